"""Turn user values into leaves (dtype, shape, bytes) without pickle; validate keys.

A value is built from tensors, numpy arrays, Python scalars, ``str``, ``bytes``, ``None``, lists,
tuples and mappings (dict, TensorDict) or dataclasses (tensorclass) with str keys, nested to any
depth; each becomes leaves at leaf paths (format version 3's value model, docs/FORMAT.md section
1, *Value model*): a mapping's keys are path segments; a Python scalar keeps its type in its dtype
(``pyint`` ...); a list of one Python number type, or of ``str``, is one leaf; a list of dicts
with the same keys is the dict of its columns under a ``pyrecords`` header; any other list or
tuple is a ``pylist`` / ``pytuple`` header leaf (its length) plus one path per item. Header and
item segments start with ``MARK``, which no user key does once escaped (``user_key``). Anything
else is pickled only when the writer opted in (``allow_pickle``), at any depth. The bytes each
kind puts in ``data`` are docs/FORMAT.md section 1, *catalog*.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import numbers
import operator
import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import SpillValueError
from .._format.common import (
    DTYPES,
    FILENAME_MAX_BYTES,
    MARK,
    MAX_NDIM,
    STRING_MAX_BYTES,
    is_marker,
    path_text,
    shape_problem,
    user_key,
)
from .._format.keyorder import positions

_MAX_DEPTH = 32


@dataclass(frozen=True, slots=True)
class Leaf:
    """One array-like leaf of a frame value, ready to be copied into a staging buffer."""

    path: tuple[str, ...]
    """Dict keys from the value's root to this leaf."""
    dtype: str
    """Dtype name from the format's dtype table."""
    shape: tuple[int, ...]
    """Shape of the leaf."""
    nbytes: int
    """Number of bytes of the leaf."""
    data: Any
    """A flat uint8 view: ``np.ndarray`` on the host or a contiguous ``torch.Tensor`` on any device."""
    pos: tuple[int, ...] | None = None
    """Per path segment, the key's position in the user's dict; None when every dict along the
    path had its keys in sorted order (``_format.keyorder``)."""


_EMPTY = np.zeros(0, dtype=np.uint8)
_UINT32_MAX = (1 << 32) - 1


# torch dtype -> format name, for the dtypes this torch has (write() is per frame: one dict lookup).
_TORCH_NAMES: dict[torch.dtype, str] = {dt: n for n in DTYPES if isinstance(dt := getattr(torch, n, None), torch.dtype)}


def _torch_dtype_name(dt: torch.dtype) -> str | None:
    return _TORCH_NAMES.get(dt)


def check_filename(filename: object) -> str:
    if not isinstance(filename, str):
        raise SpillValueError(f"filename must be a str, got {type(filename).__name__} {filename!r:.80}", filename=None)
    try:
        n = len(filename.encode("utf-8"))
    except UnicodeEncodeError:
        raise SpillValueError(
            f"filename {filename!r:.200} is not valid Unicode (lone surrogate); it cannot be stored",
            filename=filename,
        ) from None
    if n > FILENAME_MAX_BYTES:
        # The reader refuses an output whose filename index holds more (docs/FORMAT.md, *Size limits*): a
        # merge of it would succeed and leave an output nobody can open.
        raise SpillValueError(
            f"filename {filename!r:.200}... is {n} bytes of UTF-8, more than the {FILENAME_MAX_BYTES} a filename "
            "may have (docs/FORMAT.md, Size limits)",
            filename=filename,
        )
    return filename


