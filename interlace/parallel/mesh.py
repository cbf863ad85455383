"""The (TP, EP) mesh of an MoE layer: which ranks share tokens, which share experts.

World layout built by :meth:`MoEMesh.build` (DP replicas outside the layer are blocks of
``tp * ep`` consecutive ranks)::

    rank = replica * (tp * ep) + ep_rank * tp + tp_rank

- A **tensor-parallel group** is ``tp`` consecutive ranks (one node, NVLink in practice). Its
  ranks hold the SAME tokens (activations replicated, as after an attention block with TP and
  no sequence parallelism) and the same experts, each expert's FFN dimension K split in ``tp``
  slices.
- An **expert-parallel group** is the ``ep`` ranks with the same ``tp_rank``: each holds a
  different batch of tokens and a different block of ``E / ep`` experts.

Communication priority: ``build`` gives each group its own communicator
(``new_group``) and, on NCCL, a **high-priority CUDA stream** (``is_high_priority_stream``),
so the MoE layer's all-to-alls and TP all-gathers are scheduled ahead of collectives of other
communicators (data-parallel gradient reduction) that are in flight at the same time. With
``from_groups`` the caller's groups are used as they are (create them with
``ProcessGroupNCCL.Options(is_high_priority_stream=True)`` for the same effect).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from interlace.parallel.comm import WeakGroupAttribute, group_reference


def _group_options(high_priority: bool):
    """NCCL options with a high-priority stream, or None (other backends, or not asked)."""
    if not high_priority or "nccl" not in str(dist.get_backend()):
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    return opts


@dataclass(frozen=True)
class MoEMesh:
    """This rank's place in the (TP, EP) mesh and the two process groups.

    ``tp_group`` is None when ``tp == 1``; ``ep_group`` is None only without torch.distributed.
    Both are held weakly (:class:`~interlace.parallel.comm.WeakGroupAttribute`): after
    ``destroy_process_group`` reading them raises ``RuntimeError``.
    """

    tp_group: dist.ProcessGroup | None = WeakGroupAttribute()
    ep_group: dist.ProcessGroup | None = WeakGroupAttribute()
    tp: int
    ep: int
    tp_rank: int
    ep_rank: int
    high_priority: bool = False

    def __deepcopy__(self, memo) -> "MoEMesh":
        # Immutable, and its process groups are this process's handles to its peers (they cannot
        # be copied): a copied layer (copy.deepcopy of a model) talks to the same ranks.
        return self

    # Compared and hashed with the groups' references, not the groups (neither may raise once
    # they are destroyed).
    def _key(self) -> tuple:
        return (group_reference(self, "tp_group"), group_reference(self, "ep_group"), self.tp, self.ep, self.tp_rank,
                self.ep_rank, self.high_priority)

    def __eq__(self, other) -> bool:
        return self._key() == other._key() if other.__class__ is self.__class__ else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    @staticmethod
    def build(tp: int = 1, ep: int | None = None, high_priority: bool = True) -> "MoEMesh":
        """Mesh over the world (collective: every rank calls it, in the same order).

        ``ep`` defaults to ``world // tp``; ``world`` must be a multiple of ``tp * ep``.
        """
        if not (dist.is_available() and dist.is_initialized()):
            if tp != 1 or ep not in (None, 1):
                raise ValueError(f"a tp={tp} x ep={ep} mesh needs torch.distributed to be initialized")
            return MoEMesh(None, None, 1, 1, 0, 0)
        world, rank = dist.get_world_size(), dist.get_rank()
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        ep = world // tp if ep is None else ep
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world % (tp * ep):
            raise ValueError(f"world size {world} is not a multiple of tp * ep = {tp} * {ep}")
        opts = _group_options(high_priority)
        tp_group = ep_group = None
        # Every rank creates every group, in the same order (new_group is collective).
        for base in range(0, world, tp * ep):
            for e in range(ep):
                ranks = [base + e * tp + t for t in range(tp)]
                g = dist.new_group(ranks, pg_options=opts) if tp > 1 else None
                if rank in ranks:
                    tp_group = g
            for t in range(tp):
                ranks = [base + e * tp + t for e in range(ep)]
                g = dist.new_group(ranks, pg_options=opts)
                if rank in ranks:
                    ep_group = g
        local = rank % (tp * ep)
        return MoEMesh(tp_group, ep_group, tp, ep, local % tp, local // tp, high_priority=opts is not None)

    @staticmethod
    def from_groups(tp_group: dist.ProcessGroup | None = None, ep_group: dist.ProcessGroup | None = None) -> "MoEMesh":
        """Mesh from the caller's groups. ``ep_group=None`` means the world group (if
        initialized); ``tp_group=None`` means no tensor parallelism."""
        initialized = dist.is_available() and dist.is_initialized()
        if ep_group is None and initialized:
            ep_group = dist.group.WORLD
        if tp_group is not None and not initialized:
            raise ValueError("tp_group given but torch.distributed is not initialized")
        ep, ep_rank = (dist.get_world_size(ep_group), dist.get_rank(ep_group)) if ep_group is not None else (1, 0)
        tp, tp_rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group is not None else (1, 0)
        if tp == 1:
            tp_group = None
        if tp_rank < 0 or ep_rank < 0:
            raise ValueError("this rank is not a member of the given tp_group/ep_group")
        return MoEMesh(tp_group, ep_group, tp, ep, tp_rank, ep_rank)

    def shard_ffn(self, ffn: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of the expert FFN dimension K."""
        if ffn % self.tp:
            raise ValueError(f"expert ffn={ffn} is not divisible by the tensor-parallel size {self.tp}")
        width = ffn // self.tp
        return self.tp_rank * width, (self.tp_rank + 1) * width

    def __repr__(self) -> str:
        return (f"MoEMesh(tp={self.tp}, ep={self.ep}, tp_rank={self.tp_rank}, ep_rank={self.ep_rank}, "
                f"high_priority={self.high_priority})")
