"""Leaf views of an output: one leaf column over the rows of one file or of every file, one class
per kind of column (docs/FORMAT.md section 2), all on :class:`LeafView`; a file's views by leaf path
(:class:`LeafDict`)."""

from __future__ import annotations

import operator
import pickle
from collections.abc import Iterator
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import PickleNotAllowedError, RaggedShapeError, UnknownLeafError, require_torch
from .._format import common as F
from .._format.invariants import StoredColumn
from .arrow import nest, require_pyarrow, with_nulls
from .column import OpenColumn

if TYPE_CHECKING:
    import torch


def tensor(arr: np.ndarray, dtype_name: str) -> torch.Tensor:
    """A CPU tensor of dtype ``dtype_name``, bit-exact, over ``arr`` (of its storage or its real
    dtype; copied only when not contiguous): raw-bit dtypes (bfloat16, float8 ...) through a torch
    view of their storage type."""
    torch = require_torch("LeafView.to_torch()")
    raw = np.ascontiguousarray(arr).reshape(arr.shape)  # (a 0-d row stays 0-d)
    if dtype_name not in F.RAW_BITS:
        return torch.from_numpy(raw)
    return torch.from_numpy(raw.view(F.DTYPES[dtype_name].storage)).view(getattr(torch, dtype_name))


