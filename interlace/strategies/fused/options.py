"""The ``fused`` strategy's options: :class:`FusedOptions` (what ``strategy_options`` holds) and
:class:`FusedKernelConfig` (the two fused kernels' tile sizes and compile-time switches).

    MoELayer(cfg, strategy="fused", strategy_options={"max_tokens": 8192, "kernel": {"block_n1": 128}})
    MoELayer(cfg, strategy="fused", strategy_options={"options": FusedOptions(n_comm=16)})

Every option is checked when the strategy is built, before any kernel is compiled: a wrong
value names its field, an unknown field names the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from interlace.strategies.base import check_names
from interlace.tuning.tables import GemmConfig

# interleave0 = -1: the interleaved layer0 order where owners receive at most this many rows per
# local expert (see FusedKernelConfig.interleave0).
AUTO_INTERLEAVE0_MAX_ROWS = 1024

TRAIN_PATHS = ("sequential", "recompute", "fused", "lean")  # what a call that builds an autograd graph runs
DEFAULT_SPINS = 1 << 26  # ~seconds of polling: far beyond any healthy wait, short of a hang


@dataclass(frozen=True)
class FusedKernelConfig:
    """Tile sizes and switches of the two fused kernels (:mod:`interlace.kernels.comet.layer0`,
    :mod:`interlace.kernels.comet.layer1`). Switches are 0/1 (-1: decided per layer)."""

    block_m: int = 128  # row tile of both layers (= the unit of layer0 readiness)
    block_n: int = 128  # layer0 GEMM column block (over K)
    block_n1: int = 256  # layer1 N-slice (= the unit of layer1 readiness); wider: fewer h re-reads
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4
    copy_rows: int = 16  # rows per load/store step of a communication program
    copy_cols: int = 512
    block_t: int = 32  # tokens per combine task
    group_m: int = 8  # row tiles sharing a weight block in L2 (both layers)
    slice_group: int = 4  # layer1: N-slices per group (1: COMET's column-wise order; 0: all)
    # A rows through a TMA descriptor (Hopper+; ignored where TMA is off): layer0's remote tiles
    # (a_tma0; local rows are gathered, and Hopper has no TMA gather) and layer1's h rows (a_tma1).
    a_tma0: int = 1
    a_tma1: int = 1
    # layer1: count a finished tile (a system-scope release that waits for its peer stores to land)
    # after the next tile's main loop, so the stores drain under it instead of stalling the program.
    defer_count: int = 1
    # layer0 with SwiGLU and TMA weights: a tile's gate and up rows as one 3-D TMA block and one
    # BLOCK_M × 2·block_n dot, as the expert kernels' ``joint`` (interlace.kernels.expert_gemm.tile).
    # gather0: this rank's own rows are first gathered (one copy kernel) into its own region of
    # recv, which no peer writes, so the local tiles read contiguous rows through TMA like the
    # remote ones instead of a pointer gather (Hopper has no TMA gather; needs a_tma0).
    # -1 (auto) turns each on where the hidden size is at least AUTO_GATHER0_MIN_HIDDEN
    # (interlace.kernels.comet.layer0 says why); 0 / 1 force it.
    joint0: int = -1
    gather0: int = -1
    # layer0's receive order (interlace.kernels.comet.plan, "interleaved order"): the first 1/k of the
    # experts run their local rows alone, then every later expert's local and first remote
    # source's rows back to back, so their weights are read once per layer0 instead of twice.
    # k ≥ 1: always; 0: local rows first (every expert's weights read twice); -1 (auto): k = 8
    # where an owner receives at most AUTO_INTERLEAVE0_MAX_ROWS rows per local expert in the call
    # (decided on the device from the counts; the measured threshold is in docs/performance.md).
    interleave0: int = -1
    # Weights (and the A rows above) through TMA descriptors: None by the device's capability
    # (Hopper or newer), True forces it wherever the tensors allow (the interpreter included:
    # tests), False never.
    tma: bool | None = None

    def interleave0_args(self) -> tuple[int, int]:
        """(k, max_rows) of the plan's interleaved order (:attr:`interleave0`)."""
        if self.interleave0 < 0:
            return 8, AUTO_INTERLEAVE0_MAX_ROWS
        return self.interleave0, 2**31 - 1

    def __post_init__(self):
        """Refuse a config the kernels cannot compile or would run wrongly, naming the field (the
        compiler's own errors for these come late and name none)."""
        pow2 = ("block_m", "block_n", "block_n1", "block_k", "num_warps", "copy_rows", "copy_cols", "block_t")
        for name in pow2:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"fused kernel config: {name} must be a power of two ≥ 1, got {v!r}")
        if not isinstance(self.interleave0, int) or self.interleave0 < -1:
            raise ValueError(f"fused kernel config: interleave0 is -1 (auto), 0 (local rows first) or k ≥ 1, got "
                             f"{self.interleave0!r}")
        if self.num_stages < 1 or self.group_m < 1 or self.slice_group < 0:
            raise ValueError(f"fused kernel config: num_stages and group_m must be ≥ 1 and slice_group ≥ 0, got "
                             f"{self.num_stages}, {self.group_m}, {self.slice_group}")
        for name in ("a_tma0", "a_tma1", "defer_count"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"fused kernel config: {name} is a switch (0 or 1), got {getattr(self, name)!r}")
        for name in ("joint0", "gather0"):
            if getattr(self, name) not in (-1, 0, 1):
                raise ValueError(f"fused kernel config: {name} is -1 (auto), 0 or 1, got {getattr(self, name)!r}")
        if self.tma not in (None, True, False):
            raise ValueError(f"fused kernel config: tma is None (by capability), True or False, got {self.tma!r}")


