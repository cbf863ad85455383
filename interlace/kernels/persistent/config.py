"""Host-side configuration of the persistent kernels of both world sizes: the tile choices
(:class:`PersistentKernelConfig` and its tables), and the helpers both launchers use: the
error record's host mirror, the grid's programs per SM, the router GEMM's pieces, the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interlace.kernels.persistent.protocol import ERROR_WORDS
from interlace.kernels.rows import _INTERPRET
from interlace.kernels.timeline import TimelineBuffer
from interlace.kernels.tma import ensure_allocator, use_tma

ROW_TILES = (16, 32, 64, 128)  # BLOCK_M choices, by the expected rows of the busiest expert
# (block_k0, block_n0, block_n1, block_k1) per BLOCK_M: larger M takes narrower reduction steps,
# keeping 64-wide output slices (tests/kernels/test_persistent_kernel.py builds each for sm90 and
# bounds its registers and spills).
TILES_BY_BLOCK_M = {16: (64, 64, 64, 64), 32: (64, 64, 64, 64), 64: (64, 32, 64, 32), 128: (64, 32, 64, 32)}
# Wide tiles (W > 1, PersistentKernelConfig.wide): 8 warps, one program per SM, the expert
# weights through TMA descriptors; (block_k0, block_n0, block_n1, block_k1): a SwiGLU GEMM0 task
# is one BLOCK_M × 256 dot (gate and up rows in one load), GEMM1 slices 128 wide (256 where the
# call has the rows or the tasks for it: wide_tiles_for).
WIDE_TILES = (128, 64, 128, 64)
WIDE_WARPS = 8
GATE_TOKENS = 16  # tokens per gate task (world size 1; PersistentKernelConfig.block_t None)
WIDE_MIN_ROWS = 32  # the call's average rows per local expert from which `wide` None takes wide tiles


def wide_stages(block_m: int) -> int:
    """Pipeline stages of the wide tiles: 5 up to 64-row tiles (4 buffers of 40 KB), 4 for
    128-row tiles (3 buffers of 48 KB; 5 would need more shared memory than an SM has).
    Measured: docs/persistent.md."""
    return 5 if block_m <= 64 else 4


@dataclass(frozen=True)
class PersistentKernelConfig:
    """Tile sizes and launch options of the persistent kernel.

    block_m: rows per expert tile (None: by the call's average rows per expert ``T·k/E``, the
    smallest of :data:`ROW_TILES` that holds 1.25× that (room for an expert above the average),
    at most 128: so each touched expert's weight slice is read by one row tile, or two, not 4–16
    small ones). block_k0: GEMM0's K-slice (output columns of h per task); block_n0: its
    reduction step over N. block_n1: GEMM1's N-slice; block_k1: its reduction step over K (each
    None: :data:`TILES_BY_BLOCK_M`). block_t: tokens per gate task (None: :data:`GATE_TOKENS`); at
    W > 1, block_t × block_e: tokens × experts of a logits task (None:
    :data:`~interlace.kernels.persistent.dist_launch.LOGITS_TILE`, with wide tiles
    :data:`~interlace.kernels.persistent.dist_launch.WIDE_LOGITS_TILE`);
    block_tk (W > 1): tokens per top-k task (None: by the call,
    :func:`~interlace.kernels.persistent.dist_launch.top_k_block`); block_g: the gate's
    reduction step over N (None: 32 at world size 1, where one task takes all experts' logits;
    128 at W > 1, where a logits task takes ``block_e`` experts). logits_splits: at W > 1, the
    parts of the router GEMM's sum over N, each a logits task (None: by the call's token blocks,
    :func:`~interlace.kernels.persistent.dist_launch.logits_splits`). block_s × block_ns: tokens ×
    columns of a W > 1 send task (block_ns at most N's power of 2). block_tc × block_nc: a
    combine task; combine_slices (W > 1): block_nc column slices per combine task (None: as many as
    leave about one combine task per SM, each waiting on the owners once; 1 off the GPU). programs:
    the grid (None: what is co-resident on the device; under the interpreter 3). num_warps,
    num_stages: of the narrow tiles. wide (W > 1): the GEMM tasks on wide
    tiles (:data:`WIDE_TILES`, 8 warps, weights through TMA): None where the device has TMA, the
    weights' rows allow it and the call averages at least :data:`WIDE_MIN_ROWS` rows per local
    expert; True wherever the weights allow TMA (the interpreter included); False never. With wide
    tiles, ``num_warps`` and ``num_stages`` are :data:`WIDE_WARPS` and :func:`wide_stages`.

    Two tile families. Narrow (4 warps, two programs per SM, 16–128-row tiles 64 columns wide,
    weights through per-element pointers, loads ``num_stages`` = 6 deep): at a few rows per
    expert the call is a stream of weights bound by the bytes each SM has in flight, and small
    tiles keep every SM streaming. From about :data:`WIDE_MIN_ROWS` rows per expert the narrow
    tiles' operand traffic binds instead (each 64-column task re-reads its rows of A), and wide
    tiles (a 128 × 256 SwiGLU dot, 64-wide reduction steps, TMA weight boxes) are faster. The
    target is decode: up to a few hundred rows per expert; at thousands (prefill) ``fused`` is
    the better path, and ``auto`` keeps it there. The measurements behind these choices (warps,
    stages, tile widths) are in docs/persistent.md.
    """

    block_m: int | None = None
    block_k0: int | None = None
    block_n0: int | None = None
    block_n1: int | None = None
    block_k1: int | None = None
    block_t: int | None = None
    block_tk: int | None = None
    block_g: int | None = None
    block_e: int | None = None
    logits_splits: int | None = None
    block_s: int = 16
    block_ns: int = 256
    block_tc: int = 16
    block_nc: int = 128
    combine_slices: int | None = None
    num_warps: int = 4
    num_stages: int = 6
    programs: int | None = None
    wide: bool | None = None

    _POWERS_OF_2 = ("block_m", "block_k0", "block_n0", "block_n1", "block_k1", "block_t", "block_tk", "block_g",
                    "block_e", "block_s", "block_ns", "block_tc", "block_nc", "num_warps")
    _COUNTS = ("logits_splits", "combine_slices", "programs", "num_stages")
    _REQUIRED = ("num_warps", "num_stages")  # (the rest may be None: chosen by the call)

    def __post_init__(self):
        """Refuse, before any build or launch, a field no kernel can take: the tile sizes and
        warps are block shapes (powers of 2), the counts whole numbers ≥ 1."""
        for name in self._POWERS_OF_2 + self._COUNTS:
            v = getattr(self, name)
            if v is None and name not in self._REQUIRED:
                continue
            pow2 = name in self._POWERS_OF_2
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (pow2 and v & (v - 1)):
                what = "a power of 2 >= 1" if pow2 else "an int >= 1"
                none = "" if name in self._REQUIRED else " or None"
                raise ValueError(f"persistent: kernel {name} must be {what}{none}, got {v!r}")
        if self.wide is not None and not isinstance(self.wide, bool):
            raise ValueError(f"persistent: kernel wide must be True, False or None, got {self.wide!r}")

    def rows_per_tile(self, T: int, top_k: int, num_experts: int) -> int:
        if self.block_m is not None:
            return self.block_m
        busiest = 1.25 * T * top_k / max(num_experts, 1)
        return next((b for b in ROW_TILES if busiest <= b), ROW_TILES[-1])

    def wide_tiles(self, rows_per_expert: float, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
        """Whether a W > 1 call takes wide tiles (``wide``; see the class); installs Triton's
        allocator for the kernel's descriptors when it does."""
        if self.wide is False or (self.wide is None and rows_per_expert < WIDE_MIN_ROWS):
            return False
        wide = use_tma(w_up, w_down, force=True if self.wide else None)
        if wide:
            ensure_allocator()
        return wide

    def wide_tiles_for(self, rows_per_expert: float, gemm1_tasks_256: int, sms: int | None
                       ) -> tuple[int, int, int, int, int]:
        """(block_m, block_k0, block_n0, block_n1, block_k1) of wide tiles, the fields set or by
        the call: 64-row tiles below 64 rows per expert (else 128), and 256-wide GEMM1 slices
        from 128 rows per expert or where the call's GEMM1 tasks at that width
        (``gemm1_tasks_256``) still number two per SM (else 128: few experts of one tile each
        would leave SMs idle in GEMM1)."""
        block_m = self.block_m or (64 if rows_per_expert < 64 else 128)
        k0, n0, n1, k1 = WIDE_TILES
        if rows_per_expert >= 128 or (sms and gemm1_tasks_256 >= 2 * sms):
            n1 = 256
        return (block_m, *(d if v is None else v for v, d in zip((self.block_k0, self.block_n0, self.block_n1,
                                                                   self.block_k1), (k0, n0, n1, k1))))

    def tiles(self, block_m: int) -> tuple[int, int, int, int]:
        """(block_k0, block_n0, block_n1, block_k1) for ``block_m`` rows: the fields set, else
        :data:`TILES_BY_BLOCK_M` (the nearest entry at or above block_m)."""
        default = TILES_BY_BLOCK_M.get(block_m) or TILES_BY_BLOCK_M[
            next((b for b in ROW_TILES if block_m <= b), ROW_TILES[-1])]
        return tuple(d if v is None else v
                     for v, d in zip((self.block_k0, self.block_n0, self.block_n1, self.block_k1), default))


def host_error_record(device: torch.device) -> torch.Tensor:
    """The host mirror of a kernel's error record: ``ERROR_WORDS`` int32 that the first timed-out
    wait writes besides the device record. On CUDA, page-locked host memory, which the kernel
    stores into through unified addressing: the host reads a call's record once an event behind
    the call has completed, with no copy in the stream (nor in a captured graph). Elsewhere (the
    interpreter) a CPU tensor."""
    pinned = device.type == "cuda" and not _INTERPRET
    return torch.zeros(ERROR_WORDS, dtype=torch.int32, pin_memory=pinned)


def programs_per_sm(compiled, device: torch.device, num_warps: int) -> int:
    """Co-resident programs per SM of a compiled kernel, by registers, shared memory and threads
    (1 where Triton does not expose them)."""
    try:
        props = torch.cuda.get_device_properties(device)
        regs = int(compiled.n_regs)
        shared = int(compiled.metadata.shared)
        threads = 32 * num_warps
        limits = [props.max_threads_per_multi_processor // threads, 32]
        if regs > 0:
            limits.append(props.regs_per_multiprocessor // (regs * threads))
        if shared > 0:
            limits.append(props.shared_memory_per_multiprocessor // shared)
        return max(1, min(limits))
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return 1


def router_pieces(x_dtype: torch.dtype, router_gemm: str) -> int:
    """The gate's W_PIECES: 3 ("split", bf16 x: fp32-class logits on bf16 tensor cores), 1
    ("input", bf16 x: the weight rounded to bf16), 0 (an fp32 dot, for other dtypes or "upcast")."""
    if x_dtype == torch.bfloat16 and router_gemm in ("split", "input"):
        return 3 if router_gemm == "split" else 1
    return 0


def timeline_buffer(device: torch.device, mode: int, n_tasks: int) -> TimelineBuffer | None:
    """A record table of ``n_tasks`` slots (one per task number) for timeline ``mode`` (1 GPU
    clock, 2 logical clock; 0: None, the kernel's recording compiled out)."""
    if mode not in (0, 1, 2):
        raise ValueError(f"timeline mode must be 0, 1 or 2, got {mode!r}")
    if not mode:
        return None
    buf = TimelineBuffer(device, mode)
    buf.ensure(n_tasks, 0)
    return buf


def timeline_args(buf: TimelineBuffer | None) -> tuple:
    """The kernels' (records, clock, cap) arguments: None, None, 0 with the timeline off."""
    if buf is None:
        return None, None, 0
    records, clock, cap, _ = buf.args(0)
    return records, clock, cap
