"""The persistent MoE kernel at world size W > 1 (interlace.kernels.persistent.dist_*) with W
simulated ranks in one process under TRITON_INTERPRET=1: every rank's output against the fp64
reference over all experts, the slot index against plain torch, zero-token ranks, skewed
routing, NaN rows, bitwise repeatability, epochs across calls, and mutations of the phase
order and of the flag protocol (each must leave an error record naming the peer rank)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from interlace.config import MoEConfig
from interlace.experts import init_expert_weights
from interlace.kernels.persistent import dist_tasks as dt
from interlace.kernels.persistent.dist_kernel import expert_slice_order
from interlace.kernels.persistent.config import PersistentKernelConfig, router_pieces
from interlace.kernels.persistent.dist_launch import DistPlan, DistSpec, run_simulated, simulated_world
from interlace.kernels.persistent.protocol import ERROR_WORDS, STATE_HEAD, Word
from interlace.reference import reference_moe
from interlace.routing import route

CPU = torch.device("cpu")


class World:
    """W simulated ranks: config, per-rank tokens, all experts' weights, buffers and plans."""

    def __init__(self, W, Ts, *, experts=8, top_k=2, router="softmax", hidden=32, ffn=24, max_tokens=None,
                 bias=None, max_spins=1 << 16, config=None, **cfg_changes):
        self.cfg = MoEConfig(hidden=hidden, ffn=ffn, num_experts=experts, top_k=top_k, router=router,
                             dtype=torch.float32, **cfg_changes)
        self.W, self.L = W, experts // W
        self.xs = [torch.randn(T, hidden) for T in Ts]
        self.router_weight = torch.randn(experts, hidden) / hidden**0.5
        self.bias = bias if bias is not None else (torch.randn(experts) * 0.1 if router == "sigmoid" else None)
        self.w_up, self.w_down = init_expert_weights(self.cfg, range(experts), seed=sum(Ts) + 5, device=CPU)
        spec = DistSpec(W, self.L, hidden, top_k, max_tokens or max(max(Ts), 1), torch.float32)
        self.bufs = simulated_world(spec)
        self.max_spins, self.config = max_spins, config or PersistentKernelConfig()
        self.plans = self.make_plans()

    def make_plans(self, xs=None):
        cfg, L = self.cfg, self.L
        return [DistPlan(x, self.router_weight, self.bias, self.w_up[r * L:(r + 1) * L].contiguous(),
                         self.w_down[r * L:(r + 1) * L].contiguous(), self.bufs[r], top_k=cfg.top_k,
                         softmax=cfg.router == "softmax", renormalize=cfg.renormalize, route_scale=cfg.route_scale,
                         activation=cfg.activation, w_pieces=router_pieces(x.dtype, cfg.router_gemm),
                         config=self.config, max_spins=self.max_spins, capacity=cfg.capacity(x.shape[0]))
                for r, x in enumerate(xs or self.xs)]

    def run(self, phases=dt.PHASES, xs=None):
        xs = xs or self.xs
        plans = self.plans if xs is self.xs else self.make_plans(xs)
        return run_simulated(plans, xs, phases)

    def check_all(self):
        for b in self.bufs:
            b.check()

    def reference(self, r, x=None):
        x = self.xs[r] if x is None else x
        return reference_moe(x, self.router_weight, self.w_up, self.w_down, self.cfg, expert_bias=self.bias)[0]

    def assert_matches(self, outs, rtol=1e-4):
        for r, out in enumerate(outs):
            ref = self.reference(r)
            assert out.shape == ref.shape and out.dtype == torch.float32
            assert torch.isfinite(out).all(), f"rank {r}: an output row was not written (poisoned NaN left)"
            if out.numel():
                err = (out.double() - ref).abs().max().item()
                assert err <= rtol * max(1.0, ref.abs().max().item()), f"rank {r}: max error {err}"


def plain_slots(topk_idx, num_experts):
    """Each assignment's rank among the rank's assignments to its expert (assignment order), and counts."""
    flat = topk_idx.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    slots = torch.empty_like(flat)
    seen = [0] * num_experts
    for a, e in enumerate(flat.tolist()):
        slots[a] = seen[e]
        seen[e] += 1
    return slots, counts


@pytest.mark.parametrize("W, Ts, router", [
    (2, [5, 0], "softmax"), (2, [1, 9], "sigmoid"), (4, [3, 0, 7, 1], "softmax"), (4, [0, 2, 0, 5], "sigmoid"),
])
def test_matches_reference(W, Ts, router):
    extra = dict(renormalize=True, route_scale=2.5) if router == "sigmoid" else {}
    world = World(W, Ts, router=router, top_k=3 if W == 4 else 2, **extra)
    outs = world.run()
    world.check_all()
    world.assert_matches(outs)
    assert_dispatch(world)


