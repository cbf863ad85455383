"""Triton kernel launches with less host work than ``kernel[grid](...)``.

A small expert block (qwen2-moe, flashdmoe-cfg at 4096 tokens) issues a dozen Triton launches
per forward + backward, and its host time is as long as its GPU time: every microsecond of
launch overhead is lost on the GPU. ``kernel[grid](...)`` costs markedly more host time than the
compiled kernel's own C launcher. The JIT path spends the difference on Triton's general binder (a specialization per argument), a cache key built
from a formatted options string, launch hooks and a check of the kernel's globals.

:func:`launch` keeps one cache keyed on the kernel, the device, the call's keyword arguments
(constexprs and options) and what Triton's specialization of the other arguments depends on
(:func:`args_key`: a tensor's dtype and 16-byte alignment; an int's equality to 1, width class and
divisibility by 16; a descriptor's dtype, block shape and padding). A miss takes the JIT path, which compiles or
finds the kernel and launches it, and remembers the compiled kernel; a hit calls the compiled
kernel's launcher directly. The key is never coarser than Triton's specialization
(``tests/test_launch.py`` checks that against Triton's own specializer), so a hit never runs
a kernel compiled for other argument properties.

Triton's runtime knobs (debug mode, instrumentation) count as of a key's first launch: a knob
changed later in the process needs :func:`reset`. Falls back to ``kernel[grid](...)`` for: the interpreter (``TRITON_INTERPRET=1``), a Triton
other than the 3.6 series this was written against, launch hooks installed (profilers), an
argument type the key does not know, or ``INTERLACE_FAST_LAUNCH=0``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
from interlace.env import refresh as refresh_environment, settings

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)
_MAX_ENTRIES = 4096  # keys are property classes: a handful per call site


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ on the host. ``triton.cdiv`` is a constexpr function in Triton 3.6: from host code
    each call goes through Triton's argument wrapping, and an expert block call makes a dozen."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n, on the host (see :func:`cdiv`); 0 for n ≤ 0, as Triton's."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class _Unkeyed(Exception):
    """An argument whose specialization :func:`args_key` does not model."""


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The SMs of CUDA ``device`` (asked once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _SMS.get(index)
    if found is None:
        found = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return found


def args_key(args: tuple) -> tuple:
    """What Triton 3.6's specialization of these (non-constexpr) arguments depends on, one
    hashable per argument: a tensor's dtype and 16-byte alignment; an int's equality to 1, its
    divisibility by 16 and width (i32 / i64 / u64); the type of a bool, float or None; a host
    descriptor's dtype, block shape and padding. Inline type tests: this runs on every launch."""
    key = []
    for a in args:
        t = type(a)
        if t is torch.Tensor:
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif t is int:
            if a == 1:
                key.append("one")  # specialized to the constant 1
            else:
                key.append((a % 16 == 0) + 2 * (_I32[0] <= a < _I32[1]) + 4 * (_I64[0] <= a < _I64[1]))
        elif t is bool:
            key.append("u1")
        elif a is None:
            key.append(None)
        elif t is float:
            key.append("fp32")
        elif isinstance(a, torch.Tensor):  # a subclass
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif t.__name__ == "TensorDescriptor":
            key.append(("desc", a.base.dtype, tuple(a.block_shape), a.padding))
        else:
            raise _Unkeyed(t.__name__)
    return tuple(key)


def _supported() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if not settings().fast_launch:
        return False
    return triton.__version__.startswith("3.6.") and torch.cuda.is_available()


_ENABLED: bool | None = None
# (kernel, device, keywords, args_key) -> (compiled kernel, its launcher, function handle,
# packed metadata, names of the arguments after the positional ones, their defaults or None)
_CACHE: dict = {}


def enabled() -> bool:
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = _supported()
    return _ENABLED


@contextlib.contextmanager
def jit_path():
    """Launch through ``kernel[grid](...)`` inside this block (for timing the difference)."""
    global _ENABLED
    saved = enabled()
    _ENABLED = False
    try:
        yield
    finally:
        _ENABLED = saved


def reset() -> None:
    """Forget the compiled kernels and re-read the environment (tests)."""
    global _ENABLED
    _ENABLED = None
    _CACHE.clear()
    refresh_environment()


_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg"))


