"""The expert forward's two GEMMs in one persistent launch (the *chained* forward).

Run as two launches, GEMM0 and GEMM1 each end on a partial wave: phi3.5-moe at 4096 tokens on
132 SMs has 3200 GEMM0 items (24.2 waves) and 1024 GEMM1 items (7.8 waves), so about 3% of
each kernel's time has most SMs idle, and the second launch starts only when the first has
drained. Chained, every program runs its GEMM0 items (the same loop as
:func:`grouped_gemm._gemm0_flat_loop` or :func:`grouped_gemm._gemm0_loop`), then goes straight
on to GEMM1 items (:func:`grouped_gemm._gemm_loop`), so GEMM1 fills GEMM0's last wave:

* GEMM1 items continue GEMM0's round-robin: item ``j`` goes to program ``(T0 + j) mod P`` (T0
  GEMM0 items, P programs), so the programs that had one GEMM0 item fewer take the extra
  GEMM1 items.
* A GEMM1 tile needs every GEMM0 column block of its rows. GEMM0 counts its finished items per
  row tile (``TileSchedule.ready``, zeroed by the schedule's own launch) and in total, with
  release semantics once the item's stores have landed (:func:`flags.count_done`). A GEMM1
  item acquires its row tile's count (:func:`flags.wait_count`) until it sees all of GEMM0
  counted, after which no item waits. An item is counted at the epilogue of the program's
  next item, before that item's store: its own stores landed long before, so counting costs
  no wait (the last item is counted after the loop).
* Deadlock freedom: GEMM0 items never wait, so every GEMM0 item of a running program finishes.
  The grid is at most one program per SM, and the programs must all be resident at once (as
  in FlashDMoE and COMET's persistent kernels); a program that never starts — another kernel
  holding SMs for seconds — leaves a wait to time out. Waits are bounded (``max_spins`` polls):
  a timed-out wait writes an error record into pinned host memory, which the next call reads
  without a host sync and raises from, naming rank, expert and row tile
  (:func:`check_chain_errors` raises at once, after a synchronize).

Chaining is a per-shape choice: the GEMM1 table entry's ``chain`` field, or
``INTERLACE_CHAIN=0/1`` to force it off or on. On an H100 it was bitwise equal to two launches
and level with them: at most 2–5% to gain where the waves are short, the counts and waits about
1% of it, and the block's ±5% round-to-round spread larger than what was left (runs 188–190),
so every packaged table has it off. It needs GEMM0 and GEMM1 configs of the same
tile height and warp count; GEMM1 then runs the nested loop (a flat GEMM1 config's blocks and
stages in nested form). Under ``TRITON_INTERPRET=1`` programs run one after another, so a
chained launch has one program (every wait is then already met); ``phases`` splits the launch
into a GEMM0-only and a GEMM1-only launch for tests of the multi-program split.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from interlace.kernels.comet.flags import describe_error
from interlace.kernels.expert_gemm.grouped_gemm import (_ACTIVATION_ID, GemmConfig, TileSchedule, _check_config, _ensure_allocator,
                                        _gemm0_flat_loop, _gemm0_loop, _gemm_loop, _num_programs, gemm0_form,
                                        plain_gemm_tma)
from interlace.kernels.launch import cdiv, launch

# Polls of one wait before it times out. A healthy wait lasts at most one GEMM0 item (~0.1 ms);
# a poll is an L2 round trip (~1 µs), so this is seconds.
CHAIN_SPINS = 1 << 22
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _ffn_chain_kernel(
    x_ptr, gather_ptr, w_up_ptr, act_ptr, h_ptr, w_down_ptr, y_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr, ready_ptr, done_ptr, error_ptr,
    N, K, E, divisor, num_programs, num_rows, max_spins, rank,
    ACTIVATION: tl.constexpr, HAS_GATHER: tl.constexpr, STORE_H: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    FLAT0: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_K0: tl.constexpr, GROUP_M0: tl.constexpr,
    FLATTEN0: tl.constexpr, A_TMA0: tl.constexpr, JOINT: tl.constexpr, TMA_STORE0: tl.constexpr,
    BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, GROUP_M1: tl.constexpr, A_TMA1: tl.constexpr,
    TMA_STORE1: tl.constexpr, STAGES1: tl.constexpr,
    PHASES: tl.constexpr,  # 3: both; 1: GEMM0 only; 2: GEMM1 only
    CHAINED: tl.constexpr,  # GEMM0 counts its items and GEMM1 waits for them (PHASES = 3)
    FENCE: tl.constexpr,  # GEMM0's TMA stores waited for before an item is counted (off in the interpreter)
    FENCE1: tl.constexpr,  # a proxy fence after a wait, before GEMM1's TMA loads of the rows (the same)
    ASM: tl.constexpr,  # GEMM0's barrier before a count in inline assembly (flags.cta_barrier; the same)
):
    """act (and h) = GEMM0 of the rows, then y = act @ W_downᵀ per expert, in one launch."""
    pid = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    if PHASES % 2 == 1:
        if FLAT0:
            _gemm0_flat_loop(pid, num_programs, x_ptr, w_up_ptr, act_ptr, h_ptr, tile_expert_ptr, tile_start_ptr,
                             tile_end_ptr, num_tiles, N, K, E, num_rows, ready_ptr, done_ptr, ACTIVATION, STORE_H,
                             JOINT, BLOCK_M, BLOCK_N0, BLOCK_K0, GROUP_M0, SIGNAL=CHAINED, FENCE=FENCE, ASM=ASM)
        else:
            _gemm0_loop(pid, num_programs, x_ptr, gather_ptr, w_up_ptr, act_ptr, h_ptr, tile_expert_ptr,
                        tile_start_ptr, tile_end_ptr, num_tiles, N, K, E, divisor, num_rows, ready_ptr, done_ptr,
                        ACTIVATION, HAS_GATHER, STORE_H, USE_TMA, BLOCK_M, BLOCK_N0, BLOCK_K0, GROUP_M0, FLATTEN0,
                        A_TMA0, JOINT, TMA_STORE0, SIGNAL=CHAINED, FENCE=FENCE, ASM=ASM)
    if PHASES >= 2:
        need = tl.cdiv(K, BLOCK_N0)  # GEMM0 items per row tile
        total0 = num_tiles * need
        first = (pid + num_programs - total0 % num_programs) % num_programs
        _gemm_loop(first, num_programs, act_ptr, w_down_ptr, y_ptr, y_ptr, tile_expert_ptr, tile_start_ptr,
                   tile_end_ptr, num_tiles, N, K, E, num_rows, True, 0, USE_TMA, BLOCK_M, BLOCK_N1, BLOCK_K1, GROUP_M1,
                   False, A_TMA1, TMA_STORE1, WAIT=CHAINED, ready_ptr=ready_ptr, done_ptr=done_ptr, need=need,
                   total_done=total0, max_spins=max_spins, error_ptr=error_ptr, rank=rank,
                   FENCE=FENCE1, STAGES=STAGES1)


def chain_wanted(c1: GemmConfig) -> bool:
    """Whether the forward runs chained: ``INTERLACE_CHAIN`` (0/1) if set, else the GEMM1 config's ``chain``."""
    forced = os.environ.get("INTERLACE_CHAIN", "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"INTERLACE_CHAIN must be 0 or 1, got {forced!r}")
    return forced == "1" if forced else bool(c1.chain)


def chain_fits(c0: GemmConfig, c1: GemmConfig) -> bool:
    """One launch runs both: the same tile height (the counts are per row tile) and warp count."""
    return c0.block_m == c1.block_m and c0.num_warps == c1.num_warps


_RECORDS: dict[int, tuple[torch.Tensor, np.ndarray]] = {}


def _error_record(device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """This device's error record (8 int32): pinned host memory, which the kernel writes through
    its device address and the host reads with no sync (a CPU tensor under the interpreter)."""
    index = -1 if device.type != "cuda" else (device.index if device.index is not None else torch.cuda.current_device())
    hit = _RECORDS.get(index)
    if hit is None:
        record = torch.zeros(8, dtype=torch.int32, pin_memory=device.type == "cuda")
        hit = _RECORDS[index] = (record, record.numpy())
    return hit


def _raise_recorded(device: torch.device) -> None:
    """Raise (and clear) a timed-out wait of an earlier chained launch on this device, if its record has landed."""
    record, view = _error_record(device)
    if view[0] != 0:
        message = describe_error(view.tolist())
        view[:] = 0
        raise RuntimeError(message)


def check_chain_errors(device: torch.device | None = None) -> None:
    """Synchronize ``device`` and raise if a chained launch's wait timed out (tests, stress runs)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _raise_recorded(device)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def ffn_chain(x, gather, divisor, w_up, w_down, act, h, y, sched0: TileSchedule, num_rows: int, activation: str,
              c0: GemmConfig, c1: GemmConfig, tma: bool, phases: int = 3, programs: int | None = None,
              max_spins: int = CHAIN_SPINS) -> None:
    """act (and h when not None) and y = act @ W_down[e]ᵀ over ``sched0`` (built ``with_ready``)
    in one launch (``phases`` 1 and 2: GEMM0 only, GEMM1 only; tests). ``programs`` overrides
    the grid (tests); a chained launch under the interpreter has one program (see the module)."""
    _check_config(c0)
    _check_config(c1)
    if not chain_fits(c0, c1) or sched0.ready is None or sched0.block_m != c0.block_m:
        raise ValueError(f"chained forward: GEMM0 {c0} and GEMM1 {c1} need the same block_m and num_warps, and a "
                         "schedule of that height built with_ready")
    if phases not in (1, 2, 3):
        raise ValueError(f"phases must be 1, 2 or 3, got {phases}")
    _raise_recorded(x.device)
    if tma:
        _ensure_allocator()
    E, K = w_up.shape[0], act.shape[1]
    N = y.shape[1]
    f = gemm0_form(x, gather, divisor, num_rows, act, h is not None, activation, c0, tma)
    a_tma1, tma_store1 = plain_gemm_tma(c1, tma, act, y)
    items = sched0.max_tiles * max(cdiv(K, c0.block_n), cdiv(N, c1.block_n))
    grid = programs or (1 if (_INTERPRET and phases == 3) else _num_programs(x.device, items))
    record, _ = _error_record(x.device)
    launch(_ffn_chain_kernel, (grid,),
        f.x, f.gather if f.gather is not None else sched0.start, w_up, act, h if h is not None else act, w_down, y,
        sched0.expert, sched0.start, sched0.end, sched0.count, sched0.ready, sched0.ready[sched0.max_tiles:],
        record, N, K, E, f.divisor, grid, num_rows, max_spins, _rank(),
        ACTIVATION=_ACTIVATION_ID[activation], HAS_GATHER=f.gather is not None, STORE_H=h is not None, USE_TMA=tma,
        BLOCK_M=c0.block_m, FLAT0=f.flat, BLOCK_N0=c0.block_n, BLOCK_K0=c0.block_k, GROUP_M0=c0.group_m,
        FLATTEN0=bool(c0.flatten), A_TMA0=f.a_tma, JOINT=f.joint, TMA_STORE0=f.tma_store,
        BLOCK_N1=c1.block_n, BLOCK_K1=c1.block_k, GROUP_M1=c1.group_m, A_TMA1=a_tma1, TMA_STORE1=tma_store1,
        STAGES1=c1.num_stages, PHASES=phases, CHAINED=phases == 3,
        FENCE=(f.flat or f.tma_store) and not _INTERPRET, FENCE1=a_tma1 and not _INTERPRET, ASM=not _INTERPRET,
        num_warps=c0.num_warps, num_stages=f.stages,
    )
    if x.device.type != "cuda":
        _raise_recorded(x.device)  # the interpreter ran it already