def assert_dispatch(world):
    """Each rank's routing and slots against plain torch, and what each owner received from it:
    its counts, each assignment of the owner's experts at its slot of the map (slot order), and
    the row of each token that chose one of them (a peer's copy only: an owner reads its own
    tokens from its input; rows of tokens that chose none stay as the zeroed buffer was)."""
    for r, (plan, x) in enumerate(zip(world.plans, world.xs)):
        if not x.shape[0]:
            continue
        topk_idx = route(x, world.router_weight, world.bias, world.cfg)[0]
        slots, counts = plain_slots(topk_idx, world.cfg.num_experts)
        ws = plan.workspace
        assert torch.equal(ws["idx"].view(-1, world.cfg.top_k).long(), topk_idx)
        assert torch.equal(ws["slot"].long(), slots)
        assert torch.equal(ws["counts"][:world.cfg.num_experts].long(), counts)
        owner_of = topk_idx // world.L
        for d, buf in enumerate(world.bufs):
            assert torch.equal(buf.views["counts"][r].long(), counts[d * world.L:(d + 1) * world.L])
            for lo in range(world.L):
                assignments = (topk_idx.reshape(-1) == d * world.L + lo).nonzero()[:, 0]
                assert torch.equal(buf.views["amap"][r, lo, :assignments.numel()].long(), assignments)
            sent = (owner_of == d).any(dim=1) if d != r else torch.zeros(x.shape[0], dtype=torch.bool)
            assert torch.equal(buf.views["recv"][r, :x.shape[0]][sent], x[sent])
            assert buf.views["recv"][r, :x.shape[0]][~sent].eq(0).all()


def test_send_over_column_slices_once_per_owner():
    """Send tasks over three column slices (block_ns 32 of hidden 80): each slice's task stores
    its columns of a token row once per peer owner (top-3 of 8 experts on 2 ranks: most tokens
    choose two experts of one rank) and the map entries of the assignments j ≡ its slice
    (mod 3), so each entry is written by exactly one task."""
    world = World(2, [11, 6], top_k=3, hidden=80, config=PersistentKernelConfig(block_ns=32))
    assert world.plans[0].constexprs["BLOCK_NS"] == 32 and world.plans[0].layout.n_send == 3
    outs = world.run()
    world.check_all()
    world.assert_matches(outs)
    assert_dispatch(world)


@pytest.mark.parametrize("W, Ts, factor, kw", [
    (2, [23, 9], 0.5, {}), (4, [13, 0, 17, 6], 0.75, dict(top_k=3, router="sigmoid", renormalize=True)),
    (2, [20, 11], 0.6, dict(config=PersistentKernelConfig(wide=True))),
])
def test_capacity_factor_drops_as_the_reference(W, Ts, factor, kw):
    """A capacity factor at W > 1: each rank lets each expert take ceil(factor·T·k/E) of its own
    T tokens' assignments, served slot-major (the reference's policy); dropped assignments are
    not sent (the owners' counts are the kept ones) and add nothing in the combine. Narrow and
    wide tiles, 2 and 4 ranks, a zero-token rank, a bias that overflows one expert."""
    bias = None
    if kw.get("router") == "sigmoid":
        bias = torch.zeros(8)
        bias[6] = 2.0
    world = World(W, Ts, capacity_factor=factor, bias=bias, **kw)
    for buf in world.bufs:  # (poisoned: a dropped assignment's row is never written, and must not be read)
        buf.views["ret"].fill_(float("nan"))
    outs = world.run()
    world.check_all()
    world.assert_matches(outs)
    from interlace.reference import capacity_keep_mask

    for r, x in enumerate(world.xs):
        if not x.shape[0]:
            continue
        topk_idx = route(x, world.router_weight, world.bias, world.cfg)[0]
        keep = capacity_keep_mask(topk_idx, world.cfg)
        assert not keep.all()  # (the factor drops some)
        kept = torch.bincount(topk_idx[keep], minlength=world.cfg.num_experts)
        for d, buf in enumerate(world.bufs):
            assert torch.equal(buf.views["counts"][r].long(), kept[d * world.L:(d + 1) * world.L])


def test_all_tokens_to_one_rank():
    """Skewed: a selection bias sends every token of every rank to two experts of rank 1;
    rank 0 receives nothing (its receive tasks publish their return flags at once)."""
    bias = torch.zeros(8)
    bias[5] = bias[6] = 100.0
    world = World(2, [9, 4], router="sigmoid", bias=bias)
    outs = world.run()
    world.check_all()
    for plan in world.plans:
        assert set(plan.workspace["idx"].tolist()) == {5, 6}
    assert (world.bufs[0].views["counts"] == 0).all()
    world.assert_matches(outs)


def test_more_rows_than_one_tile():
    """An expert with more rows than a row tile (several tiles of one (source, expert) pair)
    and K / N wider than one slice."""
    bias = torch.zeros(4)
    bias[1] = 100.0
    world = World(2, [40, 37], experts=4, top_k=1, router="sigmoid", bias=bias, hidden=80, ffn=72)
    outs = world.run()
    world.check_all()
    assert world.plans[0].block_m < 40
    world.assert_matches(outs)


