"""``persistent``: the whole MoE layer in one persistent Triton launch (issue 30; world size 1,
and any world size W that divides the number of experts, forward inference).

An inference call runs gate (router logits, top-k, weights) → dispatch index → GEMM0 +
activation → GEMM1 → combine as tasks of one kernel (:mod:`interlace.kernels.persistent`): one
launch and no host sync per call, so decode-sized calls are not bound by the host's launches.
The router runs inside the kernel, so the layer hands this strategy the router's weights
(:meth:`PersistentStrategy.forward_layer`) instead of routing itself first.

World size W > 1 (:mod:`interlace.kernels.persistent.dist_kernel`): still one launch per rank
and call; the dispatch and the combine are one-sided stores into the peers' symmetric memory
(:class:`~interlace.kernels.persistent.dist_launch.DistBuffer`, sized from the ``max_tokens``
option: a call with more tokens raises a one-line ``ValueError`` before the launch; None: the
first call's largest token count over the ranks, agreed by an all-reduce, a host sync once).
Every rank must make every call, zero-token calls included (they still launch: peers wait for
their flags). Transports: torch symmetric memory on CUDA (one launch, capturable as a CUDA
graph like world 1); on other process groups (gloo on the CPU, under the interpreter) the same
kernel runs as three launches with ``all_to_all`` exchanges of the written regions between
them (:meth:`~interlace.kernels.persistent.dist_launch.DistPlan.run_phases`). Buffers are
shared by the layers of a process with the same group and shapes (one call at a time, in
stream order: the epochs in the buffer's state count every call of every layer).

What runs ``sequential``'s path instead (the layer routes, then :meth:`__call__`):
* training calls (grad enabled and the input or a weight requires grad; the kernel has no
  backward yet), and calls in training mode with a balance loss (it needs the logits);
* calls with user-given ``expert_indices``;
* calls traced by ``torch.compile`` (the kernel is not a custom op yet).

FP8 experts (``MoEConfig.expert_quant="fp8"``): the GEMM tasks read the e4m3 weights and their
128 × 128 block scales and dequantize each weight block in registers before its dot (W8A16: a
decode call reads half the weight bytes; the dots and h stay in x's dtype).

Refused in this phase, each with a one-line ``ValueError`` when the strategy is built (before any
weight): a world size that does not divide the experts, group-limited routing
(``n_group``/``topk_group``), ``softmax_after_topk``, fp64 tensors or an fp64 router, fp16
activations with ``router_gemm="input"``.

Errors: a bounded wait that times out leaves an error record on the device and writes it into a
host mirror (page-locked memory the kernel stores into: no copy per call); on CUDA it is raised at
a later call once an event behind the failing call has completed, or by
:meth:`PersistentStrategy.synchronize_and_check`; on the CPU (interpreter) at once.

Host cost. A call's shape (token count T) gets a
:class:`~interlace.kernels.persistent.launch.CallPlan` (tiles, task layout, grid, workspace, kernel
arguments; the compiled kernel's own launcher after its first launch), kept for at most
``MAX_PLANS`` token counts (least recently used dropped). With ``cuda_graph`` (default) on CUDA,
the second call of a T captures the launch into a CUDA graph and later calls replay it: the input
is copied into the graph's static buffer, the output copied out (those buffers, the graph's memory
pool and a plan's activation scratch are shared by every layer's plans and graphs of that shape:
strategies/graphs.py, ``alloc.shared``). The kernel is capturable (epochs
and counters live on the device and are reset by the launch itself). A graph holds the weights'
addresses and the plan's buffers: it is captured again when a weight is a different tensor
(in-place updates need nothing) or the plan was rebuilt. A capture synchronizes the device once.
Inside a caller's own CUDA-graph capture the call runs eagerly with its own workspace (captured by
the caller).

Options (``strategy_options``): ``cuda_graph`` (bool, default True; ``"persistent:eager"`` turns
it off), ``kernel`` (a :class:`~interlace.kernels.persistent.config.PersistentKernelConfig`),
``max_spins`` (polls before a wait gives up; None: 2²² at world size 1, unbounded at W > 1),
``wait_timeout_s`` (W > 1 on a GPU: seconds a wait polls before it gives up, default 100: a
peer's first call of a shape may start late by a whole kernel compile), ``max_tokens`` (W > 1:
tokens per rank and call the buffers hold), ``task_order`` (``"normal"``; ``"combine_first"``
breaks the order on purpose, for tests), ``timeline`` (bool, default False: every task of a call
records its program, SM, start, end of its waits and end, read by :meth:`timeline_records` and
drawn by :mod:`interlace.tools.timeline`; calls then run eagerly, without CUDA graphs; off, the
recording is compiled out).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace.kernels.persistent.config import PersistentKernelConfig, router_pieces
from interlace.kernels.persistent.dist_launch import DEFAULT_TIMEOUT_S, DistBuffer, DistPlan, DistSpec
from interlace.kernels.persistent.launch import DEFAULT_SPINS, CallPlan, PersistentState
from interlace.kernels.persistent.protocol import describe_error
from interlace.fp8 import BlockFP8Weight
from interlace.kernels.rows import _INTERPRET
from interlace.parallel.agreement import CallAgreement
from interlace.parallel.comm import held_group
from interlace.parallel.peer_buffer import leave_shared, on_release, take_shared
from interlace.kernels.timeline import CLOCK_GPU, CLOCK_LOGICAL
from interlace.kernels.persistent.tasks import TASK_ORDERS
from interlace.strategies.base import Strategy, register_strategy
from interlace.strategies.graphs import CudaGraphRecorder, capture_for, shared_static, static_copies
from interlace.strategies.sequential import SequentialStrategy


def unsupported(config, world: int) -> str | None:
    """Why phase 1 of the persistent kernel cannot run this layer, in one line, or None."""
    if world > 1 and config.num_experts % world:
        return f"persistent: the world size ({world}) must divide the number of experts ({config.num_experts})"
    if config.group_limited:
        return "persistent: group-limited routing (n_group/topk_group) is not in the kernel's gate yet (issue 30)"
    if config.softmax_after_topk:
        return "persistent: softmax_after_topk is not in the kernel's gate yet (issue 30)"
    if config.dtype not in (torch.bfloat16, torch.float16, torch.float32) or config.router_dtype != torch.float32:
        return (f"persistent: bf16/fp16/fp32 tensors and an fp32 router only (got dtype {config.dtype}, "
                f"router_dtype {config.router_dtype})")
    if config.dtype == torch.float16 and config.router_gemm == "input":
        return "persistent: router_gemm='input' with fp16 activations is not in the kernel's gate (use 'split')"
    return None


def logits_rounding(router) -> int:
    """The kernel's ROUND_LOGITS for ``router``: its optional ``logits_dtype`` attribute says in
    which dtype its logits GEMM rounds them (a transformers model in bf16 rounds once, after
    fp32 sums); None or fp32: 0 (kept in fp32), bf16: 1, fp16: 2."""
    dtype = getattr(router, "logits_dtype", None)
    if dtype is None or dtype == torch.float32:
        return 0
    if dtype in (torch.bfloat16, torch.float16):
        return 1 if dtype == torch.bfloat16 else 2
    raise ValueError(f"persistent: router logits_dtype {dtype} is not one the kernel rounds to (bf16, fp16, fp32)")


MAX_PLANS = 8  # token counts that keep a call plan (workspace) and a CUDA graph (in the shared pool: graphs.py)


@dataclass
class PersistentGraph:
    """One token count's captured call: the plan it launches (its buffers stay alive with it),
    the recorder, the static input x (T, N) and the static output (T, N)."""

    plan: CallPlan
    recorder: object
    x: torch.Tensor
    out: torch.Tensor


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@register_strategy
class PersistentStrategy(Strategy):
    name = "persistent"
    fused_routing = True
    needs_triton = True
    routes_itself = True
    fp8_experts = True  # inference: W8A16 in the GEMM tasks (interlace.kernels.expert_gemm.tile.fp8_dequant)

    @property
    def warm_calls(self) -> int:
        """2 where the second call of a token count captures a CUDA graph (GPU, not interpreted)."""
        return 2 if self.cuda_graph and torch.cuda.is_available() and not _INTERPRET else 1

    def __init__(self, config, ep, kernel: PersistentKernelConfig | None = None, max_spins: int | None = None,
                 task_order: str = "normal", cuda_graph: bool = True, max_tokens: int | None = None,
                 wait_timeout_s: float = DEFAULT_TIMEOUT_S, timeline: bool = False, agree: bool = True):
        super().__init__(config, ep)
        reason = unsupported(config, ep.world)
        if reason:
            raise ValueError(reason)
        if kernel is not None and not isinstance(kernel, PersistentKernelConfig):
            raise TypeError(f"strategy option 'kernel' must be a PersistentKernelConfig, got {type(kernel).__name__}")
        if max_spins is not None and (isinstance(max_spins, bool) or not isinstance(max_spins, int) or max_spins < 0):
            raise ValueError(f"strategy option 'max_spins' must be an int >= 0 or None, got {max_spins!r}")
        if isinstance(wait_timeout_s, bool) or not isinstance(wait_timeout_s, (int, float)) or not wait_timeout_s > 0:
            raise ValueError(f"strategy option 'wait_timeout_s' must be a number > 0, got {wait_timeout_s!r}")
        if task_order not in TASK_ORDERS:
            raise ValueError(f"strategy option 'task_order' must be one of {TASK_ORDERS}, got {task_order!r}")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"strategy option 'cuda_graph' must be a bool, got {cuda_graph!r}")
        if not isinstance(timeline, bool):
            raise ValueError(f"strategy option 'timeline' must be a bool, got {timeline!r}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError(f"strategy option 'max_tokens' must be an int >= 1 or None, got {max_tokens!r}")
        if ep.world > 1 and task_order != "normal":
            raise ValueError("persistent: task_order='combine_first' is a world-1 test option")
        self.max_tokens = max_tokens
        self.kernel = kernel or PersistentKernelConfig()
        self.cuda_graph = cuda_graph
        self.timeline = timeline
        self._last_plan = None  # (timeline) the plan of the last call: its records
        self.graph_recorder = None  # None: CUDA graphs where possible; tests put an EagerRecorder here
        self._plans: OrderedDict = OrderedDict()  # T → CallPlan
        self._graphs: dict = {}  # T → PersistentGraph (only for token counts that have a plan)
        self._graph_seen: set = set()  # token counts whose first (eager) call has run
        # (W > 1: the polls are unbounded by default and the time bound decides: see DistPlan)
        self.max_spins = max_spins if max_spins is not None else (DEFAULT_SPINS if ep.world == 1 else 2**31 - 1)
        self.wait_timeout_s = float(wait_timeout_s)
        self.task_order = task_order
        self.fallback = SequentialStrategy(config, ep)
        # world 1: the kernel's counters; W > 1: the DistBuffer (its state, set up at the first call)
        self.state = PersistentState() if ep.world == 1 else None
        self._record_event = None  # one reusable CUDA event behind the last unchecked call
        self._record_pending = False
        self._record_view = None  # numpy view of the state's host mirror of the record (a cheap read)
        # W > 1: every call agrees with the peers first (interlace.parallel.agreement), so that a
        # call some rank cannot run in the kernel raises on every rank instead of leaving the
        # others waiting in it; ``auto``, which agreed already, builds it with agree=False.
        self._agree = None
        if ep.world > 1 and agree and ep.group is not None and dist.is_initialized():
            self._agree = CallAgreement(ep, wait_timeout_s)

    @property
    def label(self) -> str:
        return self._agree.label if self._agree is not None else Strategy.label

    @label.setter
    def label(self, value: str) -> None:
        if self._agree is not None:
            self._agree.label = value

    def _agreed_tokens(self, tokens: int, train: bool, routed: bool) -> int:
        """W > 1: the group's largest count of this call (:meth:`CallAgreement.settle`), checked
        against ``max_tokens`` on every rank alike."""
        agreed = self._agree.settle(tokens, train, routed)
        if routed and self.max_tokens is not None and agreed.tokens > self.max_tokens:
            raise ValueError(f"persistent: a rank passed {agreed.tokens} tokens, over max_tokens={self.max_tokens} "
                             f"(strategy option; every rank raises)")
        return agreed.tokens

    @classmethod
    def parse_arg(cls, arg: str) -> dict:
        if arg in ("graph", "eager"):  # "persistent:eager": no CUDA graphs
            return {"cuda_graph": arg == "graph"}
        raise ValueError(f"persistent: unknown variant {arg!r} (known: 'graph', 'eager')")

    def routes_call(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
        """Whether this call runs the kernel (routing inside) rather than ``sequential``'s path:
        not when it builds an autograd graph (see the module)."""
        if not torch.is_grad_enabled():
            return True
        return not (x.requires_grad or router.weight.requires_grad or w_up.requires_grad or w_down.requires_grad)

    def forward_layer(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """x (T, N) → (T, N) in x's dtype: routing by ``router`` (its ``weight`` (E, N) fp32,
        ``expert_bias`` (E,) or None, and optionally ``logits_dtype``: :func:`logits_rounding`)
        and the experts ``w_up`` (E, up_width, N), ``w_down`` (E, N, K), in one launch (a graph
        replay once the token count has been seen; see the module)."""
        self._raise_landed_error()
        T = x.shape[0]
        if self._agree is not None:
            agreed = self._agreed_tokens(T, False, True)
            if self.max_tokens is None:  # (the first call sizes the buffers: its largest count)
                self.max_tokens = max(1, agreed)
        if self.ep.world > 1 and self.state is None:
            self.state = _dist_buffer(self, x)
        if T == 0 and self.ep.world == 1:  # (W > 1: the call still launches: peers wait for its flags)
            return torch.empty_like(x)
        weights = (router.weight, router.expert_bias, w_up, w_down)
        rounding = logits_rounding(router)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # (a caller's capture: its own workspace, in the caller's pool, not a cached plan
            # that this strategy may drop while the caller's graph still uses it)
            # (no event behind it: synchronize_and_check after the caller's replays)
            return self._new_plan(x, weights, rounding).run(x.contiguous())
        x = x.contiguous()
        plan = self._plan(x, weights, rounding)
        recorder = self._recorder(x)
        self._last_plan = plan
        if recorder is None:
            out = self._launch(plan, x)
        else:
            out = self._graph_call(plan, x, recorder)
        self._after_call(x)
        return out

    # ---- plans and graphs --------------------------------------------------------------------
    def _new_plan(self, x: torch.Tensor, weights: tuple, rounding: int = 0) -> CallPlan:
        cfg = self.config
        timeline = 0 if not self.timeline else CLOCK_GPU if x.is_cuda and not _INTERPRET else CLOCK_LOGICAL
        # (FP8 experts come as BlockFP8Weight pairs, held as they are: e4m3 and scales contiguous)
        router_weight, bias, w_up, w_down = (w if w is None or isinstance(w, BlockFP8Weight) else w.detach()
                                             for w in weights)
        if not isinstance(w_up, BlockFP8Weight):
            w_up, w_down = w_up.contiguous(), w_down.contiguous()
        if self.ep.world > 1:
            return DistPlan(x, router_weight.contiguous(), bias, w_up, w_down, self.state,
                            top_k=cfg.top_k, softmax=cfg.router == "softmax", renormalize=cfg.renormalize,
                            route_scale=cfg.route_scale, activation=cfg.activation,
                            w_pieces=router_pieces(x.dtype, cfg.router_gemm), config=self.kernel,
                            max_spins=self.max_spins, timeout_s=self.wait_timeout_s, timeline=timeline,
                            round_logits=rounding, capacity=cfg.capacity(x.shape[0]))
        return CallPlan(x, router_weight, bias, w_up, w_down, self.state, top_k=cfg.top_k,
                        softmax=cfg.router == "softmax", renormalize=cfg.renormalize, route_scale=cfg.route_scale,
                        activation=cfg.activation, w_pieces=router_pieces(x.dtype, cfg.router_gemm),
                        config=self.kernel, max_spins=self.max_spins, order=self.task_order, timeline=timeline,
                        round_logits=rounding, capacity=cfg.capacity(x.shape[0]))

    def _plan(self, x: torch.Tensor, weights: tuple, rounding: int = 0) -> CallPlan:
        """Token count T's plan (built again when the weights, dtype or device changed, or the
        state's buffer grew), the least recently used one dropped beyond ``MAX_PLANS``."""
        T = x.shape[0]
        plan = self._plans.get(T)
        if plan is None or not plan.matches(x, *weights) or plan.round_logits != rounding:
            plan = self._plans[T] = self._new_plan(x, weights, rounding)
            while len(self._plans) > MAX_PLANS:
                old, _ = self._plans.popitem(last=False)
                self._graphs.pop(old, None)
        self._plans.move_to_end(T)
        return plan

    def _recorder(self, x: torch.Tensor):
        """The graph recorder for this call, or None to run it eagerly (``cuda_graph`` off, not
        CUDA, the interpreter, the timeline on). Tests set ``graph_recorder`` (an EagerRecorder)."""
        if self.timeline:
            return None
        if self.graph_recorder is not None:
            return self.graph_recorder
        if not self.cuda_graph or not x.is_cuda or _INTERPRET or x.shape[0] == 0:
            return None
        return CudaGraphRecorder

    def _graph_call(self, plan: CallPlan, x: torch.Tensor, recorder) -> torch.Tensor:
        """Replay T's graph (captured now if it has none for this plan); the first call of a T
        runs eagerly (it compiles the kernel and learns the grid)."""
        T = x.shape[0]
        entry = self._graphs.get(T)
        if entry is None or entry.plan is not plan:
            if T not in self._graph_seen:
                self._graph_seen.add(T)
                return self._launch(plan, x)
            # NOTE: a capture synchronizes the device once (CudaGraphRecorder.capture).
            # (the plan matched the state's current buffer: nothing is allocated for the state
            # inside the capture)
            # Input copied in before each replay, output cloned right after it: buffers and pool
            # shared with every layer's graphs (strategies/graphs.py).
            (static_x,) = static_copies("persistent.in", x)
            out = shared_static("persistent.out", x.shape, x.dtype, x.device)
            rec, _ = capture_for(self, recorder, lambda: self._launch(plan, static_x, out), x.device, shared_pool=True)
            entry = self._graphs[T] = PersistentGraph(plan, rec, static_x, out)
        entry.x.copy_(x)
        entry.recorder.replay()  # (after a capture too: capture records the work without running it)
        return entry.out.clone()  # the static output is overwritten by the next replay

    def _launch(self, plan: CallPlan, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel (three launches and exchanges on the staged transport): what a graph holds;
        into ``out`` when given."""
        staged = isinstance(plan, DistPlan) and self.state.kind == "staged"
        return plan.run_phases(x, out) if staged else plan.run(x, out)

    def close(self) -> None:
        self.release_graphs()

    def release_buffers(self) -> None:
        if self.ep.world > 1 and self.state is not None:  # (still held here: a late call keeps it alive)
            leave_shared(self.state, _DIST_BUFFERS)

    def release_graphs(self) -> int:
        """Drop the captured graphs and the plans (their workspaces); returns how many graphs."""
        n = len(self._graphs)
        self._graphs.clear()
        self._plans.clear()
        return n

    def timeline_records(self) -> list[dict]:
        """With ``timeline=True``: one dict per task of this rank's last kernel call, by task
        number: ``kind`` (a name of ``tasks.TIMELINE_KINDS``, W > 1 ``dist_tasks.TIMELINE_KINDS``;
        "skip": a GEMM task past the real tiles), ``pid`` (program), ``sm`` (−1 under the
        interpreter), ``task``, ``start``, ``waited`` (end of its flag waits; = start for a task
        without one), ``end``: ns on a GPU (ticks of a logical clock under the interpreter),
        relative to the call's first start. NOTE: a host sync (copies the records)."""
        if not self.timeline:
            raise RuntimeError("the timeline is off: build the strategy with timeline=True")
        if self._last_plan is None:
            raise RuntimeError("no call yet: the timeline holds the records of the last call")
        return self._last_plan.timeline_records()

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        """Routing given by the layer (training, forced indices, compiled): ``sequential``."""
        if self._agree is not None:
            train = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weight, w_up, w_down))
            self._agreed_tokens(x.shape[0], train, False)
        return self.fallback(x, topk_idx, topk_weight, w_up, w_down)

    # ---- error records ---------------------------------------------------------------------
    def _after_call(self, x: torch.Tensor) -> None:
        """CPU: read the record now (free). CUDA: the kernel writes a timed-out wait's record
        into the state's host mirror; mark the call with the event, unless an earlier mark has
        not been looked at yet (a later call raises once the marked call has completed)."""
        if not x.is_cuda:
            self.state.check()
            return
        if self._record_pending or torch.cuda.is_current_stream_capturing():
            # (inside a user's CUDA graph capture nothing is marked: an event query is not allowed
            # there, and a replay's record is read by the next eager call's mark)
            return
        if self._record_event is None:
            self._record_event = torch.cuda.Event()
            self._record_view = self.state.host_error.numpy()
        self._record_event.record()
        self._record_pending = True

    def _raise_landed_error(self) -> None:
        if not self._record_pending or _capturing() or not self._record_event.query():
            return
        self._record_pending = False
        if self._record_view[0] != 0:
            message = describe_error(self._record_view.tolist())
            self.state.error_record().zero_()
            self.state.host_error.zero_()
            raise RuntimeError(message)

    def synchronize_and_check(self) -> None:
        """Wait for the device and raise ``RuntimeError`` if a call's wait timed out."""
        if self.state is None:
            return
        if self.state.buffer is not None and self.state.buffer.is_cuda:
            torch.cuda.synchronize(self.state.buffer.device)
        self._record_pending = False
        self.state.check()


