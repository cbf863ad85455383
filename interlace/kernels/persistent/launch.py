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
from interlace.kernels.launch import cdiv, launch, next_power_of_2
from interlace.kernels.persistent.kernel import persistent_moe_kernel
from interlace.kernels.persistent.tasks import ERROR_WORDS, STATE_WORDS, TASK_ORDERS, TaskLayout, describe_error
from interlace.kernels.rows import _INTERPRET

DEFAULT_SPINS = 1 << 22  # polls of one wait before it gives up (seconds on a GPU; never reached when correct)


@dataclass(frozen=True)
class PersistentKernelConfig:
    """Tile sizes and launch options of the persistent kernel.

    block_m: rows per expert tile (None: 16 while the average rows per expert are ≤ 32, 32 up to
    64, else 64; small tiles so that at decode every SM streams a slice of a touched expert's
    weights). block_k0: GEMM0's K-slice (output columns of h per task); block_n0: its reduction
    step over N. block_n1: GEMM1's N-slice; block_k1: its reduction step over K. block_t: tokens
    per gate task; block_g: the gate's reduction step. block_tc × block_nc: a combine task.
    programs: the grid (None: what is co-resident on the device; under the interpreter 3).

    The defaults keep the sm90 build free of register spills for up to 128 experts (ptxas -v on
    the compiled kernel): the weight tiles are loaded through per-element pointers, and 128-wide
    tiles or 4 warps spill them.
    """

    block_m: int | None = None
    block_k0: int = 64
    block_n0: int = 64
    block_n1: int = 64
    block_k1: int = 64
    block_t: int = 16
    block_g: int = 32
    block_tc: int = 16
    block_nc: int = 128
    num_warps: int = 8
    num_stages: int = 3
    programs: int | None = None

    def rows_per_tile(self, T: int, top_k: int, num_experts: int) -> int:
        if self.block_m is not None:
            return self.block_m
        per_expert = T * top_k / max(num_experts, 1)
        return 16 if per_expert <= 32 else 32 if per_expert <= 64 else 64


