"""A committed segment's catalog and index read a block of bytes at a time (:class:`Stream`), so
what a merge holds of one segment does not grow with its size. Every block is checked as it is
read (the checks of a whole segment are the merge plan's, ``_merge.plansql``); anything unexpected
raises :class:`Whole`, and ``_spill.root.load_segment`` then reads it whole and names the damage.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._errors import CorruptSpillError, SpillMergeError
from .._format import common as F
from .._format import crc as _crc
from .._format import spill as FS
from .._storage import Storage
from .root import Segment, check_rows, corrupt, read_checks

BLOCK = 4 << 20
"""Bytes of a catalog or index read at a time."""

_PREFIX = b'{"filenames": ['
_QUOTE, _COMMA, _SPACE, _CLOSE, _BACKSLASH = 0x22, 0x2C, 0x20, 0x5D, 0x5C


class Whole(Exception):
    """The segment must be read whole (``load_segment``): not the writer's catalog, or damaged."""


@contextlib.contextmanager
def _whole_on(*errors: type[BaseException]) -> Iterator[None]:
    """:class:`Whole` instead of any of ``errors`` raised in the block."""
    try:
        yield
    except errors:
        raise Whole from None


def _object(storage: Storage, rel: str, shape: list[int] | None, nbytes: int | None, limit: int) -> tuple[str, int]:
    """The chunk object of the one-chunk array ``rel`` and its data's size (without the 4 CRC
    bytes), checked against its metadata and its size on storage."""
    with _whole_on(OSError, SpillMergeError):
        meta = F.loads(storage.get(f"{rel}/zarr.json", max_bytes=F.RECORD_MAX_BYTES), path=storage.describe(rel))
    got = meta.get("shape") if isinstance(meta, dict) else None
    if not isinstance(got, list) or not got or not all(isinstance(d, int) and d > 0 for d in got) or shape not in (None, got):
        raise Whole
    n = nbytes if nbytes is not None else got[0]
    if n > limit:
        raise Whole
    key = f"{rel}/c/" + "/".join("0" * len(got))
    with _whole_on(OSError, SpillMergeError):
        found = dict(storage.find(f"{rel}/c"))
    if found != {key: n + 4}:
        raise Whole
    return key, n


def _blocks(storage: Storage, key: str, n: int, step: int, want: int) -> Iterator[np.ndarray]:
    """Bytes ``[0, n)`` of ``key``, ``step`` at a time; then their CRC-32C is compared with the
    chunk's trailer and with ``want``, the commit record's (:class:`Whole` when either differs)."""
    buf = np.empty(min(step, n) + 4, dtype=np.uint8)
    crc = 0
    for a in range(0, n, step):
        b = min(n, a + step)
        with _whole_on(OSError, SpillMergeError):
            storage.read_into([(key, a, b)], buf[: b - a].data)
        crc = _crc.extend(crc, buf[: b - a])
        yield buf[: b - a]
    tail = np.empty(4, dtype=np.uint8)
    with _whole_on(OSError, SpillMergeError):
        storage.read_into([(key, n, n + 4)], tail.data)
    if int.from_bytes(tail.tobytes(), "little") != crc or crc != want:
        raise Whole


