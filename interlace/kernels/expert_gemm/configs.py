"""Which config each expert GEMM kernel runs: the tuning tables' choice, the defaults where no
table covers the device, and what a caller forces through :class:`ExpertKernelOptions`.

Five kernels choose a :class:`~interlace.tuning.tables.GemmConfig` per call: GEMM0 (gate/up
projection with the activation; ``expert_gemm0``, or ``expert_gemm0_train`` in a training
forward, which also stores the pre-activation), GEMM1 (down projection), and in the backward
the d(pre-activation) GEMM, the dx GEMM and the weight gradients. Choices are memoized per
(device, weight shape, activation, rows bucket, options, tables' generation): the expert block
chooses on every call and a lookup scores every table entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from interlace.tuning.tables import GemmConfig, ShapeClass, lookup, rows_bucket
from interlace.tuning.tables import generation as tuning_generation


@dataclass(frozen=True)
class ExpertKernelOptions:
    """What the Triton expert kernels run, where a caller wants other than the tables' choice.

    Pass it as ``MoELayer(..., strategy="sequential:triton", strategy_options={"kernels":
    ExpertKernelOptions(...)})``, or to :func:`~interlace.kernels.expert_gemm.forward.expert_ffn_triton`
    and the functions below as ``options=``. ``None`` (every default) means: the tuning tables'
    config for this device and shape, and TMA where the device has it.

    Attributes:
        gemm0: GEMM0's config (gate/up projection, activation in its epilogue), in inference and
            training forwards alike.
        gemm1: GEMM1's config (down projection).
        bwd_act: the backward's d(pre-activation) GEMM (``dy @ W_down`` through the activation's
            derivative). Given here, a flat-loop config (``persistent = 2``) with the derivative
            in the epilogue is an error; from a table it runs the nested loop instead.
        bwd_dx: the backward's dx GEMM (``d_h @ W_up``).
        wgrad: the weight-gradient kernel (dW_up and dW_down).
        tma: True: weights (and, as configs say, rows and outputs) through TMA descriptors
            wherever the tensors allow it, even under the Triton interpreter (tests run the
            Hopper path on the CPU so); False: never; None: on devices of compute capability 9+.
    """

    gemm0: GemmConfig | None = None
    gemm1: GemmConfig | None = None
    bwd_act: GemmConfig | None = None
    bwd_dx: GemmConfig | None = None
    wgrad: GemmConfig | None = None
    tma: bool | None = None

    def __post_init__(self):
        for name in ("gemm0", "gemm1", "bwd_act", "bwd_dx", "wgrad"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, GemmConfig):
                raise TypeError(f"ExpertKernelOptions.{name} must be a GemmConfig or None, got {type(value).__name__}")
        if not (self.tma is None or isinstance(self.tma, bool)):
            raise TypeError(f"ExpertKernelOptions.tma must be True, False or None, got {self.tma!r}")


DEFAULT_OPTIONS = ExpertKernelOptions()

# Defaults where no tuning table covers the device (lookup warns once): chosen from a handful
# tried on an H100 (docs/benchmarks.md); 5 stages of GEMM0 failed there.
GEMM0_DEFAULT = GemmConfig(128, 128, 64, 8, 4)
GEMM1_DEFAULT = GemmConfig(128, 256, 64, 8, 3)
# Backward: the d(pre-activation) GEMM (its epilogue reads both halves of h), the dx GEMM, the
# per-expert weight-gradient kernel. Untuned guesses until a table covers the device.
BWD_ACT_DEFAULT = GemmConfig(128, 128, 64, 8, 4)
BWD_DX_DEFAULT = GemmConfig(128, 256, 64, 8, 4)
WGRAD_DEFAULT = GemmConfig(128, 128, 64, 8, 4)
INTERPRETER_CONFIG = GemmConfig(16, 16, 16, 4, 1)
PROGRAMS_PER_SM = 1

# (tuning table, ExpertKernelOptions field, default config) per kernel.
FORWARD_KERNELS = (("expert_gemm0", "gemm0", GEMM0_DEFAULT), ("expert_gemm1", "gemm1", GEMM1_DEFAULT))
# GEMM0 in a training forward, which also stores the pre-activation h: the flat loop then runs at
# most 3 stages with masked h stores, so its best config can differ from the inference forward's.
# Where a device has no such table (nor a kin's), the inference table's config serves.
TRAIN_GEMM0_KERNEL = (("expert_gemm0_train", "gemm0", GEMM0_DEFAULT),)
TRAIN_FORWARD_KERNELS = TRAIN_GEMM0_KERNEL + FORWARD_KERNELS[1:]
FALLBACK_TABLES = {"expert_gemm0_train": "expert_gemm0"}
BACKWARD_KERNELS = (("expert_bwd_act", "bwd_act", BWD_ACT_DEFAULT),
                    ("expert_bwd_dx", "bwd_dx", BWD_DX_DEFAULT),
                    ("expert_wgrad", "wgrad", WGRAD_DEFAULT))


def check_config(config: GemmConfig) -> None:
    """Config combinations the GEMM kernels refuse (raised before any launch)."""
    if config.persistent not in (0, 2):
        raise ValueError(f"GEMM config {config}: persistent must be 0 (a loop per work item) or 2 (one flat loop)")
    if config.persistent and not config.a_tma:
        raise ValueError(f"GEMM config {config}: persistent = {config.persistent} reads rows through TMA descriptors "
                         "and needs a_tma = 1")


@lru_cache(maxsize=None)
def device_identity(index: int) -> tuple[str, int, tuple[int, int]]:
    """(name, SM count, compute capability): what the tuning tables are keyed and borrowed by."""
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count, (props.major, props.minor)


def num_programs(device: torch.device, work_bound: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Programs of a persistent grid: at most ``work_bound``, and ``per_sm`` per SM of the
    device (read from it, never assumed); 4 under the interpreter."""
    if device.type != "cuda":
        return max(1, min(work_bound, 4))
    sms = device_identity(device.index if device.index is not None else torch.cuda.current_device())[1]
    return max(1, min(work_bound, sms * per_sm))


