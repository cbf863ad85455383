"""Make Triton's CPU interpreter (``TRITON_INTERPRET=1``) work with NumPy ≥ 2.4.

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


def patch_interpreter() -> bool:
    """Fix ``tensor.__index__`` of Triton's interpreter for NumPy ≥ 2.4, if it needs it.

    Does nothing unless Triton runs in interpreter mode (``triton.knobs.runtime.interpret``)
    and the installed interpreter has the bug. Idempotent. Returns whether the fix is in place.
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
    if not _has_scalar_index_bug(interpreter):
        return False
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    interpreter._patch_lang_tensor = patch_lang_tensor
    _patched = True
    return True
