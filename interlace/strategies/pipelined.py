"""``pipelined``: PipeMoE's chunked dispatch → experts → combine pipeline.

The T tokens are split into r chunks along the token dimension. Each chunk gets its own
counting sort and its own pair of all-to-alls; all chunks' split sizes travel in one count
exchange, so the forward still has exactly one host sync. Then, on the communicator's NCCL
stream and the compute stream:

    dispatch:  D1 D2 D3 ...          (all issued at once, back to back)
    experts:      E1 E2 E3 ...       (E_i waits for D_i)
    combine:         C1 C2 C3 ...    (C_i waits for E_i and, on the one link, for D_r)

which is the schedule of PipeMoE's Eqs. 9–12 on one link. Dispatches and combines share one
communicator (one FIFO NCCL stream): all dispatches are queued first, then each combine as
its chunk's experts finish — exactly the schedule PipeMoE's Theorem 1 analyses
(``interlace.planning.pipemoe.schedule.simulate_shared_link``); on NVLink the two directions of traffic
share the links' bandwidth anyway. Backward runs the mirror image: the combine
gradients' all-to-alls start at once, each chunk's expert backward starts when its gradient
has arrived, and its dispatch-gradient all-to-all leaves as soon as it is done.

``degree`` r is an int, or ``"auto"``: r is chosen per token count and mode from the stored
performance profile (``interlace.planning``): a call that builds an autograd graph (training) is
planned on the predicted forward + backward time, one under ``no_grad``/eval on the forward
time; once per distinct (T, mode), cached, with no per-step cost. Ranks
must agree on r (with ``"auto"``: equal token counts); the count exchange carries every rank's
r and a disagreement raises instead of hanging. r = 1 is exactly ``sequential``; at world
size 1 there is nothing to overlap and the strategy runs ``sequential``.

Capacity: which assignments an expert drops is decided over the whole batch (as in
``sequential``), then the surviving assignments are chunked, so every r drops the same ones.
"""

from __future__ import annotations

import warnings

import torch

from interlace.parallel.comm import all_to_all_async, all_to_all_counts
from interlace.kernels.routing_index import build_dispatch_index, expert_major_index
from interlace.kernels.rows import CombineRows, DispatchRows, gather_rows
from interlace.planning.pipemoe.degree import choose_degree
from interlace.planning.pipemoe.schedule import chunk_sizes
from interlace.planning.profile import Profile, load_profile
from interlace.strategies.base import Strategy, register_strategy
from interlace.strategies.sequential import SequentialStrategy, expert_ffn

# What "no performance profile" was already warned about in this process (the error's text,
# which names the machine key or the path): once each, not per layer or token count.
_WARNED_NO_PROFILE: set[str] = set()


def _warn_no_profile_once(err: FileNotFoundError) -> None:
    message = str(err)
    if message not in _WARNED_NO_PROFILE:
        _WARNED_NO_PROFILE.add(message)
        warnings.warn(f"pipelined: {message}; using degree 1 (run `interlace profile` to choose it)", stacklevel=3)


class _ChunkPlan:
    """Host-side split sizes and device-side re-layout indices of every chunk.

    It lives in the autograd graph until the backward: it keeps ``ep``, which holds the group
    weakly, so that a graph whose backward never ran does not keep the group past
    ``destroy_process_group``."""

    def __init__(self, in_splits, out_splits, src_rows, inverses, offs, ep, activation, needs_grad):
        self.in_splits = in_splits  # [c][dest rank] rows this rank sends in chunk c
        self.out_splits = out_splits  # [c][source rank] rows this rank receives in chunk c
        self.src_rows, self.inverses, self.offs = src_rows, inverses, offs
        self.ep = ep
        self.activation = activation
        self.needs_grad = needs_grad

    @property
    def group(self):
        return self.ep.group


