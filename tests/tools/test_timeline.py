"""The fused kernels' opt-in timeline (interlace.kernels.timeline) and its Gantt chart (interlace.tools.timeline).

Two ranks simulated in one process under the Triton interpreter (logical clock): every work
item of the last call has exactly one record of the right kind, counts derived from the
routing (not from the plan), start ≤ waited ≤ end; records of an earlier call never leak.
"""

from __future__ import annotations

import random

import pytest
import torch

from interlace import MoEConfig
from interlace.tools.timeline import covered, draw_timeline, summarize
from interlace.experts import init_expert_weights
from interlace.kernels.timeline import KINDS
from interlace.strategies.fused.engine import FusedEngine, run_simulated
from interlace.strategies.fused.options import INTERPRETER_CONFIG as KC
from interlace.parallel.peer_buffer import BufferSpec, simulated_world

from helpers import rel_err
from strategies.test_fused import expert_reference, random_indices


def cdiv(a, b):
    return -(-a // b)


def expected_counts(kept_all: torch.Tensor, me: int, El: int, tokens: int, cfg) -> dict:
    """Work items of rank ``me`` from every rank's kept rows per expert (W, E)."""
    W = kept_all.shape[0]
    tiles = lambda s, d: sum(cdiv(int(kept_all[s, d * El + e]), KC.block_m) for e in range(El))  # noqa: E731
    local = tiles(me, me)
    recv = sum(tiles(s, me) for s in range(W))
    n_blocks0, n_slices = cdiv(cfg.ffn, KC.block_n), cdiv(cfg.hidden, KC.block_n1)
    return {"send": sum(tiles(me, d) for d in range(W) if d != me), "gemm0_local": local * n_blocks0,
            "gemm0_remote": (recv - local) * n_blocks0, "gemm1": n_slices * local,
            "gemm1_remote": n_slices * (recv - local), "combine": n_slices * cdiv(tokens, KC.block_t)}


def test_timeline_records_every_work_item_of_the_last_call():
    cfg = MoEConfig(hidden=40, ffn=40, num_experts=4, top_k=2, dtype=torch.float32)
    W, El, n_programs, n_comm = 2, 2, 4, (1, 2)
    spec = BufferSpec(W, El, cfg.hidden, cfg.top_k, 40, KC.block_m, KC.block_n1, cfg.dtype)
    engines = [FusedEngine(cfg, b, KC, n_programs, *n_comm, max_spins=1 << 20, timeline=True)
               for b in simulated_world(spec)]
    w_up, w_down = init_expert_weights(cfg, range(cfg.num_experts), 1, torch.device("cpu"))
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    # Call 1 is larger than call 2: its stale records stay in the buffer and must be filtered out.
    for tokens in ([40, 33], [27, 19]):
        idxs = random_indices(cfg, tokens, gen)
        xs = [torch.randn(T, cfg.hidden, generator=gen) for T in tokens]
        ws = [torch.rand(T, cfg.top_k, generator=gen) for T in tokens]
        outs = run_simulated(engines, xs, idxs, ws, [w_up[r * El:(r + 1) * El] for r in range(W)],
                             [w_down[r * El:(r + 1) * El] for r in range(W)])
    for out, x, i, w in zip(outs, xs, idxs, ws):  # recording changes nothing
        assert rel_err(out, expert_reference(x, i, w, w_up, w_down, cfg)) < 1e-5
    kept_all = torch.stack([eng.dispatch_index(i)[2] for eng, i in zip(engines, idxs)])
    for me, eng in enumerate(engines):
        recs = eng.timeline_records()
        want = expected_counts(kept_all, me, El, tokens[me], cfg)
        assert want["send"] > 0 and want["gemm0_remote"] > 0  # the case exercises every kind
        got = {k: sorted(r["item"] for r in recs if r["kind"] == k) for k in KINDS}
        assert {k: len(v) for k, v in got.items()} == want
        # One record per item: the items of a queue are exactly 0 .. n-1.
        assert got["send"] == list(range(want["send"]))
        assert sorted(got["gemm0_local"] + got["gemm0_remote"]) == list(range(want["gemm0_local"] +
                                                                              want["gemm0_remote"]))
        assert 0 in got["gemm0_local"]  # local tiles first: no wait at the head of the queue
        # GEMM1 items by their rows' home (here / a peer), together 0 .. n-1
        assert sorted(got["gemm1"] + got["gemm1_remote"]) == list(range(want["gemm1"] + want["gemm1_remote"]))
        assert want["gemm1_remote"] > 0 and got["combine"] == list(range(want["combine"]))
        for r in recs:
            assert 0 <= r["start"] <= r["waited"] <= r["end"], r
            assert r["layer"] == (0 if r["kind"] in ("send", "gemm0_local", "gemm0_remote") else 1)
            # Separate role launches here: sends/combine only on communication programs.
            on_comm = r["pid"] < n_comm[r["layer"]]
            assert on_comm == (r["kind"] in ("send", "combine")) and 0 <= r["pid"] < n_programs, r
        # Logical clock: layer0 before layer1, and the waits of remote tiles are recorded.
        assert max(r["end"] for r in recs if r["layer"] == 0) < min(r["start"] for r in recs if r["layer"] == 1)
        assert all(r["waited"] > r["start"] for r in recs if r["kind"] == "gemm0_remote")


def test_timeline_off_by_default():
    cfg = MoEConfig(hidden=16, ffn=16, num_experts=2, top_k=1, dtype=torch.float32)
    spec = BufferSpec(1, 2, 16, 1, 8, KC.block_m, KC.block_n1, cfg.dtype)
    eng = FusedEngine(cfg, simulated_world(spec)[0], KC, 4, 1, 1)
    assert eng.timeline is None
    with pytest.raises(RuntimeError, match="timeline is off"):
        eng.timeline_records()


def test_overlap_summary_and_png(tmp_path):
    assert covered([(0, 10)], [(5, 20)]) == 5
    assert covered([(0, 4), (2, 6), (10, 12)], [(1, 3), (3, 11)]) == 5 + 1
    rng = random.Random()
    n = rng.randrange(50, 100)

    def rec(layer, kind, pid, start, wait, dur):
        return {"layer": layer, "kind": kind, "pid": pid, "sm": pid, "item": 0, "start": start,
                "waited": start + wait, "end": start + wait + dur}

    # Sends [0, 1000) on program 0; GEMM0 on programs 1-3 from 500 ns: half the sends are covered.
    records = [rec(0, "send", 0, 100 * i, 0, 100) for i in range(10)]
    records += [rec(0, rng.choice(("gemm0_local", "gemm0_remote")), 1 + i % 3, 500 + 37 * i,
                    rng.randrange(0, 20) if i else 0, rng.randrange(60, 90)) for i in range(n)]
    records += [rec(1, "gemm1", 1 + i % 3, 5000 + 41 * i, 0, 40) for i in range(n)]
    records += [rec(1, "combine", 0, 5000 + 41 * n + 50 * i, 5, 45) for i in range(8)]
    s = summarize(records)
    assert s["send_under_gemm0"] == pytest.approx(0.5)
    assert s["combine_under_gemm1"] == 0.0
    assert s["kinds"]["send"]["items"] == 10 and s["kinds"]["combine"]["wait"] == 40
    path = tmp_path / "timeline_rank0.png"
    draw_timeline(records, str(path), "synthetic", splits=(1, 1), n_programs=4)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="no timeline records"):
        draw_timeline([], str(tmp_path / "empty.png"), "empty")