@pytest.mark.parametrize("W, Ts, kw", [
    (2, [5, 0], {}), (4, [3, 0, 7, 1], dict(top_k=3, router="sigmoid", renormalize=True)),
    (2, [9, 4], dict(activation="gelu")),
    (2, [41, 37], dict(experts=4, top_k=1, hidden=136, ffn=136, router="sigmoid")),
])
def test_wide_tiles_match_reference(W, Ts, kw):
    """Wide tiles (PersistentKernelConfig.wide: weight boxes through TMA descriptors; SwiGLU's
    gate and up rows in one 3-D load and one dot, GELU's through a 2-D descriptor) against the
    fp64 reference: zero-token ranks, 4 ranks, and (last case: a selection bias sends 78 rows to
    one expert, hidden and ffn wider than one slice) two 64-row tiles of one expert whose block
    rows run past the expert's slice into the next expert's weights."""
    bias = None
    if kw.get("experts") == 4:
        bias = torch.zeros(4)
        bias[1] = 100.0
    world = World(W, Ts, config=PersistentKernelConfig(wide=True), bias=bias, **kw)
    outs = world.run()
    world.check_all()
    world.assert_matches(outs)
    for plan in world.plans:
        assert plan.wide and plan.num_warps == 8
        assert plan.num_stages == (5 if plan.block_m <= 64 else 4)  # (launch.wide_stages: what fits in shared memory)
        assert plan.constexprs["W_TMA"] and plan.constexprs["JOINT"] == (world.cfg.activation == "swiglu")
    if bias is not None:
        assert world.plans[0].block_m == 64 and world.plans[0].layout.n_k0 == 2
    plan_128 = World(2, [3, 2], config=PersistentKernelConfig(wide=True, block_m=128)).plans[0]
    assert plan_128.block_m == 128 and plan_128.num_stages == 4


def test_combine_tasks_of_several_slices_and_index_over_several_chunks():
    """A combine task over several column slices (combine_slices 2 of 5: tasks of 2, 2 and 1),
    and an index whose gate blocks span two chunks of its running sum (260 tokens: 17 blocks of
    16, G_CHUNK 16 at E_PAD 16): outputs against the reference, slots against plain torch."""
    world = World(2, [260, 7], hidden=80, config=PersistentKernelConfig(combine_slices=2, block_nc=16))
    assert world.plans[0].layout.n_comb_n == 3 and world.plans[0].constexprs["G_CHUNK"] == 16
    outs = world.run()
    world.check_all()
    world.assert_matches(outs)
    x = world.xs[0]
    topk_idx = route(x, world.router_weight, world.bias, world.cfg)[0]
    slots, _ = plain_slots(topk_idx, world.cfg.num_experts)
    assert torch.equal(world.plans[0].workspace["slot"].long(), slots)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="combine_slices"):
            World(2, [1, 1], config=PersistentKernelConfig(combine_slices=bad))


def test_top_k_tasks_by_token_count():
    """Tokens per top-k task (top_k_block): 4 up to 128 tokens, then about 32 tasks, at most 16
    tokens each; a set block_tk (2: five tasks for 9 tokens, each rank's slots continuing over
    them) routes as the layer does; a block_tk that is not a power of 2 is refused."""
    from interlace.kernels.persistent.dist_launch import top_k_block

    assert [top_k_block(T) for T in (0, 1, 128, 129, 256, 257, 512, 4096)] == [4, 4, 4, 8, 8, 16, 16, 16]
    world = World(2, [9, 4], top_k=3, config=PersistentKernelConfig(block_tk=2))
    assert world.plans[0].layout.n_gate == 5 and world.plans[0].constexprs["BLOCK_TK"] == 2
    outs = world.run()
    world.check_all()
    world.assert_matches(outs)
    assert_dispatch(world)
    for bad in (0, 3, True, 2.0):
        with pytest.raises(ValueError, match="block_tk"):
            World(2, [1, 1], config=PersistentKernelConfig(block_tk=bad))


def test_wide_tiles_rule():
    """Which calls take wide tiles, and their shapes (the measured rule of PersistentKernelConfig)."""
    c = PersistentKernelConfig()
    w = torch.randn(2, 16, 8)
    assert not c.wide_tiles(1000.0, w, w)  # (CPU weights: no TMA device)
    assert PersistentKernelConfig(wide=True).wide_tiles(1.0, w, w)  # forced: wherever the rows allow TMA
    assert not PersistentKernelConfig(wide=True).wide_tiles(1.0, torch.randn(2, 16, 7), w)  # 28-byte rows
    assert not PersistentKernelConfig(wide=False).wide_tiles(1000.0, w, w)
    assert c.wide_tiles_for(32, 128, 132) == (64, 128, 64, 128, 64)  # phi3.5-moe, 128 tokens per GPU
    assert c.wide_tiles_for(64, 64, 132) == (128, 128, 64, 128, 64)  # mixtral-8x7b, 128
    assert c.wide_tiles_for(256, 128, 132)[3] == 256  # mixtral-8x7b, 512: the rows
    assert c.wide_tiles_for(64, 512, 132)[3] == 256  # qwen3-30b-a3b, 512: the tasks
    assert c.wide_tiles_for(64, 512, None)[3] == 128  # (no SM count: the rows alone)
    assert PersistentKernelConfig(block_m=32, block_n1=64).wide_tiles_for(256, 0, 132) == (32, 128, 64, 64, 64)


