"""What a newcomer on a CPU-only machine runs: ``interlace demo``, every strategy by name, and
Triton's interpreter under any NumPy (the interpreter's scalar loop bounds broke on NumPy 2.4),
with bf16 operands (its dot multiplied their bit patterns) and under any Triton the range allows
(3.9's interpreter rejects the int32 masks its scalar comparisons produce), and the interpreter's
speed-ups (interlace.kernels.interpreter_speed) computing what it did."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from interlace.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]


@triton.jit
def _strided_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # ``n`` is a runtime argument used as a loop bound: the interpreter turns it into a Python
    # int through ``tensor.__index__`` (what failed under NumPy 2.4).
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0))


def test_interpreter_runtime_loop_bound_under_any_numpy():
    """NumPy 2.4 raises where 1.25–2.3 warn: with the warning made an error, this test sees 2.4's
    behaviour under any NumPy, and the kernel must still run (interlace.kernels.interpreter_compat)."""
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, as tests/conftest.py sets)")
    from interlace.kernels import interpreter_compat

    x = torch.arange(37, dtype=torch.float32)
    out = torch.empty(1, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Conversion of an array with ndim > 0", category=DeprecationWarning)
        _strided_sum_kernel[(1,)](x, out, x.numel(), BLOCK=8)
    assert out.item() == x.sum().item()
    assert interpreter_compat.patch_interpreter()  # in place, and idempotent


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b, tl.zeros((M, N), dtype=tl.float32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_interpreter_dot_of_bf16_operands(dtype):
    """The interpreter holds bf16 as uint16 bit patterns and its dot multiplied the patterns as
    integers (~1e10 where 1 is right): every bf16 GEMM under the interpreter was wrong. Products
    of bf16 or fp16 values are exact in fp32, so the dot must match an fp64 matmul closely."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, as tests/conftest.py sets)")
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 32, generator=gen).to(dtype), torch.randn(32, 16, generator=gen).to(dtype)
    out = torch.full((16, 16), float("nan"))
    _dot_kernel[(1,)](a, b, out, M=16, N=16, K=32)
    ref = a.double() @ b.double()
    assert (out.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@triton.jit
def _first_program_stores_kernel(out_ptr, n, BLOCK: tl.constexpr):
    # As the plan kernel's tables: a block mask and-ed with a scalar comparison. The interpreter
    # holds ``first`` with its operand's int32 type, so the mask reaches load and store as int32.
    first = tl.program_id(0) == 0
    offs = tl.arange(0, BLOCK)
    old = tl.load(out_ptr + offs, mask=(offs < n) & first, other=0)
    tl.store(out_ptr + offs, old + offs, mask=(offs < n) & first)
    tl.atomic_add(out_ptr + BLOCK + offs, 1, mask=(offs < n) & first)


def test_interpreter_mask_from_a_scalar_comparison():
    """Triton 3.9's interpreter raised ``ValueError('mask has unsupported dtype')`` on such a mask
    (every fused call's plan kernel); interlace.kernels.interpreter_compat hands it over as bools."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, as tests/conftest.py sets)")
    out = torch.full((16,), 10, dtype=torch.int32)
    _first_program_stores_kernel[(2,)](out, 5, BLOCK=8)
    assert out.tolist() == [10, 11, 12, 13, 14, 10, 10, 10] + [11] * 5 + [10] * 3


@triton.jit
def _scaled_add(acc, x, k):
    return acc + x * k


@triton.jit
def _nested_helpers_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, CALLS: tl.constexpr):
    # CALLS calls of a helper of this module, and tl.zeros (a standard-library @jit helper whose
    # module names triton.language.core, which this module does not).
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(CALLS):
        acc = _scaled_add(acc, x, k + 1)
    tl.store(out_ptr + offs, acc)


def test_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """interlace.kernels.interpreter_speed: a launch patches triton.language for the interpreter
    once, and a nested helper's call only the modules the launch has not patched yet (it patched
    all of them again at every call: a third of a fused gloo test's time). The kernel computes what
    it did, the launch restores triton.language's builtins, and a launch that fails leaves the next
    one patching as a launch does."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, as tests/conftest.py sets)")
    from triton.runtime import interpreter

    from interlace.kernels import interpreter_speed

    assert interpreter_speed.speed_up_interpreter()["one_patch_per_launch"]
    patched = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: patched.append(pkg) or original(pkg, *a))
    x = torch.randn(16, generator=torch.Generator().manual_seed(0))
    counts = {}
    _nested_helpers_kernel[(1,)](x, torch.empty(16), BLOCK=16, CALLS=1)  # (the first launch patches less)
    for calls in (1, 6):
        patched.clear()
        out = torch.full((16,), float("nan"))
        _nested_helpers_kernel[(2,)](x, out, BLOCK=16, CALLS=calls)
        torch.testing.assert_close(out, x * sum(range(1, calls + 1)), rtol=1e-6, atol=0)
        counts[calls] = len(patched)
        assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.arange), "the launch's patches undone"
    # tl (the module, its tensor, math and descriptor classes) at the launch, and tl.zeros's
    # modules (tl.core and tl) at its first call; the helper's calls add nothing (4 each before).
    assert counts[1] == counts[6] <= 11, counts
    with pytest.raises(Exception):
        _nested_helpers_kernel[(1,)](x, 1.5, BLOCK=16, CALLS=2)  # (a float for out_ptr: it fails mid-launch)
    patched.clear()
    _nested_helpers_kernel[(1,)](x, out, BLOCK=16, CALLS=2)
    assert 4 <= len(patched) <= 11 and tl.core.is_builtin(tl.load)
    torch.testing.assert_close(out, x * 3, rtol=1e-6, atol=0)


