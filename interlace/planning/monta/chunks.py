"""MoNTA's performance model of the TP×EP all-to-all (Guo et al. 2024, §Network-traffic-aware).

Inputs: the AllToAll volume ``I = b·s·h·BPE`` (Eq. 3), TP degree t, EP degree e, theoretical
bandwidths B₁ (inter-node, AllToAll), B₂ (intra-node, AllGather), B₃ (HBM, D2D copy) and the
efficiencies r₁(volume), r₂(volume), r₃(volume). With the sequence split into N chunks:

    AA_j  = I/(N·t) · (e−1)/e / (B₁·r₁(I/(N·t)))        (Eq. 8)
    AG_j  = I/N · (t−1)/t / (B₂·r₂(I/N))                 (Eq. 9)
    D2D_j = I/N / (B₃·r₃(I/N))                           (Eq. 10)
    T_base = I·(e−1)/e / (B₁·r₁(I))                      (the plain AllToAll)
    T_O1   = AA_1 + AG_1                                 (Eq. 11)

Algorithm 1 (O2: AllToAll ∥ AllGather; each chunk's D2D copy after its AllGather, same stream):
``T(N) = AA_j + (AG_j + D2D_j)·N`` if ``AA_j < AG_j + D2D_j`` else ``AA_j·N + AG_j + D2D_j`` —
the makespan of a two-stage pipeline of N equal chunks, exact. Algorithm 2 (O3: the D2D copy
on its own stream too): ``T(N) = AA_j + AG_j·N + D2D_j`` if ``AA_j < AG_j`` else
``AA_j·N + AG_j + D2D_j`` — exact for a three-stage pipeline while the copy is not the slowest
stage (D2D_j ≤ max(AA_j, AG_j)), which MoNTA assumes; :func:`pipeline_makespan` is exact always.
Both search N = 1, 2, … until a chunk's AllToAll or AllGather volume drops below I_minimal.
(As printed, lines 18–19 of both algorithms read "if T < T_min then T = T_min"; the intent — and
what is implemented — is T_min = T and remembering N.) Algorithm 3 picks the cheapest of O1,
O2, O3.

MoNTA's worked numbers (Table 8; Eqs. 12–16) are reproduced in ``tests/test_plan_monta.py``.
Note the convention behind Eqs. 14–16: the ratio T_O/T_base is taken with T_base evaluated at
the *same* AllToAll efficiency r₁ as the optimized AllToAll (e.g. 0.427 in Eqs. 15–16), so it
isolates the effect of the volume and the overlap; :func:`ratio_same_r1` computes that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

Efficiency = Union[float, Callable[[float], float]]


def _r(eff: Efficiency, volume: float) -> float:
    r = eff(volume) if callable(eff) else float(eff)
    if not r > 0:
        raise ValueError(f"efficiency must be > 0, got {r} at volume {volume}")
    return r


@dataclass(frozen=True)
class MontaInputs:
    """Algorithm 1/2 inputs. Volumes in bytes, bandwidths in bytes/s, times returned in ms."""

    volume: float  # I = b·s·h·BPE
    t: int
    e: int
    b1: float
    b2: float
    b3: float
    r1: Efficiency
    r2: Efficiency
    r3: Efficiency
    i_minimal: float = 1e6
    max_chunks: int = 1024

    def __post_init__(self):
        if self.volume <= 0 or self.t < 1 or self.e < 1:
            raise ValueError(f"MoNTA inputs need volume > 0, t >= 1, e >= 1 (got {self.volume}, {self.t}, {self.e})")
        if min(self.b1, self.b2, self.b3) <= 0:
            raise ValueError("bandwidths must be > 0")
        if self.i_minimal <= 0:
            raise ValueError("i_minimal must be > 0 (it bounds the chunk search)")

    @staticmethod
    def from_sequence(b: int, s: int, h: int, bpe: int, **kw) -> "MontaInputs":
        return MontaInputs(volume=float(b * s * h * bpe), **kw)  # Eq. 3


def aa_ms(inp: MontaInputs, n: int = 1) -> float:
    v = inp.volume / (n * inp.t)
    return v * (inp.e - 1) / inp.e / (inp.b1 * _r(inp.r1, v)) * 1e3  # Eq. 8


def ag_ms(inp: MontaInputs, n: int = 1) -> float:
    v = inp.volume / n
    return v * (inp.t - 1) / inp.t / (inp.b2 * _r(inp.r2, v)) * 1e3  # Eq. 9


def d2d_ms(inp: MontaInputs, n: int = 1) -> float:
    v = inp.volume / n
    return v / (inp.b3 * _r(inp.r3, v)) * 1e3  # Eq. 10


def baseline_ms(inp: MontaInputs) -> float:
    return inp.volume * (inp.e - 1) / inp.e / (inp.b1 * _r(inp.r1, inp.volume)) * 1e3


def o1_ms(inp: MontaInputs) -> float:
    return aa_ms(inp, 1) + ag_ms(inp, 1)  # Eq. 11


def o2_time(inp: MontaInputs, n: int) -> float:
    """Algorithm 1, lines 10–17."""
    a, g, d = aa_ms(inp, n), ag_ms(inp, n), d2d_ms(inp, n)
    return a + (g + d) * n if a < g + d else a * n + g + d


def o3_time(inp: MontaInputs, n: int) -> float:
    """Algorithm 2, lines 10–17."""
    a, g, d = aa_ms(inp, n), ag_ms(inp, n), d2d_ms(inp, n)
    return a + g * n + d if a < g else a * n + g + d


def pipeline_makespan(stages: list[float], n: int) -> float:
    """N equal chunks through stages on separate resources: Σ stages + (N−1)·max stage."""
    return sum(stages) + (n - 1) * max(stages)


@dataclass(frozen=True)
class ChunkChoice:
    form: str
    chunks: int
    time_ms: float
    searched: tuple  # (N, T(N)) for every N tried


def find_chunks(inp: MontaInputs, form: str) -> ChunkChoice:
    """Algorithm 1 (``form="O2"``) or Algorithm 2 (``"O3"``): the chunk count N minimising T."""
    if form not in ("O2", "O3"):
        raise ValueError(f"find_chunks handles O2 and O3, not {form!r}")
    time_of = o2_time if form == "O2" else o3_time
    best_n, best_t, tried = 1, float("inf"), []
    for n in range(1, inp.max_chunks + 1):
        i_aa, i_ag = inp.volume / (n * inp.t), inp.volume / n
        if n > 1 and (i_aa < inp.i_minimal or i_ag < inp.i_minimal):
            break  # lines 5–8 (N = 1 is always allowed: the unchunked O1 schedule)
        t = time_of(inp, n)
        tried.append((n, t))
        if t < best_t:
            best_n, best_t = n, t
    return ChunkChoice(form, best_n, best_t, tuple(tried))


@dataclass(frozen=True)
class StrategyChoice:
    form: str
    chunks: int
    time_ms: float
    times: dict  # form → ms (O2/O3 at their best N)


def strategy_select(inp: MontaInputs) -> StrategyChoice:
    """Algorithm 3: the cheapest of O1, O2, O3 (ties go to the simpler form)."""
    o2, o3 = find_chunks(inp, "O2"), find_chunks(inp, "O3")
    options = [("O1", 1, o1_ms(inp)), ("O2", o2.chunks, o2.time_ms), ("O3", o3.chunks, o3.time_ms)]
    form, n, t = min(options, key=lambda o: o[2])
    return StrategyChoice(form, n, t, {f: ms for f, _, ms in options})


def ratio_same_r1(inp: MontaInputs, time_ms: float, r1: float) -> float:
    """T/T_base with T_base evaluated at AllToAll efficiency ``r1`` (MoNTA Eqs. 13–16)."""
    base = inp.volume * (inp.e - 1) / inp.e / (inp.b1 * r1) * 1e3
    return time_ms / base


def aa_over_ag(inp: MontaInputs, n: int = 1) -> float:
    """Eq. 12: AA_j / AG_j = (e−1)·B₂·r₂ / (e·(t−1)·B₁·r₁)."""
    return aa_ms(inp, n) / ag_ms(inp, n)
