"""interlace: distributed Mixture-of-Experts layers that overlap communication with compute."""

from interlace.config import PRESETS, MoEConfig, preset
from interlace.layer import MoELayer
from interlace.data_parallel import DataParallelOptions, expert_parameters, parallelize, set_aux_loss_scale
from interlace.reference import reference_moe
from interlace.quantize import quantize_experts
from interlace.strategies import STRATEGIES
from interlace.kernels.interpreter_compat import patch_interpreter
from interlace.kernels.interpreter_speed import speed_up_interpreter

# Every ``import interlace.<anything>`` runs this first: Triton's CPU interpreter needs small fixes
# to run our kernels under NumPy >= 2.4 and Triton 3.9 (see interlace.kernels.interpreter_compat),
# and spends less time per op with three more (interlace.kernels.interpreter_speed).
patch_interpreter()
speed_up_interpreter()

__all__ = ["MoEConfig", "MoELayer", "PRESETS", "preset", "reference_moe", "STRATEGIES", "parallelize",
           "DataParallelOptions", "expert_parameters", "set_aux_loss_scale", "quantize_experts"]
__version__ = "0.1.0"
