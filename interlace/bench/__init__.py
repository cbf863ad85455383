"""Benchmark harness (see :mod:`interlace.bench.harness`)."""

from interlace.bench.harness import main

__all__ = ["main"]