def _tail(kernel, n_positional: int, kwargs: dict):
    """How a hit assembles the arguments after the positional ones, in the kernel's order:
    (their names, the defaults to add to ``kwargs`` or None when ``kwargs`` has them all).
    Raises :class:`_Unkeyed` where the key would not determine the specialization: a constexpr
    passed by position (the key classes its value, Triton specializes on it exactly), or a
    keyword that is neither a constexpr nor a launch option (it is keyed by value, not class)."""
    params = kernel.params
    if any(p.is_constexpr for p in params[:n_positional]):
        raise _Unkeyed("constexpr passed by position")
    by_name = {p.name: p for p in params}
    for name in kwargs:
        if name not in _OPTIONS and not (name in by_name and by_name[name].is_constexpr):
            raise _Unkeyed(f"keyword {name}")
    names, defaults = [], {}
    for p in params[n_positional:]:
        if p.name not in kwargs:
            if not p.has_default:
                raise _Unkeyed(f"missing argument {p.name}")
            defaults[p.name] = p.default
        names.append(p.name)
    return tuple(names), (defaults or None)


_RUNTIME_KNOBS = None


def _hooked() -> bool:
    """Whether a launch hook (a profiler's) is installed. Triton 3.6 keeps them in ``HookChain``
    objects that are never None; the JIT path calls them (and builds their metadata) on every
    launch even when empty, which the cached path skips."""
    global _RUNTIME_KNOBS
    if _RUNTIME_KNOBS is None:
        from triton import knobs

        _RUNTIME_KNOBS = knobs.runtime
    for hook in (_RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def launch(kernel, grid: tuple[int, ...], *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, through the cached compiled kernel when possible.
    ``grid`` a tuple of program counts; ``args`` the positional kernel arguments; ``kwargs`` the
    constexprs passed by name and the launch options (``num_warps``, ``num_stages``)."""
    if not (_ENABLED if _ENABLED is not None else enabled()) or type(grid) is not tuple or _hooked():
        return kernel[grid](*args, **kwargs)
    device = torch._C._cuda_getDevice()
    try:
        key = (kernel, device, tuple(kwargs.items()), args_key(args))
    except _Unkeyed:
        return kernel[grid](*args, **kwargs)
    hit = _CACHE.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)  # compiles or finds the kernel, and launches it
        try:
            names, defaults = _tail(kernel, len(args), kwargs)
        except _Unkeyed:
            return compiled
        if len(_CACHE) >= _MAX_ENTRIES:
            _CACHE.clear()
        _CACHE[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata, names, defaults)
        return compiled
    compiled, run, function, metadata, names, defaults = hit
    named = kwargs if defaults is None else {**defaults, **kwargs}
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
        function, metadata, None, None, None, *args, *map(named.__getitem__, names))
    return compiled


def direct_launcher(kernel, args: tuple, kwargs: dict):
    """After a :func:`launch` of ``kernel`` with these arguments: a function
    ``call(grid0, *args)`` that runs the compiled kernel's own launcher on a 1-D grid of
    ``grid0`` programs on the current stream, skipping :func:`launch`'s key (``args_key`` over
    every argument) — for a caller that launches one shape many times and itself guarantees that
    later arguments have the same :func:`args_key` as ``args`` (same dtypes, 16-byte alignment,
    int classes). None where :func:`launch` would not take its cached path (the interpreter,
    another Triton, an argument it does not key) or nothing was cached. A launch hook installed
    later (a profiler) is not seen: check :func:`hooked` before each call."""
    if not enabled():
        return None
    device = torch._C._cuda_getDevice()
    try:
        key = (kernel, device, tuple(kwargs.items()), args_key(args))
    except _Unkeyed:
        return None
    hit = _CACHE.get(key)
    if hit is None:
        return None
    _, run, function, metadata, names, defaults = hit
    named = kwargs if defaults is None else {**defaults, **kwargs}
    tail = tuple(named[name] for name in names)
    stream_of = torch._C._cuda_getCurrentRawStream

    def call(grid0: int, *call_args):
        run(grid0, 1, 1, stream_of(device), function, metadata, None, None, None, *call_args, *tail)

    return call


def hooked() -> bool:
    """Whether a launch hook (a profiler's) is installed: :func:`direct_launcher`'s callers then
    go through :func:`launch`, which calls the hooks."""
    return _hooked()

