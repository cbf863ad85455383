"""Launcher of the persistent MoE kernel: tile choice, workspace, grid sizing, error records.

:func:`persistent_moe` runs one layer call (world size 1) in one launch:
x (T, N), router weight (E, N) fp32, optional selection bias (E,) fp32, w_up (E, up_width, N),
w_down (E, N, K) → out (T, N) in x's dtype. No host sync: the launch is sized from T alone
(:class:`~interlace.kernels.persistent.tasks.TaskLayout`). The counters and the epoch live in a
:class:`PersistentState` that the caller keeps across calls (nothing is reset between calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interlace.kernels import alloc
from interlace.kernels.expert_gemm.tile import ACTIVATION_ID
from interlace.kernels.launch import direct_launcher, launch, next_power_of_2
from interlace.kernels.launch import hooked as launch_hooked
from interlace.kernels.persistent.kernel import persistent_moe_kernel
from interlace.kernels.persistent.tasks import (
    EPOCH, ERROR_WORDS, STATE_WORDS, TASK_ORDERS, TIMELINE_KINDS, TaskLayout, describe_error,
)
from interlace.kernels.rows import _INTERPRET
from interlace.kernels.tma import ensure_allocator, use_tma
from interlace.kernels.timeline import TimelineBuffer

DEFAULT_SPINS = 1 << 22  # polls of one wait before it gives up (seconds on a GPU; never reached when correct)


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
    """Pipeline stages of the wide tiles: up to 64-row tiles 5 (4 buffers of 40 KB; measured 3-4%
    faster than 4 on 2×H200 at 32-48 rows per expert), 128-row tiles 4 (3 buffers of 48 KB: 3-7%
    faster than 3 at 64-256 rows; 5 would need 245 KB of shared memory, more than an SM has)."""
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

    Why two tile families. Narrow (4 warps, two programs per SM, 16–128-row tiles 64 columns
    wide): at a few rows per expert the call is a stream of weights, and small tiles keep every SM
    streaming. From about 32 rows per expert the narrow tiles' operand traffic binds instead: an
    ncu profile (one H200, the world-1 kernel at one rank's share of qwen3-30b-a3b and
    mixtral-8x7b at 512 tokens per GPU) showed DRAM at 30–40% of its peak, tensor pipes at
    23–47%, L2 at 57–81% (each 64-column task re-reads its 128 rows of A) and 0.2–0.3 eligible
    warps per scheduler. Wide tiles (a 128 × 256 SwiGLU dot, 64-wide reduction steps, TMA weight
    boxes) measured on 2×H200, back to back: mixtral-8x7b 1.35 → 1.00 ms at 512 tokens per GPU
    and 0.61 → 0.45 at 128; phi3.5-moe 0.72 → 0.59 at 512, 0.50 → 0.39 at 128; dsv3-like 4.51 →
    3.39 at 512; 3–10% on qwen2-moe, qwen3-30b-a3b and flashdmoe-cfg at 512; and 4–16% slower
    than narrow at 8–16 rows per expert (qwen3-30b-a3b 32 and 128, qwen2-moe 128,
    flashdmoe-cfg 128, dsv3-like 128).

    The target is decode: up to a few hundred rows per expert. At thousands (prefill) ``fused``
    is the better path, and ``auto`` keeps it there.

    The narrow tiles (the world-1 kernel's only tiles) load the weights through per-element
    pointers. With 4 warps the sm90 build uses 255 registers and spills a little; 8 warps on the
    same tiles leave one program per SM and measured 15–20% slower at decode sizes on an H100
    (20–60% at W = 2 on H200s). A decode call is a weight stream bound by the bytes each SM has
    in flight, so the loads run ``num_stages`` = 6 deep: 92–102 KB of shared memory a program
    (the W > 1 kernel's sm90 builds, the router GEMM's loop pipelined as deep), still two
    programs per SM (from 3 stages: 3–23% faster at W = 2 and 7–16% at W = 1 on H200s, most at
    the 128-row tiles of 512 tokens per GPU; 8 stages would leave one program per SM).
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
        would leave SMs idle in GEMM1; e.g. mixtral-8x7b at 128 tokens per GPU, 64 tasks)."""
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