def check_leaf_limits(leaf: Leaf, filename: str) -> None:
    """The format's bounds on one leaf, which every reader enforces (docs/FORMAT.md, *Size limits*): a
    ``str`` / ``strlist`` of at most ``STRING_MAX_BYTES``, a shape within ``shape_problem``'s
    bounds (``[2**27, 0]`` is refused: an empty value with 2**27 entries before its zero).
    Cheap: only empty and string leaves need a look."""
    if leaf.dtype in ("str", "strlist") and leaf.nbytes > STRING_MAX_BYTES:
        raise SpillValueError(
            f"leaf {_leaf_name(leaf.path)!r} of {filename!r:.200}: a string of {leaf.nbytes} bytes, more than the "
            f"{STRING_MAX_BYTES} the format allows (store it as bytes)",
            filename=filename,
            leaf=_leaf_name(leaf.path),
        )
    if leaf.nbytes == 0 and DTYPES[leaf.dtype].numeric:
        bad = shape_problem(leaf.shape)
        if bad is not None:
            raise SpillValueError(
                f"leaf {_leaf_name(leaf.path)!r} of {filename!r:.200}: {bad}",
                filename=filename,
                leaf=_leaf_name(leaf.path),
            )


def check_frame_idx(frame_idx: object, filename: str | None = None) -> int:
    """Accept non-negative Python/numpy ints and 0-d integer tensors; refuse anything else."""
    value: object = frame_idx
    if isinstance(frame_idx, torch.Tensor):
        if (
            frame_idx.ndim != 0
            or frame_idx.dtype.is_floating_point
            or frame_idx.dtype
            in (
                torch.bool,
                torch.complex64,
                torch.complex128,
            )
        ):
            raise SpillValueError(
                f"frame_idx must be a non-negative integer; got a tensor of shape "
                f"{tuple(frame_idx.shape)} and dtype {frame_idx.dtype} (filename {filename!r:.200})",
                filename=filename,
            )
        value = int(frame_idx.item())
    elif isinstance(frame_idx, (bool, np.bool_)) or not isinstance(frame_idx, numbers.Integral):
        raise SpillValueError(
            f"frame_idx must be a non-negative integer, got {type(frame_idx).__name__} "
            f"{frame_idx!r:.80} (filename {filename!r:.200})",
            filename=filename,
        )
    out = int(value)  # type: ignore[call-overload]
    if not 0 <= out < (1 << 63):
        raise SpillValueError(
            f"frame_idx must be in [0, 2**63), got {out} (filename {filename!r:.200})", filename=filename
        )
    return out


def _leaf_name(path: tuple[str, ...]) -> str:
    return path_text(path)


_PACK = {"pyint": struct.Struct("<q"), "pybool": struct.Struct("<?"), "pyfloat": struct.Struct("<d")}
"""The little-endian bytes of a 0-d ``py*`` leaf: one ``pack`` instead of three numpy calls (a
value of tiny objects is mostly such leaves)."""


def _scalar(path: tuple[str, ...], name: str, value: object) -> Leaf:
    """A Python scalar as a 0-d leaf of its ``py*`` dtype (read back as the same Python type)."""
    pack = _PACK.get(name)
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
    if arr.dtype.kind not in "biufc" or name not in DTYPES:
        if allow_pickle:
            return _pickled(arr, path, filename)
        hint = "; for text pass a list of str (arr.tolist())" if arr.dtype.kind in "USO" else ""
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: numpy dtype {arr.dtype} cannot be stored "
            f"without pickle (use bool, int, uint, float or complex{hint}; or open the writer with "
            "allow_pickle=True)",
            filename=filename,
            leaf=_leaf_name(path),
        )
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and np.little_endian is False):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    shape = tuple(int(d) for d in arr.shape)  # before ascontiguousarray, which makes 0-d arrays 1-d
    flat = np.ascontiguousarray(arr).reshape(-1)
    return Leaf(path, name, shape, flat.nbytes, flat.view(np.uint8))


def _from_tensor(t: torch.Tensor, path: tuple[str, ...], filename: str) -> Leaf:
    lname = _leaf_name(path)
    if t.layout != torch.strided or t.is_quantized or getattr(t, "is_nested", False):
        raise SpillValueError(
            f"leaf {lname!r} of {filename!r:.200}: only dense (strided) tensors can be stored, "
            f"got layout {t.layout}{' (quantized)' if t.is_quantized else ''}",
            filename=filename,
            leaf=lname,
        )
    device = t.device.type
    if device == "meta":
        raise SpillValueError(
            f"leaf {lname!r} of {filename!r:.200}: meta tensors have no data", filename=filename, leaf=lname
        )
    name = _torch_dtype_name(t.dtype)
    if name is None:
        raise SpillValueError(
            f"leaf {lname!r} of {filename!r:.200}: torch dtype {t.dtype} is not supported",
            filename=filename,
            leaf=lname,
        )
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
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
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    if device == "cpu":
        return Leaf(path, name, shape, nbytes, flat.numpy())
    return Leaf(path, name, shape, nbytes, flat)


