"""Rows of an output as the Python objects that were written: one row (``MergedStore.value``), or
every row in order a block at a time (``iter_values``); the inverse of ``_write.flatten.flatten``
(docs/FORMAT.md section 1, *Value model*)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .._errors import CorruptSpillError
from .._format import common as F
from .._format import lists as L
from .._format.common import MARK, is_marker, key_of
from .._format.keyorder import Spec, ordered
from .._util.gcpause import gc_paused
from .column import OpenColumn
from .views import tensor

_Node = dict[str, Any]
"""A node of the row's tree: ``kids`` (segment -> node), ``value`` (when a leaf has one),
``header`` (a container header: (dtype, length))."""


def to_python(info: Any, v: Any, as_torch: bool) -> Any:
    """A leaf view's row value (of column ``info``) as what was written."""
    if info.kind not in ("fixed", "ragged"):
        return v  # str, bytes, list of str, unpickled object: already what was written
    arr = np.asarray(v)
    if info.dtype in F.PY_SCALARS:
        return arr.item() if arr.ndim == 0 else arr.tolist()
    return tensor(arr, info.dtype) if as_torch else arr


class RowPlan:
    """What ``row_value`` needs of one file layout's columns, derived once per layout: each
    column's leaf, list domain, item segments and header rule, the list offsets (``offs``), and
    the one column of a layout whose values are plain leaves at the root (``single``: read
    without a tree)."""

    __slots__ = ("leaves", "lists", "offs", "single")

    def __init__(self, cols: list[Any], offs: dict[tuple[str, ...], np.ndarray]) -> None:
        self.offs = offs
        # (column, leaf, domain, item segments, list path of a header's items or None, its
        # ``valid`` or None, whether a row without a value there says nothing: a list item or a
        # header, which row_value skips, so _entries does not make their paths)
        self.leaves: list[
            tuple[Any, tuple[str, ...], tuple[str, ...], tuple[int, ...], tuple[str, ...] | None, Any, bool]
        ] = []
        for col in cols:
            leaf: tuple[str, ...] = col.info.leaf
            domain, at = F.list_domain(leaf), tuple(k for k, seg in enumerate(leaf) if seg == F.ITEM)
            head = col.info.dtype in ("pylist", "pytuple") and bool(offs)
            lpath = (*leaf[:-1], F.ITEM) if head else None
            self.leaves.append((col, leaf, domain, at, lpath, col.valid, not leaf or is_marker(leaf[-1])))
        self.lists = any(domain for _, _, domain, *_ in self.leaves)
        """Whether some column's rows are list items (a row's value then reads them in a ``Block``)."""
        only = cols[0] if len(cols) == 1 else None
        self.single = only if only is not None and only.info.leaf == () else None  # () is never a header


def leaf_value(col: Any, d: int, filename: str, as_torch: bool) -> Any:
    """Row ``d`` of ``col``, known to have a value, as ``value()`` returns it."""
    if col.py_scalar:  # a Python scalar read straight from its unit: no view, no 0-d array
        x = col.unit(d)
        return (x if col.native else x.view(col.real)).item()
    return to_python(col.info, col.view(d, d + 1, filename).at(d), as_torch)


def _holds(col: Any, d: int, valid: Any, block: Any) -> bool | None:
    """Whether row ``d`` of ``col`` has a value (True), holds None (None) or lacks the leaf (False)."""
    if (valid is None or bool(valid[d])) if block is None else block.ok(col, d):
        return True
    return None if col.none is not None and col.none[d] else False


def _entries(plan: RowPlan, r: int, block: Any) -> list[tuple[tuple[str, ...], Any, int, int, bool | None]]:
    """(leaf path with item positions, column, row of the column, items of its list or -1,
    True: a value there, None: None there) of every value and None row ``r`` has in the plan's
    columns; a list's item rows get the positions their lists' offsets say (``MARK`` + position)."""
    offs = plan.offs
    out: list[tuple[tuple[str, ...], Any, int, int, bool | None]] = []
    where: dict[tuple[str, ...], tuple[int, list[tuple[int, ...]]]] = {}  # a domain's rows, once per row
    for col, leaf, domain, at, lpath, valid, quiet in plan.leaves:
        if not domain:
            ok = _holds(col, r, valid, block)
            if ok is not False and (ok or not quiet):
                out.append((leaf, col, r, -1 if lpath is None or not ok else _items(offs, lpath, r), ok))
            continue
        got = where.get(domain)
        if got is None:
            got = where[domain] = L.positions(offs, domain, r)
        lo, idx = got
        for j, ix in enumerate(idx):
            d = lo + j
            ok = _holds(col, d, valid, block)
            if ok is False or (ok is None and quiet):  # (a None list item reads as None anyway)
                continue
            segs = list(leaf)
            for k, pos in zip(at, ix, strict=True):
                segs[k] = f"{MARK}{pos}"
            out.append((tuple(segs), col, d, -1 if lpath is None or not ok else _items(offs, lpath, d), ok))
    return out


