"""Per-primitive performance models: link classes, bandwidth-efficiency curves, collective times.

A :class:`Link` is one class of interconnect seen from one GPU (intra-node NVLink or PCIe,
inter-node InfiniBand or RoCE, or the GPU's own HBM for device copies) with its theoretical
one-direction bandwidth B. Its *efficiency* r(m) is the fraction of B a primitive reaches at
message volume m (MoNTA Algorithm 1, lines 9–12: "lookup r according to the volume"). Two ways
to know r(m):

* measured points ``(volume bytes, efficiency)`` — interpolated linearly in log(volume) and,
  outside the points, extended by the saturating form ``1/r = 1/r_max + c/m`` fitted to them
  (MoNTA's own A800 points fit it to 2%: 1/r is linear in 1/m for 8, 32 and 256 MB);
* derived from a cluster description — an α–β link: ``t = α + wire/(B·r_max)``, so
  ``r(m) = wire/(B·t)`` falls to 0 for small messages (latency-bound) and rises to ``r_max``.

Collective time of one GPU (ring / pairwise algorithms; volume m is what MoNTA looks the
efficiency up by):

==================  =============================  ===============================
primitive           volume m                       bytes on the busiest link
==================  =============================  ===============================
all-to-all (n)      bytes this rank sends          m·(n_local−1)/n intra, m·(n−n_local)/n inter
all-gather (n)      gathered output bytes          m·(n−1)/n
reduce-scatter (n)  input bytes                    m·(n−1)/n
all-reduce (n)      bytes                          2·m·(n−1)/n
device copy         bytes copied                   m (over HBM)
==================  =============================  ===============================

An all-to-all whose group spans nodes uses both link classes at once; its time is the slower
of the two. Grouped GEMM time: :class:`Compute` (FLOPs over peak × an efficiency that grows
with the work per expert, fitted from measured TFLOP/s where we have them).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np


def fit_saturating(points) -> tuple[float, float]:
    """Least-squares fit of ``1/r = a + c/m`` to (m, r) points → (r_max = 1/a, c).

    With one point, c = 0 (a flat curve). a is kept ≥ 1 (efficiency never above 1) and c ≥ 0.
    """
    m = np.array([p[0] for p in points], dtype=np.float64)
    r = np.array([p[1] for p in points], dtype=np.float64)
    if np.any(m <= 0) or np.any(r <= 0) or np.any(r > 1):
        raise ValueError(f"efficiency points need volume > 0 and 0 < efficiency <= 1, got {list(points)}")
    if len(points) == 1 or np.ptp(m) == 0:
        return float(r.mean()), 0.0
    A = np.stack([np.ones_like(m), 1.0 / m], axis=1)
    (a, c), *_ = np.linalg.lstsq(A, 1.0 / r, rcond=None)
    if c < 0:
        a, c = float(np.mean(1.0 / r)), 0.0
    a = max(float(a), 1.0)
    return 1.0 / a, float(c)


@dataclass(frozen=True)
class Link:
    """One interconnect class as one GPU sees it.

    Args:
        name: ``nvlink``, ``pcie``, ``ib``, ``roce`` or ``hbm``.
        bandwidth_gbps: theoretical bandwidth B in GB/s (1e9 B/s), one direction, per GPU.
        latency_us: start-up cost α of one collective (α–β form; ignored when ``points`` given).
        peak_efficiency: r_max, the efficiency of very large messages (α–β form).
        points: measured ``(volume bytes, efficiency)`` pairs; when given they define r(m).
        source: where the numbers come from.
    """

    name: str
    bandwidth_gbps: float
    latency_us: float = 10.0
    peak_efficiency: float = 0.8
    points: tuple = ()
    source: str = ""
    _fit: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"link {self.name}: bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")
        if not 0 < self.peak_efficiency <= 1:
            raise ValueError(f"link {self.name}: peak_efficiency must be in (0, 1], got {self.peak_efficiency}")
        if self.latency_us < 0:
            raise ValueError(f"link {self.name}: latency_us must be >= 0")
        if self.points:
            pts = tuple(sorted((float(m), float(r)) for m, r in self.points))
            object.__setattr__(self, "points", pts)
            object.__setattr__(self, "_fit", fit_saturating(pts))

    # ------------------------------------------------------------------ efficiency curve
    def efficiency(self, volume: float, wire_fraction: float = 1.0) -> float:
        """r(m): fraction of the theoretical bandwidth reached at volume m (bytes)."""
        if self.points:
            return self._measured_efficiency(volume)
        wire = volume * wire_fraction
        if wire <= 0:
            return self.peak_efficiency
        t = self.latency_us * 1e-6 + wire / (self.bandwidth_gbps * 1e9 * self.peak_efficiency)
        return wire / (self.bandwidth_gbps * 1e9) / t

    def _measured_efficiency(self, volume: float) -> float:
        pts = self.points
        r_max, c = self._fit

        def form(m):
            return 1.0 / (1.0 / r_max + c / max(m, 1.0))

        if volume <= pts[0][0] or volume >= pts[-1][0] or len(pts) == 1:
            end = pts[0] if volume <= pts[0][0] else pts[-1]
            return min(1.0, form(volume) * end[1] / form(end[0]))  # the fitted form, continuous at the end
        i = bisect.bisect_right([p[0] for p in pts], volume) - 1
        (m0, r0), (m1, r1) = pts[i], pts[i + 1]
        w = (math.log(volume) - math.log(m0)) / (math.log(m1) - math.log(m0))
        return r0 + w * (r1 - r0)

    def time_ms(self, volume: float, wire_bytes: float) -> float:
        """Time of moving ``wire_bytes`` over this link for a primitive of volume ``volume``."""
        if wire_bytes <= 0 or volume <= 0:
            return 0.0
        r = self.efficiency(volume, wire_bytes / volume)
        return wire_bytes / (self.bandwidth_gbps * 1e6 * r)

    def to_json(self) -> dict:
        return {"name": self.name, "bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us,
                "peak_efficiency": self.peak_efficiency, "points": [list(p) for p in self.points],
                "source": self.source}

    @staticmethod
    def from_json(d: dict) -> "Link":
        return Link(d["name"], float(d["bandwidth_gbps"]), float(d.get("latency_us", 10.0)),
                    float(d.get("peak_efficiency", 0.8)), tuple(tuple(p) for p in d.get("points", ())),
                    d.get("source", ""))


@dataclass(frozen=True)
class Group:
    """A process group as one member sees it: ``size`` ranks, ``per_node`` of them on its node."""

    size: int
    per_node: int

    def __post_init__(self):
        if self.size < 1 or not 1 <= self.per_node <= self.size:
            raise ValueError(f"bad group: size={self.size}, per_node={self.per_node}")

    @property
    def spans_nodes(self) -> bool:
        return self.per_node < self.size


@dataclass(frozen=True)
class Compute:
    """Grouped-GEMM speed of one GPU.

    time = launch + FLOPs / (peak · eff(w)), eff(w) = 1/(1/eff_max + w_half/w) where w is the
    FLOPs per expert in one call (small GEMMs fill the GPU badly; COMET §5.3: TP splits experts
    into "fragmented small GEMMs"). ``points`` of measured ``(FLOPs per expert, efficiency)``
    fit eff_max and w_half; otherwise the given ones are used.
    """

    peak_tflops: float
    peak_efficiency: float = 0.8
    half_work_flops: float = 6e9
    launch_us: float = 20.0
    points: tuple = ()
    source: str = ""

    def __post_init__(self):
        if not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops must be > 0, got {self.peak_tflops}")
        if self.points:
            pts = tuple(sorted((float(w), float(e)) for w, e in self.points))
            r_max, c = fit_saturating(pts)
            object.__setattr__(self, "points", pts)
            object.__setattr__(self, "peak_efficiency", r_max)
            object.__setattr__(self, "half_work_flops", c * r_max)

    def efficiency(self, flops_per_expert: float) -> float:
        if flops_per_expert <= 0:
            return self.peak_efficiency
        return 1.0 / (1.0 / self.peak_efficiency + self.half_work_flops / self.peak_efficiency / flops_per_expert)

    def gemm_ms(self, flops: float, experts: int) -> float:
        """Time of grouped GEMMs doing ``flops`` in all, spread over ``experts`` experts."""
        if flops <= 0:
            return 0.0
        eff = self.efficiency(flops / max(experts, 1))
        return self.launch_us * 1e-3 + flops / (self.peak_tflops * 1e9 * eff)

    def to_json(self) -> dict:
        return {"peak_tflops": self.peak_tflops, "peak_efficiency": self.peak_efficiency,
                "half_work_flops": self.half_work_flops, "launch_us": self.launch_us,
                "points": [list(p) for p in self.points], "source": self.source}

    @staticmethod
    def from_json(d: dict) -> "Compute":
        pts = tuple(tuple(p) for p in d.get("points", ()))
        return Compute(float(d["peak_tflops"]), float(d.get("peak_efficiency", 0.8)),
                       float(d.get("half_work_flops", 6e9)), float(d.get("launch_us", 20.0)), pts,
                       d.get("source", ""))


# ----------------------------------------------------------------------------- collectives
def all_to_all_ms(intra: Link, inter: Link | None, volume: float, group: Group) -> float:
    """All-to-all where this rank sends ``volume`` bytes in all (1/n of it to each member)."""
    n = group.size
    if n <= 1 or volume <= 0:
        return 0.0
    t = intra.time_ms(volume, volume * (group.per_node - 1) / n)
    if group.spans_nodes:
        if inter is None:
            raise ValueError("group spans nodes but the cluster has no inter-node link")
        t = max(t, inter.time_ms(volume, volume * (n - group.per_node) / n))
    return t


def _ring_link(intra: Link, inter: Link | None, group: Group) -> Link:
    if group.spans_nodes:
        if inter is None:
            raise ValueError("group spans nodes but the cluster has no inter-node link")
        return inter  # a ring over nodes is as fast as its slowest hop
    return intra


def all_gather_ms(intra: Link, inter: Link | None, out_bytes: float, group: Group) -> float:
    """All-gather producing ``out_bytes`` on every member (MoNTA Eq. 9 with B₂ = the link)."""
    if group.size <= 1:
        return 0.0
    return _ring_link(intra, inter, group).time_ms(out_bytes, out_bytes * (group.size - 1) / group.size)


def reduce_scatter_ms(intra: Link, inter: Link | None, in_bytes: float, group: Group) -> float:
    """Reduce-scatter of ``in_bytes`` per member (same traffic as the mirror all-gather)."""
    return all_gather_ms(intra, inter, in_bytes, group)


def all_reduce_ms(intra: Link, inter: Link | None, nbytes: float, group: Group) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather."""
    if group.size <= 1:
        return 0.0
    return 2 * all_gather_ms(intra, inter, nbytes, group)


def copy_ms(hbm: Link, nbytes: float) -> float:
    """Device-to-device copy of ``nbytes`` (MoNTA Eq. 10: I/N over B₃·r₃)."""
    return hbm.time_ms(nbytes, nbytes)
