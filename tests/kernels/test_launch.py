"""The cached launch path (interlace.kernels.launch): its key is never coarser than Triton's own
specialization, and it refuses the calls its key cannot describe."""

import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from interlace.kernels import launch as fast
from interlace import env


def triton_specialization(a):
    """Triton's (type, attribute) of a non-constexpr argument, as its binder computes it."""
    return native_specialize_impl(BaseBackend, a, False, True, True)


def sample_arguments():
    ints = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31),
            -(2**31) - 16, -(2**31) - 1, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16]
    base = {dt: torch.zeros(256, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int32, torch.int64)}
    tensors = [t[off:] for t in base.values() for off in (0, 1, 2, 4, 8, 16)]
    mat = torch.zeros(64, 128, dtype=torch.bfloat16)
    descs = [TensorDescriptor.from_tensor(mat, [16, 32]), TensorDescriptor.from_tensor(mat, [32, 32]),
             TensorDescriptor.from_tensor(mat, [16, 32], padding="nan"),
             TensorDescriptor.from_tensor(mat.float(), [16, 32]),
             TensorDescriptor(mat, [64, 64], [128, 1], [16, 32])]
    return ints + tensors + descs + [True, False, None, 0.5, 3.0, torch.nn.Parameter(base[torch.float32][4:])]


def test_key_is_never_coarser_than_triton_specialization():
    args = sample_arguments()
    keys = [fast.args_key((a,)) for a in args]
    specs = [triton_specialization(a) for a in args]
    pairs = 0
    for (ka, sa, a), (kb, sb, b) in itertools.combinations(zip(keys, specs, args), 2):
        if ka == kb:
            pairs += 1
            assert sa == sb, f"{a!r} and {b!r} share a launch key but Triton specializes them as {sa} and {sb}"
    assert pairs > 20  # the sample has classes with several members, so the check compared something


def test_unknown_argument_types_are_refused():
    with pytest.raises(fast._Unkeyed):
        fast.args_key(([1, 2],))
    with pytest.raises(fast._Unkeyed):
        fast.args_key((torch.float32,))


