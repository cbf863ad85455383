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


def test_fp8_expert_bytes_count_e4m3_weights_and_block_scales():
    """An FP8 layer's touched weights: a byte a weight and a 4-byte scale per 128 × 128 block
    (its decode floor reads those, not bf16's)."""
    cfg = MoEConfig(hidden=256, ffn=384, num_experts=8, top_k=2, dtype=torch.bfloat16, expert_quant="fp8")
    # w_up (768, 256): 6 × 2 blocks; w_down (256, 384): 2 × 3 blocks
    per_expert = (768 + 384) * 256 + 4 * (6 * 2 + 2 * 3)
    idx = torch.tensor([[0, 1], [1, 5]])
    assert touched_expert_bytes(cfg, idx, _OneRank) == 3 * per_expert


def test_bench_times_the_fp8_twin_beside_bf16(tmp_path):
    """``--fp8``: the layer's FP8 twin (the same seed's weights, quantized) timed on the named
    strategies, its rows marked ``experts = "fp8"`` and checked against the bf16 naive output
    (block FP8's own error, above bf16's tolerance, below --fp8-tolerance)."""
    from interlace.tools.bench import main

    rows = main(["--configs", "mixtral-8x7b", "--small", "--tokens", "4", "--strategies", "sequential",
                 "--fp8", "sequential", "--warmup", "1", "--iters", "1", "--out", str(tmp_path)])
    fp8 = [r for r in rows if r.experts == "fp8"]
    assert [(r.strategy, r.status) for r in fp8] == [("sequential", "ok")]
    bf16 = {r.strategy: r for r in rows if r.experts == "bf16"}
    assert set(bf16) == {"naive", "sequential"} and bf16["sequential"].rel_err_vs_naive["out"] < 1e-5
    assert 1e-2 < fp8[0].rel_err_vs_naive["out"] < 1e-1
    assert fp8[0].median_ms > 0 and fp8[0].speedup_vs_naive is not None
    assert "sequential (fp8)" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--fp8", "fused"], "strategies that run FP8 experts"),
    (["--fp8", "fused:lean", "pipelined:2"], "--fp8 'fused:lean'"),
    (["--fp8", "sequential", "--mode", "fwdbwd"], "needs --mode fwd"),
])
def test_bench_refuses_fp8_rows_it_cannot_time(argv, message, capsys):
    from interlace.tools.bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
