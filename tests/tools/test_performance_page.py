"""docs/performance.md is generated from benchmarks/results/ by benchmarks/performance_page.py: the page in
the tree must be exactly what the generator writes from the shipped sources, so it cannot drift from them."""

import importlib.util
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
