"""The bench's peer ceilings: rank 0 measures while every other rank waits on the host store, so no
rank has GPU work (an NCCL collective's spinning kernel) in flight on either GPU of the copy."""

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from interlace.tools import bench_timing
from helpers import run_gloo

MEASURE_S = 0.3  # how long rank 0's fake measurement holds the other ranks


def test_peer_ceilings_are_none_without_two_gpus():
    env = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"), cuda=False)
    assert bench_timing.measure_peer_latency_us(env) is None
    assert bench_timing.measure_peer_gbps(env) is None
    with pytest.raises(ValueError, match=">= 50"):
        bench_timing.measure_peer_latency_us(env, iters=20)


def _forbidden(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} called while rank 0 measures")
    return fail


def _ranks_wait_on_the_host(rank, world):
    # A fake CUDA environment: env.cuda is True and two GPUs are reported, but the device is the
    # CPU. Any CUDA op other than the recorded synchronize raises here (no CUDA build); every
    # collective is made to raise, so a rank waiting in one fails the test.
    env = SimpleNamespace(rank=rank, world=world, device=torch.device("cuda", rank), cuda=True)
    syncs = []
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "device_count", lambda: 2)
    mp.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append((time.time(), str(device))))
    for name in ("broadcast", "all_reduce", "barrier", "all_gather", "recv", "send"):
        mp.setattr(dist, name, _forbidden(f"dist.{name}"))
    store = bench_timing.host_store()
    measured = []

    def fake_measure(value, name):
        def measure(*args):
            start = time.time()
            # every other rank has told rank 0 it is idle before the measurement starts
            assert store.check([f"interlace/bench/{name}/1/idle/{r}" for r in range(1, world)])
            time.sleep(MEASURE_S)
            measured.append(value)
            store.set(f"test/{value}/window", f"{start!r} {time.time()!r}")
            return value
        return measure

    if rank == 0:
        mp.setattr(bench_timing, "_peer_copy_latency_us", fake_measure(3.25, "peer_latency_us"))
        mp.setattr(bench_timing, "_peer_copy_gbps", fake_measure(390.5, "peer_gbps"))
    else:
        mp.setattr(bench_timing, "_peer_copy_latency_us", _forbidden("the latency measurement off rank 0"))
        mp.setattr(bench_timing, "_peer_copy_gbps", _forbidden("the bandwidth measurement off rank 0"))
    try:
        latency = bench_timing.measure_peer_latency_us(env)
        returned_latency = time.time()
        gbps = bench_timing.measure_peer_gbps(env)
        returned_gbps = time.time()
    finally:
        mp.undo()
    assert (latency, gbps) == (3.25, 390.5)  # every rank gets rank 0's values
    assert measured == ([3.25, 390.5] if rank == 0 else [])
    assert len(syncs) == 2 and all(device == f"cuda:{rank}" for _, device in syncs)  # its own GPU only
    if rank:
        for value, returned, sync in ((3.25, returned_latency, syncs[0][0]), (390.5, returned_gbps, syncs[1][0])):
            start, end = map(float, store.get(f"test/{value}/window").decode().split())
            # its own GPU drained before rank 0 started; nothing called until rank 0 had finished
            assert sync <= start and returned >= end


def test_other_ranks_wait_on_the_host_while_rank_0_measures():
    run_gloo(_ranks_wait_on_the_host, 2)


def _error_reaches_every_rank(rank, world):
    env = SimpleNamespace(rank=rank, world=world, device=torch.device("cpu"), cuda=False)

    def broken():
        raise OSError("peer access refused")

    with pytest.raises((OSError, RuntimeError), match="peer access refused"):
        bench_timing.rank0_measures(env, broken, "broken")
    # the next measurement of the same name gets a fresh key: the failed one's result is not reused
    assert bench_timing.rank0_measures(env, lambda: 7.0, "broken") == 7.0


def test_rank_0s_error_reaches_the_waiting_ranks():
    run_gloo(_error_reaches_every_rank, 2)
