"""Performance models: α–β lines fitted by least squares, and measured size→time curves.

PipeMoE (§IV-A) models both the grouped GEMM and the all-to-all as ``t(x) = α + β·x`` where x
is the work (FLOPs, or bytes per rank) and α the start-up cost. MoNTA (Algorithm 1) notes that
small messages are latency-bound, so the efficiency varies with size more than one line can
say: :class:`SizeCurve` keeps the measured points and interpolates between them in log-log
space, falling back to the fitted line outside the measured range.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    """``t(x) = alpha + beta * x`` (times in ms)."""

    alpha: float
    beta: float
    r2: float = float("nan")

    def __call__(self, x: float) -> float:
        return self.alpha + self.beta * x

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "r2": self.r2}

    @staticmethod
    def from_json(d: dict) -> "AlphaBeta":
        return AlphaBeta(d["alpha"], d["beta"], d.get("r2", float("nan")))


def fit_alpha_beta(xs, ts, relative: bool = True) -> AlphaBeta:
    """Least-squares fit of ``t = α + β·x``.

    With ``relative=True`` each point is weighted by 1/t, i.e. the fit minimises relative
    rather than absolute error, so microsecond-scale small sizes are not drowned by the
    millisecond-scale large ones. α and β are clamped at 0 (negative costs are noise).
    """
    x = np.asarray(xs, dtype=np.float64)
    t = np.asarray(ts, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("fit_alpha_beta needs at least two distinct sizes")
    w = 1.0 / np.maximum(t, 1e-12) if relative else np.ones_like(t)
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    if beta < 0:
        # Time that falls with size is noise (seen with host timers on a busy CPU): a flat line.
        alpha, beta = float(np.sum(w * w * t) / np.sum(w * w)), 0.0
    pred = alpha + beta * x
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return AlphaBeta(float(alpha), float(beta), r2)


@dataclass
class SizeCurve:
    """Measured (size, ms) points plus their α–β fit.

    ``__call__`` interpolates log(time) linearly in log(size) between measured points (the
    efficiency-vs-size curve). Below the measured range it uses the α–β line; above it, the
    rate of the largest measurement (``t_max · x / x_max``): the line is fitted with relative
    weights over sizes spanning many decades, so its slope is set by mid-size points and
    over-predicts large transfers (about twice the measured time of the largest all-to-alls).
    """

    sizes: list[float]
    times: list[float]
    line: AlphaBeta = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        order = sorted(range(len(self.sizes)), key=lambda i: self.sizes[i])
        self.sizes = [float(self.sizes[i]) for i in order]
        self.times = [float(self.times[i]) for i in order]
        if self.line is None:
            self.line = fit_alpha_beta(self.sizes, self.times)

    def __call__(self, x: float) -> float:
        if x <= 0:
            return self.line.alpha
        s = self.sizes
        if len(s) >= 1 and x >= s[-1]:
            return self.times[-1] * x / s[-1]  # sustained rate of the largest measured size
        if len(s) < 2 or x <= s[0]:
            return max(self.line(x), 0.0)
        i = bisect.bisect_right(s, x) - 1
        x0, x1 = math.log(s[i]), math.log(s[i + 1])
        y0, y1 = math.log(max(self.times[i], 1e-9)), math.log(max(self.times[i + 1], 1e-9))
        return math.exp(y0 + (y1 - y0) * (math.log(x) - x0) / (x1 - x0))

    def to_json(self) -> dict:
        return {"sizes": self.sizes, "times_ms": self.times, "fit": self.line.to_json()}

    @staticmethod
    def from_json(d: dict) -> "SizeCurve":
        return SizeCurve(d["sizes"], d["times_ms"], AlphaBeta.from_json(d["fit"]))


def interp_log_rows(points, rows: float) -> float:
    """Piecewise-linear interpolation of ``(rows, value)`` points in log(rows), held flat
    beyond the outermost ones; repeated rows (profiles pooled from several runs) are averaged.
    The calibrated models' residual ratios are read this way."""
    by_x: dict[float, list[float]] = {}
    for x, v in points:
        by_x.setdefault(math.log(max(float(x), 1.0)), []).append(float(v))
    xs = sorted(by_x)
    return float(np.interp(math.log(max(rows, 1.0)), xs, [sum(by_x[x]) / len(by_x[x]) for x in xs]))

