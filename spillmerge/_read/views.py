"""Leaf views of an output: one leaf column, over the rows of one file or of every file.

``view[i]`` is row ``i``'s value as written (``None`` where the row has no value); slices and the
flat forms (``values`` / ``offsets`` / ``shapes``) serve vectorised work. One class per kind of
column (docs/FORMAT.md section 2, *Columns*), all on :class:`LeafView`.
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import CorruptSpillError, PickleNotAllowedError, RaggedShapeError, require_torch
from .._format import common as F
from .._format.invariants import StoredColumn, read_rows
from .._storage import Storage
from .cache import ChunkCache
from .index import ROW_BLOCK
from .leafdict import LeafDict
from .rawchunk import chunk_reader

if TYPE_CHECKING:
    import torch


def real_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a reader returns for dtype ``name``: numpy's own, the ``ml_dtypes`` type
    of the same name (bfloat16, float8 ...) where ml_dtypes has one, else the raw-bit storage type
    (complex32, float4_e2m1fn_x2, bits*)."""
    dt = F.DTYPES[name]
    if dt.native:
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:  # a dependency; without it the raw bits are still exact
        return np.dtype(dt.storage)
    ml = getattr(ml_dtypes, name, None)
    if ml is not None and np.dtype(ml).itemsize == dt.itemsize:
        return np.dtype(ml)
    return np.dtype(dt.storage)


ROW_BLOCK_ROWS = 256
ROW_BLOCK_BYTES = 1 << 16
"""Bounds of the rows of a column with offsets read together when read in order
(:meth:`OpenColumn.row_block`): at most this much memory per column."""