# numpy dtype -> format name, for the dtypes numpy holds itself (native byte order only: a
# big-endian array misses and takes the slow path, which swaps it).
_NUMPY_NAMES: dict[np.dtype[Any], str] = (
    {np.dtype(n): n for n, d in DTYPES.items() if d.native and d.numeric} if np.little_endian else {}
)


def _dense_leaf(value: object, path: tuple[str, ...]) -> Leaf | None:
    """The leaf of a plain contiguous host tensor or array of a native dtype, with one dtype
    lookup; None for anything else (``flatten`` handles it, and names what it refuses).
    ``Tensor.numpy()`` itself refuses what needs care (autograd, conj/neg bits, devices, dtypes
    numpy lacks, sparse or quantized layouts), so the checks of ``_from_tensor`` are not
    repeated here."""
    if type(value) is torch.Tensor:
        try:
            arr = value.numpy()
        except (RuntimeError, TypeError):
            return None
    elif type(value) is np.ndarray:
        arr = value
    else:
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
            out = [dataclasses.replace(leaf, pos=(where[leaf.path[0]],)) for leaf in out]
        return out or None
    leaf = _dense_leaf(value, ())
    return None if leaf is None else [leaf]


def flatten(value: object, filename: str, frame_idx: int, allow_pickle: bool = False) -> list[Leaf]:
    """Split a value into leaves in a deterministic (sorted-key) order.

    ``allow_pickle``: store objects of no other kind as ``pickle`` leaves instead of refusing
    them (the writer's opt-in; a reader must opt in too)."""
    out: list[Leaf] = []
    orders = _Orders()
    try:
        _walk(value, (), filename, out, 0, allow_pickle, set(), orders)
    except SpillValueError as exc:
        if exc.frame_idx is not None or type(exc) is not SpillValueError:
            raise
        msg, name = str(exc), f"{filename!r:.200}"
        msg = msg.replace(name, f"{name} frame {frame_idx}", 1) if name in msg else f"{msg} (frame {frame_idx})"
        raise SpillValueError(msg, filename=exc.filename, frame_idx=frame_idx, leaf=exc.leaf) from None
    for leaf in out:
        check_leaf_limits(leaf, filename)
        if len(leaf.shape) > MAX_NDIM:
            raise SpillValueError(
                f"leaf {_leaf_name(leaf.path)!r} of {filename!r:.200} has {len(leaf.shape)} dims (max {MAX_NDIM})",
                filename=filename,
                leaf=_leaf_name(leaf.path),
            )
    if orders.odd:  # some dict was not in sorted key order: the leaves carry every dict's order
        where = orders.positions()
        out = [leaf if (p := positions(leaf.path, where)) is None else _with_pos(leaf, p) for leaf in out]
    return out


def _with_pos(leaf: Leaf, pos: tuple[int, ...]) -> Leaf:
    """``leaf`` carrying ``pos`` (``dataclasses.replace`` costs ten times more: one per leaf)."""
    return Leaf(leaf.path, leaf.dtype, leaf.shape, leaf.nbytes, leaf.data, pos)


