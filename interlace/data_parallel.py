"""Data parallelism over expert-parallel models: :func:`parallelize` applies FSDP2 or DDP on a
``("dp", "ep")`` :class:`~torch.distributed.device_mesh.DeviceMesh` so that nothing mixes the
experts of different expert-parallel ranks.

Layout (torchtitan's). The world is ``dp × ep`` ranks, ``rank = dp_index * ep + ep_index``
(``init_device_mesh(device, (dp, ep), mesh_dim_names=("dp", "ep"))``); each MoE layer's expert
group is the mesh's ``ep`` group of this rank (build layers with ``group=mesh["ep"].get_group()``,
or ``replace_moe_blocks(model, group=...)``). Then

* **expert parameters** (:func:`expert_parameters`: this rank's block of E/ep experts) are the
  same on the ``dp`` ranks of one ``ep`` index and differ along ``ep``: FSDP shards them over
  ``mesh["dp"]`` (its own unit per layer), DDP leaves them out and all-reduces their gradients
  over ``dp``;
* **every other parameter** (attention, norms, embeddings, routers, shared experts) is
  replicated on all ``dp × ep`` ranks: FSDP shards it over all of them (the flattened mesh),
  DDP replicates it over all of them.

Gradients then match one process that runs every rank's batch with the loss the *mean* of the
ranks' losses: replicated gradients are averaged over the ``dp·ep`` ranks; an expert's gradient,
which the all-to-all's backward already summed over the ``ep`` ranks' tokens, is summed over
``dp`` and divided by ``dp·ep``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from interlace.experts import ExpertShard
from interlace.parallel.comm import WeakGroupAttribute


def expert_modules(model: nn.Module) -> list[tuple[str, ExpertShard]]:
    """(qualified name, module) of every block of routed experts (``MoELayer.experts``, the HF
    blocks' ``experts``), in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertShard)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters: this rank's experts, different on each rank of an EP
    group (their gradients are reduced over data-parallel replicas only)."""
    return [p for _, m in expert_modules(model) for p in m.parameters()]


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter: the same on every rank, its gradient a data-parallel one."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a ``DistributedDataParallel`` wrapper (state-dict keys without "module."),
    else ``model`` (FSDP2 shards in place)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Every ``MoELayer``'s :attr:`~interlace.MoELayer.aux_loss_scale`: the factor the training
    loop multiplies its loss by before ``backward()`` (1/n for n accumulated micro-batches),
    so the folded balance loss's gradient scales like the loss's."""
    for m in model.modules():
        if hasattr(m, "aux_loss_scale"):
            m.aux_loss_scale = float(scale)


@dataclass(frozen=True)
class DataParallelOptions:
    """Options of :func:`parallelize`.

    ``wrapper``: ``"fsdp"`` (FSDP2's ``fully_shard``) or ``"ddp"`` (``DistributedDataParallel``).
    ``units``: FSDP only, more modules to shard as their own units over all ranks, bottom-up
    before the root (e.g. the transformer blocks: ``model.model.layers``); each layer's experts
    always get their own unit over ``dp``. ``reshard_after_forward``, ``mp_policy``: FSDP's.
    ``ddp_kwargs``: more ``DistributedDataParallel`` arguments (``static_graph``, ...).
    """

    wrapper: str = "fsdp"
    units: tuple = ()
    reshard_after_forward: bool | None = None
    mp_policy: object = None
    ddp_kwargs: tuple = ()  # (name, value) pairs (a frozen dataclass holds no dict)

    def __post_init__(self):
        if self.wrapper not in ("fsdp", "ddp"):
            raise ValueError(f"parallelize: wrapper must be 'fsdp' or 'ddp', got {self.wrapper!r}")


def parallelize(model: nn.Module, mesh: DeviceMesh, options: DataParallelOptions | None = None, **given) -> nn.Module:
    """Data parallelism over ``mesh["dp"]`` for an expert-parallel ``model`` (layers built over
    ``mesh["ep"]``): FSDP2 (default) or DDP, laid out as the module docstring says.

    Args:
        model: ``MoELayer`` models or HF models after ``replace_moe_blocks``, on their device,
            the same weights on every rank (each its own experts).
        mesh: a 2-D ``DeviceMesh`` with dims named ``("dp", "ep")`` over the whole world.
        options: :class:`DataParallelOptions`, or its fields as keywords.

    Returns:
        FSDP: ``model`` itself (sharded in place). DDP: the ``DistributedDataParallel`` wrapper
        (train through it; ``wrapper.module`` is ``model``). Gradient accumulation as the
        wrappers do it (``no_sync()`` / ``set_requires_gradient_sync(False)``, or nothing).

    ``ValueError`` (before anything is wrapped) for a mesh without those dims, a model without
    interlace experts, FP8 experts (inference-only: nothing to train), or a layer whose
    expert-parallel group is not this rank's ``ep`` group.
    """
    if options is None:
        options = DataParallelOptions(**given)
    elif given:
        raise ValueError("parallelize: give options= or its fields as keywords, not both")
    dp_mesh, ep_mesh, world_mesh = _check_mesh(mesh)
    experts = expert_modules(model)
    if not experts:
        raise ValueError(f"parallelize: {type(model).__name__} has no interlace experts (MoELayer, or HF blocks after "
                         f"interlace.hf.replace_moe_blocks); wrap a model without them with DDP / fully_shard directly")
    fp8 = [name or type(model).__name__ for name, m in experts if m.expert_quant is not None]
    if fp8:
        raise ValueError(f"parallelize: {fp8[0]} holds FP8 experts, which are inference-only (MoEConfig.expert_quant); "
                         f"data-parallel wrappers are for training: train the dense model, then quantize_experts")
    _check_ep_groups(experts, ep_mesh)
    factor = dp_mesh.size() * ep_mesh.size()
    if options.wrapper == "fsdp":
        return _apply_fsdp(model, experts, dp_mesh, world_mesh, factor, options)
    return _apply_ddp(model, experts, dp_mesh, world_mesh, factor, options)


def _check_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(dp mesh, ep mesh, the flattened dp×ep mesh of all ranks)."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != ("dp", "ep"):
        raise ValueError(f"parallelize: mesh must be a 2-D DeviceMesh with mesh_dim_names=('dp', 'ep'), got {mesh!r}; "
                         f"e.g. init_device_mesh('cuda', (dp, ep), mesh_dim_names=('dp', 'ep'))")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"parallelize: the mesh has {mesh.size()} ranks, the world {dist.get_world_size()}")
    try:
        world_mesh = mesh["dp_ep"]
    except (KeyError, RuntimeError, ValueError):
        # (DeviceMesh._flatten is private; torchtitan flattens so too. Collective: a new group, once.)
        world_mesh = mesh._flatten("dp_ep")
    return mesh["dp"], mesh["ep"], world_mesh


