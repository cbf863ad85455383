"""The fused strategy's block split (communication vs GEMM programs), profiled per shape.

``interlace tune`` (:mod:`interlace.tools.tune_fused`) measures the layer for a set of
``(n_comm, n_comm1)`` splits and stores the fastest as JSON entries keyed by

    (hidden, ffn, experts, top_k, world size, device SM count)  →  per tokens-per-GPU bucket

in ``interlace/tuning/fused-split-*.json`` (package data) or ``$INTERLACE_TUNING_DIR``. At run
time the nearest tokens bucket of the matching key is used. A shape never tuned takes the split
of the nearest tuned shape of the same world size and SM count (log distance over hidden, FFN,
experts per rank and top-k: the split balances a tile's communication against its GEMM work,
which those set), and the strategy reports where it came from (``split_source``). Only where
nothing was tuned for this world size and SM count does it use the untuned default, saying so
once (a warning) with ``split_source == "default"``.
"""

from __future__ import annotations

import json
import math
import os
import re
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


def _shape_distance(key: str, other: str) -> float | None:
    """Log distance between two split keys of the same world size and SM count, else None."""
    pa, pb = _parse_key(key), _parse_key(other)
    if pa is None or pb is None or pa[4:] != pb[4:]:
        return None
    (n, k, e, top), (n2, k2, e2, top2) = pa[:4], pb[:4]
    w = pa[4]
    return (abs(math.log(n / n2)) + abs(math.log(k / k2)) + abs(math.log((e / w) / (e2 / w)))
            + abs(math.log(top / top2)))


def _parse_key(key: str) -> tuple[int, ...] | None:
    m = re.fullmatch(r"N(\d+)-K(\d+)-E(\d+)-k(\d+)-w(\d+)-sm(\d+)", key)
    return None if m is None else tuple(int(g) for g in m.groups())


def find_split(config, tokens: int, world: int, sm_count: int) -> tuple[tuple[int, int] | None, str]:
    """(n_comm, n_comm1) and where it came from: ``"tuned"`` (this shape's nearest tokens bucket,
    log distance), ``"tuned for <key>"`` (the nearest tuned shape of the same world size and SM
    count), or (None, ``"default"``) with a warning once where nothing of this world size and
    SM count was tuned."""
    key = split_key(config, world, sm_count)
    entries = load_entries()
    buckets, source = entries.get(key), "tuned"
    if not buckets:
        near = [(d, other) for other in entries if (d := _shape_distance(key, other)) is not None]
        if near:
            _, other = min(near)
            buckets, source = entries[other], f"tuned for {other}"
    if not buckets:
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"interlace: no tuned fused block split for {key} nor for any shape at world {world} "
                          f"with {sm_count} SMs; using the default (run `interlace tune` on this machine)",
                          stacklevel=3)
        return None, "default"
    best = min(buckets, key=lambda b: abs(math.log(max(int(b), 1)) - math.log(max(tokens, 1))))
    n_comm, n_comm1 = buckets[best][:2]
    return (int(n_comm), int(n_comm1)), source


def lookup_split(config, tokens: int, world: int, sm_count: int) -> tuple[int, int] | None:
    """:func:`find_split`'s split alone."""
    return find_split(config, tokens, world, sm_count)[0]


def write_entries(path: Path, new: dict[str, dict[str, list[int]]], meta: dict) -> None:
    """Merge ``new`` into the JSON file at ``path`` (created if missing)."""
    data = json.loads(path.read_text()) if path.exists() else {"entries": {}}
    for key, buckets in new.items():
        data["entries"].setdefault(key, {}).update(buckets)
    data["meta"] = meta
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