def _pairs(raw: np.ndarray) -> np.ndarray:
    """``raw`` for Arrow, which has no complex type: complex numbers as (real, imag) pairs."""
    return raw.view(raw.real.dtype).reshape(*raw.shape, 2) if raw.dtype.kind == "c" else raw


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
        v = self._col.valid
        return None if v is None else v[self._start : self._stop]

    def _row(self, i: Any) -> int:
        """Absolute row of index ``i`` (negative counts from the end)."""
        n = self._stop - self._start
        try:
            j = i if type(i) is int else operator.index(i)
        except TypeError:
            raise TypeError(f"{type(self).__name__} rows are numbered by an int, not {type(i).__name__} {i!r}") from None
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"row {int(i)} out of range for {n} rows")
        return self._start + j

    def _ok(self, a: int, b: int) -> list[bool] | None:
        """Whether rows ``a .. b-1`` (absolute) have a value, as a list; None when all have."""
        v = self._col.valid
        return None if v is None else np.asarray(v[a:b], dtype=bool).tolist()  # type: ignore[no-any-return]

    def __getitem__(self, sel: Any) -> Any:
        if type(sel) is int:  # one row, the hot path of reading rows one by one: inlined
            n = self._stop - self._start
            j = sel + n if sel < 0 else sel
            if not 0 <= j < n:
                raise IndexError(f"row {sel} out of range for {n} rows")
            r = self._start + j
            col = self._col
            return None if col.valid is not None and not col.valid[r] else self.at(r)
        if isinstance(sel, np.integer):
            return self[int(sel)]
        return self._select(sel)

    def _select(self, sel: Any) -> Any:
        """``view[sel]`` for any ``sel`` but an int."""
        if isinstance(sel, slice):
            a, b, step = sel.indices(len(self))
            if step == 1:
                return self._many(self._start + a, self._start + max(a, b))
            return [self[i] for i in range(a, b, step)]
        raise TypeError(f"{type(self).__name__} rows are selected by an int or a slice, not {type(sel).__name__}")

    def __iter__(self) -> Iterator[Any]:
        return iter(self.to_list())

    def at(self, r: int) -> Any:
        """Row ``r`` of the column (counted over every file), known to have a value: the one
        decoder of a row of this kind, which ``view[i]``, ``value()`` and ``iter_values()`` use."""
        raise NotImplementedError

    def _many(self, a: int, b: int) -> Any:
        return self._list(a, b)

    def _list(self, a: int, b: int) -> list[Any]:
        """Rows ``a .. b-1`` (absolute), None where a row has no value: the kind's decoder of
        several rows, from one read of their values."""
        raise NotImplementedError

    def to_list(self) -> list[Any]:
        """Every row's value (``None`` where absent)."""
        return self._list(self._start, self._stop)

    def to_arrow(self) -> Any:
        """These rows as a pyarrow array (docs/READING.md, *pyarrow*), null where absent."""
        raise NotImplementedError

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

    def _raw(self, sel: Any) -> np.ndarray:
        """The storage-dtype rows ``sel`` (an int, a slice, ``...``, or a tuple starting with one)."""
        rest: tuple[Any, ...] = ()
        if isinstance(sel, tuple):
            sel, rest = (sel[0], sel[1:]) if sel else (slice(None), ())
        if sel is Ellipsis:
            sel = slice(None)
        col = self._col
        if isinstance(sel, (int, np.integer)):
            arr = col.unit(self._row(sel)).copy()
        elif isinstance(sel, slice) and sel.step in (None, 1) and col.offsets is None:
            a, b, _ = sel.indices(len(self))
            arr = col.rows(self._start + a, self._start + max(a, b))
        else:
            arr = self._take(np.arange(self._start, self._stop)[sel] if isinstance(sel, slice) else self._picked(sel))
        return arr[(slice(None), *rest)] if rest and arr.ndim > len(self.shape) - 1 else arr[rest] if rest else arr

    def _picked(self, sel: Any) -> np.ndarray:
        """The absolute rows an index array or a boolean mask over the view's rows selects."""
        idx, n = np.asarray(sel), len(self)
        if idx.dtype == bool:
            if idx.shape != (n,):
                raise IndexError(f"a boolean mask of shape {idx.shape} does not select among {n} rows")
            idx = np.flatnonzero(idx)
        elif idx.size and idx.dtype.kind not in "iu":
            raise IndexError(f"rows are selected by integers, a slice or a boolean mask, not {idx.dtype} {sel!r}")
        return np.asarray([self._row(i) for i in idx.ravel()], dtype=np.int64).reshape(idx.shape)

    def _take(self, rows: np.ndarray) -> np.ndarray:
        """Absolute rows ``rows`` from one read of the values from the first to the last; a compact
        column's ``values`` hold only the rows with a value (``offsets`` of steps 0 or 1): the
        others read as zeros."""
        col, o = self._col, self._col.offsets
        if o is None:
            lo, hi = (int(rows.min()), int(rows.max()) + 1) if rows.size else (0, 0)
            return col.rows(lo, hi)[rows - lo]
        lo, hi = (int(o[rows.min()]), int(o[rows.max() + 1])) if rows.size else (0, 0)
        vals = col.rows(lo, hi)
        has = o[rows + 1] > o[rows]
        out = np.zeros((*rows.shape, *col.unit_shape), dtype=vals.dtype)
        out[has] = vals[o[rows[has]] - lo]
        return out

    def at(self, r: int) -> Any:
        col = self._col
        x = col.ahead(r)
        if x is not None:  # read in order
            return x.copy()
        x = col.unit(r).copy()
        return x if col.native else x.view(col.real)

    def _select(self, sel: Any) -> Any:
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
        return tensor(self._raw(sel), self.dtype_name)

    def _list(self, a: int, b: int) -> list[Any]:
        arr = self._raw(slice(a - self._start, b - self._start)).view(self.dtype)
        ok = self._ok(a, b)
        return [None if ok is not None and not ok[j] else arr[j] for j in range(b - a)]

    def to_arrow(self) -> Any:
        pa = require_pyarrow()
        raw = _pairs(self._raw(slice(None)))
        inner = raw.reshape(-1)
        if raw.ndim >= 3 and all(raw.shape[1:]):  # a tensor per row: Arrow's canonical extension type
            cell = int(np.prod(raw.shape[1:], dtype=np.int64))
            storage = with_nulls(pa.FixedSizeListArray.from_arrays(pa.array(inner), cell), self.valid)
            ext = pa.fixed_shape_tensor(storage.type.value_type, list(raw.shape[1:]))
            return pa.ExtensionArray.from_storage(ext, storage)
        return with_nulls(nest(pa.array(inner), raw.shape), self.valid)