class _Names:
    """The incremental parse of the catalog's ``filenames`` list, in the writer's form only."""

    def __init__(self, data: Any, offsets: Any) -> None:
        self.data, self.offsets = data, offsets
        self.n = 0
        self.nbytes = 0
        self.after = False
        """An element was read: a ``, `` or the closing ``]`` comes next."""
        self.done = False
        offsets.write(np.zeros(1, np.int64).data)

    def feed(self, buf: np.ndarray) -> int:
        """Read the whole elements of ``buf``; return where the unread bytes start (after the
        closing ``]`` once :attr:`done`)."""
        pos = 0
        while not self.done:
            if self.after:
                if pos < len(buf) and buf[pos] == _CLOSE:
                    self.done = True
                    return pos + 1
                if len(buf) - pos < 2:
                    return pos
                if buf[pos] != _COMMA or buf[pos + 1] != _SPACE:
                    raise Whole
                pos += 2
                self.after = False
            elif self.n == 0 and pos < len(buf) and buf[pos] == _CLOSE:
                self.done = True
                return pos + 1
            if pos >= len(buf):
                return pos
            if buf[pos] != _QUOTE:
                raise Whole
            q = _unescaped(buf, np.flatnonzero(buf[pos:] == _QUOTE) + pos)
            opens, closes = q[0::2], q[1::2]
            m = len(closes)
            if not m:
                return pos  # an element that goes on in the next block
            opens = opens[:m]
            chained = (opens[1:] == closes[:-1] + 3) & (buf[closes[:-1] + 1] == _COMMA)
            chained &= buf[np.minimum(closes[:-1] + 2, len(buf) - 1)] == _SPACE
            k = int(np.argmin(chained)) + 1 if not chained.all() else m
            self._take(buf, opens[:k], closes[:k])
            pos = int(closes[k - 1]) + 1
            self.after = True
        return pos

    def _take(self, buf: np.ndarray, opens: np.ndarray, closes: np.ndarray) -> None:
        """Elements ``buf[opens[i] + 1 : closes[i]]`` (back to back in ``buf``, ``", "`` apart)."""
        a, b = int(opens[0]), int(closes[-1]) + 1
        region = buf[a:b]
        with _whole_on(UnicodeDecodeError):
            region.tobytes().decode("utf-8")  # the separators are ASCII: each name is valid on its own
        keep = np.ones(b - a, dtype=bool)
        keep[0] = keep[-1] = False
        for d in range(3):
            keep[closes[:-1] - a + d] = False
        keep[opens[1:] - a] = False
        names = region[keep]
        if len(names) and names.min() < 0x20:
            raise Whole  # a control character JSON forbids: read whole (it says so)
        lengths = (closes - opens - 1).astype(np.int64)
        if len(names) and np.any(names == _BACKSLASH):
            names, lengths = _unescape(names, lengths)
        if lengths.max() > F.FILENAME_MAX_BYTES:
            raise Whole
        self.data.write(names.data)
        self.offsets.write((self.nbytes + np.cumsum(lengths)).data)
        self.nbytes += int(lengths.sum())
        self.n += len(lengths)