class _PipelinedExperts(torch.autograd.Function):
    """x_send chunks (rows in dispatch order) → y_back chunks, pipelined over chunks.

    Each chunk's expert FFN is recorded as its own small autograd graph inside forward, so
    backward can run chunk by chunk between the all-to-alls without recomputation.
    """

    @staticmethod
    def forward(ctx, w_up, w_down, plan: _ChunkPlan, *x_sends):
        r = len(x_sends)
        wu = w_up.detach().requires_grad_(plan.needs_grad)
        wd = w_down.detach().requires_grad_(plan.needs_grad)
        x_recvs, works = [], []
        for c in range(r):
            x_recv = x_sends[c].new_empty((sum(plan.out_splits[c]), x_sends[c].shape[1]))
            works.append(all_to_all_async(x_recv, x_sends[c], plan.out_splits[c], plan.in_splits[c],
                                          plan.group))
            x_recvs.append(x_recv)
        graphs, y_backs, combine_works, keep_alive = [], [], [], []
        for c in range(r):
            works[c].wait()
            xg = gather_rows(x_recvs[c], plan.src_rows[c])
            with torch.enable_grad():
                xg.requires_grad_(plan.needs_grad)
                yg = expert_ffn(xg, wu, wd, plan.offs[c], plan.activation)
            if plan.needs_grad:
                graphs.append((xg, yg))
            y_recv = gather_rows(yg.detach(), plan.inverses[c])
            y_back = y_recv.new_empty((sum(plan.in_splits[c]), y_recv.shape[1]))
            combine_works.append(all_to_all_async(y_back, y_recv, plan.in_splits[c], plan.out_splits[c],
                                                  plan.group))
            keep_alive.append(y_recv)
            y_backs.append(y_back)
            x_recvs[c] = None  # free the received rows of this chunk
        for work in combine_works:
            work.wait()
        ctx.plan, ctx.graphs, ctx.leaves = plan, graphs, (wu, wd)
        return tuple(y_backs)

    @staticmethod
    def backward(ctx, *grads):
        plan, (wu, wd) = ctx.plan, ctx.leaves
        r = len(grads)
        dy_recvs, works = [], []
        for c in range(r):
            g = grads[c] if grads[c] is not None else torch.zeros(
                (sum(plan.in_splits[c]), wu.shape[2]), dtype=wu.dtype, device=wu.device)
            dy_recv = g.new_empty((sum(plan.out_splits[c]), g.shape[1]))
            works.append(all_to_all_async(dy_recv, g.contiguous(), plan.out_splits[c], plan.in_splits[c],
                                          plan.group))
            dy_recvs.append(dy_recv)
        dwu = torch.zeros(wu.shape, dtype=torch.float32, device=wu.device)
        dwd = torch.zeros(wd.shape, dtype=torch.float32, device=wd.device)
        dx_sends, dispatch_works, keep_alive = [], [], []
        for c in range(r):
            works[c].wait()
            xg, yg = ctx.graphs[c]
            dyg = gather_rows(dy_recvs[c], plan.src_rows[c])
            dxg, dwu_c, dwd_c = torch.autograd.grad(yg, (xg, wu, wd), dyg)
            dwu += dwu_c
            dwd += dwd_c
            dx_recv = gather_rows(dxg, plan.inverses[c])
            dx_send = dx_recv.new_empty((sum(plan.in_splits[c]), dx_recv.shape[1]))
            dispatch_works.append(all_to_all_async(dx_send, dx_recv, plan.in_splits[c], plan.out_splits[c],
                                                   plan.group))
            keep_alive.append(dx_recv)
            dx_sends.append(dx_send)
            ctx.graphs[c] = None
        for work in dispatch_works:
            work.wait()
        return (dwu.to(wu.dtype), dwd.to(wd.dtype), None, *dx_sends)


