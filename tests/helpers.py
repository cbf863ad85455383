"""Shared test helpers: error norms, fp64 reference runs, gloo process launcher."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import os
import shutil
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from interlace import MoEConfig, reference_moe
from interlace.experts import init_expert_weights
from interlace.routing import Router
from interlace.parallel import release_shared_buffers


def strict_tensor_descriptors() -> None:
    """Make the interpreter refuse tensor descriptors that CUDA refuses: every dimension must
    hold 1 to 2³² elements. Triton's interpreter checks alignment only, and a descriptor with an
    empty dimension ran on the CPU but stopped a GPU with an illegal instruction. Idempotent; the
    gloo workers get it by importing this module."""
    try:
        from triton.runtime.interpreter import TensorDescHandle
    except ImportError:  # a Triton without the interpreter's descriptors: nothing to tighten
        return
    if getattr(TensorDescHandle.validate, "interlace_strict", False):
        return
    loose = TensorDescHandle.validate

    def validate(self):
        loose(self)
        dims = [int(d.data.item()) for d in self.shape]
        assert all(1 <= d <= 2**32 for d in dims), f"tensor descriptor shape {dims}: every dimension must be 1..2^32"

    validate.interlace_strict = True
    TensorDescHandle.validate = validate


strict_tensor_descriptors()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64; NaN anywhere in a gives inf (NaN never passes)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def full_weights(cfg: MoEConfig, seed: int):
    """Router weight (E, N), w_up (E, .., N), w_down (E, N, K) of every expert, as any rank builds them."""
    router = Router(cfg, seed, torch.device("cpu"))
    w_up, w_down = init_expert_weights(cfg, range(cfg.num_experts), seed, torch.device("cpu"))
    return router.weight.detach(), router.expert_bias, w_up, w_down


def reference_grads(cfg, seed, xs, grads, indices=None, aux_coef=0.0):
    """Per-rank fp64 references for tokens ``xs[r]`` with output gradients ``grads[r]``.

    Returns outputs per rank, x-gradients per rank, and the gradients of the router and all
    experts summed over ranks (the loss is Σ_r <grads[r], out_r> + aux_coef Σ_r aux_r).
    """
    rw, bias, wu, wd = full_weights(cfg, seed)
    rw, wu, wd = (t.double().requires_grad_() for t in (rw, wu, wd))
    outs, dxs = [], []
    for r, (x, g) in enumerate(zip(xs, grads)):
        xr = x.detach().double().requires_grad_()
        out, aux = reference_moe(xr, rw, wu, wd, cfg, expert_bias=bias,
                                 expert_indices=None if indices is None else indices[r])
        loss = (out * g.double()).sum() + aux_coef * aux
        loss.backward()
        outs.append(out.detach())
        dxs.append(xr.grad)
    return outs, dxs, rw.grad, wu.grad, wd.grad


def assert_grads_match(layer, x, refs, rank: int, tokens: int, where: str, tol: float) -> None:
    """dx, the router's gradient (summed over ranks: it is replicated) and this rank's expert
    gradients of ``layer`` against ``refs = reference_grads(...)`` (after ``backward``)."""
    _, dxs, drw, dwu, dwd = refs
    if tokens:
        assert rel_err(x.grad, dxs[rank]) < tol, where + " dx"
    router_grad = layer.router.weight.grad.clone()
    if dist.is_initialized():
        dist.all_reduce(router_grad)
    assert rel_err(router_grad, drw) < tol, where + " router grad"
    lo, hi = layer.ep.first_expert, layer.ep.first_expert + layer.ep.num_local
    for got, ref, what in ((layer.experts.w_up.grad, dwu, "w_up"), (layer.experts.w_down.grad, dwd, "w_down")):
        ref = torch.zeros_like(got) if ref is None else ref[lo:hi]
        assert rel_err(got, ref) < tol, f"{where} {what} grad"


def data_parallel_steps(wrapped, opt, wrapper: str, micro: int, micro_loss, ref_losses, where: str, tol: float):
    """Train through a data-parallel wrapper (``wrapper``: "fsdp" or "ddp") for ``len(ref_losses)``
    steps of ``micro`` micro-batches each (each loss ``micro_loss(step, m)`` / micro; DDP without
    gradient sync but on the last, FSDP reducing each time, which sums the same), one optimizer
    step per step; the ranks' mean loss of each step against ``ref_losses[step]``."""
    import contextlib

    for step, ref_loss in enumerate(ref_losses):
        total = torch.zeros(())
        for m in range(micro):
            with wrapped.no_sync() if wrapper == "ddp" and m < micro - 1 else contextlib.nullcontext():
                loss = micro_loss(step, m) / micro
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        assert rel_err(total / dist.get_world_size(), ref_loss) < tol, f"{where}: loss at step {step}"