def _walk(
    value: object,
    path: tuple[str, ...],
    filename: str,
    out: list[Leaf],
    depth: int,
    allow_pickle: bool,
    active: set[int],
    orders: _Orders,
) -> None:
    if depth > _MAX_DEPTH:
        raise SpillValueError(
            f"value for {filename!r:.200} is nested deeper than {_MAX_DEPTH} at {_leaf_name(path)!r}",
            filename=filename,
            leaf=_leaf_name(path),
        )
    # Plain Python values by their exact type first (one dict lookup, not a chain of isinstance
    # calls: a value of tiny objects is mostly these); subclasses take the general chain below.
    kind = _EXACT.get(type(value))
    if kind is not None:
        if kind == "str":
            out.append(Leaf(path, "str", *_utf8(value, path, filename)))  # type: ignore[arg-type]
            return
        if kind == "container":
            if type(value) is list:  # a list of numbers or str: its one leaf, without the walk
                leaf = _plain_leaf(value, path, filename)  # type: ignore[arg-type]
                if leaf is not None:
                    out.append(leaf)
                    return
            _guarded(value, path, filename, out, depth, allow_pickle, active, orders)
            return
        if kind == "none":
            out.append(Leaf(path, "none", (), 0, _EMPTY))
            return
        if kind != "pyint" or -(1 << 63) <= value < (1 << 63):  # type: ignore[operator]
            out.append(_scalar(path, kind, value))
            return
    # Tensors first: write() runs once per frame and a tensor is the common value.
    if isinstance(value, torch.Tensor):
        out.append(_from_tensor(value, path, filename))
    elif isinstance(value, np.ndarray):
        out.append(_from_numpy(value, path, filename, allow_pickle))
    elif isinstance(value, str):  # before np.generic: np.str_ is a str
        out.append(Leaf(path, "str", *_utf8(value, path, filename)))
    elif isinstance(value, (bytes, bytearray, memoryview)):  # np.bytes_ is a bytes
        data = _bytes_view(value)
        out.append(Leaf(path, "bytes", (data.size,), data.size, data))
    elif value is None:
        out.append(Leaf(path, "none", (), 0, _EMPTY))
    elif isinstance(value, np.generic):
        out.append(_from_numpy(np.asarray(value), path, filename, allow_pickle))
    elif isinstance(value, bool):
        out.append(_scalar(path, "pybool", value))
    elif isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            if allow_pickle:  # gather_object's behaviour for what nothing else stores
                out.append(_pickled(value, path, filename))
                return
            raise SpillValueError(
                f"leaf {_leaf_name(path)!r} of {filename!r:.200}: {value} does not fit int64",
                filename=filename,
                leaf=_leaf_name(path),
            )
        out.append(_scalar(path, "pyint", value))
    elif isinstance(value, float):
        out.append(_scalar(path, "pyfloat", value))
    elif isinstance(value, complex):
        out.append(_scalar(path, "pycomplex", value))
    elif isinstance(value, (Mapping, list, tuple)) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        _guarded(value, path, filename, out, depth, allow_pickle, active, orders)
    elif allow_pickle:
        out.append(_pickled(value, path, filename))
    else:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: cannot store a {type(value).__name__} "
            "without pickle (use a tensor, numpy array, Python scalar, str, bytes, list of numbers or str, "
            "None, or a dict, TensorDict or dataclass of those; or open the writer with allow_pickle=True)",
            filename=filename,
            leaf=_leaf_name(path),
        )


def _guarded(
    value: Any, path: tuple[str, ...], filename: str, out: list[Leaf], depth: int, allow_pickle: bool, active: set[int],
    orders: _Orders,
) -> None:  # fmt: skip
    """``_container`` of a value not already being walked (a value that contains itself is refused)."""
    if id(value) in active:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: the value contains itself (a cycle)",
            filename=filename,
            leaf=_leaf_name(path),
        )
    active.add(id(value))
    try:
        _container(value, path, filename, out, depth, allow_pickle, active, orders)
    finally:
        active.discard(id(value))


class _Orders(dict[tuple[str, ...], list[str]]):
    """The keys of every dict of a value in their order (dict path -> keys); ``odd``: whether
    one of them was not in sorted order (else the leaves carry no order)."""

    odd = False

    def note(self, path: tuple[str, ...], keys: list[str], ordered: list[str]) -> None:
        if ordered != keys:
            self.odd = True
        self[path] = keys

    def positions(self) -> dict[tuple[str, ...], dict[str, int]]:
        """Dict path -> key segment -> its position."""
        return {path: {user_key(k): i for i, k in enumerate(keys)} for path, keys in self.items()}


