"""What storage does not keep of a drop-in's object, found in one walk of it and turned back
after reading: numpy arrays and scalars, bytearrays, tensors that require grad, and objects
stored pickled whole (``allow_pickle``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._format import common as F
from .._read.column import real_dtype

_ATOMIC = frozenset({int, float, bool, str, bytes, complex, type(None)})
"""Types with nothing below them for ``Shape`` to find: skipped without a call."""


STR = frozenset({str})


def _plain(values: Any) -> bool:
    """Whether every one of ``values`` is of an ``_ATOMIC`` type (a check in C, no call per item:
    the COCO instances' boxes are 192k lists of four floats)."""
    return _ATOMIC.issuperset(map(type, values))


class _Whole:
    """An object stored pickled whole (``allow_pickle``) because its type would not come back: a
    dict with keys other than str, a subclass, a sparse or quantized tensor, a dataclass. Not a
    dataclass itself: the writer would store it as a dict of its fields."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


class Shape:
    """What storage does not keep of an object, found in one walk of it: the paths (dict keys,
    list positions) of its numpy arrays and scalars (every array comes back as a torch tensor),
    bytearrays (as bytes), tensors that require grad and objects stored pickled whole (``_Whole``).
    ``obj``: what to write. (Dicts keep their key order in storage itself.)"""

    def __init__(self, obj: Any, allow_pickle: bool) -> None:
        self.found: dict[str, list[list[Any]]] = {key: [] for key in FIXES}  # key -> paths
        self.allow_pickle = allow_pickle
        self.obj = self._walk(obj, [], 0)

    def _walk(self, obj: Any, path: list[Any], depth: int) -> Any:
        kind = type(obj)
        if kind is np.ndarray:
            self.found["numpy"].append(path)
            return obj
        if kind in _ATOMIC:
            return obj
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                self.found["grad"].append(path)
            if kind is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized:
                return self._pickled(obj, path)  # a Parameter, a sparse or quantized tensor
            return obj
        if isinstance(obj, np.generic):
            self.found["scalars"].append(path)
            return obj
        if kind is bytearray:
            self.found["bytearray"].append(path)
            return obj
        if depth > 64:
            return obj
        if kind is dict or kind is list or kind is tuple:
            if kind is dict and not STR.issuperset(map(type, obj)):
                return self._pickled(obj, path)  # else the writer refuses the key, naming it
            if _plain(obj.values() if kind is dict else obj):
                return obj
            changed: Any = None
            for k, v in obj.items() if kind is dict else enumerate(obj):
                if type(v) in _ATOMIC or (type(v) is list and _plain(v)):
                    continue
                nv = self._walk(v, [*path, k], depth + 1)
                if nv is not v:
                    changed = (dict(obj) if kind is dict else list(obj)) if changed is None else changed
                    changed[k] = nv
            return obj if changed is None else changed if kind is dict else kind(changed)
        if isinstance(obj, (Mapping, list, tuple, int, float, complex, str, bytes)) or (
            dataclasses.is_dataclass(obj) and not isinstance(obj, type)
        ):
            return self._pickled(obj, path)  # a subclass (an enum) or a dataclass: stored as its base
        return obj

    def _pickled(self, obj: Any, path: list[Any]) -> Any:
        if not self.allow_pickle:
            return obj
        self.found["whole"].append(path)
        return _Whole(obj)

    def paths(self) -> dict[str, list[list[Any]]] | None:
        """The paths to turn back; None when there are none (nothing to store)."""
        return self.found if any(self.found.values()) else None


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy: dtypes numpy lacks (bfloat16, float8 ...) as their ml_dtypes arrays."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in F.RAW_BITS:
        return t.numpy()
    return t.view(getattr(torch, F.DTYPES[name].storage)).numpy().view(real_dtype(name))


def _scalar(v: Any) -> Any:
    """A numpy scalar from what storage gave back: a 0-d tensor or array (pickled), or the str or
    bytes of an ``np.str_`` / ``np.bytes_``."""
    v = _numpy(v) if isinstance(v, torch.Tensor) else v
    if isinstance(v, np.ndarray):
        return v[()]
    return np.str_(v) if type(v) is str else np.bytes_(v) if type(v) is bytes else v


FIXES: dict[str, Any] = {
    "whole": lambda v: v.obj if isinstance(v, _Whole) else v,
    "numpy": lambda v: _numpy(v) if isinstance(v, torch.Tensor) else v,
    "scalars": _scalar,
    "bytearray": lambda v: bytearray(v) if type(v) is bytes else v,
    "grad": lambda v: v.requires_grad_() if isinstance(v, torch.Tensor) else v,
}


def at(value: Any, path: list[Any], fix: Any) -> Any:
    """``value`` with ``fix`` applied to what lies at ``path`` (tuples rebuilt, the rest in place)."""
    if not path:
        return fix(value)
    head = path[0]
    try:
        inner = value[head]
    except (KeyError, IndexError, TypeError):
        return value
    fixed = at(inner, path[1:], fix)
    if fixed is inner:
        return value
    if type(value) is tuple:
        return (*value[:head], fixed, *value[head + 1 :])
    value[head] = fixed
    return value