@pytest.mark.parametrize("splits, round_logits", [(3, 0), (2, 1)])
def test_logits_split_over_columns_routes_as_one_sum(splits, round_logits):
    """The router GEMM's sum over N in ``logits_splits`` column parts (16-wide steps over hidden
    80: parts of 32, 32 and 16 columns for 3), summed in order by the gate task, then rounded
    (ROUND_LOGITS 1 rounds the whole sum, not each part): the routing is the layer's and the
    output the reference's."""
    from interlace.routing import route_logits

    torch.manual_seed(5)
    world = World(2, [9, 6], top_k=2, hidden=80, config=PersistentKernelConfig(logits_splits=splits, block_g=16))
    if round_logits:
        for plan in world.plans:
            plan.constexprs["ROUND_LOGITS"] = round_logits
    assert all(p.logits_splits == splits and p.layout.n_logits == -(-p.T // 16) * 1 * splits for p in world.plans)
    outs = world.run()
    world.check_all()
    for plan, x in zip(world.plans, world.xs):
        logits = (x.double() @ world.router_weight.double().t()).float()
        if round_logits:
            logits = logits.bfloat16().float()
        expected = route_logits(logits, world.bias, world.cfg, fused=True)[0]
        assert torch.equal(plan.workspace["idx"].view(-1, 2).long(), expected)
    if not round_logits:
        world.assert_matches(outs)
    with pytest.raises(ValueError, match="logits_splits"):
        World(2, [1, 1], config=PersistentKernelConfig(logits_splits=0))


def test_one_build_per_row_tile_over_token_counts(monkeypatch):
    """A server's batch sizes vary call by call: every token count 0–64 per rank (and some up to
    512) must reuse the build of its row tile, not compile the kernel again for each pattern of
    "divisible by 16" and "equal to 1" among the token-count arguments (31 builds over 0–512 with
    the defaults at qwen3-30b-a3b's shape, before they were left unspecialized). The GPU's grid
    and logits splits are emulated (132 SMs, 2 programs each)."""
    import interlace.kernels.persistent.dist_launch as dl
    from helpers import triton_builds
    from interlace.kernels.persistent.dist_kernel import persistent_dist_kernel

    monkeypatch.setattr(dl, "sm_count", lambda device: 132)
    monkeypatch.setattr(dl.DistPlan, "_programs", lambda self, n: max(1, min(264, n)))
    W, L, N, K, k = 2, 64, 1024, 96, 8
    buf = simulated_world(DistSpec(W, L, N, k, 512, torch.bfloat16))[0]
    rw = torch.randn(W * L, N)
    w_up, w_down = torch.empty(L, 2 * K, N, dtype=torch.bfloat16), torch.empty(L, N, K, dtype=torch.bfloat16)
    builds, splits_seen = {}, set()
    for T in [*range(0, 65), 100, 127, 128, 129, 255, 256, 300, 511, 512]:
        x = torch.empty(T, N, dtype=torch.bfloat16)
        plan = DistPlan(x, rw, None, w_up, w_down, buf, top_k=k, softmax=True, renormalize=True, route_scale=1.0,
                        activation="swiglu", w_pieces=3, config=PersistentKernelConfig(), max_spins=1)
        _, args = plan.kernel_args(x, torch.empty(T, N, dtype=torch.bfloat16), None)
        consts, spec = triton_builds(persistent_dist_kernel, args, plan.constexprs)
        builds.setdefault(consts, set()).add(spec)
        splits_seen.add(plan.logits_splits)
    assert len(splits_seen) > 1 and len(builds) > 1  # (the emulation varied what it should)
    assert all(len(specs) == 1 for specs in builds.values()), [len(v) for v in builds.values()]


def test_nan_token_stays_in_its_row():
    world = World(2, [7, 6])
    world.xs[1][2, 5] = float("nan")
    outs = world.run()
    world.check_all()
    assert torch.isnan(outs[1][2]).all()
    rows = [0, 1, 3, 4, 5]
    ref = world.reference(1, world.xs[1][rows])
    assert (outs[1][rows].double() - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())
    world.assert_matches(outs[:1])


def test_bitwise_repeatable_epochs_and_changing_token_counts():
    """Calls on one set of buffers, nothing reset between them: the same bits again, other
    token counts in between (plans of other shapes on the same buffers), other grids; the
    epoch counts the calls on every rank and the local counters are back at zero."""
    world = World(2, [6, 3], max_tokens=16)
    first = world.run()
    world.check_all()
    other = [torch.randn(11, 32), torch.randn(0, 32)]
    mid = world.run(xs=other)
    world.check_all()
    for r, x in enumerate(other):
        ref = world.reference(r, x)
        assert not x.shape[0] or (mid[r].double() - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())
    again = world.run()
    world.check_all()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for programs in (1, 8):
        world.config = PersistentKernelConfig(programs=programs)
        world.plans = world.make_plans()
        grid = world.run()
        world.check_all()
        assert all(torch.equal(a, b) for a, b in zip(first, grid))
    for buf in world.bufs:
        state = buf.state.tolist()
        assert state[Word.EPOCH] == 5
        assert state[Word.QUEUE] == state[Word.DONE] == state[Word.GATE_DONE] == state[Word.SEND_DONE] == 0
        assert state[Word.RECV_DONE] == state[Word.GEMM1_DONE] == 0 and state[Word.READY] == 5
        assert all(v == 0 for v in state[STATE_HEAD:-ERROR_WORDS])  # GEMM0 counters
        assert buf.views["sent"].tolist() == [5, 5] and buf.views["done"].tolist() == [5, 5]


def test_combine_before_owners_gemm_is_caught():
    """Mutation: every rank's combine runs before any rank's receive and GEMM tasks. Rank 1's
    first combine task waits for every owner's return flag, owner rank 0's first, which no task
    of rank 0 has published: its bounded wait times out and the record names the owner; rows
    are left unwritten on every rank."""
    bias = torch.zeros(8)
    bias[5] = 100.0
    world = World(2, [4, 3], router="sigmoid", bias=bias, top_k=1, max_spins=20)
    A, B, C = dt.PHASES
    outs = world.run(phases=(A, C, B))
    with pytest.raises(RuntimeError, match=r"rank 1: task \d+ timed out waiting for the return flag of owner "
                                           r"rank 0 .*value 0, expected ≥ 1"):
        world.bufs[1].check()
    with pytest.raises(RuntimeError, match=r"rank 0: .*return flag of owner rank"):
        world.bufs[0].check()
    assert torch.isnan(outs[0]).all() and torch.isnan(outs[1]).all()


def test_combine_waits_for_its_own_routing():
    """Mutation: the combine runs first, with the routing workspace still stale (expert indices
    that name no owner: a grid with more programs than tasks takes the combine tasks while the
    gate runs). Every combine task must wait for its own rank's index flag before it reads the
    routing: the record names that wait, and no output row is written from stale slots."""
    world = World(2, [40, 24], max_spins=20)
    for plan in world.plans:
        plan.workspace["idx"].fill_(-world.L)  # (-L // L: owner -1, no rank; its rows would read recv)
        plan.workspace["slot"].zero_()
    outs = world.run(phases=(dt.PHASES[2],))
    for r in range(2):
        with pytest.raises(RuntimeError, match=rf"rank {r}: task \d+ timed out waiting for its index flag"):
            world.bufs[r].check()
        assert torch.isnan(outs[r]).all()


def test_gemm_before_dispatch_is_caught():
    """Mutation: the receive/GEMM phase before any rank sent: each rank's first receive task
    (its own rows: receive tasks go own source first) times out on that dispatch flag, naming it."""
    world = World(2, [4, 3], max_spins=20)
    A, B, C = dt.PHASES
    world.run(phases=(B, A, C))
    for r in (0, 1):
        # the kernel wrote the record into the host mirror too (the CUDA path reads it, no copy)
        assert world.bufs[r].host_error[0] == 1
        assert world.bufs[r].host_error.tolist() == world.bufs[r].error.tolist()
        with pytest.raises(RuntimeError, match=rf"rank {r}: task \d+ timed out waiting for the dispatch flag of "
                                               rf"source rank {r}"):
            world.bufs[r].check()
        assert not world.bufs[r].host_error.any()  # cleared with the record


def test_stale_flag_of_earlier_call_is_not_taken():
    """Epochs: after a good call, rank 1 skips its sends in the next call. Rank 0's flag from
    rank 1 still holds the first call's epoch, which must not pass for the second call's."""
    world = World(2, [4, 3], max_spins=20)
    world.assert_matches(world.run())
    world.check_all()
    A, B, C = dt.PHASES
    x0, x1 = world.xs
    outs = [torch.full_like(x0, float("nan")), torch.full_like(x1, float("nan"))]
    world.plans[0].launch_phase(x0, outs[0], A)  # rank 1 does not send
    world.plans[0].launch_phase(x0, outs[0], B)
    with pytest.raises(RuntimeError, match=r"rank 0: .*dispatch flag of source rank 1 .*: value 1, expected ≥ 2"):
        world.bufs[0].check()


def test_dropped_publish_is_caught():
    """Mutation of the protocol: rank 0's dispatch flag at rank 1 is rolled back after the
    sends (as if the release were lost): rank 1's receive task must time out, not read rows."""
    world = World(2, [4, 3], max_spins=20)
    A, B, C = dt.PHASES
    outs = [torch.empty_like(x) for x in world.xs]
    for plan, x, out in zip(world.plans, world.xs, outs):
        plan.launch_phase(x, out, A)
    world.bufs[1].views["sent"][0] = 0
    for plan, x, out in zip(world.plans, world.xs, outs):
        plan.launch_phase(x, out, B)
    with pytest.raises(RuntimeError, match=r"rank 1: .*dispatch flag of source rank 0 .*: value 0, expected ≥ 1"):
        world.bufs[1].check()


def test_too_many_tokens_raise_before_launch():
    world = World(2, [4, 3])
    with pytest.raises(ValueError, match=r"5 tokens exceed max_tokens=4"):
        world.make_plans([torch.randn(5, 32), torch.randn(1, 32)])


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_tiles_per_rank_bound_holds(block_m):
    """MT (from W, max_tokens, k, E_loc) bounds the row tiles that all sources' rows make on
    one rank (a tile: one local expert's rows from every source), for random, spread and
    skewed routings of W ranks with max_tokens tokens each."""
    gen = torch.Generator().manual_seed(0)
    for T, E, W, k in [(1, 8, 2, 2), (5, 8, 4, 2), (33, 16, 2, 4), (130, 64, 4, 8), (512, 128, 2, 8)]:
        L = E // W
        mt = dt.max_tiles(W, T, k, L, block_m)
        routings = [torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(W * T)]),
                    torch.arange(W * T * k).view(W * T, k) % E, torch.arange(k).repeat(W * T, 1)]
        for idx in routings:
            counts = torch.bincount(idx.reshape(-1), minlength=E).view(W, L)
            tiles = (counts + block_m - 1) // block_m
            assert int(tiles.sum(1).max()) <= mt


