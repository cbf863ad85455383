"""Bad input fails early with a clear ValueError/TypeError (before any kernel runs)."""

import pytest
import torch

from interlace import MoEConfig, MoELayer

BASE = dict(hidden=16, ffn=8, num_experts=4, top_k=2, dtype=torch.float32)


@pytest.mark.parametrize(
    "changes,error,match",
    [
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=5), ValueError, "top_k"),
        (dict(activation="swish"), ValueError, "activation"),
        (dict(router="hash"), ValueError, "router"),
        (dict(dtype=torch.int8), TypeError, "dtype"),
        (dict(router_dtype=torch.bfloat16), TypeError, "router_dtype"),
        (dict(router_gemm="fp8"), ValueError, "router_gemm"),
        (dict(capacity_factor=0.0), ValueError, "capacity_factor"),
        (dict(capacity_factor=-1.5), ValueError, "capacity_factor"),
        (dict(capacity_factor=float("nan")), ValueError, "capacity_factor"),
        (dict(hidden=0), ValueError, "positive"),
        (dict(num_experts=2.5), TypeError, "num_experts"),
        (dict(route_scale=0.0), ValueError, "route_scale"),
        (dict(aux_loss_coef=-1.0), ValueError, "aux_loss_coef"),
        (dict(dtype="float33"), TypeError, r"unsupported dtype 'float33'; choose one of \(torch.bfloat16"),
        (dict(dtype="Tensor"), TypeError, "unsupported dtype 'Tensor'"),
        (dict(router_dtype="bfloat16"), TypeError, "unsupported router_dtype torch.bfloat16"),
    ],
)
def test_bad_config(changes, error, match):
    with pytest.raises(error, match=match):
        MoEConfig(**{**BASE, **changes})


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("torch.float16", torch.float16),
                                         ("bfloat16", torch.bfloat16), ("float64", torch.float64)])
def test_dtype_by_name(name, dtype):
    """A dtype's name (what a config file or a command line holds) is taken as the dtype itself."""
    cfg = MoEConfig(**{**BASE, "dtype": name})
    assert cfg.dtype is dtype and cfg == MoEConfig(**{**BASE, "dtype": dtype})
    assert MoEConfig(**{**BASE, "router_dtype": "torch.float64"}).router_dtype is torch.float64


def test_bad_inputs():
    layer = MoELayer(MoEConfig(**BASE), device="cpu")
    with pytest.raises(ValueError, match="hidden"):
        layer(torch.randn(3, 17))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="is on meta"):
        layer(torch.randn(3, 16, device="meta"))
    with pytest.raises(TypeError, match="tensor"):
        layer([[0.0] * 16])
    with pytest.raises(ValueError, match="shape"):
        layer(torch.randn(3, 16), expert_indices=torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="int32 or int64"):
        layer(torch.randn(3, 16), expert_indices=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="out of range"):
        layer(torch.randn(3, 16), expert_indices=torch.full((3, 2), 4, dtype=torch.long))
    with torch.inference_mode():  # inference tensors (no version counter) are checked every call
        bad = torch.full((3, 2), 4, dtype=torch.long)
        for _ in range(2):
            with pytest.raises(ValueError, match="out of range"):
                layer(torch.randn(3, 16), expert_indices=bad)
        good = torch.tensor([[0, 1]] * 3)
        assert layer(torch.randn(3, 16), expert_indices=good).shape == (3, 16)


