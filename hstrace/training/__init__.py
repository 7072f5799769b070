"""Training-data readers: speculators v0.5+, speculators v0.2-v0.4 and SpecForge offline dumps,
auto-detected, read lazily and safely (`weights_only=True`). See docs/internal-api.md."""

from hstrace.training.conventions import BEFORE_LAYER, OUTPUT_OF_LAYER, hf_index
from hstrace.training.detect import open_training, training_d2t
from hstrace.training.sample import TrainingData, TrainingSample

__all__ = [
    "BEFORE_LAYER",
    "OUTPUT_OF_LAYER",
    "TrainingData",
    "TrainingSample",
    "hf_index",
    "open_training",
    "training_d2t",
]
