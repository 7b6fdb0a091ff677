"""Turn user values into leaves (dtype, shape, bytes) without pickle; validate keys.

The value model is docs/FORMAT.md section 1, *Value model*: a mapping's keys are path segments; a
Python scalar keeps its type in its dtype (``pyint`` ...); a list of one Python number type or of
``str`` is one leaf, a list of same-keyed dicts the dict of its columns (``pyrecords``), any other
list or tuple a ``pylist`` / ``pytuple`` header leaf plus one path per item. Header and item
segments start with ``MARK``, which no escaped user key does (``user_key``). Anything else is
pickled only when the writer opted in (``allow_pickle``), at any depth.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._errors import SpillValueError
from .._format.common import (
    DTYPES,
    MARK,
    MAX_NDIM,
    RAW_BITS,
    is_marker,
    path_text,
    shape_problem,
    user_key,
)
from .._format.keyorder import positions
from .leaves import (
    MAX_DEPTH,
    PY_PACK,
    Leaf,
    check_leaf_limits,
    host_array,
    leaf_error,
    plain_leaf,
    records,
    utf8_keys,
)

EMPTY = np.zeros(0, dtype=np.uint8)


# torch dtype -> format name, for the dtypes this torch has (write() is per frame: one dict lookup).
_TORCH_NAMES: dict[torch.dtype, str] = {dt: n for n in DTYPES if isinstance(dt := getattr(torch, n, None), torch.dtype)}


def _scalar(path: tuple[str, ...], name: str, value: object) -> Leaf:
    """A Python scalar as a 0-d leaf of its ``py*`` dtype (read back as the same Python type)."""
    pack = PY_PACK.get(name)
    if pack is not None:
        data = np.frombuffer(pack.pack(value), dtype=np.uint8)
        return Leaf(path, name, (), pack.size, data)
    arr = np.asarray(value, dtype=DTYPES[name].storage).reshape(1)
    return Leaf(path, name, (), arr.nbytes, arr.view(np.uint8))


def _header(path: tuple[str, ...], name: str, n: int) -> Leaf:
    """The header leaf of a container (``pylist`` ...): its length, int64."""
    arr = np.array([n], dtype="<i8")
    return Leaf((*path, MARK), name, (), 8, arr.view(np.uint8))


def _from_numpy(arr: np.ndarray, path: tuple[str, ...], filename: str, allow_pickle: bool = False) -> Leaf:
    name = arr.dtype.name
    dt = DTYPES.get(name)
    raw = name in RAW_BITS  # an ml_dtypes array (bfloat16, float8 ...): stored as its bits, as torch's
    if dt is None or not (arr.dtype.kind in "biufc" or raw) or arr.dtype.itemsize != dt.itemsize:
        if allow_pickle:
            return _pickled(arr, path, filename)
        hint = "; for text pass a list of str (arr.tolist())" if arr.dtype.kind in "USO" else ""
        raise leaf_error(
            path,
            filename,
            f"numpy dtype {arr.dtype} cannot be stored "
            f"without pickle (use bool, int, uint, float or complex{hint}; or open the writer with "
            "allow_pickle=True)",
        )
    if raw:
        arr = arr.view(dt.storage)
    arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)  # swapped only when not little-endian
    shape = tuple(int(d) for d in arr.shape)  # before ascontiguousarray, which makes 0-d arrays 1-d
    flat = np.ascontiguousarray(arr).reshape(-1)
    return Leaf(path, name, shape, flat.nbytes, flat.view(np.uint8))


def _from_tensor(t: torch.Tensor, path: tuple[str, ...], filename: str) -> Leaf:
    nested = getattr(t, "is_nested", False)
    if t.layout != torch.strided or t.is_quantized or nested:
        kind = "a quantized tensor" if t.is_quantized else "a nested tensor" if nested else f"layout {t.layout}"
        raise leaf_error(path, filename, f"only dense (strided) tensors can be stored, got {kind}")
    device = t.device.type
    if device == "meta":
        raise leaf_error(path, filename, "meta tensors have no data")
    name = _TORCH_NAMES.get(t.dtype)
    if name is None:
        raise leaf_error(path, filename, f"torch dtype {t.dtype} is not supported")
    if t.requires_grad:
        t = t.detach()
    t = t.resolve_conj().resolve_neg()  # each returns the tensor itself when it has no such bit
    if device not in ("cpu", "cuda"):
        t, device = t.to("cpu"), "cpu"
    if not t.is_contiguous():
        # On CUDA this is the one temporary device allocation we cannot avoid: a strided
        # device-to-host copy needs a contiguous source.
        t = t.contiguous()
    shape = tuple(t.shape)
    if device == "cpu" and DTYPES[name].native:  # numpy's views are cheaper than torch's per call
        flat_np = t.numpy().reshape(-1).view(np.uint8)
        return Leaf(path, name, shape, flat_np.nbytes, flat_np)
    nbytes = t.numel() * t.element_size()
    flat = t.reshape(-1)
    if t.numel() == 1 and flat.stride(0) != 1:  # "contiguous" whatever its stride: a byte view needs 1
        flat = flat.clone(memory_format=torch.contiguous_format)
    flat = flat.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return Leaf(path, name, shape, nbytes, flat.numpy() if device == "cpu" else flat)


# numpy dtype -> format name, for the dtypes numpy holds itself (native byte order only: a
# big-endian array misses and takes the slow path, which swaps it).
_NUMPY_NAMES: dict[np.dtype[Any], str] = (
    {np.dtype(n): n for n, d in DTYPES.items() if d.native and d.numeric} if np.little_endian else {}
)


def array_bytes(value: torch.Tensor | np.ndarray) -> np.ndarray:
    """The flat bytes (little-endian, C order) ``flatten`` stores of a host tensor or array it takes."""
    leaf = _dense_leaf(value, ())  # the common leaf: a view
    if leaf is None:
        leaf = _from_tensor(value, (), "") if isinstance(value, torch.Tensor) else _from_numpy(value, (), "")
    return leaf.data  # type: ignore[no-any-return]


def _dense_leaf(value: object, path: tuple[str, ...]) -> Leaf | None:
    """The leaf of a plain contiguous host tensor or array of a native dtype, with one dtype
    lookup; None for anything else (``flatten`` handles it, and names what it refuses).
    ``host_array`` refuses what needs ``_from_tensor``'s care."""
    arr = host_array(value)
    if arr is None:
        return None
    name = _NUMPY_NAMES.get(arr.dtype)
    if name is None or not arr.flags.c_contiguous or arr.ndim > MAX_NDIM:
        return None
    if arr.size == 0 and shape_problem(arr.shape) is not None:
        return None  # flatten refuses it, naming the filename
    return Leaf(path, name, arr.shape, arr.nbytes, arr.reshape(-1).view(np.uint8))


