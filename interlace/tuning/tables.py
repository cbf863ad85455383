"""Kernel configurations by shape: measured tables, nearest-bucket lookup, a warned fallback.

A table is a JSON file (in ``interlace/tuning/`` or ``$INTERLACE_TUNING_DIR``) for one
(kernel, device name, SM count, Triton version). Each entry gives the best measured config for
a shape class — hidden N, FFN K, experts per rank, activation — and a rows-per-expert bucket
(powers of two). Lookup takes the entry of the same shape class with the nearest bucket (in
log2), else the nearest shape class. With no table for this device and Triton version it
borrows the table of the nearest kin, in this order: the same device and SM count under
another Triton version; then a device of the same compute capability (the table's
``meta["capability"]``), nearest SM count, the same Triton version first (an H100 runs the
H200's configs: the same SM architecture, so the same tiles fit). Only where nothing is kin does
it return the kernel's default. Either way it warns once, naming what is missing and what it
uses instead — never a silent fallback. ``interlace tune-experts`` measures and writes the tables.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from interlace.env import settings

PACKAGED_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GemmConfig:
    """One expert GEMM kernel's launch configuration (a tuning table entry's ``config``).

    The fields after the block sizes choose a kernel form; a form applies where the kernel and
    the operands allow it (TMA fields need TMA weights, :func:`interlace.kernels.tma.use_tma`)
    and is ignored elsewhere, except the combinations :func:`interlace.kernels.expert_gemm.configs.check_config`
    refuses."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles per L2 swizzle group of the persistent GEMMs
    # d(pre-activation) GEMM only, SwiGLU: 1 = store d(act) and apply the derivative in a
    # separate elementwise pass instead of the epilogue (expert_gemm.backward.launch_d_pre_act)
    unfused_act: int = 0
    # 1: the A rows through a TMA descriptor too (Hopper; contiguous rows only: a gathered A is
    # copied contiguous first). Else A is a pipelined tl.load. For the weight gradients: both
    # operands' rows through descriptors (an expert's last partial block of rows by masked loads).
    a_tma: int = 0
    # 0: a loop per work item (tile × column block, or weight-gradient block); 2 (with a_tma and
    # TMA weights): one flat loop over (work item, k step) steps, A, B and the output through
    # TMA, pipelined across work items (GEMM0, the plain-epilogue GEMMs GEMM1, dx, d(act)
    # unfused, and the weight gradients). Other values are refused.
    persistent: int = 0
    # GEMM0 with SwiGLU and TMA weights only: gate and up rows as one 3-D TMA block and one
    # BLOCK_M × 2·BLOCK_N dot (expert_gemm.tile.gate_up_tile) instead of two BLOCK_M × BLOCK_N dots.
    joint: int = 0
    # GEMM0's activations and the plain-epilogue grouped GEMMs (GEMM1, dx, d(act)), with TMA
    # weights: full tiles stored through a TMA descriptor (drains under the next tile's main
    # loop), an expert's partial last tile by a masked store.
    tma_store: int = 0