def _check_ep_groups(experts, ep_mesh: DeviceMesh) -> None:
    want = ep_mesh.mesh.flatten().tolist()
    for name, m in experts:
        have = dist.get_process_group_ranks(m.ep.group) if m.ep.group is not None else [dist.get_rank()]
        if have != want:
            raise ValueError(f"parallelize: {name} shards its experts over ranks {have}, but this rank's 'ep' group "
                             f"of the mesh is ranks {want}; build the layers with group=mesh['ep'].get_group() "
                             f"(MoELayer(cfg, group=...), replace_moe_blocks(model, group=...))")


def _apply_fsdp(model, experts, dp_mesh, world_mesh, factor: int, options: DataParallelOptions) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = dict(reshard_after_forward=options.reshard_after_forward, mp_policy=options.mp_policy or
                  MixedPrecisionPolicy())
    gloo = dp_mesh.device_type == "cpu"
    for _, m in experts:
        fully_shard(m, mesh=dp_mesh, **kwargs)
        # Expert gradients: Σ over dp of sums over the ep ranks' tokens, then / (dp·ep) as the
        # replicated ones are averaged over all dp·ep ranks (FSDP's default divides by dp only).
        m.set_gradient_divide_factor(float(factor))
        if gloo and dp_mesh.size() > 1:
            # (gloo has no PreMulSum: sum, then divide. Not on a 1-rank dp mesh, which runs no
            # collective: there torch 2.13's FSDP would divide by the factor twice.)
            m.set_force_sum_reduction_for_comms(True)
    for unit in options.units:
        fully_shard(unit, mesh=world_mesh, **kwargs)
    fully_shard(model, mesh=world_mesh, **kwargs)
    return model


def _apply_ddp(model, experts, dp_mesh, world_mesh, factor: int, options: DataParallelOptions) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    names = [f"{prefix}.{name}" if prefix else name for prefix, m in experts for name, _ in m.named_parameters()]
    # DDP's documented way to leave parameters out (it broadcasts and all-reduces the others).
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    params = [p for _, m in experts for p in m.parameters()]
    dp_group = dp_mesh.get_group()
    if dp_mesh.size() > 1:  # as DDP does for the rest: the dp replicas start from dp rank 0's experts
        src = dist.get_global_rank(dp_group, 0)
        for p in params:
            dist.broadcast(p.detach(), src=src, group=dp_group)
    ddp = DistributedDataParallel(model, process_group=world_mesh.get_group(), **dict(options.ddp_kwargs))
    ddp.expert_grad_sync = ExpertGradSync(ddp, params, dp_group, dp_mesh.size(), factor)
    return ddp


class ExpertGradSync:
    """DDP's missing half: the expert gradients, summed over ``dp`` and divided by ``dp·ep``
    once the backward ends (one all-reduce of them all), in the backwards DDP synchronizes
    (not under ``no_sync()``: gradient accumulation). Installed by :func:`parallelize`.

    The reduction is queued when the backward reaches the wrapper's output (a hook on its
    tensors), not when an expert gradient arrives: a rank whose experts got no tokens may get no
    expert gradient, and its dp peers would wait for it in the all-reduce.

    ``dp_group`` is held weakly (:class:`~interlace.parallel.comm.WeakGroupAttribute`), as
    every interlace holder holds its group. (DDP itself holds its process group.)"""

    dp_group = WeakGroupAttribute()

    def __init__(self, ddp, params: list[nn.Parameter], dp_group, dp: int, factor: int):
        self.params, self.dp_group, self.dp, self.factor = params, dp_group, dp, factor
        self.queued = False
        ddp.register_forward_hook(self._forward)

    def _forward(self, ddp, args, output) -> None:
        # As DDP decides: a forward with grad enabled outside no_sync() synchronizes its backward.
        if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
            return
        tensors = [t for t in torch.utils._pytree.tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_reached, mode="any")

    def _backward_reached(self, grad) -> None:
        if not self.queued:
            self.queued = True
            # NOTE: at the end of this backward, on every rank alike (no collective mid-backward,
            # where it could interleave with the layers' all-to-alls in a rank-dependent order).
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self) -> None:
        self.queued = False
        for p in self.params:  # (every rank reduces the same list; an unused expert block adds zeros)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        if self.dp > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        for g in grads:
            g.div_(self.factor)