def test_bad_expert_indices_name_the_row():
    layer = MoELayer(MoEConfig(**BASE), device="cpu")
    x = torch.randn(3, 16)
    good = torch.tensor([[0, 1], [2, 3], [3, 0]])
    layer(x, expert_indices=good)
    layer(x, expert_indices=good.int())
    with pytest.raises(ValueError, match=r"row 1 is \[2, 2\].*twice"):
        layer(x, expert_indices=torch.tensor([[0, 1], [2, 2], [3, 0]]))
    with pytest.raises(ValueError, match=r"row 2 is \[-1, 0\].*out of range"):
        layer(x, expert_indices=torch.tensor([[0, 1], [2, 3], [-1, 0]]))
    with pytest.raises(ValueError, match=r"row 0 is \[1, 4\].*out of range"):
        layer(x, expert_indices=torch.tensor([[1, 4], [2, 3], [3, 0]], dtype=torch.int32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda():
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(ValueError, match=r"device cuda.*CUDA is not available"):
            MoELayer(MoEConfig(**BASE), device=device)
    with pytest.raises(ValueError, match="not a torch device"):
        MoELayer(MoEConfig(**BASE), device="gpu0")


def test_strategy_check_runtime_runs_before_any_weight():
    """MoELayer asks the strategy class (Strategy.check_runtime) with the device and the parsed
    options before it builds anything, and passes its ValueError through."""
    from interlace.strategies.base import STRATEGIES, Strategy, register_strategy

    seen = []

    class NeedsSomething(Strategy):
        name = "test_needs_something"

        def __init__(self, config, ep, level: int = 0):
            super().__init__(config, ep)
            self.level = level

        @classmethod
        def parse_arg(cls, arg):
            return {"level": int(arg)}

        @classmethod
        def check_runtime(cls, spec, device, **options):
            seen.append((spec, device, options))
            if options.get("level", 0) > 1:
                raise ValueError(f"strategy {spec!r} needs a level-{options['level']} machine")

    register_strategy(NeedsSomething)
    try:
        layer = MoELayer(MoEConfig(**BASE), strategy="test_needs_something:1", device="cpu")
        assert seen == [("test_needs_something:1", torch.device("cpu"), {"level": 1})]
        with pytest.raises(ValueError, match="needs a level-2 machine"):
            MoELayer(MoEConfig(**BASE), strategy="test_needs_something:2", device="cpu")
        with pytest.raises(ValueError, match="needs a level-3 machine"):
            layer.set_strategy("test_needs_something", level=3)
        assert seen[-1] == ("test_needs_something", torch.device("cpu"), {"level": 3})
    finally:
        del STRATEGIES[NeedsSomething.name]


def test_needs_triton_default_check():
    from interlace.strategies.base import Strategy, require_triton, triton_runs_on

    assert triton_runs_on("cuda")
    assert not triton_runs_on("meta")
    with pytest.raises(ValueError, match=r"strategy 'x:y' runs Triton kernels.*TRITON_INTERPRET=1.*meta"):
        require_triton("x:y", "meta")

    class TritonOnly(Strategy):
        name = "test_triton_only"
        needs_triton = True

    with pytest.raises(ValueError, match="'test_triton_only' runs Triton kernels"):
        TritonOnly.check_runtime("test_triton_only", torch.device("meta"))
    Strategy.check_runtime("naive", torch.device("meta"))  # the default needs nothing


def test_bad_strategy_and_options():
    cfg = MoEConfig(**BASE)
    with pytest.raises(ValueError, match="unknown strategy"):
        MoELayer(cfg, strategy="fancy", device="cpu")
    with pytest.raises(TypeError, match="takes no options"):
        MoELayer(cfg, strategy="naive", strategy_options={"degree": 2}, device="cpu")
    with pytest.raises(ValueError, match="expert_backend"):
        MoELayer(cfg, strategy="sequential:cutlass", device="cpu")
    with pytest.raises(ValueError, match="degree"):
        MoELayer(cfg, strategy="pipelined", strategy_options={"degree": 0}, device="cpu")
    with pytest.raises(TypeError, match="MoEConfig"):
        MoELayer(dict(BASE), device="cpu")
    with pytest.raises(TypeError, match="strategy must be a name"):
        MoELayer(cfg, strategy=None, device="cpu")


def test_misspelt_strategy_or_option_names_the_closest_and_the_valid_ones():
    """An unknown strategy or option (whether the strategy takes keyword parameters or the fields
    of an options dataclass) is named with the closest valid name and the full list."""
    cfg = MoEConfig(**BASE)
    with pytest.raises(ValueError, match=r"unknown strategy 'fusd' \(did you mean 'fused'\?\); available: auto, "):
        MoELayer(cfg, strategy="fusd", device="cpu")
    with pytest.raises(ValueError, match=r"^strategy 'pipelined': unknown option 'degre' \(did you mean 'degree'\?\); "
                                         r"valid: degree, profile, max_degree$"):
        MoELayer(cfg, strategy="pipelined", strategy_options={"degre": 4}, device="cpu")
    layer = MoELayer(cfg, strategy="naive", device="cpu")
    with pytest.raises(ValueError, match=r"^strategy 'fused': unknown option 'max_token' \(did you mean 'max_tokens'"
                                         r"\?\); valid: max_tokens, n_comm, .*, tma, options$"):
        layer.set_strategy("fused", max_token=5)
    with pytest.raises(ValueError, match=r"unknown options 'kernal' \(did you mean 'kernel'\?\), 'zzz'; valid: "):
        layer.set_strategy("persistent", kernal=None, zzz=1)
    with pytest.raises(ValueError, match=r"unknown option 'chunk' \(did you mean 'chunks'\?\); valid: mesh, form, "):
        layer.set_strategy("tp_ep", chunk=2)
    with pytest.raises(ValueError, match=r"'max_degre' \(did you mean 'max_degree'\?\); valid: profile, max_degree,"):
        layer.set_strategy("auto", max_degre=3)
    with pytest.raises(ValueError, match=r"fused strategy options: unknown field 'n_com' \(did you mean 'n_comm'\?\)"):
        layer.set_strategy("fused", options={"n_com": 2})  # the fields of an options dict, too


@pytest.mark.parametrize(
    "kernel,match",
    [
        ({"copy_cols": 500}, "copy_cols must be a power of two"),
        ({"block_t": 0}, "block_t must be a power of two"),
        ({"defer_count": 2}, "defer_count is a switch"),
        ({"gather0": 2}, "gather0 is -1"),
        ({"slice_group": -1}, "slice_group"),
        ({"no_such_field": 1}, "unknown field"),
    ],
)
def test_bad_fused_kernel_config_names_the_field(kernel, match):
    """The fused kernel options (``strategy_options={"kernel": {...}}``) are checked when the
    options are built, before any kernel is compiled: the field is named (Triton's own errors for
    these come at compile time, on a GPU)."""
    from interlace.strategies.fused import FusedOptions
    from interlace.strategies.fused.options import GPU_CONFIG

    with pytest.raises(ValueError, match=match):
        FusedOptions(kernel=kernel).kernel_for(GPU_CONFIG)
    accepted = FusedOptions(kernel={"copy_cols": 256, "block_t": 64}).kernel_for(GPU_CONFIG)
    assert (accepted.copy_cols, accepted.block_t) == (256, 64)  # within the limits: accepted


def test_forced_indices_values_are_checked_once_per_tensor_version():
    """A caller that passes the same ``expert_indices`` tensor call after call (the bench) pays the
    value check's host read once; a fresh tensor, or the same one modified in place, is checked again."""
    cfg = MoEConfig(hidden=16, ffn=8, num_experts=4, top_k=2, dtype=torch.float32)
    layer = MoELayer(cfg, strategy="naive", device="cpu")
    x = torch.randn(3, 16)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])
    layer(x, expert_indices=idx)
    idx[1, 1] = 2  # in place: a repeated expert in row 1
    with pytest.raises(ValueError, match="row 1 .* names an expert twice"):
        layer(x, expert_indices=idx)
    with pytest.raises(ValueError, match="out of range"):
        layer(x, expert_indices=torch.tensor([[0, 1], [2, 3], [1, 4]]))
    with pytest.raises(ValueError, match="shape"):  # the shape is checked on every call
        layer(x[:2], expert_indices=torch.tensor([[0, 1], [2, 3], [1, 2]]))
