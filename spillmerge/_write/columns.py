"""The leaves of a batch of values of one structure, made a column at a time (``write_batch`` of a
list of dicts: the drop-ins' elements, detection results, generation outputs).

``flatten`` walks each value in Python; values that are dicts of one key order whose values, key
by key, are all of one kind give the same leaves from a few C-level passes over each key's
column (``map``, ``itertools.chain``, one ``np.array`` per column) and a slice per item. The kinds
taken: ``None``, ``str``, Python scalars of one type (``bool``, ``int`` within int64, ``float``),
lists of ``str``, lists of one Python number type, and lists of flat records (dicts of one key
order over the whole batch whose values are scalars of one type, ``str``, or lists of one number
type, all of one length). Anything else is left to ``flatten`` (None), which names what it
refuses: the leaves are those ``flatten`` gives, byte for byte, key order included.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import SpillValueError
from .._format.common import DTYPES, MARK, STRING_MAX_BYTES, user_key
from .._format.keyorder import positions
from .flatten import utf8
from .leaves import Leaf, check_leaf_limits, strlist

_NUMBERS = {bool: "pybool", int: "pyint", float: "pyfloat"}
_EMPTY = np.zeros(0, dtype=np.uint8)

Path = tuple[str, ...]


def flatten_items(items: list[Any], names: list[str]) -> list[list[Leaf]] | None:
    """``flatten(items[i], names[i], ...)`` for every ``i`` when the items are such dicts (module
    docstring); None otherwise, and for anything ``flatten`` would refuse or word itself."""
    n = len(items)
    keys = _one_key_order(items)
    if keys is None:
        return None
    where: dict[Path, dict[str, int]] = {(): {user_key(k): i for i, k in enumerate(keys)}}
    odd = [list(keys) != sorted(keys)] * n  # per item: a dict of it out of sorted order
    out: list[list[Leaf]] = [[] for _ in range(n)]
    try:
        for k in sorted(keys):
            got = _column((user_key(k),), list(map(operator.itemgetter(k), items)), names, where, odd)
            if got is None:
                return None
            for leaves, mine in zip(out, got, strict=True):
                leaves.extend(mine)
    except (SpillValueError, OverflowError):  # flatten says what is wrong, naming the item
        return None
    pos: dict[Path, tuple[int, ...] | None] = {}
    for i, leaves in enumerate(out):
        for j, leaf in enumerate(leaves):
            check_leaf_limits(leaf, names[i])
            if odd[i]:
                p = pos[leaf.path] if leaf.path in pos else pos.setdefault(leaf.path, positions(leaf.path, where))
                if p is not None:
                    leaves[j] = Leaf(leaf.path, leaf.dtype, leaf.shape, leaf.nbytes, leaf.data, p)
    return out


def _one_key_order(items: list[Any]) -> tuple[str, ...] | None:
    """The keys of ``items`` when there are two or more and all are non-empty dicts of the same
    str keys in the same order; None otherwise."""
    first = items[0] if items else None
    if len(items) < 2 or type(first) is not dict or not first or set(map(type, items)) != {dict}:
        return None
    keys = tuple(first)
    if set(map(type, keys)) != {str} or not all(map(keys.__eq__, map(tuple, items))):
        return None
    return keys


def _column(
    path: Path, column: list[Any], names: list[str], where: dict[Path, dict[str, int]], odd: list[bool]
) -> list[list[Leaf]] | None:
    """Each item's leaves of one key's ``column`` (its values over the batch), or None."""
    kinds = set(map(type, column))
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind is list:
        return _lists(path, column, names, where, odd)
    if kind is str:
        return [[Leaf(path, "str", *utf8(v, path, name))] for v, name in zip(column, names, strict=True)]
    if kind is type(None):
        return [[Leaf(path, "none", (), 0, _EMPTY)]] * len(column)
    rows = _numbers(column, kind)
    if rows is None:
        return None
    name, u8 = rows
    size = u8.shape[1]
    return [[Leaf(path, name, (), size, u8[i])] for i in range(len(column))]


def _numbers(values: list[Any], kind: type) -> tuple[str, np.ndarray] | None:
    """``values`` (all of Python number type ``kind``) as their dtype name and one row of
    little-endian bytes per value; None for other types. OverflowError for an int beyond int64."""
    name = _NUMBERS.get(kind)
    if name is None:
        return None
    arr = np.array(values, dtype=DTYPES[name].storage)
    return name, arr.view(np.uint8).reshape(len(values), -1)


def _empty(path: Path) -> Leaf:
    """The leaf of an empty list (``pynumeric``: an empty float array)."""
    return Leaf(path, "pyfloat", (0,), 0, _EMPTY)


def _lists(
    path: Path, column: list[list[Any]], names: list[str], where: dict[Path, dict[str, int]], odd: list[bool]
) -> list[list[Leaf]] | None:
    """Each item's leaves of a column of lists: of str, of one number type, or of flat records."""
    flat = list(itertools.chain.from_iterable(column))
    lens = list(map(len, column))
    if not flat:
        return [[_empty(path)] for _ in column]
    kinds = set(map(type, flat))
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind is str:
        return [[strlist(v, path, name) if v else _empty(path)] for v, name in zip(column, names, strict=True)]
    if kind is dict:
        return _records(path, flat, lens, names, where, odd)
    rows = _numbers(flat, kind)
    if rows is None:
        return None
    name, u8 = rows
    size = u8.shape[1]
    data = u8.reshape(-1)
    out, at = [], 0
    for m in lens:
        out.append([Leaf(path, name, (m,), m * size, data[at * size : (at + m) * size])] if m else [_empty(path)])
        at += m
    return out


