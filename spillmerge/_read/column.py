"""One column of an open output (``OpenColumn``): its header and arrays, rows read through the
output's chunk cache, rows read in order in blocks, and the dtype rows are returned as."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import CorruptSpillError
from .._format import common as F
from .._format.invariants import StoredColumn, read_rows
from .._storage import Storage
from .cache import ChunkCache, Chunks
from .index import ROW_BLOCK
from .outputstore import chunk_reader, damaged


def real_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a reader returns for dtype ``name``: numpy's own, the ``ml_dtypes`` type
    of the same name (bfloat16, float8 ...) where ml_dtypes has one, else the raw-bit storage type
    (complex32, float4_e2m1fn_x2, bits*)."""
    dt = F.DTYPES[name]
    if dt.native:
        return np.dtype(name)
    if name not in F.RAW_BITS:  # py* scalars, text, headers: their storage type
        return np.dtype(dt.storage)
    import ml_dtypes  # (a dependency, imported when a dtype needs it)

    ml = getattr(ml_dtypes, name, None)
    if ml is not None and np.dtype(ml).itemsize == dt.itemsize:
        return np.dtype(ml)
    return np.dtype(dt.storage)


ROW_BLOCK_ROWS = 256
ROW_BLOCK_BYTES = 1 << 16
"""Bounds of the rows of a column decoded together when read in order
(:meth:`OpenColumn.ahead`): at most this much memory per column."""


