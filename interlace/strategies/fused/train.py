"""Training through the fused (COMET) kernels: a forward that keeps what the backward needs, and
a backward that runs the same two kernels with their roles swapped.

Forward (every rank): the usual layer0 → layer1, with layer0 also storing the pre-activation
(W·cap, up) of every row it receives. The peer buffer is shared by every layer of the process,
so what later layers would overwrite is copied out when the call ends:
* the input rows of this rank's experts in receive-buffer order, this rank's own rows gathered
  into its own region (for dW_up);
* the expert outputs returned to this (home) rank, (T·k, N) in dispatch order (for d weights).

The receive layout holds up to cap = max_tokens·min(k, E_local) rows per source (all of a
source's tokens could pick this rank), W·min(k, E_local)/k times the T·k rows a balanced call
brings, and ``fused:train`` keeps the pre-activation, the activation and the input rows at that
size: its state lives in a captured CUDA graph's static buffers (forward and backward replayed,
nothing read on the host). ``fused:lean`` keeps exactly the rows received: after the count
exchange the host reads the counts (a sync), and layer0 writes the pre-activation and the
activation packed (source s's rows from ``base[s]``, the exclusive prefix sum of the counts;
the kernels' ``h_base``), as are x's rows; the backward's d_act and d_h keep that layout.
Captured, it is two graphs with that read between them, and the second keeps a little more
than the rows received (:func:`kept_rows`), captured again when a call receives more
(:class:`TrainGraph`). Inside a caller's own capture it keeps the receive layout (nothing can
be read there).

Backward, with dy (T, N) at every token's home rank (the dispatch of the backward is the
forward's combine and vice versa):
1. home: ``g[r] = w[t, j] · dy[t]`` for each dispatch row r = (t, j) and ``dw[t, j] = <y_r, dy[t]>``
   (the combine's backward kernel, fp32 dot products);
2. layer0: communication programs push the g rows to the experts' owners while GEMM programs
   compute ``d_act = g_rows @ W_down[e]`` (W_down as stored, no activation), local tiles first,
   remote tiles as their flags arrive;
3. owner: ``d_h = act'(pre) ⊙ d_act`` in one elementwise pass (faster than an epilogue, see
   docs/performance.md), over the rows each source sent, written over ``pre`` (so one
   backward per forward: a second one through the same graph raises); d_act and d_h lie as
   the kept rows do (``base``);
4. layer1: ``dx_rows = d_h @ W_up[e]`` column-wise, each tile stored straight into the home's
   return buffer; the home's combine programs sum each token's k rows (weight 1) slice by
   slice as they land → dx;
5. owner: ``dW_down[e] = Σ g_rowsᵀ act`` and ``dW_up[e] = Σ d_hᵀ x_rows`` over the expert's rows,
   by the expert kernels' weight-gradient kernel reducing over the expert's run of rows from
   each source (no gather: the rows stay where the kernels put them).

Besides ``fused:lean``'s count read, no step reads anything back to the host on the symmetric
transport (the staged transport's return exchange counts rows on the host, as in the forward).

``fused:recompute`` (:class:`RecomputeMoE`) is the other training path through the fused
kernels: the fused forward, and a backward that recomputes the layer through ``sequential``.

The strategy (:class:`interlace.strategies.fused.inference.FusedStrategy`) is passed in and
used for its buffers, engine and call steps; this module does not import it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch

from interlace.kernels import alloc
from interlace.kernels.activation import activation_reference, swiglu_backward, swiglu_backward_regions
from interlace.kernels.expert_gemm.configs import choose_backward_configs
from interlace.kernels.expert_gemm.wgrad import launch_wgrad
from interlace.kernels.tma import use_tma
from interlace.kernels.rows import combine_rows_backward, copy_used_rows, gather_used_rows
from interlace.strategies.fused.engine import FusedCall
from interlace.strategies.graphs import capture_for, shared_static, static_copies


@dataclass
class OwnerRows:
    """This rank's received rows by expert (device tensors, no sync).

    ``segments`` (2, W, E_l) int32: for each source (in the plan's order, this rank first) and
    local expert, the first buffer row ``s·cap + offset`` of its rows, then their count — the
    runs the weight-gradient kernel reduces over. ``local_row`` (cap,) int64: the dispatch row
    each row of this rank's own region holds (0 where unused: that region is filled from this
    rank's own rows, which never pass through the receive buffer). ``used`` (W,) int32: the rows
    received from each source (buffer region s = source s), which fill the first ``used[s]``
    rows of its region; the other rows are never read.
    """

    segments: torch.Tensor
    local_row: torch.Tensor
    used: torch.Tensor


def owner_rows(plan, spec, me: int) -> OwnerRows:
    W, El, cap = spec.world, spec.num_local, spec.cap
    dev = plan.recv_count.device
    count = plan.recv_count.view(W, El)  # [j, e]: j-th source (me + j) % W
    off = plan.recv_off.view(W, El)  # first row of (j, e) inside that source's region
    source = (torch.arange(W, device=dev, dtype=torch.int32) + me) % W
    segments = torch.stack([source[:, None] * cap + off, count]).to(torch.int32).contiguous()
    # This rank's region (j = 0): rows [off, off + count) of expert e hold dispatch rows from local_row0.
    o = torch.arange(cap, device=dev)
    e = (torch.searchsorted(off[0].long().contiguous(), o, right=True) - 1).clamp_(0, El - 1)
    i = o - off[0].long()[e]
    valid = i < count[0].long()[e]
    local_row = torch.where(valid, plan.recv_local_row0.view(W, El)[0].long()[e] + i, 0)
    used = torch.roll(count.sum(1, dtype=torch.int32), me)
    return OwnerRows(segments, local_row, used)


def local_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` (index clamped into range: unused entries hold 0 or −1 and are never read),
    or unspecified rows when this rank has no rows at all."""
    if src.shape[0] == 0:
        return alloc.empty((index.numel(), src.shape[1]), src.dtype, src.device)
    return src[index.clamp(0, src.shape[0] - 1)]


def activation_backward(pre: torch.Tensor, d_act: torch.Tensor, activation: str,
                        used: torch.Tensor | None = None) -> torch.Tensor:
    """d(pre-activation) from the pre-activation (M, up) and d(act) (M, K); for SwiGLU written
    over ``pre`` (the caller's last use of it). With ``used`` (W,) int32, the rows are W regions
    of M / W rows of which only the first ``used[s]`` hold data (the receive layout): SwiGLU's
    derivative then touches only those (the other rows come back unspecified)."""
    if activation == "swiglu":
        if used is not None:
            return swiglu_backward_regions(pre, d_act, used, pre.shape[0] // used.numel(), out=pre)
        return swiglu_backward(pre, d_act, out=pre)
    with torch.enable_grad():
        p = pre.detach().float().requires_grad_()
        (grad,) = torch.autograd.grad(activation_reference(p, activation), p, d_act.float())
    return grad.to(pre.dtype)


def mark(strategy, name: str) -> None:
    """With ``strategy.profile_phases``: a CUDA event after each step of the training call,
    read by :func:`step_ms` (the GPU check script); nothing otherwise."""
    if getattr(strategy, "profile_phases", False) and torch.cuda.is_available():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        strategy.__dict__.setdefault("_train_marks", []).append((name, event))


def step_ms(strategy) -> list[tuple[str, float]]:
    """(step, ms since the previous mark) of the marks recorded so far, then cleared (syncs)."""
    marks = strategy.__dict__.pop("_train_marks", [])
    if marks:
        marks[-1][1].synchronize()
    return [(name, a.elapsed_time(b)) for (_, a), (name, b) in zip(marks, marks[1:])]


@dataclass
class TrainState:
    """What one ``fused:train`` forward leaves for its backward (device tensors; on the graph path
    they are a captured graph's static buffers, valid until its next replay). Kept rows: R of
    them, source s's from ``base[s]``: R = W·cap in the receive layout (``base[s] = s·cap``),
    or the rows received, packed (``fused:lean``)."""

    out: torch.Tensor  # (T, N) the layer's output
    topk_weight: torch.Tensor  # (T, k) fp32
    row_of_assignment: torch.Tensor
    assignment_of_row: torch.Tensor
    plan: object  # FusedPlan (device tensors)
    pre: torch.Tensor  # (R, up) pre-activation; the backward writes d(pre-activation) over it
    act: torch.Tensor  # (R, K) activations (layer1's input)
    x_rows: torch.Tensor  # (R, N) the expert input rows
    y_rows: torch.Tensor  # (T·k, N) expert outputs returned home, dispatch order
    segments: torch.Tensor
    local_row: torch.Tensor
    used: torch.Tensor  # (W,) int32 rows received from each source (OwnerRows.used)
    kept: torch.Tensor
    base: torch.Tensor  # (W,) int32 first kept row of each source
    packed: bool = False  # the rows received, packed (else the receive layout)


@dataclass
class Prepared:
    """A training forward up to its layers (device tensors): the call, the dispatch index, the
    rows this rank receives, the first kept row of each source (``base``) and, packed, their
    total (``rows_total``, a 0-d int32 the host reads)."""

    call: FusedCall
    index: tuple
    rows: OwnerRows
    base: torch.Tensor
    rows_total: torch.Tensor | None


def prepare_body(strategy, x, topk_idx, topk_weight, packed: bool, out=None) -> Prepared:
    """The forward's routing, count exchange and plan (device work, capturable); the layer's
    output into ``out`` (T, N) when given."""
    spec = strategy.buf.spec
    mark(strategy, "start")
    h = x.new_empty(0, strategy.config.ffn) if packed else None  # (packed: sized once the rows are known)
    call, index = strategy._prepare_call(x, topk_idx, topk_weight, h, out)
    rows = owner_rows(call.plan, spec, strategy.buf.rank)
    if packed:
        base = (torch.cumsum(rows.used, 0, dtype=torch.int32) - rows.used).contiguous()
        total = rows.used.sum(dtype=torch.int32)
    else:
        base, total = strategy.buf.region_base, None
    return Prepared(call, index, rows, base, total)


def kept_rows(total: int, spec, previous: int = 0) -> int:
    """Rows to allocate for ``total`` rows received: exactly that eagerly; a captured forward
    takes 1/16 more, in whole 256s (so routing that moves a little does not capture again), and
    when it outgrew ``previous`` rows, at least 1/4 more than those (routing that drifts during
    training, as experts specialise, captures again a few times, not at every step); never more
    than the receive layout's W·cap."""
    want = max(total + total // 16, previous + previous // 4)
    return max(min((want + 255) // 256 * 256, spec.world * spec.cap), total, 1)


def layers_body(strategy, x, prep: Prepared, rows_kept: int | None, w_up, w_down) -> TrainState:
    """The layers and the saves of a training forward (capturable): ``rows_kept`` rows packed
    (at least the rows received), or None for the receive layout."""
    buf = strategy.buf
    spec = buf.spec
    k, me = spec.top_k, buf.rank
    up, K = w_up.shape[1], strategy.config.ffn
    call, rows, base = prep.call, prep.rows, prep.base
    packed = rows_kept is not None
    R = rows_kept if packed else spec.world * spec.cap
    if packed:  # (a copy: a captured preparation's call is a static buffer of its own graph)
        call = replace(call, h=alloc.empty((R, K), x.dtype, x.device), h_base=base)
    pre = alloc.empty((R, up), x.dtype, x.device)
    mark(strategy, "fwd prepare")
    strategy._run_layers(call, w_up, w_down, pre=pre)
    mark(strategy, "fwd layers")
    # The expert input rows: the peers' rows as received, this rank's own rows gathered into its
    # (otherwise unused) region; only the used rows of each region (in the receive layout about
    # half of a capacity-sized one with balanced routing), the rest is never read.
    recv = buf.views["recv"].view(-1, x.shape[1])
    x_rows = copy_used_rows(recv, alloc.empty((R, recv.shape[1]), recv.dtype, recv.device), rows.used, skip=me,
                            base=base if packed else None)
    assignment = local_rows(call.assignment_of_row[:, None], rows.local_row)[:, 0]
    gather_used_rows(x, assignment, x_rows, rows.used, me, divisor=k, base=base if packed else None)
    y_rows = buf.views["ret"][:x.shape[0] * k].clone()
    mark(strategy, "fwd saves")
    return TrainState(call.out, call.topk_weight, call.row_of_assignment, call.assignment_of_row, call.plan, pre,
                      call.h, x_rows, y_rows, rows.segments, rows.local_row, rows.used, prep.index[2], base, packed)


def forward_body(strategy, x, topk_idx, topk_weight, w_up, w_down, packed: bool = False, out=None) -> TrainState:
    """The forward's device work, from the routing to the saved rows, eagerly: in the receive
    layout (no host sync: capturable), or ``packed`` (the rows received, their count read on the
    host); the layer's output into ``out`` when given."""
    prep = prepare_body(strategy, x, topk_idx, topk_weight, packed, out)
    # NOTE: packed, a host sync: the host waits until the GPU has run the count exchange, and the
    # GPU then waits for the layer launches.
    rows_kept = max(int(prep.rows_total), 1) if packed else None  # (a rank receiving nothing keeps one row)
    return layers_body(strategy, x, prep, rows_kept, w_up, w_down)


def caller_capturing(x: torch.Tensor) -> bool:
    """Whether this call runs inside a caller's own CUDA-graph capture (no host read there)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def backward_body(strategy, st: TrainState, grad: torch.Tensor, w_up, w_down, activation: str, dx=None):
    """Steps 1–4 of the backward and the own g rows into the receive buffer (capturable):
    ``(dx (T, N), d_weight (T, k), d_h (W·cap, up))``; ``d_h`` is written over ``st.pre``
    for SwiGLU; dx into ``dx`` when given."""
    buf, spec = strategy.buf, strategy.buf.spec
    T, N = grad.shape
    k = spec.top_k
    mark(strategy, "bwd start")
    # 1. home: the weighted rows to send back to the experts, and the routing weights' gradient.
    g_rows, d_weight = combine_rows_backward(grad, st.y_rows, st.row_of_assignment, st.topk_weight)
    mark(strategy, "bwd combine grad")
    # 2.–4. the two kernels with the roles swapped; dispatch rows are read as themselves.
    # A later layer's backward may still read the shared buffers on a peer: order first.
    strategy._order_after_peers()
    buf.advance_epoch()
    identity = torch.arange(T * k, device=grad.device, dtype=torch.int32) * k
    dx = alloc.empty((T, N), grad.dtype, grad.device) if dx is None else dx
    ones = torch.ones(T, k, device=grad.device, dtype=torch.float32)
    # call.h: layer0's output d_act (R, K), then d_h (R, up) written over pre, both laid out as
    # the kept rows. Only the call holds d_act, so it is freed as soon as the derivative has read it.
    call = FusedCall(g_rows, ones, st.row_of_assignment, identity, st.plan,
                     alloc.empty(st.act.shape, st.act.dtype, st.act.device), dx, st.kept, h_base=st.base)

    def between():
        mark(strategy, "bwd layer0")
        # (in the receive layout the derivative skips the unused rest of each source's region)
        call.h = activation_backward(st.pre, call.h, activation, None if st.packed else st.used)
        mark(strategy, "bwd act")

    strategy._run_layers(call, w_down, w_up, backward=True, between=between)
    mark(strategy, "bwd layer1")
    # 5. (first part) this rank's own g rows go into its unused region of the receive buffer
    # (no peer writes there, and the next call's writes wait for _order_after_peers / the
    # count exchange), where dW_down reads them with the peers' rows.
    gather_used_rows(g_rows, st.local_row, buf.views["recv"].view(-1, N), st.used, buf.rank)
    mark(strategy, "bwd local rows")
    return dx, d_weight, call.h


def weight_grads(strategy, st: TrainState, d_h: torch.Tensor, grad: torch.Tensor, w_up, w_down, activation: str):
    """5. owner: dW_up and dW_down into fresh tensors, reducing each expert's rows from every
    source where they lie (runs after :func:`backward_body`, on the same stream): d_h against
    x's kept rows, the g rows in the receive buffer against the kept activations (packed, their
    runs start elsewhere: a second table of starts). The kernel's config is the strategy's
    ``wgrad`` option, else the expert kernels' tuned one."""
    N = grad.shape[1]
    buf = strategy.buf
    spec = buf.spec
    c_w = strategy.options.wgrad
    if c_w is None:
        _, _, c_w, _ = choose_backward_configs(grad, w_down, grad.shape[0] * spec.top_k, activation)
    tma = use_tma(w_up, w_down, force=strategy.engine.kernel.tma)
    segments, both = st.segments, st.segments
    if st.packed:  # each (source, expert)'s first kept row: its offset in the source's region, from base[source]
        source = (torch.arange(spec.world, device=st.base.device) + buf.rank) % spec.world
        kept_start = segments[0] - (source * spec.cap).to(torch.int32)[:, None] + st.base[source][:, None]
        segments = torch.stack([kept_start, st.segments[1]])
        both = torch.cat([st.segments, kept_start[None]])
    dw_up = launch_wgrad(d_h, st.x_rows, alloc.empty(w_up.shape, w_up.dtype, w_up.device), None,
                         w_up.shape[1], N, c_w, segments=segments, tma=tma)
    mark(strategy, "bwd dW_up")
    recv = buf.views["recv"].view(-1, N)
    dw_down = launch_wgrad(recv, st.act, alloc.empty(w_down.shape, w_down.dtype, w_down.device), None,
                           N, w_down.shape[2], c_w, segments=both, tma=tma)
    mark(strategy, "bwd dW_down")
    return dw_up, dw_down


# ----------------------------------------------------------------------------- CUDA graphs
def train_inputs(x, topk_idx, topk_weight) -> tuple:
    """A training forward graph's static inputs and output buffer: x in a buffer shared with
    every layer's graphs (it is read by the forward only) and the output likewise
    (:func:`shared_static`; cloned at once), the routing in buffers of its own: the backward
    reads the routing weights (the state's ``topk_weight`` is this buffer), after other layers'
    forwards have run. ``((x, topk_idx, topk_weight), out)``."""
    (sx,) = static_copies("train.in", x)
    out = shared_static("train.out", x.shape, x.dtype, x.device)
    return (sx, topk_idx.clone(), topk_weight.detach().clone()), out


class TrainGraph:
    """One token count's captured ``fused:train`` / ``fused:lean`` forward and backward.

    The forward graph's outputs (the layer output and the :class:`TrainState`) are static
    buffers, so one call at a time may hold them: from its forward until its backward has
    launched (or its autograd graph is freed without one), :attr:`owner` is set and further
    calls with this token count run eagerly. The backward graph covers steps 1–4 (its dx and
    routing-weight gradient are static buffers too: the caller copies them out); the weight
    gradients are launched after it into fresh tensors, since autograd may keep them as
    ``.grad``.

    ``packed`` (``fused:lean``): the forward is two graphs, the preparation (routing, count
    exchange, plan) and the layers with their saves, and between them the host reads the rows
    received (a sync). The layers' graph keeps :func:`kept_rows` of them; a call receiving more
    captures it (and the backward) again, larger."""

    def __init__(self, weights: tuple, recorder, packed: bool = False):
        self.weights = weights
        self.recorder = recorder
        self.packed = packed
        self.owner: int | None = None
        self.prep = None  # packed: (recorder, static inputs, Prepared)
        self.rows_kept = 0  # packed: the rows the layers' graph was captured for
        self.fwd = None  # (recorder, static inputs, TrainState)
        self.bwd = None  # (recorder, static grad, (dx, d_weight, d_h))
        self._leases = 0
        self.retired = False

    def retire(self) -> None:
        """Drop the graphs (their buffers live on while a call's state refers to them); a
        pending backward then runs eagerly."""
        self.prep = self.fwd = self.bwd = None
        self.retired = True

    def lease(self) -> "_Lease":
        self._leases += 1
        return _Lease(self, self._leases)

    def forward(self, strategy, x, topk_idx, topk_weight, w_up, w_down) -> TrainState:
        """The forward's replay (captured first where there is no graph yet): one graph, or,
        ``packed``, the preparation's, the host's read of the rows received, and the layers'."""
        if self.packed:
            if self.prep is None:
                static, out = train_inputs(x, topk_idx, topk_weight)
                rec, prep = capture_for(strategy, self.recorder, lambda: prepare_body(strategy, *static, True, out),
                                        x.device)
                self.prep = (rec, static, prep)
            rec, static, prep = self.prep
        else:
            if self.fwd is None:
                static, out = train_inputs(x, topk_idx, topk_weight)
                rec, state = capture_for(strategy, self.recorder,
                                         lambda: forward_body(strategy, *static, w_up, w_down, out=out), x.device)
                self.fwd = (rec, static, state)
            rec, static, state = self.fwd
        for buf, t in zip(static, (x, topk_idx, topk_weight)):
            buf.copy_(t)
        rec.replay()
        if not self.packed:
            return state
        # NOTE: a host sync: the rows received, counted by the count exchange just replayed.
        total = int(prep.rows_total)
        if self.fwd is None or total > self.rows_kept:
            self.rows_kept = kept_rows(total, strategy.buf.spec, self.rows_kept)
            self.bwd = None  # (captured over the old forward's buffers)
            rec, state = capture_for(strategy, self.recorder,
                                     lambda: layers_body(strategy, static[0], prep, self.rows_kept, w_up, w_down),
                                     x.device)
            self.fwd = (rec, None, state)
        rec, _, state = self.fwd
        rec.replay()
        return state

    def backward(self, strategy, state: TrainState, grad, w_up, w_down, activation: str, capture: bool):
        """``(dx, d_weight, d_h)``. Before any eager backward of this token count compiled the
        kernels (``capture`` False), runs the steps eagerly on the static buffers instead."""
        if self.bwd is None:
            if not capture or self.retired:
                return backward_body(strategy, state, grad, w_up, w_down, activation)
            # Shared pool and buffers: dx and d_weight are cloned and d_h read by weight_grads before
            # any other graph replays.
            (sgrad,) = static_copies("train.grad", grad)
            dx = shared_static("train.dx", grad.shape, grad.dtype, grad.device)
            rec, outs = capture_for(strategy, self.recorder,
                                    lambda: backward_body(strategy, state, sgrad, w_up, w_down, activation, dx),
                                    grad.device, shared_pool=True)
            self.bwd = (rec, sgrad, outs)
        rec, sgrad, outs = self.bwd
        sgrad.copy_(grad)
        rec.replay()
        return outs


class _Lease:
    """A call's hold on its :class:`TrainGraph`'s static buffers (kept in its autograd context):
    released after its backward, or when the context is freed without one."""

    def __init__(self, graph: TrainGraph, token: int):
        graph.owner = token
        self._finalizer = weakref.finalize(self, _release, graph, token)

    def release(self) -> None:
        self._finalizer()


def _release(graph: TrainGraph, token: int) -> None:
    if graph.owner == token:
        graph.owner = None


class FusedTrain(torch.autograd.Function):
    """The fused layer forward and backward (see the module docstring); through the strategy's
    :class:`TrainGraph` for this call when it has one, else eagerly."""

    @staticmethod
    def forward(ctx, x, topk_weight, w_up, w_down, strategy, topk_idx):
        lean = strategy.train_path == "lean"
        graph = strategy._train_graph(x, w_up, w_down)
        if graph is None:
            packed = lean and not caller_capturing(x)
            state = forward_body(strategy, x, topk_idx, topk_weight, w_up, w_down, packed)
            ctx.lease, out = None, state.out
            state.out = None  # ctx keeps the state: holding the output too would be a reference cycle
        else:
            state = graph.forward(strategy, x, topk_idx, topk_weight, w_up, w_down)
            ctx.lease, out = graph.lease(), state.out.clone()  # the static output: the next replay rewrites it
        ctx.save_for_backward(w_up, w_down)
        ctx.strategy, ctx.activation, ctx.graph, ctx.state = strategy, strategy.config.activation, graph, state
        ctx.pre_consumed = False
        strategy._check_errors()
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.pre_consumed:
            raise RuntimeError(
                "fused:train: backward ran twice through one forward (retain_graph=True). The first "
                "backward overwrote the saved pre-activation with its gradient, to save memory; run "
                "the forward again for a second backward, or use train_path='sequential'")
        w_up, w_down = ctx.saved_tensors
        strategy, state, graph = ctx.strategy, ctx.state, ctx.graph
        grad = grad.contiguous()
        T = grad.shape[0]
        if graph is not None:
            dx, d_weight, d_h = graph.backward(strategy, state, grad, w_up, w_down, ctx.activation,
                                               capture=T in strategy._train_backward_seen)
            dx, d_weight = dx.clone(), d_weight.clone()  # static buffers once captured
        else:
            dx, d_weight, d_h = backward_body(strategy, state, grad, w_up, w_down, ctx.activation)
        strategy._train_backward_seen.add(T)
        # A graph's buffers go to the next call after this backward; an eager call's pre-activation
        # is gone if the derivative was written over it (SwiGLU).
        ctx.pre_consumed = graph is not None or d_h is state.pre
        dw_up, dw_down = weight_grads(strategy, state, d_h, grad, w_up, w_down, ctx.activation)
        if ctx.pre_consumed:
            ctx.state = None
        if ctx.lease is not None:
            ctx.lease.release()  # stream order: the next replay runs after these kernels
        strategy._check_errors()
        return dx, d_weight, dw_up, dw_down, None, None


class RecomputeMoE(torch.autograd.Function):
    """``fused:recompute``. Forward: the fused kernels. Backward: recompute the layer through
    ``sequential`` and differentiate it (only the inputs are saved)."""

    @staticmethod
    def forward(ctx, x, topk_weight, w_up, w_down, strategy, topk_idx):
        ctx.strategy = strategy
        ctx.save_for_backward(x, topk_weight, w_up, w_down, topk_idx)
        return strategy._forward(x, topk_idx, topk_weight, w_up, w_down)

    @staticmethod
    def backward(ctx, grad):
        x, topk_weight, w_up, w_down, topk_idx = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (x, topk_weight, w_up, w_down)]
        with torch.enable_grad():
            out = ctx.strategy.recompute(inputs[0], topk_idx, *inputs[1:])
            need = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, need, grad, allow_unused=True))
        return (*[next(grads) if t.requires_grad else None for t in inputs], None, None)
