"""Score the planner's layer model against measured layer times kept in a profile.

    python -m interlace.planning.monta.validate [--cluster h200x2] [--profile PATH]

``SHIPPED`` (``interlace/tuning/profiles/runs/``) is a 2×H200 profile from one lease, kept for
its raw layer timings alone (per shape class: tokens, top-k, pipeline degree r, measured ms of a
forward at TP = 1 / EP = 2). This prints, per degree, the median |predicted/measured − 1| of
:func:`interlace.planning.monta.layer.predict_layer_ms` with a cluster description (no profile:
the profile-free path ``interlace plan`` uses for clusters we do not have). The profile's own
calibrated model is fitted on these points, so it is not scored here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from interlace.config import MoEConfig
from interlace.planning.profile import PACKAGED_DIR, parse_shape_key
from interlace.planning.monta.cluster import load_cluster
from interlace.planning.monta.layer import predict_layer_ms

# One lease's points alone: the shipped default pools several leases, and its wider spread of
# host-bound points would blur what this scores (the cluster model, not lease-to-lease drift).
SHIPPED = PACKAGED_DIR / "runs" / "run7-NVIDIA_H200-sm132-w2-n1-p2p.json"


def score(cluster, profile_json: dict) -> dict[int, list[float]]:
    """Signed relative errors per pipeline degree."""
    world = profile_json["world"]
    errors: dict[int, list[float]] = {}
    for key, shape in profile_json["shapes"].items():
        n, k, e_local, act = parse_shape_key(key)
        for tokens, top_k, r, ms in shape["calibration"]:
            cfg = MoEConfig(hidden=n, ffn=k, num_experts=e_local * world, top_k=top_k, activation=act)
            strategy = "sequential" if r == 1 else f"pipelined:{r}"
            pred = predict_layer_ms(cfg, tokens, 1, world, "O0", strategy, cluster)
            errors.setdefault(r, []).append(pred / ms - 1)
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="h200x2", help="cluster preset or JSON file whose model is scored")
    ap.add_argument("--profile", default=str(SHIPPED), help="profile JSON whose raw layer timings are the truth")
    args = ap.parse_args(argv)
    errors = score(load_cluster(args.cluster), json.loads(open(args.profile).read()))
    print("| degree | points | median abs error | median signed error |")
    print("|---|---|---|---|")
    for r in sorted(errors):
        e = errors[r]
        print(f"| {r} | {len(e)} | {100 * statistics.median(abs(x) for x in e):.1f}% | "
              f"{100 * statistics.median(e):+.1f}% |")
    every = [abs(x) for e in errors.values() for x in e]
    print(f"\nall degrees: median abs error {100 * statistics.median(every):.1f}% over {len(every)} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
