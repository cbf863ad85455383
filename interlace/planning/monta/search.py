"""Enumerate layouts × MoE strategies × all-to-all forms, simulate, rank by predicted step time.

Layouts (MoNTA §Cluster Expansion, rank order [TP, EP, CP, PP, DP] innermost first): TP divides
the GPUs of a node, the heads and the expert FFN size; CP divides the sequence; PP divides the
layers; EP divides the experts and is either its own dimension (``horizontal``: EP ⟂ CP, the
switch must connect cp·ep ranks) or the CP group itself (``vertical``: EP = CP, network scale
max(ep, cp)); DP takes the rest. MoNTA prefers horizontal while cp < ep and vertical when
cp ≥ ep; the search simply tries both and lets the model decide.

For each layout: micro-batches m = ceil(global batch / (b · attention-DP replicas)), tokens per
GPU per micro-batch T = b·s/cp, the memory model (:mod:`interlace.planning.monta.memory`) — layouts that do
not fit are rejected with their reason — and, for every form (O0–O3 with TP > 1) and strategy
(sequential, pipelined r ∈ {2, 4, 8}), the step time of :mod:`interlace.planning.monta.simulate`.
Ties break on memory, then on the simpler layout, so the ranking is deterministic.

``fused`` is accepted but never gets rows of its own: a training call of the ``fused`` strategy
runs ``sequential``'s forward and backward (its default train path), so its step time is
exactly ``sequential``'s (:data:`FUSED_NOTE`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from interlace.planning.monta.cluster import Cluster
from interlace.planning.monta.layer import ClusterMachine, LayerPlan, make_plan, simulate_layer
from interlace.planning.monta.memory import MemoryEstimate, estimate, usable_bytes
from interlace.planning.monta.model import ModelSpec, with_dtype
from interlace.planning.monta.simulate import StepTime

PIPELINE_DEGREES = (2, 4, 8)
STRATEGIES = ("sequential", "pipelined", "fused")
FUSED_NOTE = ("fused: no rows of its own: a training call of `fused` runs sequential's forward and backward "
              "(its default train path), so its step time is sequential's; fused:train is not modelled "
              "(strategy 'auto' chooses it from measured pairs only)")


@dataclass(frozen=True)
class TrainSetup:
    """What is trained: sequence length, global batch (sequences), micro-batch, memory options."""

    seq: int = 4096
    global_batch: int = 256
    micro_batch: int = 1
    zero: int = 1
    sp: bool = True
    recompute: str = "selective"
    flash_attention: bool = True

    def __post_init__(self):
        if self.seq < 1 or self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError("seq, global_batch and micro_batch must be >= 1")


@dataclass(frozen=True)
class Layout:
    tp: int
    ep: int
    cp: int
    pp: int
    dp: int
    ep_cp: str  # "horizontal" (EP its own dimension) or "vertical" (EP = CP group)

    @property
    def ep_dim(self) -> int:
        return self.ep if self.ep_cp == "horizontal" else 1

    @property
    def world(self) -> int:
        return self.tp * self.ep_dim * self.cp * self.pp * self.dp

    def label(self) -> str:
        cp = f" CP{self.cp}{'v' if self.ep_cp == 'vertical' else ''}" if self.cp > 1 else ""
        return f"TP{self.tp} EP{self.ep}{cp} PP{self.pp} DP{self.dp}"


@dataclass
class Candidate:
    layout: Layout
    form: str
    chunks: int
    strategy: str
    time: StepTime
    memory: MemoryEstimate
    why: str

    def row(self) -> dict:
        return {"layout": self.layout.label(), **asdict(self.layout), "form": self.form, "chunks": self.chunks,
                "strategy": self.strategy, "layer_fwd_ms": self.time.layer_fwd_ms,
                "layer_bwd_ms": self.time.layer_bwd_ms, "layer_ms": self.time.layer_ms,
                "step_moe_ms": self.time.step_ms, "grad_sync_ms": self.time.grad_sync_ms,
                "memory_gib": self.memory.gib(), "why": self.why}


@dataclass
class PlanResult:
    cluster: Cluster
    model: ModelSpec
    setup: TrainSetup
    ranked: list[Candidate]
    rejected: list[tuple[Layout, str, float]]  # (layout, reason, bytes needed), closest to fitting first
    layouts: int
    notes: list[str] = field(default_factory=list)

    def to_json(self, top: int = 100) -> dict:
        return {"cluster": self.cluster.name, "model": self.model.name, "setup": asdict(self.setup),
                "layouts_enumerated": self.layouts, "rejected": len(self.rejected),
                "rejected_closest": [(lay.label(), why) for lay, why, _ in self.rejected[:20]],
                "candidates": len(self.ranked), "ranked": [c.row() for c in self.ranked[:top]], "notes": self.notes}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cluster: Cluster, model: ModelSpec, setup: TrainSetup) -> list[Layout]:
    world, g = cluster.world, cluster.gpus_per_node
    moe = model.moe
    out = []
    for tp in _divisors(g):
        if model.heads % tp or moe.ffn % tp:
            continue
        for cp in _divisors(world // tp):
            if cp > 64 or setup.seq % cp or (setup.seq // cp) * setup.micro_batch < 1:
                continue
            for pp in _divisors(world // (tp * cp)):
                if model.layers % pp or pp > 32:
                    continue
                rest = world // (tp * cp * pp)
                for ep in _divisors(rest):
                    if moe.num_experts % ep == 0:
                        out.append(Layout(tp, ep, cp, pp, rest // ep, "horizontal"))
                if cp > 1 and moe.num_experts % cp == 0:
                    out.append(Layout(tp, cp, cp, pp, rest, "vertical"))
    return out


class Planner:
    """Evaluates layouts on one cluster, caching layer simulations shared between layouts."""

    def __init__(self, cluster: Cluster, model: ModelSpec, setup: TrainSetup, strategies=STRATEGIES):
        unknown = set(strategies) - set(STRATEGIES)
        if unknown or not strategies:
            raise ValueError(f"strategies must be among {', '.join(STRATEGIES)}; got {list(strategies)}")
        if set(strategies) == {"fused"}:
            raise ValueError(f"{FUSED_NOTE}: pass sequential too")
        self.strategies = tuple(strategies)
        self.cluster, self.setup = cluster, setup
        self.model = with_dtype(model, cluster.dtype)
        self.machine = ClusterMachine(cluster)
        self._cache: dict = {}

    def groups(self, lay: Layout):
        c = self.cluster
        return c.group(lay.tp, 1), c.group(lay.ep, lay.tp)

    def microbatches(self, lay: Layout) -> int:
        replicas = lay.ep_dim * lay.dp
        return math.ceil(self.setup.global_batch / (self.setup.micro_batch * replicas))

    def memory(self, lay: Layout, form: str) -> MemoryEstimate:
        s = self.setup
        replicas = lay.ep_dim * lay.cp * lay.dp
        return estimate(self.model, micro_batch=s.micro_batch, seq=s.seq, tp=lay.tp, ep=lay.ep, cp=lay.cp,
                        pp=lay.pp, replicas_non_moe=replicas, replicas_moe=replicas // lay.ep,
                        microbatches=self.microbatches(lay), zero=s.zero, sp=s.sp, recompute=s.recompute,
                        flash_attention=s.flash_attention, form=form, bpe=2)

    def grad_sync_ms(self, lay: Layout) -> float:
        replicas = lay.ep_dim * lay.cp * lay.dp // lay.ep
        if replicas <= 1:
            return 0.0
        grads = 2 * self.model.moe_params() / (lay.tp * lay.pp * lay.ep)
        g = self.cluster.group(replicas, lay.tp * lay.ep_dim)
        if self.setup.zero >= 1:
            return self.machine.ag(grads, g)  # reduce-scatter: same traffic as an all-gather
        return self.machine.ar(grads, g)

    def layer(self, lay: Layout, form: str, strategy: str) -> tuple[LayerPlan, float, float]:
        tokens = self.setup.micro_batch * self.setup.seq // lay.cp
        tg, eg = self.groups(lay)
        key = (tokens, lay.tp, lay.ep, tg, eg, form, strategy)
        if key not in self._cache:
            plan = make_plan(self.machine, self.model.moe, tokens, lay.tp, lay.ep, form, strategy, tg, eg)
            self._cache[key] = (plan, simulate_layer(self.machine, plan)[0],
                                simulate_layer(self.machine, plan, backward=True)[0])
        return self._cache[key]

    def options(self, lay: Layout) -> list[tuple[str, str]]:
        forms = ["O0"] if lay.tp == 1 else ["O0", "O1", "O2", "O3"]
        opts = []
        for f in forms:
            opts.append((f, "sequential"))
            if lay.ep > 1 or lay.tp > 1:
                if f in ("O0", "O1"):
                    opts += [(f, f"pipelined:{r}") for r in PIPELINE_DEGREES]
        opts = [(f, st) for f, st in opts if st.partition(":")[0] in self.strategies]
        return opts

    def explain(self, plan: LayerPlan, fwd: float, mem: MemoryEstimate, lay: Layout) -> str:
        _, ops, _ = simulate_layer(self.machine, plan)
        comm = sum(o.gpu for o in ops if o.stream != "compute")
        expert = sum(o.gpu for o in ops if o.name == "expert")
        links = []
        for name, g in (("TP", plan.tp_group), ("EP", plan.ep_group)):
            if g.size > 1:
                links.append(f"{name} over {self.machine.link_for(g).name}")
        return (f"fwd: comm {comm:.2f} ms, experts {expert:.2f} ms, other {max(fwd - max(comm, expert), 0):.2f} ms"
                f"{'; ' + ', '.join(links) if links else ''}; {mem.total / 1024 ** 3:.1f} GiB/GPU")

    def run(self) -> PlanResult:
        layouts = enumerate_layouts(self.cluster, self.model, self.setup)
        budget = usable_bytes(self.cluster.memory_gib)
        ranked, rejected = [], []
        for lay in layouts:
            if self.setup.global_batch < self.setup.micro_batch * lay.ep_dim * lay.dp:
                rejected.append((lay, f"global batch {self.setup.global_batch} < {lay.ep_dim * lay.dp} "
                                      f"data-parallel replicas × micro-batch", float("inf")))
                continue
            mem0 = self.memory(lay, "O0")
            if mem0.total > budget:
                rejected.append((lay, f"needs {mem0.total / 1024 ** 3:.1f} GiB > {budget / 1024 ** 3:.1f} usable",
                                 mem0.total))
                continue
            m = self.microbatches(lay)
            sync = self.grad_sync_ms(lay)
            for form, strategy in self.options(lay):
                mem = self.memory(lay, form)
                if mem.total > budget:
                    continue
                plan, fwd, bwd = self.layer(lay, form, strategy)
                st = StepTime(fwd, bwd, self.model.n_moe / lay.pp, m + lay.pp - 1, sync)
                ranked.append(Candidate(lay, plan.form, plan.form_chunks, strategy, st, mem, ""))
        rejected.sort(key=lambda r: (r[2], r[0].tp, r[0].ep, r[0].cp, r[0].pp, r[0].ep_cp))  # closest first
        ranked.sort(key=lambda c: (round(c.time.step_ms, 9), round(c.memory.total), c.layout.tp, c.layout.ep,
                                   c.layout.cp, c.layout.pp, c.layout.ep_cp, c.form, c.strategy))
        for c in ranked[:100]:  # explanations only for what is shown
            plan, fwd, _ = self.layer(c.layout, c.form, c.strategy)
            c.why = self.explain(plan, fwd, c.memory, c.layout)
        notes = ["times are the MoE layers only (attention and dense layers are not modelled)"]
        if "fused" in self.strategies:
            notes.append(FUSED_NOTE)
        if not ranked:
            notes.append("no layout fits the GPU memory; see rejected_closest")
        return PlanResult(self.cluster, self.model, self.setup, ranked, rejected, len(layouts), notes)


def plan_cluster(cluster: Cluster, model: ModelSpec, setup: TrainSetup | None = None,
                 strategies=STRATEGIES) -> PlanResult:
    return Planner(cluster, model, setup or TrainSetup(), strategies).run()

