"""One MoE layer under TP×EP as GPU ops: the all-to-all forms O0–O3 (MoNTA Table 6) and the
strategies (sequential, PipeMoE-pipelined, fused), simulated on streams.

Semantics (as ``interlace.strategies.tp_ep``): T tokens per rank, the same T on every rank of a
TP group (replicated activations); each expert's FFN dimension K is split over the TP group
(K/t per rank), experts over the EP group (E/e per rank). Per rank, with row bytes B = N·bpe:

==========  ==========================================  ==============================================
form        dispatch                                     combine
==========  ==========================================  ==============================================
O0          A2A_EP(T·k·B)                                A2A_EP(T·k·B), unpermute, AllReduce_TP(T·B)
O1          A2A_EP(T·k·B/t), AllGather_TP(T·k·B)         ReduceScatter_TP(T·k·B), A2A_EP(T·k·B/t),
                                                         unpermute, AllGather_TP(T·B)
O2 (N)      per chunk: A2A_EP(T·k·B/(t·N)) ∥             D2D(T·k·B), then per chunk ReduceScatter_TP
            AllGather_TP(T·k·B/N); then D2D(T·k·B)       ∥ A2A_EP(T·k·B/(t·N))
O3 (N)      O2 with the D2D per chunk (chunk c's copy    mirror: chunk c+1's copy beside chunk c's
            beside chunk c+1's all-gather)               reduce-scatter
==========  ==========================================  ==============================================

The expert stage computes T·k rows (balanced routing) with K/t columns. Streams: ``compute``
(experts, re-layout copies), ``a2a`` (EP communicator), ``tp`` (TP communicator). O2/O3's chunk count N comes from
MoNTA's Algorithm 1/2 (:mod:`interlace.planning.monta.chunks`) fed with the links' efficiency curves.

Strategies: ``sequential`` (dispatch → experts → combine), ``pipelined:r`` (PipeMoE: r token
chunks, the dispatch of chunk i+1 beside the experts of chunk i; with O0/O1) and ``fused``
(``interlace.strategies.fused.inference``, EP only). ``fused`` comes from a profile's measured
fused/sequential pairs where :func:`predict_layer_ms` has them (TP = 1 at the profile's world
size); elsewhere (clusters, the layout search) it is modelled as COMET's fine-grained overlap
hiding 86.5% of the shorter of communication and compute (COMET §5.3). Backward (training)
repeats the op list with twice the expert time (input and weight gradients); a training call of
``fused`` runs ``sequential``'s forward and backward (the strategy's default ``train_path``;
``fused:train`` measured slower on most shapes), so its backward is that of ``sequential``. This planner does not model ``fused:train``; ``auto`` picks it from
measured pairs only.

Costs come from a *machine*: :class:`ClusterMachine` (a cluster description) or
:class:`ProfileMachine` (a measured ``interlace profile``; for TP = 1 the calibrated planner of
``interlace.planning.pipemoe.degree`` is used as is).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from interlace.config import MoEConfig
from interlace.planning.monta import primitives as P
from interlace.planning.monta.chunks import MontaInputs, find_chunks
from interlace.planning.monta.cluster import CHUNK_HOST_US, Cluster, cluster_preset, load_cluster
from interlace.planning.monta.primitives import Group, Link
from interlace.planning.pipemoe.degree import fused_speedup
from interlace.planning.pipemoe.degree import predict_layer_ms as calibrated
from interlace.planning.pipemoe.schedule import Op, chunk_sizes, simulate_ops
from interlace.planning.profile import (PACKAGED_DIR, Profile, form_key, load_profile, parse_shape_key, shape_key,
                                        tp_fixed_line, tp_residual_ratio, tp_shard_key)

FORMS = ("O0", "O1", "O2", "O3")
FUSED_HIDDEN = 0.865  # COMET §5.3: hides 86.5% of the communication latency on average
MAX_FORM_CHUNKS = 16


def _bpe(cfg: MoEConfig) -> int:
    return torch.empty((), dtype=cfg.dtype).element_size()


# ----------------------------------------------------------------------------- machines
class ClusterMachine:
    """Primitive costs on a described cluster."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.host_ms = cluster.host_op_us * 1e-3
        self.chunk_host_ms = cluster.chunk_host_us * 1e-3

    def a2a(self, volume, g: Group):
        return P.all_to_all_ms(self.cluster.intra, self.cluster.inter, volume, g)

    def ag(self, out_bytes, g: Group):
        return P.all_gather_ms(self.cluster.intra, self.cluster.inter, out_bytes, g)

    def ar(self, nbytes, g: Group):
        return P.all_reduce_ms(self.cluster.intra, self.cluster.inter, nbytes, g)

    def copy(self, nbytes):
        return P.copy_ms(self.cluster.hbm, nbytes)

    def link_for(self, g: Group) -> Link:
        return self.cluster.inter if g.spans_nodes else self.cluster.intra

    def expert(self, cfg: MoEConfig, rows: float, tp: int, e_local: int) -> float:
        """Forward expert stage: gate/up grouped GEMM, activation, down grouped GEMM."""
        if rows <= 0:
            return 0.0
        bpe = _bpe(cfg)
        k_l, up_l = cfg.ffn // tp, cfg.up_width // tp
        c = self.cluster.compute
        gemm = c.gemm_ms(2 * rows * cfg.hidden * up_l, e_local) + c.gemm_ms(2 * rows * k_l * cfg.hidden, e_local)
        return gemm + self.copy(rows * (up_l + k_l) * bpe)

    def fixed(self, cfg: MoEConfig, tokens: int, tp: int) -> tuple[float, float]:
        """(device ms, host ms) outside the op list: router GEMM, top-k, sort, permute gather,
        unpermute, and the host sync of the split sizes."""
        bpe = _bpe(cfg)
        rows = tokens * cfg.top_k
        c = self.cluster.compute
        dev = (c.gemm_ms(2 * tokens * cfg.hidden * cfg.num_experts, 1) + 3 * c.launch_us * 1e-3
               + self.copy(2 * rows * cfg.hidden * bpe) + self.copy(rows * cfg.hidden * bpe + tokens * cfg.hidden * 4))
        return dev, self.cluster.sync_us * 1e-3 + 6 * self.host_ms


