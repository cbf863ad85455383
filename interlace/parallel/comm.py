"""Expert-parallel process group handling and the differentiable all-to-all."""

from __future__ import annotations

import socket
import weakref
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


GROUP_DESTROYED = ("interlace: the process group of this layer was destroyed (torch.distributed.destroy_process_group); "
                   "build the layer again after init_process_group")


class GroupReference:
    """How an interlace object holds a process group beyond a call (:func:`hold_group`):
    ``reference()`` is the group, or None once it is gone.

    A group that torch.distributed holds (made by ``init_process_group`` or ``new_group``, a
    ``DeviceMesh``'s) is referenced weakly: ``destroy_process_group()`` lets go of it, and so it
    is freed there, as torch expects, not at the interpreter's exit through a layer the script
    still holds (a gloo or NCCL group destroyed at exit can abort the process: "terminate called
    without an active exception"). A group torch does not hold (one built by hand, a test's
    stand-in) is held strongly: nothing else would keep it, and ``destroy_process_group`` cannot
    destroy it.

    Two references are equal where they reference the same group (a gone group: where they are
    the same weak reference), so objects holding them compare and hash without reading the group.
    """

    __slots__ = ("_reference", "_id")

    def __init__(self, group):
        self._id = id(group)
        self._reference = weakref.ref(group) if _registered(group) else _Strong(group)

    def __call__(self):
        return self._reference()

    def __eq__(self, other) -> bool:
        if not isinstance(other, GroupReference):
            return NotImplemented
        # (weakref.ref(g) without a callback is one object per live g: the same reference, the same group)
        return self._reference is other._reference or (self() is not None and self() is other())

    def __hash__(self) -> int:
        return self._id

    def __deepcopy__(self, memo) -> "GroupReference":
        return self  # (immutable; a group cannot be copied)

    def __repr__(self) -> str:
        group = self()
        return "<destroyed process group>" if group is None else repr(group)


class _Strong:
    """A strong reference with weakref.ref's call (:class:`GroupReference`, a group torch does not hold)."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __call__(self):
        return self.group


def _registered(group) -> bool:
    """Whether torch.distributed holds ``group`` until ``destroy_process_group`` (and a weak
    reference to it can be made)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_process_group_ranks(group)
        weakref.ref(group)
    except (KeyError, ValueError, TypeError, RuntimeError):
        return False
    return True


def hold_group(group) -> GroupReference | None:
    """What an object keeps of ``group`` (None for None): see :class:`GroupReference`."""
    return None if group is None else GroupReference(group)


class WeakGroupAttribute:
    """A class attribute through which each instance holds a process group (:func:`hold_group`):
    ``obj.group = g`` keeps a :class:`GroupReference`, and ``obj.group`` is the group (None
    where None was given) or raises ``RuntimeError`` (:data:`GROUP_DESTROYED`) once
    ``destroy_process_group`` has let go of it, before the caller starts any work with it. One
    weak reference read per access, no other cost. Also a dataclass field (a required one: the
    class's own access raises ``AttributeError``, which tells the dataclass there is no default);
    :func:`group_reference` reads the reference itself.
    """

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, _slot(name)

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError(f"{owner.__name__}.{self.name} is a process group held per instance")
        reference = obj.__dict__[self.slot]
        if reference is None:
            return None
        group = reference._reference()  # (the weak reference's own call: no Python frame of GroupReference's)
        if group is None:
            raise RuntimeError(GROUP_DESTROYED)
        return group

    def __set__(self, obj, group) -> None:
        # (straight into the instance's dict: a frozen dataclass's own __setattr__ refuses)
        obj.__dict__[self.slot] = hold_group(group)


def _slot(name: str) -> str:
    return f"_{name}_reference"


def group_reference(obj, name: str = "group") -> GroupReference | None:
    """The :class:`GroupReference` behind ``obj``'s :class:`WeakGroupAttribute` ``name`` (None
    where the group given was None): to compare or hash without reading the group."""
    return obj.__dict__[_slot(name)]


def held_group(obj, name: str = "group"):
    """``obj``'s group under :class:`WeakGroupAttribute` ``name``, or None where it is gone (or
    was None): for caches that check which group an entry belongs to, without raising."""
    reference = group_reference(obj, name)
    return None if reference is None else reference()


@dataclass(frozen=True)
class ExpertParallel:
    """Where this rank sits in the expert-parallel group.

    ``num_local`` experts live on each rank; rank r owns experts
    ``[r * num_local, (r + 1) * num_local)``. ``hosts``: per group rank, the index of its host
    (ranks on one host share the index; :func:`host_identity`), None where not known (one host
    is assumed: a group built by hand).

    The group is held weakly (:class:`WeakGroupAttribute`): after ``destroy_process_group``
    reading ``group`` raises ``RuntimeError`` (:data:`GROUP_DESTROYED`).
    """

    group: dist.ProcessGroup | None = WeakGroupAttribute()
    rank: int
    world: int
    num_local: int
    hosts: tuple[int, ...] | None = None

    def __deepcopy__(self, memo) -> "ExpertParallel":
        # Immutable, and its process groups are this process's handles to its peers (they cannot
        # be copied): a copied layer (copy.deepcopy of a model) talks to the same ranks.
        return self

    # Compared, hashed (auto's shared deciders are keyed by it) and shown with the group's
    # reference, not the group: neither may raise once the group is destroyed.
    def _key(self) -> tuple:
        return group_reference(self), self.rank, self.world, self.num_local, self.hosts

    def __eq__(self, other) -> bool:
        return self._key() == other._key() if other.__class__ is self.__class__ else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"ExpertParallel(group={group_reference(self)!r}, rank={self.rank}, world={self.world}, "
                f"num_local={self.num_local}, hosts={self.hosts})")

    def check_group(self) -> None:
        """``RuntimeError`` (:data:`GROUP_DESTROYED`) where ``destroy_process_group`` has taken
        the group: a layer checks it before any work of a call (one weak reference read)."""
        reference = group_reference(self)
        if reference is not None and reference() is None:
            raise RuntimeError(GROUP_DESTROYED)

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
    """``all_to_all_single`` on rows with host-side split sizes; backward runs it reversed.

    The graph keeps ``ep`` (which holds its group weakly), not the group: a graph whose backward
    never ran does not keep the group past ``destroy_process_group``."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], ep: ExpertParallel):
        ctx.splits = (out_splits, in_splits)
        ctx.ep = ep
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=ep.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, group=ctx.ep.group)
        return dx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], ep: ExpertParallel) -> torch.Tensor:
    return AllToAll.apply(x, out_splits, in_splits, ep)


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