def _items(offs: dict[tuple[str, ...], np.ndarray], lpath: tuple[str, ...], d: int) -> int:
    o = offs.get(lpath)
    return 0 if o is None else int(o[d + 1] - o[d])


def row_value(plan: RowPlan, r: int, filename: str, as_torch: bool, block: Any, order: Spec | None) -> Any:
    """The value of row ``r`` from the plan of its file's columns; ``block``: a :class:`Block` of
    rows around ``r`` whose columns' rows it reads (else each leaf's row is read here);
    ``order``: the file's dict key orders, None for sorted keys."""
    col = plan.single
    if col is not None and block is None:  # the value is one leaf at the root: no tree to build
        valid = col.valid
        if valid is not None and not valid[r]:
            return None
        return leaf_value(col, r, filename, as_torch)
    root: _Node = {"kids": {}}
    for leaf, col, d, items, ok in _entries(plan, r, block):
        dtype = col.info.dtype
        head = ok and dtype in F.PY_HEADERS  # a container's header: the node of its path, not of its leaf
        node = root
        for seg in leaf[:-1] if head else leaf:
            kids = node["kids"]
            nxt = kids.get(seg)
            if nxt is None:
                nxt = kids[seg] = {"kids": {}}
            node = nxt
        if ok is None:
            node["value"] = None
            continue
        # from the block: already what value() returns for the leaf
        got = block.get(col, d, filename) if block is not None else leaf_value(col, d, filename, as_torch)
        if head:  # (0-d: a Python int)
            n = int(got)
            # a header is checked against its list offsets (none: no items), so a damaged (or
            # hostile) length cannot make a reader build a list of a billion Nones
            if dtype in ("pylist", "pytuple") and n != max(items, 0):
                said = f"its list offsets say {items}" if items >= 0 else "the output holds no items of it"
                raise CorruptSpillError(
                    f"columns/{col.info.name}: row {d} ({filename!r:.200}) says its {dtype[2:]} has {n} items; {said}",
                    path=f"columns/{col.info.name}",
                )
            node["header"] = (dtype, n)
        else:
            node["value"] = got
    if not root["kids"] and "value" not in root and "header" not in root:
        return None  # the value itself was None (its leaf is ``[]``)
    return _build(root, (), order)


def _build(node: _Node, path: tuple[str, ...], order: Spec | None) -> Any:
    """The object of a node at ``path`` (list items as ``MARK`` + position), its dicts' keys in
    ``order``."""
    if "value" in node:
        return node["value"]
    kids: dict[str, _Node] = node["kids"]
    header = node.get("header")
    if header is not None:
        kind, n = header
        if kind in ("pylist", "pytuple"):
            items = [
                _build(kids[f"{MARK}{i}"], (*path, f"{MARK}{i}"), order) if f"{MARK}{i}" in kids else None
                for i in range(n)
            ]
            return tuple(items) if kind == "pytuple" else items
        if kind == "pyrecords":
            return _records(
                n,
                [(key_of(k), _build(v, (*path, k), order)) for k, v in ordered(kids, path, order) if not is_marker(k)],
            )
    return {key_of(k): _build(v, (*path, k), order) for k, v in ordered(kids, path, order)}


