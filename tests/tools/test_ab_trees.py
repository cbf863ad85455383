"""benchmarks/ab_trees.py's pooling of rounds: the medians over rounds of both timings (a barrier
before each call, and calls back to back) and their ratios."""

import importlib.util
import os


def _ab_trees():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "ab_trees.py")
    spec = importlib.util.spec_from_file_location("ab_trees", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(ms, b2b):
    return dict(config="c", tokens=8, routing="random", mode="fwd", strategy="persistent", status="ok",
                median_ms=ms, back_to_back_ms=b2b, decode_floor_ms=0.05)


def test_medians_over_rounds_of_both_timings(capsys):
    ab = _ab_trees()
    rounds = [dict(round=i, tree=tree, rows=[_row(ms, b2b)])
              for i, (tree, ms, b2b) in enumerate([("old", 0.2, 0.10), ("new", 0.2, 0.08), ("old", 0.3, 0.14),
                                                   ("new", 0.2, 0.09), ("old", 0.2, 0.12), ("new", 0.1, 0.30)])]
    for r in rounds:
        r["round"] //= 2
    (row,) = ab.median_results("new", rounds, {})["rows"]
    # the back-to-back median of the new tree's three rounds, not its last round's 0.30
    assert row["back_to_back_ms"] == 0.09 and row["back_to_back_times_ms"] == [0.08, 0.09, 0.30]
    assert row["median_ms"] == 0.2 and abs(row["x_decode_floor"] - 4.0) < 1e-12
    assert abs(ab.print_table(["old", "new"], rounds, "back_to_back_ms") - (1 - 0.09 / 0.12)) < 1e-12
    assert abs(ab.print_table(["old", "new"], rounds) - 0.0) < 1e-12
    out = capsys.readouterr().out
    assert "back_to_back_ms (calls back to back)" in out and "median_ms (a barrier before each call)" in out
