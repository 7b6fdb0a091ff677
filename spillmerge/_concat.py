"""Arrays made of slices back to back, read without joining them: a plan built in ranges of
filenames (``_plan_disk``, docs/SCALE.md) keeps each range's per-row and per-file arrays in files
of their own, and the copy, the index writer and the fingerprint read them through :class:`Concat`
as one array, a block or a gather at a time, like the maps of a plan built in one piece."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class Concat:
    """The arrays ``pieces`` (one dtype, one shape after the first dimension) as one read-only
    array along the first dimension: ``len``, ``shape``, ``dtype``, ``ndim``, ``nbytes``, an
    int, a slice or an int array (a gather) as index, optionally followed by indexes of the
    other dimensions, and ``np.asarray`` (which joins every piece: for small arrays only)."""

    def __init__(self, pieces: Sequence[np.ndarray]) -> None:
        if not pieces:
            raise ValueError("Concat needs at least one piece")
        self.pieces = list(pieces)
        self.dtype = np.dtype(self.pieces[0].dtype)
        tail = tuple(self.pieces[0].shape[1:])
        for p in self.pieces:
            if np.dtype(p.dtype) != self.dtype or tuple(p.shape[1:]) != tail:
                raise ValueError(f"Concat of unlike pieces: {p.dtype}{p.shape} after {self.dtype}{tail}")
        self.starts = np.zeros(len(self.pieces) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in self.pieces], out=self.starts[1:])
        self.shape = (int(self.starts[-1]), *tail)
        self.ndim = len(self.shape)
        self.nbytes = int(sum(int(p.nbytes) for p in self.pieces))

    def __len__(self) -> int:
        return self.shape[0]

    def _piece(self, i: int) -> tuple[int, int]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} is out of bounds for an array of {n}")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return k, i - int(self.starts[k])

    def __getitem__(self, index: Any) -> Any:
        rest: tuple[Any, ...] = ()
        if isinstance(index, tuple):
            index, rest = index[0], index[1:]
        if isinstance(index, (int, np.integer)):
            k, j = self._piece(int(index))
            return self.pieces[k][(j, *rest)]
        if isinstance(index, slice):
            out = self._span(index)
        else:
            out = self._gather(np.asarray(index))
        return out[(slice(None), *rest)] if rest else out

    def _span(self, s: slice) -> np.ndarray:
        a, b, step = s.indices(len(self))
        if step != 1:
            return self._gather(np.arange(a, b, step, dtype=np.int64))
        b = max(a, b)
        k0 = int(np.searchsorted(self.starts, a, side="right")) - 1
        got = []
        for k in range(max(k0, 0), len(self.pieces)):
            lo, hi = int(self.starts[k]), int(self.starts[k + 1])
            if lo >= b:
                break
            if hi > a:
                got.append(self.pieces[k][max(a, lo) - lo : min(b, hi) - lo])
        if len(got) == 1:
            return got[0]  # inside one piece: a view of it, as a slice of one array is
        if not got:
            return np.zeros((0, *self.shape[1:]), dtype=self.dtype)
        return np.concatenate(got)

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        if idx.dtype == bool:
            raise TypeError("Concat takes int indexes, not a mask")
        idx = idx.astype(np.int64, copy=False)
        n = len(self)
        if len(idx) and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"an index is out of bounds for an array of {n}")
        if len(idx) and int(idx.min()) < 0:
            idx = np.where(idx < 0, idx + n, idx)
        if len(idx):
            # Most gathers (a batch of rows of one output chunk) fall in one piece: index it directly.
            k = int(np.searchsorted(self.starts, int(idx.min()), side="right")) - 1
            if int(idx.max()) < int(self.starts[k + 1]):
                return self.pieces[k][idx - self.starts[k] if k else idx]
        which = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty((*idx.shape, *self.shape[1:]), dtype=self.dtype)
        for k in np.unique(which).tolist():
            m = which == k
            out[m] = self.pieces[k][idx[m] - self.starts[k]]
        return out

    def searchsorted(self, v: Any, side: Any = "left", sorter: Any = None) -> Any:
        """``np.searchsorted`` of a sorted array (offsets), without joining the pieces: the count
        of elements below ``v`` (or not above it, ``side="right"``) summed over the pieces, a
        binary search in each (numpy calls this method for ``np.searchsorted(concat, v)``; joining
        every piece per call made a part's copy read its offsets whole per output chunk)."""
        if sorter is not None:
            raise TypeError("Concat.searchsorted takes no sorter")
        out = np.searchsorted(self.pieces[0], v, side=side)
        for p in self.pieces[1:]:
            out = out + np.searchsorted(p, v, side=side)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._span(slice(None))
        out = np.array(out) if len(self.pieces) == 1 else out
        return out if dtype is None else out.astype(dtype)

    def __iter__(self) -> Any:
        for p in self.pieces:
            yield from p


def concat(pieces: Sequence[Any]) -> Any:
    """One array piece as itself (a plan in one range reads its maps directly), else a
    :class:`Concat` (of one piece too when it is not an array: a ``_fetched.Fetched`` one gives
    the plan's readers the operations of a ``Concat``, no more)."""
    return pieces[0] if len(pieces) == 1 and isinstance(pieces[0], np.ndarray) else Concat(pieces)


def concat_offsets(pieces: Sequence[Any]) -> Any:
    """Offsets arrays (``n + 1`` entries each, every piece starting where the one before ends,
    already in global values) as one: each piece's last entry is the next one's first."""
    return concat([_head(p) for p in pieces[:-1]] + [pieces[-1]])


def _head(a: Any) -> Any:
    """``a`` without its last entry, as a view: not read (a ``_fetched.Fetched`` window)."""
    return a.window(0, len(a) - 1) if hasattr(a, "window") else a[:-1]