def _probe(x_ptr, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def test_tail_refuses_calls_the_key_cannot_describe():
    kernel = JITFunction(_probe)
    x = torch.zeros(4)
    assert fast._tail(kernel, 2, {"BLOCK": 16, "num_warps": 4}) == (("BLOCK", "FLAG"), {"FLAG": False})
    assert fast._tail(kernel, 2, {"BLOCK": 16, "FLAG": True}) == (("BLOCK", "FLAG"), None)
    with pytest.raises(fast._Unkeyed, match="by position"):
        fast._tail(kernel, 3, {})  # BLOCK passed positionally: Triton specializes on its exact value
    with pytest.raises(fast._Unkeyed, match="keyword n"):
        fast._tail(kernel, 1, {"n": 4, "BLOCK": 16})  # a runtime int by name would be keyed by value
    with pytest.raises(fast._Unkeyed, match="missing"):
        fast._tail(kernel, 2, {})
    del x


def test_interpreter_takes_the_jit_path(monkeypatch):
    fast.reset()
    assert not fast.enabled()  # TRITON_INTERPRET=1 in the tests

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.arange(8, dtype=torch.float32)
    fast.launch(add_one, (1,), x, 8, BLOCK=8)
    assert torch.equal(x, torch.arange(1, 9, dtype=torch.float32))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("INTERLACE_FAST_LAUNCH", "0")
    env.refresh()
    fast.reset()
    assert not fast.enabled()
    fast.reset()


def test_host_integer_helpers_match_triton():
    for a in list(range(0, 600)) + [2**31 - 1, 2**31, 2**40 + 3]:
        for b in (1, 2, 3, 7, 16, 64, 128, 1000):
            assert fast.cdiv(a, b) == triton.cdiv(a, b)
        assert fast.next_power_of_2(a) == triton.next_power_of_2(a), a


def test_a_profiler_hook_sends_launches_down_the_jit_path():
    from triton import knobs

    def hook(metadata):
        pass

    assert not fast._hooked()  # Triton's empty hook chains are not hooks
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert fast._hooked()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not fast._hooked()


def test_cached_path_launches_with_the_jit_paths_arguments(monkeypatch):
    """The hit path, on the CPU with a stand-in for the GPU pieces: the first call of a key takes
    kernel[grid](...), later calls of the same key call the compiled kernel's launcher with the
    grid, the stream, the positional arguments and the constexprs in the kernel's order (defaults
    filled in), and a change in what Triton specializes on is a new key."""
    real = JITFunction(_probe)
    launched, jit_calls = [], []

    class Compiled:
        function, packed_metadata = "handle", "metadata"

        def run(self, *a):
            launched.append(a)

    compiled = Compiled()

    class Kernel:  # the JITFunction's parameters, a recording JIT path
        params = real.params

        def __getitem__(self, grid):
            def jit(*args, **kwargs):
                jit_calls.append((grid, args, kwargs))
                return compiled
            return jit

    kernel = Kernel()
    fast.reset()
    monkeypatch.setattr(fast, "_ENABLED", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    x = torch.zeros(64)
    fast.launch(kernel, (3,), x, 32, BLOCK=16, num_warps=4)
    assert len(jit_calls) == 1 and not launched
    fast.launch(kernel, (3, 2), x, 48, BLOCK=16, num_warps=4)  # 48: same class as 32 (a multiple of 16)
    assert len(jit_calls) == 1
    assert launched == [(3, 2, 1, 1234, "handle", "metadata", None, None, None, x, 48, 16, False)]
    fast.launch(kernel, (3,), x, 17, BLOCK=16, num_warps=4)  # 17: not a multiple of 16, a new key
    fast.launch(kernel, (3,), x[1:], 32, BLOCK=16, num_warps=4)  # misaligned base, a new key
    fast.launch(kernel, (3,), x, 32, BLOCK=32, num_warps=4)  # another constexpr, a new key
    assert len(jit_calls) == 4 and len(launched) == 1
    fast.launch(kernel, (3,), x, 32, BLOCK=16, FLAG=True, num_warps=4)  # FLAG given: a new key, then a hit
    fast.launch(kernel, (3,), x, 64, BLOCK=16, FLAG=True, num_warps=4)
    assert launched[-1][-4:] == (x, 64, 16, True)
    fast.reset()


def test_direct_launcher_calls_the_cached_kernel(monkeypatch):
    """direct_launcher after a launch: the compiled kernel's launcher with the 1-D grid, the
    current stream, the given positional arguments and the constexprs (defaults filled in), as
    the hit path; None before any launch of that key, and on the JIT path."""
    real = JITFunction(_probe)
    launched = []

    class Compiled:
        function, packed_metadata = "handle", "metadata"

        def run(self, *a):
            launched.append(a)

    class Kernel:
        params = real.params

        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled()

    kernel = Kernel()
    fast.reset()
    monkeypatch.setattr(fast, "_ENABLED", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    x = torch.zeros(64)
    assert fast.direct_launcher(kernel, (x, 32), dict(BLOCK=16, num_warps=4)) is None  # nothing cached yet
    fast.launch(kernel, (3,), x, 32, BLOCK=16, num_warps=4)
    call = fast.direct_launcher(kernel, (x, 32), dict(BLOCK=16, num_warps=4))
    call(5, x, 48)
    assert launched == [(5, 1, 1, 99, "handle", "metadata", None, None, None, x, 48, 16, False)]
    assert fast.direct_launcher(kernel, (x, 32), dict(BLOCK=32, num_warps=4)) is None  # another key
    monkeypatch.setattr(fast, "_ENABLED", False)
    assert fast.direct_launcher(kernel, (x, 32), dict(BLOCK=16, num_warps=4)) is None
    fast.reset()


def test_token_counts_share_a_build_of_the_fused_combine():
    """Layer1 of the fused strategy takes the call's token count T (masks only): every T must
    reuse one build, not one per pattern of "divisible by 16" and "equal to 1"."""
    from helpers import triton_builds
    from interlace.kernels.comet.layer1 import _gemm1_combine_kernel

    kernel = _gemm1_combine_kernel if isinstance(_gemm1_combine_kernel, JITFunction) else \
        JITFunction(_gemm1_combine_kernel.fn, **_gemm1_combine_kernel.kwargs)
    names = [p.name for p in kernel.params if not p.is_constexpr]
    builds = {triton_builds(kernel, [T if n == "T" else 7 for n in names], {}) for T in (1, 5, 16, 17, 32, 33, 512)}
    assert len(builds) == 1