def test_kernel_builds_for_sm90():
    """The interpreter accepts Python a GPU build refuses: build the W > 1 kernel for sm90
    (Triton's bundled ptxas, no GPU needed) without the interpreter, for small and large row
    tiles and gates (BLOCK_M, E_PAD, EL_PAD, TOP_K[, TIMELINE[, BLOCK_N1[, ROUND_LOGITS[, WIDE[, CAPACITY[, FP8]]]]]]),
    and bound its registers, spill stack and shared memory (the 128-wide GEMM1 slice of
    narrow_gemm1_slice and the wide tiles' 64- and 128-row builds included)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not ((bin_dir / "ptxas").exists() and (bin_dir / "cuobjdump").exists()):
        pytest.skip("Triton's bundled ptxas / cuobjdump is not installed")
    root = Path(__file__).resolve().parents[2]
    script = Path(__file__).with_name("_persistent_dist_sm90_build.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    # (TIMELINE 1: %globaltimer; BLOCK_N1 128: the wide GEMM1 slice at decode and 512-token sizes;
    # ROUND_LOGITS 1: the gate's logits rounded to bf16, as for a transformers router in bf16)
    specs = ["16,16,16,2", "16,128,64,8", "128,16,16,2", "16,128,64,8,1", "32,128,64,8,0,128", "128,128,64,8,0,128",
             "32,128,64,8,0,128,1", "128,16,16,2,0,256,0,1", "64,256,128,8,0,128,1,1", "32,128,64,8,0,128,0,0,1",
             "64,256,128,8,0,128,1,1,1", "128,128,64,8,0,128,0,1", "16,128,64,8,0,128,0,0,0,1",
             "64,256,128,8,0,128,1,1,0,1"]
    proc = subprocess.run([sys.executable, str(script), *specs], env=env, cwd=root, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = {spec: tuple(map(int, rest)) for spec, *rest in (ln.split() for ln in proc.stdout.splitlines())}
    assert set(built) == set(specs)
    for spec, (regs, stack, shared) in built.items():
        # (the build specializes the shapes as a launch does, so it spills as the GPU's build does:
        # at most 56 bytes of these specs; without the hints it spilled up to 936)
        assert regs <= 255 and stack <= 256, f"{spec}: {regs} registers, {stack} bytes of spill stack"
        # shared memory an sm90 program may take (227 KB), and for narrow tiles two programs per SM
        # (each with the 1 KB the driver reserves): a larger logits task or more stages must not
        # halve the grid (or fail to launch) unnoticed
        wide = spec.split(",")[7:8] == ["1"]
        assert shared <= (232448 if wide else 115712), f"{spec}: {shared} bytes of shared memory"


def test_single_device_check_script_passes_and_catches_a_dropped_phase(monkeypatch, capsys):
    """tests/gpu/persistent_sim_check.py --smoke (the single-GPU debugging path of the W > 1
    kernel) passes on the CPU, and fails when the receive/GEMM phase runs before the sends."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "gpu" / "persistent_sim_check.py"
    spec = importlib.util.spec_from_file_location("persistent_sim_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--smoke"]) == 0
    assert "0 failed checks" in capsys.readouterr().out
    A, B, C = dt.PHASES
    monkeypatch.setattr(script, "run_simulated", lambda plans, xs: run_simulated(plans, xs, (B, A, C)))
    monkeypatch.setattr(script, "DistPlan", lambda *a, **kw: DistPlan(*a, **{**kw, "max_spins": 20}))
    assert script.main(["--smoke"]) == 1
    out = capsys.readouterr().out
    assert "FAIL tokens per rank" in out and "FAIL rank 0: persistent MoE kernel, rank 0" in out