class ProfileMachine(ClusterMachine):
    """Primitive costs from a measured profile (``interlace.planning.profile.Profile``): its
    all-to-all curve (exact at its own world size; other groups through the NVLink efficiency
    curve it implies), its expert-stage curves (the nearest shape class, rows scaled by the
    ratio of N·K) and its fixed-term line."""

    def __init__(self, profile, hbm_gbps: float | None = None):
        self.profile = profile
        w = profile.world
        pts = tuple((x, min(1.0, x * (w - 1) / w / (450e9 * t * 1e-3))) for x, t in
                    zip(profile.a2a.sizes, profile.a2a.times) if t > 0)
        intra = Link("nvlink", 450.0, points=pts, source=f"profile {profile.key}")
        copy_gbps = hbm_gbps or profile.copy_gbps / 2  # gathers: bytes read + written
        hbm = Link("hbm", copy_gbps, peak_efficiency=1.0, latency_us=0.0)
        base = cluster_preset("h200x2")
        h = profile.host_ms
        chunk_us = max(CHUNK_HOST_US, 1e3 * (h.get("index", 0.0) + h.get("prep", 0.0) + h.get("combine", 0.0)))
        self.cluster = Cluster(f"profile:{profile.key}", profile.key, w, 1, base.memory_gib, base.compute,
                               intra, None, hbm, host_op_us=profile.a2a_host_ms * 1e3, sync_us=0.0,
                               chunk_host_us=chunk_us)
        self.host_ms = profile.a2a_host_ms
        self.chunk_host_ms = chunk_us * 1e-3
        # True: no fixed cost in the op list; predict_layer_ms adds one per call instead (the TP
        # shard class's own fitted line, interlace.planning.monta.tp_profile, or _profile_fixed_ms).
        self.raw_fixed = False

    def a2a(self, volume, g: Group):
        if g.size <= 1 or volume <= 0:
            return 0.0
        if g.size == self.profile.world:
            return self.profile.a2a(volume)
        return super().a2a(volume, g)

    def ag(self, out_bytes, g: Group):
        if g.size <= 1:
            return 0.0
        if g.size == self.profile.world:  # same bytes over the same link as an all-to-all of out_bytes
            return self.profile.a2a(out_bytes)
        return super().ag(out_bytes, g)

    def expert(self, cfg: MoEConfig, rows: float, tp: int, e_local: int) -> float:
        if rows <= 0:
            return 0.0
        entry = self.profile.tp_shapes.get(tp_shard_key(cfg, tp, e_local)) if tp > 1 else None
        if entry is not None:  # the TP shard class itself was measured
            return entry.expert(rows)
        used, shape = self.profile.shape(f"N{cfg.hidden}-K{cfg.ffn // tp}-El{e_local}-{cfg.activation}")
        n, k, _, _ = parse_shape_key(used)
        return shape.expert(rows * cfg.hidden * (cfg.ffn // tp) / (n * k))

    def fixed(self, cfg: MoEConfig, tokens: int, tp: int) -> tuple[float, float]:
        if self.raw_fixed:
            return 0.0, 0.0
        _, shape = self.profile.shape(shape_key(cfg, self.profile.world))
        return max(shape.fixed(tokens * cfg.top_k), 0.0), 0.0  # the fitted line includes the host sync


# ----------------------------------------------------------------------------- op lists
@dataclass(frozen=True)
class LayerPlan:
    """What to simulate: sizes, groups, form, strategy."""

    cfg: MoEConfig
    tokens: int
    tp: int
    ep: int
    tp_group: Group
    ep_group: Group
    form: str = "O0"
    form_chunks: int = 1
    strategy: str = "sequential"
    degree: int = 1


def parse_strategy(strategy: str) -> tuple[str, int]:
    base, _, arg = strategy.partition(":")
    if base == "sequential":
        return base, 1
    if base == "pipelined":
        r = int(arg) if arg else 2
        if r < 1:
            raise ValueError(f"pipelined degree must be >= 1, got {r}")
        return ("sequential", 1) if r == 1 else (base, r)
    if base == "fused":
        return base, 1
    raise ValueError(f"unknown strategy {strategy!r}; the planner knows sequential, pipelined:r, fused")


def parse_form(form: str) -> tuple[str, int | None]:
    base, _, arg = form.partition(":")
    if base not in FORMS:
        raise ValueError(f"unknown all-to-all form {form!r}; choose one of {FORMS}")
    return base, (int(arg) if arg else None)


def monta_chunks(m: ClusterMachine, plan: LayerPlan, form: str, i_minimal: float = 1e6) -> int:
    """O2/O3's chunk count from MoNTA Algorithm 1/2 with this machine's efficiency curves."""
    bpe = _bpe(plan.cfg)
    volume = plan.tokens * plan.cfg.top_k * plan.cfg.hidden * bpe  # I: this rank's dispatched bytes
    t, e = plan.tp, plan.ep
    ep_link, tp_link, hbm = m.link_for(plan.ep_group), m.link_for(plan.tp_group), m.cluster.hbm
    inp = MontaInputs(volume, t, e, ep_link.bandwidth_gbps * 1e9, tp_link.bandwidth_gbps * 1e9,
                      hbm.bandwidth_gbps * 1e9,
                      lambda v: ep_link.efficiency(v, (e - 1) / e if e > 1 else 1.0),
                      lambda v: tp_link.efficiency(v, (t - 1) / t if t > 1 else 1.0),
                      lambda v: hbm.efficiency(v), i_minimal=i_minimal, max_chunks=MAX_FORM_CHUNKS)
    if e == 1 or t == 1:
        return 1
    return find_chunks(inp, form).chunks


def form_messages(cfg: MoEConfig, tokens: int, tp: int, ep: int, form: str, chunks: int = 1) -> list[tuple]:
    """The table above as data: (phase, primitive, group, volume bytes) per collective or copy of
    one forward call (O2/O3: ``chunks`` entries per chunked primitive). Volumes are what
    :mod:`interlace.planning.monta.primitives` takes: bytes a rank sends (A2A), gathered output (AG),
    reduce-scatter input (RS), all-reduce buffer (AR), bytes copied (D2D)."""
    B = cfg.hidden * _bpe(cfg)
    rows = tokens * cfg.top_k
    I = rows * B  # noqa: E741  (MoNTA's I: this rank's dispatched bytes)
    msgs = []
    if form == "O0" or tp == 1:
        for phase in ("dispatch", "combine"):
            if ep > 1:
                msgs.append((phase, "A2A", "EP", I))
        if tp > 1:
            msgs.append(("combine", "AR", "TP", tokens * B))
        return msgs
    n = chunks if form in ("O2", "O3") else 1
    for _ in range(n):
        if ep > 1:
            msgs.append(("dispatch", "A2A", "EP", I / (tp * n)))
        msgs.append(("dispatch", "AG", "TP", I / n))
        if form == "O3":
            msgs.append(("dispatch", "D2D", "-", I / n))
    if form == "O2":
        msgs.append(("dispatch", "D2D", "-", I))
        msgs.append(("combine", "D2D", "-", I))
    for _ in range(n):
        if form == "O3":
            msgs.append(("combine", "D2D", "-", I / n))
        msgs.append(("combine", "RS", "TP", I / n))
        if ep > 1:
            msgs.append(("combine", "A2A", "EP", I / (tp * n)))
    msgs.append(("combine", "AG", "TP", tokens * B))
    return msgs


def layer_ops(m: ClusterMachine, plan: LayerPlan, expert_factor: float = 1.0) -> list[Op]:
    """The op list of one layer call (forward, or backward with ``expert_factor`` 2)."""
    cfg, T, t = plan.cfg, plan.tokens, plan.tp
    B = cfg.hidden * _bpe(cfg)
    e_local = cfg.num_experts // plan.ep
    h = m.host_ms
    ops: list[Op] = []

    def add(name, stream, gpu, after=(), extra_host=0.0):
        ops.append(Op(name, stream, h + extra_host, gpu, tuple(after)))
        return len(ops) - 1

    def dispatch(tokens, after):
        """Ops of one dispatch; returns the indices the experts must wait for."""
        rows = tokens * cfg.top_k
        if plan.form == "O0" or t == 1:
            return [add("A2A", "a2a", m.a2a(rows * B, plan.ep_group), after)] if plan.ep > 1 else list(after)
        n = plan.form_chunks if plan.form in ("O2", "O3") else 1
        ends = []
        for j in range(n):
            extra = m.chunk_host_ms if j else 0.0
            a = add("A2A", "a2a", m.a2a(rows * B / (t * n), plan.ep_group), after, extra) if plan.ep > 1 else None
            g = add("AG", "tp", m.ag(rows * B / n, plan.tp_group), [a] if a is not None else after,
                    0.0 if a is not None else extra)
            ends.append(add("D2D", "compute", m.copy(rows * B / n), [g]) if plan.form == "O3" else g)
        if plan.form == "O2":  # one re-layout copy after the last all-gather
            ends = [add("D2D", "compute", m.copy(rows * B), ends)]
        return ends

    def combine(tokens, after):
        rows = tokens * cfg.top_k
        if plan.form == "O0" or t == 1:
            a = add("A2A", "a2a", m.a2a(rows * B, plan.ep_group), after) if plan.ep > 1 else after[0]
            u = add("unpermute", "compute", m.copy(rows * B + tokens * B), [a])
            return add("AR", "tp", m.ar(tokens * B, plan.tp_group), [u]) if t > 1 else u
        n = plan.form_chunks if plan.form in ("O2", "O3") else 1
        if plan.form == "O2":  # one re-layout copy before the first reduce-scatter
            after = [add("D2D", "compute", m.copy(rows * B), after)]
        last = []
        for _ in range(n):
            prev = [add("D2D", "compute", m.copy(rows * B / n), after)] if plan.form == "O3" else after
            r = add("RS", "tp", m.ag(rows * B / n, plan.tp_group), prev)
            last.append(add("A2A", "a2a", m.a2a(rows * B / (t * n), plan.ep_group), [r]) if plan.ep > 1 else r)
        u = add("unpermute", "compute", m.copy((rows * B + tokens * B) / t), last)
        return add("AG", "tp", m.ag(tokens * B, plan.tp_group), [u])

    chunks = [T] if plan.strategy != "pipelined" else chunk_sizes(T, plan.degree)
    waits = []
    for c, tc in enumerate(chunks):
        if c:  # one more chunk's bookkeeping (counting sort, index, gather) on the host
            add("prep", "compute", 0.0, [], m.chunk_host_ms)
        waits.append(dispatch(tc, []))
    experts = []
    for tc, w in zip(chunks, waits):
        experts.append(add("expert", "compute", expert_factor * m.expert(cfg, tc * cfg.top_k, t, e_local), w))
        if plan.strategy == "pipelined":
            combine(tc, [experts[-1]])
    if plan.strategy != "pipelined":
        combine(T, [experts[-1]])
    return ops


def simulate_layer(m: ClusterMachine, plan: LayerPlan, backward: bool = False) -> tuple[float, list[Op], list[float]]:
    """(ms, ops, op end times) of one layer call; the fixed part (routing, sync) comes first."""
    dev, host = m.fixed(plan.cfg, plan.tokens, plan.tp)
    ops = [Op("route+sync", "compute", host, dev)]
    body = layer_ops(m, plan, 2.0 if backward else 1.0)
    ops += [Op(o.name, o.stream, o.host, o.gpu, tuple(j + 1 for j in o.after)) for o in body]
    for i, o in enumerate(ops[1:], 1):  # everything waits for the routing
        if not o.after:
            ops[i] = Op(o.name, o.stream, o.host, o.gpu, (0,))
    total, ends = simulate_ops(ops)
    if plan.strategy == "fused":
        if backward:
            # A training call of `fused` runs sequential's forward and backward (its default
            # train_path): callers add this to the fused forward's time, so return sequential's
            # backward plus the difference of the two forwards.
            seq = replace(plan, strategy="sequential")
            shift = simulate_layer(m, seq)[0] - simulate_layer(m, plan)[0]
            total, ops, ends = simulate_layer(m, seq, backward=True)
            return total + shift, ops, [e + shift for e in ends]
        comm = sum(o.gpu for o in ops if o.stream != "compute")
        comp = sum(o.gpu for o in ops[1:] if o.stream == "compute")
        total = dev + host + max(comm, comp) + (1 - FUSED_HIDDEN) * min(comm, comp)
    return total, ops, ends


def make_plan(m: ClusterMachine, cfg: MoEConfig, tokens: int, tp: int, ep: int, form: str, strategy: str,
              tp_group: Group | None = None, ep_group: Group | None = None) -> LayerPlan:
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if tp < 1 or ep < 1 or cfg.num_experts % ep or cfg.ffn % tp:
        raise ValueError(f"TP={tp} must divide K={cfg.ffn} and EP={ep} must divide E={cfg.num_experts}")
    base, chunks = parse_form(form)
    strat, r = parse_strategy(strategy)
    if tp == 1:
        base, chunks = "O0", 1
    if strat == "pipelined" and base in ("O2", "O3"):
        raise ValueError("pipelined token chunks combine with forms O0/O1 only (O2/O3 chunk inside the form)")
    tp_group = tp_group or Group(tp, tp)
    ep_group = ep_group or Group(ep, ep)
    plan = LayerPlan(cfg, tokens, tp, ep, tp_group, ep_group, base, 1, strat, r)
    if base in ("O2", "O3"):
        n = chunks or monta_chunks(m, plan, base)
        plan = LayerPlan(cfg, tokens, tp, ep, tp_group, ep_group, base, max(1, n), strat, r)
    return plan


def _measured_fused_ms(prof, config: MoEConfig, tokens: int, backward: bool) -> float | None:
    """``fused`` from the profile's measured fused/sequential forward pairs of this exact shape
    class (``interlace.planning.pipemoe.degree.fused_speedup``) applied to the calibrated sequential
    prediction; a training call is sequential's forward + backward with the fused forward in
    place of sequential's (its default train path). None without pairs."""
    shape = prof.shapes.get(shape_key(config, prof.world))
    speedup = None if shape is None else fused_speedup(shape, tokens * config.top_k)
    if speedup is None:
        return None
    seq_fwd = calibrated(prof, config, tokens, prof.world, 1)
    if not backward:
        return seq_fwd / speedup
    return calibrated(prof, config, tokens, prof.world, 1, mode="fwdbwd") - seq_fwd + seq_fwd / speedup


def predict_layer_ms(config: MoEConfig, tokens: int, tp: int, ep: int, form: str = "O0",
                     strategy: str = "sequential", profile_or_cluster=None, backward: bool = False) -> float:
    """Predicted ms of one MoE layer call (forward; fwd+bwd with ``backward=True``).

    ``tokens`` per rank (the same on every rank of a TP group); ``form`` ``O0``–``O3`` (``O2:4``
    fixes the chunk count, else MoNTA's search picks it); ``strategy`` ``sequential``,
    ``pipelined:r`` or ``fused``; ``profile_or_cluster`` a :class:`Cluster`, a preset name, a
    ``Profile``, or None for the shipped 2×H200 profile. With a profile and TP = 1 the
    calibrated run-time planner's model is used (``interlace.planning.pipemoe.degree.predict_layer_ms``).
    """
    src = profile_or_cluster
    if src is None:
        src = load_profile(2, path=PACKAGED_DIR / "NVIDIA_H200-sm132-w2-n1-p2p.json")
    if isinstance(src, str):
        src = load_cluster(src)
    strat, r = parse_strategy(strategy)
    if isinstance(src, Profile):
        if tp == 1 and strat == "fused" and ep == src.world:
            measured = _measured_fused_ms(src, config, tokens, backward)
            if measured is not None:
                return measured
        if tp == 1 and strat in ("sequential", "pipelined") and ep == src.world:
            if not backward:
                return calibrated(src, config, tokens, ep, r)
            try:  # the run-time planner's own forward + backward model, where it has one
                return calibrated(src, config, tokens, ep, r, mode="fwdbwd")
            except TypeError:
                m = ProfileMachine(src)
                plan = make_plan(m, config, tokens, tp, ep, form, strategy)
                return calibrated(src, config, tokens, ep, r) + simulate_layer(m, plan, backward=True)[0]
        # The op list without a fixed part, plus one fixed cost per call (below): the TP shard
        # class's own fitted line where it was measured (interlace.planning.monta.tp_profile), else what
        # `sequential` calibrated at the same dispatched rows (_profile_fixed_ms).
        m = ProfileMachine(src)
        m.raw_fixed = True
        if tp > 1:
            plan = make_plan(m, config, tokens, tp, ep, form, strategy)
            total = simulate_layer(m, plan)[0]
            if backward:
                total += simulate_layer(m, plan, backward=True)[0]
            entry = src.tp_shapes.get(tp_shard_key(config, tp, config.num_experts // ep))
            if entry is not None:
                mode, rows = ("fwdbwd" if backward else "fwd"), tokens * config.top_k
                total += tp_fixed_line(entry, mode, rows)
                if plan.strategy == "sequential":  # what the calibrated forms measured beyond that
                    total *= tp_residual_ratio(entry, mode, form_key(plan.form, plan.form_chunks), rows)
                return total
            return total + _profile_fixed_ms(src, config, tokens, backward)
    else:
        m = ClusterMachine(src)
    if isinstance(src, Cluster):
        plan = make_plan(m, config, tokens, tp, ep, form, strategy, src.group(tp, 1), src.group(ep, tp))
    else:
        plan = make_plan(m, config, tokens, tp, ep, form, strategy)
    total = simulate_layer(m, plan)[0]
    if backward:
        total += simulate_layer(m, plan, backward=True)[0]
    if isinstance(src, Profile):
        total += _profile_fixed_ms(src, config, tokens, backward)
    return total


def _profile_fixed_ms(prof, config: MoEConfig, tokens: int, backward: bool) -> float:
    """What the op model leaves out of one layer call (routing, count exchange, the host sync,
    launch gaps), as the run-time planner calibrated it on the profile's own ``sequential``
    points at the same dispatched rows T·k (a TP rank dispatches all of its T tokens' rows).
    Nothing here is fitted on TP×EP measurements."""
    mode = "fwdbwd" if backward else "fwd"
    try:
        with_fixed = calibrated(prof, config, tokens, prof.world, 1, mode=mode, corrected=False)
        without = calibrated(prof, config, tokens, prof.world, 1, include_fixed=False, mode=mode)
    except (KeyError, TypeError, ValueError):
        return 0.0
    return max(with_fixed - without, 0.0)
