"""The reference EAGLE-3 drafter: config, model, checkpoint dialects (see docs/internal-api.md)."""

from hstrace.drafter.checkpoint import LoadReport, load_drafter, save_drafter
from hstrace.drafter.config import DrafterConfig
from hstrace.drafter.model import DraftCache, DraftOutput, Eagle3Drafter
from hstrace.drafter.train import TTTLoss, ttt_loss

__all__ = [
    "DraftCache",
    "DraftOutput",
    "DrafterConfig",
    "Eagle3Drafter",
    "LoadReport",
    "TTTLoss",
    "load_drafter",
    "save_drafter",
    "ttt_loss",
]