@pytest.mark.parametrize("Ts", [[6], [0]])
def test_one_launch_runs_every_task(Ts):
    """The one-launch call (phase None, what a GPU rank runs) must cover every task kind. With one
    rank the interpreter can run it (its programs run one after another, and every wait is on an
    earlier task of the same rank); a launch that starts past the logits tasks times out."""
    w = World(1, Ts, max_spins=1 << 10)
    layout = w.plans[0].layout
    assert layout.task_range(None) == (0, layout.total)
    ranges = [layout.task_range(p) for p in dt.PHASES]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
    w.assert_matches(w.run(phases=(None,)))
    w.check_all()


def test_gemm1_count_reaches_the_combine_without_a_skip():
    """A program counts its GEMM1 tasks when it leaves the kind: at the skip past the real tiles,
    or, where every tile the bound allows is real (no skip task: one token, top-1 of two
    experts), at its first combine task, before that task waits for the return flag the count
    publishes (uncounted, the wait would time out)."""
    w = World(1, [1], experts=2, top_k=1, max_spins=1 << 10)
    plan = w.plans[0]
    w.assert_matches(w.run(phases=(None,)))
    w.check_all()
    assert int(w.bufs[0].state[Word.N_TILES]) == plan.layout.mt == 1  # (every tile real: no skip task)


