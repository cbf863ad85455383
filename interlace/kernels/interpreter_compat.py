"""Make Triton's CPU interpreter (``TRITON_INTERPRET=1``) work with NumPy ≥ 2.4 and bf16 dots.

The interpreter holds every scalar kernel argument as a one-element NumPy array (shape
``(1,)``) and turns it into a Python int with ``int(array)`` when a kernel uses it as a loop
bound (``for b0 in range(0, num_blocks, BLOCK_B)``). NumPy 2.4 made ``int()`` of an array
with ``ndim > 0`` a ``TypeError`` ("only 0-dimensional arrays can be converted to Python
scalars"), so with Triton 3.6 every kernel with a runtime loop bound fails under the
interpreter. Triton fixed it upstream (triton-lang/triton#9171, ``int(data.squeeze())``);
torch pins the Triton it ships with, so we cannot simply require a newer one.

:func:`patch_interpreter` installs the same one-line fix on the installed interpreter, and
only when that interpreter is in use and shows the bug: kernels, launch arguments and the GPU
path are untouched.

It fixes one more: the interpreter holds bf16 values as their uint16 bit patterns (NumPy has no
bf16), and its ``tl.dot`` multiplies those patterns as integers, so every bf16 GEMM of a kernel
under the interpreter came out ~1e10 (fp16, fp32 and fp8 operands are converted and right).
The fix widens bf16 operands to fp32 first (exact: a bf16 value is the high half of an fp32)
before the interpreter's own dot, again only where the installed interpreter shows the bug.

And one for FP8 (Triton 3.6): the interpreter's cast of fp32 to float8e4nv drops the carry of a
mantissa that rounds up (7.9 became 4.0, not 8.0), rounds ties away from zero and flushes
subnormals, so the FP8 kernels' activation quantizers disagreed with the GPU's
``cvt.rn.satfinite``. The fix casts through torch's float8_e4m3fn (round to nearest even) of the
value clamped to ±448, only where the installed interpreter shows the bug.

And a third, for newer Triton (seen on 3.9.0): the interpreter's comparison of a scalar (``first =
tl.program_id(0) == 0``) keeps its operand's int32 type on the handle, so a mask built from it
(``(offs < n) & first``) is held as int32 0/1 values, not bools. Triton 3.6's native load and store
read such a mask as bools; 3.9's reject it (``ValueError('mask has unsupported dtype')``, every
call of the fused strategies' plan kernel). The fix hands the native load, store and atomic
read-modify-write their mask as bools (nonzero is true, as before), again only where the
installed interpreter rejects an int mask. Compiled kernels never see it: their masks are i1.
"""

from __future__ import annotations

import warnings

_patched = False


def _index(tensor) -> int:
    # ``.item()`` reads the single element whatever the array's ndim (0 or 1).
    return int(tensor.handle.data.item())


def _has_scalar_index_bug(interpreter) -> bool:
    """Whether this interpreter's ``tensor.__index__`` fails (or warns) on a one-element array."""
    import numpy as np

    class _Scope:  # records what _patch_lang_tensor would set, changes nothing
        def __init__(self):
            self.attrs = {}

        def set_attr(self, obj, name, value):
            self.attrs[name] = value

    class _Handle:
        data = np.array([3], dtype=np.int32)

    class _Tensor:
        handle = _Handle()

    scope = _Scope()
    try:
        interpreter._patch_lang_tensor(_Tensor, scope)
        index = scope.attrs["__index__"]
    except Exception:  # a layout we do not know: leave the interpreter alone
        return False
    # NumPy 1.25 to 2.3 only warn (DeprecationWarning) where 2.4 raises: fix those too, so the
    # interpreter behaves the same under every NumPy (and the fix is tested under any).
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            return index(_Tensor()) != 3
        except (TypeError, DeprecationWarning):
            return True


def _has_bf16_dot_bug(interpreter) -> bool:
    """Whether this interpreter's dot of bf16 1.0 by bf16 1.0 (bit pattern 0x3F80) is not 1."""
    import numpy as np
    import triton.language as tl

    try:
        one = interpreter.TensorHandle(np.full((1, 1), 0x3F80, dtype=np.uint16), tl.bfloat16)
        acc = interpreter.TensorHandle(np.zeros((1, 1), dtype=np.float32), tl.float32)
        out = interpreter.InterpreterBuilder.create_dot(None, one, one, acc, None, None)
        return float(np.asarray(out.data).reshape(-1)[0]) != 1.0
    except Exception:  # a layout we do not know: leave the interpreter alone
        return False