def _records(
    path: Path, flat: list[dict[str, Any]], lens: list[int], names: list[str], where: dict[Path, dict[str, int]],
    odd: list[bool],
) -> list[list[Leaf]] | None:  # fmt: skip
    """Each item's leaves of a column of lists of records (``flat``: every item's records, back to
    back; ``lens``: how many each item has): a ``pyrecords`` header and a leaf per key."""
    rkeys = tuple(flat[0])
    if not rkeys or set(map(type, rkeys)) != {str} or not all(map(rkeys.__eq__, map(tuple, flat))):
        return None
    where[path] = {user_key(k): i for i, k in enumerate(rkeys)}
    unsorted = list(rkeys) != sorted(rkeys)
    columns: list[tuple[Path, Any]] = []
    for k in sorted(rkeys):
        sub = list(map(operator.itemgetter(k), flat))
        kinds = set(map(type, sub))
        if len(kinds) != 1:
            return None
        kind = kinds.pop()
        if kind is str:
            columns.append(((*path, user_key(k)), sub))
            continue
        width = None
        if kind is list:  # equally long, non-empty lists of one number type: rows of a 2-d array
            widths = set(map(len, sub))
            inner = set(map(type, itertools.chain.from_iterable(sub)))
            if len(widths) != 1 or 0 in widths or len(inner) != 1:
                return None
            width, kind = widths.pop(), inner.pop()
        rows = _numbers(sub, kind)
        if rows is None:
            return None
        columns.append(((*path, user_key(k)), (*rows, width)))
    out, at = [], 0
    for i, (m, name) in enumerate(zip(lens, names, strict=True)):
        if not m:  # an empty list is no records (``records`` needs a first dict)
            out.append([_empty(path)])
            continue
        odd[i] = odd[i] or unsorted
        head = np.array([m], dtype="<i8").view(np.uint8)
        leaves = [Leaf((*path, MARK), "pyrecords", (), 8, head)]
        for kpath, col in columns:
            if type(col) is list:
                leaves.append(strlist(col[at : at + m], kpath, name))
                continue
            dtype, u8, width = col
            part = u8[at : at + m].reshape(-1)
            shape = (m,) if width is None else (m, width)
            leaves.append(Leaf(kpath, dtype, shape, part.size, part))
        out.append(leaves)
        at += m
    return out


@dataclass(slots=True)
class FlatColumns:
    """A batch of dicts of one key order as one byte buffer per leaf: what ``flatten`` gives item
    by item, made a column at a time (``SpillWriter.write_batch``). Each key's values are all
    ``None``, all ``str``, all one Python number type, all lists of one number type, or all
    lists of flat records (dicts of one key order over the batch, each key's values of one number
    type, or lists of one number type all of one length)."""

    data: list[np.ndarray]
    """Per leaf (in ``flatten``'s order): the kept items' bytes, back to back."""
    sizes: np.ndarray
    """int64 ``(n_kept, n_leaves)``: each leaf's byte count."""
    lengths: np.ndarray
    """int64 ``(n_kept, n_leaves)``: each leaf's first dimension, -1 for a 0-d leaf."""
    dtypes: list[str]
    """Per leaf: its dtype name."""
    kept: list[int]
    """The items taken, in batch order; the others hold an empty list, which ``flatten`` stores as
    a leaf of its own: they go item by item."""


