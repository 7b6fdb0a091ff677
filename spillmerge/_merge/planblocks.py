"""A stored plan's arrays in blocks of about :data:`BLOCK_BYTES`, each with its BLAKE2b in
``plan.json``: a part fetches a block when an index first touches it, checks it and caches it
(bounded); a byte that fails its digest is never used."""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import CorruptSpillError, SpillMergeError
from .._storage import Storage

BLOCK_BYTES = 4 << 20
"""About the bytes of one stored block (whole rows of the array)."""


class DamagedPlan(CorruptSpillError):
    """A stored plan file fails its digest or does not parse (the caller plans again)."""


def digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def put_blocks(output: Storage, rel: str, a: np.ndarray) -> dict[str, Any]:
    """Write ``a`` as blocks ``rel.0``, ``rel.1``, ...; the spec ``plan.json`` keeps for it: dtype,
    shape, rows per block, each block's digest and (1-d integers) each block's first element."""
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    row_bytes = dt.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
    rows = max(1, BLOCK_BYTES // max(row_bytes, 1))
    digests, firsts = [], []
    for k, lo in enumerate(range(0, len(a), rows)):
        block = np.ascontiguousarray(a[lo : lo + rows], dtype=dt)
        raw = block.reshape(-1).view(np.uint8).data
        output.put(f"{rel}.{k}", raw)
        digests.append(digest(raw))
        if block.ndim == 1 and dt.kind in "iu":
            firsts.append(int(block[0]))
    spec: dict[str, Any] = {"dtype": dt.str, "shape": [int(d) for d in a.shape], "rows": rows, "blake2b": digests}
    if a.ndim == 1 and dt.kind in "iu":
        spec["first"] = firsts
    return spec


class BlockCache:
    """The blocks a stored plan holds in memory, least recently used evicted beyond ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self._blocks: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def put(self, key: tuple[str, int], block: np.ndarray) -> None:
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = block
            self.bytes += block.nbytes
            while self.bytes > self.limit and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= old.nbytes


class StoredArray:
    """One array of a stored plan, read a block at a time: ``len``, ``shape``, ``dtype``, indexing
    by an int, a slice, an int or bool array, and :meth:`searchsorted` on a sorted 1-d array (one
    block read). ``np.asarray`` reads it all."""

    def __init__(
        self, output: Storage, rel: str, spec: dict[str, Any], cache: BlockCache,
        bad: Callable[[str, str], DamagedPlan], *, monotonic: bool = False,
    ) -> None:  # fmt: skip
        self._output, self._rel, self._cache, self._bad = output, rel, cache, bad
        self.dtype = np.dtype(spec["dtype"])
        self.shape = tuple(int(d) for d in spec["shape"])
        if not self.shape or any(d < 0 for d in self.shape):
            raise bad(rel, f"a bad shape {self.shape}")
        self.ndim = len(self.shape)
        self._rows = int(spec["rows"])
        self._digests = [str(d) for d in spec["blake2b"]]
        n_blocks = -(-self.shape[0] // self._rows) if self._rows > 0 else -1
        if self._rows < 1 or len(self._digests) != n_blocks:
            raise bad(rel, f"{len(self._digests)} block digests for {self.shape[0]} rows of {self._rows}")
        self._row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        if self._rows * self._row_bytes > max(BLOCK_BYTES, self._row_bytes) or self._row_bytes > BLOCK_BYTES:
            # what a block (and an index into it) may allocate is bounded before anything is read
            raise bad(rel, f"blocks of {self._rows} rows of {self._row_bytes} bytes: more than a block holds")
        first = spec.get("first")
        self._first = None if first is None else [int(x) for x in first]
        if self._first is not None and len(self._first) != n_blocks:
            raise bad(rel, "a first element per block is missing")
        self._monotonic = monotonic
        if monotonic and (
            self._first is None or any(b < a for a, b in zip(self._first, self._first[1:], strict=False))
        ):
            raise bad(rel, "offsets that do not rise")

    def __len__(self) -> int:
        return self.shape[0]

    def block(self, k: int) -> np.ndarray:
        """Block ``k``, checked against its digest (and, for offsets, rising)."""
        key = (self._rel, k)
        got = self._cache.get(key)
        if got is not None:
            return got
        rel = f"{self._rel}.{k}"
        n = min(self._rows, self.shape[0] - k * self._rows)
        nbytes = n * self._row_bytes
        try:
            data = self._output.get(rel, max_bytes=nbytes)
        except FileNotFoundError:
            raise self._bad(rel, "missing") from None
        except SpillMergeError as exc:
            raise self._bad(rel, str(exc)) from None
        if len(data) != nbytes or digest(data) != self._digests[k]:
            raise self._bad(rel, "fails its digest in plan.json: the stored plan is damaged")
        block = np.frombuffer(data, dtype=self.dtype).reshape((n, *self.shape[1:]))
        if self._first is not None and n and int(block[0]) != self._first[k]:
            raise self._bad(rel, "its first element is not the one plan.json names")
        if self._monotonic and n > 1 and bool(np.any(block[1:] < block[:-1])):
            raise self._bad(rel, "offsets that do not rise")
        self._cache.put(key, block)
        return block

    def __getitem__(self, key: Any) -> Any:
        n, rows = self.shape[0], self._rows
        if isinstance(key, (int, np.integer)):
            k = int(key) + n if int(key) < 0 else int(key)
            if not 0 <= k < n:
                raise IndexError(f"index {key} out of {n} rows of {self._rel}")
            return self.block(k // rows)[k % rows]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                return self[np.arange(start, stop, step, dtype=np.int64)]
            if stop <= start:
                return np.zeros((0, *self.shape[1:]), dtype=self.dtype)
            k0, k1 = start // rows, (stop - 1) // rows
            pieces = [self.block(k)[max(start - k * rows, 0) : stop - k * rows] for k in range(k0, k1 + 1)]
            return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        idx = np.asarray(key)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False)
        out = np.empty((*idx.shape, *self.shape[1:]), dtype=self.dtype)
        if not idx.size:
            return out
        flat = np.where(idx < 0, idx + n, idx).reshape(-1)
        if int(flat.min()) < 0 or int(flat.max()) >= n:
            raise IndexError(f"index out of {n} rows of {self._rel}")
        dest = out.reshape((-1, *self.shape[1:]))
        which = flat // rows
        k0, k1 = int(which.min()), int(which.max())
        if k0 == k1:  # (nearly always: a chunk's rows lie in one block; no sort of the indices)
            dest[:] = self.block(k0)[flat - k0 * rows]
        else:
            for k in np.unique(which).tolist():
                m = which == k
                dest[m] = self.block(k)[flat[m] - k * rows]
        return out

    def searchsorted(self, v: int, side: str = "left") -> int:
        """``ndarray.searchsorted`` of a rising 1-d integer array, reading one block."""
        if self._first is None:
            raise TypeError(f"{self._rel} is not a stored 1-d integer array")
        find = bisect.bisect_left if side == "left" else bisect.bisect_right
        k = find(self._first, int(v)) - 1
        if k < 0:
            return 0
        return k * self._rows + int(np.searchsorted(self.block(k), v, side=side))  # type: ignore[call-overload]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)
