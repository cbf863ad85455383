"""Every environment variable interlace reads, read once (at first use) and kept here.

Behaviour is chosen by options (``MoEConfig``, ``MoELayer(strategy=..., strategy_options=...)``),
never by the environment. The variables below only say *where* files live, or switch off a
fast path for debugging; none of them changes a result.

``INTERLACE_PROFILE_DIR``
    Folder of the measured performance profiles (``interlace profile`` writes there; ``auto`` and
    ``pipelined`` read there before the profiles shipped in ``interlace/tuning/profiles``).
    Default ``~/.cache/interlace/profiles``.
``INTERLACE_TUNING_DIR``
    Folder searched before the package's ``interlace/tuning`` for kernel tuning tables (expert GEMM
    configs, the fused block split); ``interlace tune`` / ``tune-experts`` write there. Unset: the
    package's own tables only.
``INTERLACE_FAST_LAUNCH``
    ``0`` launches every Triton kernel through Triton's own ``kernel[grid](...)`` path instead of
    the cached launcher of :mod:`interlace.kernels.launch` (debugging, profilers that hook
    Triton's launches). Default ``1``.
``INTERLACE_COMMIT``
    The commit recorded in benchmark results where the tree has no ``.git`` (a copy on a GPU
    machine). Default: ``git rev-parse HEAD``.

Tests that change a variable call :func:`refresh` afterwards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Environment:
    profile_dir: Path
    tuning_dir: Path | None
    fast_launch: bool
    commit: str | None


def _read() -> Environment:
    fast = os.environ.get("INTERLACE_FAST_LAUNCH", "1")
    if fast not in ("0", "1"):
        raise ValueError(f"INTERLACE_FAST_LAUNCH must be 0 or 1, got {fast!r}")
    tuning = os.environ.get("INTERLACE_TUNING_DIR")
    return Environment(
        profile_dir=Path(os.environ.get("INTERLACE_PROFILE_DIR") or Path.home() / ".cache" / "interlace" / "profiles"),
        tuning_dir=Path(tuning) if tuning else None,
        fast_launch=fast == "1",
        commit=os.environ.get("INTERLACE_COMMIT") or None,
    )


_CURRENT: Environment | None = None


def settings() -> Environment:
    """The environment as read at first use (or at the last :func:`refresh`)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = _read()
    return _CURRENT


def refresh() -> Environment:
    """Read the variables again (tests that set them)."""
    global _CURRENT
    _CURRENT = None
    return settings()
