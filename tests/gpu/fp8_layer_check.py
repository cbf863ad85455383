"""FP8 experts through the public API on one GPU: MoELayer(expert_quant="fp8").

    python tests/gpu/fp8_layer_check.py

Per shape (mixtral-8x7b-like: 4 experts of 4096 × 14336, top-2; qwen3-30b-a3b-like: 16 experts
of 2048 × 768, top-8), bf16 activations, 128 and 4096 tokens:

* the layer (``sequential``, its FP8 backend on ``auto``: the Triton kernels at 128 tokens,
  cuBLAS's blockwise GEMMs where they pay) on forced experts against ``interlace.reference_moe``
  with its FP8 weights (the W8A8 arithmetic in fp32): relative Frobenius error < 3e-2
  (tests/gpu/fp8_check.py says why: Hopper's FP8 accumulation and the activation's e4m3 step);
* each FP8 backend ("triton", "blockwise" where it runs) against the reference the same way,
  and repeatable bitwise;
* ``persistent`` (W8A16: the weights dequantized in its GEMM tasks) against a dense layer holding
  the dequantized weights: relative Frobenius error < 3e-2 (bf16 rounding only), repeatable;
* ``auto``, once it has decided (``persistent`` or ``sequential`` at world size 1), equal bitwise
  to the strategy it chose; ``quantize_experts`` of the dense twin equal bitwise to the layer
  built FP8; a call with gradients raising the inference-only error;
* a CUDA graph of decode calls (128 tokens, ``fp8_backend="triton"``) captured once and replayed
  on new inputs equal bitwise to eager calls.

Prints one line per check and ``N PASS, M FAIL``; exits 1 on a failure. ``--smoke``: tiny shapes
on the CPU under TRITON_INTERPRET=1 (no graph), to check the script itself.
"""

import sys

import torch

from interlace import MoEConfig, MoELayer, quantize_experts, reference_moe
from interlace.fp8 import BlockFP8Weight

results = []


def report(name: str, ok: bool, detail: str = "") -> None:
    results.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


SHAPES = {
    "mixtral-like": MoEConfig(hidden=4096, ffn=14336, num_experts=4, top_k=2),
    "qwen3-like": MoEConfig(hidden=2048, ffn=768, num_experts=16, top_k=8, renormalize=True),
}


def expected(layer: MoELayer, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """reference_moe of the layer's own router and FP8 experts on the forced experts ``idx``."""
    ex = layer.experts
    out, _ = reference_moe(x, layer.router.weight, BlockFP8Weight(ex.w_up, ex.w_up_scale_inv),
                           BlockFP8Weight(ex.w_down, ex.w_down_scale_inv), layer.config, expert_indices=idx,
                           compute_dtype=torch.float32)
    return out


def dequantized(layer: MoELayer, dense_cfg: MoEConfig, dev) -> MoELayer:
    """A dense ``sequential`` layer with ``layer``'s router and its FP8 experts dequantized."""
    twin = MoELayer(dense_cfg, seed=5, device=dev, strategy="sequential")
    with torch.no_grad():
        twin.router.weight.copy_(layer.router.weight)
        for w in ("w_up", "w_down"):
            q = BlockFP8Weight(getattr(layer.experts, w), getattr(layer.experts, w + "_scale_inv"))
            getattr(twin.experts, w).copy_(q.dequantize(dense_cfg.dtype))
    return twin


def main() -> int:
    smoke = "--smoke" in sys.argv
    dev = torch.device("cpu" if smoke else "cuda")
    shapes = {"tiny": MoEConfig(hidden=256, ffn=512, num_experts=4, top_k=2)} if smoke else SHAPES
    torch.manual_seed(0)
    for name, dense_cfg in shapes.items():
        cfg = dense_cfg.with_(expert_quant="fp8")
        layers = {spec: MoELayer(cfg, seed=5, device=dev, strategy="sequential", strategy_options={"fp8_backend": spec})
                  for spec in ("auto", "triton")}
        if cfg.hidden % 512 == 0 and cfg.ffn % 512 == 0 and not smoke:
            layers["blockwise"] = MoELayer(cfg, seed=5, device=dev, strategy="sequential",
                                           strategy_options={"fp8_backend": "blockwise"})
        with torch.inference_mode():
            for T in ((16,) if smoke else (128, 4096)):
                x = torch.randn(T, cfg.hidden, device=dev).bfloat16()
                idx = torch.rand(T, cfg.num_experts, device=dev).argsort(dim=1)[:, :cfg.top_k].int()
                want = expected(layers["auto"], x, idx)
                for spec, layer in layers.items():
                    y = layer(x, expert_indices=idx)
                    err = rel(y, want)
                    again = layer(x, expert_indices=idx)
                    report(f"{name} T={T} fp8_backend={spec}", err < 3e-2 and torch.equal(y, again),
                           f"rel {err:.1e} (< 3e-2), repeatable {torch.equal(y, again)}")
                persistent = MoELayer(cfg, seed=5, device=dev, strategy="persistent")
                deq = dequantized(persistent, dense_cfg, dev)
                y, want_deq = persistent(x), deq(x)
                err = rel(y, want_deq)
                again = persistent(x)
                report(f"{name} T={T} persistent (W8A16) vs dequantized dense", err < 3e-2 and torch.equal(y, again),
                       f"rel {err:.1e} (< 3e-2), repeatable {torch.equal(y, again)}")
                auto = MoELayer(cfg, seed=5, device=dev, strategy="auto")
                for _ in range(12):  # calibration: a few calls per candidate
                    auto(x)
                choice = auto.strategy.choice_for(T)
                spec = choice.spec if choice is not None else "undecided"
                chosen = {"persistent": persistent, "sequential": layers["auto"]}.get(spec)
                report(f"{name} T={T} auto ({spec}) == {spec}", chosen is not None and torch.equal(auto(x), chosen(x)))
                del persistent, deq
                twin = MoELayer(dense_cfg, seed=5, device=dev, strategy="sequential")
                quantize_experts(twin)
                report(f"{name} T={T} quantize_experts(dense) == built FP8", torch.equal(twin(x), layers["auto"](x)))
                del auto, twin
        x = torch.randn(8, cfg.hidden, device=dev).bfloat16().requires_grad_()
        try:
            layers["auto"](x)
            report(f"{name} training call raises", False, "no error")
        except RuntimeError as e:
            report(f"{name} training call raises", "inference-only" in str(e), str(e)[:80])
        if smoke:
            continue
        # a captured decode step: 3 calls of one layer in a CUDA graph, replayed on new inputs
        layer = layers["triton"]
        static = torch.randn(128, cfg.hidden, device=dev).bfloat16()
        with torch.inference_mode():
            for _ in range(2):  # warm-up: compiles, allocations
                layer(layer(static))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(layer(layer(static)))
            ok = True
            for _ in range(3):
                static.copy_(torch.randn_like(static))
                graph.replay()
                eager = layer(layer(layer(static)))
                ok = ok and torch.equal(out, eager)
        report(f"{name} CUDA graph of 3 decode calls replays == eager", ok)
        del layers, layer, graph
        torch.cuda.empty_cache()
    passed = sum(results)
    print(f"{passed} PASS, {len(results) - passed} FAIL")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
