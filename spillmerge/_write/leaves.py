"""A frame's leaves: the :class:`Leaf` record, the format's checks on a key and on a leaf, and the
Python lists stored as one leaf (numbers, strings: ``pynumeric``, ``strlist``) or as the dict of
their columns (a list of records: ``records``), each converted by C-level passes."""

from __future__ import annotations

import itertools
import numbers
import operator
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
    MAX_NDIM,
    STRING_MAX_BYTES,
    path_text,
    shape_problem,
)

MAX_DEPTH = 32


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


UINT32_MAX = (1 << 32) - 1


def host_array(value: object) -> np.ndarray | None:
    """``value`` as a numpy array when it is one, or a plain host tensor that ``Tensor.numpy()``
    views (it refuses what needs care: autograd, conj / neg bits, other devices, layouts and
    dtypes numpy lacks); None for anything else (the general way handles and names it)."""
    if type(value) is np.ndarray:
        return value
    if type(value) is torch.Tensor:
        try:
            return value.numpy()
        except (RuntimeError, TypeError):
            return None
    return None


def leaf_error(path: tuple[str, ...], filename: str, problem: str) -> SpillValueError:
    """The error for a leaf the writer refuses, naming the leaf, its file and the problem."""
    name = path_text(path)
    return SpillValueError(f"leaf {name!r} of {filename!r:.200}: {problem}", filename=filename, leaf=name)


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
    ``str`` / ``strlist`` of at most ``STRING_MAX_BYTES``, at most ``MAX_NDIM`` dimensions, a shape
    within ``shape_problem``'s bounds (``[2**27, 0]`` is refused: an empty value with 2**27
    entries before its zero). Cheap: only empty and string leaves need a closer look."""
    if len(leaf.shape) > MAX_NDIM:
        raise leaf_error(leaf.path, filename, f"{len(leaf.shape)} dims, more than the {MAX_NDIM} the format allows")
    if leaf.dtype in ("str", "strlist") and leaf.nbytes > STRING_MAX_BYTES:
        raise leaf_error(
            leaf.path,
            filename,
            f"a string of {leaf.nbytes} bytes, more than the {STRING_MAX_BYTES} the format allows (store it as bytes)",
        )
    if leaf.nbytes == 0 and DTYPES[leaf.dtype].numeric:
        bad = shape_problem(leaf.shape)
        if bad is not None:
            raise leaf_error(leaf.path, filename, bad)


def check_frame_idx(frame_idx: object, filename: str | None = None) -> int:
    """Accept non-negative Python/numpy ints and 0-d integer tensors; refuse anything else."""
    value: object = frame_idx
    if isinstance(frame_idx, torch.Tensor):
        if (
            frame_idx.ndim != 0
            or frame_idx.dtype.is_floating_point
            or frame_idx.dtype in (torch.bool, torch.complex64, torch.complex128)
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


def plain_leaf(value: list[Any], path: tuple[str, ...], filename: str) -> Leaf | None:
    """The one leaf of a list of ``str`` (``strlist``) or of Python numbers (``pynumeric``);
    None for any other list. Such a list cannot contain itself: no cycle check is needed."""
    if value and type(value[0]) is str and all(type(s) is str for s in value):
        return strlist(value, path, filename)
    arr = pynumeric(value)
    if arr is None:
        return None
    name, a = arr
    return Leaf(path, name, tuple(int(d) for d in a.shape), a.nbytes, a.reshape(-1).view(np.uint8))


def records(value: list[Any]) -> dict[str, list[Any]] | None:
    """The columns of a non-empty list of mappings with the same str keys in the same order (key
    -> the list of its values, in the dicts' key order); None for any other list. Plain dicts
    are checked and split by C-level passes (``map``, ``itemgetter``), not one Python step per
    dict: a COCO result list holds hundreds of thousands."""
    keys = same_keys(value)
    if keys is None:
        return _mapping_records(value)  # (mappings of other types, or other keys: refused there)
    return {k: list(map(operator.itemgetter(k), value)) for k in keys}


def same_keys(items: list[Any]) -> tuple[str, ...] | None:
    """The keys of ``items`` when all are plain dicts of the same non-empty str keys in the same
    order, checked by C-level passes; None otherwise."""
    first = items[0] if items else None
    if type(first) is not dict or not first or set(map(type, items)) != {dict}:
        return None
    keys = tuple(first)
    if set(map(type, keys)) != {str} or not utf8_keys(keys) or not all(map(keys.__eq__, map(tuple, items))):
        return None
    return keys


def utf8_keys(keys: Any) -> bool:
    """Whether str ``keys`` are UTF-8 (no lone surrogate): the catalog names them in UTF-8 JSON."""
    joined = "".join(keys)
    if joined.isascii():
        return True
    try:
        joined.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _mapping_records(value: list[Any]) -> dict[str, list[Any]] | None:
    """``records`` of a list whose items are mappings of any type (TensorDict ...), item by item."""
    first = value[0] if value else None
    if not isinstance(first, Mapping):
        return None
    keys = list(first.keys())
    if (
        keys
        and all(type(k) is str for k in keys)
        and utf8_keys(keys)
        and all(isinstance(d, Mapping) and list(d.keys()) == keys for d in value)
    ):
        return {k: [d[k] for d in value] for k in keys}
    return None


PY_NUMBERS = {bool: "pybool", int: "pyint", float: "pyfloat"}
"""The Python number types a list of one of them is stored as (by exact type): their ``py*`` dtype."""
PY_PACK = {"pyint": struct.Struct("<q"), "pybool": struct.Struct("<?"), "pyfloat": struct.Struct("<d")}
"""The little-endian bytes of a 0-d ``py*`` leaf: one ``pack`` instead of three numpy calls."""


def pynumeric(value: list[Any], depth: int = 0) -> tuple[str, np.ndarray] | None:
    """A list of Python numbers of one exact type (``bool``, ``int`` or ``float``), or a
    rectangular list of such lists, as its ``py*`` dtype name and array; None for anything else
    (mixed types would not come back as they went in: ``[1, 2.5]`` read as floats)."""
    if not value:
        return "pyfloat", np.zeros(0, dtype=np.float64)
    if type(value[0]) is list:
        if depth >= MAX_DEPTH:  # too deep (or a cycle): the item walk names it
            return None
        name = _rows_kind(value)
        if name is None:  # not one array of one pass: row by row
            rows = []
            for item in value:
                if type(item) is not list:
                    return None
                row = pynumeric(item, depth + 1)
                if row is None:
                    return None
                rows.append(row)
            names = {n for n, a in rows if a.size}
            shapes = {a.shape for _, a in rows}
            if len(names) > 1 or len(shapes) != 1:
                return None
            kind = names.pop() if names else "pyfloat"
            return kind, np.stack([a.astype(DTYPES[kind].storage, copy=False) for _, a in rows])
    else:
        t = type(value[0])
        name = PY_NUMBERS.get(t)
        if name is None or (len(value) > 1 and set(map(type, value)) != {t}):  # the types, in C
            return None
    try:
        return name, np.array(value, dtype=DTYPES[name].storage)
    except OverflowError:  # an int beyond int64: the items are stored one by one (or refused there)
        return None


def _rows_kind(value: list[Any]) -> str | None:
    """The ``py*`` dtype of a list of equally long non-empty lists of one Python number type
    (COCO boxes: a list of ``[4 floats]``), found in a few C-level passes, which ``np.array``
    then converts at once; None for anything else (the row-by-row way decides)."""
    if set(map(type, value)) != {list}:
        return None
    lengths = set(map(len, value))
    if len(lengths) != 1 or 0 in lengths:
        return None
    kinds = set(map(type, itertools.chain.from_iterable(value)))
    return PY_NUMBERS.get(kinds.pop()) if len(kinds) == 1 else None


def strlist(value: list[Any] | tuple[Any, ...], path: tuple[str, ...], filename: str) -> Leaf:
    """``n`` uint32 LE byte lengths, then the UTF-8 bytes of each string (docs/FORMAT.md)."""
    enc = []
    for i, s in enumerate(value):
        try:
            enc.append(s.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise leaf_error(
                path,
                filename,
                f"string {i} is not valid Unicode (lone "
                f"surrogate at character {exc.start}); it cannot be stored as UTF-8 text",
            ) from None
    n = len(enc)
    lens = np.fromiter(map(len, enc), dtype=np.int64, count=n)
    if n and int(lens.max()) > UINT32_MAX:
        raise leaf_error(path, filename, "a string of a list is 4 GiB or longer (store it as a str leaf of its own)")
    data = np.frombuffer(b"".join([lens.astype("<u4").tobytes(), *enc]), dtype=np.uint8)
    return Leaf(path, "strlist", (n, data.size), data.size, data)


def same_leaves(a: list[Leaf], b: list[Leaf]) -> bool:
    """Do two frames of one batch hold the same leaves (layouts and bytes)?"""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if (x.path, x.dtype, x.shape, x.nbytes) != (y.path, y.dtype, y.shape, y.nbytes):
            return False
        dx = x.data.cpu().numpy() if isinstance(x.data, torch.Tensor) else x.data
        dy = y.data.cpu().numpy() if isinstance(y.data, torch.Tensor) else y.data
        if not np.array_equal(dx, dy):
            return False
    return True
