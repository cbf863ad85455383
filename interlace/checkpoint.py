"""Checkpoints of expert-parallel models in any data-parallel layout (:func:`interlace.parallelize`,
FSDP2 or DDP, or none): state dicts for ``torch.distributed.checkpoint`` (DCP).

An expert tensor's FQN is the same on every rank of an EP group, but each rank holds other
experts, so ``model.state_dict()`` hands DCP tensors that share a name and a shape without
being one tensor: DCP would keep one rank's. :func:`expert_sharded_state_dict` gives each
expert entry as what it is, a DTensor of the layer's full (E, ...) tensor sharded over ``ep``
(then, under FSDP, over ``dp``; else replicated over ``dp``), so DCP saves every expert once and
loads into any layout of the same mesh. The other entries stay as the model gives them (FSDP:
DTensors over all ranks; DDP: replicated tensors). FP8 experts' block scales are expert-sharded
the same way as their weights.

For HF checkpoints (full tensors, the plain transformers model's keys) use
:func:`interlace.hf.gather_hf_state_dict`, which takes every layout too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from interlace.data_parallel import unwrapped
from interlace.experts import ExpertShard


def _ep_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ("ep", "dp") transpose of a ("dp", "ep") mesh: an expert tensor's rows are split over ep
    first (rank e holds experts [e·E/ep, (e+1)·E/ep)), each block then over dp (FSDP's shard).
    Only its coordinates are used (DCP's offsets): no process group is made."""
    return DeviceMesh(mesh.device_type, mesh.mesh.transpose(0, 1).contiguous(), mesh_dim_names=("ep", "dp"),
                      _init_backend=False)


def _expert_modules(model: nn.Module, mesh: DeviceMesh | None, what: str) -> dict[str, ExpertShard]:
    """FQN prefix → experts module, after checking that ``mesh`` describes how they are sharded:
    a ("dp", "ep") mesh of the whole world whose ``ep`` row of this rank is every layer's EP
    group; ``mesh=None`` only where no layer shards its experts (world size 1)."""
    experts = {prefix: m for prefix, m in model.named_modules() if isinstance(m, ExpertShard)}
    if mesh is None:
        sharded = [prefix for prefix, m in experts.items() if m.ep.world > 1]
        if sharded:
            raise ValueError(f"{what}: {sharded[0]} shards its experts over {experts[sharded[0]].ep.world} ranks; "
                             f"give the ('dp', 'ep') DeviceMesh of interlace.parallelize (no data-parallel wrapper: "
                             f"init_device_mesh(device, (1, ep), mesh_dim_names=('dp', 'ep')))")
        return experts
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != ("dp", "ep"):
        raise ValueError(f"{what}: mesh must be a 2-D DeviceMesh with mesh_dim_names=('dp', 'ep'), got {mesh!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world:
        # (e.g. a tensor-parallel dim besides: each rank's experts are then a slice of their FFN too)
        raise ValueError(f"{what}: the mesh has {mesh.size()} ranks, the world {world}: the experts' layout over "
                         f"the other ranks (tensor parallelism?) is not supported")
    rank = dist.get_rank() if dist.is_initialized() else 0
    row = (mesh.mesh == rank).nonzero()[0, 0]
    want = mesh.mesh[row].tolist()
    for prefix, m in experts.items():
        have = dist.get_process_group_ranks(m.ep.group) if m.ep.group is not None else [rank]
        if have != want:
            raise ValueError(f"{what}: {prefix} shards its experts over ranks {have}, but this rank's 'ep' group of "
                             f"the mesh is ranks {want}")
    return experts


def _as_full_experts(tensor: torch.Tensor, ep_world: int, ep_dp: DeviceMesh) -> DTensor:
    """This rank's rows (E_local, ...) of an expert tensor (or, FSDP, its dp shard of them, a DTensor)
    as a DTensor of the full (E, ...) tensor over ``ep_dp``, sharing the storage."""
    if isinstance(tensor, DTensor):  # FSDP: this rank's dp shard of its ep block
        local, placements = tensor.to_local(), (Shard(0), Shard(0))
    else:  # replicated over dp (DDP, or no wrapper)
        local, placements = tensor, (Shard(0), Replicate())
    shape = (tensor.shape[0] * ep_world,) + tuple(tensor.shape[1:])
    return DTensor.from_local(local, ep_dp, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def expert_sharded_state_dict(model: nn.Module, mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (``model``: the parallelized model, or its DDP wrapper) with every
    expert tensor (the weights; FP8 experts: their ``*_scale_inv`` block scales too) as a DTensor
    of the full (E, ...) tensor over ``mesh``'s ``ep`` and ``dp`` dims, sharing storage with the
    module's: ``dcp.load`` into it loads in place.

    ``mesh``: the ("dp", "ep") mesh given to :func:`interlace.parallelize` (a model without a
    data-parallel wrapper: a (1, ep) mesh); None at world size 1 (the plain state dict).
    ``ValueError`` for a mesh that does not describe the experts' layout."""
    model = unwrapped(model)
    experts = _expert_modules(model, mesh, "expert_sharded_state_dict")
    state = model.state_dict()
    if mesh is None:
        return state
    ep_dp = _ep_dp_mesh(mesh)
    for prefix, module in experts.items():
        for name in module.tensor_names():  # (the weights, and FP8 weights' block scales)
            key = f"{prefix}.{name}" if prefix else name
            state[key] = _as_full_experts(state[key], module.ep.world, ep_dp)
    return state
