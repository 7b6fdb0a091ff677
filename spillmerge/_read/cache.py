"""Decoded chunks of an open output (``open(out, cache_bytes=...)``), shared by its leaf views and
``column()``: only chunks zarr decoded (crc32c checked) enter, least recently used go first, and a
chunk another thread is decoding is waited for, not decoded twice."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from .._errors import ConfigError, CorruptSpillError

DEFAULT_CACHE_BYTES = 64 << 20
"""Default bound of one open output's decoded chunks: four 16 MiB chunks of large rows, or
sixteen 4 MiB chunks of small ones (docs/FORMAT.md section 2, *Chunks*)."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What a :class:`ChunkCache` holds and did (``MergedStore.cache_stats()``)."""

    max_bytes: int
    """The bound: decoded chunks held never add up to more."""
    nbytes: int
    """Bytes of decoded chunks held now."""
    chunks: int
    """Chunks held now."""
    hits: int
    """Chunk reads served from the cache (rows read in order ahead: one per block of rows; the
    in-order path counts without the lock, so threads reading at once may lose a few)."""
    misses: int
    """Reads that decoded a chunk."""


class ChunkCache:
    """A thread-safe LRU of decoded chunks, bounded by bytes (``max_bytes``; 0 keeps nothing).

    :meth:`get` returns the chunk under ``key``, calling ``load`` to decode it on a miss; the
    arrays it returns are read-only (they are shared between readers): take a copy to write.
    ``same_output()`` raises when the output was replaced: called after a read from storage
    (:meth:`read_from_storage`) while chunks read before are held, so none is served beside
    another merge's, and as ``same_output(True)`` where a read found damage (:meth:`damage_found`)."""

    def __init__(self, max_bytes: int, same_output: Callable[..., None] | None = None) -> None:
        if not isinstance(max_bytes, int | float | np.integer) or max_bytes < 0:
            raise ConfigError(f"cache_bytes must be >= 0 (bytes), got {max_bytes!r}", key="cache_bytes")
        self.max_bytes = int(max_bytes)
        self._same_output = same_output
        self._lock = threading.Lock()
        self._chunks: OrderedDict[Hashable, tuple[np.ndarray, int]] = OrderedDict()
        self._nbytes = 0
        self._loading: dict[Hashable, threading.Event] = {}
        self._hits = 0
        self._misses = 0

    def get(self, key: Hashable, load: Callable[[], np.ndarray]) -> np.ndarray:
        while True:
            with self._lock:
                hit = self._chunks.get(key)
                if hit is not None:
                    self._chunks.move_to_end(key)
                    self._hits += 1
                    return hit[0]
                pending = self._loading.get(key)
                if pending is None:
                    self._misses += 1
                    mine = self._loading[key] = threading.Event()
                    break
            # Another thread decodes this chunk: wait for it rather than hold a second copy. If it
            # failed (a corrupt chunk), nothing was stored and this thread decodes and raises too.
            pending.wait()
        try:
            try:
                arr = load()
            except CorruptSpillError:
                self.damage_found()
                raise
            self.read_from_storage()
            arr.flags.writeable = False
            # The memory it holds: for strings their characters too (numpy's StringDType keeps them
            # outside the buffer; 4 bytes a character, UTF-32's most, bounds numpy's UTF-8 arena).
            size = int(arr.nbytes)
            if arr.dtype.kind in ("T", "O", "U") and arr.size:
                size += 4 * int(np.strings.str_len(arr.astype(np.dtypes.StringDType(), copy=False)).sum())
            if size <= self.max_bytes:  # else it would evict everything and still not fit: uncached
                with self._lock:  # (the key is not held: only this thread loads it)
                    while self._chunks and self._nbytes + size > self.max_bytes:
                        _, (_, dropped) = self._chunks.popitem(last=False)
                        self._nbytes -= dropped
                    self._chunks[key] = (arr, size)
                    self._nbytes += size
            return arr
        finally:
            with self._lock:
                del self._loading[key]
            mine.set()

    def read_from_storage(self) -> None:
        """A chunk was just read from storage: check that the output is the one opened when
        chunks read earlier are held (with nothing held, nothing older can be mixed in)."""
        if self._chunks and self._same_output is not None:
            self._same_output()

    def damage_found(self) -> None:
        """A read of this output just found damage: when the output was replaced since it was
        opened (an overwrite removes chunks and rewrites them), raise that instead."""
        if self._same_output is not None:
            self._same_output(True)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.max_bytes, self._nbytes, len(self._chunks), self._hits, self._misses)


class Chunks:
    """``chunks(c)``: chunk ``c`` of one array (``key``) through ``cache``, ``load(c)`` decoding it on
    a miss. The chunk read last is kept by a weak reference while the cache holds it: reads in
    order skip the cache's lock, and the cache alone bounds the memory."""

    __slots__ = ("_cache", "_key", "_last", "_load")

    def __init__(self, cache: ChunkCache, key: Hashable, load: Callable[[int], np.ndarray]) -> None:
        self._cache, self._key, self._load = cache, key, load
        self._last: tuple[int, weakref.ref[np.ndarray]] | None = None

    def __call__(self, c: int) -> np.ndarray:
        last = self._last
        if last is not None and last[0] == c:
            arr = last[1]()
            if arr is not None:  # a hit: counted without the lock (a read costs about a microsecond)
                self._cache._hits += 1
                return arr
        arr = self._cache.get((self._key, c), lambda: self._load(c))
        self._last = (c, weakref.ref(arr))
        return arr
