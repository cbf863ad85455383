"""The expert FFN's grouped GEMMs in Triton, over expert-major rows with the row gather fused.

Modules, from the entry points down:

* :mod:`.autograd` — :class:`~.autograd.TritonExpertFFN`, forward and backward as one autograd Function;
* :mod:`.forward` — :func:`~.forward.expert_ffn_triton` (GEMM0 then GEMM1);
* :mod:`.backward` — d(pre-activation), dW_down, dW_up, dx_rows;
* :mod:`.configs` — :class:`~.configs.ExpertKernelOptions` and the per-call config choice (tables, defaults);
* :mod:`.gemm0`, :mod:`.grouped`, :mod:`.wgrad` — the kernels, each beside its launcher;
* :mod:`.schedule` — the device-built tile schedule and how persistent programs walk it;
* :mod:`.tile` — tile-level building blocks (shared with the fused COMET kernels);
* :mod:`.torch_grouped_mm` — the ``torch._grouped_mm`` path.
"""