@register_strategy
class PipelinedStrategy(Strategy):
    name = "pipelined"
    fused_routing = True

    def __init__(self, config, ep, degree: int | str = "auto", profile=None, max_degree: int = 16):
        super().__init__(config, ep)
        if degree != "auto" and (isinstance(degree, bool) or not isinstance(degree, int)
                                 or not 1 <= degree <= max_degree):
            raise ValueError(f"pipelined degree must be an int in 1..{max_degree} (e.g. 'pipelined:4') or 'auto', "
                             f"got {degree!r}")
        self.degree = degree
        self.max_degree = max_degree
        self._profile = profile
        self._chosen: dict[tuple[int, str], int] = {}
        self._sequential = SequentialStrategy(config, ep)

    @classmethod
    def parse_arg(cls, arg: str) -> dict:
        if arg == "auto":
            return {"degree": "auto"}
        # A negative int is parsed too: the constructor's check says the range (1..max_degree).
        if not arg.removeprefix("-").isdigit():
            raise ValueError(f"pipelined: the part after ':' is the pipeline degree, an int such as "
                             f"'pipelined:4', or 'pipelined:auto'; got {arg!r}")
        return {"degree": int(arg)}

    def degree_for(self, tokens: int, mode: str = "fwd") -> int:
        """The pipeline degree used for a batch of ``tokens`` tokens on this rank, for a
        forward-only call (``mode="fwd"``) or one whose backward will run (``"fwdbwd"``)."""
        if self.degree != "auto":
            return self.degree
        key = (tokens, mode)
        if key not in self._chosen:
            try:
                if not isinstance(self._profile, Profile):  # read the JSON once, not per token count
                    self._profile = load_profile(self.ep.world, path=self._profile)
                self._chosen[key] = choose_degree(self.config, tokens, self.ep.world, self._profile,
                                                  max_degree=self.max_degree, mode=mode).degree
            except FileNotFoundError as err:
                _warn_no_profile_once(err)
                self._chosen[key] = 1
        return self._chosen[key]

    def __repr__(self) -> str:
        return f"PipelinedStrategy(degree={self.degree}, world={self.ep.world})"

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        cfg, ep = self.config, self.ep
        T = x.shape[0]
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or w_up.requires_grad or w_down.requires_grad)
        r = self.degree_for(T, "fwdbwd" if needs_grad else "fwd")
        if ep.world == 1 or r <= 1:
            return self._sequential(x, topk_idx, topk_weight, w_up, w_down)
        E = cfg.num_experts
        sizes = chunk_sizes(T, r)
        sizes += [0] * (r - len(sizes))  # every rank runs r chunks (collectives), some may be empty
        capacity = cfg.capacity(T)
        if capacity is not None:
            # Drop decisions over the whole batch; dropped assignments go to an extra bin E.
            row_global = build_dispatch_index(topk_idx, E, capacity)[0]
            marked = torch.where(row_global < 0, E, topk_idx)
            bins = E + 1
        else:
            marked, bins = topk_idx, E
        indices = []
        for tc in torch.split(marked, sizes):
            row_of_assignment, assignment_of_row, kept, _ = build_dispatch_index(tc, bins, None)
            if capacity is not None:
                row_of_assignment = torch.where(tc == E, -1, row_of_assignment)
            indices.append((row_of_assignment, assignment_of_row, kept[:E]))

        # Count exchange of a fixed size (max_degree chunks + a header holding r), so that ranks
        # that disagree on r get an error here instead of mismatched collectives later.
        W, E_local, R = ep.world, ep.num_local, self.max_degree
        per_chunk = torch.stack([kept for _, _, kept in indices]).view(r, W, E_local).transpose(0, 1)
        send = torch.zeros((W, R * E_local + 1), dtype=torch.int32, device=x.device)
        send[:, : r * E_local] = per_chunk.reshape(W, r * E_local)
        send[:, -1] = r
        recv = all_to_all_counts(send.view(-1), ep).view(W, R * E_local + 1)
        # THE host sync of the forward: split sizes of every chunk's all-to-alls, in one copy.
        counts = torch.cat([send.view(-1), recv.view(-1)]).tolist()
        row = R * E_local + 1
        sent, got = counts[: W * row], counts[W * row:]
        peer_degrees = [got[w * row + row - 1] for w in range(W)]
        if any(d != r for d in peer_degrees):
            raise ValueError(
                f"pipelined: ranks disagree on the pipeline degree (rank {ep.rank} uses {r}, ranks use "
                f"{peer_degrees}); with degree='auto' every rank needs the same token count, or pass a "
                f"fixed degree")

        def split_sums(flat, c):  # flat is [rank][chunk * E_local + local expert | header]
            return [sum(flat[w * row + c * E_local: w * row + (c + 1) * E_local]) for w in range(W)]

        in_splits = [split_sums(sent, c) for c in range(r)]
        out_splits = [split_sums(got, c) for c in range(r)]
        recv_counts = recv[:, : r * E_local].view(W, r, E_local)
        recv_by_chunk = recv_counts.transpose(0, 1).contiguous()  # (r, W, E_local)
        relayout = [expert_major_index(recv_by_chunk[c], sum(out_splits[c])) for c in range(r)]

        x_chunks = torch.split(x, sizes)
        w_chunks = torch.split(topk_weight, sizes)
        x_sends = [DispatchRows.apply(x_chunks[c], indices[c][1][: sum(in_splits[c])], indices[c][0])
                   for c in range(r)]
        plan = _ChunkPlan(in_splits, out_splits, [s for s, _, _ in relayout], [i for _, i, _ in relayout],
                          [o for _, _, o in relayout], ep, cfg.activation, needs_grad)
        y_backs = _PipelinedExperts.apply(w_up, w_down, plan, *x_sends)
        outs = [CombineRows.apply(y_backs[c], w_chunks[c], indices[c][0], x.dtype) for c in range(r)]
        return torch.cat(outs) if r > 1 else outs[0]

