"""Every row of an output as the Python object that was written, in (filename, frame) order
(``MergedStore.iter_values``): ``value()``'s decoders run on blocks of rows, the index read a block of
files at a time, memory bounded by :data:`BLOCK_ROWS` and :data:`BLOCK_BYTES`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._format import common as F
from .._format import lists as L
from .._util.gcpause import gc_paused
from .rowvalue import ABSENT, leaf_value, records, row_value, static_builder, to_python

if TYPE_CHECKING:
    from .views import OpenColumn

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
        got = self._cols.get(id(col))
        lo, ok, _ = got if got is not None else self._load(col)
        return ok is None or ok[d - lo]

    def run(self, flat: list[tuple[str, OpenColumn]], r0: int, r1: int) -> list[dict[str, Any]] | None:
        """Rows ``r0 .. r1-1`` of a layout whose value is a flat dict (key, column): the dicts, in
        one ``records`` pass over the columns' decoded rows; None when a column of them is read
        row by row or a row lacks a value (the row-by-row way)."""
        slices = []
        for _, col in flat:
            got = self._cols.get(id(col))
            lo, ok, vals = got if got is not None else self._load(col)
            if vals is _DIRECT or (ok is not None and not all(ok[r0 - lo : r1 - lo])):
                return None
            slices.append(vals[r0 - lo : r1 - lo])
        return gc_paused(records, [k for k, _ in flat], slices)  # type: ignore[no-any-return]

    def get(self, col: OpenColumn, d: int, filename: str) -> Any:
        """Row ``d`` of ``col`` (one with a value) as ``value()`` returns it."""
        got = self._cols.get(id(col))
        lo, _, vals = got if got is not None else self._load(col)
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
        # lists of Python numbers (token ids, COCO boxes): one tolist() sliced per row
        flat, bounds = view.values.tolist(), view.offsets.tolist()
        return [None if ok is not None and not ok[j] else flat[bounds[j] : bounds[j + 1]] for j in range(hi - lo)]
    rows = view.to_list()
    if info.kind in ("fixed", "ragged"):
        dtype, kind = info.dtype, info.kind
        # (a fixed view's rows are views of one array: each gets its own, as value() returns)
        own = info.kind == "fixed"
        return [None if x is None else to_python(dtype, kind, x.copy() if own else x, as_torch) for x in rows]
    return rows


def iter_values(files: Any, as_torch: bool) -> Iterator[tuple[str, int, Any]]:
    """(filename, frame_idx, value) of every row of ``files`` (the reader's ``OutputFiles``) in order
    (module docstring)."""
    n_files = len(files.filenames)
    offs = files.list_offsets
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
        a, b = starts[0], starts[-1]
        f = 0
        for ra in range(a, b, BLOCK_ROWS):
            rb = min(ra + BLOCK_ROWS, b)
            frames = np.asarray(files.frame_idx[ra:rb]).tolist()  # (checks the rows' index block)
            block = Block(ra, rb, offs, as_torch)
            r = ra
            while r < rb:
                while starts[f + 1] <= r:
                    f += 1
                layout = layouts[f]
                plan = files.row_plan(layout)
                name = names[f]
                order = files.key_orders.of_file(i0 + f)
                key = (layout, id(order))  # (a file's orders are the store's objects: alive, one per order)
                if key not in builders:
                    builders[key] = static_builder(plan, order)
                build, value = builders[key], ABSENT
                flat = getattr(build, "flat", None)
                if flat is not None:  # a flat dict: the run of rows of this layout and order at once
                    g = f
                    while (
                        starts[g + 1] < rb
                        and layouts[g + 1] == layout
                        and files.key_orders.of_file(i0 + g + 1) is order
                    ):
                        g += 1
                    r1 = min(starts[g + 1], rb)
                    run = block.run(flat, r, r1)
                    if run is not None:
                        if starts[f : g + 2] == list(range(r, r1 + 1)):  # one row a file (an LLM output each)
                            yield from zip(names[f : g + 1], frames[r - ra : r1 - ra], run, strict=True)
                        else:
                            for h in range(f, g + 1):
                                for q in range(max(r, starts[h]), min(starts[h + 1], r1)):
                                    yield names[h], frames[q - ra], run[q - r]
                        r = r1
                        continue
                if build is not None:
                    value = gc_paused(build, block, r, name)
                if value is ABSENT:
                    value = gc_paused(row_value, plan, r, name, as_torch, offs, block, order)
                yield name, frames[r - ra], value
                r += 1