_CHOICES: dict[tuple, tuple[tuple[GemmConfig, ...], str]] = {}


def _choose(kernels, x: torch.Tensor, w_down: torch.Tensor, num_rows: int, activation: str,
            options: ExpertKernelOptions):
    """Configs of ``kernels`` ((table name, options field, default) each) for this call's shape,
    and where they came from: the options, the tuning table, or the warned default."""
    forced = tuple(getattr(options, field) for _, field, _ in kernels)
    if not x.is_cuda:
        return [f or INTERPRETER_CONFIG for f in forced], "interpreter"
    E, N, K = w_down.shape
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    per_expert = num_rows / max(E, 1)
    memo = (kernels, index, E, N, K, activation, rows_bucket(per_expert), options, tuning_generation())
    hit = _CHOICES.get(memo)
    if hit is not None:
        return hit
    name, sms, capability = device_identity(index)
    shape = ShapeClass(N, K, E, activation)
    configs, sources = [], []
    for (table, _, default), f in zip(kernels, forced):
        c, src = (f, "options") if f else lookup(table, name, sms, shape, per_expert, default, capability,
                                                 FALLBACK_TABLES.get(table))
        configs.append(c)
        sources.append(f"{table.removeprefix('expert_')} {src}")
    if len(_CHOICES) > 1024:
        _CHOICES.clear()
    _CHOICES[memo] = tuple(configs), "; ".join(sources)
    return _CHOICES[memo]


def choose_configs(x: torch.Tensor, w_down: torch.Tensor, num_rows: int, activation: str, store_h: bool = False,
                   options: ExpertKernelOptions | None = None):
    """(GEMM0 config, GEMM1 config, where they came from) for this call's shape.

    ``store_h`` (a training forward): GEMM0 from the ``expert_gemm0_train`` table, which the tuner
    times storing h, as that forward runs it (the flat joint loop can win alone without h and lose
    storing it). Where this device has no such table (nor a kin's), the inference table's config
    serves (source ``gemm0_train from expert_gemm0, …``)."""
    (c0, c1), source = _choose(TRAIN_FORWARD_KERNELS if store_h else FORWARD_KERNELS, x, w_down, num_rows,
                               activation, options or DEFAULT_OPTIONS)
    return c0, c1, source


def choose_backward_configs(dy: torch.Tensor, w_down: torch.Tensor, num_rows: int, activation: str,
                            options: ExpertKernelOptions | None = None):
    """(d(pre-activation) GEMM, dx GEMM, weight-gradient kernel) configs and their source.

    The flat loop (``persistent = 2``) has the plain epilogue only. A d(act) config from a table
    that has it, where this layer computes the derivative in the epilogue (GELU and ReLU, or
    SwiGLU without ``unfused_act``), runs the nested kernel instead: the tables' entries are
    measured on SwiGLU shapes and other activations borrow the nearest one (as ``joint`` applies
    to SwiGLU only). The same config given in ``options.bwd_act`` stays an error."""
    options = options or DEFAULT_OPTIONS
    (ca, cd, cw), source = _choose(BACKWARD_KERNELS, dy, w_down, num_rows, activation, options)
    if ca.persistent == 2 and not (ca.unfused_act and activation == "swiglu") and options.bwd_act is None:
        ca = replace(ca, persistent=0)
    return ca, cd, cw, source
