"""An output's values as Arrow types (``MergedStore.to_arrow`` / ``iter_batches`` / ``to_parquet``):
the leaf columns put back into their paths' tree, each node's rows of a batch one Arrow array built
by pyarrow's constructors (unions for variants, ``large_list`` for lists, ``struct`` for dicts); the
numpy → Arrow helpers the leaf views share (nulls, nested fixed-size lists, a tensor array undone)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CorruptSpillError, SpillMergeError, require
from .._format import common as F
from .._format import lists as L
from .._format.common import MARK
from .._format.keyorder import Spec, ordered
from .column import OpenColumn
from .outputstore import damaged


def require_pyarrow(feature: str = "MergedStore.to_arrow()") -> Any:
    return require("pyarrow", package="pyarrow", extra="arrow", feature=feature)


def with_nulls(arr: Any, valid: np.ndarray | None) -> Any:
    """``arr`` with nulls where ``valid`` is False."""
    if valid is None or valid.all():
        return arr
    import pyarrow.compute as pc

    pa = require_pyarrow()
    return pc.if_else(pa.array(valid), arr, pa.nulls(len(arr), arr.type))


def nest(flat: Any, shape: tuple[int, ...]) -> Any:
    """``flat`` (every element) as ``shape[0]`` rows of ``fixed_size_list`` one level per later
    dimension; a dimension of size 0 is a ``large_list`` of empty lists (Arrow refuses a
    ``fixed_size_list`` of size 0)."""
    pa = require_pyarrow()
    arr = flat
    for level in range(len(shape) - 1, 0, -1):
        d = int(shape[level])
        if d:
            arr = pa.FixedSizeListArray.from_arrays(arr, d)
        else:
            count = int(np.prod(shape[:level], dtype=np.int64))
            arr = pa.LargeListArray.from_arrays(pa.array(np.zeros(count + 1, np.int64)), arr)
    return arr


def untensor(arr: Any) -> Any:
    """An ``arrow.fixed_shape_tensor`` array as the nested ``fixed_size_list`` of its storage
    (what readers without the extension type, Parquet's among them, see with its shape)."""
    pa = require_pyarrow()
    if not isinstance(arr.type, pa.FixedShapeTensorType):
        return arr
    storage = arr.storage
    k = storage.type.list_size
    flat = storage.values.slice(storage.offset * k, len(storage) * k)
    valid = None if storage.null_count == 0 else storage.is_valid().to_numpy(zero_copy_only=False)
    return with_nulls(nest(flat, (len(storage), *arr.type.shape)), valid)


_Part = tuple[tuple[str, str], str, np.ndarray, Any]
"""One variant's share of a node's rows: (key, union child name, positions among the rows, the
values at those positions as one pyarrow array). Every variant yields a part, empty or not, so
the types (and the union's children) are the same in every batch."""

TUPLE_META = {b"spillmerge.container": b"tuple"}
"""Field metadata of a column that holds tuples (a union child of tuples is named ``tuple``)."""


class Node:
    """One path of the value tree: the columns of its leaf (``cols``), its container headers
    (``headers``), its list items (one node) and its dict keys (segment -> node)."""

    __slots__ = ("_dicts", "_sides", "cols", "each", "headers", "keys", "order", "path")

    def __init__(self, path: tuple[str, ...], order: Spec | None) -> None:
        self.path = path
        self.order = order
        """The output's dict key orders (``KeyOrders.overall``): struct fields follow them (flat
        columns keep their name order)."""
        self.cols: list[OpenColumn] = []
        self.headers: list[OpenColumn] = []
        self.keys: dict[str, Node] = {}
        self.each: Node | None = None
        """The items of the lists here, one node whose rows are all of them."""
        self._sides: dict[bool, list[tuple[str, Node]]] = {}
        self._dicts: bool | None = None

    def child(self, seg: str) -> Node:
        if seg == F.ITEM:
            if self.each is None:
                self.each = Node((*self.path, seg), self.order)
            return self.each
        return self.keys.setdefault(seg, Node((*self.path, seg), self.order))

    def stored(self) -> list[OpenColumn]:
        """The columns and headers of this node and of every node under it."""
        kids = [*self.keys.values(), *([self.each] if self.each is not None else [])]
        return self.cols + self.headers + [c for kid in kids for c in kid.stored()]

    def pruned(self, keep: Callable[[OpenColumn], bool]) -> Node | None:
        """A copy with the columns ``keep`` takes and the nodes left holding one; None if none is left."""
        out = Node(self.path, self.order)
        out.cols = [c for c in self.cols if keep(c)]
        out.headers = [h for h in self.headers if keep(h)]
        for seg, kid in self.keys.items():
            got = kid.pruned(keep)
            if got is not None:
                out.keys[seg] = got
        out.each = None if self.each is None else self.each.pruned(keep)
        return out if out.cols or out.headers or out.keys or out.each else None

    def records(self) -> list[OpenColumn]:
        """The ``pyrecords`` headers here: in their rows the keys are a list of dicts' columns."""
        return [h for h in self.headers if h.info.dtype == "pyrecords"]

    def inside(self) -> np.ndarray | None:
        """Per row of this path's domain: whether it holds a list of dicts; None when none does."""
        heads = self.records()
        return np.logical_or.reduce([_rows(h) for h in heads]) if heads else None

    def keys_in(self, offs: dict[tuple[str, ...], np.ndarray], records: bool) -> list[tuple[str, Node]]:
        """The keys here (``sorted_keys``) that hold a value in a row of the whole output whose value
        here is a list of dicts (``records``: its columns) or is none (a dict's keys): decided once,
        so every batch has the same fields."""
        got = self._sides.get(records)
        if got is None:
            inside = self.inside()
            if inside is None:
                got = [] if records else self.sorted_keys()
            else:
                rows = inside if records else ~inside
                domain = F.list_domain(self.path)
                got = [
                    (seg, kid) for seg, kid in self.sorted_keys() if _meets(_valued(kid.stored(), offs, domain), rows)
                ]
            self._sides[records] = got
        return got

    def holds_dicts(self, offs: dict[tuple[str, ...], np.ndarray]) -> bool:
        """Whether a row of the whole output holds a dict here: an empty one, or a key's value
        (decided once: it reads every row's validity)."""
        if self._dicts is None:
            heads = [h for h in self.headers if h.info.dtype == "pydict"]
            self._dicts = bool(self.keys_in(offs, False)) or any(_rows(h).any() for h in heads)
        return self._dicts

    def sorted_keys(self) -> list[tuple[str, Node]]:
        """The dict keys here, in the key order the output holds for this path (else sorted)."""
        return ordered(self.keys, self.path, self.order)

    @property
    def structured(self) -> bool:
        """Exported as one column of its own type, not today's flat column(s). An empty dict
        (``pydict``) at a path whose keys other rows have makes no column by itself: its keys'
        flat columns are null in its rows (in a column made for other reasons it is ``{}``)."""
        heads = [h for h in self.headers if not (h.info.dtype == "pydict" and self.keys)]
        return bool(heads) or any(c.info.variant is not None for c in self.cols)


def tree(cols: list[OpenColumn], order: Spec | None) -> Node:
    root = Node((), order)
    for col in sorted(cols, key=lambda c: (c.info.leaf, c.info.dtype)):
        leaf = col.info.leaf
        node = root
        is_header = bool(leaf) and leaf[-1] == MARK
        for seg in leaf[:-1] if is_header else leaf:
            node = node.child(seg)
        (node.headers if is_header else node.cols).append(col)
    return root


class Batch:
    """Rows ``a .. b-1``: each column's leaf view as a pyarrow array read once, its ``valid``
    and (headers) its lengths. A column whose rows are a list's items is read over
    the items of rows ``a .. b-1`` (``offs``: the list offsets), and row numbers passed for it
    are its own."""

    def __init__(self, a: int, b: int, offs: dict[tuple[str, ...], np.ndarray]) -> None:
        self.a, self.b = a, b
        self.offs = offs
        self._arrow: dict[int, Any] = {}
        self._lengths: dict[int, np.ndarray] = {}
        self._spans: dict[tuple[str, ...], tuple[int, int]] = {(): (a, b)}

    def span(self, col: OpenColumn) -> tuple[int, int]:
        """The rows of ``col``'s domain (its list path, ``()``: the output's rows) the batch holds:
        its arrays start at the first."""
        domain = F.list_domain(col.info.leaf)
        got = self._spans.get(domain)
        if got is None:
            got = self._spans[domain] = L.rows_of(self.offs, domain, self.a, self.b)
        return got

    def arrow(self, col: OpenColumn) -> Any:
        got = self._arrow.get(id(col))
        if got is None:
            got = self._arrow[id(col)] = col.view(*self.span(col)).to_arrow()
        return got

    def valid(self, col: OpenColumn, rows: np.ndarray) -> np.ndarray:
        v = col.valid
        return np.ones(len(rows), bool) if v is None else v[rows]

    def lengths(self, col: OpenColumn) -> np.ndarray:
        got = self._lengths.get(id(col))
        if got is None:
            view = col.view(*self.span(col))
            got = self._lengths[id(col)] = np.asarray(view[:], dtype=np.int64).reshape(-1)
        return got


def combine(parts: list[_Part], n: int) -> Any:
    """One array of ``n`` slots from the parts (positions never shared): the one type when every
    part has it, else a dense union with a child per type (empty slots: nulls of the first)."""
    pa = require_pyarrow()
    names: dict[tuple[str, str], str] = {}  # each type's child name: its first part's
    for key, name, _, _ in parts:
        names.setdefault(key, name)
    order = list(names)
    ids = np.full(n, -1, np.int64)
    offs = np.zeros(n, np.int64)
    children = []
    for c, key in enumerate(order):
        mine = [(pos, arr) for k, _, pos, arr in parts if k == key]
        pos = np.concatenate([p for p, _ in mine])
        arr = pa.concat_arrays([x for _, x in mine]) if len(mine) > 1 else mine[0][1]
        if len(mine) > 1:  # several variants of one type: their rows in row order
            perm = np.argsort(pos, kind="stable")
            pos, arr = pos[perm], arr.take(pa.array(perm))
        ids[pos] = c
        offs[pos] = np.arange(len(pos))
        children.append(arr)
    empty = ids < 0
    if len(order) == 1:
        return children[0].take(pa.array(offs, mask=empty)) if empty.any() else children[0].take(pa.array(offs))
    if not order:
        return pa.nulls(n)
    if empty.any():  # a dense union has no validity of its own: a null of its first child
        k = int(empty.sum())
        offs[empty] = len(children[0]) + np.arange(k)
        ids[empty] = 0
        children[0] = pa.concat_arrays([children[0], pa.nulls(k, children[0].type)])
    # child names must differ: a second variant of the same name gets its type in it
    seen: dict[str, int] = {}
    fields = []
    for key in order:
        nm = names[key]
        seen[nm] = seen.get(nm, 0) + 1
        fields.append(nm if seen[nm] == 1 else f"{nm}.{seen[nm]}")
    return pa.UnionArray.from_dense(
        pa.array(ids.astype(np.int8)), pa.array(offs.astype(np.int32)), children, fields, list(range(len(order)))
    )


def parts(node: Node, b: Batch, rows: np.ndarray, with_keys: bool) -> list[_Part]:
    """The variants of ``node`` over ``rows`` (absolute row numbers within the batch): its
    columns, its containers, and (``with_keys``: inside a list) the dict of its keys."""
    pa = require_pyarrow()
    out: list[_Part] = []
    # A list of numbers of one type is one numeric leaf at the list's own path (``[]`` and ``[[]]``
    # too): where the path also holds lists of other items, its rows are lists of that column,
    # items and all.
    lists = any(h.info.dtype == "pylist" for h in node.headers)
    as_list = [
        c for c in node.cols
        if lists and c.info.dtype in F.PY_SCALARS and (c.info.ndim == 1 or _only_empty_lists(c))
    ]  # fmt: skip
    # ``[]`` (a ``pyfloat`` column of no item in the whole output) beside lists of dicts: empty
    # lists of dicts, not a union of two list types (which Parquet cannot hold)
    empty = [c for c in node.cols if node.records() and c.info.ndim == 1 and _only_empty_lists(c)]
    for col in (c for c in node.cols if c not in as_list and c not in empty):
        pos = np.flatnonzero(b.valid(col, rows))
        arr = b.arrow(col).take(pa.array(rows[pos] - b.span(col)[0]))
        info = col.info
        tag = f"{info.dtype}.{info.ndim}d" if info.kind in ("fixed", "ragged") else info.kind
        out.append((("col", str(arr.type)), info.variant if info.variant is not None else tag, pos, arr))
    for head in node.headers:
        pos = np.flatnonzero(b.valid(head, rows))
        lengths = b.lengths(head)[rows[pos] - b.span(head)[0]]
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        kind = head.info.dtype
        if kind == "pylist" and as_list:
            pos, starts, values = _merged_lists(node, b, rows, pos, lengths, as_list)
            arr = pa.LargeListArray.from_arrays(pa.array(starts), values)
            out.append(((kind, str(arr.type)), "list", pos, arr))
        elif kind in ("pylist", "pytuple"):
            values = combine(_item_parts(node, b, rows[pos], lengths, starts), int(starts[-1]))
            name = "tuple" if kind == "pytuple" else "item"
            arr = pa.LargeListArray.from_arrays(
                pa.array(starts), values, type=pa.large_list(pa.field(name, values.type))
            )
            out.append(((kind, str(arr.type)), kind[2:], pos, arr))
        elif kind == "pyrecords":
            arr = _records(node, b, rows[pos], lengths, starts)
            out.append((("records", str(arr.type)), "records", pos, arr))
            for col in empty:  # (from arrays: pyarrow makes no tensor or union of Python lists)
                none = np.flatnonzero(b.valid(col, rows))
                nil = pa.array(np.zeros(len(none) + 1, np.int64))
                lists = pa.LargeListArray.from_arrays(nil, arr.values.slice(0, 0), type=arr.type)
                out.append((("records", str(arr.type)), "records", none, lists))
            empty = []
        elif with_keys and node.keys:
            continue  # a dict whose keys some rows have: the struct of them below, null fields here
        else:  # pydict: an empty dict
            arr = pa.array([{}] * len(pos), type=pa.struct([]))
            out.append((("dict", "struct<>"), "dict", pos, arr))
    records = node.records()
    if with_keys and node.keys and (not records or node.holds_dicts(b.offs)):
        arr, present = _struct(node, b, rows)
        for head in node.headers:
            if head.info.dtype == "pydict":
                present |= b.valid(head, rows)
        for head in records:  # a list of dicts' keys are its columns, not a dict of their own
            present &= ~b.valid(head, rows)
        pos = np.flatnonzero(present)
        arr = arr.take(pa.array(pos))
        out.append((("dict", str(arr.type)), "dict", pos, arr))
    return out


def _item_parts(node: Node, b: Batch, rows: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> list[_Part]:
    """The parts of every item of the lists at ``node`` in ``rows``, positioned in the flat item
    array (item ``i`` of list ``j`` at ``starts[j] + i``)."""
    # the items are rows of the child path, in list order (no child: no list here has an item
    # anywhere in the output)
    o = None if node.each is None else b.offs.get(node.each.path)
    have = np.diff(o)[rows] if o is not None else np.zeros(len(rows), np.int64)
    if not np.array_equal(have, lengths):
        j = int(np.flatnonzero(have != lengths)[0])
        said = "but the output holds no item of these lists"
        if node.each is not None:
            said = f"{int(have[j])} by its list offsets"
        raise CorruptSpillError(
            f"the lists at {F.path_text(node.path)!r}: row {int(rows[j])} has {int(lengths[j])} items by its "
            f"header, {said}; the output is damaged: merge it again"
        )
    if node.each is None:
        return []
    if o is None:
        o = np.zeros(1 + max(int(rows.max(initial=-1)) + 1, 0), np.int64)  # no items anywhere
    item_rows = _spread(o[rows], lengths)
    at = _spread(starts[: len(rows)], lengths)  # where each item goes in the flat array
    return [(key, name, at[pos], arr) for key, name, pos, arr in parts(node.each, b, item_rows, with_keys=True)]


def _spread(first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each item's position, for lists of ``lengths`` items whose first items are at ``first``."""
    laid = np.concatenate([[0], np.cumsum(lengths)])[:-1]  # where each list starts laid end to end
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(first - laid, lengths)


def _merged_lists(
    node: Node, b: Batch, rows: np.ndarray, hpos: np.ndarray, hlen: np.ndarray, numeric: list[OpenColumn]
) -> tuple[np.ndarray, np.ndarray, Any]:
    """The lists at ``node`` over ``rows``, those of its ``pylist`` header (``hpos``, ``hlen``)
    and those stored as the numeric columns ``numeric``: (positions, list offsets, items)."""
    pa = require_pyarrow()
    import pyarrow.compute as pc

    got = []
    for col in numeric:
        cpos = np.flatnonzero(b.valid(col, rows))
        carr = b.arrow(col).take(pa.array(rows[cpos] - b.span(col)[0]))
        clen = pc.list_value_length(carr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        got.append((col, cpos, carr, clen))
    all_pos = np.concatenate([hpos, *(g[1] for g in got)]).astype(np.int64)
    all_len = np.concatenate([hlen, *(g[3] for g in got)]).astype(np.int64)
    perm = np.argsort(all_pos, kind="stable")
    pos, ln = all_pos[perm], all_len[perm]
    starts = np.concatenate([[0], np.cumsum(ln)]).astype(np.int64)
    start_of = np.zeros(len(rows), np.int64)
    start_of[pos] = starts[:-1]
    ps = _item_parts(node, b, rows[hpos], hlen, start_of[hpos])
    for col, cpos, carr, clen in got:
        flat, at = pc.list_flatten(carr), _spread(start_of[cpos], clen)
        if _only_empty_lists(col) and ps:  # ``[]``, ``[[]]`` beside lists of other items: no union child of their own
            if col.info.ndim == 1:
                continue  # no item
            # ``[[]]``: its items are empty lists of the first type of the other items that has
            # their levels of lists (decided by the types alone: the same in every batch)
            levels = (col.info.ndim or 1) - 1
            like = next((p for p in ps if p[0][0] != "pytuple" and _list_levels(p[3].type) >= levels), None)
            if like is not None:
                ps.append((like[0], like[1], at, _emptied(flat, like[3])))
                continue
        ps.append((("col", str(flat.type)), f"{col.info.dtype}.0d", at, flat))
    return pos, starts, combine(ps, int(starts[-1]))


def _only_empty_lists(col: OpenColumn) -> bool:
    """Whether ``col``'s rows are lists with no number at any level, ``[]``, ``[[]]`` ... (FORMAT.md:
    ``[]`` is ``pyfloat (0,)``)."""
    return col.info.dtype == "pyfloat" and bool(col.info.ndim) and 0 in (col.n_units, *col.unit_shape)


def _list_levels(t: Any) -> int:
    """How many levels of ``large_list`` Arrow type ``t`` begins with."""
    pa = require_pyarrow()
    return 1 + _list_levels(t.value_type) if pa.types.is_large_list(t) else 0


def _emptied(arr: Any, like: Any) -> Any:
    """``arr`` (lists of lists ... with no item at the bottom, at most ``_list_levels`` of
    ``like``'s type deep) as an array of ``like``'s type."""
    pa = require_pyarrow()
    import pyarrow.compute as pc

    if not len(arr):
        return like.slice(0, 0)  # (pyarrow makes no empty array of an extension or union type)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]))
    return pa.LargeListArray.from_arrays(offsets, _emptied(pc.list_flatten(arr), like.values), type=like.type)


def _split(name: str, pos: np.ndarray, arr: Any) -> list[_Part]:
    """``arr`` at ``pos`` as parts: one per child when it is a union (no union of unions)."""
    pa = require_pyarrow()
    if not pa.types.is_union(arr.type):
        return [(("col", str(arr.type)), name, pos, arr)]
    codes = arr.type_codes.to_numpy(zero_copy_only=False)
    offs = arr.offsets.to_numpy(zero_copy_only=False)
    out: list[_Part] = []
    for i in range(arr.type.num_fields):
        mine = codes == arr.type.type_codes[i]
        child = arr.field(i).take(pa.array(offs[mine].astype(np.int64)))
        out.append((("col", str(child.type)), arr.type.field(i).name, pos[mine], child))
    return out


def _struct(node: Node, b: Batch, rows: np.ndarray) -> tuple[Any, np.ndarray]:
    """The dict of ``node``'s keys over ``rows`` as a struct array, and where any key has a value."""
    pa = require_pyarrow()
    fields, names = [], []
    present = np.zeros(len(rows), bool)
    for seg, kid in node.keys_in(b.offs, records=False):
        ps = parts(kid, b, rows, with_keys=True)
        for _, _, pos, _ in ps:
            present[pos] = True
        fields.append(combine(ps, len(rows)))
        names.append(F.key_of(seg))
    if not fields:  # only empty dicts
        return pa.array([{}] * len(rows), type=pa.struct([])), present
    return pa.StructArray.from_arrays(fields, names), present


def _records(node: Node, b: Batch, rows: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> Any:
    """``large_list<struct>`` of the lists of dicts at ``node`` in ``rows``: each key's column (a
    list per row) cut into the items."""
    pa = require_pyarrow()
    import pyarrow.compute as pc

    # A row's header must equal the length of each key's list in it (checked before the key's
    # lists are cut) and some key must hold one, as ``value()`` checks, before anything is sized
    # by the headers (a damaged or hostile header of 2**40 would size an 8 TiB array).
    held = np.zeros(len(rows), bool)
    keyed: list[tuple[str, list[_Part]]] = []
    for seg, kid in node.keys_in(b.offs, records=True):
        elems: list[_Part] = []
        for _, name, pos, arr in parts(kid, b, rows, with_keys=True):
            arr = untensor(arr)  # a key's column of tensors: each item one tensor, as nested lists
            t = arr.type
            if not (pa.types.is_large_list(t) or pa.types.is_list(t) or pa.types.is_fixed_size_list(t)):
                if not len(pos):
                    continue  # a key of dicts in other rows, none of these
                raise SpillMergeError(
                    f"the lists of dicts at {F.path_text(node.path)!r}: key {F.key_of(seg)!r} holds a {name} value where "
                    f"its list of {int(lengths.max(initial=0))} is expected; the output is damaged: merge it again"
                )
            have = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            bad = np.flatnonzero(have != lengths[pos])
            if len(bad):
                j = int(pos[bad[0]])
                raise _records_error(
                    node, int(rows[j]), int(lengths[j]), f"key {F.key_of(seg)!r} holds {int(have[bad[0]])}"
                )
            held[pos] = True
            first = np.concatenate([[0], np.cumsum(have)])[:-1]
            take, at = _spread(first, have), _spread(starts[pos], have)
            elems += _split(name, at, pc.list_flatten(arr).take(pa.array(take)))
        keyed.append((seg, elems))
    if not held.all() and len(rows):
        j = int(np.flatnonzero(~held)[0])
        raise _records_error(node, int(rows[j]), int(lengths[j]), "no key holds a list there")
    total = int(starts[-1])
    fields = [combine(elems, total) for _, elems in keyed]
    names = [F.key_of(seg) for seg, _ in keyed]
    values = pa.StructArray.from_arrays(fields, names) if fields else pa.array([{}] * total, type=pa.struct([]))
    return pa.LargeListArray.from_arrays(pa.array(starts), values)


def _records_error(node: Node, row: int, n: int, what: str) -> CorruptSpillError:
    head = next(iter(node.records()), None)
    where = f"columns/{head.info.name}" if head is not None else F.path_text(node.path)
    said = f"row {row} says its list of dicts at {F.path_text(node.path)!r} has {n} items"
    return damaged(where, f"{said}, but {what}")


@dataclass(frozen=True, slots=True)
class Hidden:
    """A top-level column null in some rows: a structured node's where it holds no value of its
    own, any column's where an enclosing path holds a list of dicts."""

    column: OpenColumn | Node
    rows: np.ndarray
    """bool per output row: the rows where the column is null."""


def top_columns(
    root: Node, name_of: Callable[[OpenColumn], str], offs: dict[tuple[str, ...], np.ndarray]
) -> dict[str, Any]:
    """Column name -> what makes it: a structured node (``Node``) or a flat column (``OpenColumn``),
    either ``Hidden`` in rows an enclosing list of dicts holds, in output order. Dicts from the
    root stay flat (``"a/b"``). ``offs``: the list offsets."""
    out: dict[str, Any] = {}

    def add(name: str, leaf: tuple[str, ...], what: OpenColumn | Node, hidden: np.ndarray | None) -> None:
        out[unique_name(out, name, leaf)] = what if hidden is None else Hidden(what, hidden)

    def walk(node: Node, hidden: np.ndarray | None) -> None:
        if node.structured:
            # its own rows (not its keys' dicts, not an enclosing list of dicts'): the union
            # children and fields of columns that hold no value in them go (Parquet refuses a union)
            own = np.logical_or.reduce([_rows(c) for c in node.cols + node.headers])
            if hidden is not None:
                own &= ~hidden
            kept = node.pruned(lambda c: bool(L.any_per_row(offs, F.list_domain(c.info.leaf), _held(c))[own].any()))
            if kept is not None:
                add("/".join(node.path) or "value", node.path, kept, ~own)
        else:  # not a column only an enclosing list of dicts holds (its rows are inside that one)
            for col in node.cols:
                if hidden is None or _meets(_valued([col], offs, ()), ~hidden):
                    add(name_of(col), col.info.leaf, col, hidden)
        inside = node.inside()  # its records' columns are inside its column, not dicts' keys
        if inside is not None:
            hidden = inside if hidden is None else hidden | inside
        for _, kid in sorted(node.keys.items()):  # flat columns in name order
            if hidden is None or _meets(_valued(kid.stored(), offs, ()), ~hidden):  # some row's dict holds it
                walk(kid, hidden)

    walk(root, None)
    return out


def unique_name(taken: dict[str, Any], name: str, leaf: tuple[str, ...]) -> str:
    """``name``, or when another leaf path took it (a key holding ``/`` beside nested dicts, an
    empty key or a key ``value`` beside plain values) the path as JSON, ``["a/b"]``, and what
    ``name`` adds to the path (``:float16``)."""
    if name not in taken:
        return name
    return json.dumps(list(leaf), ensure_ascii=False) + name[len("/".join(leaf) or "value") :]


def _rows(col: OpenColumn) -> np.ndarray:
    """Per row of ``col``'s domain: whether it has a value."""
    return np.ones(col.n_rows, bool) if col.valid is None else np.asarray(col.valid, dtype=bool)


def _held(col: OpenColumn) -> np.ndarray:
    """Per row of ``col``'s domain: whether it has a value or holds None there."""
    return _rows(col) if col.none is None else _rows(col) | np.asarray(col.none, dtype=bool)


def _meets(valued: np.ndarray | None, rows: np.ndarray) -> bool:
    """Whether ``valued`` (``_valued``'s answer) has a value in one of ``rows``."""
    return valued is None or bool((valued & rows).any())


def _valued(
    cols: list[OpenColumn], offs: dict[tuple[str, ...], np.ndarray], domain: tuple[str, ...]
) -> np.ndarray | None:
    """Per row of ``domain`` (the columns' or one they lie in): whether one of ``cols`` has a value
    there; None when ``cols`` is empty."""
    got = [L.any_per_row(offs, F.list_domain(c.info.leaf), _rows(c), domain) for c in cols]
    return np.logical_or.reduce(got) if got else None


def node_array(node: Node, b: Batch, rows: np.ndarray) -> tuple[Any, dict[bytes, bytes] | None]:
    """The structured column of ``node`` in ``rows`` (of the batch), and its field metadata."""
    ps = parts(node, b, rows, with_keys=False)
    meta = TUPLE_META if ps and all(k[0] == "pytuple" for k, _, _, _ in ps) else None
    return combine(ps, len(rows)), meta


def has_type(t: Any, test: Any) -> bool:
    """Whether ``test`` holds for Arrow type ``t`` or a type nested in it."""
    return bool(test(t)) or any(has_type(t.field(i).type, test) for i in range(t.num_fields))
