"""Predicted vs measured TP×EP layer times: ``python benchmarks/compare_tp_ep.py OUT/tp_ep.json``.

Reads the measured medians written by ``benchmarks/device_tp_ep.py`` (its "times" list of
{"config", "tokens", "mesh": "tp2xep1", "strategy": "tp_ep:O2-4" | "sequential", "median_ms"},
forward only) and prints, per row, the
planner's prediction (``interlace.planning.monta.layer.predict_layer_ms`` with the shipped 2×H200 profile,
or ``--cluster h200x2`` for the profile-free cluster description), the ratio and the median
|predicted/measured − 1|. Rows are found leniently: a list of records (or a dict holding one
under "rows"/"results"), each with a config name, tokens, tp, ep, a form (O0–O3, or a strategy
such as "tp_ep:O2-4" / "sequential") and a median in ms.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from interlace.config import preset  # noqa: E402
from interlace.planning.monta.layer import predict_layer_ms  # noqa: E402
from interlace.planning.profile import load_profile  # noqa: E402


def _get(rec: dict, *names, default=None):
    for n in names:
        if n in rec:
            return rec[n]
    return default


def records(data) -> list[dict]:
    if isinstance(data, dict):
        for key in ("times", "rows", "results", "records", "timings"):
            if isinstance(data.get(key), list):
                return data[key]
        return [v for v in data.values() if isinstance(v, dict)]
    return list(data)


def form_and_strategy(rec: dict) -> tuple[str, str]:
    text = str(_get(rec, "form", "strategy", "variant", default="O0"))
    m = re.search(r"O([0-3])(?:[-:](\d+))?", text)
    form = f"O{m[1]}" + (f":{m[2]}" if m and m[2] else "") if m else "O0"
    if form.startswith("O2") or form.startswith("O3"):
        if ":" not in form:
            form += ":2"  # tp_ep's default chunk count
    p = re.search(r"pipelined:(\d+)", text)
    return form, (f"pipelined:{p[1]}" if p else "sequential")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="measured tp_ep.json of benchmarks/device_tp_ep.py")
    ap.add_argument("--cluster", default=None, help="predict from a cluster preset instead of the shipped profile")
    ap.add_argument("--profile", default=None,
                    help="predict from this profile JSON (e.g. one with TP shard classes from "
                         "`benchmarks/device_tp_ep.py --profile-tp`) instead of the shipped one")
    args = ap.parse_args(argv)
    source = args.cluster
    if args.profile:
        source = load_profile(2, path=args.profile)
    path = Path(args.json)
    if not path.exists():
        print(f"{path} not found (benchmarks/device_tp_ep.py writes it)", file=sys.stderr)
        return 2
    rows, errors = [], []
    for rec in records(json.loads(path.read_text())):
        ms = _get(rec, "median_ms", "ms", "median", "time_ms")
        name = _get(rec, "config", "preset", "model")
        if ms is None or name is None or _get(rec, "priority", default=None) is not None:
            continue
        mesh = re.fullmatch(r"tp(\d+)xep(\d+)", str(_get(rec, "mesh", default="")))
        tp = int(mesh[1]) if mesh else int(_get(rec, "tp", default=1))
        ep = int(mesh[2]) if mesh else int(_get(rec, "ep", default=1))
        tokens = int(_get(rec, "tokens", "T"))
        form, strategy = form_and_strategy(rec)
        backward = str(_get(rec, "mode", default="fwd")) in ("fwdbwd", "fwd+bwd", "train")
        pred = predict_layer_ms(preset(name), tokens, tp, ep, form, strategy, source, backward=backward)
        err = pred / float(ms) - 1
        errors.append(abs(err))
        rows.append((name, tokens, tp, ep, form, strategy, float(ms), pred, err))
    if not rows:
        print(f"no usable rows in {path}", file=sys.stderr)
        return 2
    print("| config | tokens | TP | EP | form | strategy | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tokens, tp, ep, form, strategy, ms, pred, err in rows:
        print(f"| {name} | {tokens} | {tp} | {ep} | {form} | {strategy} | {ms:.3f} | {pred:.3f} | {100 * err:+.1f}% |")
    print(f"\nmedian |predicted/measured - 1| = {100 * statistics.median(errors):.1f}% over {len(errors)} rows")
    for label, keep in (("TP=1", lambda row: row[2] == 1), ("TP>1", lambda row: row[2] > 1)):
        part = [abs(row[-1]) for row in rows if keep(row)]
        if part:
            print(f"  {label} rows: {100 * statistics.median(part):.1f}% over {len(part)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
