"""Expert-parallel process group handling and the differentiable all-to-all."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


def host_identity() -> tuple[str, str]:
    """(host name, boot id) of this process's machine: ranks with equal identities share a host
    (its /dev/shm, and its GPUs' peer memory over NVLink or PCIe)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


@dataclass(frozen=True)
class ExpertParallel:
    """Where this rank sits in the expert-parallel group.

    ``num_local`` experts live on each rank; rank r owns experts
    ``[r * num_local, (r + 1) * num_local)``. ``hosts``: per group rank, the index of its host
    (ranks on one host share the index; :func:`host_identity`), None where not known (one host
    is assumed: a group built by hand).
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    num_local: int
    hosts: tuple[int, ...] | None = None

    def __deepcopy__(self, memo) -> "ExpertParallel":
        # Immutable, and its process groups are this process's handles to its peers (they cannot
        # be copied): a copied layer (copy.deepcopy of a model) talks to the same ranks.
        return self

    @property
    def first_expert(self) -> int:
        return self.rank * self.num_local

    @property
    def one_host(self) -> bool:
        """Whether every rank of the group runs on one host (peer memory reaches every rank)."""
        return self.hosts is None or len(set(self.hosts)) == 1

    def require_peer_memory(self, what: str) -> None:
        """``ValueError`` (the same on every rank) where ``what`` needs the peers' memory (CUDA
        symmetric memory) but the group's ranks are on several hosts, naming them."""
        if self.one_host:
            return
        by_host: dict[int, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            by_host.setdefault(host, []).append(rank)
        parts = "; ".join(f"ranks {ranks} on host {host}" for host, ranks in by_host.items())
        raise ValueError(f"{what} stores into its peers' GPU memory, which reaches only the ranks of one host, but "
                         f"this expert-parallel group spans {len(by_host)} hosts ({parts}). Across hosts use "
                         f"'sequential', 'pipelined', 'tp_ep' or 'auto' (which then picks among those), or "
                         f"transport='staged' for fused.")

    @staticmethod
    def build(group: dist.ProcessGroup | None, num_experts: int) -> "ExpertParallel":
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is None:
            rank, world = 0, 1
        else:
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        if num_experts % world:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel world size {world}"
            )
        hosts = None
        if world > 1:
            # (one small collective, once per layer: which ranks share a host and so peer memory)
            identities = [None] * world
            dist.all_gather_object(identities, host_identity(), group=group)
            order = {ident: i for i, ident in reversed(list(enumerate(identities)))}
            hosts = tuple(sorted(set(order.values())).index(order[ident]) for ident in identities)
        return ExpertParallel(group=group, rank=rank, world=world, num_local=num_experts // world, hosts=hosts)

    def collective_device(self) -> torch.device:
        """Device for small collectives: NCCL needs CUDA tensors, gloo takes CPU ones."""
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def all_to_all_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """Exchange per-expert row counts: send (E,) with rank-major blocks of ``num_local``,
    receive (W * num_local,) laid out [source rank][local expert]. Asynchronous on NCCL."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts, group=ep.group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on rows with host-side split sizes; backward runs it reversed."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], ep: ExpertParallel) -> torch.Tensor:
    return AllToAll.apply(x, out_splits, in_splits, ep.group)


def check_same_across_ranks(value: int, ep: ExpertParallel, what: str, fields: dict[str, str] | None = None) -> None:
    """Raise ValueError on every rank if ranks disagree on ``value`` (one small all_gather).

    ``value`` is the int itself (a seed) or a hash of ``fields`` (``MoEConfig.fingerprint()`` of
    ``MoEConfig.math_fields()``, name → repr). On a mismatch the ranks also gather ``fields``, so
    the message names each field that differs and every rank's value of it, not a hash.
    """
    if ep.world == 1:
        return
    device = ep.collective_device()
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(ep.world)]
    dist.all_gather(gathered, mine, group=ep.group)
    values = [int(g.item()) for g in gathered]
    if len(set(values)) == 1:
        return
    # Every rank saw the same gathered values, so every rank takes this branch: the second
    # collective is entered by all of them.
    if fields is None:
        differences = [_who_has_what([str(v) for v in values])]
    else:
        per_rank: list[dict[str, str] | None] = [None] * ep.world
        dist.all_gather_object(per_rank, fields, group=ep.group)
        names = dict.fromkeys(name for rank_fields in per_rank for name in rank_fields)
        differences = []
        for name in names:
            reprs = [rank_fields.get(name, "(no such field)") for rank_fields in per_rank]
            if len(set(reprs)) > 1:
                differences.append(f"{name}: {_who_has_what(reprs)}")
    raise ValueError(f"{what} differs across the expert-parallel group: {'; '.join(differences)}")


def _who_has_what(values: list[str]) -> str:
    """``"2 on ranks [0, 2], 3 on ranks [1]"`` for the per-rank values ``["2", "3", "2"]``."""
    ranks_of: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks_of.setdefault(value, []).append(rank)
    return ", ".join(f"{value} on ranks {ranks}" for value, ranks in ranks_of.items())


def all_to_all_async(out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """Start ``all_to_all_single`` without making the current stream wait; returns the work.

    NCCL runs it on its own stream once the current stream's earlier work is done; call
    ``work.wait()`` before the current stream reads ``out``. Keep ``x`` and ``out`` alive until
    then (ProcessGroupNCCL also stashes them).
    """
    return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)


# torch ≥ 2.13 renames the single-tensor collectives; older releases (the device's 2.11) only
# have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """``out`` (G·M, ...) = the ``x`` (M, ...) of every rank of ``group``, in rank order."""
    return _all_gather_single(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """``out`` (M, ...) = Σ over ranks of block ``rank`` of ``x`` (G·M, ...)."""
    return _reduce_scatter_single(out, x, group=group, async_op=async_op)
