"""MoNTA's model (interlace.planning.monta.chunks): the paper's own numbers, and Algorithms 1–3 against brute force."""

import random

import pytest

from interlace.planning.pipemoe.schedule import Op, simulate_ops
from interlace.planning.monta import chunks as monta
from interlace.planning.monta.cluster import cluster_preset

# MoNTA §Evaluation: 2 nodes × 8 A800, IB 25 GB/s (B1), NVLink 200 GB/s (B2); Table 8's D2D row
# (64 MB at 80% in 0.05 ms) gives B3 = 1.6 TB/s. t = 8, e = 2, I = 256 MB (8K sequence).
PAPER = dict(t=8, e=2, b1=25e9, b2=200e9, b3=1.6e12)


def paper_inputs(r1, r2, r3=0.8, volume=256e6):
    return monta.MontaInputs(volume=volume, r1=r1, r2=r2, r3=r3, **PAPER)


def close(a, b, tol=0.05):
    return abs(a / b - 1) <= tol


def test_table8_latencies():
    assert close(monta.baseline_ms(paper_inputs(0.741, 0.776)), 6.909)
    o1 = paper_inputs(0.633, 0.776)
    assert close(monta.aa_ms(o1, 1), 1.012) and close(monta.ag_ms(o1, 1), 1.443)
    o2 = paper_inputs(0.427, 0.726)
    assert close(monta.aa_ms(o2, 4), 0.374) and close(monta.ag_ms(o2, 4), 0.385)
    assert close(monta.d2d_ms(o2, 4), 0.05)


def test_eqs_12_to_16_ratios():
    # Eq. 12 with r1 = r2: AA_j/AG_j = 4/7; Eq. 13: O3's limit (N → ∞) is 7/32 of the baseline.
    same = paper_inputs(0.75, 0.75, r3=1e9)  # D2D negligible in the limit
    assert close(monta.aa_over_ag(same), 4 / 7)
    n = 1000
    limit = monta.o3_time(monta.MontaInputs(**{**same.__dict__, "max_chunks": n}), n)
    assert close(monta.ratio_same_r1(same, limit, 0.75), 7 / 32)
    # Eq. 14: O1 at 8K, r1 = 0.632, r2 = 0.776 → 0.31.
    o1 = paper_inputs(0.632, 0.776)
    assert close(monta.ratio_same_r1(o1, monta.o1_ms(o1), 0.632), 0.31)
    # 4 chunks: r1 = 0.427, r2 = 0.726; Eq. 12 → 0.979, Eq. 15 (O2) → 0.176, Eq. 16 (O3) → 0.164.
    c4 = paper_inputs(0.427, 0.726)
    assert close(monta.aa_over_ag(c4, 4), 0.979)
    assert close(monta.ratio_same_r1(c4, monta.o2_time(c4, 4), 0.427), 0.176)
    assert close(monta.ratio_same_r1(c4, monta.o3_time(c4, 4), 0.427), 0.164)


def simulated(inp, form, n):
    """Brute force: the chunk pipeline as ops on streams (A2A on the inter link, AG on the
    intra link, D2D after its AG on the same stream (O2) or its own stream (O3))."""
    ops = []
    for _ in range(n):
        ops.append(Op("A2A", "inter", 0.0, monta.aa_ms(inp, n)))
        ops.append(Op("AG", "intra", 0.0, monta.ag_ms(inp, n), (len(ops) - 1,)))
        ops.append(Op("D2D", "intra" if form == "O2" else "copy", 0.0, monta.d2d_ms(inp, n), (len(ops) - 1,)))
    return simulate_ops(ops)[0]


def random_inputs(rng):
    curve = cluster_preset("a800x16")
    volume = rng.uniform(8e6, 4e9)
    return monta.MontaInputs(
        volume=volume, t=rng.choice([2, 4, 8]), e=rng.choice([2, 4, 8, 16]), b1=rng.uniform(10e9, 50e9),
        b2=rng.uniform(100e9, 450e9), b3=rng.uniform(1e13, 3e13),  # fast copies: Algorithm 2's assumption
        r1=curve.inter.efficiency, r2=curve.intra.efficiency, r3=rng.uniform(0.5, 0.9),
        i_minimal=rng.choice([1e5, 1e6, 4e6]), max_chunks=64)


@pytest.mark.parametrize("seed", range(6))
def test_chunk_search_matches_brute_force(seed):
    rng = random.Random(seed)
    inp = random_inputs(rng)
    for form, time_of in (("O2", monta.o2_time), ("O3", monta.o3_time)):
        choice = monta.find_chunks(inp, form)
        ns = [n for n, _ in choice.searched]
        assert ns == list(range(1, len(ns) + 1))
        brute = {n: simulated(inp, form, n) for n in ns}
        for n in ns:
            assert time_of(inp, n) == pytest.approx(brute[n], rel=1e-9)
        best = min(brute, key=lambda n: (brute[n], n))
        assert choice.chunks == best and choice.time_ms == pytest.approx(brute[best], rel=1e-9)
        # the minimum-message rule stops the search where a chunk gets too small
        nxt = len(ns) + 1
        if nxt <= inp.max_chunks:
            assert inp.volume / (nxt * inp.t) < inp.i_minimal or inp.volume / nxt < inp.i_minimal
    sel = monta.strategy_select(inp)
    forms = {"O1": monta.aa_ms(inp, 1) + monta.ag_ms(inp, 1)}
    for form in ("O2", "O3"):
        forms[form] = min(simulated(inp, form, n) for n, _ in monta.find_chunks(inp, form).searched)
    assert sel.form == min(forms, key=forms.get) and sel.time_ms == pytest.approx(min(forms.values()), rel=1e-9)


def test_algorithm2_is_exact_only_while_the_copy_is_not_the_slowest_stage():
    inp = paper_inputs(0.427, 0.726, r3=0.01)  # a copy at 1% of HBM bandwidth: D2D dominates
    n = 4
    a, g, d = monta.aa_ms(inp, n), monta.ag_ms(inp, n), monta.d2d_ms(inp, n)
    assert d > max(a, g)
    assert monta.pipeline_makespan([a, g, d], n) == pytest.approx(simulated(inp, "O3", n), rel=1e-9)
    assert monta.o3_time(inp, n) < simulated(inp, "O3", n)  # the paper's formula under-estimates here


def test_bad_inputs():
    with pytest.raises(ValueError):
        monta.MontaInputs(volume=0, t=2, e=2, b1=1, b2=1, b3=1, r1=0.5, r2=0.5, r3=0.5)
    with pytest.raises(ValueError):
        monta.MontaInputs(volume=1e6, t=2, e=2, b1=1, b2=1, b3=1, r1=0.5, r2=0.5, r3=0.5, i_minimal=0)
    with pytest.raises(ValueError):
        monta.find_chunks(paper_inputs(0.7, 0.7), "O1")
