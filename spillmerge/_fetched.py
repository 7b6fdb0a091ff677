"""Arrays of an object store read where they are used: a merge in parts reads the other parts'
runs and ranges of the plan (``_planruns``, ``_planranges``) from the output's storage, and on
an object store fetching each whole into local disk made every part read every run (~170 GB a
part at 10^9 keys, docs/SCALE.md). A :class:`Fetched` array fetches the granules a read touches
(ranged GETs, nearby missing granules in one request) into a sparse work file, once, and serves
every later read of them from there."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._concat import Concat
from ._storage import Storage

GRANULE = 64 << 10
"""Bytes fetched at least per read (and the unit remembered as fetched): a binary search probes
one granule; a part's share of round-robin index chunks (256 KiB per array) is not rounded up
to its neighbours'."""
MAX_REQUEST = 16 << 20
"""Bytes of one ranged read at most (a long read is several, fetched together)."""
PREFETCH_BYTES = 64 << 20
"""Bytes :func:`prefetch` reads at once at most (more: one batch after another)."""


@dataclass
class Fetches:
    """What a process fetched of the objects it read through :class:`Fetched` arrays."""

    bytes: int = 0
    requests: int = 0
    rounds: int = 0
    """Reads that waited for their ranged reads (one ``read_into`` each, its reads at once)."""
    size: int = 0
    """Bytes of every object opened (what fetching them whole would have read)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int = 0, requests: int = 0, size: int = 0, rounds: int = 0) -> None:
        with self._lock:  # the plan's threads fetch from several objects at once
            self.bytes += nbytes
            self.requests += requests
            self.size += size
            self.rounds += rounds

    def __str__(self) -> str:
        return f"{self.bytes:,} bytes in {self.requests:,} ranged reads ({self.rounds:,} round trips) of {self.size:,}"


class _Object:
    """One object of ``nbytes`` bytes, mirrored into a sparse file of the work folder."""

    def __init__(self, output: Storage, rel: str, nbytes: int, local: np.ndarray, stats: Fetches) -> None:
        self.output, self.rel, self.nbytes, self.stats = output, rel, nbytes, stats
        self.local = local  # uint8 map of the work file, as long as the object
        self.have = np.zeros(-(-nbytes // GRANULE), dtype=bool)
        self.busy = np.zeros_like(self.have)
        """Granules another thread is fetching."""
        self.cond = threading.Condition()
        stats.add(size=nbytes)

    def ensure(self, a: int, b: int) -> None:
        """Bytes ``a .. b-1`` present in :attr:`local`."""
        if b <= a:
            return
        g0, g1 = a // GRANULE, -(-b // GRANULE)
        if not self.have[g0:g1].all():
            self.ensure_granules(np.arange(g0, g1, dtype=np.int64))

    def ensure_granules(self, granules: np.ndarray) -> None:
        """The sorted distinct ``granules`` present in :attr:`local`: the missing ones no other
        thread is fetching are fetched here in one read (runs of consecutive ones one ranged
        read each, cut at ``MAX_REQUEST``), outside the lock, so threads reading other parts of
        the object (the index writer's, the copy's) are not held up; then this waits for those
        another thread is fetching."""
        while True:
            with self.cond:
                need = granules[~self.have[granules]]
                if not len(need):
                    return
                mine = need[~self.busy[need]]
                if not len(mine):
                    self.cond.wait()
                    continue
                self.busy[mine] = True
            try:
                self._fetch(mine)
            except BaseException:
                with self.cond:
                    self.busy[mine] = False
                    self.cond.notify_all()
                raise
            with self.cond:
                self.have[mine] = True
                self.busy[mine] = False
                self.cond.notify_all()

    def _fetch(self, missing: np.ndarray) -> None:
        pieces = self.pieces(missing)
        buf = np.empty(sum(hi - lo for lo, hi in pieces), dtype=np.uint8)
        # One read of all of them: an object store fetches them at once.
        self.output.read_into([(self.rel, lo, hi) for lo, hi in pieces], buf.data)
        self.place(pieces, buf)
        self.stats.add(rounds=1)

    def pieces(self, missing: np.ndarray) -> list[tuple[int, int]]:
        """Byte ranges of the sorted ``missing`` granules: runs of consecutive ones, each cut at
        ``MAX_REQUEST``."""
        cuts = np.flatnonzero(np.diff(missing) != 1) + 1
        out = []
        per = max(1, MAX_REQUEST // GRANULE)
        for run in np.split(missing, cuts):
            for i in range(0, len(run), per):
                lo, hi = int(run[i]), int(run[min(i + per, len(run)) - 1]) + 1
                out.append((lo * GRANULE, min(hi * GRANULE, self.nbytes)))
        return out

    def place(self, pieces: list[tuple[int, int]], buf: np.ndarray) -> None:
        """``buf`` (``pieces``' bytes back to back) into :attr:`local`; counted."""
        pos = 0
        for lo, hi in pieces:
            self.local[lo:hi] = buf[pos : pos + hi - lo]
            pos += hi - lo
        self.stats.add(pos, len(pieces))


def prefetch(spans: Sequence[tuple[Any, int, int]]) -> None:
    """Fetch together what elements ``a .. b-1`` of each ``(array, a, b)`` will read, in one
    ``read_into`` per storage (an object store's ranged GETs at once, not one after another):
    ``Fetched`` arrays and ``Concat`` s of them; other arrays (maps of local files) are skipped.
    The copy calls it before it gathers a chunk's rows from several arrays of the plan."""
    want: dict[int, tuple[_Object, list[np.ndarray]]] = {}
    for arr, a, b in spans:
        _collect(arr, a, b, want)
    claimed: list[tuple[_Object, np.ndarray]] = []
    for obj, parts in want.values():
        g = np.unique(np.concatenate(parts))
        with obj.cond:
            need = g[~obj.have[g]]
            mine = need[~obj.busy[need]]
            obj.busy[mine] = True
        if len(mine):
            claimed.append((obj, mine))
    by_storage: dict[int, list[tuple[_Object, np.ndarray, list[tuple[int, int]]]]] = {}
    for obj, mine in claimed:
        by_storage.setdefault(id(obj.output), []).append((obj, mine, obj.pieces(mine)))
    try:
        for group in by_storage.values():
            batch: list[tuple[_Object, np.ndarray, list[tuple[int, int]]]] = []
            size = 0
            for item in group:  # batches of about PREFETCH_BYTES: the buffer is in memory
                batch.append(item)
                size += sum(hi - lo for lo, hi in item[2])
                if size >= PREFETCH_BYTES or item is group[-1]:
                    _read_batch(batch, size)
                    batch, size = [], 0
    finally:
        for obj, mine in claimed:
            with obj.cond:
                obj.busy[mine] = False
                obj.cond.notify_all()


def _read_batch(batch: list[tuple[_Object, np.ndarray, list[tuple[int, int]]]], size: int) -> None:
    reads = [(obj.rel, lo, hi) for obj, _m, ps in batch for lo, hi in ps]
    buf = np.empty(size, dtype=np.uint8)
    batch[0][0].output.read_into(reads, buf.data)
    batch[0][0].stats.add(rounds=1)
    pos = 0
    for obj, mine, ps in batch:
        n = sum(hi - lo for lo, hi in ps)
        obj.place(ps, buf[pos : pos + n])
        pos += n
        with obj.cond:
            obj.have[mine] = True


def _collect(arr: Any, a: int, b: int, want: dict[int, tuple[_Object, list[np.ndarray]]]) -> None:
    a, b = max(a, 0), min(b, len(arr))  # a span out of range is the gather's to refuse
    if b <= a:
        return
    if isinstance(arr, Fetched):
        lo, hi = (arr.start + a) * arr._row, (arr.start + b) * arr._row
        g = np.arange(lo // GRANULE, -(-hi // GRANULE), dtype=np.int64)
        want.setdefault(id(arr._obj), (arr._obj, []))[1].append(g)
    elif isinstance(arr, Concat):
        for k, p in enumerate(arr.pieces):
            lo, hi = int(arr.starts[k]), int(arr.starts[k + 1])
            if hi > a and lo < b:
                _collect(p, max(a, lo) - lo, min(b, hi) - lo, want)


class Fetched:
    """Elements ``start .. stop-1`` (first dimension) of an array stored as one raw object:
    ``len``, ``shape``, ``dtype``, ``ndim``, ``nbytes``; an int, a slice (a view of the local
    copy) or an int array as index, optionally followed by indexes of the other dimensions;
    ``searchsorted`` (numpy's ``np.searchsorted`` calls it) of a sorted array, a granule per probe;
    :meth:`window`; ``np.asarray`` fetches the whole window."""

    def __init__(self, obj: _Object, local: np.ndarray, start: int = 0, stop: int | None = None) -> None:
        self._obj, self._local = obj, local  # ``local``: the whole object's map, typed and shaped
        self.start = start
        self.stop = len(local) if stop is None else stop
        self.dtype = local.dtype
        self.shape = (self.stop - self.start, *local.shape[1:])
        self.ndim = len(self.shape)
        self._row = local.dtype.itemsize * int(np.prod(local.shape[1:], dtype=np.int64))
        self.nbytes = self.shape[0] * self._row

    def __len__(self) -> int:
        return self.shape[0]

    def window(self, a: int, b: int) -> Fetched:
        """Elements ``a .. b-1`` of this one, fetched lazily too."""
        a, b, _ = slice(a, b).indices(len(self))
        return Fetched(self._obj, self._local, self.start + a, self.start + max(a, b))

    def _rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``a .. b-1`` of the window (``0 <= a <= b <= len``), fetched, as a view."""
        lo, hi = self.start + a, self.start + b
        self._obj.ensure(lo * self._row, hi * self._row)
        return self._local[lo:hi]

    def __getitem__(self, index: Any) -> Any:
        rest: tuple[Any, ...] = ()
        if isinstance(index, tuple):
            index, rest = index[0], index[1:]
        if isinstance(index, (int, np.integer)):
            i = int(index)
            n = len(self)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"index {int(index)} is out of bounds for an array of {n}")
            return self._rows(i, i + 1)[(0, *rest)]
        if isinstance(index, slice):
            a, b, step = index.indices(len(self))
            if step == 1:
                out = self._rows(a, max(a, b))
                return out[(slice(None), *rest)] if rest else out
            index = np.arange(a, b, step, dtype=np.int64)
        idx = np.asarray(index)
        if idx.dtype == bool:
            raise TypeError("Fetched takes int indexes, not a mask")
        idx = idx.astype(np.int64, copy=False)
        n = len(self)
        if idx.size and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"an index is out of bounds for an array of {n}")
        idx = np.where(idx < 0, idx + n, idx) + self.start
        if idx.size:
            flat = idx.reshape(-1)
            first = flat * self._row // GRANULE
            reach = int(((flat * self._row + self._row - 1) // GRANULE - first).max())  # a row over granules
            gr = np.unique(first if not reach else (first[:, None] + np.arange(reach + 1)).reshape(-1))
            self._obj.ensure_granules(gr[gr < len(self._obj.have)])
        out = self._local[idx]
        return out[(slice(None), *rest)] if rest else out

    def searchsorted(self, v: Any, side: Any = "left", sorter: Any = None) -> Any:
        """``np.searchsorted`` of this sorted one-dimensional window: a binary search over
        elements, each probe fetching its granule only."""
        if sorter is not None or self.ndim != 1:
            raise TypeError("Fetched.searchsorted takes no sorter, and one dimension")
        vs = np.asarray(v)
        out = np.empty(vs.shape, dtype=np.intp)
        flat = out.reshape(-1)
        for k, x in enumerate(vs.reshape(-1).tolist()):
            lo, hi = 0, len(self)
            while hi - lo > max(1, GRANULE // self._row):
                mid = (lo + hi) // 2
                y = self[mid]
                if y < x or (side == "right" and y == x):
                    lo = mid + 1
                else:
                    hi = mid
            flat[k] = lo + int(np.searchsorted(self._rows(lo, hi), x, side=side))
        return out if vs.ndim else out[()]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.array(self._rows(0, len(self)))
        return out if dtype is None else out.astype(dtype)

    def __iter__(self) -> Iterator[Any]:
        step = max(1, (4 << 20) // max(1, self._row))
        for a in range(0, len(self), step):
            yield from self._rows(a, min(a + step, len(self)))


def fetched(output: Storage, rel: str, dtype: np.dtype[Any], shape: tuple[int, ...], local_path: str,
            stats: Fetches) -> Fetched:  # fmt: skip
    """The raw little-endian object ``rel`` (already checked to hold ``shape`` of ``dtype``) as a
    :class:`Fetched` array mirrored into the new sparse file ``local_path``."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        empty = np.zeros(shape, dtype=dtype)
        return Fetched(_Object(output, rel, 0, empty.reshape(-1).view(np.uint8), stats), empty)
    with open(local_path, "xb") as f:  # never another array's copy (FileExistsError)
        f.truncate(nbytes)
    raw = np.memmap(local_path, dtype=np.uint8, mode="r+", shape=(nbytes,))
    return Fetched(_Object(output, rel, nbytes, raw, stats), raw.view(dtype).reshape(shape))
