"""Checks that a data-parallel wrapper (DDP, FSDP2) does not mix the experts of different
expert-parallel ranks: each raises ``ValueError`` before the wrapped model takes a step, naming
what is wrong and the layout that works (:func:`interlace.parallelize`, docs/training.md).

Both take the experts module duck-typed (``ep``: its :class:`ExpertParallel`, ``weight_names``,
the names of its two weights), so :mod:`interlace.experts` can call them from the module itself.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

_FIX = ("Shard or replicate the experts over the data-parallel dimension only: interlace.parallelize(model, mesh) "
        "with a ('dp', 'ep') DeviceMesh whose 'ep' groups are the layers' expert-parallel groups does it "
        "(docs/training.md)")


def _ep_peers(experts, mesh_ranks) -> tuple[list[int], list[int]]:
    """(the ranks of ``experts.ep``'s group, those of them other than this one in ``mesh_ranks``)."""
    ep_ranks = dist.get_process_group_ranks(experts.ep.group)
    return ep_ranks, sorted((set(mesh_ranks) & set(ep_ranks)) - {dist.get_rank()})


def _what(experts) -> str:
    ep = experts.ep
    return (f"{type(experts).__name__} (this rank's experts {ep.first_expert}..{ep.first_expert + ep.num_local - 1} "
            f"of {ep.num_local * ep.world})")


def check_dtensor_mesh(experts, name: str, value) -> None:
    """``value``, a DTensor about to become ``experts.<name>`` (``fully_shard`` assigns its sharded
    parameters so): ``ValueError`` when its mesh holds another rank of the experts' EP group. Those
    ranks hold other experts; FSDP would all-gather and average them as one tensor."""
    if experts.ep.world == 1 or experts.ep.group is None:
        return
    mesh = value.device_mesh
    if experts.__dict__.get("_checked_mesh") is mesh:  # (FSDP assigns its shards again at every reshard)
        return
    mesh_ranks = mesh.mesh.flatten().tolist()
    ep_ranks, clash = _ep_peers(experts, mesh_ranks)
    if clash:
        raise ValueError(f"fully_shard over ranks {sorted(mesh_ranks)} would shard {name} of {_what(experts)} "
                         f"together with ranks {clash} of its expert-parallel group {ep_ranks}, which hold other "
                         f"experts: FSDP would gather and average different experts as one tensor. {_FIX}: it "
                         f"shards the experts with fully_shard(experts, mesh=mesh['dp']) and the rest over all ranks.")
    experts.__dict__["_checked_mesh"] = mesh


_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # DDP wrapper → experts modules passed


def check_ddp_wrapper(experts) -> None:
    """Inside a ``DistributedDataParallel`` forward (the wrapper DDP marks as active): ``ValueError``
    when that DDP manages the weights of ``experts`` over a process group that holds another rank
    of their EP group. It broadcast rank 0's experts over them when it was built and would average
    their gradients; its ignored parameters (``_ddp_params_and_buffers_to_ignore``) are fine.
    Checked once per (wrapper, experts module): a dictionary lookup afterwards."""
    if experts.ep.world == 1 or experts.ep.group is None:
        return
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return
    seen = _CHECKED.setdefault(ddp, weakref.WeakSet())
    if experts in seen:
        return
    managed = {id(p) for p in getattr(ddp, "_module_parameters", ())}
    synced = [name for name in experts.weight_names if id(getattr(experts, name)) in managed]
    if synced:
        group_ranks = dist.get_process_group_ranks(ddp.process_group)
        ep_ranks, clash = _ep_peers(experts, group_ranks)
        if clash:
            raise ValueError(f"DistributedDataParallel over ranks {group_ranks} manages {' and '.join(synced)} of "
                             f"{_what(experts)} with ranks {clash} of its expert-parallel group {ep_ranks}, "
                             f"which hold other experts. It broadcast rank {group_ranks[0]}'s experts to them when "
                             f"it was built (the weights are already overwritten: rebuild the model) and would "
                             f"average different experts' gradients. {_FIX}: it leaves the experts out of DDP and "
                             f"reduces their gradients over 'dp' only.")
    seen.add(experts)
