"""The fused strategy's block split (communication vs GEMM programs), profiled per shape.

``interlace tune`` (:mod:`interlace.tools.tune_fused`) measures the layer for a set of
``(n_comm, n_comm1)`` splits and stores the fastest as JSON entries keyed by

    (hidden, ffn, experts, top_k, world size, device SM count)  →  per tokens-per-GPU bucket

in ``interlace/tuning/fused-split-*.json`` (package data) or ``$INTERLACE_TUNING_DIR``. At run
time the nearest tokens bucket of the matching key is used; with no matching key the strategy
uses an untuned default, says so once (a warning) and reports ``split_source == "default"``.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from interlace.env import settings

PACKAGE_DIR = Path(__file__).resolve().parent
_WARNED: set = set()


def tuning_dirs() -> list[Path]:
    dirs = [PACKAGE_DIR]
    extra = settings().tuning_dir
    if extra:
        dirs.insert(0, Path(extra))
    return dirs


def split_key(config, world: int, sm_count: int) -> str:
    return f"N{config.hidden}-K{config.ffn}-E{config.num_experts}-k{config.top_k}-w{world}-sm{sm_count}"


def load_entries() -> dict[str, dict[str, list[int]]]:
    """key → {tokens bucket (str) → [n_comm, n_comm1]} from every fused-split file."""
    entries: dict[str, dict[str, list[int]]] = {}
    for d in reversed(tuning_dirs()):  # the override directory wins
        for path in sorted(d.glob("fused-split-*.json")) if d.is_dir() else []:
            data = json.loads(path.read_text())
            for key, buckets in data.get("entries", {}).items():
                entries.setdefault(key, {}).update(buckets)
    return entries


def lookup_split(config, tokens: int, world: int, sm_count: int) -> tuple[int, int] | None:
    """Tuned (n_comm, n_comm1) for the nearest tokens bucket (log distance), or None + a warning."""
    key = split_key(config, world, sm_count)
    buckets = load_entries().get(key)
    if not buckets:
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"interlace: no tuned fused block split for {key}; using the default "
                          f"(run `interlace tune` on this machine)", stacklevel=3)
        return None
    best = min(buckets, key=lambda b: abs(math.log(max(int(b), 1)) - math.log(max(tokens, 1))))
    n_comm, n_comm1 = buckets[best][:2]
    return int(n_comm), int(n_comm1)


def write_entries(path: Path, new: dict[str, dict[str, list[int]]], meta: dict) -> None:
    """Merge ``new`` into the JSON file at ``path`` (created if missing)."""
    data = json.loads(path.read_text()) if path.exists() else {"entries": {}}
    for key, buckets in new.items():
        data["entries"].setdefault(key, {}).update(buckets)
    data["meta"] = meta
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