def flatten_dense(value: object) -> list[Leaf] | None:
    """``flatten`` of the common ``write()`` value, a tensor or a flat dict of str -> tensor (or
    array), contiguous on the host: the same leaves, without the general walk. None when the
    value is anything else."""
    if type(value) is dict:
        given = list(value)
        try:
            keys = sorted(given)
        except TypeError:
            return None
        out = []
        for k in keys:
            if type(k) is not str or k.startswith(MARK):  # a marked key is escaped by the general walk
                return None
            leaf = _dense_leaf(value[k], (k,))
            if leaf is None:
                return None
            out.append(leaf)
        if keys != given and out:  # the user's key order, on each leaf's layout
            where = {k: i for i, k in enumerate(given)}
            out = [_with_pos(leaf, (where[leaf.path[0]],)) for leaf in out]
        return out or None
    leaf = _dense_leaf(value, ())
    return None if leaf is None else [leaf]


def flatten(value: object, filename: str, frame_idx: int, allow_pickle: bool = False) -> list[Leaf]:
    """Split a value into leaves in a deterministic (sorted-key) order.

    ``allow_pickle``: store objects of no other kind as ``pickle`` leaves instead of refusing
    them (the writer's opt-in; a reader must opt in too)."""
    w = _Walk(filename, allow_pickle)
    try:
        _walk(value, (), 0, w)
    except SpillValueError as exc:
        if exc.frame_idx is not None or type(exc) is not SpillValueError:
            raise
        msg, name = str(exc), f"{filename!r:.200}"
        msg = msg.replace(name, f"{name} frame {frame_idx}", 1) if name in msg else f"{msg} (frame {frame_idx})"
        raise SpillValueError(msg, filename=exc.filename, frame_idx=frame_idx, leaf=exc.leaf) from None
    out = w.out
    for leaf in out:
        check_leaf_limits(leaf, filename)
    if w.odd:  # some dict was not in sorted key order: the leaves carry every dict's order
        where = {path: {user_key(k): i for i, k in enumerate(keys)} for path, keys in w.items()}
        out = [leaf if (p := positions(leaf.path, where)) is None else _with_pos(leaf, p) for leaf in out]
    return out


