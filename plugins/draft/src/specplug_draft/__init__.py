"""specplug-draft: classic speculative decoding with a separate draft model (`type: draft`)."""
from specplug_draft.draft import DraftModel

__all__ = ["DraftModel"]
