"""interlace: distributed Mixture-of-Experts layers that overlap communication with compute."""

from interlace.config import PRESETS, MoEConfig, preset
from interlace.layer import MoELayer
from interlace.reference import reference_moe
from interlace.strategies import STRATEGIES

__all__ = ["MoEConfig", "MoELayer", "PRESETS", "preset", "reference_moe", "STRATEGIES"]
__version__ = "0.1.0"
