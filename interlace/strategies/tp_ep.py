"""``tp_ep``: experts sharded over a TP × EP mesh, with MoNTA's all-to-all forms O0–O3.

Mesh (``interlace.parallel.mesh.MoEMesh``): rank (j, t) is EP rank j, TP rank t. The ``tp`` ranks of
TP group j hold the same T tokens (batch j) and the experts ``[j·E/ep, (j+1)·E/ep)``, each
expert's FFN dimension K cut into ``tp`` slices (rank t: K rows ``[t·K/tp, (t+1)·K/tp)`` of
the gate and of the up projection, the same columns of ``w_down``). An assignment of a token
of batch j to an expert of EP rank i must therefore reach all ``tp`` shards (i, ·); each
computes a partial down projection, the partials are summed over the TP group, and the sum
returns to every rank of TP group j (the layer's output is replicated like its input).

Forms (``"tp_ep:O0"`` … ``"tp_ep:O3"``; ``"tp_ep:O2-4"`` uses 4 chunks, default 2):

- **O0** plain all-to-all: rank (j, t) sends ALL its tokens' assignments to shard (i, t) over
  the EP group (the world all-to-all of EP+TP MoE, whose only non-empty blocks pair equal TP
  ranks). Each assignment crosses the EP links ``tp`` times: the duplicates O1 removes.
  Combine mirror: all-to-all back, weighted combine of the partials, all-reduce over TP.
- **O1** drop → all-to-all → all-gather: rank (j, t) keeps only token slice t of its batch
  (``T/tp`` tokens, "duplicate token dropping"), sends it over the EP group to (i, t), and the
  TP group of i all-gathers what its ranks received, so every shard (i, ·) holds every
  assignment to its experts. Combine mirror: reduce-scatter over TP (sum of the partials) →
  all-to-all back → combine of the slice → all-gather of the token slices over TP.
- **O2** O1 in r chunks of the token slice: the EP all-to-all of chunk c+1 runs beside the TP
  all-gather of chunk c (each collective on its own communicator, hence its own NCCL stream);
  the re-layout copy (received [TP rank][source][expert] blocks → expert-major rows for the
  grouped GEMM; MoNTA's "D2D copy") is one gather after the last all-gather.
- **O3** O2 with the re-layout copy of chunk c (on the compute stream) running beside the
  all-gather of chunk c+1. Combine mirrors it: the copy of chunk c+1 beside the
  reduce-scatter of chunk c, the reduce-scatter of chunk c+1 beside the all-to-all of chunk c.

Backward is the mirror image of each direction (dispatch's backward is the combine data
movement and vice versa), pipelined the same way. Gradient convention (Megatron's): the
upstream gradient is replicated over the TP group; every rank gets the FULL gradient of its
input tokens and of the router's weights for its batch (the TP all-reduce or all-gather of
these is part of the layer's backward), and exact slices of its expert shards' gradients
(summed over batches). Sum the router gradient over the EP group like any data-parallel
parameter.

Host syncs: one per forward, the count exchange (``all_gather`` over EP, then over TP, of
every rank's per-chunk per-expert counts and a header with T and the form). Ranks of a TP
group must have the same T (checked: a mismatch raises ValueError on every rank).

Capacity: drop decisions over the whole batch of T tokens (as in ``sequential``), then the
surviving assignments are sliced and chunked, so every form drops the same assignments.

FP8 experts (``MoEConfig.expert_quant="fp8"``, inference): each rank's slice of K must be whole
128-wide scale blocks, K % (128·tp) == 0 (``ValueError`` when the strategy is built otherwise).
The slice then holds whole blocks of the full weights with their scales, the activation's
128-column groups are the full layer's, and ``expert_ffn_fp8`` runs the W8A8 FFN of the slice: its
partial down projections (in x's dtype, as the dense path's) are summed over the TP group by the
same collectives: in fp32 the full layer's W8A8 FFN up to the order of the sums (in bf16 each
partial is rounded to bf16 before the sum).

Communication priority: the EP all-to-all uses the mesh's EP communicator; ``MoEMesh.build``
gives it (and the TP group) its own NCCL communicator on a high-priority stream, so a
concurrent data-parallel all-reduce on another communicator cannot hold it back in the GPU's
queues (``benchmarks/device_tp_ep.py`` measures it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace.fp8 import BlockFP8Weight, check_fp8_ffn_slice
from interlace.kernels.expert_gemm.fp8 import FP8_BACKENDS, expert_ffn_fp8
from interlace.parallel.comm import all_gather_single, all_to_all_async, reduce_scatter_single
from interlace.parallel.mesh import MoEMesh
from interlace.kernels.routing_index import build_dispatch_index
from interlace.kernels.rows import CombineRows, DispatchRows, gather_rows
from interlace.planning.pipemoe.schedule import chunk_sizes
from interlace.strategies.base import Strategy, register_strategy
from interlace.strategies.sequential import expert_ffn

FORMS = ("O0", "O1", "O2", "O3")
_HEADER = 3  # T, chunks, form id


# --------------------------------------------------------------------------- TP-group ops
def _padded_all_gather(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Rows of every TP rank, concatenated: x (sizes[rank], ...) → (Σ sizes, ...)."""
    pad = max(sizes)
    buf = x.new_zeros((pad,) + tuple(x.shape[1:]))
    buf[: x.shape[0]] = x
    out = x.new_empty((len(sizes) * pad,) + tuple(x.shape[1:]))
    all_gather_single(out, buf, group)
    return torch.cat([out[r * pad: r * pad + n] for r, n in enumerate(sizes)])


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group (Megatron's f). The graph
    keeps the mesh (its groups held weakly), not the group: see :class:`_Plan`."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.mesh.tp_group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum of the shards' partial outputs); identity backward (g)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SliceForTP(torch.autograd.Function):
    """Rows ``[lo, lo + sizes[rank])`` forward; backward all-gathers the slices' gradients over
    the mesh's TP group (the graph keeps the mesh, as :class:`_CopyToTP`)."""

    @staticmethod
    def forward(ctx, x, sizes, rank, mesh):
        ctx.sizes, ctx.mesh = sizes, mesh
        lo = sum(sizes[:rank])
        return x[lo: lo + sizes[rank]]

    @staticmethod
    def backward(ctx, grad):
        return _padded_all_gather(grad.contiguous(), ctx.sizes, ctx.mesh.tp_group), None, None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather of the slices forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.sizes, ctx.rank = sizes, rank
        return _padded_all_gather(x.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, grad):
        lo = sum(ctx.sizes[: ctx.rank])
        return grad[lo: lo + ctx.sizes[ctx.rank]], None, None, None


# --------------------------------------------------------------------------- the plan
@dataclass
class _Plan:
    """Split sizes (host) and re-layout indices (device) of one forward, reused by backward.

    Chunk c's received buffer (``width[c]`` rows at ``start[c]`` of one buffer holding all
    chunks) is, with the TP all-gather, ``tp`` blocks of ``pad[c]`` rows (TP rank t' block:
    [source EP rank][local expert] row blocks, then padding); without it, one such block.
    ``dest`` (Σ width,) int64 maps every buffer row to its expert-major row (padding → M);
    ``src`` (M,) int32 is its inverse; ``dest_gather`` is ``dest`` with padding → row 0.

    The plan lives in the autograd graph until the backward: it keeps the mesh, which holds its
    groups weakly, so that a graph whose backward never ran does not keep them past
    ``destroy_process_group``.
    """

    form: str
    mesh: MoEMesh
    tp_gather: bool
    in_splits: list[list[int]]
    out_splits: list[list[int]]
    pad: list[int]
    start: list[int]
    width: list[int]
    rows: int  # M
    dest: torch.Tensor
    src: torch.Tensor
    dest_gather: torch.Tensor
    offs: torch.Tensor

    @property
    def ep_group(self):
        return self.mesh.ep_group

    @property
    def tp_group(self):
        return self.mesh.tp_group


def _relayout(lengths, buf_starts, dst_starts, offs, rows, total, device):
    """Row index maps of a block re-layout: block b moves ``lengths[b]`` rows from buffer row
    ``buf_starts[b]`` to expert-major row ``dst_starts[b]``. The host-side block table (and the
    grouped GEMM's ``offs``) travel in one pinned, non-blocking copy; the maps are built on
    the device (no host sync). Returns ``dest, src, dest_gather, offs`` (see :class:`_Plan`)."""
    n = len(lengths)
    first = [0] * n
    for b in range(1, n):
        first[b] = first[b - 1] + lengths[b - 1]
    host = torch.tensor(lengths + first + buf_starts + dst_starts + offs, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    table = host.to(device, non_blocking=True)
    lengths_d, first_d, buf_d, dst_d = (table[i * n:(i + 1) * n] for i in range(4))
    block = torch.repeat_interleave(torch.arange(n, device=device), lengths_d, output_size=rows)
    within = torch.arange(rows, device=device) - first_d[block]
    buf_row = buf_d[block] + within
    dst_row = dst_d[block] + within
    dest = torch.full((total,), rows, dtype=torch.int64, device=device)
    dest[buf_row] = dst_row
    src = torch.empty(rows, dtype=torch.int32, device=device)
    src[dst_row] = buf_row.to(torch.int32)
    dest_gather = torch.where(dest == rows, 0, dest).to(torch.int32)
    return dest, src, dest_gather, table[4 * n:].to(torch.int32)


def _make_plan(form, counts, mesh, num_local, chunks, device) -> _Plan:
    """counts[t][j][c][e]: rows rank (j, t) sends to expert e in chunk c (host ints)."""
    tp, ep, t0, i0 = mesh.tp, mesh.ep, mesh.tp_rank, mesh.ep_rank
    tp_gather = form != "O0" and tp > 1
    mine = range(i0 * num_local, (i0 + 1) * num_local)
    sources = range(tp) if tp_gather else [t0]

    def to_rank(t, j, c, i):
        return sum(counts[t][j][c][i * num_local:(i + 1) * num_local])

    in_splits = [[to_rank(t0, i0, c, i) for i in range(ep)] for c in range(chunks)]  # this rank is (i0, t0)
    out_splits = [[to_rank(t0, j, c, i0) for j in range(ep)] for c in range(chunks)]
    pad = [max(sum(to_rank(t, j, c, i0) for j in range(ep)) for t in sources) for c in range(chunks)]
    width = [len(sources) * p for p in pad]
    start = [sum(width[:c]) for c in range(chunks)]
    per_expert = [sum(counts[t][j][c][e] for c in range(chunks) for t in sources for j in range(ep)) for e in mine]
    expert_start = [sum(per_expert[:e]) for e in range(num_local)]
    lengths, buf_starts, dst_starts = [], [], []
    filled = list(expert_start)
    for c in range(chunks):
        for s, t in enumerate(sources):
            at = start[c] + s * pad[c]
            for j in range(ep):
                for e_local, e in enumerate(mine):
                    n = counts[t][j][c][e]
                    lengths.append(n)
                    buf_starts.append(at)
                    dst_starts.append(filled[e_local])
                    at += n
                    filled[e_local] += n
    rows = sum(per_expert)
    offs = [sum(per_expert[:e + 1]) for e in range(num_local)]  # end row of each expert
    dest, src, dest_gather, offs = _relayout(lengths, buf_starts, dst_starts, offs, rows, sum(width), device)
    return _Plan(form, mesh, tp_gather, in_splits, out_splits, pad, start, width, rows, dest, src, dest_gather,
                 offs)


# --------------------------------------------------------------------------- data movement
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """A stream that only waits: it chains one collective after another (all-to-all c →
    all-gather c) without making the compute stream wait, which would serialise the
    pipeline. A no-op context on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return torch.cuda.stream(_SIDE_STREAMS[device])


def spread(plan: _Plan, sends: list[torch.Tensor]) -> torch.Tensor:
    """Dispatch direction: chunk c's send rows → (all-to-all EP → all-gather TP) → expert-major
    rows (M, N) of this shard. Returns after the compute stream can read them."""
    N, dtype, device = sends[0].shape[1], sends[0].dtype, sends[0].device
    buf = torch.empty((sum(plan.width), N), dtype=dtype, device=device)
    chunks = len(sends)
    # 1. Every chunk's EP all-to-all, queued at once on the EP communicator's stream.
    a2a, mine = [], []
    for c in range(chunks):
        if plan.tp_gather:
            mine.append(torch.empty((plan.pad[c], N), dtype=dtype, device=device))
            target = mine[c][: sum(plan.out_splits[c])]
        else:
            target = buf[plan.start[c]: plan.start[c] + sum(plan.out_splits[c])]
        a2a.append(all_to_all_async(target, sends[c].contiguous(), plan.out_splits[c], plan.in_splits[c],
                                    plan.ep_group))
    # 2. TP all-gather of chunk c once its all-to-all is done: beside the all-to-all of c+1.
    landed = []
    out = torch.empty((plan.rows + 1, N), dtype=dtype, device=device) if plan.form == "O3" else None
    for c in range(chunks):
        if plan.tp_gather:
            with _side_stream(device):
                a2a[c].wait()
                landed.append(all_gather_single(buf[plan.start[c]: plan.start[c] + plan.width[c]], mine[c],
                                                plan.tp_group, async_op=True))
        else:
            landed.append(a2a[c])
        if out is not None and c > 0:  # O3: re-layout copy of chunk c-1 beside the all-gather of c
            _place(plan, out, buf, landed[c - 1], c - 1)
    if out is not None:
        _place(plan, out, buf, landed[-1], chunks - 1)
        return out[: plan.rows]
    for work in landed:
        work.wait()
    return gather_rows(buf, plan.src)  # O1/O2: one re-layout copy of every chunk


def _place(plan, out, buf, work, c):
    work.wait()
    lo, hi = plan.start[c], plan.start[c] + plan.width[c]
    out.index_copy_(0, plan.dest[lo:hi], buf[lo:hi])  # padding rows land in the spare row M


def collect(plan: _Plan, y: torch.Tensor) -> list[torch.Tensor]:
    """Combine direction, the mirror of :func:`spread`: expert-major rows (M, N) → per chunk
    (re-layout copy → reduce-scatter TP → all-to-all EP back) → rows in send order."""
    N, dtype, device = y.shape[1], y.dtype, y.device
    chunks = len(plan.pad)
    if plan.rows == 0:
        y = y.new_zeros((1, N))  # every buffer row is padding (or there is none)
    whole = gather_rows(y, plan.dest_gather) if plan.form != "O3" else None
    outs, works, keep = [], [], []
    for c in range(chunks):
        lo, hi = plan.start[c], plan.start[c] + plan.width[c]
        block = whole[lo:hi] if whole is not None else gather_rows(y, plan.dest_gather[lo:hi])
        received = sum(plan.out_splits[c])
        back = torch.empty((sum(plan.in_splits[c]), N), dtype=dtype, device=device)
        if plan.tp_gather:
            mine = torch.empty((plan.pad[c], N), dtype=dtype, device=device)
            summed = reduce_scatter_single(mine, block, plan.tp_group, async_op=True)
            with _side_stream(device):  # all-to-all c waits for its reduce-scatter, not the copies
                summed.wait()
                works.append(all_to_all_async(back, mine[:received], plan.in_splits[c], plan.out_splits[c],
                                              plan.ep_group))
            keep.append(mine)
        else:
            works.append(all_to_all_async(back, block[:received], plan.in_splits[c], plan.out_splits[c],
                                          plan.ep_group))
        keep.append(block)
        outs.append(back)
    for work in works:
        work.wait()
    return outs


class _Spread(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, *sends):
        ctx.plan = plan
        return spread(plan, list(sends))

    @staticmethod
    def backward(ctx, grad):
        return (None, *collect(ctx.plan, grad.contiguous()))


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, y):
        ctx.plan = plan
        outs = collect(plan, y)
        ctx.like = [o.new_empty(0) for o in outs]  # dtype/device of a missing gradient
        ctx.shapes = [o.shape for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.contiguous() if g is not None else like.new_zeros(shape)
                 for g, like, shape in zip(grads, ctx.like, ctx.shapes)]
        return None, spread(ctx.plan, grads)


# --------------------------------------------------------------------------- the strategy
def _chunk_index(marked: torch.Tensor, bins: int, num_experts: int):
    """Counting sort of one chunk's (t, k) choices, where choice ``num_experts`` (bin E, only
    with a capacity) marks a dropped assignment: (row_of_assignment with -1 for dropped ones,
    assignment_of_row, kept counts (E,))."""
    index = build_dispatch_index(marked, bins, None)
    dropped = marked == num_experts
    row_of_assignment = index[0].masked_fill(dropped, -1) if bins > num_experts else index[0]
    return row_of_assignment, index[1], index[2][:num_experts]


@register_strategy
class TpEpStrategy(Strategy):
    """Expert FFN sharded over the mesh's TP group, experts over its EP group; see the
    module docstring for the forms. Options: ``form`` ("O0".."O3"), ``chunks`` (O2/O3),
    ``fp8_backend`` (FP8 experts: :func:`~interlace.kernels.expert_gemm.fp8.expert_ffn_fp8`'s, as in
    ``sequential``)."""

    name = "tp_ep"
    fused_routing = True
    uses_mesh = True
    fp8_experts = True  # inference, where each rank's slice of K is whole 128-blocks (check_fp8_ffn_slice)

    def __init__(self, config, ep, mesh=None, form: str = "O1", chunks: int = 2, fp8_backend: str = "auto"):
        super().__init__(config, ep)
        if form not in FORMS:
            raise ValueError(f"tp_ep form must be one of {FORMS}, got {form!r}")
        if fp8_backend not in FP8_BACKENDS:
            raise ValueError(f"fp8_backend must be one of {FP8_BACKENDS}, got {fp8_backend!r}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= 64:
            raise ValueError(f"tp_ep chunks must be an int in 1..64, got {chunks!r}")
        self.mesh = mesh if mesh is not None else MoEMesh.from_groups(None, ep.group)
        if self.mesh.ep_group is None and self.mesh.tp_group is None:
            # Every form runs collectives on the mesh's groups; without them the first call
            # would fail deep inside torch.distributed.
            raise ValueError(
                "strategy 'tp_ep' needs process groups: call torch.distributed.init_process_group first and pass "
                "MoELayer(..., mesh=MoEMesh.build(tp=..., ep=...)) (or group= for an EP-only mesh), "
                "or use strategy 'sequential' on a single process")
        if self.mesh.ep != ep.world:
            raise ValueError(f"mesh ep={self.mesh.ep} does not match the expert-parallel group size {ep.world}")
        ffn_slice = self.mesh.shard_ffn(config.ffn)  # K divisible by tp
        if config.expert_quant == "fp8":  # (before any weight is built: the layer builds its strategy first)
            check_fp8_ffn_slice(ffn_slice, config.ffn)
        self.form = form
        self.fp8_backend = fp8_backend
        self.chunks = chunks if form in ("O2", "O3") else 1

    @classmethod
    def parse_arg(cls, arg: str) -> dict:
        form, _, chunks = arg.partition("-")
        if chunks and not chunks.isdigit():
            raise ValueError(f"tp_ep: the part after ':' is a form {FORMS}, optionally with a chunk count "
                             f"for O2/O3 (e.g. 'tp_ep:O2-4'); got {arg!r}")
        return {"form": form, **({"chunks": int(chunks)} if chunks else {})}

    def __repr__(self) -> str:
        return f"TpEpStrategy(form={self.form}, chunks={self.chunks}, {self.mesh})"

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        cfg, mesh = self.config, self.mesh
        T, E, r = x.shape[0], cfg.num_experts, self.chunks
        if mesh.tp > 1 and self.form == "O0":
            x, topk_weight = _CopyToTP.apply(x, mesh), _CopyToTP.apply(topk_weight, mesh)
        capacity = cfg.capacity(T)
        if capacity is not None:  # drop decisions over the whole batch; dropped → extra bin E
            row_global = build_dispatch_index(topk_idx, E, capacity)[0]
            marked, bins = torch.where(row_global < 0, E, topk_idx), E + 1
        else:
            marked, bins = topk_idx, E
        slices = chunk_sizes(T, mesh.tp) if T else []
        slices += [0] * (mesh.tp - len(slices))
        if self.form != "O0" and mesh.tp > 1:  # O1-O3: drop the tokens other TP ranks send
            x = _SliceForTP.apply(x, slices, mesh.tp_rank, mesh)
            topk_weight = _SliceForTP.apply(topk_weight, slices, mesh.tp_rank, mesh)
            lo = sum(slices[: mesh.tp_rank])
            marked = marked[lo: lo + slices[mesh.tp_rank]]
        sizes = chunk_sizes(x.shape[0], r) if x.shape[0] else []
        sizes += [0] * (r - len(sizes))
        indices = [_chunk_index(tc, bins, E) for tc in torch.split(marked, sizes)]

        counts = self._exchange_counts(indices, T, x.device)
        plan = _make_plan(self.form, counts, mesh, self.ep.num_local, r, x.device)
        x_chunks, w_chunks = torch.split(x, sizes), torch.split(topk_weight, sizes)
        x_sends = [DispatchRows.apply(x_chunks[c], indices[c][1][: sum(plan.in_splits[c])], indices[c][0])
                   for c in range(r)]
        rows = _Spread.apply(plan, *x_sends)
        if isinstance(w_up, BlockFP8Weight):  # this rank's K slice, W8A8: partial down projections in x's dtype
            y = expert_ffn_fp8(rows, None, 1, plan.rows, w_up, w_down, plan.offs, cfg.activation,
                               backend=self.fp8_backend)
        else:
            y = expert_ffn(rows, w_up, w_down, plan.offs, cfg.activation)
        y_backs = _Collect.apply(plan, y)
        outs = [CombineRows.apply(y_backs[c], w_chunks[c], indices[c][0], x.dtype) for c in range(r)]
        out = torch.cat(outs) if r > 1 else outs[0]
        if mesh.tp == 1:
            return out
        if self.form == "O0":
            return _ReduceFromTP.apply(out, mesh.tp_group)
        return _GatherFromTP.apply(out, slices, mesh.tp_rank, mesh.tp_group)

    def _exchange_counts(self, indices, T, device):
        """All ranks' per-chunk per-expert counts as host ints [t][j][c][e]: all-gather over
        EP, then over TP, and THE host sync of the forward."""
        mesh, E, r = self.mesh, self.config.num_experts, self.chunks
        coll = self.ep.collective_device()
        row = torch.empty(r * E + _HEADER, dtype=torch.int64, device=device)
        row[: r * E] = torch.stack([kept for _, _, kept in indices]).view(-1)
        row[r * E:] = torch.tensor([T, r, FORMS.index(self.form)], dtype=torch.int64)
        row = row.to(coll).view(1, -1)
        by_ep = torch.empty((mesh.ep, row.shape[1]), dtype=row.dtype, device=coll)
        if mesh.ep > 1:
            all_gather_single(by_ep, row, mesh.ep_group)
        else:
            by_ep.copy_(row)
        table = torch.empty((mesh.tp * mesh.ep, row.shape[1]), dtype=row.dtype, device=coll)
        if mesh.tp > 1:
            all_gather_single(table, by_ep, mesh.tp_group)
        else:
            table.copy_(by_ep)
        flat = table.view(mesh.tp, mesh.ep, -1).tolist()  # host sync
        headers = [tuple(flat[t][j][r * E:]) for t in range(mesh.tp) for j in range(mesh.ep)]
        mine = flat[mesh.tp_rank][mesh.ep_rank][r * E:]
        if any(h[1:] != tuple(mine[1:]) for h in headers):
            raise ValueError(f"tp_ep: ranks disagree on the form or chunk count (headers {headers})")
        peers_t = [flat[t][mesh.ep_rank][r * E] for t in range(mesh.tp)]
        if len(set(peers_t)) != 1:
            raise ValueError(f"tp_ep: the ranks of a tensor-parallel group must hold the same tokens, "
                             f"but their token counts differ: {peers_t}")
        return [[[v[c * E:(c + 1) * E] for c in range(r)] for v in by_t] for by_t in flat]
