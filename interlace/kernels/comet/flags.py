"""Readiness flags between programs and ranks: bounded acquire waits and release publishes.

A flag holds the epoch (call counter) of the last call that published it; a waiter waits for
``flag >= epoch``. Waits are bounded: after ``max_spins`` polls the first timed-out wait of a
call writes an error record and the kernel goes on (its output is then garbage, but nothing
hangs); the host raises from the record (:func:`describe_error`), naming rank, what was
awaited and the flag's value.

Error record (8 int32): [set, rank, kind, source/peer rank, expert or slice, tile, flag, epoch].
"""

from __future__ import annotations

import triton
import triton.language as tl

from interlace.kernels.tma import ensure_allocator, use_tma

# What a wait was for (stored in the error record); constexpr so kernels may read them.
WAIT_LAYER0 = tl.constexpr(1)  # a GEMM0 tile waiting for its dispatched rows
WAIT_LAYER1 = tl.constexpr(2)  # the combine waiting for an N-slice of returned expert outputs


@triton.jit
def peer_region(table, rank, dtype: tl.constexpr):
    """``rank``'s region as a ``dtype`` pointer, from a (W,) int64 address table. The addresses
    are 16-byte aligned (:class:`interlace.parallel.peer_buffer.PeerBuffer` checks them), and
    saying so lets row stores through the pointer use 16-byte vectors: without the hint the
    compiler knows nothing of a loaded address and stores element by element (2 bytes at a
    time in bf16, over NVLink for a peer)."""
    return tl.multiple_of(tl.load(table + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def wait_flag(flag_ptr, epoch, max_spins, error_ptr, rank, kind, peer, what, tile):
    """Acquire-spin (system scope) until ``*flag_ptr >= epoch``; False after ``max_spins``."""
    flag = _spin_until(flag_ptr, epoch, max_spins, "sys")
    ok = flag >= epoch
    if not ok:
        if tl.atomic_cas(error_ptr, 0, 1) == 0:
            record_error_fields(error_ptr, rank, kind, peer, what, tile, flag, epoch)
    return ok


@triton.jit
def _spin_until(ptr, target, max_spins, SCOPE: tl.constexpr):
    """``*ptr`` by acquire loads at ``SCOPE`` until it reaches ``target`` or ``max_spins`` polls pass."""
    value = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    spins = 0
    while (value < target) & (spins < max_spins):
        value = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
        spins += 1
    return value


@triton.jit
def record_error_fields(error_ptr, rank, kind, peer, what, tile, flag, epoch):
    """An error record's fields after its set word (see the module; the persistent kernel's
    records use the same eight words)."""
    tl.store(error_ptr + 1, rank)
    tl.store(error_ptr + 2, kind)
    tl.store(error_ptr + 3, peer)
    tl.store(error_ptr + 4, what)
    tl.store(error_ptr + 5, tile)
    tl.store(error_ptr + 6, flag)
    tl.store(error_ptr + 7, epoch)


@triton.jit
def fence_proxy_async(x):
    """``fence.proxy.async.global``: order this thread's earlier generic-proxy accesses (the flag
    acquire) before its later async-proxy ones (TMA loads of the rows the flag covers). Without it
    a TMA load may miss rows a peer released before the flag. Returns ``x`` (no interpreter form:
    callers gate it with a constexpr that is off under TRITON_INTERPRET)."""
    return tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.b32 $0, $1;", "=r,r", [x],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def publish_flag(flag_ptr, epoch):
    """Make this program's earlier stores (all threads) visible, then set the flag (release)."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


def describe_error(record: list[int]) -> str | None:
    """Human-readable message of an error record, or None if no wait timed out."""
    if not record or record[0] == 0:
        return None
    _, rank, kind, peer, what, tile, flag, epoch = record[:8]
    if kind == WAIT_LAYER0.value:
        waited = f"rows from source rank {peer} for local expert {what}, row tile {tile}"
    else:
        waited = f"expert outputs from rank {peer} for N-slice {what}"
    return (f"rank {rank}: timed out waiting for {waited} (flag value {flag}, expected epoch {epoch}); "
            f"a peer did not run the same layer call, or crashed")


# ---- work queues: programs claim work items with an atomic counter ----------------------
# A queue is 4 int32 on the device: [counter A, counter B, programs done, counter C]. Items are handed
# out in order, so "all items before mine were claimed by running programs" holds, which is
# what makes waiting on them deadlock-free whatever the block scheduling. The last program
# to finish resets the queue for the next launch (stream order separates launches).

@triton.jit
def claim(counter_ptr):
    return tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def finish_queue(queue_ptr, n_programs):
    """Count this program out; the last one resets the queue's four counters."""
    if tl.atomic_add(queue_ptr + 2, 1, sem="acq_rel", scope="gpu") == n_programs - 1:
        tl.atomic_xchg(queue_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(queue_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(queue_ptr + 3, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(queue_ptr + 2, 0, sem="relaxed", scope="gpu")


def launch_roles(layer: str, role: str, n_comm: int, n_programs: int, weights,
                 force_tma: bool | None = None) -> tuple[int, int, bool]:
    """(pid_base, grid, use TMA) of a fused-kernel launch. ``role``: ``"all"`` (one launch, both
    program roles), ``"comm"`` (programs [0, n_comm)) or ``"gemm"`` (the rest).
    ``force_tma``: as ``force`` of :func:`interlace.kernels.tma.use_tma` (None: by device)."""
    if not 0 < n_comm < n_programs:
        raise ValueError(f"{layer} needs 0 < n_comm ({n_comm}) < programs ({n_programs})")
    pid_base, grid = {"all": (0, n_programs), "comm": (0, n_comm),
                      "gemm": (n_comm, n_programs - n_comm)}[role]
    tma = use_tma(weights, force=force_tma)
    if tma:
        ensure_allocator()
    return pid_base, grid, tma