def _with_pos(leaf: Leaf, pos: tuple[int, ...]) -> Leaf:
    """``leaf`` carrying ``pos`` (``dataclasses.replace`` costs ten times more: one per leaf)."""
    return Leaf(leaf.path, leaf.dtype, leaf.shape, leaf.nbytes, leaf.data, pos)


def _walk(value: object, path: tuple[str, ...], depth: int, w: _Walk) -> None:
    out = w.out
    if depth > MAX_DEPTH:
        raise SpillValueError(
            f"value for {w.filename!r:.200} is nested deeper than {MAX_DEPTH} at {path_text(path)!r}",
            filename=w.filename,
            leaf=path_text(path),
        )
    # Plain Python values by their exact type first (one dict lookup, not a chain of isinstance
    # calls: a value of tiny objects is mostly these); subclasses take the general chain below.
    kind = _EXACT.get(type(value))
    if kind is not None:
        if kind == "str":
            out.append(Leaf(path, "str", *utf8(value, path, w.filename)))  # type: ignore[arg-type]
            return
        if kind == "container":
            if type(value) is list:  # a list of numbers or str: its one leaf, without the walk
                leaf = plain_leaf(value, path, w.filename)  # type: ignore[arg-type]
                if leaf is not None:
                    out.append(leaf)
                    return
            _container(value, path, depth, w)
            return
        if kind == "none":
            out.append(Leaf(path, "none", (), 0, EMPTY))
            return
        if kind != "pyint" or -(1 << 63) <= value < (1 << 63):  # type: ignore[operator]
            out.append(_scalar(path, kind, value))
            return
    # Tensors first: write() runs once per frame and a tensor is the common value.
    if isinstance(value, torch.Tensor):
        out.append(_from_tensor(value, path, w.filename))
    elif isinstance(value, np.ndarray):
        out.append(_from_numpy(value, path, w.filename, w.allow_pickle))
    elif w.allow_pickle and isinstance(value, (str, int, float, complex)) and not isinstance(value, np.generic):
        # a subclass of a plain type (an IntEnum, a str subclass): pickled, so that it comes back
        # as itself, as gather_object returns it; without pickle it is stored as the plain type
        out.append(_pickled(value, path, w.filename))
    elif isinstance(value, str):  # before np.generic: np.str_ is a str
        out.append(Leaf(path, "str", *utf8(value, path, w.filename)))
    elif isinstance(value, (bytes, bytearray, memoryview)):  # np.bytes_ is a bytes
        # a flat uint8 view, copied only when not contiguous (write() copies it into staging
        # before returning, so a view of the caller's buffer is safe)
        if isinstance(value, memoryview):
            value = value.cast("B") if value.c_contiguous and value.ndim else value.tobytes()
        data = np.frombuffer(value, dtype=np.uint8)
        out.append(Leaf(path, "bytes", (data.size,), data.size, data))
    elif isinstance(value, np.generic):
        out.append(_from_numpy(np.asarray(value), path, w.filename, w.allow_pickle))
    elif isinstance(value, int):  # (bool and None, which have no subclasses, took the shortcut)
        if not -(1 << 63) <= value < (1 << 63):
            if w.allow_pickle:  # gather_object's behaviour for what nothing else stores
                out.append(_pickled(value, path, w.filename))
                return
            raise leaf_error(path, w.filename, f"{value} does not fit int64 (or open the writer with allow_pickle=True)")
        out.append(_scalar(path, "pyint", value))
    elif isinstance(value, float):
        out.append(_scalar(path, "pyfloat", value))
    elif isinstance(value, complex):
        out.append(_scalar(path, "pycomplex", value))
    elif isinstance(value, (Mapping, list, tuple)) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        _container(value, path, depth, w)
    elif w.allow_pickle:
        out.append(_pickled(value, path, w.filename))
    else:
        raise leaf_error(
            path,
            w.filename,
            f"cannot store a {type(value).__name__} "
            "without pickle (use a tensor, numpy array, Python scalar, str, bytes, list of numbers or str, "
            "None, or a dict, TensorDict or dataclass of those; or open the writer with allow_pickle=True)",
        )