class _OffsetView(LeafView):
    """Base of the kinds stored as values + offsets."""

    __slots__ = ()

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``(rows + 1,)``: row ``i``'s values are ``values[offsets[i]:offsets[i + 1]]``."""
        o = self._col.offsets
        assert o is not None
        part = o[self._start : self._stop + 1]
        return part - part[0]

    @property
    def values(self) -> np.ndarray:
        """Every row's values, concatenated: bytes (uint8), or a ragged leaf's elements ``(n,
        *inner_shape)`` (flat ``(n,)`` where more than the first dimension varies) of the real dtype."""
        return self._flat(self._start, self._stop).view(self._col.real)

    def _decode(self, r: int, raw: bytes) -> Any:
        """Row ``r``'s value from its bytes (the kinds stored as bytes: the one decoder of each)."""
        raise NotImplementedError

    def at(self, r: int) -> Any:
        return self._decode(r, self._flat(r, r + 1).tobytes())

    def _span(self, a: int, b: int) -> tuple[np.ndarray, list[int]]:
        """The values of rows ``a .. b-1`` (absolute), one read, and each row's bounds in them."""
        ob = np.asarray(self._col.offsets[a : b + 1], dtype=np.int64)  # type: ignore[index]
        return self._col.rows(int(ob[0]), int(ob[-1])), (ob - ob[0]).tolist()

    def _list(self, a: int, b: int) -> list[Any]:
        """Rows ``a .. b-1`` (absolute) from their values as one ``bytes``, sliced per row:
        ``_decode`` of each, None where the row has no value."""
        vals, bounds = self._span(a, b)
        buf = vals.tobytes()
        ok, decode = self._ok(a, b), self._decode
        return [
            None if ok is not None and not ok[j] else decode(a + j, buf[bounds[j] : bounds[j + 1]])
            for j in range(b - a)
        ]

    def _flat(self, a: int, b: int) -> np.ndarray:
        o = self._col.offsets
        assert o is not None
        return self._col.rows(o.item(a), o.item(b))


class RaggedView(_OffsetView):
    """A numeric leaf whose shape varies between rows. ``view[i]`` is row ``i``'s array; the flat
    form is :attr:`values` (every row's elements, first dimension concatenated), :attr:`offsets`
    and :attr:`shapes`; ``view[a:b]`` stacks rows of one shape and refuses others (no rows:
    ``(0, 0, *inner_shape)``, or all zeros where more than the first dimension varies)."""

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

    def at(self, r: int) -> Any:
        col = self._col
        x = col.ahead(r)
        if x is not None:  # read in order (to_torch reads a row without a value too: read alone)
            return x.copy()
        flat = self._flat(r, r + 1).view(col.real)
        if col.info.inner_shape is None:  # else (n, *inner_shape) already
            assert col.shapes is not None
            flat = flat.reshape(tuple(col.shapes[r].tolist()))
        return flat

    def _many(self, a: int, b: int) -> Any:
        shapes = self._shapes(a, b)
        if len(shapes) and np.any(shapes != shapes[0]):
            i = int(np.flatnonzero((shapes != shapes[0]).any(axis=1))[0])
            raise RaggedShapeError(
                f"{self!r}: rows {a - self._start} and {a - self._start + i} have shapes {tuple(shapes[0].tolist())} and "
                f"{tuple(shapes[i].tolist())}, so they do not stack; use .to_list() (one array per row) or "
                ".values / .offsets / .shapes (the flat form)"
            )
        if len(shapes):
            shape = tuple(shapes[0].tolist())
        else:  # no rows: 0 for the dimensions that vary, the others as stored
            inner = self._col.info.inner_shape
            shape = (0,) * self.ndim if inner is None else (0, *inner)
        return self._flat(a, b).view(self.dtype).reshape((b - a, *shape))

    def _list(self, a: int, b: int) -> list[Any]:
        vals, bounds = self._span(a, b)
        flat = vals.view(self.dtype)
        rows = [flat[bounds[j] : bounds[j + 1]] for j in range(b - a)]
        if self._col.info.inner_shape is None:
            rows = [x.reshape(shape) for x, shape in zip(rows, self._shapes(a, b).tolist(), strict=True)]
        ok = self._ok(a, b)
        return rows if ok is None else [x if has else None for x, has in zip(rows, ok, strict=True)]

    def to_torch(self, i: int) -> torch.Tensor:
        """Row ``i`` as a CPU tensor of the real dtype."""
        return tensor(self.at(self._row(i)), self.dtype_name)

    def to_arrow(self) -> Any:
        """``large_list`` per row: of ``fixed_size_list`` (the inner dimensions) when only the
        first dimension varies, else nested ``large_list`` one level per dimension."""
        pa = require_pyarrow()
        raw = _pairs(self._flat(self._start, self._stop))
        arr = nest(pa.array(raw.reshape(-1)), raw.shape)
        if self._col.info.inner_shape is not None:
            return with_nulls(pa.LargeListArray.from_arrays(pa.array(self.offsets, pa.int64()), arr), self.valid)
        shapes = self.shapes
        for j in reversed(range(shapes.shape[1])):  # dimension j's lengths, once per cell of those above it
            lengths = np.repeat(shapes[:, j], np.prod(shapes[:, :j], axis=1, dtype=np.int64))
            off = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
            arr = pa.LargeListArray.from_arrays(pa.array(off, pa.int64()), arr)
        return with_nulls(arr, self.valid)


