"""A SpillWriter's lifecycle (:class:`WriterState`): its segment opened (header, folders, the flush
thread), committed (index, catalog and block checksums durable before the commit record, written
last) or aborted (the failure record); the resume helpers that read what earlier sessions
committed."""

from __future__ import annotations

import array
import contextlib
import enum
import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, Self

import numpy as np

from .._dist.rank import launcher_run_id, refused, resolve_rank, resolve_run_id
from .._dist.round import Rounds
from .._dist.store import next_session, publish_failure
from .._errors import SpillMergeError, SpillStorageError, SpillValueError, WriterClosedError
from .._format import common as F
from .._format import crc as _crc
from .._format import spill as FS
from .._format.zarr import array_meta, array_objects
from .._spill.barrier import check_not_stale
from .._spill.root import load_committed_keys
from .._storage import Storage
from .._util.gcpause import gc_paused
from .flush import grown
from .layouts import LayoutCatalog
from .leaves import check_filename, check_frame_idx
from .staging import Staging
from .templates import DenseTemplate, FrameTemplate, PyTemplate

DuplicatePolicy = Literal["error", "first", "last"]
_POLICIES = ("error", "first", "last")


class WriterState(enum.StrEnum):
    """A writer's lifecycle: ``NEW`` → ``open()`` → ``OPEN`` (writes) → ``close()`` → ``CLOSING``
    → ``COMMITTED``; an exception in the ``with`` block (or a failed commit, which passes back
    through ``OPEN``) → ``abort()`` → ``ABORTING`` → ``FAILED``. ``merge()`` needs ``COMMITTED``."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    ABORTING = "aborting"
    COMMITTED = "committed"
    FAILED = "failed"


class SegmentSteps:
    """``SpillWriter``'s constructor (its options, checked: the class's docstring) and the
    methods that open and end a segment (commit, abort) and read earlier sessions' commits."""

    run_id: str | None = None  # set by open()
    segment: str | None = None  # set by open()
    _state: WriterState = WriterState.NEW
    _committed_keys: dict[str, set[int]] | None = None  # read once, when first asked
    _finalizer: weakref.finalize
    """Ends the flush thread of a writer garbage-collected while open (``_never_closed``)."""

    _flush_at_commit = False
    """Start the flush thread only once a chunk fills (``Staging.start``'s ``at_commit``): a
    subclass for short-lived writers (the drop-ins) whose bytes usually fit in one chunk."""
    _counts_refusal = True
    """A constructor that raises counts this rank's writer session and tells the others, as
    :meth:`open` would have (``_dist.rank.refused``); ``gather`` does it itself, a bad option name included."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        chunk_bytes: int = F.DEFAULT_CHUNK_BYTES,
        staging_bytes: int | None = None,
        on_duplicate: DuplicatePolicy = "error",
        run_id: str | None = None,
        fsync: bool = True,
        flush_threads: int | None = None,
        allow_pickle: bool = False,
        expected: int | None = None,
    ) -> None:
        try:
            if on_duplicate not in _POLICIES:
                raise SpillValueError(f"on_duplicate must be one of {_POLICIES}, got {on_duplicate!r}")
            if not isinstance(chunk_bytes, int) or not 4096 <= chunk_bytes <= (1 << 32):
                raise SpillValueError(f"chunk_bytes must be an int in [4096, 2**32], got {chunk_bytes!r}")
            self.rank, self.world_size = resolve_rank(rank, world_size)
            self.storage = Storage(root, storage_options)
            self.root = self.storage.url
            self.chunk_bytes = chunk_bytes
            self.flush_threads = flush_threads if flush_threads is not None else (2 if self.storage.local else 4)
            if not _positive_int(self.flush_threads):
                raise SpillValueError(f"flush_threads must be a positive int, got {flush_threads!r}")
            if staging_bytes is not None and not _positive_int(staging_bytes):
                raise SpillValueError(f"staging_bytes must be a positive int or None, got {staging_bytes!r}")
            staging = staging_bytes if staging_bytes is not None else 4 * chunk_bytes
            self.n_buffers = max(2, -(-staging // chunk_bytes))
            self.on_duplicate: DuplicatePolicy = on_duplicate
            self.fsync = fsync
            self.allow_pickle = bool(allow_pickle)
            if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool) or expected < 0):
                raise SpillValueError(f"expected must be a number of frames >= 0 or None, got {expected!r}")
            self.expected = expected
            self._run_id_arg = run_id
            self._staging = Staging(chunk_bytes, self.n_buffers)
            self._rounds = Rounds()
            self._lock = threading.Lock()
            """Held by every call that changes the segment (open, write, write_batch, close, abort):
            threads sharing the writer take turns, a call at a time."""
        except Exception as exc:
            if self._counts_refusal:  # without a run id from the launcher or the caller, only the count
                refused(launcher_run_id(run_id), rank, world_size, exc)
            raise


    # ------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def open(self) -> None:
        """Start a new segment (called by ``__enter__``)."""
        with self._lock:
            if self._state is not WriterState.NEW:
                raise WriterClosedError("a SpillWriter can be opened only once; create a new one")
            self.run_id = resolve_run_id(self._run_id_arg)
            # Counted before anything that may fail on one rank only, as every rank counts it: the
            # next session of the run has the same number on every rank.
            self._session_number = next_session(self.run_id)
            # Before any compute: a root left by a run of another world size cannot be merged with
            # this one (every rank checks, so every rank fails here, not only the merging one).
            try:
                check_not_stale(self.storage, self.rank, self.world_size)
            except SpillMergeError as exc:
                publish_failure(self.run_id, self.rank, f"{type(exc).__name__}: {exc}", session=self._session_number)
                raise
            self.segment = FS.new_segment_name(self.storage.listdir(FS.rank_dirname(self.rank)))
            self._prefix = f"{FS.rank_dirname(self.rank)}/{self.segment}"
            self._filenames: list[str] = []
            self._file_ids: dict[str, int] = {}
            self._catalog = LayoutCatalog()
            self._keys: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (first row, n rows)
            self._fresh_keys: list[tuple[Sequence[int], list[int], int, int]] = []
            """Keys of write_batch's batches not yet in ``_keys`` (file ids, frames, first row, rows
            per frame): only a write to a file already written looks keys up, so a job of new files
            never builds the two tuples per key (:meth:`_key_map`)."""
            self._new_keys = array.array("q")
            """The same for ``write``'s frames of new files: (file id, frame, first row, n rows) per
            key, 32 bytes, not a dict entry and its two tuples (a gather of a million tiny values
            writes a million new files)."""
            self._dense_templates: dict[tuple[Any, ...], DenseTemplate] = {}
            self._frame_template: FrameTemplate | None = None
            self._py_template: PyTemplate | None = None
            self._dead_rows: list[tuple[int, int]] = []
            self._identical_rewrites = 0
            self._rewrites = 0  # writes of a key already written, whatever the policy kept
            self._rows = np.zeros((1024, FS.INDEX_COLUMNS), dtype=np.int64)
            self._n_rows = 0
            header = FS.SegmentHeader(
                rank=self.rank,
                world_size=self.world_size,
                segment=self.segment,
                run_id=self.run_id,
                chunk_bytes=self.chunk_bytes,
                started=F.utcnow(),
                expected=self.expected,
            )
            self.storage.makedirs(self._rel(f"{FS.DATA_NAME}/c"))
            self.storage.makedirs(self._rel(FS.JOURNAL_NAME))
            self.storage.put_atomic(self._rel("zarr.json"), header.to_json())
            if self.fsync:  # the segment's folders, so a journal entry names chunks that outlive a power loss
                self.storage.sync([self._rel(f"{FS.DATA_NAME}/c"), self._rel(FS.JOURNAL_NAME)])
            self._staging.start(
                self.storage, self._prefix, rank=self.rank, flush_threads=self.flush_threads,
                filenames=self._filenames, layouts=self._catalog.layouts, fsync=self.fsync,
                at_commit=self._flush_at_commit,
            )  # fmt: skip
            self._finalizer = weakref.finalize(self, _never_closed, self._staging, self.rank, self.segment_path)
            self._finalizer.atexit = False  # at exit the daemon threads just stop, as a killed writer's
            self._state = WriterState.OPEN

    def _rel(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    @property
    def segment_path(self) -> str:
        """Where this writer's segment lives (URL or path)."""
        return self.storage.describe(self._prefix) if self.segment else ""

    def _ended(self, state: WriterState) -> None:
        """The writer takes no more writes (``state``); the staging memory, only needed while
        writing, goes (a merge on this rank follows)."""
        self._state = state
        self._finalizer.detach()
        self._staging.pool.retire()
        self._rows = np.zeros((0, FS.INDEX_COLUMNS), dtype=np.int64)

    # --------------------------------------------------------------------------------- commit
    def _vanished(self, what: str) -> SpillStorageError:
        return SpillStorageError(
            f"{self.segment_path} vanished while spilling ({what}): was the spill root {self.root} deleted or "
            f"moved? Rank {self.rank}'s segment is not committed; spill again to a root that stays in place",
            path=self.segment_path,
        )

    def _check_segment(self, n_chunks: int | None = None, size: int = 0) -> None:
        """Fail when the segment is gone from storage, before writing anything that would recreate
        its folders (local writes create missing parents) or a commit record that would vouch
        for chunks that no longer exist. With ``n_chunks``, one listing also checks that every
        data chunk is there with its ``size``."""
        header = self._rel("zarr.json")
        found = dict(self.storage.find(self._prefix)) if n_chunks is not None else {}
        if header not in found and (n_chunks is not None or not self.storage.exists(header)):
            raise self._vanished("its header zarr.json is gone")
        for c in range(n_chunks or 0):
            got = found.get(self._rel(f"{FS.DATA_NAME}/c/{c}"))
            if got != size:
                state = "is gone" if got is None else f"has {got} bytes, not {size}"
                raise self._vanished(f"data chunk {c} {state}")

    def _sync_rows(self) -> None:
        """Bring ``_rows`` up to every frame staged (file, frame, layout, offset, nbytes: the rows
        staging hands the journal); only a rewrite of a key and the commit read them."""
        self._rows = grown(self._rows, self._n_rows)
        parts = self._staging.take_rows()
        while parts:
            part = parts.pop()
            self._rows[part[:, 0], : FS.COL_CRC] = part[:, 1:]

    @property
    def _n_frames(self) -> int:
        fresh = sum(len(frames) for _, frames, _, _ in self._fresh_keys)
        return len(self._keys) + fresh + len(self._new_keys) // 4

    def _write_index(self) -> FS.CommitRecord:
        self._check_segment()
        self._sync_rows()
        rows = self._rows[: self._n_rows]  # the writer takes no more rows: filled in place
        checks = self._staging.checksums(rows)
        if self._dead_rows:
            keep = np.ones(len(rows), dtype=bool)
            for first, n in self._dead_rows:
                keep[first : first + n] = False
            rows = rows[keep]
        rows = np.ascontiguousarray(rows)
        nbytes, n_chunks = self._staging.offset, self._staging.n_chunks
        chunk = max(nbytes, 1) if n_chunks == 1 else self.chunk_bytes  # one chunk: stored exactly sized
        data_meta = array_meta((nbytes,), (chunk,), "uint8", crc=False)
        index_bytes = rows.astype("<i8").tobytes()
        checks_bytes = checks.astype("<i8").tobytes()
        catalog = gc_paused(FS.encode_catalog, self._filenames, self._catalog.layouts)
        # A few small objects, written concurrently on object stores (one round trip, not one each).
        objects = {self._rel(f"{FS.DATA_NAME}/zarr.json"): F.dumps(data_meta)}
        objects.update(array_objects(self._rel(FS.INDEX_NAME), index_bytes, (len(rows), FS.INDEX_COLUMNS), "int64"))
        objects.update(array_objects(self._rel(FS.CATALOG_NAME), catalog, (len(catalog),), "uint8"))
        if len(checks):
            objects.update(array_objects(self._rel(FS.CHECKS_NAME), checks_bytes, checks.shape, "int64"))
        self.storage.put_many(objects)
        if self.fsync:  # everything the commit record vouches for is durable before it exists
            # (the data chunks were fsynced by the flush workers: here only their folders)
            chunks = [self._rel(f"{FS.DATA_NAME}/c/{c}") for c in range(n_chunks)]
            self.storage.sync([*objects, *chunks])
        return FS.CommitRecord(
            rank=self.rank,
            world_size=self.world_size,
            segment=str(self.segment),
            run_id=self.run_id,
            n_rows=len(rows),
            n_frames=self._n_frames,
            n_files=len(self._filenames),
            nbytes=nbytes,
            n_chunks=n_chunks,
            rewrites=self._rewrites,
            chunk_bytes=chunk,
            index_crc32c=_crc.value(index_bytes),
            catalog_crc32c=_crc.value(catalog),
            n_checks=len(checks),
            checks_crc32c=_crc.value(checks_bytes),
            finished=F.utcnow(),
        )

    def close(self) -> None:
        """Flush everything and write the commit record. Idempotent."""
        with self._lock:
            if self._state is WriterState.COMMITTED:
                return
            if self._state is not WriterState.OPEN:
                raise WriterClosedError(f"SpillWriter for rank {self.rank} is {self._state}; cannot commit")
            self._state = WriterState.CLOSING
            try:
                self._staging.finish()
                record = self._write_index()
                # Last look before the commit record vouches for the chunks: are they all still there?
                self._check_segment(record.n_chunks, record.chunk_bytes)
                self.storage.put_atomic(self._rel(FS.COMMIT_NAME), record.to_json())
            except BaseException as exc:
                self._state = WriterState.OPEN
                self._abort(exc)
                raise
            self._ended(WriterState.COMMITTED)

    def abort(self, exc: BaseException) -> None:
        """Record a failure (best effort) after flushing what was staged, so the data written so far
        stays readable; the commit record is never written."""
        with self._lock:
            self._abort(exc)

    def _abort(self, exc: BaseException) -> None:
        if self._state not in (WriterState.OPEN, WriterState.CLOSING):
            return
        self._state = WriterState.ABORTING
        with contextlib.suppress(BaseException):  # the original exception matters more
            if self._staging.stop():
                self._write_index()
        record = FS.FailureRecord(
            rank=self.rank, world_size=self.world_size, segment=str(self.segment), run_id=self.run_id,
            **F.exception_fields(exc),
        )  # fmt: skip
        with contextlib.suppress(BaseException):  # storage may be what failed
            self.storage.put_atomic(self._rel(FS.FAILURE_NAME), record.to_json())
        publish_failure(self.run_id, self.rank, record.summary(), session=self._session_number)
        self._ended(WriterState.FAILED)

    # --------------------------------------------------------------------------------- resume
    def committed_keys(self) -> dict[str, set[int]]:
        """Filename → frame indices committed under this root by earlier sessions of any rank
        (read once, when first asked). Use it to skip work after a crash."""
        if self._committed_keys is None:
            self._committed_keys = load_committed_keys(self.storage, exclude=self.segment)
        return self._committed_keys

    def is_committed(self, filename: str, frame_idx: int) -> bool:
        """True when ``(filename, frame_idx)`` was committed by an earlier session (any rank)."""
        frames = self.committed_keys().get(check_filename(filename))
        return frames is not None and check_frame_idx(frame_idx, filename) in frames

    def stats(self) -> dict[str, int]:
        """Counters of this writer: frames, rows, bytes, chunks, staging buffers allocated, and
        ``identical_rewrites``: writes of a key already written with the same bytes (kept once,
        under ``on_duplicate="error"``); ``rewrites``: every write of a key already written (kept
        once by the policy), recorded in the commit record and summed by the merge into
        ``MergeReport.rewrites`` / ``dropped_duplicates``."""
        return {
            "frames": self._n_frames if hasattr(self, "_keys") else 0,
            "rows": getattr(self, "_n_rows", 0),
            "bytes": self._staging.offset,
            "chunks": self._staging.n_chunks,
            "staging_buffers": self._staging.pool.allocated,
            "identical_rewrites": getattr(self, "_identical_rewrites", 0),
            "rewrites": getattr(self, "_rewrites", 0),
        }


def _never_closed(staging: Staging, rank: int, segment: str) -> None:
    """A writer garbage-collected while open: its threads and memory go; nothing is committed."""
    warnings.warn(
        f"SpillWriter for rank {rank} was never closed: {segment} stays uncommitted (leave the `with` "
        "block or call close() to commit it)",
        ResourceWarning,
        stacklevel=2,
    )
    staging.abandon()


def _positive_int(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0