class _Walk(dict[tuple[str, ...], list[str]]):
    """One value's walk: its leaves so far (``out``), the ids of the containers being walked
    (``active``) and the keys of every dict in their order (dict path -> keys); ``odd``: whether
    one of them was not in sorted order (else the leaves carry no order)."""

    __slots__ = ("filename", "allow_pickle", "out", "active", "odd")

    def __init__(self, filename: str, allow_pickle: bool) -> None:
        super().__init__()
        self.filename, self.allow_pickle, self.odd = filename, allow_pickle, False
        self.out: list[Leaf] = []
        self.active: set[int] = set()

    def note(self, path: tuple[str, ...], keys: list[str]) -> list[str]:
        """Note the keys of the dict at ``path``; returns them sorted."""
        ordered = sorted(keys)
        if ordered != keys:
            self.odd = True
        self[path] = keys
        return ordered


_EXACT: dict[type, str] = {
    str: "str", int: "pyint", bool: "pybool", float: "pyfloat", type(None): "none",
    dict: "container", list: "container", tuple: "container",
}  # fmt: skip
"""``_walk``'s shortcut: the exact built-in types and what they become (an int beyond int64
takes the general chain, which pickles or refuses it)."""


def _container(value: Any, path: tuple[str, ...], depth: int, w: _Walk) -> None:
    """A mapping, dataclass, list or tuple: its children at their paths (``_walk``); a value that
    contains itself is refused."""
    if id(value) in w.active:
        raise leaf_error(path, w.filename, "the value contains itself (a cycle)")
    w.active.add(id(value))
    try:
        if isinstance(value, (list, tuple)):
            _from_list(value, path, depth, w)
            return
        if isinstance(value, Mapping):
            keys = list(value.keys())
            for k in keys:
                if not isinstance(k, str):
                    raise SpillValueError(
                        f"dict keys must be str; {w.filename!r:.200} has key {k!r:.80} at {path_text(path)!r}",
                        filename=w.filename,
                        leaf=path_text(path),
                    )
            if not utf8_keys(keys):
                raise SpillValueError(
                    f"a dict key of {w.filename!r:.200} at {path_text(path)!r} is not valid Unicode (lone "
                    f"surrogate): {keys!r:.200}; it cannot be stored",
                    filename=w.filename,
                    leaf=path_text(path),
                )
            ordered = w.note(path, keys)
            items = [(k, value[k]) for k in ordered]
        else:
            # A dataclass of tensors (tensordict's @tensorclass included) is stored like the dict of
            # its fields; TensorDict itself is a Mapping and takes the branch above, so tensordict is
            # never imported here.
            names = [f.name for f in dataclasses.fields(value)]
            ordered = w.note(path, names)
            items = [(k, getattr(value, k)) for k in ordered]
        if not items or any(is_marker(seg) for seg in path):
            # an empty dict has no leaf of its own, and a dict inside a list may hold only None: its
            # header (the number of keys) says it is there
            w.out.append(_header(path, "pydict", len(items)))
        for k, v in items:
            _walk(v, (*path, user_key(k)), depth + 1, w)
    finally:
        w.active.discard(id(value))


