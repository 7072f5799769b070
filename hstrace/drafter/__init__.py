"""The reference EAGLE-3 drafter: config, model, checkpoint dialects (see docs/internal-api.md)."""

from hstrace.drafter.config import DrafterConfig
from hstrace.drafter.model import DraftCache, DraftOutput, Eagle3Drafter

__all__ = ["DraftCache", "DraftOutput", "DrafterConfig", "Eagle3Drafter"]
