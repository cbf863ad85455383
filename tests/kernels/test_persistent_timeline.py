"""The persistent kernels' opt-in timeline (TIMELINE = 2: the interpreter's logical clock) at
world size 1 and with W = 2 simulated ranks: every task taken has exactly one record of the
right kind in its own slot, with the call's epoch (stale records of an earlier call filtered
out), start ≤ waited ≤ end, waits recorded where a task waits, dependency order in the logical
clock, and the same output bits as with the timeline off.

Which GEMM tasks are real (vs "skip") is derived from the routing (plain torch), not from the
kernel's own tile table."""

from __future__ import annotations

import pytest
import torch

from interlace.kernels.persistent import dist_tasks as dt
from interlace.kernels.persistent.dist_launch import DistPlan, run_simulated
from interlace.kernels.persistent.config import PersistentKernelConfig, router_pieces
from interlace.kernels.persistent.launch import CallPlan, PersistentState
from interlace.kernels.persistent.protocol import Word
from interlace.kernels.persistent.tasks import TIMELINE_KINDS, reference_index
from interlace.kernels.timeline import CLOCK_LOGICAL
from interlace.routing import route
from interlace.tools.task_timeline import summarize_tasks

from kernels.test_persistent_dist import World
from kernels.test_persistent_kernel import make_case


