"""The same-host board auto agrees on (interlace.parallel.host_board): its row equals the
group's all_gather call after call, reads still pending when the next call is posted are
kept, a rank that never posts makes the wait raise naming it, and ``auto`` uses the board when
its ranks share a host."""

import random

import pytest
import torch

from helpers import run_gloo


def _board_agrees(rank, world):
    import torch.distributed as dist

    from interlace.parallel.host_board import HostBoard

    board = HostBoard.create(dist.group.WORLD, timeout_s=60.0)
    assert board is not None, "one host, /dev/shm: the board must serve"
    rng = random.Random(rank)
    for i in range(300):
        # zeros and large values too, and ranks that arrive late
        value = rng.choice([0, rng.randrange(1 << 20), (1 << 32) - 1 - rng.randrange(4)])
        if rng.random() < 0.05:
            torch.ones(200_000).sum()
        seq = board.post(value)
        expect = [None] * world
        dist.all_gather_object(expect, value)
        assert board.wait(seq) == tuple(expect), f"call {i}"
    # Two posts before either wait: the first is read when the second is posted, both kept.
    s1, s2 = board.post(rank + 1), board.post(100 + rank)
    assert (board.wait(s1), board.wait(s2)) == (tuple(range(1, world + 1)), tuple(range(100, 100 + world)))
    with pytest.raises(ValueError):
        board.post(-1)
    # A rank that never posts: the others' wait raises within its timeout, naming it.
    dist.barrier()
    if rank != world - 1:
        seq = board.post(1)
        with pytest.raises(TimeoutError, match=rf"ranks \[{world - 1}\]"):
            board.wait(seq, timeout_s=0.5)
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4])
def test_board_agrees_with_all_reduce(world):
    run_gloo(_board_agrees, world)


def _auto_uses_board(rank, world):
    from interlace import MoEConfig, MoELayer

    cfg = MoEConfig(hidden=16, ffn=8, num_experts=4, top_k=2, dtype=torch.float32)
    layer = MoELayer(cfg, strategy="auto", seed=1, device="cpu", strategy_options={"candidates": ("sequential",)})
    assert layer.strategy._agree.board is not None
    with torch.no_grad():
        layer(torch.randn(3 + rank, cfg.hidden))
    assert layer.strategy.choice_for(4) is not None  # the agreed count (4) keyed the call


def test_auto_agrees_on_the_board():
    run_gloo(_auto_uses_board, 2)
