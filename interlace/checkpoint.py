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

The optimizer's state of an expert parameter (AdamW's ``exp_avg``, ``exp_avg_sq``) is a per-rank
slice too: :func:`expert_sharded_optimizer_state_dict` gives torch's
``get_optimizer_state_dict`` with those entries so wrapped, and
:func:`load_expert_sharded_optimizer_state_dict` puts a loaded one back into the optimizer.

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
    for prefix, m in experts.items():
        lo, hi = getattr(m, "ffn_slice", (0, None))
        if hi is not None and (lo, hi) != (0, getattr(m, "ffn", hi)):
            # (each rank holds K-slice [lo, hi) of every expert: a plain or expert-sharded dict
            # would save one slice as if it were the whole FFN)
            raise ValueError(f"{what}: {prefix} holds the tensor-parallel slice [{lo}, {hi}) of the experts' FFN "
                             f"dimension ({m.ffn}): checkpoints of tp > 1 layouts are not supported")
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


def _expert_params(experts: dict[str, ExpertShard]) -> dict[str, tuple[nn.Parameter, int]]:
    """FQN → (parameter, EP world size) of every expert parameter of ``experts`` (FQN prefix → module)."""
    out = {}
    for prefix, module in experts.items():
        for name, p in module.named_parameters():
            out[f"{prefix}.{name}" if prefix else name] = (p, module.ep.world)
    return out


def expert_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                        mesh: DeviceMesh | None) -> dict:
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer)``
    (``{"state": {fqn: {...}}, "param_groups": [...]}``, FQN keys, FSDP2's state as its DTensors)
    with every state tensor of an expert parameter shaped like the parameter (AdamW's
    ``exp_avg``, ``exp_avg_sq``) as a DTensor of the full (E, ...) tensor, as
    :func:`expert_sharded_state_dict` gives the parameter. Scalars (``step``, the same on every
    rank) stay as they are. Like torch's, it first initializes an optimizer without state (a
    step with zero gradients at lr 0; gradients already there are kept aside meanwhile), so a
    fresh optimizer's dict can be ``dcp.load``-ed into; then
    :func:`load_expert_sharded_optimizer_state_dict` sets it.

    ``model``: the parallelized model, or its DDP wrapper; ``mesh`` as for
    :func:`expert_sharded_state_dict`. ``ValueError`` for an expert parameter's state tensor of
    another shape (an optimizer whose state does not mirror the parameter: not supported)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = _expert_params(_expert_modules(unwrapped(model), mesh, "expert_sharded_optimizer_state_dict"))
    held = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if optimizer.state or not held:
        state = get_optimizer_state_dict(model, optimizer)
    else:  # (torch initializes no state where gradients are set: the dict would load nothing)
        grads = [p.grad for p in held]
        for p in held:
            p.grad = None
        state = get_optimizer_state_dict(model, optimizer)
        for p, grad in zip(held, grads):
            p.grad = grad
    if mesh is None:
        return state
    ep_dp = _ep_dp_mesh(mesh)
    for fqn, entries in state["state"].items():
        if fqn not in params:
            continue
        param, ep_world = params[fqn]
        entries = state["state"][fqn] = dict(entries)  # (optimizer.state_dict() hands out its own dicts)
        for key, value in list(entries.items()):
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                continue
            if value.shape != param.shape:
                raise ValueError(f"expert_sharded_optimizer_state_dict: {type(optimizer).__name__}'s state {key!r} of "
                                 f"the expert parameter {fqn} has shape {tuple(value.shape)}, the parameter "
                                 f"{tuple(param.shape)}: only state shaped like the parameter (as Adam's, SGD's "
                                 f"momentum) or scalars can be expert-sharded")
            entries[key] = _as_full_experts(value, ep_world, ep_dp)
    return state


def load_expert_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                             state: dict) -> None:
    """Set ``optimizer``'s state from ``state``, a dict of
    :func:`expert_sharded_optimizer_state_dict` that ``dcp.load`` filled: its expert entries
    back to this rank's tensors (FSDP: the DTensors of the optimizer's own), then torch's
    ``set_optimizer_state_dict`` (the state and the param groups' hyperparameters)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    params = _expert_params({prefix: m for prefix, m in unwrapped(model).named_modules() if isinstance(m, ExpertShard)})
    live = get_optimizer_state_dict(model, optimizer)["state"]
    own = {}
    for fqn, entries in state["state"].items():
        if fqn not in params:
            own[fqn] = entries
            continue
        own[fqn] = dict(entries)
        for key, value in entries.items():
            if isinstance(value, DTensor) and value.device_mesh.mesh_dim_names == ("ep", "dp"):
                template = live[fqn][key]
                local = value.to_local()
                own[fqn][key] = (DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                                                    shape=template.shape, stride=template.stride())
                                 if isinstance(template, DTensor) else local)
    set_optimizer_state_dict(model, optimizer, {"state": own, "param_groups": state["param_groups"]})