_DIST_BUFFERS: dict = {}  # (transport, group, device, spec) → DistBuffer shared by the process's layers


def _release_dist_buffers() -> None:
    """:func:`interlace.parallel.release_shared_buffers` drops these too (each holds, on GPUs,
    its symmetric memory: ``DistSpec.regions``; its group only weakly);
    a layer that still holds one keeps it, and the next new layer makes a fresh one."""
    _DIST_BUFFERS.clear()


on_release(_release_dist_buffers)


def _dist_buffer(strategy: PersistentStrategy, x: torch.Tensor) -> DistBuffer:
    """The W > 1 buffer of ``strategy``'s group and shapes (made at the first call: collectives,
    on every rank in the same order)."""
    import torch.distributed as dist

    cfg, ep = strategy.config, strategy.ep
    max_tokens = strategy.max_tokens
    if max_tokens is None:
        # NOTE: a host sync, once per strategy: the ranks agree on the buffers' size.
        t = torch.tensor([x.shape[0]], dtype=torch.int64, device=ep.collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ep.group)
        max_tokens = strategy.max_tokens = max(1, int(t.item()))
    spec = DistSpec(ep.world, ep.num_local, cfg.hidden, cfg.top_k, max_tokens, cfg.dtype)
    kind = "symmetric" if x.is_cuda and not _INTERPRET else "staged"
    if kind == "symmetric":
        ep.require_peer_memory("persistent")  # (before any allocation, on every rank alike)
    key = (kind, id(ep.group), str(x.device), spec)  # (a destroyed group's id may come again: checked below)
    buf = _DIST_BUFFERS.get(key)
    if buf is None or held_group(buf) is not ep.group:
        make = DistBuffer.symmetric if kind == "symmetric" else DistBuffer.staged
        buf = _DIST_BUFFERS[key] = make(spec, ep.group, x.device)
    return take_shared(buf)
