"""interlace.parallelize (issue 48): FSDP2 and DDP over a ("dp", "ep") DeviceMesh of 4 gloo ranks,
for a small model of MoELayers, against one process that runs every rank's batch with the loss
the mean of the ranks' losses: the loss of each of 3 SGD steps and every parameter after them
(fp32, relative error < TOL), in the layouts DP 2 × EP 2, DP 1 × EP 4 and DP 4 × EP 1, plain,
with gradient accumulation (2 micro-batches) and with activation checkpointing (``auto``
calibrating while its forwards are recomputed). Also: plain DDP(model) / fully_shard(model) over
EP > 1 raise before any step, and in each layout a torch.distributed.checkpoint of the model and
AdamW's state from which a fresh model and optimizer continue bit for bit (also at world size 1);
saved in one layout and loaded into another (DP 2 × EP 2 FSDP → DP 1 × EP 4 DDP → DP 4 × EP 1
FSDP), every parameter and state tensor equal, the next step within TOL.

One launch of 4 processes runs every check (a launch costs more than the checks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import check_dcp_resume, data_parallel_steps, rel_err, run_gloo, shared_tempdir
from interlace import MoEConfig, MoELayer
from interlace.data_parallel import expert_modules, expert_parameters, parallelize, set_aux_loss_scale

TOL = 1e-5  # fp32: the sums over ranks and tokens run in different orders than the reference's
CFG = MoEConfig(hidden=16, ffn=8, num_experts=8, top_k=2, dtype=torch.float32, aux_loss_coef=0.05)
STEPS, LR, TOKENS = 3, 0.2, 6
AUTO = {"candidates": ("naive", "sequential"), "warmup": 0, "samples": 1, "extra_samples": 0, "cache": False}


class TinyModel(nn.Module):
    """x (T, N) → (T, N): a linear layer, two residual MoE layers (optionally checkpointed), a
    linear head. Weights a function of the seed only: the shards of every layout come from it."""

    def __init__(self, group, strategy: str, checkpointed: bool = False, options: dict | None = None):
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(CFG.hidden, CFG.hidden)
        self.moe = nn.ModuleList(MoELayer(CFG, group=group, strategy=strategy, seed=3 + i, device="cpu",
                                          strategy_options=options) for i in range(2))
        self.head = nn.Linear(CFG.hidden, CFG.hidden)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        for layer in self.moe:
            h = h + (checkpoint(layer, h, use_reentrant=False) if self.checkpointed else layer(h))
        return self.head(h)


def batches(world: int, micro: int, step: int):
    """(world, micro, TOKENS, N) inputs and targets, fresh per step, the same on every rank."""
    gen = torch.Generator().manual_seed(100 + step)
    shape = (world, micro, TOKENS, CFG.hidden)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def singleton_groups(rank: int, world: int):
    """Every rank's one-rank group (new_group is collective): the reference's layers'."""
    groups = [dist.new_group([r]) for r in range(world)]
    return groups[rank]