def parse_config(text: str) -> GemmConfig:
    """A config from ``bm,bn,bk,warps,stages[,group_m][,field=value...]`` (the benchmark scripts'
    spelling), e.g. ``128,256,64,8,3,a_tma=1,persistent=2``."""
    positional, named = [], {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, eq, value = item.partition("=")
        if eq:
            named[name] = int(value)
        elif named:
            raise ValueError(f"config {text!r}: a positional field after a named one")
        else:
            positional.append(int(item))
    return GemmConfig(*positional, **named)


# Fields that tables written by earlier versions may hold, only ever at these values (the forms
# they chose were removed): read and dropped.
RETIRED_FIELDS = {"flatten": 0, "chain": 0}


def config_from_entry(config: dict) -> GemmConfig:
    """A table entry's ``config`` dict as a :class:`GemmConfig` (retired fields at their old
    default dropped; any other value of them is an error, as its kernel form is gone)."""
    config = dict(config)
    for name, value in RETIRED_FIELDS.items():
        if name in config and config.pop(name) != value:
            raise ValueError(f"tuning table config {config} sets {name}, a kernel form interlace no longer has; "
                             "re-run `interlace tune-experts`")
    return GemmConfig(**config)


@dataclass(frozen=True)
class ShapeClass:
    hidden: int
    ffn: int
    experts: int
    activation: str

    def distance(self, other: "ShapeClass") -> float:
        return (abs(math.log(self.hidden / other.hidden)) + abs(math.log(self.ffn / other.ffn))
                + abs(math.log(self.experts / other.experts)) + (10.0 if self.activation != other.activation else 0.0))


def rows_bucket(rows_per_expert: float) -> int:
    """Power-of-two bucket of the mean rows per expert."""
    return 1 << max(0, round(math.log2(max(rows_per_expert, 1.0))))


def table_key(kernel: str, device_name: str, sm_count: int, triton_version: str | None = None) -> str:
    version = triton_version or triton.__version__
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{kernel}-{device_name}-sm{sm_count}-triton{version}")


def tuning_dirs() -> list[Path]:
    extra = settings().tuning_dir
    dirs = [extra] if extra else []
    return dirs + [PACKAGED_DIR]


_TABLES: dict[str, list[dict] | None] = {}
_WARNED: set[str] = set()
# lookup results by (table key, shape, bucket, default): every expert-block call looks up five
# kernels, and scoring every entry each time costs host time on every call.
_LOOKUPS: dict[tuple, tuple[GemmConfig, str]] = {}
_GENERATION = 0  # advances whenever the caches above are emptied, so callers' memos expire too


def generation() -> int:
    """A number that changes whenever a table is written or the caches are cleared."""
    return _GENERATION


def _load(key: str) -> list[dict] | None:
    if key not in _TABLES:
        _TABLES[key] = None
        for d in tuning_dirs():
            path = d / f"{key}.json"
            if path.exists():
                _TABLES[key] = json.loads(path.read_text())["entries"]
                break
    return _TABLES[key]


def lookup(kernel: str, device_name: str, sm_count: int, shape: ShapeClass, rows_per_expert: float,
           default: GemmConfig, capability: tuple[int, int] | None = None,
           fallback: str | None = None) -> tuple[GemmConfig, str]:
    """The config for this kernel, device and shape, and where it came from. ``capability``
    (the device's compute capability) lets a device without a table borrow a kin's. ``fallback``:
    a kernel whose table serves where this kernel has neither a table nor a kin's (its source then
    says ``from <fallback>``), before the default."""
    key = table_key(kernel, device_name, sm_count)
    bucket = rows_bucket(rows_per_expert)
    memo = (key, shape, bucket, default, capability, fallback)
    if memo in _LOOKUPS:
        return _LOOKUPS[memo]
    result = _lookup(key, kernel, device_name, sm_count, capability, shape, bucket, default, fallback)
    _LOOKUPS[memo] = result
    return result


def _tables_of(kernel: str) -> list[tuple[str, dict]]:
    """(key, meta) of every table of ``kernel`` in the tuning folders (the first folder wins a key)."""
    found: dict[str, dict] = {}
    for d in tuning_dirs():
        for path in sorted(d.glob(f"{kernel}-*.json")) if d.is_dir() else []:
            if path.stem not in found:
                try:
                    found[path.stem] = json.loads(path.read_text()).get("meta", {})
                except (OSError, ValueError):
                    continue
    return list(found.items())


def kin_table(kernel: str, device_name: str, sm_count: int, capability: tuple[int, int] | None) -> str | None:
    """The key of the table a device without its own borrows, or None: the same device and SM
    count under another Triton version first, then the same compute capability with the nearest
    SM count, the same Triton version preferred; ties by key, so the choice is reproducible."""
    here = triton.__version__

    def rank(item):
        key, meta = item
        same_device = meta.get("device") == device_name and meta.get("sm_count") == sm_count
        sms = max(int(meta.get("sm_count") or 1), 1)
        return (0 if same_device else 1, abs(math.log(sms / max(sm_count, 1))), meta.get("triton") != here, key)

    kin = [(key, meta) for key, meta in _tables_of(kernel)
           if (meta.get("device") == device_name and meta.get("sm_count") == sm_count)
           or (capability is not None and tuple(meta.get("capability") or ()) == tuple(capability))]
    return min(kin, key=rank)[0] if kin else None


def _lookup(key: str, kernel: str, device_name: str, sm_count: int, capability, shape: ShapeClass, bucket: int,
            default: GemmConfig, fallback: str | None = None) -> tuple[GemmConfig, str]:
    entries, borrowed = _load(key), None
    if not entries:
        borrowed = kin_table(kernel, device_name, sm_count, capability)
        entries = _load(borrowed) if borrowed else None
        if not entries and fallback:  # the fallback kernel's lookup warns for itself if it must
            config, source = lookup(fallback, device_name, sm_count, shape, bucket, default, capability)
            return config, f"from {fallback}, {source}"
        if key not in _WARNED:
            _WARNED.add(key)
            instead = (f"borrowing {borrowed}.json, its nearest kin by device, compute capability and SM count"
                       if entries else
                       f"using the default {kernel} config {asdict(default)}")
            warnings.warn(f"no tuning table {key}.json in {', '.join(map(str, tuning_dirs()))}: {instead} "
                          f"(run `interlace tune-experts` on this GPU)", stacklevel=4)
        if not entries:
            return default, "default (no table)"

    def score(entry):
        other = ShapeClass(**entry["shape"])
        return (shape.distance(other), abs(math.log2(entry["bucket"]) - math.log2(bucket)))

    best = min(entries, key=score)
    exact = ShapeClass(**best["shape"]) == shape and best["bucket"] == bucket
    source = "tuned" if exact else f"tuned, nearest {best['shape']} bucket {best['bucket']}"
    return config_from_entry(best["config"]), source if borrowed is None else f"borrowed from {borrowed}, {source}"


def write_table(path: Path, entries: list[dict], meta: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "entries": entries}, indent=1))
    _TABLES.clear()
    _LOOKUPS.clear()
    _advance()
    return path


def _advance() -> None:
    global _GENERATION
    _GENERATION += 1


def clear_cache() -> None:
    _TABLES.clear()
    _WARNED.clear()
    _LOOKUPS.clear()
    _advance()
