"""interlace: distributed Mixture-of-Experts layers that overlap communication with compute."""

from interlace.config import PRESETS, MoEConfig, preset
from interlace.layer import MoELayer
from interlace.reference import reference_moe
from interlace.strategies import STRATEGIES
from interlace.kernels.interpreter_compat import patch_interpreter

# Every ``import interlace.<anything>`` runs this first: Triton 3.6's CPU interpreter needs a
# one-line fix to run our kernels under NumPy >= 2.4 (see interlace.kernels.interpreter_compat).
patch_interpreter()

__all__ = ["MoEConfig", "MoELayer", "PRESETS", "preset", "reference_moe", "STRATEGIES"]
__version__ = "0.1.0"