def _records(n: int, columns: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """A list of ``n`` dicts from its keys' columns (``(key, list of n values)``; a column of
    None: a key no dict of the list has), each column checked to hold ``n`` values."""
    kept = [(k, v) for k, v in columns if v is not None]
    for k, v in kept:
        if not isinstance(v, (list, tuple)) or len(v) != n:
            raise CorruptSpillError(f"a list of {n} dicts whose column {k!r:.100} is not a list of {n}")
    return records([k for k, _ in kept], [v for _, v in kept])


def records(keys: list[str], columns: list[Any], n: int | None = None) -> list[dict[str, Any]]:
    """The ``n`` dicts ``{keys[0]: columns[0][i], ...}`` (``n``: the columns' length, which it
    must be when there are none), in the keys' order. Filled a column at a time: about twice as
    fast as ``dict(zip(keys, row))`` a row at a time."""
    n = n if n is not None else len(columns[0]) if columns else 0
    rows: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, column in zip(keys, columns, strict=True):
        for row, value in zip(rows, column, strict=True):
            row[key] = value
    return rows


def static_builder(plan: RowPlan, order: Spec | None) -> Any:
    """``(block, r, filename) -> value`` for a layout without list items or list headers: a row
    with a value in each of its columns has the same tree as every other such row, so the tree is
    made once here (its dicts' keys in ``order``) and the row only reads its leaves from the
    block, as ``row_value`` with that block gives them; :data:`ABSENT` for a row without a value
    in some column (``row_value`` builds it). Its ``run(block, r0, r1)``: rows ``r0 .. r1-1`` so,
    a node of the tree at a time over all of them (``(values, whether no row is ABSENT)``), or
    None when a column of them is read row by row. None for any other layout."""
    if plan.lists:
        return None
    root: _Node = {"kids": {}}
    maybe = []  # the columns with rows without a value
    for col, leaf, _, _, _, valid, _ in plan.leaves:
        if col.info.dtype in ("pylist", "pytuple"):
            return None
        if valid is not None:
            maybe.append(col)
        head = col.info.dtype in F.PY_HEADERS
        node = root
        for seg in leaf[:-1] if head else leaf:
            node = node["kids"].setdefault(seg, {"kids": {}})
        if head:
            node["header"] = (col.info.dtype, col)
        else:
            node["col"] = col
    if root == {"kids": {}}:
        return None
    build, rows = _compile(root, (), order)

    def checked(block: Any, r: int, filename: str) -> Any:
        good = block.good(maybe, r, r + 1)
        return build(block, r, filename) if good is None or good[0] else ABSENT

    def run(block: Any, r0: int, r1: int) -> tuple[list[Any], bool] | None:
        good = block.good(maybe, r0, r1)
        got = rows(block, r0, r1, good)
        if got is None or good is None:
            return None if got is None else (got, True)
        return [v if ok else ABSENT for v, ok in zip(got, good, strict=True)], False

    checked.run = run  # type: ignore[attr-defined]
    return checked


ABSENT = object()
"""``static_builder``'s answer for a row without a value in one of its layout's columns."""


def _compile(node: _Node, path: tuple[str, ...], order: Spec | None) -> tuple[Any, Any]:
    """The builders of ``node`` (``static_builder``), what ``_build`` makes of it: of one row
    (``(block, r, filename)``), and of rows ``r0 .. r1-1`` (``(block, r0, r1, good)``: a list,
    anything where ``good`` says a row lacks a value in some column; None when a column is read
    row by row)."""
    col = node.get("col")
    if col is not None:
        return (
            lambda block, r, filename: block.get(col, r, filename),
            lambda block, r0, r1, _: block.rows(col, r0, r1),
        )
    kid_nodes = list(ordered(node["kids"], path, order))
    kids = [(k, key_of(k), *_compile(v, (*path, k), order)) for k, v in kid_nodes]
    header = node.get("header")
    if header is None or header[0] != "pyrecords":
        items = [(k, b) for _, k, b, _ in kids]
        keys, many = [k for _, k, _, _ in kids], [m for _, _, _, m in kids]

        def build(block: Any, r: int, filename: str) -> Any:
            return {k: b(block, r, filename) for k, b in items}

        def rows(block: Any, r0: int, r1: int, good: list[bool] | None) -> list[Any] | None:
            cols = [m(block, r0, r1, good) for m in many]
            return None if any(c is None for c in cols) else records(keys, cols, r1 - r0)

        return build, rows
    items = [(k, b) for seg, k, b, _ in kids if not is_marker(seg)]
    named = [(k, m) for seg, k, _, m in kids if not is_marker(seg)]
    head = header[1]

    def build_records(block: Any, r: int, filename: str) -> Any:
        return _records(int(block.get(head, r, filename)), [(k, b(block, r, filename)) for k, b in items])

    def rows_records(block: Any, r0: int, r1: int, good: list[bool] | None) -> list[Any] | None:
        ns, cols = block.rows(head, r0, r1), [m(block, r0, r1, good) for _, m in named]
        if ns is None or any(c is None for c in cols):
            return None
        keys = [k for k, _ in named]
        return [
            _records(int(n), list(zip(keys, vs, strict=True))) if good is None or good[i] else None
            for i, (n, *vs) in enumerate(zip(ns, *cols, strict=True))
        ]

    return build_records, rows_records


BLOCK_FILES = 1024
"""Files whose index entries are read at a time (the filenames' block size)."""
BLOCK_ROWS = 4096
"""Rows whose column values are decoded at a time."""
BLOCK_BYTES = 32 << 20
"""A column's payload in one block above which its rows are read one by one (large tensors): the
block's memory stays bounded whatever the rows hold."""

_DIRECT = None  # a column read row by row (its rows in the block are too large to hold at once)


class Block:
    """Rows ``a .. b-1`` of an output: each column's rows (``lo``, validity, Python values) read
    once, when a row first needs them (``row_value``'s ``block``)."""

    __slots__ = ("_cols", "a", "as_torch", "b", "offs")

    def __init__(self, a: int, b: int, offs: dict[tuple[str, ...], np.ndarray], as_torch: bool) -> None:
        self.a, self.b, self.offs, self.as_torch = a, b, offs, as_torch
        self._cols: dict[int, tuple[int, list[bool] | None, list[Any] | None]] = {}

    def _load(self, col: OpenColumn) -> tuple[int, list[bool] | None, list[Any] | None]:
        lo, hi = L.rows_of(self.offs, F.list_domain(col.info.leaf), self.a, self.b)
        valid = col.valid
        ok = None if valid is None else np.asarray(valid[lo:hi], dtype=bool).tolist()
        got = self._cols[id(col)] = (lo, ok, gc_paused(column_rows, col, lo, hi, ok, self.as_torch))
        return got

    def ok(self, col: OpenColumn, d: int) -> bool:
        """Whether row ``d`` of ``col`` has a value."""
        lo, ok, _ = self._cols.get(id(col)) or self._load(col)
        return ok is None or ok[d - lo]

    def good(self, cols: list[OpenColumn], r0: int, r1: int) -> list[bool] | None:
        """Whether each of rows ``r0 .. r1-1`` has a value in every column of ``cols`` (not list
        items); None when all have."""
        out = None
        for col in cols:
            lo, ok, _ = self._cols.get(id(col)) or self._load(col)
            part = None if ok is None else ok[r0 - lo : r1 - lo]
            if part is not None and not all(part):
                out = part if out is None else [x and y for x, y in zip(out, part, strict=True)]
        return out

    def rows(self, col: OpenColumn, r0: int, r1: int) -> list[Any] | None:
        """Rows ``r0 .. r1-1`` of ``col`` (not list items) as ``get`` gives them, anything where
        a row has no value; None when the column is read row by row."""
        lo, _, vals = self._cols.get(id(col)) or self._load(col)
        return None if vals is _DIRECT else vals[r0 - lo : r1 - lo]

    def get(self, col: OpenColumn, d: int, filename: str) -> Any:
        """Row ``d`` of ``col`` (one with a value) as ``value()`` returns it."""
        lo, _, vals = self._cols.get(id(col)) or self._load(col)
        if vals is _DIRECT:  # as value() reads it
            return leaf_value(col, d, filename, self.as_torch)
        return vals[d - lo]


def column_rows(col: OpenColumn, lo: int, hi: int, ok: list[bool] | None, as_torch: bool) -> list[Any] | None:
    """Rows ``lo .. hi-1`` of ``col`` as the Python values ``value()`` gives for them (anything
    where ``ok`` says a row has no value), decoded by the column's leaf view from one read of
    their values; None when they hold more than :data:`BLOCK_BYTES` (read them one by one)."""
    o = col.offsets
    units = hi - lo if o is None else int(o[hi] - o[lo])  # of values: rows, or elements with offsets
    if units * col.unit_nbytes > BLOCK_BYTES:
        return _DIRECT
    if col.info.kind == "pickle" and not col.allow_pickle:
        # row by row, as value() reads it: PickleNotAllowedError only for a row that is read and
        # holds a pickled value, not for a block whose other rows hold the leaf's other variants
        return _DIRECT
    info = col.info
    view = col.view(lo, hi)
    if info.kind == "fixed" and (info.dtype in F.PY_SCALARS or info.dtype in F.PY_HEADERS):
        # py* scalars, lists of them and container headers: one tolist() for the block
        rows: list[Any] = view[:].tolist()
        return rows if ok is None else [x if has else None for x, has in zip(rows, ok, strict=True)]
    if info.kind == "ragged" and info.dtype in F.PY_SCALARS and info.inner_shape is not None:
        # lists of Python numbers (token ids, COCO boxes): a tolist() of each row's slice of
        # one read (faster than slicing one list of every row's numbers)
        flat, bounds = view.values, view.offsets.tolist()
        rows = [flat[x:y].tolist() for x, y in zip(bounds[:-1], bounds[1:], strict=True)]
        return rows if ok is None else [x if has else None for x, has in zip(rows, ok, strict=True)]
    rows = view.to_list()
    if info.kind in ("fixed", "ragged"):
        # (a fixed view's rows are views of one array: each gets its own, as value() returns)
        own = info.kind == "fixed"
        return [None if x is None else to_python(info, x.copy() if own else x, as_torch) for x in rows]
    return rows


def iter_values(files: Any, as_torch: bool) -> Iterator[tuple[str, int, Any]]:
    """(filename, frame_idx, value) of every row of ``files`` (the reader's ``OutputFiles``) in order:
    the index read a block of files at a time, each column's rows of a block decoded once."""
    n_files = len(files.filenames)
    builders: dict[tuple[int, int], Any] = {}  # (layout, id of the file's key orders) -> static_builder
    for i0 in range(0, n_files, BLOCK_FILES):
        i1 = min(i0 + BLOCK_FILES, n_files)
        fo = np.asarray(files.frame_offsets[i0 : i1 + 1], dtype=np.int64)
        if len(fo) != i1 - i0 + 1 or fo[0] < 0 or fo[-1] > files.n_rows or np.any(fo[1:] < fo[:-1]):
            for i in range(i0, i1):  # the per-file check names the entry
                files.checks.file_rows(i)
        starts = fo.tolist()
        layouts = files.file_layout[i0:i1].tolist()
        names = files.filenames[i0:i1]
        orders = files.key_orders.of_files(i0, i1)
        a, b = starts[0], starts[-1]
        f = 0
        for ra in range(a, b, BLOCK_ROWS):
            rb = min(ra + BLOCK_ROWS, b)
            frames = np.asarray(files.frame_idx[ra:rb]).tolist()  # (checks the rows' index block)
            block = Block(ra, rb, files.list_offsets, as_torch)
            by_row = set()  # the builders with a column this block reads row by row
            r = ra
            while r < rb:
                while starts[f + 1] <= r:
                    f += 1
                layout = layouts[f]
                plan = files.row_plan(layout)
                name = names[f]
                order = orders[f]
                key = (layout, id(order))  # (a file's orders are the store's objects: alive, one per order)
                if key not in builders:
                    builders[key] = static_builder(plan, order)
                build, value = builders[key], ABSENT
                if build is not None and key not in by_row:  # the run of rows of this layout and order at once
                    g = f
                    while (
                        starts[g + 1] < rb
                        and layouts[g + 1] == layout
                        and orders[g + 1] is order
                    ):
                        g += 1
                    r1 = min(starts[g + 1], rb)
                    run = gc_paused(build.run, block, r, r1)
                    if run is not None:
                        vals, whole = run
                        if whole and starts[f : g + 2] == list(range(r, r1 + 1)):  # one row a file (an LLM output each)
                            yield from zip(names[f : g + 1], frames[r - ra : r1 - ra], vals, strict=True)
                        else:
                            for h in range(f, g + 1):
                                for q in range(max(r, starts[h]), min(starts[h + 1], r1)):
                                    v = vals[q - r]
                                    if v is ABSENT:
                                        v = gc_paused(row_value, plan, q, names[h], as_torch, block, order)
                                    yield names[h], frames[q - ra], v
                        r = r1
                        continue
                    by_row.add(key)
                if build is not None:
                    value = gc_paused(build, block, r, name)
                if value is ABSENT:
                    value = gc_paused(row_value, plan, r, name, as_torch, block, order)
                yield name, frames[r - ra], value
                r += 1