def test_interpreter_tuple_type_names_and_numpy_dtypes():
    """The other two speed-ups compute what Triton did: a tuple type's name (built on demand, as
    Triton 3.9 does) and the NumPy dtype the interpreter holds each Triton dtype in."""
    import numpy as np
    from triton.runtime import interpreter

    from interlace.kernels import interpreter_speed

    installed = interpreter_speed.speed_up_interpreter()
    ty = tl.core.tuple_type([tl.int32, tl.float32], ["a", "b"])
    if installed["lazy_tuple_type_names"]:  # (Triton 3.6's format; 3.9 names its own way)
        assert ty.name == str(ty) == "[a:int32,b:fp32]"
        assert tl.core.tuple_type([tl.int64]).name == "[:int64]"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    want = {tl.int1: np.bool_, tl.float16: np.float16, tl.float32: np.float32, tl.float64: np.float64,
            tl.int8: np.int8, tl.uint8: np.uint8, tl.int16: np.int16, tl.uint16: np.uint16, tl.int32: np.int32,
            tl.uint32: np.uint32, tl.int64: np.int64, tl.uint64: np.uint64, tl.bfloat16: np.uint16,
            tl.float8e5: np.uint8, tl.float8e4nv: np.uint8}
    for _ in range(2):  # (the second time from the table)
        for tt, np_type in want.items():
            assert interpreter._get_np_dtype(tt) == np.dtype(np_type), tt
            assert interpreter._get_np_dtype(tl.block_type(tt, [4, 2])) == np.dtype(np_type), tt
        assert interpreter._get_np_dtype(tl.pointer_type(tl.bfloat16)) == np.dtype(np.uint64)
        assert interpreter._get_np_dtype(tl.block_type(tl.pointer_type(tl.float32), [8])) == np.dtype(np.uint64)