class BytesView(_OffsetView):
    """A ``bytes`` leaf: ``view[i]`` ``bytes``, ``view[a:b]`` a list; the flat form is
    :attr:`values` (uint8) and :attr:`offsets`."""

    __slots__ = ()
    _ARROW = "large_binary"
    """The Arrow type of the rows (a pyarrow factory's name): the bytes and offsets as stored."""

    def _decode(self, r: int, raw: bytes) -> Any:
        return raw

    def to_arrow(self) -> Any:
        pa = require_pyarrow()
        raw, valid = self._flat(self._start, self._stop), self.valid
        bitmap = None if valid is None else pa.py_buffer(np.packbits(valid.astype(bool), bitorder="little"))
        bufs = [bitmap, pa.py_buffer(self.offsets.astype(np.int64)), pa.py_buffer(raw)]
        return pa.Array.from_buffers(getattr(pa, self._ARROW)(), len(self), bufs)


class PickleView(BytesView):
    """A leaf stored pickled (writer and reader opted in): ``view[i]`` the unpickled object, only
    when the store was opened with ``allow_pickle=True``; :attr:`values` are the pickled bytes."""

    __slots__ = ()

    def _decode(self, r: int, raw: bytes) -> Any:
        if not self._col.allow_pickle:
            raise PickleNotAllowedError(
                f"{self!r}: this leaf holds pickled objects; unpickling runs code from the output, so "
                "spillmerge never does it by default: open the output with spillmerge.open(out, "
                "allow_pickle=True) (a dataset: OutputDataset(path, allow_pickle=True)) if you trust it "
                "(.values / .offsets give the pickled bytes)",
                leaf="/".join(self.leaf),
            )
        return pickle.loads(raw)  # noqa: S301 - the reader opted in (allow_pickle=True)