def _fix_bf16_dot(interpreter) -> None:
    """Wrap the interpreter's dot: bf16 operands (uint16 bit patterns) widened to the fp32 values."""
    import numpy as np
    import triton.language as tl

    original = interpreter.InterpreterBuilder.create_dot

    def as_fp32(handle):
        if getattr(handle.dtype, "scalar", handle.dtype) != tl.bfloat16:
            return handle
        bits = np.asarray(handle.data).astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _has_fp8_cast_bug(interpreter) -> bool:
    """Whether this interpreter's fp32 → float8e4nv cast of 7.9 is not 8.0 (Triton 3.6 drops the
    carry of a mantissa that rounds up, rounds ties away from zero and flushes subnormals)."""
    import numpy as np
    import triton.language as tl

    try:
        src = interpreter.TensorHandle(np.array([7.9], dtype=np.float32), tl.float32)
        out = interpreter.InterpreterBuilder.create_fp_to_fp(None, src, tl.float8e4nv, None)
        return int(np.asarray(out.data).reshape(-1)[0]) != 0x50  # 8.0 = 0 1010 000
    except Exception:  # a layout we do not know: leave the interpreter alone
        return False


def _fix_fp8_cast(interpreter) -> None:
    """Wrap the interpreter's float casts: to float8e4nv through torch's cast (round to nearest
    even, subnormals kept) of the value clamped to ±448, as Hopper's ``cvt.rn.satfinite`` does."""
    import numpy as np
    import torch
    import triton.language as tl

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16, tl.bfloat16):
            return original(self, src, dst_type, rounding_mode)
        if src.dtype.scalar == tl.bfloat16:  # held as uint16 bit patterns
            values = (np.asarray(src.data).astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            values = np.asarray(src.data).astype(np.float32)
        fp8 = torch.from_numpy(np.ascontiguousarray(values)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(fp8.view(torch.uint8).numpy(), dst_type.scalar)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def _has_int_mask_bug(interpreter) -> bool:
    """Whether this interpreter's native load rejects an int32 mask (all false: nothing is read)."""
    import numpy as np

    try:
        native = interpreter._interpreter
        buf = np.zeros(1, dtype=np.int32)
        ptrs = np.array([buf.ctypes.data], dtype=np.uint64)
        native.load(ptrs, np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32), np.dtype(np.int32))
    except ValueError:
        return True
    except Exception:  # a layout we do not know: leave the interpreter alone
        return False
    return False


class _BoolMasks:
    """The interpreter's native module (``triton._C.libtriton.interpreter``) with every mask that
    reaches its load, store and atomic read-modify-write converted to bool."""

    def __init__(self, native):
        self._native = native

    def __getattr__(self, name):  # everything else (atomic_cas, the enums, ...) as it is
        return getattr(self._native, name)

    @staticmethod
    def _bool(mask):
        import numpy as np

        mask = np.asarray(mask)
        return mask if mask.dtype == np.bool_ else mask != 0

    def load(self, ptrs, mask, other, dtype):
        return self._native.load(ptrs, self._bool(mask), other, dtype)

    def store(self, ptrs, value, mask):
        return self._native.store(ptrs, value, self._bool(mask))

    def atomic_rmw(self, op, ptrs, value, mask, sem):
        return self._native.atomic_rmw(op, ptrs, value, self._bool(mask), sem)


def patch_interpreter() -> bool:
    """Fix ``tensor.__index__`` of Triton's interpreter for NumPy ≥ 2.4, its bf16 ``tl.dot``, and
    its int masks (Triton 3.9) and its casts to float8e4nv, each only if the installed interpreter needs it.

    Does nothing unless Triton runs in interpreter mode (``triton.knobs.runtime.interpret``).
    Idempotent. Returns whether a fix is in place.
    """
    global _patched
    if _patched:
        return True
    try:
        from triton import knobs

        if not knobs.runtime.interpret:
            return False
        from triton.runtime import interpreter
    except Exception:  # no Triton, or one without the interpreter we know
        return False
    if _has_bf16_dot_bug(interpreter):
        _fix_bf16_dot(interpreter)
        _patched = True
    if _has_fp8_cast_bug(interpreter):
        _fix_fp8_cast(interpreter)
        _patched = True
    if _has_scalar_index_bug(interpreter):
        original = interpreter._patch_lang_tensor

        def patch_lang_tensor(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", _index)

        interpreter._patch_lang_tensor = patch_lang_tensor
        _patched = True
    if _has_int_mask_bug(interpreter):
        # The interpreter's builder reads its native module as a global at each call.
        interpreter._interpreter = _BoolMasks(interpreter._interpreter)
        _patched = True
    return _patched