class PersistentState:
    """The kernel's persistent device state: counters and epoch (``STATE_WORDS``), the error record
    (``ERROR_WORDS``) and per-tile GEMM0 counters, in one int32 tensor that grows (zeroed, epoch
    restarting at 0) when a call needs more tiles. Keep one per layer; not shared between streams."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def views(self, device: torch.device, max_tiles: int):
        need = STATE_WORDS + ERROR_WORDS + max_tiles
        if self.buffer is None or self.buffer.device != device or self.buffer.numel() < need:
            self.buffer = torch.zeros(max(need, 2 * (self.buffer.numel() if self.buffer is not None else 0)),
                                      dtype=torch.int32, device=device)
        b = self.buffer
        return b[:STATE_WORDS], b[STATE_WORDS:STATE_WORDS + ERROR_WORDS], b[STATE_WORDS + ERROR_WORDS:]

    def error_record(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer[STATE_WORDS:STATE_WORDS + ERROR_WORDS]

    def check(self) -> None:
        """Raise ``RuntimeError`` if a wait of an earlier call timed out (reads the record: a host
        sync), and clear the record."""
        record = self.error_record()
        if record is None:
            return
        message = describe_error(record.tolist())
        if message:
            record.zero_()
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


def persistent_moe(x: torch.Tensor, router_weight: torch.Tensor, expert_bias: torch.Tensor | None,
                   w_up: torch.Tensor, w_down: torch.Tensor, state: PersistentState, *, top_k: int, softmax: bool,
                   renormalize: bool, route_scale: float, activation: str, w_pieces: int,
                   config: PersistentKernelConfig = PersistentKernelConfig(), max_spins: int = DEFAULT_SPINS,
                   order: str = "normal", workspace: dict | None = None) -> torch.Tensor:
    """One MoE layer call (world size 1) in one launch; see the module.

    Args:
        x: (T, N) tokens, bf16/fp16/fp32, contiguous.
        router_weight: (E, N) fp32; expert_bias: (E,) fp32 selection bias, or None.
        w_up: (E, up_width, N) (SwiGLU: gate rows first); w_down: (E, N, K); x's dtype.
        state: the caller's :class:`PersistentState` (counters and epoch, kept across calls).
        top_k, softmax, renormalize, route_scale: the routing (:class:`interlace.config.MoEConfig`).
        activation: ``"swiglu"``, ``"gelu"`` or ``"relu"``; w_pieces: :func:`router_pieces`.
        order: ``"normal"``; ``"combine_first"`` (tests) breaks the task order on purpose.
        workspace: if a dict, filled with the intermediate tensors (tests read the routing and
            the index from it).
    Returns:
        (T, N) in x's dtype. A timed-out wait leaves an error record in ``state`` (see
        :meth:`PersistentState.check`); nothing here reads it.
    """
    if order not in TASK_ORDERS:
        raise ValueError(f"order must be one of {TASK_ORDERS}, got {order!r}")
    x, router_weight, w_up, w_down = (t.contiguous() for t in (x, router_weight, w_up, w_down))
    T, N = x.shape
    E, up_width, _ = w_up.shape
    K = w_down.shape[2]
    out = alloc.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    c = config
    block_m = c.rows_per_tile(T, top_k, E)
    layout = TaskLayout.build(T, N, K, E, top_k, c.block_t, block_m, c.block_k0, c.block_n1, c.block_tc, c.block_nc)
    e_pad = max(16, next_power_of_2(E))
    TK = T * top_k
    n_hist = layout.n_gate * e_pad
    # One int32 workspace: idx, weights (as fp32), ranks, row_of, asg_of (T·k each), hist and
    # base (n_gate·E_PAD each), offsets (E_PAD), the tile table (3·max_tiles).
    ints = alloc.empty((5 * TK + 2 * n_hist + e_pad + 3 * layout.max_tiles,), dtype=torch.int32, device=x.device)
    idx, wt, lrank, row_of, asg_of = (ints[i * TK:(i + 1) * TK] for i in range(5))
    wt = wt.view(torch.float32)
    rest = ints[5 * TK:]
    hist, base, offs, tiles = (rest[:n_hist], rest[n_hist:2 * n_hist], rest[2 * n_hist:2 * n_hist + e_pad],
                               rest[2 * n_hist + e_pad:])
    h = alloc.empty((TK, K), dtype=x.dtype, device=x.device)
    y = alloc.empty((TK, N), dtype=x.dtype, device=x.device)
    st, err, gemm0_done = state.views(x.device, layout.max_tiles)
    if c.programs is not None:
        programs = c.programs
    elif _INTERPRET or x.device.type != "cuda":
        programs = 3
    else:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = sms * _OCCUPANCY.get((x.device.index, block_m, e_pad, top_k, activation, x.dtype, c), 1)
    programs = max(1, min(programs, layout.total))
    constexprs = dict(
        TOP_K=top_k, K_PAD=next_power_of_2(top_k), E_PAD=e_pad, BLOCK_T=c.block_t, BLOCK_G=c.block_g,
        BLOCK_A=128, BLOCK_J=max(16, min(64, 2048 // e_pad)), BLOCK_M=block_m, BLOCK_K0=c.block_k0,
        BLOCK_N0=c.block_n0, BLOCK_N1=c.block_n1, BLOCK_K1=c.block_k1, BLOCK_TC=c.block_tc, BLOCK_NC=c.block_nc,
        SOFTMAX=softmax, HAS_BIAS=expert_bias is not None, RENORMALIZE=renormalize,
        ACTIVATION=ACTIVATION_ID[activation], W_PIECES=w_pieces, DOT_FP32=_INTERPRET,
        ORDER=TASK_ORDERS.index(order),
    )
    compiled = launch(
        persistent_moe_kernel, (programs,),
        x, router_weight, expert_bias if expert_bias is not None else router_weight, w_up, w_down, out,
        idx, wt, lrank, row_of, asg_of, hist, base, offs, tiles, h, y, st, err, gemm0_done,
        T, N, K, E, up_width, float(route_scale), int(max_spins), programs,
        layout.n_gate, layout.max_tiles, layout.n_k0, layout.n_n1, layout.n_comb_t, layout.n_comb_n,
        num_warps=c.num_warps, num_stages=c.num_stages, **constexprs,
    )
    key = (x.device.index, block_m, e_pad, top_k, activation, x.dtype, c)
    if x.device.type == "cuda" and c.programs is None and key not in _OCCUPANCY:
        _OCCUPANCY[key] = _programs_per_sm(compiled, x.device, c.num_warps)
    if workspace is not None:
        workspace.update(idx=idx, weight=wt, row_of_assignment=row_of, assignment_of_row=asg_of, tiles=tiles,
                         state=st, block_m=block_m, layout=layout, programs=programs)
    return out
