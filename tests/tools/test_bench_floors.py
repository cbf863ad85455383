"""The bench's floors: the prefill floor's terms and the decode floor's weight term."""

import pytest
import torch

from interlace.config import MoEConfig
from interlace.tools.bench import decode_floor_ms, floor_ms, touched_expert_bytes


class _OneRank:
    world, group = 1, None


CFG = MoEConfig(hidden=64, ffn=32, num_experts=8, top_k=2, dtype=torch.bfloat16)  # SwiGLU: up_width 64


def test_touched_expert_bytes_counts_each_chosen_expert_once():
    per_expert = (2 * 32 + 32) * 64 * 2  # (w_up 2K×N + w_down N×K) bf16
    idx = torch.tensor([[0, 1], [1, 5], [5, 0]])
    assert touched_expert_bytes(CFG, idx, _OneRank) == 3 * per_expert
    assert touched_expert_bytes(CFG, torch.empty(0, 2, dtype=torch.long), _OneRank) == 0
    assert touched_expert_bytes(CFG, torch.arange(8).view(4, 2), _OneRank) == 8 * per_expert


def test_decode_floor_is_the_largest_term():
    weights = 4_000_000_000  # 4 GB at 4 TB/s: 1 ms
    assert decode_floor_ms(0.25, weights, 4.0, 2, 10.0) == pytest.approx(1.0)
    assert decode_floor_ms(2.0, weights, 4.0, 2, 10.0) == pytest.approx(2.0)  # compute-bound
    assert decode_floor_ms(0.001, 0, 4.0, 2, 10.0) == pytest.approx(0.02)  # two peer latencies
    assert decode_floor_ms(0.001, 0, 4.0, 1, 10.0) == pytest.approx(0.001)  # no peers at world size 1
    assert decode_floor_ms(None, weights, 4.0, 2, 10.0) is None
    assert decode_floor_ms(0.25, weights, None, 2, 10.0) is None


def test_prefill_floor_terms():
    tokens, world = 4096, 2
    compute = CFG.flops_per_token() * tokens / 100e12 * 1e3
    comm = 2 * tokens * 2 * 0.5 * 64 * 2 / 1e9 * 1e3
    assert floor_ms(CFG, tokens, world, "fwd", 100.0, 1.0) == pytest.approx(max(compute, comm))
    assert floor_ms(CFG, tokens, world, "fwdbwd", 100.0, 1.0) == pytest.approx(max(3 * compute, 2 * comm))


def test_git_commit_marks_a_tree_that_differs_from_its_head(tmp_path, monkeypatch):
    """A checkout whose tracked files differ from HEAD (a copied tree whose .git lags) is recorded
    as ``<head>-dirty``, not as the older commit; INTERLACE_COMMIT wins where set."""
    import subprocess

    from interlace import env
    from interlace.tools.bench import git_commit

    monkeypatch.delenv("INTERLACE_COMMIT", raising=False)
    env.refresh()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(git[:5] + ["init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "a.py"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "one"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "new.py").write_text("untracked = True\n")  # (untracked files do not count)
    assert git_commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(str(tmp_path)) == head + "-dirty"
    monkeypatch.setenv("INTERLACE_COMMIT", "abc1234")
    env.refresh()
    assert git_commit(str(tmp_path)) == "abc1234"
    monkeypatch.delenv("INTERLACE_COMMIT")
    env.refresh()
