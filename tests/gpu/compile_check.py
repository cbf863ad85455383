"""GPU check of ``torch.compile(fullgraph=True)``: a stack of MoE layers compiled against eager.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 tests/gpu/compile_check.py [--tokens 4096] [--layers 4]

Per strategy (sequential, fused, fused:train, auto): the model ``x → x + moe_i(norm(x))`` for
``--layers`` layers (Qwen3-30B-A3B's shape, bf16, experts sharded over the ranks) compiled with
``fullgraph=True`` (inductor) and run eagerly on the same weights and inputs:

* a training step (forward + backward of a fixed loss): output and the gradients of the input and
  every parameter compiled vs eager (relative ‖·‖₂, bf16 tolerance ``TOL``);
* the step's median time over ``--iters`` steps, eager and compiled, and a forward under no_grad.

Prints one line per strategy: eager and compiled ms (training step; forward), compiled/eager
ratios, the largest relative difference. Exits non-zero when a difference passes ``TOL``.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from interlace import MoELayer, preset
from interlace.parallel import release_shared_buffers

TOL = 2e-2  # bf16, compiled vs eager (the compiled router takes the plain torch top-k)


class Stack(nn.Module):
    def __init__(self, strategy: str, layers: int, max_tokens: int):
        super().__init__()
        cfg = preset("qwen3-30b-a3b")
        opts = {"max_tokens": max_tokens} if strategy.startswith("fused") else {}
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.hidden, device="cuda", dtype=cfg.dtype) for _ in range(layers))
        self.moes = nn.ModuleList(MoELayer(cfg, strategy=strategy, seed=i, strategy_options=opts)
                                  for i in range(layers))

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if torch.isfinite(a).all() else float("inf")


def step(fn, model, x, grad):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), [x.grad] + [p.grad for p in model.parameters()]


def median_ms(body, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        body()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--strategies", nargs="+", default=["sequential", "fused", "fused:train", "auto"])
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    hidden = preset("qwen3-30b-a3b").hidden
    x = torch.randn(args.tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    grad = torch.randn(args.tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    failed = False
    if rank == 0:
        print(f"{'strategy':<12} {'train eager ms':>14} {'compiled':>9} {'ratio':>6} {'fwd eager ms':>12} "
              f"{'compiled':>9} {'ratio':>6} {'max rel diff':>12}", flush=True)
    for strategy in args.strategies:
        model = Stack(strategy, args.layers, args.tokens)
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(2):  # compile, warm up (fused: the first call per T runs eagerly, the next captures)
            step(compiled, model, x, grad)
            step(model, model, x, grad)
        out_c, grads_c = step(compiled, model, x, grad)
        out_e, grads_e = step(model, model, x, grad)
        worst = max([rel(out_c, out_e)] + [rel(g, r) for g, r in zip(grads_c, grads_e)])
        failed |= worst > TOL
        train = [median_ms(lambda: step(fn, model, x, grad), args.iters) for fn in (model, compiled)]
        with torch.no_grad():
            compiled(x), model(x)
            fwd = [median_ms(lambda: fn(x), args.iters) for fn in (model, compiled)]
        if rank == 0:
            print(f"{strategy:<12} {train[0]:14.2f} {train[1]:9.2f} {train[1] / train[0]:6.2f} {fwd[0]:12.2f} "
                  f"{fwd[1]:9.2f} {fwd[1] / fwd[0]:6.2f} {worst:12.2e}{'  FAIL' if worst > TOL else ''}", flush=True)
        del model, compiled
        torch._dynamo.reset()
    release_shared_buffers()  # before the group goes
    dist.destroy_process_group()
    if rank == 0:
        print("compile check:", "FAILED" if failed else "passed", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
