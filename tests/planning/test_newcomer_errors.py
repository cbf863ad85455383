"""What a newcomer meets first: misspelled strategy options, a missing profile, tp_ep without
process groups, and the ``interlace`` / ``interlace plan`` command lines (CPU only)."""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch

from interlace import MoEConfig, MoELayer, env
from interlace.parallel.comm import ExpertParallel
from interlace.strategies import pipelined
from interlace.strategies.base import make_strategy
from interlace.tools import cli, evaluate, plan_cli, profile
from interlace.planning.monta.search import FUSED_NOTE
from interlace.planning.monta.simulate import OP_COLORS, legend_entries

CFG = MoEConfig(hidden=32, ffn=16, num_experts=4, top_k=2, dtype=torch.float32)


@pytest.mark.parametrize("spec, accepted", [("pipelined:x", "pipelined:auto"), ("pipelined:-2", r"in 1\.\.16 .*got -2"),
                                            ("pipelined:0", r"in 1\.\.16 \(e\.g\. 'pipelined:4'\)"),
                                            ("tp_ep:O2-x", "tp_ep:O2-4")])
def test_a_bad_strategy_argument_says_what_is_accepted(spec, accepted):
    with pytest.raises(ValueError, match=accepted):
        make_strategy(spec, CFG, ExpertParallel(None, 0, 1, 4))


def test_missing_profile_is_warned_about_once_per_process(tmp_path, monkeypatch):
    monkeypatch.setattr(pipelined, "_WARNED_NO_PROFILE", set())
    monkeypatch.setenv("INTERLACE_PROFILE_DIR", str(tmp_path))
    env.refresh()
    ep = ExpertParallel(None, 0, 2, 2)  # a rank of 2: planning needs the profile, no group is used

    def warnings_of(make_strategy_once):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):  # several layers, several token counts and modes each
                strategy = make_strategy_once()
                for tokens in (8, 16, 32):
                    assert strategy.degree_for(tokens, "fwd") == strategy.degree_for(tokens, "fwdbwd") == 1
        return [str(w.message) for w in caught if "profile" in str(w.message)]

    found = warnings_of(lambda: pipelined.PipelinedStrategy(CFG, ep))
    assert len(found) == 1 and "no performance profile" in found[0]
    assert warnings_of(lambda: pipelined.PipelinedStrategy(CFG, ep)) == []  # still this process
    # Another missing profile (another machine key or path) is news: warned about once too.
    missing = str(tmp_path / "no-such-profile.json")
    found = warnings_of(lambda: pipelined.PipelinedStrategy(CFG, ep, profile=missing))
    assert len(found) == 1 and "no-such-profile" in found[0]


def test_tp_ep_without_process_groups_says_what_to_pass():
    with pytest.raises(ValueError, match=r"init_process_group.*MoEMesh.build"):
        MoELayer(CFG, strategy="tp_ep:O1", device="cpu")


def _options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("make_parser", [plan_cli.parser, evaluate.parser, profile.parser])
def test_every_command_line_option_has_help(make_parser):
    undocumented = [a.option_strings or a.dest for a in _options(make_parser()) if not (a.help or "").strip()]
    assert not undocumented


def _options_without_help(help_text: str) -> list[str]:
    """The options of an argparse ``--help`` text that have no help: an option line (two spaces,
    a dash) with nothing after its invocation and no more indented line under it."""
    lines = help_text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    bare = []
    for line, below in zip(lines, lines[1:] + [""]):
        invocation, _, text = line.strip().partition("  ")
        if line.startswith("  -") and not text.strip() and not below.startswith("    "):
            bare.append(invocation)
    return bare


@pytest.mark.parametrize("command", ["", *cli.COMMANDS])
def test_help_is_plain_text_with_every_option_explained(command, capsys):
    """``interlace --help`` and ``interlace <command> --help``: exit 0, no reST markup (the text is
    printed as is), help on every option and the defaults shown."""
    try:
        code = cli.main([command, "--help"] if command else ["--help"])
    except SystemExit as exit_:  # (argparse exits after printing the help)
        code = exit_.code
    out = capsys.readouterr().out
    assert code == 0
    for markup in ("``", "`", ":func:", ":class:", ":mod:", ":meth:"):
        assert markup not in out, (command, markup)
    if command:
        assert out.startswith(f"usage: interlace {command} ")
        assert _options_without_help(out) == []
    if command == "bench":
        assert "timed calls per strategy and case, the median reported (default: 20)" in " ".join(out.split())


def test_interlace_without_a_command_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: interlace <command>" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0 and "plan" in capsys.readouterr().out
    assert cli.main(["no-such-command"]) == 2


def test_plan_without_arguments_prints_usage_and_fails(capsys):
    assert plan_cli.main([]) == 2
    err = capsys.readouterr().err
    assert "usage: interlace plan" in err and "--model and --cluster" in err
    assert plan_cli.main(["--model", "mixtral-8x7b"]) == 2
    assert "give --cluster" in capsys.readouterr().err


def test_plan_table_has_no_duplicate_fused_rows_and_explains_its_abbreviations(capsys):
    assert plan_cli.main(["--model", "mixtral-8x7b", "--cluster", "h100x1024", "--out", "", "--top", "40"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 40 and not any(r[3] == "fused" for r in rows)
    # No two rows are the same choice (layout, form, strategy), and none repeats another's times
    # under a different strategy name.
    assert len({(r[1], r[2], r[3]) for r in rows}) == len(rows)
    assert out.count(FUSED_NOTE) == 1
    legend = out[out.index("legend:"):]
    for abbreviation in ("CPcv", "O0", "O1", "O2×n", "pipelined:r", "MoE step ms", "GiB/GPU"):
        assert abbreviation in legend
    assert out.index("legend:") > out.index(rows[-1][1])  # under the table
    with pytest.raises(ValueError, match="pass sequential too"):
        from interlace.planning.monta.cluster import cluster_preset
        from interlace.planning.monta.model import MODEL_PRESETS
        from interlace.planning.monta.search import Planner, TrainSetup

        Planner(cluster_preset("h200x2"), MODEL_PRESETS["qwen2-moe"], TrainSetup(), ("fused",))


def test_timeline_legend_lists_only_what_is_drawn():
    rows = [("compute", "fwd:route+sync", 0.0, 0.1), ("compute", "fwd:expert", 0.1, 1.0),
            ("a2a", "bwd:A2A", 1.0, 1.2), ("compute", "bwd:prep", 1.2, 1.3)]
    entries = legend_entries(rows)
    assert [k for k, _ in entries] == ["A2A", "expert", "route+sync", "prep"]
    assert dict(entries)["A2A"] == OP_COLORS["A2A"] and "AG" not in dict(entries)
