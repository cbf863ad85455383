"""The scaling scripts on CPU: the EP×TP mesh bench at 4 ranks and the weak-scaling report from
harness results at two world sizes (timings here are host wall time, checked only for shape)."""

import json
import os
import sys

import pytest

from helpers import run_gloo

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def _mesh_bench(rank, world, out):
    sys.path.insert(0, SCRIPTS)
    import mesh_bench

    mesh_bench.main(["--config", "qwen2-moe", "--small", "--layer-tokens", "8", "--warmup", "0", "--iters", "1",
                     "--out", out])


def test_mesh_bench_times_every_factorisation_of_four_ranks(tmp_path):
    run_gloo(_mesh_bench, 4, str(tmp_path))
    rows = json.loads((tmp_path / "mesh_bench.json").read_text())
    got = {(r["ep"], r["tp"], r["strategy"]) for r in rows}
    forms = [f"tp_ep:O{i}" for i in range(4)]
    want = {(4, 1, "sequential"), (4, 1, "fused")} | {(ep, tp, f) for ep, tp in ((2, 2), (1, 4)) for f in forms}
    assert got == want
    # COMET Fig. 12's comparison: the layer holds 8 distinct tokens on every mesh, each rank 8 / EP
    assert all(r["ms"] > 0 and r["world"] == 4 and r["layer_tokens"] == 8 and r["tokens"] == 8 // r["ep"]
               for r in rows)
    assert all(r["ok"] and r["rel_err_vs_first"] < 1e-5 for r in rows)
    assert any(r["rel_err_vs_first"] > 0 for r in rows)  # the forms really differ in their arithmetic


def _bench(rank, world, out):
    from interlace.tools.bench import main

    main(["--small", "--configs", "qwen2-moe", "--tokens", "4", "--strategies", "naive", "sequential",
          "--warmup", "1", "--iters", "3", "--out", out])


def test_weak_scaling_report_divides_the_smallest_worlds_times(tmp_path, capsys):
    sys.path.insert(0, SCRIPTS)
    import scaling_report

    one, two = tmp_path / "w1", tmp_path / "w2"
    _bench(0, 1, str(one))
    run_gloo(_bench, 2, str(two))
    paths = [str(one / "results.json"), str(two / "results.json")]
    ms = {}
    for p in paths:
        data = json.loads(open(p).read())
        ms[data["meta"]["world"]] = {r["strategy"]: r["median_ms"] for r in data["rows"]}
    for given in (paths, paths[::-1]):  # any order of files: the smallest world is the base
        capsys.readouterr()
        scaling_report.main(given)
        out = capsys.readouterr().out.splitlines()
        assert out[0].endswith("| strategy | T(1)/T(2) |")
        lines = [ln for ln in out if ln.startswith("| qwen2-moe")]
        assert len(lines) == 2
        for line in lines:
            cells = [c.strip() for c in line.strip("|").split("|")]
            strategy, ratio = cells[4], float(cells[5])
            assert ratio == pytest.approx(ms[1][strategy] / ms[2][strategy], abs=0.006)
    with pytest.raises(SystemExit, match="at least two world sizes"):
        scaling_report.main(paths[:1])
