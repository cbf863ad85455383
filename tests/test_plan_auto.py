"""Strategy "auto" on 2 gloo ranks: picks from the shipped profile (or sequential without one),
and its output and gradients equal the fp64 reference."""

import torch

from helpers import reference_grads, rel_err, run_gloo
from interlace import MoEConfig, MoELayer
from interlace.perf.profile import PACKAGED_DIR

PROFILE = PACKAGED_DIR / "NVIDIA_H200-sm132-w2-n1-p2p.json"
CFG = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32)


def _auto_matches_reference(rank, world, tmp):
    import os
    import warnings

    os.environ["INTERLACE_PROFILE_DIR"] = tmp  # no profile for the CPU machine key here
    g = torch.Generator().manual_seed(5)
    for profile, tokens in ((str(PROFILE), 37), (None, 24)):
        layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu")
        layer.strategy._profile = profile
        xs = [torch.randn(tokens, CFG.hidden, generator=g) for _ in range(world)]
        gs = [torch.randn(tokens, CFG.hidden, generator=g) for _ in range(world)]
        x = xs[rank].clone().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = layer(x)
        out.backward(gs[rank])
        outs, dxs, *_ = reference_grads(CFG, 3, xs, gs)
        assert rel_err(out, outs[rank]) < 2e-6 and rel_err(x.grad, dxs[rank]) < 2e-6
        choice = layer.strategy.choices[tokens]
        if profile is None:
            assert choice == "sequential"
            assert any("auto:" in str(w.message) for w in caught)
        else:
            assert choice == "sequential" or choice.startswith("pipelined:")
            assert layer.strategy.notes[tokens]


def test_auto_on_gloo(tmp_path):
    run_gloo(_auto_matches_reference, 2, str(tmp_path))