def _stress_on_gloo(rank, world, failures_path, broken, factor):
    """tests/gpu/persistent_dist_check.py's stress on gloo ranks (the staged transport, the kernel
    under the interpreter), small: random rank-local counts, skewed calls, every 10th checked;
    with a capacity factor, its reference drops per rank as the policy does."""
    import importlib.util
    from pathlib import Path

    import torch.distributed as dist

    from interlace import MoELayer
    from interlace.tools.bench import init_env

    path = Path(__file__).resolve().parents[1] / "gpu" / "persistent_dist_check.py"
    spec = importlib.util.spec_from_file_location("persistent_dist_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    env = init_env()
    cfg = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32, capacity_factor=factor)
    layer = MoELayer(cfg, group=env.group, strategy="persistent", seed=5, device="cpu",
                     strategy_options={"max_tokens": 12})
    if broken:  # a wrong output on one rank must fail the check on every rank
        forward = layer.strategy.forward_layer

        def wrong(x, *args):
            out = forward(x, *args)
            return out * 1.1 if rank == 1 else out  # (10%: over the bf16 tolerance)

        layer.strategy.forward_layer = wrong
    failed = []
    # Broken: 10 calls, one of them checked (call 9: 8 tokens on rank 1). Rank 0's calls are the
    # unbroken run's and every checked call goes through the same comparison, so a second
    # checked call would only repeat the unbroken run's work.
    calls = 10 if broken else 20
    script.stress("tiny", layer, env, calls, lambda ok, msg: failed.append(msg) if not ok else None, max_tokens=12)
    seen = [None] * world
    dist.all_gather_object(seen, failed)
    assert all(bool(f) == broken for f in seen), seen


@pytest.mark.parametrize("broken, factor", [(False, None), (True, None), (False, 0.6)])
def test_dist_check_stress_runs_on_gloo(tmp_path, broken, factor):
    from helpers import run_gloo

    run_gloo(_stress_on_gloo, 2, str(tmp_path), broken, factor)


