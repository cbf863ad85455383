"""``fused``: COMET's fine-grained overlap — dispatch fused into GEMM0, GEMM1 fused into combine.

Per call, on every rank (no host sync anywhere after the first call; the epoch lives on the
device):

1. counting sort of the routing (``build_dispatch_index``) and **one all-gather** of every
   rank's kept rows per expert (a device collective; nothing is read back to the host);
2. the index plan on the device (:mod:`interlace.kernels.comet.plan`);
3. layer0 (:mod:`interlace.kernels.comet.layer0`): communication programs push rows into the
   experts' owners' symmetric buffers while GEMM programs compute local tiles, then remote
   tiles as their flags arrive;
4. layer1 (:mod:`interlace.kernels.comet.layer1`): GEMM1 column-wise with its tiles stored at the
   home ranks, and combine programs reducing each token's top-k rows per N-slice as slices land.

Steps 1–4 of one rank are :class:`~interlace.strategies.fused.engine.FusedEngine`; this module
is the strategy around it: set-up, the transports' phase order, training paths, CUDA graphs and
error checks. Options: :class:`~interlace.strategies.fused.options.FusedOptions`.

Transports (:class:`interlace.parallel.PeerBuffer`): ``symmetric`` on CUDA (torch symmetric
memory), ``staged`` on other process groups (gloo in CI: the same kernels, with collectives
moving the staged regions between the kernel phases).

Training (a call that builds an autograd graph). ``train_path`` says what such a call runs:
* ``"sequential"`` (default) runs the ``sequential`` strategy's forward and backward;
* ``"fused"`` (``"fused:train"``) runs the fused kernels forward *and* backward
  (:mod:`interlace.strategies.fused.train`: the backward's dispatch is the forward's combine and
  vice versa, the same two kernels with their roles swapped, weight gradients by the expert
  kernels' weight-gradient kernel). It keeps more activation memory than ``sequential``;
  ``auto`` picks it per shape from the measured profile (docs/performance.md);
* ``"recompute"`` (``"fused:recompute"``) runs the fused kernels forward, saves only the
  layer's inputs, and recomputes the forward through ``sequential`` in the backward
  (activation checkpointing: less activation memory, one extra forward of time).
``no_grad`` / inference calls always run the fused kernels. The kernels need CUDA GPUs, or
``TRITON_INTERPRET=1`` on the CPU; elsewhere a call that would run them raises at once.

Deadlock freedom: communication work never waits; every wait is on work that was claimed
earlier from an in-order queue by a running program (interlace.kernels.comet.flags), so progress does
not depend on which programs the GPU schedules first; the grid is the device's SM count (read,
never assumed) and a peer that never runs the layer makes the bounded waits record an error
(raised on this rank's next call, or by :meth:`FusedStrategy.synchronize_and_check`).

CUDA graphs: nothing between the routing and the output needs the host (the epoch, the plan and
every flag live on the device; the count exchange is a device collective), so an inference call
with CUDA symmetric memory captures that part once per token count T (on its second call with
that T; the first one runs eagerly and compiles the kernels) and replays it afterwards: inputs
are copied into the graph's static buffers and the output is copied out. Replays save most at
small T, where the eager call is bound by the host's kernel launches.
The graph holds the weights' addresses: it is re-captured when ``w_up``/``w_down`` are different
tensors (in-place optimizer updates need nothing). At most ``MAX_GRAPHS`` token counts keep a
graph (least recently used dropped); a capture synchronizes the device once, so a workload that
cycles through more token counts than that pays a sync per returning T — use ``"fused:eager"``
there. Inside a caller's own CUDA-graph capture the kernels run eagerly (and are captured by
the caller). The error record is checked after every replay.
``fused:train`` does the same for training calls (:class:`~interlace.strategies.fused.train.TrainGraph`):
the forward and the backward up to the weight gradients are captured per token count; the
saved state lives in the graph's buffers, so while one call's backward is pending, other
calls with that token count run eagerly. Eager, such a call is bound by the host's launches.
``fused:lean`` captures its forward as two graphs with the host's read of the rows received
between them, and keeps a little more than those rows (:class:`TrainGraph`).
A live graph with a captured NCCL collective makes the communicator's destruction wait forever,
so once a strategy captures, ``dist.destroy_process_group`` is wrapped to drop every
fused graph first (:func:`guard_destroy_process_group`); call
:func:`interlace.parallel.release_shared_buffers` before it as well (it drops the graphs and the
buffers, and covers a ``destroy_process_group`` imported before the wrapping).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace.kernels.comet.flags import describe_error
from interlace.kernels.rows import _INTERPRET
from interlace.parallel.comm import all_gather_single
from interlace.parallel.peer_buffer import BufferSpec, PeerBuffer, leave_shared, on_release, shared_buffer
from interlace.strategies.base import Strategy, register_strategy
from interlace.strategies.fused.engine import FusedEngine, check_error_record, default_split
from interlace.strategies.fused.options import GPU_CONFIG, INTERPRETER_CONFIG, FusedOptions
from interlace.strategies.fused.train import FusedTrain, RecomputeMoE, TrainGraph
from interlace.strategies.graphs import CudaGraphRecorder, capture_for, shared_static, static_copies
from interlace.strategies.sequential import SequentialStrategy

MAX_GRAPHS = 8  # token counts that keep a captured CUDA graph (their temporaries share one pool: graphs.py)


_LIVE = weakref.WeakSet()  # every FusedStrategy: release_shared_buffers drops their graphs


def release_graphs() -> int:
    """Drop the captured CUDA graphs of every live ``fused`` strategy (run by
    :func:`interlace.parallel.release_shared_buffers`, before the process group goes);
    returns how many. A strategy captures again on its next calls."""
    n = 0
    for strategy in list(_LIVE):
        n += strategy.release_graphs()
    return n


on_release(release_graphs)


def guard_destroy_process_group() -> None:
    """Make ``torch.distributed.destroy_process_group`` drop interlace's CUDA graphs first.

    A live graph with a captured NCCL collective keeps ``ncclCommDestroy`` waiting forever
    (pytorch/pytorch#115388): a script that destroys its group while a layer still
    holds a graph would hang at exit. Installed once, at a strategy's first capture. A
    reference to the function taken before that (``from torch.distributed import
    destroy_process_group``) is not covered: call :func:`interlace.parallel.release_shared_buffers`
    before it, which also frees the buffers."""
    from torch.distributed import distributed_c10d

    current = dist.destroy_process_group
    if getattr(current, "interlace_releases_graphs", False):
        return

    def destroy_process_group(*args, **kwargs):
        release_graphs()
        return current(*args, **kwargs)

    destroy_process_group.__doc__ = current.__doc__
    destroy_process_group.__wrapped__ = current
    destroy_process_group.interlace_releases_graphs = True
    dist.destroy_process_group = destroy_process_group
    if distributed_c10d.destroy_process_group is current:
        distributed_c10d.destroy_process_group = destroy_process_group


@dataclass
class ForwardGraph:
    """One token count's captured inference call: its recorder, static inputs (x, expert
    indices, routing weights) and static output, and the weights' addresses it was captured
    with. Nothing holds it between calls (``owner`` is always None)."""

    weights: tuple
    recorder: object
    static: tuple
    out: torch.Tensor
    owner = None


@register_strategy
class FusedStrategy(Strategy):
    name = "fused"
    options_class = FusedOptions
    fused_routing = True
    # Inference calls (and every call of fused:train / fused:recompute) run the fused Triton
    # kernels; a fused layer that can only train through sequential's path is not what was asked.
    needs_triton = True

    def __init__(self, config, ep, options: FusedOptions | dict | None = None, **fields):
        """``options``: a :class:`FusedOptions` or a dict of its fields; keyword ``fields``
        (what ``strategy_options={...}`` passes) replace those. An unknown field raises
        ``ValueError`` naming the valid ones."""
        super().__init__(config, ep)
        self.options = opts = FusedOptions.build(options, **fields)
        self.cuda_graph = bool(opts.cuda_graph)
        self._graphs: OrderedDict = OrderedDict()  # T → ForwardGraph (inference calls)
        self._graph_seen: set = set()
        # fused:train's graphs: T → TrainGraph; token counts seen by an eager forward / backward.
        self._train_graphs: OrderedDict = OrderedDict()
        self._train_seen: set = set()
        self._train_backward_seen: set = set()
        self.graph_recorder = None  # None: CUDA graphs where possible; tests put an EagerRecorder here
        _LIVE.add(self)
        self.train_path = opts.train_path
        self.timeline = bool(opts.timeline)
        self.max_tokens, self.transport, self.symm_backend = opts.max_tokens, opts.transport, opts.symm_backend
        if self.transport == "symmetric":
            ep.require_peer_memory(f"{self.spec_name} (transport 'symmetric')")
        self._n_comm_opt, self._n_comm1_opt, self.max_spins = opts.n_comm, opts.n_comm1, opts.max_spins
        self.buf: PeerBuffer | None = None
        self.engine: FusedEngine | None = None
        self.split_source = "unset"  # "option", "tuned", "tuned for <key>" or "default": where n_comm came from
        self._recompute = SequentialStrategy(config, ep)
        self._pending_error: tuple | None = None

    @property
    def warm_calls(self) -> int:
        """2 where the second call of a token count captures a CUDA graph (GPU, not interpreted)."""
        graphs = self.cuda_graph and torch.cuda.is_available() and not _INTERPRET
        return 2 if graphs else 1

    @property
    def spec_name(self) -> str:
        """How this strategy is spelled for its training path (``fused``, ``fused:train``, ...)."""
        return {"sequential": "fused", "fused": "fused:train", "recompute": "fused:recompute",
                "lean": "fused:lean"}[self.train_path]

    # -- set-up (first call) ---------------------------------------------------------------
    def _setup(self, x: torch.Tensor) -> None:
        cfg, ep = self.config, self.ep
        max_tokens = self.max_tokens
        if max_tokens is None:
            # First call only: agree on a size for the symmetric buffers (a host sync).
            t = torch.tensor([x.shape[0]], dtype=torch.int64, device=ep.collective_device())
            if ep.world > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ep.group)
            max_tokens = max(1, int(t.item()))
        on_gpu = x.is_cuda
        kernel = self.options.kernel_for(GPU_CONFIG if on_gpu and not _INTERPRET else INTERPRETER_CONFIG)
        spec = BufferSpec(ep.world, ep.num_local, cfg.hidden, cfg.top_k, max_tokens, kernel.block_m,
                          kernel.block_n1, cfg.dtype)
        transport = self.transport
        if transport == "auto":
            transport = "symmetric" if on_gpu and ep.world > 1 else "staged"
        if transport == "symmetric":
            ep.require_peer_memory(self.spec_name)  # (before any allocation, on every rank alike)
        if ep.world == 1:
            transport = "local"
        self.buf = shared_buffer(spec, "simulated" if transport == "local" else transport, ep.group, x.device,
                                 self.symm_backend)
        self.transport_used = transport
        n_programs = torch.cuda.get_device_properties(x.device).multi_processor_count if on_gpu else 4
        n_comm, n_comm1 = self._resolve_split(n_programs, x.shape[0], tuned_tables=on_gpu)
        self.engine = FusedEngine(cfg, self.buf, kernel, n_programs, n_comm, n_comm1, self.max_spins, self.timeline)

    def _resolve_split(self, n_programs: int, tokens: int, tuned_tables: bool = True) -> tuple[int, int]:
        from interlace.tuning.fused_split import find_split

        tuned, source = None, "default"
        if tuned_tables and "auto" in (self._n_comm_opt, self._n_comm1_opt):  # tables exist for GPUs only
            tuned, source = find_split(self.config, tokens, self.ep.world, n_programs)
        default = tuned or default_split(n_programs)
        n_comm = default[0] if self._n_comm_opt == "auto" else self._n_comm_opt
        n_comm1 = default[1] if self._n_comm1_opt == "auto" else self._n_comm1_opt
        self.split_source = "option" if "auto" not in (self._n_comm_opt, self._n_comm1_opt) else source
        if not (0 < n_comm < n_programs and 0 < n_comm1 < n_programs):
            raise ValueError(f"n_comm={n_comm}, n_comm1={n_comm1} must be in [1, {n_programs - 1}] "
                             f"({n_programs} programs on this device)")
        return n_comm, n_comm1

    @property
    def split(self) -> tuple[int, int] | None:
        """(n_comm, n_comm1) in use, once set up; ``split_source`` says where they came from."""
        return None if self.engine is None else (self.engine.n_comm, self.engine.n_comm1)

    @classmethod
    def parse_arg(cls, arg: str) -> dict:
        if arg in ("graph", "eager"):  # "fused:eager": no CUDA graphs
            return {"cuda_graph": arg == "graph"}
        if arg == "train":  # "fused:train": training through the fused kernels too
            return {"train_path": "fused"}
        return {"train_path": arg}  # "fused:recompute"

    # -- calls --------------------------------------------------------------------------------
    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weight, w_up, w_down))
        if training and self.train_path == "sequential":
            return self._recompute(x, topk_idx, topk_weight, w_up, w_down)  # sequential's graph, no recompute
        if self.engine is None:
            self._setup(x)
        self._raise_pending_error()
        if training and self.train_path in ("fused", "lean"):
            return FusedTrain.apply(x, topk_weight, w_up, w_down, self, topk_idx)
        if training:
            return RecomputeMoE.apply(x, topk_weight, w_up, w_down, self, topk_idx)
        recorder = self._recorder(x)
        if recorder is not None:
            return self._graph_forward(x, topk_idx, topk_weight, w_up, w_down, recorder)
        return self._forward(x, topk_idx, topk_weight, w_up, w_down)

    def _graphable(self) -> bool:
        return (self.buf.kind == "symmetric" and not _INTERPRET and self.engine.timeline is None
                and not getattr(self, "profile_phases", False) and not torch.cuda.is_current_stream_capturing())

    def close(self) -> None:
        self.release_graphs()

    def release_buffers(self) -> None:
        if self.buf is not None:  # (still held here: a pending backward keeps it alive)
            leave_shared(self.buf)

    def release_graphs(self) -> int:
        """Drop this strategy's captured CUDA graphs (inference and training); returns how many.
        A call whose backward is still to come keeps its saved state and runs that backward
        eagerly."""
        n = len(self._graphs) + len(self._train_graphs)
        for entry in self._train_graphs.values():
            entry.retire()
        self._graphs.clear()
        self._train_graphs.clear()
        return n

    def _recorder(self, x):
        """The graph recorder for this call, or None to run it eagerly (CUDA graphs off or
        impossible here, or an empty batch: nothing to gain). Tests set ``graph_recorder``."""
        if x.shape[0] == 0 or getattr(self, "profile_phases", False) or self.engine.timeline is not None:
            return None
        if self.graph_recorder is not None:
            return self.graph_recorder
        if not (self.cuda_graph and self._graphable()):
            return None
        guard_destroy_process_group()
        return CudaGraphRecorder

    def _graph_entry(self, table: OrderedDict, seen: set, T: int, weights: tuple, make):
        """Token count T's graph in ``table`` (least recently used first), made by ``make()``
        when there is none for these weights, or None to run eagerly: the first call with T
        (it compiles the kernels and warms NCCL), T's graph held by a call whose backward has
        not run (``owner``), or no room that an idle graph could free."""
        entry = table.get(T)
        if entry is not None and entry.owner is not None:
            return None
        if entry is None or entry.weights != weights:
            if T not in seen:
                seen.add(T)
                return None
            if entry is not None:
                del table[T]
            while len(table) >= MAX_GRAPHS:  # drop the least recently used idle one
                idle = next((t for t, e in table.items() if e.owner is None), None)
                if idle is None:
                    return None
                del table[idle]
            entry = table[T] = make()
        table.move_to_end(T)
        return entry

    def _train_graph(self, x, w_up, w_down):
        """This training call's :class:`~interlace.strategies.fused.train.TrainGraph`, or None
        to run it eagerly (:meth:`_recorder`, :meth:`_graph_entry`)."""
        recorder = self._recorder(x)
        if recorder is None:
            return None
        weights = (w_up.data_ptr(), w_down.data_ptr())
        return self._graph_entry(self._train_graphs, self._train_seen, x.shape[0], weights,
                                 lambda: TrainGraph(weights, recorder, packed=self.train_path == "lean"))

    def _graph_forward(self, x, topk_idx, topk_weight, w_up, w_down, recorder):
        weights = (w_up.data_ptr(), w_down.data_ptr())

        def capture():
            # Inputs copied in before each replay, the output cloned right after it: buffers and
            # pool shared with every layer's graphs (strategies/graphs.py).
            static = static_copies("fused.in", x, topk_idx, topk_weight)
            out = shared_static("fused.out", x.shape, x.dtype, x.device)
            rec, _ = capture_for(self, recorder, lambda: self._forward_kernels(*static, w_up, w_down, out=out),
                                 x.device, shared_pool=True)
            return ForwardGraph(weights, rec, static, out)

        entry = self._graph_entry(self._graphs, self._graph_seen, x.shape[0], weights, capture)
        if entry is None:
            return self._forward(x, topk_idx, topk_weight, w_up, w_down)
        sx, sidx, sw = entry.static
        sx.copy_(x)
        sidx.copy_(topk_idx)
        sw.copy_(topk_weight)
        entry.recorder.replay()  # (after a capture too: capture records the work without running it)
        self._check_errors()
        return entry.out.clone()  # the static output is overwritten by the next replay

    def recompute(self, x, topk_idx, topk_weight, w_up, w_down):
        return self._recompute(x, topk_idx, topk_weight, w_up, w_down)

    def _forward(self, x, topk_idx, topk_weight, w_up, w_down):
        out = self._forward_kernels(x, topk_idx, topk_weight, w_up, w_down)
        self._check_errors()
        return out

    def _order_after_peers(self) -> None:
        """A one-element all-reduce (a device collective: no host sync) before a call that
        does not start with the count exchange (the backward): no peer writes into this rank's
        shared buffers for it until this rank is done with its previous use of them."""
        if self.ep.world > 1:
            dist.all_reduce(torch.zeros(1, device=self.ep.collective_device()), group=self.ep.group)

    def _check_errors(self) -> None:
        """After the kernels: a timed-out wait raises (on a GPU at the next call, without a
        host sync now; under the interpreter or on the CPU at once)."""
        if self.buf.error.is_cuda and not _INTERPRET:
            self._record_error_check()
        else:
            check_error_record(self.buf)

    def _forward_kernels(self, x, topk_idx, topk_weight, w_up, w_down, out=None):
        """Everything from the routing to the output, on the device (capturable on CUDA); into
        ``out`` (T, N) when given."""
        call, _ = self._prepare_call(x, topk_idx, topk_weight, out=out)
        self._run_layers(call, w_up, w_down)
        return call.out

    def _prepare_call(self, x, topk_idx, topk_weight, h=None, out=None):
        """Dispatch index, count exchange, epoch and plan of a call: ``(FusedCall, index)``;
        ``h``: layer0's output buffer, ``out`` the layer's (default new ones)."""
        eng, buf, ep = self.engine, self.buf, self.ep
        index = eng.dispatch_index(topk_idx)
        kept = index[2]
        counts_all = torch.empty(ep.world * kept.numel(), dtype=torch.int32, device=kept.device)
        if ep.world > 1:
            # Device collective, no host sync; also orders this call after every rank's
            # previous call (buffers are reused only once all peers are done with them).
            all_gather_single(counts_all, kept.to(torch.int32), ep.group)
        else:
            counts_all.copy_(kept)
        counts_all = counts_all.view(ep.world, -1)
        buf.advance_epoch()
        return eng.prepare(x, topk_weight, index, counts_all, h, out), index

    def _run_layers(self, call, w0, w1, pre=None, backward=False, between=None):
        """layer0 with ``w0`` then layer1 with ``w1`` on this buffer's transport (one launch
        each on the symmetric one; each program role apart on the others, with the staged
        regions exchanged between). ``between`` runs after layer0 (the backward's activation
        derivative)."""
        eng, buf = self.engine, self.buf
        if buf.kind == "symmetric" and not _INTERPRET:
            marks = self._phase_marks()
            eng.layer0(call, w0, pre=pre, backward=backward)
            marks and marks[1].record()
            if between is not None:
                between()
            eng.layer1(call, w1, backward=backward)
            marks and marks[2].record()
        else:
            eng.layer0(call, w0, "comm", pre=pre, backward=backward)
            buf.exchange_dispatch()
            eng.layer0(call, w0, "gemm", pre=pre, backward=backward)
            if between is not None:
                between()
            eng.layer1(call, w1, "gemm", backward=backward)
            if buf.kind == "staged":
                buf.exchange_return(self._owner_of_rows(call.kept, call.out.shape[0]), int(call.kept.sum()))
            eng.layer1(call, w1, "comm", backward=backward)

    def _phase_marks(self):
        """With ``profile_phases = True``: CUDA events (start, after layer0, after layer1) of the
        last call, for :meth:`phase_ms` (debugging and the GPU check script)."""
        if not getattr(self, "profile_phases", False):
            return None
        self._marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self._marks[0].record()
        return self._marks

    def phase_ms(self) -> dict:
        """(prepare excluded) layer0 and layer1 times of the last profiled call; syncs."""
        a, b, c = self._marks
        c.synchronize()
        return {"layer0": a.elapsed_time(b), "layer1": b.elapsed_time(c)}

    def _owner_of_rows(self, kept: torch.Tensor, tokens: int) -> torch.Tensor:
        """Staged transport: rank owning the expert of each dispatch row (R,) int64."""
        owner = torch.arange(kept.numel(), device=kept.device) // self.ep.num_local
        return torch.repeat_interleave(owner, kept.long())

    def _record_error_check(self) -> None:
        # No host sync: copy the error record to pinned memory behind the kernels; the next
        # call raises if that copy has landed and shows a timed-out wait.
        if self._pending_error is None:
            host = torch.zeros(8, dtype=torch.int32, pin_memory=True)
            self._pending_error = (host, torch.cuda.Event())
        host, event = self._pending_error
        host.copy_(self.buf.error, non_blocking=True)
        event.record()

    def _raise_pending_error(self) -> None:
        if self._pending_error is None:
            return
        host, event = self._pending_error
        if event.query():
            message = describe_error(host.tolist())
            if message:
                self.buf.error.zero_()
                host.zero_()
                raise RuntimeError(message)

    def timeline_records(self) -> list[dict]:
        """With ``timeline=True``: one dict per work item of this rank's last call (layer, kind,
        pid, sm, item, start/waited/end in ns from the call's first start); a host sync.
        Drawn by :mod:`interlace.tools.timeline`."""
        if self.engine is None:
            raise RuntimeError("no call yet: the timeline holds the records of the last call")
        return self.engine.timeline_records()

    def synchronize_and_check(self) -> None:
        """Wait for this rank's work and raise if any wait timed out (tests, stress runs)."""
        if self.buf is not None:
            check_error_record(self.buf)
