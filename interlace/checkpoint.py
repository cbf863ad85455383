"""Checkpoints of expert-parallel models in any data-parallel layout (:func:`interlace.parallelize`,
FSDP2 or DDP, or none): state dicts for ``torch.distributed.checkpoint`` (DCP).

An expert tensor's FQN is the same on every rank of an EP group, but each rank holds other
experts, so ``model.state_dict()`` hands DCP tensors that share a name and a shape without
being one tensor: DCP would keep one rank's. :func:`expert_sharded_state_dict` gives each
expert entry as what it is, a DTensor of the layer's full (E, ...) tensor sharded over ``ep``
(then, under FSDP, over ``dp``; else replicated over ``dp``), so DCP saves every expert once and
loads into any layout of the same mesh. The other entries stay as the model gives them (FSDP:
DTensors over all ranks; DDP: replicated tensors).

For HF checkpoints (full tensors, the plain transformers model's keys) use
:func:`interlace.hf.gather_hf_state_dict`, which takes every layout too.
"""

from __future__ import annotations

import torch
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


def expert_sharded_state_dict(model: nn.Module, mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (``model``: the parallelized model, or its DDP wrapper's ``module``)
    with every expert parameter as a DTensor of the full (E, ...) tensor over ``mesh``'s ``ep``
    and ``dp`` dims, sharing storage with the parameter: ``dcp.load`` into it loads in place.

    ``mesh``: the ("dp", "ep") mesh given to :func:`interlace.parallelize` (a model without a
    data-parallel wrapper: a (1, ep) mesh)."""
    model = unwrapped(model)
    ep_dp = _ep_dp_mesh(mesh)
    state = model.state_dict()
    for prefix, experts in model.named_modules():
        if not isinstance(experts, ExpertShard):
            continue
        for name in experts.tensor_names():  # (the weights, and FP8 weights' block scales)
            key = f"{prefix}.{name}" if prefix else name
            tensor = state[key]
            if isinstance(tensor, DTensor):  # FSDP: this rank's dp shard of its ep block
                block_rows, local = tensor.shape[0], tensor.to_local()
                placements = (Shard(0), Shard(0))
            else:  # replicated over dp (DDP, or no wrapper)
                block_rows, local = tensor.shape[0], tensor
                placements = (Shard(0), Replicate())
            shape = (block_rows * experts.ep.world,) + tuple(tensor.shape[1:])
            state[key] = DTensor.from_local(local, ep_dp, placements, run_check=False, shape=torch.Size(shape),
                                            stride=torch.empty(shape, device="meta").stride())
    return state