class PersistentState:
    """The kernel's persistent device state: counters and epoch (``STATE_WORDS``), the error record
    (``ERROR_WORDS``) and per-tile GEMM0 counters, in one int32 tensor that grows (zeroed, epoch
    restarting at 0) when a call needs more tiles, and the record's host mirror
    (:func:`host_error_record`). Keep one per layer; not shared between streams."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.host_error: torch.Tensor | None = None

    def views(self, device: torch.device, max_tiles: int):
        need = STATE_WORDS + ERROR_WORDS + max_tiles
        if self.buffer is None or self.buffer.device != device or self.buffer.numel() < need:
            self.buffer = torch.zeros(max(need, 2 * (self.buffer.numel() if self.buffer is not None else 0)),
                                      dtype=torch.int32, device=device)
        if self.host_error is None:
            self.host_error = host_error_record(device)
        b = self.buffer
        return b[:STATE_WORDS], b[STATE_WORDS:STATE_WORDS + ERROR_WORDS], b[STATE_WORDS + ERROR_WORDS:]

    def error_record(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer[STATE_WORDS:STATE_WORDS + ERROR_WORDS]

    def check(self) -> None:
        """Raise ``RuntimeError`` if a wait of an earlier call timed out (reads the record: a host
        sync), and clear the record and its mirror."""
        record = self.error_record()
        if record is None:
            return
        message = describe_error(record.tolist())
        if message:
            record.zero_()
            self.host_error.zero_()
            raise RuntimeError(message)


_OCCUPANCY: dict = {}  # (device index, kernel key) → programs per SM, from the compiled kernel


def _programs_per_sm(compiled, device: torch.device, num_warps: int) -> int:
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


class CallPlan:
    """Everything of one call shape that is the same from call to call: the tile choice, the
    :class:`TaskLayout`, the grid, the workspace tensors, the state's views and the kernel's
    arguments but x and out; after its first launch, the compiled kernel's own launcher
    (:func:`interlace.kernels.launch.direct_launcher`), so that a repeated call costs one
    allocation (out) and one launch of host work.

    A plan is valid for x of its ``T``, dtype and device with the weights it was built with
    (:meth:`matches`) and while ``state`` keeps the buffer it was built on (the state grows it
    for a call with more tiles). Calls of one plan share its workspace: they run in stream order
    on one stream (as the state requires anyway).
    """

    def __init__(self, x: torch.Tensor, router_weight: torch.Tensor, expert_bias: torch.Tensor | None,
                 w_up: torch.Tensor, w_down: torch.Tensor, state: PersistentState, *, top_k: int, softmax: bool,
                 renormalize: bool, route_scale: float, activation: str, w_pieces: int,
                 config: PersistentKernelConfig, max_spins: int, order: str, timeline: int = 0,
                 round_logits: int = 0, capacity: int | None = None):
        """``capacity``: each expert's capacity in this call (``MoEConfig.capacity(T)``: the
        assignments served slot-major, the rest dropped); None: dropless."""
        if order not in TASK_ORDERS:
            raise ValueError(f"order must be one of {TASK_ORDERS}, got {order!r}")
        for name, t in (("router_weight", router_weight), ("w_up", w_up), ("w_down", w_down)):
            if not t.is_contiguous():
                raise ValueError(f"persistent: {name} must be contiguous")
        T, N = x.shape
        E, up_width, _ = w_up.shape
        K = w_down.shape[2]
        self.T, self.N, self.dtype, self.device = T, N, x.dtype, x.device
        self.weights = (router_weight, expert_bias, w_up, w_down)
        self.weight_ptrs = weight_ptrs(router_weight, expert_bias, w_up, w_down)
        self.config = c = config
        self.block_m = block_m = c.rows_per_tile(T, top_k, E)
        block_k0, block_n0, block_n1, block_k1 = c.tiles(block_m)
        self.layout = layout = TaskLayout.build(T, N, K, E, top_k, c.block_t or GATE_TOKENS, block_m, block_k0,
                                                block_n1, c.block_tc, c.block_nc)
        e_pad = max(16, next_power_of_2(E))
        TK = T * top_k
        n_hist = layout.n_gate * e_pad * (top_k if capacity is not None else 1)
        # One int32 workspace: idx, weights (as fp32), ranks, row_of, asg_of (T·k each), hist and
        # base (n_gate·E_PAD each, ·k with a capacity), offsets (E_PAD), the tile table (3·max_tiles).
        ints = alloc.empty((5 * TK + 2 * n_hist + e_pad + 3 * layout.max_tiles,), dtype=torch.int32,
                           device=x.device)
        idx, wt, lrank, row_of, asg_of = (ints[i * TK:(i + 1) * TK] for i in range(5))
        wt = wt.view(torch.float32)
        rest = ints[5 * TK:]
        hist, base, offs, tiles = (rest[:n_hist], rest[n_hist:2 * n_hist], rest[2 * n_hist:2 * n_hist + e_pad],
                                   rest[2 * n_hist + e_pad:])
        h = alloc.empty((TK, K), dtype=x.dtype, device=x.device)
        y = alloc.empty((TK, N), dtype=x.dtype, device=x.device)
        self.state = state
        st, err, gemm0_done = state.views(x.device, layout.max_tiles)
        self.state_buffer = state.buffer
        self.workspace = dict(idx=idx, weight=wt, row_of_assignment=row_of, assignment_of_row=asg_of, tiles=tiles,
                              state=st, block_m=block_m, layout=layout)
        self._occupancy_key = (x.device.index, block_m, e_pad, top_k, activation, x.dtype, c, timeline, round_logits,
                               capacity is not None)
        self.round_logits = round_logits
        self.programs = self._programs()
        self.constexprs = dict(
            TOP_K=top_k, E_PAD=e_pad, BLOCK_T=c.block_t or GATE_TOKENS, BLOCK_G=c.block_g or 32,
            BLOCK_A=128, BLOCK_J=max(16, min(64, 2048 // e_pad)), BLOCK_M=block_m, BLOCK_K0=block_k0,
            BLOCK_N0=block_n0, BLOCK_N1=block_n1, BLOCK_K1=block_k1, BLOCK_TC=c.block_tc, BLOCK_NC=c.block_nc,
            SOFTMAX=softmax, HAS_BIAS=expert_bias is not None, RENORMALIZE=renormalize,
            ACTIVATION=ACTIVATION_ID[activation], W_PIECES=w_pieces, DOT_FP32=_INTERPRET,
            ORDER=TASK_ORDERS.index(order), TIMELINE=timeline, ROUND_LOGITS=round_logits,
            CAPACITY=capacity is not None,
        )
        # The arguments between x and out, and after out (the last one, the grid, set per launch).
        self._weights_args = (router_weight, expert_bias if expert_bias is not None else router_weight, w_up,
                              w_down)
        self._rest_args = (idx, wt, lrank, row_of, asg_of, hist, base, offs, tiles, h, y, st, err, gemm0_done,
                           state.host_error,
                           T, N, K, E, up_width, float(route_scale), int(max_spins))
        self.timeline = timeline_buffer(x.device, timeline, layout.total)
        self._layout_args = (layout.n_gate, layout.max_tiles, layout.n_k0, layout.n_n1, layout.n_comb_t,
                             layout.n_comb_n, capacity or 0, *timeline_args(self.timeline))
        self._direct = None

    def _programs(self) -> int:
        c = self.config
        if c.programs is not None:
            programs = c.programs
        elif _INTERPRET or self.device.type != "cuda":
            programs = 3
        else:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            programs = sms * _OCCUPANCY.get(self._occupancy_key, 1)
        return max(1, min(programs, self.layout.total))

    def timeline_records(self) -> list[dict]:
        """The last call's task records (``timeline`` on; a host sync): see
        :meth:`TimelineBuffer.task_records`, kinds :data:`~tasks.TIMELINE_KINDS`."""
        return self.timeline.task_records(int(self.state_buffer[EPOCH]), TIMELINE_KINDS)

    def matches(self, x: torch.Tensor, router_weight, expert_bias, w_up, w_down) -> bool:
        """Whether this plan runs ``x`` with these weights (same T, dtype, device, weight
        addresses, and the state's buffer unchanged)."""
        return (x.shape[0] == self.T and x.dtype == self.dtype and x.device == self.device
                and self.state.buffer is self.state_buffer
                and weight_ptrs(router_weight, expert_bias, w_up, w_down) == self.weight_ptrs)

    def kernel_args(self, x: torch.Tensor, out: torch.Tensor) -> tuple:
        """The kernel's positional arguments for x and out (the grid: ``self.programs``)."""
        return (x, *self._weights_args, out, *self._rest_args, self.programs, *self._layout_args)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """out (T, N) in x's dtype for x (T, N) contiguous, with the plan's weights."""
        out = alloc.empty((self.T, self.N), dtype=self.dtype, device=self.device)
        if self.T == 0:
            return out
        direct = self._direct
        if direct is not None and x.data_ptr() % 16 == 0 and not launch_hooked():
            direct(self.programs, *self.kernel_args(x, out))
            return out
        args = self.kernel_args(x, out)
        kwargs = dict(num_warps=self.config.num_warps, num_stages=self.config.num_stages, **self.constexprs)
        compiled = launch(persistent_moe_kernel, (self.programs,), *args, **kwargs)
        if self.device.type == "cuda" and not _INTERPRET:
            key = self._occupancy_key
            if self.config.programs is None and key not in _OCCUPANCY:
                _OCCUPANCY[key] = _programs_per_sm(compiled, self.device, self.config.num_warps)
                programs = self._programs()
                if programs != self.programs:  # (the next launch: the grid is an argument too)
                    self.programs = programs
                    return out
            if x.data_ptr() % 16 == 0:
                self._direct = direct_launcher(persistent_moe_kernel, args, kwargs)
        return out


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


def weight_ptrs(router_weight, expert_bias, w_up, w_down) -> tuple:
    """The weights' addresses: what a plan (and a CUDA graph of it) holds."""
    return (router_weight.data_ptr(), 0 if expert_bias is None else expert_bias.data_ptr(), w_up.data_ptr(),
            w_down.data_ptr())


def persistent_moe(x: torch.Tensor, router_weight: torch.Tensor, expert_bias: torch.Tensor | None,
                   w_up: torch.Tensor, w_down: torch.Tensor, state: PersistentState, *, top_k: int, softmax: bool,
                   renormalize: bool, route_scale: float, activation: str, w_pieces: int,
                   config: PersistentKernelConfig = PersistentKernelConfig(), max_spins: int = DEFAULT_SPINS,
                   order: str = "normal", workspace: dict | None = None, round_logits: int = 0) -> torch.Tensor:
    """One MoE layer call (world size 1) in one launch; see the module. (A caller that repeats
    a shape keeps a :class:`CallPlan` instead: this builds one per call.)

    Args:
        x: (T, N) tokens, bf16/fp16/fp32.
        router_weight: (E, N) fp32; expert_bias: (E,) fp32 selection bias, or None.
        w_up: (E, up_width, N) (SwiGLU: gate rows first); w_down: (E, N, K); x's dtype.
        state: the caller's :class:`PersistentState` (counters and epoch, kept across calls).
        top_k, softmax, renormalize, route_scale: the routing (:class:`interlace.config.MoEConfig`).
        activation: ``"swiglu"``, ``"gelu"`` or ``"relu"``; w_pieces: :func:`router_pieces`.
        order: ``"normal"``; ``"combine_first"`` (tests) breaks the task order on purpose.
        workspace: if a dict, filled with the intermediate tensors (tests read the routing and
            the index from it).
        round_logits: 1 / 2: the router logits rounded to bf16 / fp16 before the choice (a
            router whose logits GEMM runs in that dtype; ``strategies.persistent.logits_rounding``).
    Returns:
        (T, N) in x's dtype. A timed-out wait leaves an error record in ``state`` (see
        :meth:`PersistentState.check`); nothing here reads it.
    """
    if order not in TASK_ORDERS:
        raise ValueError(f"order must be one of {TASK_ORDERS}, got {order!r}")
    x, router_weight, w_up, w_down = (t.contiguous() for t in (x, router_weight, w_up, w_down))
    if x.shape[0] == 0:
        return alloc.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    plan = CallPlan(x, router_weight, expert_bias, w_up, w_down, state, top_k=top_k, softmax=softmax,
                    renormalize=renormalize, route_scale=route_scale, activation=activation, w_pieces=w_pieces,
                    config=config, max_spins=max_spins, order=order, round_logits=round_logits)
    out = plan.run(x)
    if workspace is not None:
        workspace.update(plan.workspace, programs=plan.programs)
    return out
