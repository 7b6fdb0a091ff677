"""The index arrays of an open output, read chunk by chunk (:class:`LazyArray`) and checked block by
block (:class:`IndexChecks`): every docs/FORMAT.md *Invariant* of a block holds before anything in it
is served; ``spillmerge verify`` runs the same checks over every block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._format import invariants as V
from .._storage import Storage
from .cache import ChunkCache, Chunks
from .outputstore import chunk_reader

ROW_BLOCK = 1 << 14
"""Rows checked together (and at open, the first block): the unit of the lazy checks, a quarter of
an index chunk."""

Raise = Callable[[list[V.Problem]], None]


class LazyArray:
    """A 1-d (or rows x dims) index array read chunk by chunk through the output's chunk cache,
    each chunk checked by ``check(first, chunk)`` (``first``: its first element) when read, and
    every element served only after ``hook`` checked its rows. Indexing as numpy for the forms the
    reader uses: an int (an element, or a row of a 2-d array), a slice, an int array;
    ``np.asarray`` reads it whole."""

    def __init__(
        self,
        node: Any,
        cache: ChunkCache,
        storage: Storage,
        dtype: Any = np.int64,
        check: Callable[[int, np.ndarray], None] | None = None,
    ) -> None:
        self.rel: str = node.path
        self.shape: tuple[int, ...] = tuple(int(d) for d in node.shape)
        self.dtype = np.dtype(dtype)
        self._n = self.shape[0]
        self._k = max(int(node.chunks[0]), 1)
        self._read = chunk_reader(node, storage)
        self.chunk = Chunks(cache, node.path, self._load)
        """``chunk(c)``: chunk ``c`` (read-only), checked by ``check`` on its first read; no row hook."""
        self._check = check
        self.hook: Callable[[int, int], tuple[int, int]] | None = None
        """``hook(a, b)``: make elements ``a .. b-1`` safe to serve (check their rows); returns the
        range of elements now known checked (covering ``a .. b-1``)."""
        self._hot: tuple[int, int, int, np.ndarray] | None = None  # (lo, hi, chunk start, chunk)

    def __len__(self) -> int:
        return self._n

    def _load(self, c: int) -> np.ndarray:
        arr = np.asarray(self._read(c)).astype(self.dtype, copy=False)
        if self._check is not None:
            self._check(c * self._k, arr)
        return arr

    def span(self, lo: int, hi: int) -> np.ndarray:
        """Elements ``lo .. hi-1`` (clipped to the array), chunk by chunk; no row hook (for checks)."""
        lo, hi = max(lo, 0), min(hi, self._n)
        if hi <= lo:
            return np.empty((0, *self.shape[1:]), dtype=self.dtype)
        k = self._k
        parts = [self.chunk(c)[max(lo - c * k, 0) : hi - c * k] for c in range(lo // k, (hi - 1) // k + 1)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _serve(self, lo: int, hi: int) -> np.ndarray:
        if self.hook is not None and hi > lo:
            self.hook(lo, hi)
        return self.span(lo, hi)

    def _one(self, i: int) -> Any:
        hot = self._hot
        if hot is not None and hot[0] <= i < hot[1]:
            return hot[3][i - hot[2]]
        if not 0 <= i < self._n:
            raise IndexError(f"index {i} out of range for {self.rel} ({self._n} entries)")
        c = i // self._k
        lo, hi = c * self._k, min((c + 1) * self._k, self._n)
        if self.hook is not None:
            a, b = self.hook(i, i + 1)
            lo, hi = max(lo, a), min(hi, b)
        arr = self.chunk(c)
        self._hot = (lo, hi, c * self._k, arr)
        return arr[i - c * self._k]

    def __getitem__(self, sel: Any) -> Any:
        if isinstance(sel, (int, np.integer)):
            i = int(sel)
            return self._one(i + self._n if i < 0 else i)
        if isinstance(sel, slice):
            a, b, step = sel.indices(self._n)
            if step == 1:
                return self._serve(a, max(a, b))
            sel = np.arange(a, b, step)
        idx = np.asarray(sel)
        idx = np.where(idx < 0, idx + self._n, idx).astype(np.int64)
        if not idx.size:
            return np.empty((*idx.shape, *self.shape[1:]), dtype=self.dtype)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        if lo < 0 or hi > self._n:
            raise IndexError(f"index out of range for {self.rel} ({self._n} entries)")
        return self._serve(lo, hi)[idx - lo]

    def item(self, i: int) -> Any:
        """Element ``i`` of a 1-d array as a Python scalar: a row's offset or a file's layout, read
        once or more per row in order, so the chunk last served answers without ``__getitem__``'s
        dispatch or a numpy scalar (``ndarray.item``)."""
        hot = self._hot
        if hot is not None and hot[0] <= i < hot[1]:
            return hot[3].item(i - hot[2])
        return self[i].item()

    def whole(self) -> np.ndarray:
        """Every element (checked): for work over the whole output (coverage, ``index_arrays``)."""
        return self._serve(0, self._n)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.whole()
        return out if dtype is None else out.astype(dtype, copy=False)

    def searchsorted(self, v: int, side: str = "left", hint: int | None = None) -> int:
        """Where ``v`` goes in this sorted 1-d array (numpy's ``searchsorted``), reading the chunks
        a bisection over chunk starts needs (from chunk ``hint`` first when given); no row hook."""
        k = self._k
        m = -(-self._n // k)  # chunks (none: lo = hi = 0, so 0)

        def before(c: int) -> bool:  # chunk c starts before v's position
            x = int(self.chunk(c)[0])
            return x < v if side == "left" else x <= v

        lo, hi = 0, m  # the last chunk that starts before v's position is in lo-1 .. hi-1
        if hint is not None and 0 <= hint < m:
            if before(hint):
                last = int(self.chunk(hint)[-1])
                if (last >= v if side == "left" else last > v) or hint == m - 1:  # v's position is in it
                    return hint * k + int(np.searchsorted(self.chunk(hint), v, side=side))  # type: ignore[call-overload]
                lo = hint + 1
                if not before(lo):  # v's position is the next chunk's start
                    return lo * k
            else:
                hi = hint
        while lo < hi:
            mid = (lo + hi) // 2
            if before(mid):
                lo = mid + 1
            else:
                hi = mid
        c = lo - 1
        if c < 0:
            return 0
        return c * k + int(np.searchsorted(self.chunk(c), v, side=side))  # type: ignore[call-overload]


class Found(Exception):
    """The problems (``args[0]``) found, raised by a ``raise_`` that collects them (``verify``)
    rather than refuses the output: :class:`IndexChecks` keeps them and goes on."""


class IndexChecks:
    """The row-block checks of an open output (module docstring): :meth:`rows` before serving
    elements of a per-row array."""

    def __init__(self, files: Any, columns: dict[str, Any], raise_: Raise) -> None:
        self.n_rows = files.n_rows
        self._files = files  # the reader's OutputFiles: its index arrays and filenames
        self._fo: LazyArray = files.frame_offsets
        self._cols = columns  # name -> column.OpenColumn (offsets / shapes / valid: LazyArray)
        self._raise = raise_
        self.found: list[V.Problem] = []
        """The problems a collecting ``raise_`` (:class:`Found`) was given, the checks going on."""
        self._listed = {name: np.array([name in lay for lay in files.layouts], dtype=bool) for name in files.columns}
        self._done: set[int] = set()
        self._last_file = 0
        self._variants = [g for g in files.variants if g[0] in columns]

    def _fail(self, rel: str, problem: str) -> None:
        """Refuse the output for one problem of the array ``rel`` (or, with a collecting
        ``raise_``, keep it: the checks after it need nothing it broke)."""
        try:
            self._raise([(rel, problem)])
        except Found as exc:
            self.found.extend(exc.args[0])

    def rows(self, a: int, b: int) -> tuple[int, int]:
        """Check the blocks over rows ``a .. b-1``; returns the rows now known checked."""
        j0, j1 = a // ROW_BLOCK, max(a, b - 1) // ROW_BLOCK
        for j in range(j0, j1 + 1):
            if j not in self._done:
                self._check(j)
                self._done.add(j)  # (set.add is atomic: threads checking a block at once both pass)
        return j0 * ROW_BLOCK, min((j1 + 1) * ROW_BLOCK, self.n_rows)

    def edges(self, a: int, b: int) -> tuple[int, int]:
        """Hook of a column's ``offsets`` (``n_rows + 1`` entries): entry ``e`` is checked with the
        block of row ``min(e, n_rows - 1)``; returns the entries now known checked."""
        last = max(self.n_rows - 1, 0)
        lo, hi = self.rows(min(a, last), min(max(b - 1, a), last) + 1)
        return lo, hi + 1

    def file_rows(self, i: int) -> tuple[int, int]:
        """Rows ``a, b`` of file ``i``, its blocks checked."""
        fo = self._fo  # (no row hook: each chunk is checked when first read)
        a, b = fo.item(i), fo.item(i + 1)
        if not 0 <= a <= b <= self.n_rows:
            self._fail(self._fo.rel, f"entries {i}..{i + 1} are {a}, {b}: decreasing or outside 0..{self.n_rows}")
        self._last_file = i
        if b > a:
            j = a // ROW_BLOCK
            if j != (b - 1) // ROW_BLOCK or j not in self._done:  # (the common case: a block checked before)
                self.rows(a, b)
        return a, b

    def in_layout(self, name: str, layout_of_row: np.ndarray) -> np.ndarray:
        """Per row (``layout_of_row``: its file's layout), whether the layout lists column ``name``."""
        listed = self._listed[name]
        return listed[layout_of_row] if len(listed) else np.zeros(len(layout_of_row), dtype=bool)

    def _where(self, r: int, f0: int, starts: np.ndarray) -> str:
        i = f0 + int(np.searchsorted(starts, r, side="right")) - 1
        return f"row {r} (file {i}, {str(self._files.filenames[i])!r:.200})"

    def _check(self, j: int) -> None:
        r0, r1 = j * ROW_BLOCK, min((j + 1) * ROW_BLOCK, self.n_rows)
        fo, n_files = self._fo, len(self._fo) - 1
        hint = self._last_file // fo._k
        f0 = max(fo.searchsorted(r0, "right", hint) - 1, 0)
        f1 = min(max(fo.searchsorted(r1, "left", hint), f0 + 1), n_files)
        starts = fo.span(f0, f1 + 1)
        if len(starts) and (np.any(np.diff(starts) < 0) or int(starts[0]) > r0 or int(starts[-1]) < r1):
            self._raise([(fo.rel, f"entries {f0}..{f1} decrease or do not cover rows {r0}..{r1 - 1}")])
        self._frames(r0, r1, f0, starts)
        for name, arr in self._files.prov.items():
            least = 1 if name == "frame_copies" else 0
            vals = arr.span(r0, r1)
            bad = np.flatnonzero(vals < least)
            if len(bad):
                what = f"row {r0 + int(bad[0])} holds {int(vals[bad[0]])} < {least}"
                self._fail(arr.rel, f"{what} ({len(bad)} such rows in rows {r0}..{r1 - 1})")
        lens = np.diff(np.clip(starts, r0, r1))  # (no files: no rows, no layouts)
        layout_of_row = np.repeat(self._files.file_layout.span(f0, f1), lens)
        valid: dict[str, np.ndarray | None] = {}
        none: dict[str, np.ndarray | None] = {}
        for name, col in self._cols.items():
            o = None if col.offsets is None else col.offsets.span(r0, r1 + 1)
            shapes = None if col.shapes is None else col.shapes.span(r0, r1)
            v = valid[name] = None if col.valid is None else np.asarray(col.valid.span(r0, r1), dtype=bool)
            n = none[name] = None if col.none is None else np.asarray(col.none.span(r0, r1), dtype=bool)
            in_layout = self.in_layout(name, layout_of_row)
            for p in column_row_problems(col.info, o, shapes, v, in_layout, r0, r1 == self.n_rows, n):
                self._fail(*p)
        for p in variant_problems(self._variants, self._cols, valid, r0, none):
            self._fail(*p)

    def _frames(self, r0: int, r1: int, f0: int, starts: np.ndarray) -> None:
        rel = self._files.frame_idx.rel
        lo = r0 - 1 if r0 else r0  # the row before: a file across the blocks' edge ascends across it
        fi_lo = self._files.frame_idx.span(lo, r1)
        fi = fi_lo[r0 - lo :]
        neg = np.flatnonzero(fi < 0)
        if len(neg):
            what = f"{self._where(r0 + int(neg[0]), f0, starts)} holds frame index {int(fi[neg[0]])} < 0"
            self._fail(rel, f"{what} ({len(neg)} negative in rows {r0}..{r1 - 1})")
        step_ok = np.diff(fi_lo) > 0
        inner = starts[(starts > lo) & (starts < r1)]
        step_ok[inner - lo - 1] = True  # a file's first row may be below the previous file's last
        bad = np.flatnonzero(~step_ok)
        if len(bad):
            r = lo + int(bad[0]) + 1
            at = f"{self._where(r, f0, starts)} holds {int(fi_lo[r - lo])} after {int(fi_lo[r - lo - 1])}"
            what = f"frame indices are not strictly ascending within a file: {at}"
            self._fail(rel, f"{what} ({len(bad)} such rows in rows {r0}..{r1 - 1})")


def column_row_problems(
    info: Any,
    o: np.ndarray | None,
    shapes: np.ndarray | None,
    v: np.ndarray | None,
    in_layout: np.ndarray,
    r0: int,
    last: bool,
    none: np.ndarray | None,
) -> list[V.Problem]:
    """What rows ``r0 ..`` of column ``info`` break: their ``offsets`` ``o`` (one entry more;
    ``last``: they end the column) and ``shapes`` against ``values``; a value or a None only where
    the row's file lists the column (``in_layout``); no values where a row has none (``v``, None:
    all have); None only where a row has no value (``none``)."""
    rel, r1 = f"columns/{info.name}", r0 + len(in_layout)
    out: list[V.Problem] = []
    if o is not None:
        vlen = int(info.arrays["values"].shape[0])
        out += V.offsets_block_problems(f"{rel}/offsets", o, r0, last, vlen, f"{rel}/values")
        step = np.diff(o)
        if info.kind == "fixed" and np.any(step > 1):
            r = int(np.flatnonzero(step > 1)[0])
            out.append((f"{rel}/offsets", f"row {r0 + r} spans {int(step[r])} rows of a fixed column"))
        if shapes is not None:
            out += _shapes_problems(info, shapes, step, r0)
    has = np.ones(r1 - r0, dtype=bool) if v is None else v
    within = f"in rows {r0}..{r1 - 1}"
    for arr, rel_arr, what in (
        (has, f"{rel}/{'values' if v is None else 'valid'}", "has a value"), (none, f"{rel}/none", "holds None")
    ):  # fmt: skip
        bad = np.zeros(0, np.int64) if arr is None else np.flatnonzero(arr & ~in_layout)
        if len(bad):
            said = f"row {r0 + int(bad[0])} {what}, but its file's layout does not list this column"
            out.append((rel_arr, f"{said} ({len(bad)} such rows {within})"))
    if none is not None and np.any(none & has):
        r = r0 + int(np.flatnonzero(none & has)[0])
        out.append((f"{rel}/none", f"row {r} holds None and a value"))
    if o is not None and v is not None:
        bad = np.flatnonzero(~v & (step != 0))
        if len(bad):
            what = f"row {r0 + int(bad[0])} has no value but spans {int(step[bad[0]])}"
            out.append((f"{rel}/offsets", f"{what} ({len(bad)} such rows {within})"))
        if info.kind == "fixed" and np.any(v & (step != 1)):
            r = int(np.flatnonzero(v & (step != 1))[0])
            what = f"row {r0 + r} has a value but spans {int(step[r])} rows of a compact fixed column"
            out.append((f"{rel}/offsets", what))
    return out


def _shapes_problems(info: Any, shapes: np.ndarray, step: np.ndarray, r0: int) -> list[V.Problem]:
    rel = f"columns/{info.name}/shapes"
    if info.kind == "strlist":  # strings per row, whose n uint32 lengths open its bytes
        bad = np.flatnonzero((shapes[:, 0] < 0) | (4 * shapes[:, 0] > step))
        if not len(bad):
            return []
        r = int(bad[0])
        what = f"row {r0 + r} holds {int(shapes[r, 0])} strings, more than its {int(step[r])} bytes can"
        return [(rel, f"{what} ({len(bad)} such rows)")]
    out: list[V.Problem] = []
    if np.any(shapes < 0):
        r = int(np.flatnonzero((shapes < 0).any(axis=1))[0])
        out.append((rel, f"row {r0 + r} has a negative dimension {shapes[r].tolist()}"))
    inner = int(np.prod(info.inner_shape)) if info.inner_shape else 1
    elems, problems = V.shape_products(shapes, rel, base=r0)
    out += problems
    bad = np.flatnonzero(elems != step * inner)
    if len(bad):
        r = int(bad[0])
        what = f"row {r0 + r} has shape {shapes[r].tolist()}, but its offsets span {int(step[r])}"
        out.append((rel, f"{what} ({len(bad)} such rows)"))
    return out


def variant_problems(
    groups: list[list[str]], columns: dict[str, Any], valid: dict[str, np.ndarray | None], r0: int,
    none: dict[str, np.ndarray | None],
) -> list[V.Problem]:  # fmt: skip
    """A row (of rows ``r0 ..``, ``valid`` and ``none`` each column's) has a value or a None in
    one variant of its leaf at most."""
    out: list[V.Problem] = []
    for group in groups:
        leaf = list(columns[group[0]].info.leaf)
        absent = [name for name in group if valid[name] is None]
        if absent:
            what = f"missing: leaf {leaf!r:.200} has {len(group)} variant columns, so each has rows without a value"
            out.append((f"columns/{absent[0]}/valid", what))
            continue
        flags = [valid[name] for name in group] + [none[name] for name in group if none[name] is not None]
        count = np.sum([np.asarray(f) for f in flags], axis=0, dtype=np.int64)
        if count.size and int(count.max()) > 1:
            r = r0 + int(np.argmax(count > 1))
            shown = ", ".join(f"columns/{n}" for n in group)
            what = f"row {r} has a value in more than one variant of leaf {leaf!r:.200} ({shown})"
            out.append((f"columns/{group[0]}/valid", what))
    return out
