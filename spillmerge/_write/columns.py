"""A batch of Python dicts of one structure made a column at a time (``write_batch``: the
drop-ins' elements, detection results, generation outputs): each key's values converted in a few
C-level passes (``map``, ``itertools.chain``, ``np.fromiter``) into one byte buffer per leaf,
which the writer stages whole (``FlatColumns``) or slices into each item's leaves
(``flatten_items``). Anything else is left to ``flatten``, which names what it refuses: the
leaves are those ``flatten`` gives, byte for byte, key order included.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import SpillValueError
from .._format.common import DTYPES, STRING_MAX_BYTES
from .._util.marshalled import SHORT, exact_numbers
from .flatten import EMPTY, flatten
from .leaves import PY_NUMBERS, UINT32_MAX, Leaf, same_keys


def flatten_items(items: list[Any], names: list[str]) -> list[list[Leaf]] | None:
    """``flatten(items[i], names[i], ...)`` for every ``i`` when the items are dicts
    :func:`flat_columns` takes, each kept item's leaves sliced from the columns; None otherwise,
    and for anything ``flatten`` would refuse or word itself."""
    cols = flat_columns(items)
    first = first_leaves(cols, items, names) if cols is not None else None
    if cols is None or first is None:
        return None
    out: list[Any] = [None] * len(items)
    try:
        for i in set(range(len(items))) - set(cols.kept):
            out[i] = flatten(items[i], names[i], 0)
    except SpillValueError:  # flatten says what is wrong, naming the item
        return None
    starts = np.cumsum(cols.sizes, axis=0) - cols.sizes
    for r, i in enumerate(cols.kept):
        out[i] = leaves = []
        for j, leaf in enumerate(first):
            m, at, nb = int(cols.lengths[r, j]), int(starts[r, j]), int(cols.sizes[r, j])
            shape = () if m < 0 else (m, nb) if leaf.dtype == "strlist" else (m, *leaf.shape[1:])
            leaves.append(Leaf(leaf.path, leaf.dtype, shape, nb, cols.data[j][at : at + nb], leaf.pos))
    return out


def first_leaves(cols: FlatColumns, items: list[Any], names: list[str]) -> list[Leaf] | None:
    """``flatten``'s leaves of the first item ``cols`` kept (paths, key positions and the shape
    past the first dimension of every kept item's leaves), when they agree with the columns;
    None otherwise, and when ``flatten`` refuses the item (a frame index or ``allow_pickle``
    would change only its words, or make a ``pickle`` leaf, which no column holds)."""
    i = cols.kept[0]
    try:
        leaves = flatten(items[i], names[i], 0)
    except SpillValueError:
        return None
    seen = [(leaf.dtype, leaf.nbytes, leaf.shape[0] if leaf.shape else -1) for leaf in leaves]
    want = list(zip(cols.dtypes, cols.sizes[0].tolist(), cols.lengths[0].tolist(), strict=True))
    return leaves if seen == want else None


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
    keys = same_keys(items) if len(items) >= 2 else None
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
    sizes = np.stack([np.broadcast_to(leaf[1], n) for leaf in leaves], axis=1, dtype=np.int64)
    lengths = np.stack([np.broadcast_to(leaf[2], n) for leaf in leaves], axis=1, dtype=np.int64)
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
        out.append((EMPTY, 0, -1, "none"))
        return True
    if kind is not list:
        return _numbers_leaf([column], n, kind, 1, -1, out)  # one number an item: a 0-d leaf
    lens = np.fromiter(map(len, column), dtype=np.int64, count=n)
    if type(column[0][0]) in PY_NUMBERS:  # each list holds some (empty ones are not kept)
        return _numbers_leaf(column, int(lens.sum()), type(column[0][0]), lens, lens, out)
    inner = set(map(type, itertools.chain.from_iterable(column)))
    if inner == {str}:
        return _strlist_leaf(list(itertools.chain.from_iterable(column)), lens, out)
    records = list(itertools.chain.from_iterable(column)) if inner == {dict} else []
    rkeys = same_keys(records)
    if rkeys is None:
        return False
    out.append((lens.astype("<i8").view(np.uint8), 8, -1, "pyrecords"))  # the header: how many records
    for k in sorted(rkeys):
        sub = list(map(operator.itemgetter(k), records))
        rkind = type(sub[0])
        if rkind is str:
            ok = operator.countOf(map(type, sub), str) == len(sub) and _strlist_leaf(sub, lens, out)
        elif rkind is not list:
            ok = _numbers_leaf([sub], len(sub), rkind, lens, lens, out)
        else:  # rows of a 2-d array
            widths = set(map(len, sub))
            if len(widths) != 1 or 0 in widths or operator.countOf(map(type, sub), list) != len(sub):
                return False
            w = widths.pop()
            ok = _numbers_leaf(sub, len(sub) * w, type(sub[0][0]), lens * w, lens, out)
        if not ok:
            return False
    return True


def _numbers_leaf(lists: list[list[Any]], count: int, kind: Any, elems: Any, lengths: Any, out: list[Any]) -> bool:
    """Append the leaf of the ``count`` items of ``lists`` when each is a Python number of
    exactly type ``kind`` (no bool among ints), ``elems`` of them per item, of first dimension
    ``lengths`` (-1: a 0-d leaf); False otherwise. Many go through marshal, which checks and
    converts them at once; a few are checked then converted by ``np.fromiter``."""
    name = PY_NUMBERS.get(kind)
    if name is None:
        return False
    storage = np.dtype(DTYPES[name].storage)
    items = itertools.chain.from_iterable
    numbers = lists[0] if len(lists) == 1 else items(lists)  # one list: marshalled as it is
    data = exact_numbers(numbers, count, kind, storage) if count >= SHORT else None
    if data is None:
        if operator.countOf(map(type, items(lists)), kind) != count:
            return False
        data = np.fromiter(items(lists), dtype=storage, count=count)
    out.append((data.view(np.uint8), elems * storage.itemsize, lengths, name))
    return True


def _strlist_leaf(strings: list[str], lens: np.ndarray, out: list[Any]) -> bool:
    """Append the ``strlist`` leaf of ``strings``, ``lens`` of them per item (each item's uint32
    UTF-8 lengths, then its strings: docs/FORMAT.md); False past the format's limits."""
    raw = [s.encode("utf-8") for s in strings]
    sizes = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
    if int(sizes.max()) > UINT32_MAX:
        return False
    heads = sizes.astype("<u4")
    parts: list[Any] = []
    a = 0
    for b in np.cumsum(lens).tolist():
        parts.append(heads[a:b])
        parts.extend(raw[a:b])
        a = b
    per_item = 4 * lens + np.add.reduceat(sizes, np.cumsum(lens) - lens)  # every item has a string
    if int(per_item.max()) > STRING_MAX_BYTES:
        return False
    out.append((np.frombuffer(b"".join(parts), dtype=np.uint8), per_item, lens, "strlist"))
    return True