def cdiv(a, b):
    return -(-a // b)


def world1_plan(case, state, timeline, config):
    cfg, x, rw, bias, w_up, w_down = case
    return CallPlan(x, rw, bias, w_up, w_down, state, top_k=cfg.top_k, softmax=cfg.router == "softmax",
                    renormalize=cfg.renormalize, route_scale=cfg.route_scale, activation=cfg.activation,
                    w_pieces=router_pieces(x.dtype, cfg.router_gemm), config=config, max_spins=1 << 16,
                    order="normal", timeline=timeline)


def check_times(recs, waiting_kinds):
    for r in recs:
        assert 0 <= r["start"] <= r["waited"] <= r["end"], r
        # a task that waits on a flag records the wait's end after its start; the gate waits for nothing
        assert (r["waited"] > r["start"]) == (r["kind"] in waiting_kinds), r


def test_world1_records_every_task_once_in_dependency_order():
    config = PersistentKernelConfig(block_m=16, block_k0=16, block_n1=16, block_tc=8, block_nc=32)
    case = make_case(37, experts=6, top_k=2, hidden=48, ffn=40)
    cfg, x, rw, bias, w_up, w_down = case
    state = PersistentState()
    plan = world1_plan(case, state, CLOCK_LOGICAL, config)
    other = torch.randn_like(x)
    plan.run(other)  # an earlier call with other routing: its records are overwritten or filtered
    out_on = plan.run(x)
    state.check()
    recs = plan.timeline_records()
    out_off = world1_plan(case, PersistentState(), 0, config).run(x)
    assert torch.equal(out_on, out_off)
    assert plan.timeline.data[1:, 0].eq(2).all()  # every slot written by call 2 (world 1 takes every number)

    lay = plan.layout
    topk_idx = route(x, rw, bias, cfg)[0]
    n_tiles = reference_index(topk_idx, cfg.num_experts, plan.block_m)[2].shape[1]
    assert 0 < n_tiles < lay.max_tiles  # real tiles and skips both present
    first_gemm = lay.n_gate + 1
    n_gemm0 = lay.max_tiles * lay.n_k0

    def expected_kind(t):
        if t < lay.n_gate:
            return "gate"
        if t == lay.n_gate:
            return "index"
        rel = t - first_gemm
        if rel < n_gemm0:
            return "gemm0" if rel % lay.max_tiles < n_tiles else "skip"
        if rel < n_gemm0 + lay.max_tiles * lay.n_n1:
            return "gemm1" if (rel - n_gemm0) % lay.max_tiles < n_tiles else "skip"
        return "combine"

    assert [r["task"] for r in recs] == list(range(lay.total))
    assert [r["kind"] for r in recs] == [expected_kind(t) for t in range(lay.total)]
    assert {r["kind"] for r in recs} == set(TIMELINE_KINDS)
    assert all(r["sm"] == -1 and 0 <= r["pid"] < plan.programs for r in recs)
    check_times([r for r in recs if r["kind"] != "skip"], {"index", "gemm0", "gemm1", "combine"})

    def end_of(pred):
        return max(r["end"] for r in recs if pred(r))

    index = next(r for r in recs if r["kind"] == "index")
    assert index["waited"] > end_of(lambda r: r["kind"] == "gate")
    for r in recs:
        if r["kind"] in ("gemm0", "gemm1", "combine", "skip"):
            assert r["waited"] > index["end"]
        if r["kind"] == "gemm1":
            tile = (r["task"] - first_gemm - n_gemm0) % lay.max_tiles
            assert r["waited"] > end_of(lambda g: g["kind"] == "gemm0"
                                        and (g["task"] - first_gemm) % lay.max_tiles == tile)
        if r["kind"] == "combine":
            assert r["waited"] > end_of(lambda g: g["kind"] == "gemm1")
    s = summarize_tasks(recs, TIMELINE_KINDS, plan.programs)
    assert 0 < s["utilization"] <= 1
    assert s["kinds"]["gemm0"]["tasks"] == n_tiles * lay.n_k0 and s["kinds"]["gemm1"]["tasks"] == n_tiles * lay.n_n1
    assert int(state.buffer[Word.EPOCH]) == 2


def test_timeline_off_has_no_table_and_bad_mode_raises():
    case = make_case(5)
    assert world1_plan(case, PersistentState(), 0, PersistentKernelConfig()).timeline is None
    with pytest.raises(ValueError, match="timeline mode"):
        world1_plan(case, PersistentState(), 3, PersistentKernelConfig())


def dist_plans(world, timeline):
    cfg, L = world.cfg, world.L
    return [DistPlan(x, world.router_weight, world.bias, world.w_up[r * L:(r + 1) * L].contiguous(),
                     world.w_down[r * L:(r + 1) * L].contiguous(), world.bufs[r], top_k=cfg.top_k,
                     softmax=cfg.router == "softmax", renormalize=cfg.renormalize, route_scale=cfg.route_scale,
                     activation=cfg.activation, w_pieces=router_pieces(x.dtype, cfg.router_gemm),
                     config=world.config, max_spins=world.max_spins, timeline=timeline)
            for r, x in enumerate(world.xs)]


def expected_dist_kinds(plan, me, W, rows_from):
    """task → kind of rank ``me``'s tasks that are taken: every gate/index/send/receive/combine
    task; per GEMM kind the tasks of the real row tiles (a tile: one local expert's rows from
    every source), then one skip if there are empty tiles (it jumps the queue past the rest).
    ``rows_from[s]``: rows per local expert from source s."""
    lay = plan.layout
    want = {}
    for kind in (dt.LOGITS, dt.GATE, dt.INDEX, dt.SEND, dt.RECEIVE, dt.COMBINE):
        for t in range(lay.first(kind), lay.first(kind) + lay.counts()[kind]):
            want[t] = dt.TIMELINE_KINDS[kind]
    n_tiles = sum(cdiv(int(c), plan.block_m) for c in sum(rows_from))
    for kind, n_slices in ((dt.GEMM0, lay.n_k0), (dt.GEMM1, lay.n_n1)):
        base = lay.first(kind)
        for t in range(base, base + n_tiles * n_slices):
            want[t] = dt.TIMELINE_KINDS[kind]
        if n_tiles < lay.mt:
            want[base + n_tiles * n_slices] = "skip"
    return want


def test_dist_records_every_taken_task_once_with_the_calls_epoch():
    """W = 2: call 1 spreads the tokens; call 2 (same plans, a selection bias changed in place)
    sends every token to rank 1's experts, so rank 0's GEMM ranges are skipped at once and
    its slots still hold call 1's GEMM records: they must not be returned."""
    bias = torch.zeros(8)
    world = World(2, [9, 6], router="sigmoid", bias=bias, config=PersistentKernelConfig(block_m=16))
    W = world.W
    plans = dist_plans(world, CLOCK_LOGICAL)
    run_simulated(plans, world.xs)
    bias[5] = bias[6] = 100.0
    outs_on = run_simulated(plans, world.xs)
    world.check_all()
    world.assert_matches(outs_on)
    stale = plans[0].timeline.data[1:, 0]
    assert stale.eq(1).any() and stale.eq(2).any()  # call 1's records are still in rank 0's table
    for me, plan in enumerate(plans):
        recs = plan.timeline_records()
        topk_idx = route(world.xs[me], world.router_weight, bias, world.cfg)[0]
        assert set(topk_idx.flatten().tolist()) == {5, 6}
        # rows each source sends to me, per local expert: from the routing of every rank
        rows_from = []
        for s in range(W):
            idx_s = route(world.xs[s], world.router_weight, bias, world.cfg)[0].flatten()
            rows_from.append(torch.bincount(idx_s, minlength=world.cfg.num_experts)[me * world.L:(me + 1) * world.L])
        want = expected_dist_kinds(plan, me, W, rows_from)
        assert {r["task"]: r["kind"] for r in recs} == want
        assert len(recs) == len(want)  # one record per task
        check_times([r for r in recs if r["kind"] != "skip"],
                    {"gate", "index", "send", "receive", "gemm0", "gemm1", "combine"})
        gate = [r for r in recs if r["kind"] == "gate"]
        assert gate and all(r["waited"] > max(q["end"] for q in recs if q["kind"] == "logits") for r in gate)
        index = next(r for r in recs if r["kind"] == "index")
        assert index["waited"] > max(r["end"] for r in recs if r["kind"] == "gate")
        assert all(r["waited"] > index["end"] for r in recs if r["kind"] == "send")
        g0_end = max((r["end"] for r in recs if r["kind"] == "gemm0"), default=-1)
        assert all(r["waited"] > g0_end for r in recs if r["kind"] == "gemm1")
        assert all(r["waited"] > max(q["end"] for q in recs if q["kind"] != "combine")
                   for r in recs if r["kind"] == "combine")
        s = summarize_tasks(recs, dt.TIMELINE_KINDS, plan.grid)
        assert 0 < s["utilization"] <= 1
    assert sum(r["kind"] == "gemm0" for r in plans[0].timeline_records()) == 0  # rank 0 got no rows
    # The same bits with the timeline off (fresh plans on the same buffers: the epochs go on).
    outs_off = run_simulated(dist_plans(world, 0), world.xs)
    world.check_all()
    assert all(torch.equal(a, b) for a, b in zip(outs_on, outs_off))
