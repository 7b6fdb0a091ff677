"""The segment's progress record (``progress.json``): what the flush thread has made durable so
far, rewritten at most every few seconds so that ``spillmerge status`` reads one small object per
rank instead of listing and replaying the journal (docs/FORMAT.md, *progress.json*); the progress
bar of merge, inspect and verify."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from .._format import common as F
from .._storage import Storage

PROGRESS_NAME = "progress.json"
PROGRESS_INTERVAL = 2.0
"""Seconds between two rewrites of a segment's progress record (the flush thread waits at most
this long to write the last one after a pause)."""


@dataclass(frozen=True, slots=True)
class ProgressRecord:
    """Contents of ``progress.json``: totals of what the segment's journal lists so far."""

    rank: int
    """Rank that writes the segment."""
    segment: str
    """Segment folder name."""
    frames: int
    """Frames durable (listed by a journal entry) so far."""
    rows: int
    """Index rows (leaves) durable so far."""
    nbytes: int
    """Payload bytes of those rows."""
    chunks: int
    """Data chunks durable (``c/0 .. c/chunks-1``)."""
    updated: float
    """Unix time (writer's clock) the last of those chunks became durable."""
    staged_frames: int = 0
    """Frames the writer has taken so far, durable or still in a staging buffer (rewrites of a
    key included): small outputs fill a chunk only after many frames, and this moves before."""
    staged_bytes: int = 0
    """Payload bytes of those frames."""
    staged_updated: float = 0.0
    """Unix time (writer's clock) the writer was last seen taking a frame (to a few seconds)."""

    def to_json(self) -> bytes:
        return F.dumps({"format_version": F.SPILL_FORMAT_VERSION, "kind": "spill-progress", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> ProgressRecord | None:
        """The record, or None when it is not one (a progress record is advisory: status shows
        the rank without counts rather than failing)."""
        try:
            obj = F.loads(data, path=path)
            if not isinstance(obj, dict) or obj.get("kind") != "spill-progress":
                return None
            ints = {k: obj[k] for k in ("rank", "frames", "rows", "nbytes", "chunks", "staged_frames", "staged_bytes")}
            times = {k: float(obj[k]) for k in ("updated", "staged_updated") if type(obj[k]) in (int, float)}
            if len(times) < 2 or not all(type(v) is int and v >= 0 for v in ints.values()):
                return None
            return cls(segment=str(obj.get("segment")), **(ints | times))
        except (KeyError, F.CorruptSpillError):
            return None


class ProgressWriter:
    """Counts what becomes durable (called by the flush thread, in chunk order) and rewrites the
    progress record at most every :data:`PROGRESS_INTERVAL` seconds. Never raises: a progress record that
    cannot be written must not fail or slow the spill (status then shows older counts)."""

    def __init__(self, storage: Storage, prefix: str, *, rank: int) -> None:
        self.storage, self.rel, self.rank = storage, f"{prefix}/{PROGRESS_NAME}", rank
        self.segment = prefix.rsplit("/", 1)[-1]
        self._lock = threading.Lock()  # counters (flush thread) vs. snapshots (upload threads)
        self._put_lock = threading.Lock()  # one PUT at a time, newest wins
        self._frames = self._rows = self._bytes = self._chunks = 0
        self._updated = 0.0
        self._seq = self._written_seq = 0
        self._last_put = 0.0
        self.staged: Callable[[], tuple[int, int]] | None = None
        """(frames, bytes) the writer has staged so far (``Staging`` sets it); polled here, so the
        record moves while no chunk is full yet."""
        self._staged = (0, 0)
        self._staged_at = 0.0

    def durable(self, number: int, completed: np.ndarray) -> None:
        """Chunk ``number`` and every earlier one are durable; ``completed`` are the int64 rows
        (row, file, frame, layout, offset, nbytes) its journal entry lists (whole frames,
        consecutive rows per frame)."""
        keys = completed[:, 1:3]
        frames = int(len(keys) > 0) + int(np.count_nonzero(np.any(keys[1:] != keys[:-1], axis=1)))
        nbytes = int(completed[:, 5].sum())
        with self._lock:
            self._frames += frames
            self._rows += len(completed)
            self._bytes += nbytes
            self._chunks = number + 1
            self._updated = time.time()
            self._seq += 1

    def _poll_staged(self) -> None:
        """Take the writer's staged counts (under ``_lock``); a change is news for the record."""
        got = self.staged() if self.staged is not None else (0, 0)
        if got != self._staged:
            self._staged, self._staged_at = got, time.time()
            self._seq += 1

    def behind(self) -> bool:
        """Something durable or staged is not in the record yet."""
        with self._lock:
            self._poll_staged()
            return self._seq != self._written_seq

    def maybe_write(self, *, trailing: bool = False) -> None:
        """Rewrite the record if something new is durable and the interval has passed since the
        last rewrite (``trailing``: the flush thread is idle, write what is left now)."""
        now = time.monotonic()
        with self._lock:
            self._poll_staged()
            if self._seq == self._written_seq or (not trailing and now - self._last_put < PROGRESS_INTERVAL):
                return
            seq, rec = self._seq, self._snapshot()
            self._last_put = now
        with self._put_lock:
            if seq <= self._written_seq:  # a newer snapshot got there first
                return
            # Whole or nothing for a reader (temporary name + rename on local disks, one PUT
            # elsewhere); no fsync: the record is advisory, the journal is the durable truth.
            with contextlib.suppress(Exception):  # advisory record; the spill goes on without it
                with self.storage.open_write(self.rel) as sink:
                    sink.write(rec.to_json())
                self._written_seq = seq

    def _snapshot(self) -> ProgressRecord:
        frames, nbytes = self._staged
        return ProgressRecord(
            self.rank, self.segment, self._frames, self._rows, self._bytes, self._chunks, self._updated,
            max(frames, self._frames), max(nbytes, self._bytes), max(self._staged_at, self._updated),
        )  # fmt: skip


def read(storage: Storage, seg_rel: str) -> ProgressRecord | None:
    """The segment's progress record; None when it has none or it is not one. A record that is
    no regular file or over ``RECORD_MAX_BYTES`` (64 KiB) raises (``SpillMergeError``) without
    being read, naming it."""
    raw = storage.get_or_none(f"{seg_rel}/{PROGRESS_NAME}", max_bytes=F.RECORD_MAX_BYTES)
    return None if raw is None else ProgressRecord.from_json(raw, path=storage.describe(f"{seg_rel}/{PROGRESS_NAME}"))


def iso_to_unix(text: Any) -> float | None:
    """Seconds since the epoch of a record's UTC ISO-8601 time (None when unreadable)."""
    try:
        dt = datetime.fromisoformat(text)  # (a trailing Z reads as UTC since Python 3.11)
    except (TypeError, ValueError):  # not a str, or not ISO-8601
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


class _NoBar(contextlib.nullcontext["_NoBar"]):
    """The bar of a run nobody watches: tqdm is not even imported."""

    def __init__(self) -> None:
        super().__init__(self)

    def update(self, n: int = 1) -> None:
        return None


def bar(total: int, desc: str, unit: str = "B", *, show: bool | None = None, **kw: Any) -> Any:
    """A tqdm bar on stderr when ``show`` (None: only on a terminal, so piped output and logs stay
    free of carriage returns), used as a context manager; else one that draws nothing."""
    if not (sys.stderr.isatty() if show is None else show):
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, **kw)