def _unescaped(buf: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Quote positions ``q`` of ``buf`` without those a backslash escapes (after an odd run of
    backslashes; a run never starts before the first quote, where an element starts)."""
    drop = []
    for i in np.flatnonzero(buf[np.maximum(q - 1, 0)] == _BACKSLASH).tolist():
        p = int(q[i]) - 1
        while p >= 0 and buf[p] == _BACKSLASH:
            p -= 1
        if (int(q[i]) - 1 - p) % 2:
            drop.append(i)
    return np.delete(q, drop) if drop else q


def _unescape(names: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Names as their JSON string bodies (back to back, ``lengths`` bytes each), those with an
    escape decoded (rare: a name per element); :class:`Whole` when one is not valid JSON or holds
    a lone surrogate (``_format.common.loads`` refuses it)."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    parts = np.split(names, starts[1:])
    seen = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(names == _BACKSLASH, out=seen[1:])
    escaped = seen[starts + lengths] - seen[starts]
    for i in np.flatnonzero(escaped).tolist():
        with _whole_on(ValueError, UnicodeEncodeError):
            text = json.loads(b'"' + parts[i].tobytes() + b'"')
            parts[i] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    lengths = np.array([len(x) for x in parts], dtype=np.int64)
    return np.concatenate(parts), lengths


class Stream:
    """A committed segment read a block at a time: its catalog when made (filenames to the
    files ``<stem>.u8``/``<stem>.i8``, :meth:`names`; :attr:`layouts`; :attr:`checks`), then its
    index by :meth:`rows`, as often as asked (each time read and checked again)."""

    def __init__(self, storage: Storage, seg: Segment, stem: str) -> None:
        commit = seg.commit
        assert commit is not None
        self.storage, self.seg, self.commit, self.stem = storage, seg, commit, stem
        self.layouts, self.n_files, self.name_bytes = self._catalog()
        with _whole_on(CorruptSpillError):  # the chunks promised, the block checksums (small: read whole)
            self.checks: np.ndarray | None = read_checks(storage, seg)

    def _catalog(self) -> tuple[list[FS.Layout], int, int]:
        """The catalog's layouts, number of filenames and their bytes (the names to the files)."""
        rel = f"{self.seg.rel}/{FS.CATALOG_NAME}"
        limit = FS.catalog_max_bytes(self.commit.n_files, self.commit.n_rows)
        key, n = _object(self.storage, rel, None, None, limit)
        head = b""
        rest = bytearray()
        with open(f"{self.stem}.u8", "wb") as data, open(f"{self.stem}.i8", "wb") as offsets:
            names = _Names(data, offsets)
            left = np.zeros(0, dtype=np.uint8)
            for block in _blocks(self.storage, key, n, BLOCK, self.commit.catalog_crc32c):
                if len(head) < len(_PREFIX):  # the writer's catalog starts so
                    take = len(_PREFIX) - len(head)
                    head += block[:take].tobytes()
                    block = block[take:]
                    if head != _PREFIX[: len(head)]:
                        raise Whole
                if not names.done:
                    buf = np.concatenate([left, block]) if len(left) else block
                    block = buf[names.feed(buf) :]
                    if not names.done:  # an element goes on in the next block
                        left = block.copy()
                        if len(left) > F.FILENAME_MAX_BYTES + BLOCK:
                            raise Whole
                        continue
                rest += block.tobytes()
        if not names.done:
            raise Whole
        with _whole_on(CorruptSpillError):
            obj = F.loads(b'{"filenames": []' + bytes(rest), path=self.storage.describe(rel))
        if not isinstance(obj, dict) or obj.get("filenames") != [] or not isinstance(obj.get("layouts"), list):
            raise Whole
        with _whole_on(CorruptSpillError):
            where = self.storage.describe(rel)
            layouts = FS.Layout.many(obj["layouts"], path=where)
        return layouts, names.n, names.nbytes

    def names(self) -> Any:
        """The catalog's filenames as an Arrow ``large_binary`` array over maps of the files."""
        import pyarrow as pa

        data: Any = np.zeros(1, np.uint8)
        if self.name_bytes:
            data = np.memmap(f"{self.stem}.u8", dtype=np.uint8, mode="r", shape=(self.name_bytes,))
        off = np.memmap(f"{self.stem}.i8", dtype=np.int64, mode="r", shape=(self.n_files + 1,))
        return pa.Array.from_buffers(pa.large_binary(), self.n_files, [None, pa.py_buffer(off), pa.py_buffer(data)])

    def rows(self, step: int) -> Iterator[np.ndarray]:
        """The index, about ``step`` rows at a time (int64, ``(rows, FS.INDEX_COLUMNS)``), each
        block checked against the catalog and the data size before it is given; its CRC-32C
        compared with the commit record's after the last (:class:`Whole` when anything fails)."""
        c = self.commit
        width = FS.INDEX_COLUMNS * 8
        rel = f"{self.seg.rel}/{FS.INDEX_NAME}"
        key, n = _object(self.storage, rel, [c.n_rows, FS.INDEX_COLUMNS], c.n_rows * width, c.n_rows * width)
        bad = functools.partial(corrupt, self.storage, self.seg)
        for block in _blocks(self.storage, key, n, max(1, step) * width, c.index_crc32c):
            idx = block.view("<i8").reshape(-1, FS.INDEX_COLUMNS).astype(np.int64, copy=False)
            with _whole_on(CorruptSpillError):
                check_rows(bad, self.n_files, self.layouts, list(idx.T), c.nbytes, self.checks, c.chunk_bytes)
            yield idx