def _dims(shape: Any) -> tuple[int, ...]:
    """A shape as plain ints: a tuple of numpy ints would print as ``(np.int64(4),)`` in messages."""
    return tuple(int(d) for d in shape)


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
        cache: ChunkCache | None = None,
        storage: Storage | None = None,
    ) -> None:
        self.info = info
        self.n_rows = n_rows
        self.allow_pickle = allow_pickle
        self.cache = cache if cache is not None else ChunkCache(0)
        # Read once here: a row read is a few microseconds, and zarr's properties cost as much.
        values = info.arrays["values"]
        self._key = values.path
        self._k = max(int(values.chunks[0]), 1)
        self._n = int(values.shape[0])
        self._unit = tuple(values.shape[1:])
        self._dtype = values.dtype
        self.unit_nbytes = int(np.prod(self._unit, dtype=np.int64)) * self._dtype.itemsize
        """Bytes of one unit of ``values`` (a row, or an element of a column with offsets)."""
        # Uncompressed chunks straight from storage (one get + CRC-32C), others through zarr.
        self._read = chunk_reader(values, storage, lambda rel: storage.describe(rel) if storage else rel)
        self.real: np.dtype[Any] = real_dtype(info.dtype) if info.kind in ("fixed", "ragged") else values.dtype
        """The dtype rows are returned as (ml_dtypes bfloat16 ...; the storage dtype for other kinds)."""
        self.native = self.real == self._dtype
        self.has_valid = "valid" in info.arrays
        self.view_cls = _VIEWS[info.kind]
        self._hot: tuple[int, weakref.ref[np.ndarray]] | None = None
        self._block: tuple[int, int, list[int], Any] | None = None  # rows read in order (row_block)
        self._next_row = -1
        self.offsets: Any = None
        """int64 ``(n_rows + 1,)`` (columns with offsets): a ``LazyArray`` set by the reader."""
        self.shapes: Any = None
        """int64 ``(n_rows, ndim)`` (ragged columns without ``inner_shape``): a ``LazyArray``."""
        self.valid_arr: Any = None
        """bool ``(n_rows,)`` (columns with ``valid``): a ``LazyArray`` set by the reader."""

    @property
    def values(self) -> Any:
        return self.info.arrays["values"]

    def _chunk(self, c: int) -> np.ndarray:
        """Chunk ``c`` of ``values`` (read-only), decoded and checksummed by zarr once, then served
        from the cache."""
        # The chunk this column read last, while the cache (or a reader) still holds it: rows read
        # in order skip the cache's lock. A weak reference, so the cache alone bounds the memory.
        hot = self._hot
        if hot is not None and hot[0] == c:
            arr = hot[1]()
            if arr is not None:
                return arr
        arr = self.cache.get((self._key, c), lambda: self._read(c))
        self._hot = (c, weakref.ref(arr))
        return arr

    def scalar(self, r: int) -> Any:
        """Row ``r`` (one with a value) of a 0-d fixed column as a Python scalar (``value()``'s
        read of a ``py*`` leaf or a container header: no view, no 0-d array); as ``view[r]``
        reads it, then ``.item()``."""
        o = self.offsets
        if o is not None:  # compact: ``values`` hold only the rows with a value
            lo = int(o[r])
            if int(o[r + 1]) <= lo:
                return np.zeros((), dtype=self.real).item()
            r = lo
        c, i = divmod(r, self._k)
        x = self._chunk(c)[i]
        return (x if self.native else x.view(self.real)).item()

    def row_block(self, r: int) -> tuple[int, int, list[int], Any] | None:
        """Rows ``r ..`` read together when rows are read in order (row ``r`` right after row
        ``r - 1``): ``(r, b, bounds, payload)`` for rows ``r .. b-1``, ``payload`` a private copy
        of their values: row ``r + j`` is ``payload[j]`` in a fixed column without offsets,
        ``payload[bounds[j] : bounds[j + 1]]`` in a column with offsets, and for a ``str`` column
        (:class:`TextView`) ``payload[j]`` is its decoded string. At most :data:`ROW_BLOCK_ROWS` rows and :data:`ROW_BLOCK_BYTES` bytes, kept until
        the next block (one per column), so a row read in order costs two list lookups and a
        slice, not a walk through the index and chunk caches (a file read through
        ``res[f][leaf][0]`` is mostly Python calls). None when the read is not in order, when
        row ``r`` alone is larger than a block, or a string in the block is not UTF-8 (the
        caller reads the row alone, and names it if it is the damaged one)."""
        sequential = r == self._next_row
        self._next_row = r + 1
        if not sequential:
            return None
        limit = ROW_BLOCK_BYTES // max(self._dtype.itemsize * int(np.prod(self._unit, dtype=np.int64)), 1)
        k = self._k
        if self.offsets is None:  # a fixed column: row r is unit r (no bounds)
            n = min(ROW_BLOCK_ROWS, limit, self.n_rows - r, (r // k + 1) * k - r)
            if n < 1:
                return None
            block = self._block = (r, r + n, [], self.rows(r, r + n))
            return block
        # Never past the block of index rows (ROW_BLOCK) or the chunk of values that row r reads:
        # the rows read ahead are checked, and their chunks read, no sooner than row r's are.
        stop = min(r + ROW_BLOCK_ROWS, self.n_rows, (r // ROW_BLOCK + 1) * ROW_BLOCK)
        offs = np.asarray(self.offsets[r : stop + 1])
        lo = int(offs[0])
        n = int(np.searchsorted(offs, min(lo + limit, (lo // k + 1) * k), side="right")) - 1
        if n < 1:
            return None
        offs = offs[: n + 1]
        payload: Any = self.rows(lo, int(offs[-1]))
        bounds = (offs - lo).tolist()
        if self.view_cls is TextView:
            raw = payload.tobytes()
            try:
                payload = [raw[bounds[j] : bounds[j + 1]].decode("utf-8") for j in range(n)]
            except UnicodeDecodeError:
                return None
        block = self._block = (r, r + n, bounds, payload)
        return block

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Units ``lo .. hi-1`` of ``values`` (rows, or elements of columns with offsets), a new
        array. Chunks the read only partly covers go through the cache (reading rows in order, or
        batches whose edges cut chunks, decodes each chunk once); chunks it covers whole are read
        straight into the result, never kept: a large read does not flush the cache, and reading
        a whole chunk costs one decoded copy, not a cached one plus the result."""
        k, n = self._k, self._n
        if hi <= lo:
            return np.empty((0, *self._unit), dtype=self._dtype)
        c0, c1 = lo // k, (hi - 1) // k
        head_whole = lo == c0 * k and min((c0 + 1) * k, n) <= hi
        if c0 == c1 and not head_whole:  # part of one chunk: one row, the common case
            base = c0 * k
            return self._chunk(c0)[lo - base : hi - base].copy()
        tail_whole = hi == min((c1 + 1) * k, n)
        if head_whole and tail_whole:  # whole chunks only: zarr's decoded array is the result
            return read_rows(self.values, lo, hi)
        out = np.empty((hi - lo, *self._unit), dtype=self._dtype)
        pos = lo
        if not head_whole:
            head = self._chunk(c0)[lo - c0 * k :]
            out[: len(head)] = head
            pos += len(head)
        straight_end = hi if tail_whole else c1 * k
        if straight_end > pos:
            read_rows(self.values, pos, straight_end, out=out[pos - lo : straight_end - lo])
            pos = straight_end
        if pos < hi:
            out[pos - lo :] = self._chunk(c1)[pos - c1 * k : hi - c1 * k]
        return out

    def valid(self) -> Any:
        """bool ``(n_rows,)`` (a ``LazyArray``: ``v[r]``, ``v[a:b]``, ``np.asarray(v)``) or None
        when every row has a value."""
        if not self.has_valid:
            return None
        return self.valid_arr

    def view(self, start: int, stop: int, filename: str | None = None) -> LeafView:
        return self.view_cls(self, start, stop, filename)


class LeafView:
    """Rows ``start .. stop-1`` of one leaf column. ``len(view)`` rows; ``view[i]`` is row ``i``'s
    value (``None`` where :attr:`valid` is False); ``view[a:b]`` several rows (the kind decides
    the form); :meth:`to_list` every row as a Python list; :meth:`to_arrow` a pyarrow array."""

    __slots__ = ("_col", "_start", "_stop", "filename")

    def __init__(self, col: OpenColumn, start: int, stop: int, filename: str | None) -> None:
        self._col = col
        self._start = start
        self._stop = stop
        self.filename = filename
        """The file whose rows these are (None for a whole column)."""

    @property
    def info(self) -> StoredColumn:
        """The stored column these rows are of (leaf path, kind, dtype, ``ndim`` ...)."""
        return self._col.info

    @property
    def leaf(self) -> tuple[str, ...]:
        """Dict keys from the value's root to this leaf (empty for plain tensor values)."""
        return self._col.info.leaf

    @property
    def kind(self) -> str:
        """``fixed``, ``ragged``, ``str``, ``bytes``, ``pickle`` or ``strlist``."""
        return self._col.info.kind

    @property
    def dtype_name(self) -> str:
        """The dtype name (``"bfloat16"``), or the kind for non-numeric leaves."""
        return self._col.info.dtype

    @property
    def zarr(self) -> Any:
        """The column's ``values`` array (every row of every file)."""
        return self._col.values

    def __len__(self) -> int:
        return self._stop - self._start

    @property
    def valid(self) -> np.ndarray | None:
        """bool per row: False where the row has no value for this leaf; None when all have one."""
        v = self._col.valid()
        return None if v is None else v[self._start : self._stop]

    def _row(self, i: Any) -> int:
        """Absolute row of index ``i`` (negative counts from the end)."""
        n = self._stop - self._start
        j = i if type(i) is int else int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"row {int(i)} out of range for {n} rows")
        return self._start + j

    def _is_valid(self, r: int) -> bool:
        col = self._col
        return not col.has_valid or bool(col.valid()[r])  # type: ignore[index]

    def __getitem__(self, sel: Any) -> Any:
        if type(sel) is int:  # one row, the hot path of reading rows one by one: inlined
            n = self._stop - self._start
            j = sel + n if sel < 0 else sel
            if not 0 <= j < n:
                raise IndexError(f"row {sel} out of range for {n} rows")
            r = self._start + j
            col = self._col
            return None if col.has_valid and not col.valid()[r] else self._one(r)  # type: ignore[index]
        return self._select(sel)

    def _select(self, sel: Any) -> Any:
        """``view[sel]`` for any ``sel`` but a Python int."""
        if isinstance(sel, np.integer):
            r = self._row(sel)
            return self._one(r) if self._is_valid(r) else None
        if isinstance(sel, slice):
            a, b, step = sel.indices(len(self))
            if step == 1:
                return self._many(self._start + a, self._start + max(a, b))
            return [self[i] for i in range(a, b, step)]
        raise TypeError(f"{type(self).__name__} rows are selected by an int or a slice, not {type(sel).__name__}")

    def __iter__(self) -> Iterator[Any]:
        return iter(self.to_list())

    def _one(self, r: int) -> Any:
        raise NotImplementedError

    def _many(self, a: int, b: int) -> Any:
        return self._list(a, b)

    def _list(self, a: int, b: int) -> list[Any]:
        return [self._one(r) if self._is_valid(r) else None for r in range(a, b)]

    def to_list(self) -> list[Any]:
        """Every row's value (``None`` where absent)."""
        return self._list(self._start, self._stop)

    def to_arrow(self) -> Any:
        """These rows as a pyarrow array (docs/READING.md, *pyarrow*), null where absent."""
        raise NotImplementedError

    def _null_mask(self) -> np.ndarray | None:
        v = self.valid
        return None if v is None else ~v

    def __repr__(self) -> str:
        where = f"{self.filename!r}" if self.filename is not None else "all files"
        info = self._col.info
        leaf = F.path_text(info.leaf) if info.leaf else "<tensor>"
        return f"{type(self).__name__}({where}, leaf={leaf!r}, rows={len(self)}, dtype={F.dtype_text(info.dtype, info.ndim)})"


class FixedView(LeafView):
    """A numeric leaf of one shape in every row: ``view[a:b]`` and ``np.asarray(view)`` are numpy
    arrays ``(rows, *shape)`` of the real dtype (ml_dtypes bfloat16, float8 ...; rows without a
    value hold zeros, see :attr:`valid`); :meth:`to_torch` a tensor of the torch dtype."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self._col.values.shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        """numpy dtype of what indexing returns: the real dtype where numpy or ml_dtypes has it."""
        return self._col.real  # real_dtype(self.dtype_name), computed once per column

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(require_torch("LeafView.to_torch()"), self.dtype_name)  # type: ignore[no-any-return]

    def _raw(self, sel: Any) -> np.ndarray:
        """The storage-dtype rows ``sel`` (an int, a slice, ``...``, or a tuple starting with one)."""
        rest: tuple[Any, ...] = ()
        if isinstance(sel, tuple):
            sel, rest = (sel[0], sel[1:]) if sel else (slice(None), ())
        if sel is Ellipsis:
            sel = slice(None)
        if self._col.offsets is not None:
            arr = self._compact(sel)
        elif isinstance(sel, (int, np.integer)):
            r = self._row(sel)
            arr = self._col.rows(r, r + 1)[0]
        elif isinstance(sel, slice):
            a, b, step = sel.indices(len(self))
            if step == 1:
                arr = self._col.rows(self._start + a, self._start + max(a, b))
            else:  # read the file's rows, then step through them
                arr = self._col.rows(self._start, self._stop)[sel]
        else:
            idx = np.asarray(sel)
            if idx.dtype == bool:
                idx = np.flatnonzero(idx)
            rows = np.asarray([self._row(i) for i in idx.ravel()], dtype=np.int64).reshape(idx.shape)
            if rows.size:
                lo = int(rows.min())
                arr = self._col.rows(lo, int(rows.max()) + 1)[rows - lo]
            else:
                arr = self._col.rows(0, 0)
        return arr[(slice(None), *rest)] if rest and arr.ndim > len(self.shape) - 1 else arr[rest] if rest else arr

    def _compact(self, sel: Any) -> np.ndarray:
        """Rows ``sel`` of a fixed column whose ``values`` hold only the rows with a value (it has
        ``offsets``, steps 0 or 1): the others read as zeros."""
        col = self._col
        o = col.offsets
        assert o is not None
        if isinstance(sel, (int, np.integer)):  # one row (value() reads rows one by one): no index arrays
            r = self._row(sel)
            lo = int(o[r])
            if int(o[r + 1]) > lo:
                return col.rows(lo, lo + 1)[0]
            return np.zeros(col._unit, dtype=col._dtype)
        rows = np.arange(self._start, self._stop)[sel]
        lo, hi = (int(o[rows.min()]), int(o[rows.max() + 1])) if rows.size else (0, 0)
        vals = col.rows(lo, hi)
        has = o[rows + 1] > o[rows]
        out = np.zeros((*rows.shape, *col._unit), dtype=vals.dtype)
        out[has] = vals[o[rows[has]] - lo]
        return out

    def _one(self, r: int) -> Any:
        col = self._col
        if col.offsets is None:  # one row, the common case
            block = col._block
            if block is None or not block[0] <= r < block[1]:
                block = col.row_block(r)
            if block is not None:  # read in order
                x = block[3][r - block[0]].copy()
            else:  # straight from its chunk
                c, i = divmod(r, col._k)
                x = col._chunk(c)[i].copy()
            return x if col.native else x.view(col.real)
        return self._raw(r - self._start).view(self.dtype)

    def _select(self, sel: Any) -> Any:
        if isinstance(sel, np.integer):
            r = self._row(sel)
            return self._one(r) if self._is_valid(r) else None
        return self._raw(sel).view(self.dtype)

    def numpy(self) -> np.ndarray:
        return self[...]  # type: ignore[no-any-return]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.numpy()
        if dtype is None or np.dtype(dtype) == arr.dtype:
            return arr
        if copy is False:
            raise ValueError(f"{self!r}: converting {arr.dtype} to {np.dtype(dtype)} needs a copy")
        return arr.astype(dtype)

    def to_torch(self, sel: Any = ...) -> torch.Tensor:
        """A CPU tensor of the real dtype (bfloat16, float8 ... bit-exact) that wraps the array
        zarr decoded into: no copy beyond reading it."""
        torch = require_torch("LeafView.to_torch()")
        t = torch.from_numpy(np.ascontiguousarray(self._raw(sel)))
        return t if self.dtype_name not in F.RAW_BITS else t.view(self.torch_dtype)

    def to_list(self) -> list[Any]:
        arr = self.numpy()
        v = self.valid
        return [None if v is not None and not v[i] else arr[i] for i in range(len(arr))]

    def to_arrow(self) -> Any:
        pa = _pa()
        raw = self._raw(slice(None))
        inner = raw.reshape(-1) if raw.ndim > 1 else raw
        if raw.dtype.kind == "c":  # Arrow has no complex type: (real, imag) pairs
            raw = raw.view(raw.real.dtype).reshape(*raw.shape, 2)
            inner = raw.reshape(-1)
        if raw.ndim >= 3 and all(raw.shape[1:]):  # a tensor per row: Arrow's canonical extension type
            cell = int(np.prod(raw.shape[1:], dtype=np.int64))
            storage = _with_nulls(pa.FixedSizeListArray.from_arrays(pa.array(inner), cell), self.valid)
            tensor = pa.fixed_shape_tensor(storage.type.value_type, list(raw.shape[1:]))
            return pa.ExtensionArray.from_storage(tensor, storage)
        return _with_nulls(_nest(pa.array(inner), raw.shape), self.valid)


class _OffsetView(LeafView):
    """Base of the kinds stored as values + offsets."""

    __slots__ = ()

    def _span(self, a: int, b: int) -> tuple[int, int]:
        o = self._col.offsets
        assert o is not None
        return o.item(a), o.item(b)

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``(rows + 1,)``: row ``i``'s values are ``values[offsets[i]:offsets[i + 1]]``."""
        o = self._col.offsets
        assert o is not None
        part = o[self._start : self._stop + 1]
        return part - part[0]

    def _per_row(self, a: int, b: int, convert: Callable[[int, np.ndarray], Any]) -> list[Any]:
        """Rows ``a .. b-1`` (absolute) from one read of their values: ``convert(row, slice)`` of
        each row, None where the row has no value."""
        flat = self._flat(a, b)
        o = self._col.offsets
        assert o is not None
        base = int(o[a])
        v = self._col.valid()
        return [
            None if v is not None and not v[r] else convert(r, flat[int(o[r]) - base : int(o[r + 1]) - base])
            for r in range(a, b)
        ]

    def _flat(self, a: int, b: int) -> np.ndarray:
        lo, hi = self._span(a, b)
        return self._col.rows(lo, hi)


class RaggedView(_OffsetView):
    """A numeric leaf whose shape varies between rows. ``view[i]`` is row ``i``'s array; the flat
    form is :attr:`values` (every row's elements, first dimension concatenated), :attr:`offsets`
    and :attr:`shapes`; ``view[a:b]`` stacks rows of one shape and refuses others."""

    __slots__ = ()

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._col.real  # real_dtype(self.dtype_name), computed once per column

    @property
    def ndim(self) -> int:
        """Dimensions of one row's value."""
        info = self._col.info
        if info.inner_shape is not None:
            return 1 + len(info.inner_shape)
        assert self._col.shapes is not None
        return int(self._col.shapes.shape[1])

    def _shapes(self, a: int, b: int) -> np.ndarray:
        info = self._col.info
        if self._col.shapes is not None:
            return self._col.shapes[a:b]
        o = self._col.offsets
        assert o is not None and info.inner_shape is not None
        first = np.diff(o[a : b + 1])[:, None]
        return np.concatenate([first, np.tile(np.asarray(info.inner_shape, np.int64), (b - a, 1))], axis=1)

    @property
    def shapes(self) -> np.ndarray:
        """int64 ``(rows, ndim)``: each row's shape (zero-size rows where absent)."""
        return self._shapes(self._start, self._stop)

    @property
    def values(self) -> np.ndarray:
        """Every row's elements, concatenated: ``(n, *inner_shape)``, or flat ``(n,)`` where more
        than the first dimension varies; of the real dtype."""
        return self._flat(self._start, self._stop).view(self.dtype)

    def _one(self, r: int) -> Any:
        col = self._col
        block = col._block
        if block is None or not block[0] <= r < block[1]:
            block = col.row_block(r)
        if block is not None:
            bounds, j = block[2], r - block[0]
            flat = block[3][bounds[j] : bounds[j + 1]].copy()
        else:
            flat = self._flat(r, r + 1)
        # (n, *inner_shape) already when only the first dimension varies
        if col.info.inner_shape is None:
            assert col.shapes is not None
            flat = flat.reshape(tuple(col.shapes[r].tolist()))
        return flat if col.native else flat.view(col.real)

    def _many(self, a: int, b: int) -> Any:
        shapes = self._shapes(a, b)
        if len(shapes) and np.any(shapes != shapes[0]):
            i = int(np.flatnonzero((shapes != shapes[0]).any(axis=1))[0])
            raise RaggedShapeError(
                f"{self!r}: rows {a - self._start} and {a - self._start + i} have shapes {_dims(shapes[0])} and "
                f"{_dims(shapes[i])}, so they do not stack; use .to_list() (one array per row) or "
                ".values / .offsets / .shapes (the flat form)"
            )
        shape = _dims(shapes[0]) if len(shapes) else (0,) * self.ndim
        return self._flat(a, b).view(self.dtype).reshape((b - a, *shape))

    def _list(self, a: int, b: int) -> list[Any]:
        flat = self._flat(a, b).view(self.dtype)
        o = self._col.offsets
        assert o is not None
        base = int(o[a])
        shapes = self._shapes(a, b)
        v = self._col.valid()
        out: list[Any] = []
        for j, r in enumerate(range(a, b)):
            if v is not None and not v[r]:
                out.append(None)
                continue
            lo, hi = int(o[r]) - base, int(o[r + 1]) - base
            if self._col.info.inner_shape is not None:
                out.append(flat[lo:hi])
            else:
                out.append(flat[lo:hi].reshape(tuple(shapes[j])))
        return out

    def to_torch(self, i: int) -> torch.Tensor:
        """Row ``i`` as a CPU tensor of the real dtype."""
        r = self._row(i)
        raw = self._flat(r, r + 1).reshape(tuple(self._shapes(r, r + 1)[0]))
        torch = require_torch("LeafView.to_torch()")
        t = torch.from_numpy(np.ascontiguousarray(raw))
        return t if self.dtype_name not in F.RAW_BITS else t.view(getattr(torch, self.dtype_name))

    def to_arrow(self) -> Any:
        """``large_list`` per row: of ``fixed_size_list`` (the inner dimensions) when only the
        first dimension varies, else nested ``large_list`` one level per dimension."""
        pa = _pa()
        raw = self._flat(self._start, self._stop)
        o = self.offsets
        info = self._col.info
        if info.inner_shape is not None:
            arr = _nest(pa.array(raw.reshape(-1)), raw.shape)
            return _with_nulls(pa.LargeListArray.from_arrays(pa.array(o, pa.int64()), arr), self.valid)
        shapes = self.shapes
        levels = []
        for j in range(shapes.shape[1]):
            reps = np.prod(shapes[:, :j], axis=1, dtype=np.int64) if j else np.ones(len(shapes), np.int64)
            lengths = np.repeat(shapes[:, j], reps)
            levels.append(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
        arr = pa.array(raw)
        for off in reversed(levels):
            arr = pa.LargeListArray.from_arrays(pa.array(off, pa.int64()), arr)
        return _with_nulls(arr, self.valid)


class BytesView(_OffsetView):
    """A ``bytes`` leaf: ``view[i]`` ``bytes``, ``view[a:b]`` a list; the flat form is
    :attr:`values` (uint8) and :attr:`offsets`."""

    __slots__ = ()

    @property
    def values(self) -> np.ndarray:
        return self._flat(self._start, self._stop)

    def _decode(self, b: bytes) -> Any:
        return b

    def _one(self, r: int) -> Any:
        return self._decode(self._flat(r, r + 1).tobytes())

    def _list(self, a: int, b: int) -> list[Any]:
        return self._per_row(a, b, lambda _, x: self._decode(x.tobytes()))

    def to_arrow(self) -> Any:
        pa = _pa()
        raw = self._flat(self._start, self._stop)
        bufs = [_validity(self.valid), pa.py_buffer(self.offsets.astype(np.int64)), pa.py_buffer(raw)]
        return pa.Array.from_buffers(pa.large_binary(), len(self), bufs)


class PickleView(BytesView):
    """A leaf stored pickled (writer and reader opted in): ``view[i]`` the unpickled object, only
    when the store was opened with ``allow_pickle=True``; :attr:`values` are the pickled bytes."""

    __slots__ = ()

    def _decode(self, b: bytes) -> Any:
        if not self._col.allow_pickle:
            raise PickleNotAllowedError(
                f"{self!r}: this leaf holds pickled objects; unpickling runs code from the output, so "
                "spillmerge never does it by default: open the output with spillmerge.open(out, "
                "allow_pickle=True) if you trust it (.values / .offsets give the pickled bytes)",
                leaf="/".join(self.leaf),
            )
        return pickle.loads(b)  # noqa: S301 - the reader opted in (allow_pickle=True)


def utf8_text(col: OpenColumn, r: int, raw: bytes) -> str:
    """UTF-8 ``raw`` of row ``r`` as ``str``; bytes that are not UTF-8 are damage, named."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        path = f"{col.values.store_path}"
        raise CorruptSpillError(
            f"{path}: row {r} is not valid UTF-8 ({exc.reason}); the output is damaged: merge it again", path=path
        ) from None


class TextView(BytesView):
    """A ``str`` leaf (UTF-8 bytes + byte offsets): ``view[i]`` a ``str``,
    ``view[a:b]`` a list; :attr:`values` (uint8) and :attr:`offsets` are the flat form."""

    __slots__ = ()

    def _one(self, r: int) -> Any:
        col = self._col
        block = col._block
        if block is None or not block[0] <= r < block[1]:
            block = col.row_block(r)
        if block is not None:
            return block[3][r - block[0]]
        return utf8_text(col, r, self._flat(r, r + 1).tobytes())

    def _list(self, a: int, b: int) -> list[Any]:
        flat = self._flat(a, b).tobytes()
        o = self._col.offsets
        assert o is not None
        bounds = (o[a : b + 1] - o[a]).tolist()
        v = self._col.valid()
        return [
            None if v is not None and not v[a + j] else utf8_text(self._col, a + j, flat[bounds[j] : bounds[j + 1]])
            for j in range(b - a)
        ]

    def to_arrow(self) -> Any:
        pa = _pa()
        raw = self._flat(self._start, self._stop)
        bufs = [_validity(self.valid), pa.py_buffer(self.offsets.astype(np.int64)), pa.py_buffer(raw)]
        arr = pa.Array.from_buffers(pa.large_string(), len(self), bufs)
        try:
            arr.validate(full=True)  # UTF-8 of every row
        except pa.ArrowInvalid as exc:
            path = f"{self._col.values.store_path}"
            raise CorruptSpillError(f"{path}: {exc}; the output is damaged: merge it again", path=path) from None
        return arr


class TextListView(_OffsetView):
    """A list-of-``str`` leaf: ``view[i]`` a list of ``str``. Row ``r``'s
    bytes are ``n`` uint32 LE lengths then the UTF-8 strings, ``n`` = ``shapes[r, 0]``."""

    __slots__ = ()

    def _split(self, r: int, raw: np.ndarray) -> list[str]:
        shapes = self._col.shapes
        assert shapes is not None
        n = int(shapes[r, 0])
        lens = np.frombuffer(raw, dtype="<u4", count=n).tolist()
        data = raw[4 * n :].tobytes()
        if sum(lens) != len(data):
            path = f"{self._col.values.store_path}"
            raise CorruptSpillError(
                f"{path}: row {r}'s string lengths do not add up to its bytes; the output is damaged: merge it again",
                path=path,
            )
        out, pos = [], 0
        for ln in lens:
            out.append(utf8_text(self._col, r, data[pos : pos + ln]))
            pos += ln
        return out

    def _one(self, r: int) -> Any:
        return self._split(r, self._flat(r, r + 1))

    def _list(self, a: int, b: int) -> list[Any]:
        return self._per_row(a, b, self._split)

    def to_arrow(self) -> Any:
        pa = _pa()
        rows = self._list(self._start, self._stop)
        return pa.array(rows, type=pa.large_list(pa.large_string()))


def view_factory(flat: list[tuple[str, Any, OpenColumn]]) -> Callable[[int, int, str], LeafDict]:
    """``make(a, b, filename)``: the value of a file whose layout has these top-level leaves
    (``(key, view class, column)`` each), rows ``a .. b-1``: a :class:`LeafDict` of one view per
    leaf."""

    def make(a: int, b: int, filename: str) -> LeafDict:
        out = LeafDict.top(filename)
        for key, cls, col in flat:
            out[key] = cls(col, a, b, filename)
        return out

    return make


_VIEWS: dict[str, type[LeafView]] = {
    "fixed": FixedView,
    "ragged": RaggedView,
    "str": TextView,
    "bytes": BytesView,
    "pickle": PickleView,
    "strlist": TextListView,
}


def _pa() -> Any:
    from .._errors import require

    return require("pyarrow", package="pyarrow", extra="arrow", feature="MergedStore.to_arrow()")


def _validity(valid: np.ndarray | None) -> Any:
    if valid is None:
        return None
    return _pa().py_buffer(np.packbits(valid.astype(bool), bitorder="little"))


def _with_nulls(arr: Any, valid: np.ndarray | None) -> Any:
    """``arr`` with nulls where ``valid`` is False."""
    if valid is None or valid.all():
        return arr
    import pyarrow.compute as pc

    pa = _pa()
    return pc.if_else(pa.array(valid), arr, pa.nulls(len(arr), arr.type))


def _nest(flat: Any, shape: tuple[int, ...]) -> Any:
    """``flat`` (every element) as ``shape[0]`` rows of ``fixed_size_list`` one level per later
    dimension; a dimension of size 0 is a ``large_list`` of empty lists (Arrow refuses a
    ``fixed_size_list`` of size 0)."""
    pa = _pa()
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
    """An ``arrow.fixed_shape_tensor`` array as the nested ``fixed_size_list`` it was before
    (what readers without the extension type, Parquet's among them, see with its shape)."""
    pa = _pa()
    if not isinstance(arr.type, pa.FixedShapeTensorType):
        return arr
    storage = arr.storage
    k = storage.type.list_size
    flat = storage.values.slice(storage.offset * k, len(storage) * k)
    valid = None if storage.null_count == 0 else storage.is_valid().to_numpy(zero_copy_only=False)
    return _with_nulls(_nest(flat, (len(storage), *arr.type.shape)), valid)