def utf8_text(col: OpenColumn, r: int, raw: bytes) -> str:
    """UTF-8 ``raw`` of row ``r`` as ``str``; bytes that are not UTF-8 are damage, named."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise col.damaged(f"row {r} is not valid UTF-8 ({exc.reason})") from None


class TextView(BytesView):
    """A ``str`` leaf (UTF-8 bytes + byte offsets): ``view[i]`` a ``str``,
    ``view[a:b]`` a list; :attr:`values` (uint8) and :attr:`offsets` are the flat form."""

    __slots__ = ()
    _ARROW = "large_string"

    def at(self, r: int) -> Any:
        x = self._col.ahead(r)
        return super().at(r) if x is None else x

    def _decode(self, r: int, raw: bytes) -> Any:
        return utf8_text(self._col, r, raw)

    def _list(self, a: int, b: int) -> list[Any]:
        """As ``_OffsetView._list``, each row decoded inline (no call per row but ``decode``);
        where some row's bytes are not UTF-8, that way, which names the row."""
        vals, bounds = self._span(a, b)
        buf = vals.tobytes()
        try:
            rows = [buf[x:y].decode() for x, y in zip(bounds[:-1], bounds[1:], strict=True)]
        except UnicodeDecodeError:
            return super()._list(a, b)
        ok = self._ok(a, b)
        return rows if ok is None else [x if has else None for x, has in zip(rows, ok, strict=True)]

    def to_arrow(self) -> Any:
        arr = super().to_arrow()
        try:
            arr.validate(full=True)  # UTF-8 of every row
        except require_pyarrow().ArrowInvalid as exc:
            raise self._col.damaged(str(exc)) from None
        return arr


class TextListView(_OffsetView):
    """A list-of-``str`` leaf: ``view[i]`` a list of ``str``. Row ``r``'s
    bytes are ``n`` uint32 LE lengths then the UTF-8 strings, ``n`` = ``shapes[r, 0]``."""

    __slots__ = ()

    def _decode(self, r: int, raw: bytes) -> Any:
        shapes = self._col.shapes
        assert shapes is not None
        n = int(shapes[r][0])
        lens = np.frombuffer(raw, dtype="<u4", count=n).tolist()
        data = raw[4 * n :]
        if sum(lens) != len(data):
            raise self._col.damaged(f"row {r}'s string lengths do not add up to its bytes")
        return [utf8_text(self._col, r, data[end - ln : end]) for ln, end in zip(lens, accumulate(lens), strict=True)]

    def to_arrow(self) -> Any:
        pa = require_pyarrow()
        return pa.array(self.to_list(), type=pa.large_list(pa.large_string()))


class LeafDict(dict[str, Any]):
    """One level of the nested dict a file's value reads as (``store[filename]``); ``prefix`` is
    the leaf path down to it (``()`` at the top). A missing key raises :class:`UnknownLeafError`
    naming the file, the leaf and the leaves it has (a ``KeyError`` still: ``in`` and ``.get`` work)."""

    # Slots: no per-instance __dict__ to allocate, one LeafDict per file read in order.
    __slots__ = ("filename", "prefix")
    filename: str
    prefix: tuple[str, ...]

    @classmethod
    def top(cls, filename: str, prefix: tuple[str, ...] = ()) -> LeafDict:
        """The level ``prefix`` (``()``: the top) of ``filename``'s value (a ``str``: a numpy str's
        repr would show in messages), made without a Python ``__init__``: one per file read, so it
        counts when files are read in order."""
        out = cls.__new__(cls)
        out.filename = filename
        out.prefix = prefix
        return out

    def child(self, key: str) -> LeafDict:
        """The level below ``key``, created when absent."""
        node = self.get(key)
        if node is None:
            node = self[key] = LeafDict.top(self.filename, (*self.prefix, key))
        return node  # type: ignore[no-any-return]

    def __missing__(self, key: object) -> Any:
        leaf = "/".join((*self.prefix, str(key)))
        known = ["/".join((*self.prefix, k)) for k in sorted(self)]
        where = f"; leaves under {'/'.join(self.prefix)!r}" if self.prefix else "; its leaves"
        raise UnknownLeafError(
            f"{self.filename!r} has no leaf {leaf!r}{where}: {', '.join(map(repr, known)) or 'none'}",
            filename=self.filename,
            leaf=leaf,
            known=known,
        )


VIEWS: dict[str, type[LeafView]] = {
    "fixed": FixedView,
    "ragged": RaggedView,
    "str": TextView,
    "bytes": BytesView,
    "pickle": PickleView,
    "strlist": TextListView,
}
"""Column kind → its leaf view class (``OpenColumn.view_cls``)."""