_EXACT: dict[type, str] = {
    str: "str", int: "pyint", bool: "pybool", float: "pyfloat", type(None): "none",
    dict: "container", list: "container", tuple: "container",
}  # fmt: skip
"""``_walk``'s shortcut: the exact built-in types and what they become (an int beyond int64
takes the general chain, which pickles or refuses it)."""


def _container(
    value: Any, path: tuple[str, ...], filename: str, out: list[Leaf], depth: int, allow_pickle: bool, active: set[int],
    orders: _Orders,
) -> None:  # fmt: skip
    """A mapping, dataclass, list or tuple: its children at their paths (``_walk``)."""
    if isinstance(value, (list, tuple)):
        _from_list(value, path, filename, out, depth, allow_pickle, active, orders)
        return
    if isinstance(value, Mapping):
        keys = list(value.keys())
        for k in keys:
            if not isinstance(k, str):
                raise SpillValueError(
                    f"dict keys must be str; {filename!r:.200} has key {k!r:.80} at {_leaf_name(path)!r}",
                    filename=filename,
                    leaf=_leaf_name(path),
                )
        ordered = sorted(keys)
        orders.note(path, keys, ordered)
        items = [(k, value[k]) for k in ordered]
    else:
        # A dataclass of tensors (tensordict's @tensorclass included) is stored like the dict of
        # its fields; TensorDict itself is a Mapping and takes the branch above, so tensordict is
        # never imported here.
        names = [f.name for f in dataclasses.fields(value)]
        ordered = sorted(names)
        orders.note(path, names, ordered)
        items = [(k, getattr(value, k)) for k in ordered]
    if not items or any(is_marker(seg) for seg in path):
        # an empty dict has no leaf of its own, and a dict inside a list may hold only None: its
        # header (the number of keys) says it is there
        out.append(_header(path, "pydict", len(items)))
    for k, v in items:
        _walk(v, (*path, user_key(k)), filename, out, depth + 1, allow_pickle, active, orders)


