"""The ``fused`` strategy (COMET): options, the per-rank engine, inference and training paths.

Modules, each importing only those before it: :mod:`.options` → :mod:`.engine` →
:mod:`.train` → :mod:`.inference` (the registered strategy).
"""

from interlace.strategies.fused.options import FusedKernelConfig, FusedOptions
from interlace.strategies.fused.inference import FusedStrategy

__all__ = ["FusedKernelConfig", "FusedOptions", "FusedStrategy"]