def flat_columns(items: list[Any]) -> FlatColumns | None:
    """``items`` as :class:`FlatColumns`, or None for any other batch and for what ``flatten``
    refuses or words itself (an int beyond int64, a lone surrogate, an over-long string, an
    item of no bytes): the item-by-item way handles those."""
    keys = _one_key_order(items)
    if keys is None:
        return None
    columns = [list(map(operator.itemgetter(k), items)) for k in sorted(keys)]
    empty = {i for column in columns for i, v in enumerate(column) if type(v) is list and not v}
    kept = [i for i in range(len(items)) if i not in empty]
    if len(kept) < 2:
        return None
    if empty:
        pick = operator.itemgetter(*kept)
        columns = [list(pick(column)) for column in columns]
    n = len(kept)
    leaves: list[tuple[np.ndarray, Any, Any, str]] = []
    try:
        if not all(_column_leaves(column, n, leaves) for column in columns):
            return None
    except (OverflowError, UnicodeEncodeError):
        return None
    sizes = np.empty((n, len(leaves)), dtype=np.int64)
    lengths = np.empty((n, len(leaves)), dtype=np.int64)
    for j, (_, size, length, _) in enumerate(leaves):
        sizes[:, j], lengths[:, j] = size, length
    if not sizes.sum(axis=1).all():
        return None
    return FlatColumns([leaf[0] for leaf in leaves], sizes, lengths, [leaf[3] for leaf in leaves], kept)


def _column_leaves(column: list[Any], n: int, out: list[tuple[np.ndarray, Any, Any, str]]) -> bool:
    """Append one key's leaves over the batch to ``out`` as ``(bytes, sizes, lengths, dtype
    name)``; False for values ``flat_columns`` does not take."""
    kinds = set(map(type, column))
    if len(kinds) != 1:
        return False
    kind = kinds.pop()
    if kind is str:
        raw = [v.encode("utf-8") for v in column]
        sizes = np.fromiter(map(len, raw), dtype=np.int64, count=n)
        if sizes.max() > STRING_MAX_BYTES:
            return False
        out.append((np.frombuffer(b"".join(raw), dtype=np.uint8), sizes, sizes, "str"))
        return True
    if kind is type(None):
        out.append((_EMPTY, 0, -1, "none"))
        return True
    if kind is not list:
        return _numbers_leaf(column, n, kind, None, None, out)
    lens = np.fromiter(map(len, column), dtype=np.int64, count=n)
    inner = set(map(type, itertools.chain.from_iterable(column)))
    if inner != {dict}:
        numbers = itertools.chain.from_iterable(column)
        return len(inner) == 1 and _numbers_leaf(numbers, int(lens.sum()), inner.pop(), lens, lens, out)
    records = list(itertools.chain.from_iterable(column))
    rkeys = tuple(records[0])
    if not rkeys or set(map(type, rkeys)) != {str} or not all(map(rkeys.__eq__, map(tuple, records))):
        return False
    out.append((lens.astype("<i8").view(np.uint8), 8, -1, "pyrecords"))  # the header: how many records
    for k in sorted(rkeys):
        sub = list(map(operator.itemgetter(k), records))
        kinds = set(map(type, sub))
        rkind = kinds.pop() if len(kinds) == 1 else None
        if rkind is not list:
            if not _numbers_leaf(sub, len(sub), rkind, lens, lens, out):
                return False
            continue
        widths = set(map(len, sub))
        inner = set(map(type, itertools.chain.from_iterable(sub)))
        if len(widths) != 1 or 0 in widths or len(inner) != 1:  # rows of a 2-d array
            return False
        w = widths.pop()
        if not _numbers_leaf(itertools.chain.from_iterable(sub), len(sub) * w, inner.pop(), lens * w, lens, out):
            return False
    return True


def _numbers_leaf(numbers: Any, count: int, kind: Any, elems: Any, lengths: Any, out: list[Any]) -> bool:
    """Append the leaf of the iterable ``numbers``, ``count`` Python numbers of type ``kind``,
    ``elems`` of them per item (None: one, a 0-d leaf), of first dimension ``lengths``; False
    for another type."""
    name = _NUMBERS.get(kind)
    if name is None:
        return False
    storage = np.dtype(DTYPES[name].storage)
    data = np.fromiter(numbers, dtype=storage, count=count).view(np.uint8)
    if elems is None:
        out.append((data, storage.itemsize, -1, name))
    else:
        out.append((data, elems * storage.itemsize, lengths, name))
    return True