def _utf8(text: str, path: tuple[str, ...], filename: str) -> tuple[tuple[int], int, np.ndarray]:
    """Shape, size and bytes of a ``str`` leaf. Lone surrogates (from ``surrogateescape``
    decoding, or a broken JSON source) are not Unicode text: no reader could decode them."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: the str is not valid Unicode (lone surrogate "
            f"at character {exc.start}); it cannot be stored as UTF-8 text (pass bytes instead)",
            filename=filename,
            leaf=_leaf_name(path),
        ) from None
    data = np.frombuffer(raw, dtype=np.uint8)
    return (data.size,), data.size, data


def _bytes_view(value: bytes | bytearray | memoryview) -> np.ndarray:
    """A flat uint8 view of a bytes-like value, copied only when it is not contiguous (write()
    copies it into staging before returning, so a view of the caller's buffer is safe)."""
    if isinstance(value, memoryview):
        value = value.cast("B") if value.c_contiguous and value.ndim else value.tobytes()
    return np.frombuffer(value, dtype=np.uint8)


_NUMPY_TORCH = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip
"""The torch dtypes numpy has (``Tensor.numpy()`` works on them, bit-exact)."""
_NAMED = hasattr(torch.Tensor, "has_names")  # named tensors (gone from recent torch)


class _Pickler(pickle.Pickler):
    """``pickle`` with plain CPU tensors reduced through numpy (``torch.from_numpy(array)``).

    torch's own reduce of a tensor saves its storage with ``torch.save`` and loads it with
    ``torch.load`` (~100-180 us each way for a 3x3 tensor, most of what pickling
    ``gather_object``'s test list costs); a numpy array pickles as its bytes (~15-25 us). What
    comes back is equal in type and content: a ``torch.Tensor`` of the same dtype, shape and
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


def _dumps(value: object) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(value)
    return buf.getvalue()


def _pickled(value: object, path: tuple[str, ...], filename: str) -> Leaf:
    try:
        raw = _dumps(value)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the value's problem
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: cannot pickle a {type(value).__name__}: "
            f"{type(exc).__name__}: {exc}",
            filename=filename,
            leaf=_leaf_name(path),
        ) from exc
    data = np.frombuffer(raw, dtype=np.uint8)
    return Leaf(path, "pickle", (data.size,), data.size, data)


def _from_list(
    value: list[Any] | tuple[Any, ...], path: tuple[str, ...], filename: str, out: list[Leaf], depth: int,
    allow_pickle: bool, active: set[int], orders: _Orders,
) -> None:  # fmt: skip
    """A list or tuple (docs/FORMAT.md, *Value model*): a list of ``str`` → a ``strlist`` leaf; a
    list of one Python number type (or of equally long such lists) → one ``py*`` array; a list of
    dicts with the same keys → a ``pyrecords`` header and the dict of their columns; anything
    else → a ``pylist`` / ``pytuple`` header and one path per item."""
    if isinstance(value, list):
        _from_plain_list(value, path, filename, out, depth, allow_pickle, active, orders)
        return
    out.append(_header(path, "pytuple", len(value)))
    for i, item in enumerate(value):
        _walk(item, (*path, f"{MARK}{i}"), filename, out, depth + 1, allow_pickle, active, orders)


def _from_plain_list(
    value: list[Any], path: tuple[str, ...], filename: str, out: list[Leaf], depth: int, allow_pickle: bool,
    active: set[int], orders: _Orders,
) -> None:  # fmt: skip
    leaf = _plain_leaf(value, path, filename)
    if leaf is not None:
        out.append(leaf)
        return
    columns = _records(value)
    if columns is not None:
        # COCO-style detection lists: one column per key, each stored as the list it makes.
        keys = list(columns)
        out.append(_header(path, "pyrecords", len(value)))
        ordered = sorted(keys)
        orders.note(path, keys, ordered)  # every dict of the list has this order (checked in _records)
        for k in ordered:
            column, kpath = columns[k], (*path, user_key(k))
            # a column of numbers or str is one leaf: made here, without the walk's dispatch
            leaf = _plain_leaf(column, kpath, filename) if depth < _MAX_DEPTH else None
            if leaf is not None:
                out.append(leaf)
            else:
                _walk(column, kpath, filename, out, depth + 1, allow_pickle, active, orders)
        return
    out.append(_header(path, "pylist", len(value)))
    for i, item in enumerate(value):
        _walk(item, (*path, f"{MARK}{i}"), filename, out, depth + 1, allow_pickle, active, orders)


def _plain_leaf(value: list[Any], path: tuple[str, ...], filename: str) -> Leaf | None:
    """The one leaf of a list of ``str`` (``strlist``) or of Python numbers (``_pynumeric``);
    None for any other list. Such a list cannot contain itself: no cycle check is needed."""
    if value and type(value[0]) is str and all(type(s) is str for s in value):
        return _strlist(value, path, filename)
    arr = _pynumeric(value)
    if arr is None:
        return None
    name, a = arr
    return Leaf(path, name, tuple(int(d) for d in a.shape), a.nbytes, a.reshape(-1).view(np.uint8))


def _records(value: list[Any]) -> dict[str, list[Any]] | None:
    """The columns of a non-empty list of mappings with the same str keys in the same order (key
    -> the list of its values, in the dicts' key order); None for any other list. Plain dicts
    are checked and split by C-level passes (``map``, ``itemgetter``), not one Python step per
    dict: a COCO result list holds hundreds of thousands."""
    first = value[0] if value else None
    if type(first) is dict:
        keys = tuple(first)
        if not keys or not all(type(k) is str for k in keys):
            return None
        if set(map(type, value)) != {dict} or not all(map(keys.__eq__, map(tuple, value))):
            return _mapping_records(value)  # (mappings of other types, or other keys: refused there)
        if len(keys) == 1:
            return {keys[0]: list(map(operator.itemgetter(keys[0]), value))}
        return dict(zip(keys, map(list, zip(*map(operator.itemgetter(*keys), value), strict=True)), strict=True))
    return _mapping_records(value) if isinstance(first, Mapping) else None


def _mapping_records(value: list[Any]) -> dict[str, list[Any]] | None:
    """``_records`` of a list whose items are mappings of any type (TensorDict ...), item by item."""
    first = value[0]
    if not isinstance(first, Mapping):
        return None
    keys = list(first.keys())
    if (
        keys
        and all(type(k) is str for k in keys)
        and all(isinstance(d, Mapping) and list(d.keys()) == keys for d in value)
    ):
        return {k: [d[k] for d in value] for k in keys}
    return None


_PY_NUM = {bool: "pybool", int: "pyint", float: "pyfloat"}


def _pynumeric(value: list[Any], depth: int = 0) -> tuple[str, np.ndarray] | None:
    """A list of Python numbers of one exact type (``bool``, ``int`` or ``float``), or a
    rectangular list of such lists, as its ``py*`` dtype name and array; None for anything else
    (mixed types would not come back as they went in: ``[1, 2.5]`` read as floats)."""
    if not value:
        return "pyfloat", np.zeros(0, dtype=np.float64)
    if type(value[0]) is list:
        if depth >= _MAX_DEPTH:  # too deep (or a cycle): the item walk names it
            return None
        flat = _flat_rows(value)
        if flat is not None:
            return flat
        rows = []
        for item in value:
            if type(item) is not list:
                return None
            row = _pynumeric(item, depth + 1)
            if row is None:
                return None
            rows.append(row)
        names = {n for n, a in rows if a.size}
        shapes = {a.shape for _, a in rows}
        if len(names) > 1 or len(shapes) != 1:
            return None
        kind = names.pop() if names else "pyfloat"
        return kind, np.stack([a.astype(DTYPES[kind].storage, copy=False) for _, a in rows])
    t = type(value[0])
    name = _PY_NUM.get(t)
    if name is None or (len(value) > 1 and set(map(type, value)) != {t}):  # the types, in C
        return None
    try:
        return name, np.array(value, dtype=DTYPES[name].storage)
    except OverflowError:  # an int beyond int64: the items are stored one by one (or refused there)
        return None


def _flat_rows(value: list[Any]) -> tuple[str, np.ndarray] | None:
    """``_pynumeric`` of a list of equally long non-empty lists of one Python number type
    (COCO boxes: a list of ``[4 floats]``) in a few C-level passes instead of one array per
    row; None for anything else (the row-by-row way decides)."""
    if set(map(type, value)) != {list}:
        return None
    lengths = set(map(len, value))
    if len(lengths) != 1 or 0 in lengths:
        return None
    kinds = set(map(type, itertools.chain.from_iterable(value)))
    if len(kinds) != 1:
        return None
    name = _PY_NUM.get(kinds.pop())
    if name is None:
        return None
    try:
        return name, np.array(value, dtype=DTYPES[name].storage)
    except OverflowError:  # an int beyond int64
        return None


def _strlist(value: list[Any] | tuple[Any, ...], path: tuple[str, ...], filename: str) -> Leaf:
    """``n`` uint32 LE byte lengths, then the UTF-8 bytes of each string (docs/FORMAT.md)."""
    enc = []
    for i, s in enumerate(value):
        try:
            enc.append(s.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise SpillValueError(
                f"leaf {_leaf_name(path)!r} of {filename!r:.200}: string {i} is not valid Unicode (lone "
                f"surrogate at character {exc.start}); it cannot be stored as UTF-8 text",
                filename=filename,
                leaf=_leaf_name(path),
            ) from None
    n = len(enc)
    lens = np.fromiter(map(len, enc), dtype=np.int64, count=n)
    if n and int(lens.max()) > _UINT32_MAX:
        raise SpillValueError(
            f"leaf {_leaf_name(path)!r} of {filename!r:.200}: a string of a list is 4 GiB or longer (store it "
            "as a str leaf of its own)",
            filename=filename,
            leaf=_leaf_name(path),
        )
    body = b"".join(enc)
    data = np.empty(4 * n + len(body), dtype=np.uint8)
    data[: 4 * n] = lens.astype("<u4").view(np.uint8)
    data[4 * n :] = np.frombuffer(body, dtype=np.uint8)
    return Leaf(path, "strlist", (n, data.size), data.size, data)
