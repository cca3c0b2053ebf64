"""Where `ChainDrafter`, `ChainHead`, `Calibrator` and `pick_tokens` were first defined; they now
live in the toolkit's own modules (`chain`, `calibrate`, `pick`) and stay importable from here."""
from specplug.heads.calibrate import Calibrator
from specplug.heads.chain import ChainDrafter, ChainHead
from specplug.heads.pick import pick_tokens

__all__ = ["Calibrator", "ChainDrafter", "ChainHead", "pick_tokens"]
