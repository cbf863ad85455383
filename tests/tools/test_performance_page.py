"""docs/performance.md is generated from benchmarks/results/ by benchmarks/performance_page.py: the page in
the tree must be exactly what the generator writes from the shipped sources, so it cannot drift from them."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generator():
    spec = importlib.util.spec_from_file_location("performance_page",
                                                  os.path.join(ROOT, "benchmarks", "performance_page.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_equals_what_the_generator_writes(tmp_path):
    out = tmp_path / "performance.md"
    assert _generator().main(["--out", str(out)]) == 0
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        shipped = f.read()
    assert out.read_text() == shipped, "docs/performance.md is stale: run python benchmarks/performance_page.py"


def test_every_source_file_is_shipped_and_each_section_is_present():
    gen = _generator()
    for src in gen.SOURCES:
        for name in src.get("files") or [src["file"]]:
            assert os.path.exists(os.path.join(gen.RESULTS, name)), name
    page = gen.render()
    for _, title, _ in gen.SECTIONS:
        assert f"## {title}" in page


def test_a_later_source_with_the_same_table_key_replaces_the_earlier_one():
    gen = _generator()
    first = dict(gen.SOURCES[0])
    newer = dict(first, title="A newer run of the same table", date="2099-01-01", commit="abcdef0")
    page = gen.render(gen.SOURCES + [newer])
    assert "A newer run of the same table" in page and first["title"] not in page
    assert page.count("### ") == gen.render().count("### ")


def test_new_kinds_draw_their_scripts_rows_and_show_missing_parts_as_dashes(tmp_path, monkeypatch):
    gen = _generator()
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))
    hf = {"rows": [{"model": "m", "part": "forward", "skipped": "budget"},
                   {"model": "m", "layers": 2, "optimizer": "sgd", "part": "train", "impl": "hf", "step_s_median": 0.3},
                   {"model": "m", "layers": 2, "optimizer": "sgd", "part": "train", "impl": "interlace",
                    "step_s_median": 0.1},
                   {"model": "m", "part": "train", "impl": "baseline", "strategy": "sequential",
                    "step_s_median": 0.12},
                   {"model": "m", "part": "compile", "error": "boom"}]}
    (tmp_path / "hf.json").write_text(json.dumps(hf))
    grid = [dict(kind="grid", config=f"c{i}", tokens=128, mode="fwd", fastest="fused", fastest_ms=1.0,
                 times_ms={"fused": 1.0, "sequential": 1.5}, auto_choice=choice, auto_ms=ms, ratio=ms,
                 calibration_calls=9, overhead_ms=over, ok=True)
            for i, (choice, ms, over) in enumerate([("fused", 1.02, 5.0), ("sequential", 1.6, 7.0),
                                                     ("fused", 1.1, 30.0)])]
    presets = [dict(kind="preset", config="p", tokens=t, old_choice="sequential", old_ms=2.0, new_choice="fused",
                    new_ms=ms, ratio=ms / 2.0, overhead_ms=3.0) for t, ms in ((4096, 1.0), (16384, 2.2))]
    (tmp_path / "grid.jsonl").write_text("\n".join(map(json.dumps, grid + presets)) + "\n")
    src = dict(section="x", table="t", title="T", date="d", commit="c", device="dev", command="cmd")
    hf_lines = "\n".join(gen.hf_models_table(dict(src, file="hf.json")))
    assert "| m | 2 | sgd | – | – | – | 300.0 | 100.0 | 3.00 | 1.20 | – (–) | – | – | – |" in hf_lines
    grid_lines = gen.auto_grid_table(dict(src, file="grid.jsonl"))
    summary = grid_lines[8]
    assert summary.startswith("3 rows over 3 shapes; auto within 5% of the fastest candidate on 1 (33%); "
                              "worst auto ÷ fastest 1.600")
    assert "Preset rows: 2; new ÷ old median 0.800, worst 1.100; new slower than old by more than 5% on 1." in grid_lines
    assert "| p | 16384 | sequential | 2.000 | fused | 2.200 | 1.100 | 3.0 |" in grid_lines
    assert "ran the fastest candidate on 2 of 3" in summary and "median 100 µs per call" in summary
    assert "overhead median 7.0 ms, max 30.0 ms" in summary


def test_decode_bench_draws_one_line_per_case_with_every_strategy_and_the_decode_floor(tmp_path, monkeypatch):
    gen = _generator()
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))

    def case(tokens, floor, weight_bytes, ms, choice):
        rows = []
        for strategy, t in ms.items():
            status = "WRONG" if t is None else "ok"
            rows.append(dict(config="c", tokens=tokens, routing="random", mode="fwd", strategy=strategy, world=2,
                             status=status, median_ms=t, floor_ms=None if t is None else floor,
                             weight_bytes=None if t is None else weight_bytes,
                             choice=choice if strategy == "auto" else None))
        return rows

    # 4 TB/s HBM; peer latency 5 µs (two of them: 0.010 ms)
    rows = (case(128, 0.1, 2_000_000_000, dict(naive=2.0, fused=1.0, sequential=1.5, persistent=0.6, auto=1.02),
                 "fused (measured, calibration 3.0 ms over the winner)")  # floor 0.5 ms: HBM term
            + case(8, 0.01, 400_000_000, dict(naive=0.9, persistent=0.4, fused=0.3, sequential=None, auto=0.41),
                   "persistent (predicted)")  # floor 0.1 ms: persistent 4×, fused fastest
            + case(1, 0.001, 4_000_000, dict(naive=0.5, fused=0.05, sequential=0.08, persistent=0.035, auto=0.05),
                   "fused (predicted)"))  # floor 0.010 ms: the two peer latencies; persistent within 30 µs
    rows.append(dict(rows[0], mode="fwdbwd", median_ms=9.0))  # training rows are not decode rows
    meta = dict(world=2, device="GPU", ceilings=dict(matmul_tflops=900.0, peer_gbps=400.0, hbm_tbps=4.0,
                                                      peer_latency_us=5.0))
    (tmp_path / "d.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    src = dict(section="decode", table="t", title="T", date="d", commit="c", file="d.json")
    lines = gen.decode_bench_table(src)
    assert ("| config | tokens/GPU | naive ms | fused ms | sequential ms | persistent ms | auto ms | decode floor ms "
            "| persistent × decode floor | fastest | fastest × decode floor | auto ran |") in lines
    assert "| c | 128 | 2.000 | 1.000 | 1.500 | 0.600 | 1.020 | 0.500 | 1.20 | persistent | 1.20 | fused (measured) |" in lines
    assert "| c | 8 | 0.900 | 0.300 | WRONG | 0.400 | 0.410 | 0.100 | 4.00 | fused | 3.00 | persistent (predicted) |" in lines
    assert "| c | 1 | 0.500 | 0.050 | 0.080 | 0.035 | 0.050 | 0.010 | 3.50 | persistent | 3.50 | fused (predicted) |" in lines
    assert sum(line.startswith("| c |") for line in lines) == 3
    summary = next(line for line in lines if line.startswith("HBM read bandwidth"))
    assert summary == ("HBM read bandwidth (this run): 4.00 TB/s; peer latency in the floor: 5.0 µs. `persistent` "
                       "fastest on 2 of 3 rows; within 1.5× the decode floor at ≥ 128 tokens on 1 of 1; within 2× "
                       "or 30 µs of it below 128 tokens on 1 of 2.")
    # A source may leave a mis-measured peer latency out: the 1-token floor is then its HBM term, 0.001 ms.
    lines = gen.decode_bench_table(dict(src, peer_latency_us=None))
    assert "| c | 1 | 0.500 | 0.050 | 0.080 | 0.035 | 0.050 | 0.001 | 35.00 | persistent | 35.00 | fused (predicted) |" in lines
    # timing="back_to_back" reads the rows' back-to-back times (half the barrier-timed ones here).
    for r in rows:
        r["back_to_back_ms"] = None if r["median_ms"] is None else r["median_ms"] / 2
    (tmp_path / "d.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    lines = gen.decode_bench_table(dict(src, timing="back_to_back"))
    assert "| c | 128 | 1.000 | 0.500 | 0.750 | 0.300 | 0.510 | 0.500 | 0.60 | persistent | 0.60 | fused (measured) |" in lines


def test_the_page_opens_with_the_summary_and_stays_within_30_kb():
    gen = _generator()
    page = gen.render()
    assert len(page.encode()) <= 30 * 1024, "docs/performance.md is over 30 KB: drop or shorten a table in SOURCES"
    first_table = page.index("\n| ")
    assert page.index("\n## ") > first_table  # the summary table comes before any section
    assert page[first_table:].startswith("\n| preset | regime | tokens/GPU | fastest | × floor | speed-up over naive |")


def test_summary_takes_the_fastest_per_preset_and_regime_and_shows_dashes_where_a_reference_is_missing(
        tmp_path, monkeypatch):
    gen = _generator()
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))

    def row(config, tokens, strategy, ms, x, mode="fwd"):
        return dict(config=config, tokens=tokens, routing="random", mode=mode, strategy=strategy, status="ok",
                    median_ms=ms, x_floor=x)

    prefill = [row("c", 100, "naive", 4.0, 4.0), row("c", 100, "sequential", 3.0, 3.0),
               row("c", 100, "fused", 2.0, 2.0), row("c", 100, "auto", 1.0, 1.0),  # auto is never "fastest"
               row("c", 200, "naive", 9.0, 3.0), row("c", 200, "sequential", 3.0, 1.0),
               row("c", 200, "fused", 4.5, 1.5), row("c", 400, "naive", 8.0, 2.0), row("c", 400, "fused", 2.0, 0.5)]
    training = [row("c", 100, "sequential", 6.0, 1.5, "fwdbwd"), row("c", 100, "tutel", 12.0, 3.0, "fwdbwd")]
    (tmp_path / "p.json").write_text(json.dumps(dict(meta=dict(world=2, device="GPU"), rows=prefill)))
    (tmp_path / "t.json").write_text(json.dumps(dict(meta=dict(world=2, device="GPU"), rows=training)))
    src = dict(kind="bench", date="d", commit="c0", command="cmd")
    chosen = [dict(src, section="prefill", table="p", file="p.json", title="P"),
              dict(src, section="training", table="t", file="t.json", title="T")]
    monkeypatch.setattr(gen, "SUMMARY", (("decode", "absent"), ("prefill", "p"), ("training", "t")))
    lines = gen.summary_table(chosen)
    assert "| c | prefill | 100, 200, 400 | `fused` (`sequential` at 200) | 0.50–2.00 | 2.00–4.00× | — |" in lines
    assert "| c | training | 100 | `sequential` | 1.50 | — | 2.00× |" in lines
    assert not any("| decode |" in line for line in lines)
    assert "- training: *T* (d, 2× GPU, commit `c0`), × the training floor (3× the FLOPs term)." in lines
    assert "- Over `naive`: — where the run behind the row has no `naive` row." in lines
    assert "- Over Tutel: — where the run behind the row has no `tutel` row." in lines
    assert lines[0] == "| preset | regime | tokens/GPU | fastest | × floor | speed-up over naive | over Tutel |"
    # without any tutel row: no such column
    (tmp_path / "t.json").write_text(json.dumps(dict(meta=dict(world=2, device="GPU"), rows=training[:1])))
    lines = gen.summary_table(chosen)
    assert lines[0] == "| preset | regime | tokens/GPU | fastest | × floor | speed-up over naive |"
    assert "| c | training | 100 | `sequential` | 1.50 | — |" in lines and not any("Tutel" in x for x in lines)


def test_fp8_layer_table_puts_each_fp8_row_beside_the_fastest_bf16_one(tmp_path, monkeypatch):
    """A bench run with --fp8: per case the fastest bf16 strategy (auto and naive aside), each FP8
    strategy × its own floor, auto's pick, and the fastest FP8 row's speed-up; back-to-back timing
    reads back_to_back_ms against the decode floors; a WRONG row shows as a dash."""
    gen = _generator()
    monkeypatch.setattr(gen, "RESULTS", str(tmp_path))

    def row(strategy, experts, ms, floor, b2b=None, status="ok", choice=None):
        return dict(config="m", tokens=128, strategy=strategy, experts=experts, status=status, median_ms=ms,
                    floor_ms=floor, back_to_back_ms=b2b, decode_floor_ms=floor / 2, choice=choice)

    rows = [row("naive", "bf16", 9.0, 1.0, 9.0), row("fused", "bf16", 4.0, 1.0, 3.0),
            row("persistent", "bf16", 5.0, 1.0, 2.0), row("auto", "bf16", 1.0, 1.0, 1.0),
            row("sequential", "fp8", 2.0, 0.5, 2.5), row("persistent", "fp8", 3.0, 0.5, 1.0, status="WRONG"),
            row("auto", "fp8", 2.1, 0.5, 2.6, choice="sequential (measured)")]
    (tmp_path / "f.json").write_text(json.dumps({"meta": {"ceilings": {"fp8_tflops": 1300.0}}, "rows": rows}))
    src = dict(section="fp8", table="t", kind="fp8_layer", file="f.json", title="T", device="d", date="x",
               commit="c", command="cmd")
    lines = gen.fp8_layer_table(src)
    assert "| m | 128 | fused 4.000 (4.00) | 2.000 (4.00) | 2.100 (4.20, sequential) | 2.00× |" in lines
    lines = gen.fp8_layer_table(dict(src, timing="back_to_back"))
    assert "| m | 128 | persistent 2.000 (4.00) | 2.500 (10.00) | 2.600 (10.40, sequential) | 0.80× |" in lines