GPU_CONFIG = FusedKernelConfig()
# Under the interpreter each op costs the same whatever its size: wide blocks, few programs.
INTERPRETER_CONFIG = FusedKernelConfig(16, 32, 32, 32, 4, 1, 16, 64, 16, group_m=2, slice_group=1)


def kernel_config(base: FusedKernelConfig, overrides: FusedKernelConfig | dict | None) -> FusedKernelConfig:
    """The kernel config of a call: ``overrides`` as given (a :class:`FusedKernelConfig`), or
    ``base`` (the device's default) with the fields of a dict replaced."""
    if overrides is None:
        return base
    if isinstance(overrides, FusedKernelConfig):
        return overrides
    _check_names(overrides, FusedKernelConfig, "fused kernel config ('kernel' option)")
    return replace(base, **overrides)


def _check_names(given: dict, cls, what: str) -> None:
    check_names(given, [f.name for f in fields(cls)], what, noun="field")


@dataclass(frozen=True)
class FusedOptions:
    """Options of the ``fused`` strategy (``strategy_options`` of :class:`interlace.MoELayer`).

    ``"fused:eager"`` sets ``cuda_graph=False``; ``"fused:train"`` / ``"fused:lean"`` /
    ``"fused:recompute"`` set ``train_path``.
    """

    # Tokens per rank the peer buffers are sized for; None: the first call's largest T over the
    # ranks (that first call's all-reduce is the one host sync this strategy makes).
    max_tokens: int | None = None
    # Communication programs of layer0 / combine programs of layer1: an int, or "auto" for the
    # tuned split (interlace.tuning.fused_split, measured by ``interlace tune``).
    n_comm: int | str = "auto"
    n_comm1: int | str = "auto"
    max_spins: int = DEFAULT_SPINS  # bound of every wait; a timed-out wait raises a named error
    transport: str = "auto"  # "auto", "symmetric" (CUDA symmetric memory) or "staged" (collectives)
    symm_backend: str | None = None  # symmetric memory backend: None (torch's default), "CUDA", "NVSHMEM"
    # Record every work item's start/wait/end (FusedStrategy.timeline_records); off: compiled out.
    timeline: bool = False
    # What a call that builds an autograd graph runs: "sequential" (the sequential strategy's
    # forward and backward), "fused" (the fused kernels both ways, rows kept at capacity size,
    # CUDA graphs), "lean" (the fused kernels both ways, the rows received kept, CUDA graphs, one
    # host sync per call) or "recompute" (the fused kernels forward, a recompute through
    # sequential in the backward).
    train_path: str = "sequential"
    cuda_graph: bool = True  # replay a captured CUDA graph per token count (symmetric transport)
    # The kernels' tile sizes and switches: None for the device's default (GPU_CONFIG, or
    # INTERPRETER_CONFIG under the interpreter), a dict of FusedKernelConfig fields that replace
    # the default's, or a whole FusedKernelConfig.
    kernel: FusedKernelConfig | dict | None = None
    # fused:train's weight-gradient kernel config; None: from the expert kernels' tuning tables.
    wgrad: GemmConfig | None = None
    # Weights through TMA (both fused kernels and fused:train's weight gradients): None by the
    # device's capability, True forces it where the tensors allow, False never. Overrides the
    # kernel config's ``tma`` where set.
    tma: bool | None = None

    def __post_init__(self):
        if self.train_path not in TRAIN_PATHS:
            raise ValueError(f"train_path must be one of {TRAIN_PATHS}, got {self.train_path!r}")
        if self.transport not in ("auto", "symmetric", "staged"):
            raise ValueError(f"transport must be 'auto', 'symmetric' or 'staged', got {self.transport!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        for name in ("n_comm", "n_comm1"):
            v = getattr(self, name)
            if v != "auto" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or 'auto', got {v!r}")
        if isinstance(self.kernel, dict):
            kernel_config(GPU_CONFIG, self.kernel)  # names a wrong field now, not at the first call
        elif self.kernel is not None and not isinstance(self.kernel, FusedKernelConfig):
            raise TypeError(f"kernel must be a FusedKernelConfig, a dict of its fields or None, got "
                            f"{type(self.kernel).__name__}")
        if self.tma not in (None, True, False):
            raise ValueError(f"tma is None (by capability), True or False, got {self.tma!r}")

    @classmethod
    def build(cls, options: "FusedOptions | dict | None" = None, **given) -> "FusedOptions":
        """Options from a :class:`FusedOptions` or a dict of its fields, with ``given`` fields
        replacing them; an unknown field raises ``ValueError`` naming the valid ones."""
        if isinstance(options, dict):
            given = {**options, **given}
            options = None
        elif options is not None and not isinstance(options, cls):
            raise TypeError(f"fused options must be a FusedOptions or a dict, got {type(options).__name__}")
        _check_names(given, cls, "fused strategy options")
        return replace(options, **given) if options is not None else cls(**given)

    def kernel_for(self, base: FusedKernelConfig) -> FusedKernelConfig:
        """The kernel config to run with on a device whose default is ``base``."""
        config = kernel_config(base, self.kernel)
        return config if self.tma is None else replace(config, tma=self.tma)


__all__ = ["FusedOptions", "FusedKernelConfig", "GPU_CONFIG", "INTERPRETER_CONFIG", "TRAIN_PATHS", "DEFAULT_SPINS",
           "AUTO_INTERLEAVE0_MAX_ROWS", "kernel_config"]