def test_persistent_bf16_layer_on_the_interpreter():
    """The persistent kernel's GEMMs in bf16 under the interpreter (the CPU demo's path with a
    bf16 model) against sequential's, within bf16 rounding."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, as tests/conftest.py sets)")
    from interlace import MoEConfig, MoELayer

    cfg = MoEConfig(hidden=64, ffn=48, num_experts=4, top_k=2, dtype=torch.bfloat16)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.inference_mode():
        out = MoELayer(cfg, strategy="persistent", seed=3)(x).float()
        ref = MoELayer(cfg, strategy="sequential", seed=3)(x).float()
    assert (out - ref).abs().max().item() <= 3e-2 * ref.abs().max().item()


def test_cpu_demo_runs(capsys, monkeypatch):
    """``interlace demo``'s CPU path (2 gloo ranks, the interpreter): a training call of
    ``sequential`` (its routing index runs Triton kernels with runtime loop bounds), an
    inference call of ``persistent`` (the kernel's staged transport) and a ``tp_ep`` form on the
    TP = 2 mesh, each against the reference; the demo names what it checks first."""
    from interlace.tools import demo

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert demo.main(["--cpu", "--strategies", "sequential", "persistent", "tp_ep:O1"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks (gloo processes" in out and "Triton's CPU interpreter" in out
    assert "Checks 3 strategies: sequential, persistent, tp_ep:O1." in out
    assert "all strategies agree with the reference (3 checked;" in out
    assert out.count("| sequential | training |") == 2  # one row per rank
    assert out.count("| persistent | inference |") == 2 and out.count("| tp_ep:O1 | training |") == 2


def test_cpu_demo_checks_every_strategy_the_readme_names():
    """The CPU demo's default list covers each name of the README's strategy table (``pipelined``
    as ``pipelined:3``, so that its chunks run; ``tp_ep:O0`` … ``tp_ep:O3`` as the four forms)."""
    from interlace.tools import demo

    table = (ROOT / "README.md").read_text().split("## Strategies", 1)[1].split("\n\n")[2]
    names = [cell.strip() for line in table.splitlines()[2:] for cell in [line.split("|")[1]]]
    assert len(names) == 11, names
    checked = {s.split(":")[0] if s.startswith("pipelined") else s for s in demo.CPU_STRATEGIES}
    for name in names:
        specs = [w.strip("`") for w in name.split() if w.startswith("`")]
        forms = ["tp_ep:O0", "tp_ep:O1", "tp_ep:O2", "tp_ep:O3"] if specs[0] == "tp_ep:O0" else specs[:1]
        assert set(forms) <= checked, (name, sorted(checked))


def test_the_readme_cpu_quick_start_runs_as_pasted(tmp_path):
    """The README's CPU quick start, the shell block that writes moe_cpu.py and runs it on 2 gloo
    ranks under torchrun, run as it stands (interlace from this checkout)."""
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    readme = (ROOT / "README.md").read_text()
    start = readme.index("cat > moe_cpu.py")
    script = readme[start:readme.index("```", start)]
    assert script.rstrip().endswith("TRITON_INTERPRET=1 torchrun --nproc-per-node 2 moe_cpu.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: y (16, 64), experts {4 * rank}–{4 * rank + 3}," in proc.stdout, proc.stdout


# Each spelling that picks a different code path on a single process.
SPECS = sorted(STRATEGIES) + ["sequential:triton", "pipelined:2", "fused:train", "fused:recompute", "tp_ep:O0"]

_PROBE = r"""
import json, sys
import torch
from interlace import MoEConfig, MoELayer

cfg = MoEConfig(hidden=16, ffn=8, num_experts=4, top_k=2, dtype=torch.float32)
for spec in sys.argv[1:]:
    try:
        layer = MoELayer(cfg, strategy=spec, device="cpu")
        x = torch.randn(5, 16, requires_grad=True)
        layer(x).sum().backward()
        with torch.no_grad():
            layer.eval()(x)
        result = {"spec": spec, "ran": True}
    except Exception as exc:
        result = {"spec": spec, "ran": False, "type": type(exc).__name__, "message": str(exc)}
    print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def strategies_without_interpreter():
    """Every spec built and called once on the CPU in a process without Triton's interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _PROBE, *SPECS], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["spec"]] = r
    assert len(results) == len(SPECS), proc.stdout[-2000:] + proc.stderr[-4000:]
    return results


@pytest.mark.parametrize("spec", SPECS)
def test_every_strategy_runs_or_says_what_it_needs_on_cpu(spec, strategies_without_interpreter):
    r = strategies_without_interpreter[spec]
    if r["ran"]:
        return
    msg = r["message"]
    assert r["type"] == "ValueError", r
    assert "\n" not in msg.strip() and "active drivers" not in msg, msg
    assert repr(spec.partition(":")[0]) in msg or repr(spec) in msg, f"the message should name the strategy: {msg}"
