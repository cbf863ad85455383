"""What the bench does around each strategy's timing: ``auto`` settled before it is timed, and each
row's peak memory with no other strategy alive."""

from __future__ import annotations

import gc

import torch

from interlace.layer import MoELayer
from interlace.tools.bench_timing import reduce_max


STEADY_CALLS = 3
AUTO_SETTLE_CALLS = 200  # bound on the calls settle_auto serves


def settle_auto(strategy, call, tokens: int, mode: str) -> int:
    """``auto``: calls until its decision for this bucket and mode is made (at most
    AUTO_SETTLE_CALLS), so that the timed calls measure what it runs, not its calibration
    (that is reported apart: the row's ``choice``). Every rank decides at the same call. Returns
    the calls served; 0 for any other strategy."""
    choice_for = getattr(strategy, "choice_for", None)
    calls = 0
    while choice_for is not None and choice_for(tokens, mode) is None and calls < AUTO_SETTLE_CALLS:
        call()
        calls += 1
    return calls


def graph_pools_unallocated(device: int) -> int:
    """Bytes that CUDA-graph memory pools hold on ``device`` beyond their live tensors: the
    captured graphs' temporaries, reserved for their replays and usable by nothing else, which
    ``max_memory_allocated`` does not count (it counts a graph's memory only while captured)."""
    segments = torch.cuda.memory._snapshot()["segments"]
    return sum(seg["total_size"] - seg["allocated_size"] for seg in segments
               if seg["device"] == device and tuple(seg["segment_pool_id"]) != (0, 0))


def isolated_peaks(layer: MoELayer, rows: list, call, grads_of: list, warmup: int, backward: bool, env,
                   idle: str = "naive") -> None:
    """Each ok row's peak memory with no other strategy alive (while the timing ran, every
    strategy's buffers and graphs were held at once): the layer's strategy built afresh after the
    others' objects and the shared buffers are released and the gradients dropped, then its first
    call and ``warmup`` more (compiles, captures; ``auto``'s calibration where no decision is
    cached): ``first_peak_gib``; then STEADY_CALLS more: ``peak_gib``, what the strategy holds
    and allocates in steady state. Weights and inputs included, the slowest rank's. On the CPU
    no peak is read: the release, the rebuild and the first ``1 + warmup`` calls run (``auto``'s
    calibration among them), the STEADY_CALLS, which only feed ``peak_gib``, do not. A peak counts
    the memory CUDA-graph pools hold unallocated (:func:`graph_pools_unallocated`) on top of
    ``max_memory_allocated``. ``idle``: the strategy the layer holds between rows (an FP8
    layer's: one that runs FP8 experts). NOTE: device syncs (between strategies, outside every timing)."""
    from interlace.parallel import release_shared_buffers

    ctx = torch.no_grad() if not backward else torch.enable_grad()

    def fresh_peak():
        for t in grads_of:
            t.grad = None
        gc.collect()
        if env.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib():
        if not env.cuda:
            return None
        torch.cuda.synchronize()
        held = graph_pools_unallocated(torch.cuda.current_device())
        peak = reduce_max(env, (torch.cuda.max_memory_allocated() + held) / 2**30)
        torch.cuda.reset_peak_memory_stats()
        return peak

    for row in rows:
        if row.status != "ok":
            continue
        layer.set_strategy(idle)
        release_shared_buffers()
        fresh_peak()
        layer.set_strategy(row.strategy)
        with ctx:
            for _ in range(1 + warmup):
                call()
            row.first_peak_gib = peak_gib()
            for _ in range(STEADY_CALLS if env.cuda else 0):
                call()
            row.peak_gib = peak_gib()
    layer.set_strategy(idle)
    release_shared_buffers()


def auto_choice(strategy, tokens: int, mode: str) -> str | None:
    """``"<spec> (<source>[, calibration <ms> over the winner])"`` of an ``auto`` strategy's decision
    for ``tokens`` per rank (every rank passes the same count here) and ``mode``; None for any
    other strategy or while undecided."""
    choice_for = getattr(strategy, "choice_for", None)
    choice = choice_for(tokens, mode) if choice_for is not None else None
    if choice is None:
        return None
    extra = f", calibration {choice.overhead_ms:.1f} ms over the winner" if choice.calibration_calls else ""
    return f"{choice.spec} ({choice.source}{extra})"