def _pick_check_on_gloo(rank, world, failures_path):
    """The dist check's pick comparison: the kernel's own picks agree with the reference's; picks
    swapped between two experts whose scores differ by 2e-5 of the row's (a near-tie) count as
    near-ties, and a pick moved to an unrelated expert as a far pick: on the rank whose pick moved,
    and (reduced) on every rank."""
    import importlib.util
    from pathlib import Path

    from interlace import MoELayer
    from interlace.tools.bench import init_env

    path = Path(__file__).resolve().parents[1] / "gpu" / "persistent_dist_check.py"
    spec = importlib.util.spec_from_file_location("persistent_dist_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    env = init_env()
    cfg = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32)
    layer = MoELayer(cfg, group=env.group, strategy="persistent", seed=5, device="cpu",
                     strategy_options={"max_tokens": 12})
    with torch.no_grad():
        u = layer.router.weight[6] / layer.router.weight[6].norm()
        layer.router.weight[7] = layer.router.weight[6] * (1 + 1e-6)  # every token: 7 then 6, a near-tie
        gen = torch.Generator().manual_seed(rank)
        x = 3.0 * cfg.hidden**0.5 * u + 0.1 * torch.randn(10, cfg.hidden, generator=gen)
        out = layer(x)
    picks = layer.strategy._plans[10].workspace["idx"]
    assert picks[:20].tolist() == [7, 6] * 10
    assert script.pick_check(layer, x)[1:] == (0, 0)
    err, ties, far = script.checked_err(layer, x, out, env)
    assert (ties, far) == (0, 0) and err < 1e-4
    picks[0], picks[1] = 6, 7  # token 0: the near-tie the other way round
    if rank == 1:
        picks[2 * 5] = 2  # token 5's first pick to an unrelated expert
    assert script.pick_check(layer, x)[1:] == (2, int(rank == 1))
    _, ties, far = script.checked_err(layer, x, out, env)
    assert (ties, far) == (2, 1)  # (the worst over the ranks)


def test_dist_check_pick_comparison_on_gloo(tmp_path):
    from helpers import run_gloo

    run_gloo(_pick_check_on_gloo, 2, str(tmp_path))


@triton.jit
def _slice_order_probe(tiles_ptr, out_ptr, mt, n_slices, BLOCK_M: tl.constexpr):
    rel = tl.program_id(0)
    tile, piece, lx, first, end = expert_slice_order(rel, rel // n_slices, n_slices, tiles_ptr, mt, BLOCK_M)
    for i, v in enumerate((tile, piece, lx, first, end)):
        tl.store(out_ptr + 5 * rel + i, v)


def test_gemm_tasks_take_each_slice_over_an_experts_tiles_together():
    """GEMM task numbers → (tile, slice): expert by expert, and within an expert slice by slice
    over its tiles (consecutive numbers: the same weight slice, read once from HBM for all the
    expert's tiles), a bijection onto every (real tile, slice); with each tile's expert and
    rows as its table entry has them."""
    block_m, n_slices, rows = 16, 3, [40, 0, 3, 17]  # experts of 3, 0, 1 and 2 tiles
    tiles = []
    for e, r in enumerate(rows):
        tiles += [(e, first, r) for first in range(0, r, block_m)]
    mt = len(tiles) + 2  # (the table is sized by a bound)
    table = torch.zeros(3 * mt, dtype=torch.int32)
    for j, (e, first, end) in enumerate(tiles):
        table[j], table[mt + j], table[2 * mt + j] = e, first, end
    n = len(tiles) * n_slices
    out = torch.full((5 * n,), -1, dtype=torch.int32)
    _slice_order_probe[(n,)](table, out, mt, n_slices, BLOCK_M=block_m)
    got = [tuple(p[:2]) for p in out.view(n, 5).tolist()]
    assert [tuple(p[2:]) for p in out.view(n, 5).tolist()] == [tiles[t] for t, _ in got]
    want, b = [], 0
    for r in rows:
        n_e = -(-r // block_m)
        want += [(b + i, s) for s in range(n_slices) for i in range(n_e)]
        b += n_e
    assert got == want
    assert sorted(got) == [(t, s) for t in range(len(tiles)) for s in range(n_slices)]


def test_kernel_args_name_every_parameter():
    """DistKernelArgs name the kernel's parameters in order, and a launch's positional arguments
    are its call group then the plan's cached rest; the phases' task ranges are the kernel's
    numbering (protocol.kind_starts)."""
    import inspect

    from interlace.kernels.persistent.dist_kernel import persistent_dist_kernel

    W, L, N, K, k, T = 2, 4, 64, 32, 2, 5
    buf = simulated_world(DistSpec(W, L, N, k, 8, torch.float32))[0]
    x = torch.randn(T, N)
    plan = DistPlan(x, torch.randn(W * L, N), None, torch.empty(L, 2 * K, N), torch.empty(L, N, K), buf, top_k=k,
                    softmax=True, renormalize=True, route_scale=1.0, activation="swiglu", w_pieces=0,
                    config=PersistentKernelConfig(), max_spins=1)
    assert list(plan.args.as_kwargs()) == list(inspect.signature(persistent_dist_kernel.fn).parameters)
    out = torch.empty_like(x)
    programs, args = plan.kernel_args(x, out, dt.PHASES[1])
    assert args[:6] == (x, out, programs, *plan.layout.task_range(dt.PHASES[1]), 0)
    assert args[6:] == plan.args.runtime(skip_call=True)
    counts = plan.layout.counts()
    assert [plan.layout.first(kind) for kind in range(len(counts))] == [sum(counts[:i]) for i in range(len(counts))]