def full_param(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def reference_run(world: int, micro: int, checkpointed: bool, reference_group):
    """One process's run of every rank's micro-batches, loss = their mean: the per-step losses
    and the parameters after STEPS SGD steps (each rank computes it alone; the same on all)."""
    ref = TinyModel(reference_group, "naive", checkpointed)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    set_aux_loss_scale(ref, 1 / (world * micro))  # the loss's factor: a mean over world·micro batches
    losses = []
    for step in range(STEPS):
        xs, ts = batches(world, micro, step)
        loss = sum(loss_fn(ref(xs[r, m]), ts[r, m]) for r in range(world) for m in range(micro)) / (world * micro)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {name: p.detach() for name, p in ref.named_parameters()}


def check_layout(rank, world, dp, ep, wrapper, mode, reference):
    """``mode``: "plain" (naive, one batch per step) or "accumulate+checkpoint" (2 micro-batches
    per step, each MoE layer under torch.utils.checkpoint, auto calibrating naive against
    sequential on the first calls, so recomputed forwards come while it calibrates)."""
    where = f"rank {rank}: dp {dp} x ep {ep} {wrapper} {mode}"
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    plain = mode == "plain"
    micro = 1 if plain else 2
    # (at EP 1, auto runs sequential and calibrates nothing: naive there, cheaper under the interpreter)
    auto = not plain and ep > 1
    model = TinyModel(mesh["ep"].get_group(), "auto" if auto else "naive", not plain, AUTO if auto else None)
    wrapped = parallelize(model, mesh, wrapper=wrapper)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    set_aux_loss_scale(model, 1 / micro)  # each micro-batch's loss is divided by `micro`
    ref_losses, ref_params = reference

    def micro_loss(step, m):
        xs, ts = batches(world, micro, step)
        return loss_fn(wrapped(xs[rank, m]), ts[rank, m])

    data_parallel_steps(wrapped, opt, wrapper, micro, micro_loss, ref_losses, where, TOL)
    # every parameter after the steps: the replicated ones whole, the experts this rank's rows
    experts = {id(p) for p in expert_parameters(model)}
    for name, p in model.named_parameters():
        got, want = full_param(p), ref_params[name]
        if id(p) in experts:
            rows = got.shape[0]
            want = want[mesh["ep"].get_local_rank() * rows:][:rows]
        assert rel_err(got, want) < TOL, f"{where}: {name} after {STEPS} steps"
    check_checkpoint_round_trip(rank, world, mesh, model, wrapped, wrapper, where)


def other_weights(model: TinyModel) -> TinyModel:
    """``model`` with 1 added to every weight: a fresh model a checkpoint must overwrite."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def check_checkpoint_round_trip(rank, world, mesh, model, wrapped, wrapper, where):
    """helpers.check_dcp_resume on the trained model, naive and not checkpointed from here on
    (the fresh model's computation, for bitwise equal steps), aux scale 1."""
    for layer in model.moe:
        layer.set_strategy("naive")
    model.checkpointed = False
    set_aux_loss_scale(model, 1.0)

    def make_fresh():
        fresh = other_weights(TinyModel(mesh["ep"].get_group(), "naive"))
        return fresh, parallelize(fresh, mesh, wrapper=wrapper)

    def step_loss(wrapped, step):
        xs, ts = batches(world, 1, 10 + step)
        return loss_fn(wrapped(xs[rank, 0]), ts[rank, 0])

    check_dcp_resume(model, wrapped, wrapper, mesh, make_fresh, step_loss, where)


def check_plain_wrappers_raise(rank, world):
    """DDP(model) and fully_shard(model) over all 4 ranks with EP 2: a ValueError naming the
    experts and the fix, before any step (DDP: at the first forward; FSDP: in fully_shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    x = torch.randn(TOKENS, CFG.hidden)
    model = DistributedDataParallel(TinyModel(mesh["ep"].get_group(), "naive"))
    with pytest.raises(ValueError, match=r"DistributedDataParallel over ranks \[0, 1, 2, 3\] manages w_up and "
                                         r"w_down of GroupedExperts .*interlace.parallelize\(model, mesh\)"):
        model(x)
    with pytest.raises(ValueError, match=r"fully_shard over ranks \[0, 1, 2, 3\] would shard w_up of GroupedExperts.*"
                                         r"interlace.parallelize\(model, mesh\)"):
        fully_shard(TinyModel(mesh["ep"].get_group(), "naive"))
    # torchtitan's layout by hand, the experts over dp: no error (the experts module's call unshards them)
    model = TinyModel(mesh["ep"].get_group(), "naive")
    for _, experts in expert_modules(model):
        fully_shard(experts, mesh=mesh["dp"])
    fully_shard(model)
    model(x).sum().backward()
    # and the helper's checks: a layer over another group than the mesh's 'ep'
    with pytest.raises(ValueError, match=r"moe.0.experts shards its experts over ranks \[0, 1, 2, 3\]"):
        parallelize(TinyModel(None, "naive"), mesh)
    # interlace.checkpoint: an optimizer whose state of an expert parameter is not shaped like it
    from interlace.checkpoint import expert_sharded_optimizer_state_dict

    model = TinyModel(mesh["ep"].get_group(), "naive")
    with pytest.raises(ValueError, match=r"Adafactor's state 'row_var' of the expert parameter moe.0.experts.w_up "
                                         r"has shape \(4, 16, 1\), the parameter \(4, 16, 16\)"):
        expert_sharded_optimizer_state_dict(model, torch.optim.Adafactor(model.parameters()), mesh)


def gathered(p: torch.Tensor, mesh, expert: bool) -> torch.Tensor:
    """The whole tensor of a parameter (or of its optimizer state): FSDP's shards gathered, and
    for an expert tensor every EP rank's rows (E, ...)."""
    t = full_param(p).detach()
    if not expert:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(mesh["ep"].size())]
    dist.all_gather(parts, t.contiguous(), group=mesh["ep"].get_group())
    return torch.cat(parts)


def check_resume_in_another_layout(rank, world, saved_as, loaded_as):
    """A torch.distributed.checkpoint of the model and AdamW's state saved in one layout
    (``saved_as``: ((dp, ep), wrapper)) and loaded into a fresh model and optimizer of another:
    every parameter and every state tensor equal to the saved ones bit for bit (gathered whole),
    and the next AdamW step within TOL of the saving layout's (other reduction orders)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from interlace.checkpoint import (expert_sharded_optimizer_state_dict, expert_sharded_state_dict,
                                      load_expert_sharded_optimizer_state_dict)

    where = f"rank {rank}: saved as {saved_as}, loaded as {loaded_as}"

    def build(layout, fresh):
        (dp, ep), wrapper = layout
        mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
        model = TinyModel(mesh["ep"].get_group(), "naive")
        model = other_weights(model) if fresh else model
        wrapped = parallelize(model, mesh, wrapper=wrapper)
        return mesh, model, wrapped, torch.optim.AdamW(model.parameters(), lr=0.5 if fresh else 0.01,
                                                       weight_decay=0.1)

    def adam_step(wrapped, opt, step):
        xs, ts = batches(world, 1, 20 + step)
        loss_fn(wrapped(xs[rank, 0]), ts[rank, 0]).backward()
        opt.step()
        opt.zero_grad()

    def whole(mesh, model, opt):
        experts = {id(p) for p in expert_parameters(model)}
        out = {}
        for name, p in model.named_parameters():
            out[name] = gathered(p, mesh, id(p) in experts)
            for key, value in opt.state[p].items():
                out[f"{name}/{key}"] = (gathered(value, mesh, id(p) in experts) if value.ndim
                                        else full_param(value).clone())
        return out

    def state_dicts(mesh, model, wrapped, opt):
        return {"model": expert_sharded_state_dict(model, mesh),
                "optim": expert_sharded_optimizer_state_dict(wrapped, opt, mesh)}

    mesh, model, wrapped, opt = build(saved_as, fresh=False)
    for step in range(2):
        adam_step(wrapped, opt, step)
    with shared_tempdir("interlace-dcp-") as path:  # (removed after the round trip)
        dcp.save(state_dicts(mesh, model, wrapped, opt), checkpoint_id=path)
        saved = whole(mesh, model, opt)
        adam_step(wrapped, opt, 2)
        want = whole(mesh, model, opt)

        mesh, model, wrapped, opt = build(loaded_as, fresh=True)
        if loaded_as[1] == "ddp":  # (as check_dcp_resume: DDP regroups its buckets after a first backward)
            xs, ts = batches(world, 1, 0)
            loss_fn(wrapped(xs[rank, 0]), ts[rank, 0]).backward()
        state = state_dicts(mesh, model, wrapped, opt)
        dcp.load(state, checkpoint_id=path)
        load_expert_sharded_optimizer_state_dict(wrapped, opt, state["optim"])
        opt.zero_grad()
        got = whole(mesh, model, opt)
        assert sorted(got) == sorted(saved), where
        for key, value in got.items():
            assert torch.equal(value, saved[key]), f"{where}: {key} after loading"
        assert opt.param_groups[0]["lr"] == 0.01, where
        adam_step(wrapped, opt, 2)
        for key, value in whole(mesh, model, opt).items():
            assert rel_err(value, want[key]) < TOL, f"{where}: {key} after an AdamW step from the checkpoint"


LAYOUTS = [(2, 2), (1, 4), (4, 1)]
MODES = ["plain", "accumulate+checkpoint"]
CASES = [(layout, wrapper, mode) for layout in LAYOUTS for wrapper in ("fsdp", "ddp") for mode in MODES]


RESHARDS = [(((2, 2), "fsdp"), ((1, 4), "ddp")), (((1, 4), "ddp"), ((4, 1), "fsdp"))]


def _all_layouts(rank, world, cases=CASES, plain_wrappers=True, reshards=RESHARDS):
    if plain_wrappers:
        check_plain_wrappers_raise(rank, world)
    for saved_as, loaded_as in reshards:
        check_resume_in_another_layout(rank, world, saved_as, loaded_as)
    reference_group = singleton_groups(rank, world)
    references = {}
    for (dp, ep), wrapper, mode in cases:
        if mode not in references:  # (the same for every layout)
            # (never checkpointed: the checkpointed runs must give the gradients of plain ones)
            references[mode] = reference_run(world, 1 if mode == "plain" else 2, False, reference_group)
        check_layout(rank, world, dp, ep, wrapper, mode, references[mode])


def test_gloo_four_ranks_fsdp_and_ddp_match_one_process():
    run_gloo(_all_layouts, 4)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (DCP in one process: as intended)
def test_dcp_resume_world_one():
    """helpers.check_dcp_resume without a process group (mesh None, no wrapper): the model and
    AdamW's state saved, a fresh model continues bit for bit."""
    model = TinyModel(None, "naive")

    def make_fresh():
        fresh = other_weights(TinyModel(None, "naive"))
        return fresh, fresh

    def step_loss(model, step):
        xs, ts = batches(1, 1, step)
        return loss_fn(model(xs[0, 0]), ts[0, 0])

    check_dcp_resume(model, model, "none", None, make_fresh, step_loss, "world 1")


@pytest.mark.parametrize("strategy", ["naive", "sequential"])
def test_checkpointed_layer_gives_the_gradients_of_a_plain_one(strategy):
    """torch.utils.checkpoint (use_reentrant=False) around a layer (balance loss on): the same
    output, input, router and expert gradients as the layer without it, bit for bit."""
    layer = MoELayer(CFG, strategy=strategy, seed=2, device="cpu")
    x = torch.randn(TOKENS, CFG.hidden)
    g = torch.randn(TOKENS, CFG.hidden)
    runs = []
    for checkpointed in (False, True):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        out = checkpoint(layer, xi, use_reentrant=False) if checkpointed else layer(xi)
        out.backward(g)
        runs.append([out.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])
    for got, want in zip(runs[1], runs[0]):
        assert torch.equal(got, want)


def test_balance_loss_gradient_follows_aux_loss_scale():
    """The folded balance loss's gradient is scaled by the layer's aux_loss_scale: half the
    loss's factor, half the router's balance gradient (the old layer ignored the loss's factor)."""
    layer = MoELayer(CFG, strategy="naive", seed=1, device="cpu")
    x = torch.randn(TOKENS, CFG.hidden)
    grads = []
    for scale in (1.0, 0.5):
        layer.zero_grad()
        layer.aux_loss_scale = scale
        (layer(x).sum() * 0).backward()  # only the balance loss reaches the router
        grads.append(layer.router.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    assert rel_err(grads[1], grads[0] * 0.5) < 1e-6