class OpenColumn:
    """One column of an open output: its header, arrays, and the row-layout arrays (``offsets``,
    ``shapes``, ``valid``: :class:`~spillmerge._read.index.LazyArray` s, read a chunk at a time and
    checked block by block before a row of them is served). Its ``values`` are read through the
    output's :class:`~spillmerge._read.cache.ChunkCache` (:meth:`rows`)."""

    def __init__(
        self,
        info: StoredColumn,
        n_rows: int,
        allow_pickle: bool,
        cache: ChunkCache,
        storage: Storage,
        view_cls: Any,
    ) -> None:
        self.info = info
        self.n_rows = n_rows
        self.allow_pickle = allow_pickle
        # Read once here: a row read is a few microseconds, and zarr's properties cost as much.
        self.values = values = info.arrays["values"]
        """The column's ``values`` array (zarr)."""
        self.chunk_rows = max(int(values.chunks[0]), 1)
        self.n_units = int(values.shape[0])  # over every row: a ragged leaf's items
        self.unit_shape = tuple(values.shape[1:])
        self.stored_dtype = values.dtype
        self.unit_nbytes = int(np.prod(self.unit_shape, dtype=np.int64)) * self.stored_dtype.itemsize
        """Bytes of one unit of ``values`` (a row, or an element of a column with offsets)."""
        # Chunk c of values (read-only), decoded once, then served from the cache; uncompressed
        # chunks straight from storage (one get + CRC-32C), others through zarr.
        self._read_chunk = chunk_reader(values, storage)
        self.chunk = Chunks(cache, values.path, self._read_chunk)
        self._read_past_cache = cache.read_from_storage
        self._damage_found = cache.damage_found
        self.real: np.dtype[Any] = real_dtype(info.dtype) if info.kind in ("fixed", "ragged") else values.dtype
        """The dtype rows are returned as (ml_dtypes bfloat16 ...; the storage dtype for other kinds)."""
        self.native = self.real == self.stored_dtype
        self.py_scalar = info.kind == "fixed" and info.ndim == 0 and info.dtype in (*F.PY_SCALARS, *F.PY_HEADERS)
        """Rows read as Python scalars (``values.leaf_value``): ``py*`` leaves and container headers."""
        self.view_cls = view_cls
        """The leaf view class of the column's kind (``_read.views.VIEWS``)."""
        self._block: tuple[int, int, list[Any]] | None = None  # rows read in order (ahead)
        self._next_row = -1
        self.offsets: Any = None
        """int64 ``(n_rows + 1,)`` (columns with offsets): a ``LazyArray`` set by the reader."""
        self.shapes: Any = None
        """int64 ``(n_rows, ndim)`` (ragged columns without ``inner_shape``): a ``LazyArray``."""
        self.valid: Any = None
        """bool ``(n_rows,)`` (a ``LazyArray``: ``v[r]``, ``v[a:b]``, ``np.asarray(v)``; whole for a
        list's items) set by the reader, or None when every row has a value."""
        self.none: Any = None
        """bool ``(n_rows,)``: rows that hold None here (they have no value), as ``valid``; None
        when no row does."""

    def damaged(self, what: str) -> CorruptSpillError:
        """The error for damage ``what`` found in this column's values (raised instead: that the
        output was replaced since it was opened, when it was)."""
        self._damage_found()
        return damaged(f"{self.values.store_path}", what)

    def unit(self, r: int) -> np.ndarray:
        """Row ``r`` of a fixed column, of the storage dtype, read-only (a view of its cached
        chunk); a compact column's row without a value (its ``values`` hold only the rows with
        one) reads as zeros."""
        o = self.offsets
        if o is not None:
            lo = int(o[r])
            if int(o[r + 1]) <= lo:
                return np.zeros(self.unit_shape, dtype=self.stored_dtype)
            r = lo
        c, i = divmod(r, self.chunk_rows)
        return self.chunk(c)[i]  # type: ignore[no-any-return]

    def ahead(self, r: int) -> Any:
        """Row ``r`` as the column's view decodes it (None for a row without a value) from rows
        decoded together: the block kept, else one from row ``r`` when it comes right after row
        ``r - 1`` (within :data:`ROW_BLOCK_ROWS` and :data:`ROW_BLOCK_BYTES`); None when not in
        order, too large or damaged (each row is then read alone)."""
        block = self._block
        if block is not None and block[0] <= r < block[1]:
            return block[2][r - block[0]]
        sequential = r == self._next_row
        self._next_row = r + 1
        if not sequential:
            return None
        limit = ROW_BLOCK_BYTES // max(self.unit_nbytes, 1)
        k = self.chunk_rows
        # Never past the block of index rows (ROW_BLOCK) or the chunk of values that row r reads:
        # the rows read ahead are checked, and their chunks read, no sooner than row r's are.
        stop = min(r + ROW_BLOCK_ROWS, self.n_rows, (r // ROW_BLOCK + 1) * ROW_BLOCK)
        if self.offsets is None:  # row r is unit r
            n = min(stop - r, limit, (r // k + 1) * k - r)
        else:
            offs = np.asarray(self.offsets[r : stop + 1])
            lo = int(offs[0])
            n = int(np.searchsorted(offs, min(lo + limit, (lo // k + 1) * k), side="right")) - 1
        if n < 1:
            return None
        try:
            self._block = (r, r + n, self.view(r, r + n).to_list())
        except CorruptSpillError:
            return None
        return self._block[2][0]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Units ``lo .. hi-1`` of ``values`` (rows, or elements with offsets), a new array: chunks
        the read covers partly go through the cache, chunks it covers whole straight into the result."""
        k, n = self.chunk_rows, self.n_units
        if hi <= lo:
            return np.empty((0, *self.unit_shape), dtype=self.stored_dtype)
        c0, c1 = lo // k, (hi - 1) // k
        head_whole = lo == c0 * k and min((c0 + 1) * k, n) <= hi
        if c0 == c1 and not head_whole:  # part of one chunk: one row, the common case
            base = c0 * k
            return self.chunk(c0)[lo - base : hi - base].copy()
        if c0 == c1:  # one whole chunk (a small output's column): one read, past the cache
            arr = self._past_cache(self._read_chunk, c0)
            return arr if arr.flags.writeable else arr.copy()  # (a view of the fetched bytes is read-only)
        out = np.empty((hi - lo, *self.unit_shape), dtype=self.stored_dtype)
        pos = lo
        if not head_whole:
            head = self.chunk(c0)[lo - c0 * k :]
            out[: len(head)] = head
            pos += len(head)
        straight_end = hi if hi == min((c1 + 1) * k, n) else c1 * k  # the tail chunk whole, or not
        if straight_end > pos:
            self._past_cache(read_rows, self.values, pos, straight_end, out=out[pos - lo : straight_end - lo])
            pos = straight_end
        if pos < hi:
            out[pos - lo :] = self.chunk(c1)[pos - c1 * k : hi - c1 * k]
        return out

    def _past_cache(self, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``read(*args, **kwargs)`` from storage, not through the cache, checked as the cache's reads are."""
        try:
            got = read(*args, **kwargs)
        except CorruptSpillError:
            self._damage_found()
            raise
        self._read_past_cache()
        return got

    def view(self, start: int, stop: int, filename: str | None = None) -> Any:
        """Rows ``start .. stop-1`` as this column's leaf view (``_read.views``)."""
        return self.view_cls(self, start, stop, filename)
