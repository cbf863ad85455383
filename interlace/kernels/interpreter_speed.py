"""Make Triton's CPU interpreter (``TRITON_INTERPRET=1``) cheaper per op, computing the same.

Every test of a kernel, and the CPU demo, runs under the interpreter, where a kernel's cost is
Python's: each ``tl`` op goes through Triton's semantic layer once per program. Profiled on the
fused strategy's gloo tests, a third of a rank's time was bookkeeping that three changes remove,
each leaving every value the interpreter computes as it was:

- **One patch of ``triton.language`` per launch.** A launch points ``tl``'s builtins at the
  interpreter (``_patch_lang``: ``inspect.getmembers`` over the module and a wrapper per builtin)
  and undoes it at the end. Each call of a nested ``@triton.jit`` helper did the same again, and
  a kernel calls its helpers once per tile. Inside a launch, a helper's call now patches only the
  language modules the launch has not patched yet (``tl.core``, which ``tl.zeros`` and the other
  standard-library helpers see, the first time). What the helper runs against is what it was.
- **Triton 3.6's tuple types name themselves on demand.** ``tuple_type.__init__`` formatted its
  name (a string of every member type) at every construction, a shape or an index tuple per op;
  the name is read by ``str`` only. Triton 3.9 made it a ``cached_property`` upstream; this is the
  same change where the installed Triton does not have it.
- **NumPy dtypes of Triton dtypes from one table.** ``_get_np_dtype`` built its dict of fifteen
  entries at every call (several per op); the table is now built once, by the original function.

:func:`speed_up_interpreter` installs each only where the installed interpreter has the shape
it expects, and does nothing unless Triton runs in interpreter mode. tests/core/test_cpu_machine.py
checks that kernels with nested helpers compute what they did and that the builtins are restored
after each launch.
"""

from __future__ import annotations

import functools
import inspect

_installed: dict[str, bool] | None = None  # what speed_up_interpreter put in place


class _NothingPatched:
    """The scope of a nested helper's call whose modules the launch has already patched."""

    @staticmethod
    def restore() -> None:
        pass


def _one_patch_per_launch(interpreter, tl) -> bool:
    original_patch = interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    state = {"patched": None}  # ids of the language modules the launch in progress has patched
    langs_of: dict = {}  # function → ids of the language modules its globals name (as _patch_lang looks)

    def patch_lang(fn):
        patched = state["patched"]
        if patched is None:  # outside a launch: as Triton does
            return original_patch(fn)
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and (v is tl or v is tl.core))
        if langs and langs <= patched:
            return _NothingPatched
        scope = original_patch(fn)
        patched |= langs
        return scope

    def launch(self, *args, **kwargs):
        outer, state["patched"] = state["patched"], set()
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            state["patched"] = outer

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    return True


def _lazy_tuple_type_names(core) -> bool:
    tuple_type = core.tuple_type
    if not isinstance(tuple_type.__dict__.get("__init__"), type(_lazy_tuple_type_names)):
        return False
    try:
        source = inspect.getsource(tuple_type.__init__)
    except (OSError, TypeError):
        return False
    # Triton 3.6's constructor, exactly: anything else is left as it is.
    if "self.fields = fields or [''] * len(types)" not in source or "self.name = '['" not in source:
        return False

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [''] * len(types)

    def name(self) -> str:
        return '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']'

    lazy = functools.cached_property(name)
    lazy.__set_name__(tuple_type, "name")
    tuple_type.__init__ = __init__
    tuple_type.name = lazy
    return True


def _np_dtypes_from_a_table(interpreter, tl) -> bool:
    original = interpreter._get_np_dtype
    table: dict[str, object] = {}  # a scalar Triton dtype's name (its identity: dtype.__eq__) → NumPy dtype

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return original(tt_dtype)
        found = table.get(scalar.name)
        if found is None:
            found = table[scalar.name] = original(scalar)
        return found

    interpreter._get_np_dtype = get_np_dtype
    return True


def speed_up_interpreter() -> dict[str, bool]:
    """Install the speed-ups this module describes on Triton's interpreter, each where the
    installed Triton has the code it replaces. Does nothing unless Triton runs in interpreter
    mode (``triton.knobs.runtime.interpret``). Idempotent. Returns which are in place."""
    global _installed
    names = ("one_patch_per_launch", "lazy_tuple_type_names", "np_dtypes_from_a_table")
    if _installed is not None:
        return dict(_installed)
    try:
        from triton import knobs

        if not knobs.runtime.interpret:
            return dict.fromkeys(names, False)
        import triton.language as tl
        from triton.language import core
        from triton.runtime import interpreter
    except Exception:  # no Triton, or one without the interpreter we know
        return dict.fromkeys(names, False)
    shaped = all(hasattr(interpreter, n) for n in ("_patch_lang", "GridExecutor", "_get_np_dtype"))
    _installed = {
        "one_patch_per_launch": shaped and _one_patch_per_launch(interpreter, tl),
        "lazy_tuple_type_names": _lazy_tuple_type_names(core),
        "np_dtypes_from_a_table": shaped and _np_dtypes_from_a_table(interpreter, tl),
    }
    return dict(_installed)