def utf8(text: str, path: tuple[str, ...], filename: str) -> tuple[tuple[int], int, np.ndarray]:
    """Shape, size and bytes of a ``str`` leaf. Lone surrogates (from ``surrogateescape``
    decoding, or a broken JSON source) are not Unicode text: no reader could decode them."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise leaf_error(
            path,
            filename,
            "the str is not valid Unicode (lone surrogate "
            f"at character {exc.start}); it cannot be stored as UTF-8 text (pass bytes instead)",
        ) from None
    data = np.frombuffer(raw, dtype=np.uint8)
    return (data.size,), data.size, data


_NUMPY_TORCH = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip
"""The torch dtypes numpy has (``Tensor.numpy()`` works on them, bit-exact)."""
_NAMED = hasattr(torch.Tensor, "has_names")  # named tensors (gone from recent torch)


class _Pickler(pickle.Pickler):
    """``pickle`` with plain CPU tensors reduced through numpy (``torch.from_numpy(array)``).

    torch's own reduce of a tensor saves its storage with ``torch.save`` and loads it with
    ``torch.load``, far slower for a small tensor than a numpy array, which pickles as its bytes.
    What comes back is equal in type and content: a ``torch.Tensor`` of the same dtype, shape and
    values (contiguous, as it went in). Anything else (subclasses, tensors with attributes, names,
    autograd, conjugate or negative views, non-contiguous strides, other devices and dtypes)
    takes torch's reduce. Storage shared between tensors is not kept, as torch's reduce under
    plain ``pickle`` does not keep it either."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.dtype in _NUMPY_TORCH
            and obj.layout == torch.strided
            and obj.device.type == "cpu"
            and not obj.requires_grad
            and obj.is_contiguous()
            and not obj.is_conj()
            and not obj.is_neg()
            and not (_NAMED and obj.has_names())  # type: ignore[attr-defined]
            and not obj.__dict__
        ):
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


def _pickled(value: object, path: tuple[str, ...], filename: str) -> Leaf:
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=5).dump(value)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the value's problem
        raise leaf_error(
            path, filename, f"cannot pickle a {type(value).__name__}: {type(exc).__name__}: {exc}"
        ) from exc
    data = np.frombuffer(buf.getvalue(), dtype=np.uint8)
    return Leaf(path, "pickle", (data.size,), data.size, data)


def _from_list(value: list[Any] | tuple[Any, ...], path: tuple[str, ...], depth: int, w: _Walk) -> None:
    """A list or tuple (docs/FORMAT.md, *Value model*): a list of ``str`` → a ``strlist`` leaf; a
    list of one Python number type (or of equally long such lists) → one ``py*`` array; a list of
    dicts with the same keys → a ``pyrecords`` header and the dict of their columns; anything
    else → a ``pylist`` / ``pytuple`` header and one path per item."""
    filename, out = w.filename, w.out
    leaf = plain_leaf(value, path, filename) if isinstance(value, list) else None
    if leaf is not None:
        out.append(leaf)
        return
    columns = records(value) if isinstance(value, list) else None
    if columns is not None:
        # COCO-style detection lists: one column per key, each stored as the list it makes.
        out.append(_header(path, "pyrecords", len(value)))
        ordered = w.note(path, list(columns))  # every dict of the list has this order (checked in records)
        for k in ordered:
            column, kpath = columns[k], (*path, user_key(k))
            # a column of numbers or str is one leaf: made here, without the walk's dispatch
            leaf = plain_leaf(column, kpath, filename) if depth < MAX_DEPTH else None
            if leaf is not None:
                out.append(leaf)
            else:
                _walk(column, kpath, depth + 1, w)
        return
    out.append(_header(path, "pytuple" if isinstance(value, tuple) else "pylist", len(value)))
    for i, item in enumerate(value):
        _walk(item, (*path, f"{MARK}{i}"), depth + 1, w)