def check_dcp_resume(model, wrapped, wrapper: str, mesh, make_fresh, step_loss, where: str) -> None:
    """torch.distributed.checkpoint of a parallelized model and AdamW's state (interlace.checkpoint):
    2 AdamW steps, save both, a third step (the parameters after it recorded); a fresh model of the
    same layout, ``make_fresh()`` → (model, wrapper's return; other weights), and a fresh AdamW
    (another lr: the checkpoint's param groups replace it) load the checkpoint: their parameters
    equal the saved ones, and after the same third step the recorded ones, bit for bit.
    ``step_loss(wrapped, step)``: this rank's loss of step ``step`` (fresh data per step).
    ``mesh`` None: one process without a process group.

    DDP: the fresh wrapper first runs one backward (its gradients dropped after the load). DDP
    regroups its gradient buckets after its first backward, which moves the all-reduce's chunks
    and so its summation order (measured: 1 ulp); the trained wrapper's are regrouped already."""
    import torch.distributed.checkpoint as dcp
    from interlace.checkpoint import (expert_sharded_optimizer_state_dict, expert_sharded_state_dict,
                                      load_expert_sharded_optimizer_state_dict)

    def adam_step(wrapped, opt, step):
        step_loss(wrapped, step).backward()
        opt.step()
        opt.zero_grad()

    def params(model):  # (full_tensor: a collective, in the same order on every rank)
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
                for name, p in model.named_parameters()}

    def state_dicts(model, wrapped, opt):
        return {"model": expert_sharded_state_dict(model, mesh),
                "optim": expert_sharded_optimizer_state_dict(wrapped, opt, mesh)}

    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(2):
        adam_step(wrapped, opt, step)
    with shared_tempdir("interlace-dcp-") as path:  # (removed after the round trip)
        dcp.save(state_dicts(model, wrapped, opt), checkpoint_id=path)
        saved = params(model)
        adam_step(wrapped, opt, 2)
        want = params(model)

        fresh, fresh_wrapped = make_fresh()
        if wrapper == "ddp":  # (its gradients stay until after the load: the optimizer's state is made beside them)
            step_loss(fresh_wrapped, 0).backward()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5, weight_decay=0.1)
        state = state_dicts(fresh, fresh_wrapped, fresh_opt)
        dcp.load(state, checkpoint_id=path)
        load_expert_sharded_optimizer_state_dict(fresh_wrapped, fresh_opt, state["optim"])
        fresh_opt.zero_grad()
        got = params(fresh)
        assert list(got) == list(saved), where
        for name, p in got.items():
            assert torch.equal(p, saved[name]), f"{where}: {name} after the checkpoint round trip"
        adam_step(fresh_wrapped, fresh_opt, 2)
        for name, p in params(fresh).items():
            assert torch.equal(p, want[name]), f"{where}: {name} after an AdamW step from the checkpoint"