@pytest.mark.parametrize("tma_store", [False, True])
def test_peer_bandwidth_copy_kernel_copies_every_row_once(tma_store):
    """The NVLink bandwidth probe's row copy (interlace.tools.peer_bandwidth) copies every row and
    column with any program count, row counts not divisible by its step and rows not divisible by
    its column block; the destination starts poisoned. Bad shapes fail before any launch."""
    from interlace.tools.peer_bandwidth import copy_rows

    src = torch.randn(37, 80)
    for programs in (1, 3, 8):
        dst = torch.full_like(src, float("nan"))
        copy_rows(src, dst, programs, rows=8, cols=32, tma_store=tma_store)
        assert torch.equal(dst, src), programs
    with pytest.raises(ValueError, match="programs"):
        copy_rows(src, torch.empty_like(src), 0)
    with pytest.raises(ValueError, match="one dtype"):
        copy_rows(src, torch.empty(37, 80, dtype=torch.float64), 2)


# ---- the persistent kernel's task timeline (interlace.tools.task_timeline) -----------------------

def test_task_summary_utilization_and_png(tmp_path):
    """SM utilization = Σ (end − waited) of real tasks ÷ (programs × span): skips and waits are
    idle; a program that took no task still counts in the grid."""
    from interlace.kernels.persistent.dist_tasks import TIMELINE_KINDS
    from interlace.tools.task_timeline import draw_tasks, summarize_tasks

    def rec(kind, pid, start, waited, end, task=0):
        return {"kind": kind, "pid": pid, "sm": pid, "task": task, "start": start, "waited": waited, "end": end}

    records = [rec("gate", 0, 0, 0, 10), rec("send", 1, 2, 5, 15), rec("gemm0", 0, 10, 12, 40),
               rec("skip", 1, 15, 16, 18), rec("gemm1", 1, 18, 30, 50), rec("combine", 0, 40, 45, 60)]
    s = summarize_tasks(records, TIMELINE_KINDS, n_programs=3)
    busy = 10 + 10 + 28 + 20 + 15  # the skip's 2 ticks are not work
    assert s["busy"] == busy and s["span"] == 60 and s["programs"] == 3
    assert s["utilization"] == pytest.approx(busy / (3 * 60))
    assert s["wait"] == 3 + 2 + 1 + 12 + 5 and s["kinds"]["skip"] == {"tasks": 1, "busy": 2, "wait": 1}
    assert summarize_tasks(records, TIMELINE_KINDS)["programs"] == 2  # default: the programs seen
    assert summarize_tasks([], TIMELINE_KINDS)["utilization"] is None
    path = tmp_path / "tasks.png"
    draw_tasks(records, str(path), "synthetic", TIMELINE_KINDS, unit="ticks", scale=1.0, n_programs=3)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="no timeline records"):
        draw_tasks([], str(tmp_path / "empty.png"), "empty", TIMELINE_KINDS)


def test_persistent_cli_world1(tmp_path, capsys):
    """``python -m interlace.tools.timeline --strategy persistent`` at world size 1 (the
    interpreter): the same output with the timeline on and off, a PNG and a JSON whose records
    cover the call, the summary table printed last; bad flag combinations refused."""
    import json

    from interlace.tools.timeline import main, parse_args

    summary = main(["--strategy", "persistent", "--config", "mixtral-8x7b", "--small", "--tokens", "2",
                    "--calls", "2", "--iters", "0", "--out", str(tmp_path)])
    assert summary["same_output"] is True and 0 < summary["utilization"] <= 1
    out = capsys.readouterr().out
    assert "SM utilization" in out and "| 0 | 3 |" in out
    assert (tmp_path / "timeline_rank0.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "timeline_rank0.json").read_text())
    tasks = [dict(zip(data["fields"], r))["task"] for r in data["records"]]
    assert tasks == sorted(set(tasks)) and tasks[0] == 0
    assert parse_args(["--strategy", "persistent"]).tokens == 128 and parse_args([]).tokens == 16384
    for bad in (["--strategy", "persistent", "--routing", "skewed"], ["--programs", "4"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
