"""Names for Python objects inside ``torch.library`` ops.

An op takes tensors and numbers, not objects: a compiled layer's ops find the strategy (and, for
a call handed over with its router, the router) that run a call by a key, a (1,) int64 CPU tensor
held by the object and registered here weakly. A tensor rather than an int: ``torch.compile``
guards an int attribute's value, so each layer (each with its own objects) would compile its own
graph; a tensor is a graph input, and layers compiled one by one share one graph.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_KEYS = itertools.count(1)
_OBJECTS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def register(obj: object) -> torch.Tensor:
    """A fresh key for ``obj`` (held weakly): the tensor to keep as ``obj.op_key``. A copy of
    ``obj`` (``copy.deepcopy``, pickle) is another object and must register anew."""
    key = next(_KEYS)
    _OBJECTS[key] = obj
    return torch.tensor([key], dtype=torch.int64)


def lookup(key: int, what: str) -> object:
    """The live object registered under ``key``; ``RuntimeError`` naming ``what`` if it was freed."""
    obj = _OBJECTS.get(int(key))
    if obj is None:
        raise RuntimeError(f"interlace: no live {what} has op_key {key} (it was freed or replaced; a compiled graph "
                           f"whose layer changed its {what} is recompiled, not reused)")
    return obj