@contextlib.contextmanager
def shared_tempdir(prefix: str):
    """A temporary directory every rank of the default group (or the one process) sees: rank 0
    makes it and sends its path; on leaving, all ranks meet, then rank 0 removes it (after an error
    at once, without meeting: a failed rank must not leave the others waiting)."""
    distributed = dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    path = [tempfile.mkdtemp(prefix=prefix) if rank0 else None]
    if distributed:
        dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
        if distributed:
            dist.barrier()
    finally:
        if rank0:
            shutil.rmtree(path[0], ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fp8_expected(cfg: MoEConfig, seed: int, x: torch.Tensor) -> torch.Tensor:
    """Σ_j weight[t, j] · ffn_e(x[t]) with every expert's FFN from expert_ffn_fp8_reference on
    quantize_weight of the seeded dense init, routed by the seeded router; fp32 combine. On x's
    device (the seeded weights are those a layer on that kind of device draws)."""
    from interlace.fp8 import BlockFP8Weight, expert_ffn_fp8_reference, quantize_weight

    idx, weight, _ = Router(cfg, seed, x.device)(x, None, fused=True)
    w_up, w_down = init_expert_weights(cfg, range(cfg.num_experts), seed, x.device)
    up, down = quantize_weight(w_up), quantize_weight(w_down)
    out = torch.zeros(x.shape[0], cfg.hidden, device=x.device)
    for e in range(cfg.num_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            pick = lambda w: BlockFP8Weight(w.weight[e:e + 1], w.scale_inv[e:e + 1])  # noqa: E731
            ends = torch.tensor([tok.numel()], device=x.device)
            y = expert_ffn_fp8_reference(x[tok], pick(up), pick(down), ends, cfg.activation)
            out.index_add_(0, tok, y.float() * weight[tok, slot, None].float())
    return out.to(x.dtype)


def _entry(rank, world, port, fn, args, environ):
    # The launching process's environment as it is now (the fork server's is that of its start).
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from interlace import env

    env.refresh()
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180))
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        # Let nothing hold the group past destroy_process_group: the fused strategy's cached
        # buffer did. (A fused:train test process once aborted in CI with "terminate called
        # without an active exception"; where it aborted was not recorded, hence faulthandler.)
        release_shared_buffers()
        gc.collect()
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, where native threads (gloo, the store)
    # are destroyed in no particular order; a failure above still raises and exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; any failure fails the test."""
    mp.set_forkserver_preload(FORK_SERVER_PRELOAD)
    mp.start_processes(_entry, args=(world, free_port(), fn, args, dict(os.environ)), nprocs=world, join=True,
                       start_method="forkserver")


# Tiny transformers MoE models from a config (tests/hf, tests/core/test_compile.py): hidden 32, vocab 64.
HF_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, initializer_range=0.1, output_router_logits=True,
               router_aux_loss_coef=0.02, tie_word_embeddings=False)
# name: (model class, config class, config fields beyond _COMMON). Expert FFN 24, 8 experts, top-2.
HF_FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                       head_dim=8)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",
              dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8,
                       num_experts_per_tok=2)),
    # Layer 0 dense (first_k_dense_replace), layer 1 MoE: 8 experts in 4 groups, 2 groups kept, top-3.
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
                         qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config",
                    dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=2,
                         num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                         first_k_dense_replace=0, routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=24,
                         qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)),
}


# The gloo processes are forked from a fork server that imported these once (the server starts
# at the first launch, a fresh interpreter, and serves every later one of this test process):
# each launch's processes start in well under a second instead of each importing torch, Triton
# and interlace again (several seconds each, 8 processes at once on CI's 2 cores). Every process
# is still new, with its modules as imported; it imports the test's module itself and takes the
# launching process's environment (_entry).
# transformers' models too (tests/hf, test_compile): its modeling_utils alone took a gloo rank ~3.7 s
# to import (a module a transformers release lacks is skipped).
FORK_SERVER_PRELOAD = (["torch", "torch.distributed", "triton", "numpy", "interlace", "helpers", "cases",
                        "transformers.modeling_utils"]
                       + [f"transformers.models.{family}.modeling_{family}" for family in HF_FAMILIES])


def triton_builds(kernel, args, constexprs) -> tuple:
    """What Triton compiles a launch of ``kernel`` for: its constexprs and the specialization of
    each non-tensor argument as its binder computes it (tensors: all 16-byte aligned here)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):  # (under the interpreter: the same function and options)
        kernel = JITFunction(kernel.fn, **kernel.kwargs)
    params = [p for p in kernel.params if not p.is_constexpr]
    spec = tuple(native_specialize_impl(BaseBackend, a, False, not p.do_not_specialize,
                                        not p.do_not_specialize_on_alignment)
                 for p, a in zip(params, args, strict=True) if not isinstance(a, torch.Tensor) and a is not None)
    return tuple(sorted(constexprs.items())), spec
