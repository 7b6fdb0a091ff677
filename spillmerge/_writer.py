"""SpillWriter: each rank appends frames to its own segment under the spill root.

Protocol (see docs/ARCHITECTURE.md):
  (every rank)   __enter__ → write/update ... → __exit__ (commit record last) → merge(out)
  (merging rank) merge waits for every rank's commit record, moves the shards of ranks whose
                 storage it cannot see over torch.distributed (_transfer.py), then merges.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal

import google_crc32c
import numpy as np
import torch

from . import _format as F
from . import _output
from ._dist import dist_initialized, resolve_rank, resolve_run_id
from ._errors import (
    ConfigError,
    DuplicateFrameError,
    LayoutMismatchError,
    SpillMergeError,
    SpillStorageError,
    SpillValueError,
    WriterClosedError,
)
from ._merge import merge, merge_parallel
from ._report import MergeReport
from ._spillroot import load_committed_keys
from ._staging import BufferPool, Chunk, Flusher
from ._storage import Storage
from ._transfer import (
    DEFAULT_TRANSFER_CHUNK_BYTES,
    DEFAULT_TRANSFER_TIMEOUT,
    OutcomeWatch,
    Session,
    TransferInfo,
    check_options,
    next_session,
    publish_failure,
    publish_merge_outcome,
    transfer_shards,
)
from ._values import Leaf, check_filename, check_frame_idx, flatten
from ._zarrmeta import array_meta, array_objects


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


DuplicatePolicy = Literal["error", "first", "last"]
_POLICIES = ("error", "first", "last")
_COMPARE_WINDOW = 1 << 20
"""Bytes compared at a time when a key is written again (bounded memory for any frame size)."""

_Sig = tuple[str, str | None, int | None]
_EMPTY_LIST: _Sig = ("num", None, 1)
"""The signature of ``[]`` (a float64 array of shape (0,)): also an empty list of strings."""
"""What a leaf must keep within a file: (kind, numeric dtype or None when not yet known, ndim)."""


def _describe(lay: F.Layout) -> str:
    return f"{lay.dtype}{list(lay.shape)}" if lay.kind == "num" else f"a {lay.kind}"


def _describe_sig(sig: _Sig) -> str:
    kind, dtype, ndim = sig
    if kind != "num":
        return f"a {kind}"
    return f"{dtype or 'empty numeric'} with {ndim} dim{'s' if ndim != 1 else ''}"


class SpillWriter:
    """Append ``(filename, frame_idx) -> value`` predictions of one rank to a spill root.

    ``root`` is a local path or an fsspec URL; every rank of a job uses the same root and writes
    only below ``root/rank-RRRRR/``. Use it as a context manager; leaving the ``with`` block writes
    the commit record (or a failure record when the block raised). Then every rank calls
    :meth:`merge`.

    Args:
        root: spill root (local path or fsspec URL).
        rank, world_size: default to torch.distributed when initialised, else env ``RANK`` /
            ``WORLD_SIZE``, else 0 / 1.
        storage_options: passed to fsspec for ``root``.
        chunk_bytes: size of each data chunk object (default 16 MiB).
        staging_bytes: host memory for staging chunks (default 4 chunks); ``write`` blocks while
            all of it waits for storage.
        on_duplicate: ``"error"`` (default: a key written again with different bytes raises
            :class:`~spillmerge.DuplicateFrameError`; the same bytes again are kept once, see
            :meth:`stats`), ``"first"`` (ignore later writes of a key) or ``"last"`` (a later write
            replaces the earlier one).
        run_id: id shared by all ranks of a job run; defaults to the launcher's id.
        fsync: on local disks, fsync every object of the segment before the commit record is
            written (default True).
        flush_threads: chunk uploads in flight (default 1 on local disks, 4 on object stores).
        allow_pickle: store values of no other kind (docs/FORMAT.md section 1) as pickled bytes
            instead of refusing them with :class:`~spillmerge.SpillValueError`; reading them back
            needs ``spillmerge.open(out, allow_pickle=True)``. Off by default: nothing is pickled
            unless both sides opt in.
    """

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
    ) -> None:
        if on_duplicate not in _POLICIES:
            raise SpillValueError(f"on_duplicate must be one of {_POLICIES}, got {on_duplicate!r}")
        if not isinstance(chunk_bytes, int) or not 4096 <= chunk_bytes <= (1 << 32):
            raise SpillValueError(f"chunk_bytes must be an int in [4096, 2**32], got {chunk_bytes!r}")
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.storage = Storage(root, storage_options)
        self.root = self.storage.url
        self.chunk_bytes = chunk_bytes
        self.flush_threads = flush_threads or (1 if self.storage.local else 4)
        if not isinstance(self.flush_threads, int) or self.flush_threads < 1:
            raise SpillValueError(f"flush_threads must be a positive int, got {flush_threads!r}")
        staging = staging_bytes if staging_bytes is not None else 4 * chunk_bytes
        self.n_buffers = max(2, -(-staging // chunk_bytes))
        self.on_duplicate: DuplicatePolicy = on_duplicate
        self.fsync = fsync
        self.allow_pickle = bool(allow_pickle)
        self._run_id_arg = run_id
        self.run_id: str | None = None
        self.segment: str | None = None
        self._state = WriterState.NEW
        self._buffers = BufferPool(chunk_bytes, self.n_buffers)
        self._cuda_stream: Any = None
        self._shards_here = False  # set by a completed collective merge (see merge())

    # ------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SpillWriter:
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
        if self._state is not WriterState.NEW:
            raise WriterClosedError("a SpillWriter can be opened only once; create a new one")
        self.run_id = resolve_run_id(self._run_id_arg)
        self._session_number = next_session(self.run_id)
        self.segment = F.new_segment_name(self.storage.listdir(F.rank_dirname(self.rank)))
        self._prefix = f"{F.rank_dirname(self.rank)}/{self.segment}"
        self._filenames: list[str] = []
        self._file_ids: dict[str, int] = {}
        self._layouts: list[F.Layout] = []
        self._layout_ids: dict[F.Layout, int] = {}
        # Per-file layout rule (format 2): what each file's leaves have been so far, as an id into
        # _schemas, interned because millions of one-frame files share a handful of schemas; a
        # frame's move from one schema to the next is cached in _transitions by the frame's leaf
        # signatures, which ignore shapes, so ragged frames hit the cache too.
        self._file_schema: list[int] = []  # file_id -> schema id
        self._schemas: list[dict[tuple[str, ...], _Sig]] = [{}]
        self._schema_ids: dict[frozenset[tuple[tuple[str, ...], _Sig]], int] = {frozenset(): 0}
        self._transitions: dict[tuple[int, tuple[int, ...]], int] = {}
        # layout -> (catalog id, or -1 until a frame using it is accepted; signature id)
        self._known: dict[F.Layout, tuple[int, int]] = {}
        self._sigs: list[tuple[tuple[str, ...], _Sig]] = []
        self._sig_ids: dict[tuple[tuple[str, ...], _Sig], int] = {}
        self._keys: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (first row, n rows)
        self._dead_rows: list[tuple[int, int]] = []
        self._identical_rewrites = 0
        self._rows = np.zeros((1024, F.INDEX_COLUMNS), dtype=np.int64)
        self._n_rows = 0
        self._offset = 0
        self._n_chunks = 0
        self._current: Chunk | None = None
        self._journaled_files = 0
        self._journaled_layouts = 0
        self._committed_keys: dict[str, set[int]] | None = None
        header = F.SegmentHeader(
            rank=self.rank,
            world_size=self.world_size,
            segment=self.segment,
            run_id=self.run_id,
            chunk_bytes=self.chunk_bytes,
            started=F.utcnow(),
        )
        self.storage.makedirs(self._rel(f"{F.DATA_NAME}/c"))
        self.storage.makedirs(self._rel(F.JOURNAL_NAME))
        self.storage.put_atomic(self._rel("zarr.json"), header.to_json())
        self._flusher = Flusher(
            self._buffers, self.storage, self._prefix, rank=self.rank, flush_threads=self.flush_threads,
            object_size=self._chunk_object_size,
        )  # fmt: skip
        self._flusher.start()
        self._state = WriterState.OPEN

    @property
    def state(self) -> str:
        """The lifecycle state (:class:`WriterState`), as its string: ``"new"``, ``"open"``,
        ``"closing"``, ``"aborting"``, ``"committed"`` or ``"failed"``."""
        return str(self._state.value)

    def _rel(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    @property
    def segment_path(self) -> str:
        """Where this writer's segment lives (URL or path)."""
        return self.storage.describe(self._prefix) if self.segment else ""

    # ---------------------------------------------------------------------------------- write
    def write(self, filename: str, frame_idx: int, value: Any) -> None:
        """Append one frame. Copies the value into a staging buffer and returns; blocks only while
        every staging buffer waits for storage."""
        self._check_open()
        filename = check_filename(filename)
        frame = check_frame_idx(frame_idx, filename)
        leaves = flatten(value, filename, frame, self.allow_pickle)
        file_id = self._file_ids.get(filename)
        if file_id is None:
            file_id = len(self._filenames)
            schema = 0
        else:
            schema = self._file_schema[file_id]
        layouts = [F.Layout(leaf.path, leaf.dtype, leaf.shape) for leaf in leaves]
        known = self._known  # one lookup per leaf: write() runs once per frame
        infos = [known.get(lay) or self._new_layout(lay) for lay in layouts]  # new: a new leaf or ragged shape
        sigs = tuple([info[1] for info in infos])
        new_schema = self._transitions.get((schema, sigs))
        if new_schema is None:  # raises before anything of this frame is staged or cataloged
            new_schema = self._next_schema(filename, frame, schema, sigs, layouts)
        layout_ids = tuple([info[0] for info in infos])  # -1: not in the catalog yet
        key = (file_id, frame)
        prev = self._keys.get(key)
        if prev is not None:
            if self.on_duplicate == "first":
                return
            if self.on_duplicate == "error":
                if self._same_as_written(prev, leaves, layout_ids):  # identical content is never an error
                    self._identical_rewrites += 1
                    return
                raise DuplicateFrameError(
                    f"frame {frame} of {filename!r:.200} was already written by rank {self.rank} "
                    "(pass on_duplicate='first' or 'last' to allow rewrites)",
                    filename=filename,
                    frame_idx=frame,
                    ranks=[self.rank],
                )
            self._dead_rows.append(prev)
        if -1 in layout_ids:  # the frame is accepted: its new layouts join the catalog
            layout_ids = tuple([self._layout_id(lay) for lay in layouts])
        if file_id == len(self._filenames):
            self._filenames.append(filename)
            self._file_ids[filename] = file_id
            self._file_schema.append(new_schema)
        else:
            self._file_schema[file_id] = new_schema
        first_row = self._n_rows
        if len(leaves) == 1:
            self._append(file_id, frame, layout_ids[0], leaves[0])
        else:
            held: list[tuple[int, int, int, int, int, int]] = []  # journaled with the frame's last leaf
            for leaf, lid in zip(leaves[:-1], layout_ids[:-1], strict=True):
                self._append(file_id, frame, lid, leaf, held, last=False)
            self._append(file_id, frame, layout_ids[-1], leaves[-1], held)
        self._keys[key] = (first_row, len(leaves))

    def update(self, mapping: Mapping[str, Any]) -> None:
        """Write many frames: ``{filename: (frame_idx, value)}`` or ``{filename: {frame_idx: value}}``."""
        if not isinstance(mapping, Mapping):
            raise SpillValueError(f"update() takes a mapping, got {type(mapping).__name__}")
        for filename, item in mapping.items():
            if isinstance(item, tuple) and len(item) == 2:
                self.write(filename, item[0], item[1])
            elif isinstance(item, Mapping):
                for frame_idx, value in item.items():
                    self.write(filename, frame_idx, value)
            else:
                raise SpillValueError(
                    f"update(): the value for {filename!r:.200} must be a (frame_idx, value) tuple or a "
                    f"{{frame_idx: value}} dict, got {type(item).__name__}",
                    filename=filename if isinstance(filename, str) else None,
                )

    def _same_as_written(self, prev: tuple[int, int], leaves: list[Leaf], layout_ids: tuple[int, ...]) -> bool:
        """Do ``leaves`` hold the same bytes as the frame already written at rows ``prev``?

        Only a rewrite of a key gets here (rare), so this may wait for the flush thread and read
        back from storage; writes of new keys never checksum or compare anything. The earlier
        bytes are read where they are: in the current staging chunk, else (once the flush thread
        has uploaded their chunk) from storage, ``_COMPARE_WINDOW`` bytes at a time. CUDA leaves
        are copied to the host, synchronously, window by window."""
        first, n = prev
        if n != len(leaves):
            return False
        reader: Storage | None = None
        try:
            for i, leaf in enumerate(leaves):
                lid, off, nbytes = (int(v) for v in self._rows[first + i, [F.COL_LAYOUT, F.COL_OFFSET, F.COL_NBYTES]])
                if nbytes != leaf.nbytes or lid != layout_ids[i]:  # same bytes, other shape/kind: different
                    return False
                pos = 0
                while pos < nbytes:
                    c, lo = divmod(off + pos, self.chunk_bytes)
                    m = min(nbytes - pos, self.chunk_bytes - lo, _COMPARE_WINDOW)
                    new = leaf.data[pos : pos + m]
                    if isinstance(new, torch.Tensor):
                        new = new.cpu().numpy()
                    cur = self._current
                    if cur is not None and cur.number == c:
                        if cur.event is not None:  # its device-to-host copies may still run
                            cur.event.synchronize()
                        old = cur.host.numpy()[lo : lo + m]
                    else:
                        self._wait_durable(c)
                        if reader is None:  # its own handle cache, closed below
                            reader = Storage(self.storage.url, self.storage.storage_options)
                        old = np.empty(m, dtype=np.uint8)
                        reader.read_into([(self._rel(f"{F.DATA_NAME}/c/{c}"), lo, lo + m)], old.data)
                    if not np.array_equal(old, new):
                        return False
                    pos += m
        finally:
            if reader is not None:
                reader.close()
        return True

    def _wait_durable(self, chunk: int) -> None:
        """Block until data chunk ``chunk`` is on storage (the flush thread uploads in the
        background); raise the flush thread's error if it failed instead."""
        fl = self._flusher
        with fl.durable_cond:
            while fl.durable <= chunk and fl.error is None and fl.is_alive():
                fl.durable_cond.wait(0.5)
        self._raise_flush_error()
        if fl.durable <= chunk:  # pragma: no cover - the flush thread ended without an error
            raise SpillStorageError(
                f"data chunk {chunk} of {self.segment_path} was never written", path=self.segment_path
            )

    def _layout_id(self, lay: F.Layout) -> int:
        """The catalog id of a layout, added to the catalog on first use (only for frames that
        passed the layout rule: a refused frame leaves no layout a merge would trip on)."""
        lid = self._layout_ids.get(lay)
        if lid is None:
            lid = len(self._layouts)
            self._layouts.append(lay)
            self._layout_ids[lay] = lid
            self._known[lay] = (lid, self._known[lay][1])
        return lid

    def _new_layout(self, lay: F.Layout) -> tuple[int, int]:
        info = self._known[lay] = (-1, self._sig_id(lay))
        return info

    def _sig_id(self, lay: F.Layout) -> int:
        """The signature of a layout: what must stay the same for its leaf within one file (kind,
        numeric dtype, ndim), not its shape. A ``none`` row and a numeric row of zero elements
        say nothing about the dtype (``[]`` is float64 whatever the other rows hold)."""
        kind = lay.kind
        if kind == "none":
            sig: _Sig = ("none", None, None)
        elif kind == "num":
            sig = ("num", None if 0 in lay.shape else lay.dtype, len(lay.shape))
        else:
            sig = (kind, None, None)
        full = (lay.leaf, sig)
        sid = self._sig_ids.get(full)
        if sid is None:
            sid = self._sig_ids[full] = len(self._sigs)
            self._sigs.append(full)
        return sid

    def _next_schema(
        self, filename: str, frame: int, schema: int, sigs: tuple[int, ...], layouts: list[F.Layout]
    ) -> int:
        """The file's schema after this frame, or LayoutMismatchError: within one file on one
        rank a leaf keeps its kind, numeric dtype and ndim (its shape may change, it may be None
        or absent in some frames), and no leaf path is both a value and a dict holding values.
        The same rules hold across ranks and files at merge time; checking here names the frame
        while the user's code that produced it is still on the stack."""
        state = dict(self._schemas[schema])
        for sid, lay in zip(sigs, layouts, strict=True):
            path, sig = self._sigs[sid]
            cur = state.get(path)
            if cur is None:
                for other in state:
                    n = min(len(other), len(path))
                    if other[:n] == path[:n]:  # one is a prefix of the other: value vs dict
                        self._raise_parent(filename, frame, path, other)
                state[path] = sig
            elif sig[0] == "none" or (sig == _EMPTY_LIST and cur[0] == "strlist"):
                continue  # None says nothing; [] is also an empty list of strings
            elif cur[0] == "none" or (cur == _EMPTY_LIST and sig[0] == "strlist"):
                state[path] = sig
            elif sig[0] != cur[0] or sig[2] != cur[2] or (sig[1] and cur[1] and sig[1] != cur[1]):
                name = "/".join(path) or "<tensor>"
                raise LayoutMismatchError(
                    f"{filename!r:.200} frame {frame} (rank {self.rank}): leaf {name!r} is {_describe(lay)} but "
                    f"earlier frames of this file had {_describe_sig(cur)} (a leaf keeps its kind, dtype and "
                    "number of dimensions across the frames of a file; its shape may change)",
                    filename=filename,
                    leaf=name,
                    ranks=[self.rank],
                )
            elif cur[1] is None and sig[1] is not None:
                state[path] = sig
        key = frozenset(state.items())
        new = self._schema_ids.get(key)
        if new is None:
            new = self._schema_ids[key] = len(self._schemas)
            self._schemas.append(state)
        self._transitions[(schema, sigs)] = new
        return new

    def _raise_parent(self, filename: str, frame: int, path: tuple[str, ...], other: tuple[str, ...]) -> None:
        short, long = (path, other) if len(path) < len(other) else (other, path)
        here = "a value" if short == path else f"a dict holding {'/'.join(long)!r}"
        before = f"a dict holding {'/'.join(long)!r}" if short == path else "a value"
        name = "/".join(short) or "<tensor>"
        raise LayoutMismatchError(
            f"{filename!r:.200} frame {frame} (rank {self.rank}): leaf {name!r} is {here} but {before} in earlier "
            "frames of this file (a leaf path cannot be both; write None for an absent value)",
            filename=filename,
            leaf=name,
            ranks=[self.rank],
        )

    def _append(
        self, file_id: int, frame: int, layout_id: int, leaf: Leaf, held: list[Any] | None = None, last: bool = True
    ) -> None:
        """Copy one leaf into staging. The rows of a frame's earlier leaves wait in ``held``
        (``last=False``); with its ``last`` leaf they all go to the chunk holding the frame's last
        byte, so the journal entry of that chunk lists the whole frame and a frame whose large
        leaf never became durable is never salvaged by halves."""
        row = self._n_rows
        if row == len(self._rows):
            self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
        self._rows[row, : F.COL_CRC] = (file_id, frame, layout_id, self._offset, leaf.nbytes)
        self._n_rows += 1
        done = 0
        data = leaf.data
        is_cuda = isinstance(data, torch.Tensor) and data.device.type == "cuda"
        if is_cuda:
            self._prepare_cuda(data)
        while done < leaf.nbytes:
            chunk = self._current_chunk()
            n = min(leaf.nbytes - done, self.chunk_bytes - chunk.fill)
            if is_cuda:
                dst = chunk.host[chunk.fill : chunk.fill + n]
                with torch.cuda.stream(self._cuda_stream):
                    dst.copy_(data[done : done + n], non_blocking=True)
                    if chunk.event is None:
                        chunk.event = torch.cuda.Event()
                    chunk.event.record(self._cuda_stream)
                # Work the caller queues next (e.g. overwriting this tensor in place) runs after our
                # copy, without blocking the host: write() keeps its copy semantics on CUDA.
                torch.cuda.current_stream(data.device).wait_stream(self._cuda_stream)
            else:
                if chunk.host_np is None:
                    chunk.host_np = chunk.host.numpy()
                chunk.host_np[chunk.fill : chunk.fill + n] = data[done : done + n]
            chunk.pieces.append((row, chunk.fill, chunk.fill + n))
            chunk.fill += n
            done += n
            self._offset += n
            if done == leaf.nbytes:
                entry = (row, file_id, frame, layout_id, self._offset - leaf.nbytes, leaf.nbytes)
                if not last:
                    held.append(entry)  # type: ignore[union-attr]
                else:
                    if held:
                        chunk.completed.extend(held)
                    chunk.completed.append(entry)
            if chunk.fill == self.chunk_bytes:
                self._hand_off()
        if leaf.nbytes == 0:
            entry = (row, file_id, frame, layout_id, self._offset, 0)
            if not last:
                held.append(entry)  # type: ignore[union-attr]
            else:
                completed = self._current_chunk().completed
                if held:
                    completed.extend(held)
                completed.append(entry)

    def _prepare_cuda(self, data: torch.Tensor) -> None:
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream(device=data.device)
            self._buffers.pin()
        # Copies run on our own stream after the producer's work; the allocator must not
        # reuse the tensor's memory before our copy has read it.
        self._cuda_stream.wait_stream(torch.cuda.current_stream(data.device))
        data.record_stream(self._cuda_stream)

    def _current_chunk(self) -> Chunk:
        if self._current is None:
            self._current = Chunk(self._n_chunks, self._buffers.acquire(self._raise_flush_error))
            self._n_chunks += 1
        return self._current

    def _hand_off(self) -> None:
        chunk, self._current = self._current, None
        if chunk is not None:
            chunk.file_base, chunk.new_files = self._journaled_files, self._filenames[self._journaled_files :]
            chunk.layout_base, chunk.new_layouts = self._journaled_layouts, self._layouts[self._journaled_layouts :]
            self._journaled_files, self._journaled_layouts = len(self._filenames), len(self._layouts)
            self._flusher.q.put(chunk)

    # ------------------------------------------------------------------------- buffer pool
    def _free_buffers(self) -> None:
        # The staging memory is only needed while writing; a merge on this rank follows.
        self._buffers.clear()
        self._rows = np.zeros((0, F.INDEX_COLUMNS), dtype=np.int64)

    def _raise_flush_error(self) -> None:
        err = self._flusher.error
        if err is not None:
            if isinstance(err, SpillMergeError):
                raise err
            raise SpillStorageError(
                f"spilling to {self.segment_path} failed in the background: {type(err).__name__}: {err}",
                path=self.segment_path,
            ) from err

    def _check_open(self) -> None:
        if self._state is not WriterState.OPEN:
            raise WriterClosedError(
                f"SpillWriter for rank {self.rank} is {self._state}; write inside `with SpillWriter(...)`"
            )
        self._raise_flush_error()

    def _chunk_object_size(self, chunk: Chunk) -> int:
        # A spill smaller than one chunk is stored as one exactly-sized chunk; otherwise the last
        # chunk is padded to the chunk size, as zarr's regular chunk grid requires.
        if self._state in (WriterState.CLOSING, WriterState.ABORTING) and chunk.number == 0 and self._n_chunks == 1:
            return max(chunk.fill, 1)
        return self.chunk_bytes

    # --------------------------------------------------------------------------------- commit
    def _drain(self) -> None:
        self._hand_off()
        self._flusher.q.put(None)
        self._flusher.join()
        self._raise_flush_error()

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
        if n_chunks is None:
            if not self.storage.exists(self._rel("zarr.json")):
                raise self._vanished("its header zarr.json is gone")
            return
        found = dict(self.storage.find(self._prefix))
        if self._rel("zarr.json") not in found:
            raise self._vanished("its header zarr.json is gone")
        for c in range(n_chunks):
            got = found.get(self._rel(f"{F.DATA_NAME}/c/{c}"))
            if got != size:
                state = "is gone" if got is None else f"has {got} bytes, not {size}"
                raise self._vanished(f"data chunk {c} {state}")

    def _write_index(self) -> tuple[F.CommitRecord, np.ndarray]:
        self._check_segment()
        rows = self._rows[: self._n_rows].copy()
        for row, crc in self._flusher.crc.items():
            rows[row, F.COL_CRC] = crc
        if self._dead_rows:
            keep = np.ones(len(rows), dtype=bool)
            for first, n in self._dead_rows:
                keep[first : first + n] = False
            rows = rows[keep]
        rows = np.ascontiguousarray(rows)
        single = self._n_chunks == 1 and self._offset <= self.chunk_bytes
        chunk = max(self._offset, 1) if single else self.chunk_bytes
        data_meta = array_meta((self._offset,), (chunk,), "uint8", crc=False)
        index_bytes = rows.astype("<i8").tobytes()
        catalog = F.dumps({"filenames": self._filenames, "layouts": [lay.to_obj() for lay in self._layouts]})
        # Five small objects, written concurrently on object stores (one round trip, not five).
        objects = {self._rel(f"{F.DATA_NAME}/zarr.json"): F.dumps(data_meta)}
        objects.update(array_objects(self._rel(F.INDEX_NAME), index_bytes, (len(rows), F.INDEX_COLUMNS), "int64"))
        objects.update(array_objects(self._rel(F.CATALOG_NAME), catalog, (len(catalog),), "uint8"))
        self.storage.put_many(objects)
        if self.fsync:  # everything the commit record vouches for is durable before it exists
            self.storage.fsync_tree(self._prefix)
        record = F.CommitRecord(
            rank=self.rank,
            world_size=self.world_size,
            segment=str(self.segment),
            run_id=self.run_id,
            n_rows=len(rows),
            n_frames=len(self._keys),
            n_files=len(self._filenames),
            nbytes=self._offset,
            n_chunks=self._n_chunks,
            chunk_bytes=chunk,
            index_crc32c=google_crc32c.value(index_bytes),
            catalog_crc32c=google_crc32c.value(catalog),
            finished=F.utcnow(),
        )
        return record, rows

    def close(self) -> None:
        """Flush everything and write the commit record. Idempotent."""
        if self._state is WriterState.COMMITTED:
            return
        if self._state is not WriterState.OPEN:
            raise WriterClosedError(f"SpillWriter for rank {self.rank} is {self._state}; cannot commit")
        self._state = WriterState.CLOSING
        try:
            self._drain()
            record, _ = self._write_index()
            # Last look before the commit record vouches for the chunks: are they all still there?
            self._check_segment(record.n_chunks, record.chunk_bytes)
            self.storage.put_atomic(self._rel(F.COMMIT_NAME), record.to_json())
        except BaseException as exc:
            self._state = WriterState.OPEN
            self.abort(exc)
            raise
        self.commit_record = record
        self._state = WriterState.COMMITTED
        self._free_buffers()

    def abort(self, exc: BaseException) -> None:
        """Record a failure (best effort) after flushing what was staged, so the data written so far
        stays readable; the commit record is never written."""
        if self._state not in (WriterState.OPEN, WriterState.CLOSING):
            return
        self._state = WriterState.ABORTING
        try:
            if self._flusher.is_alive():
                self._hand_off()
                self._flusher.q.put(None)
                self._flusher.join()
            if self._flusher.error is None:
                self._write_index()
        except BaseException:  # noqa: BLE001 - the original exception matters more
            pass
        error_type, message, tb = F.exception_fields(exc)
        record = F.FailureRecord(
            rank=self.rank,
            world_size=self.world_size,
            segment=str(self.segment),
            run_id=self.run_id,
            error_type=error_type,
            message=message,
            traceback=tb,
            time=F.utcnow(),
        )
        try:
            self.storage.put_atomic(self._rel(F.FAILURE_NAME), record.to_json())
        except BaseException:  # noqa: BLE001 - storage may be what failed
            pass
        publish_failure(self.run_id, self.rank, f"{record.error_type}: {record.message}", session=self._session_number)
        self._state = WriterState.FAILED
        self._free_buffers()

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

    def remove_spill(self, *, everything: bool = False) -> None:
        """Delete this rank's spill data once it is merged: its rank folder (every session of this
        rank), or with ``everything`` every rank folder and the merge failure record (the merging
        rank of :func:`spillmerge.gather`, whose root holds every shard after a node-local
        transfer); then the root itself if nothing else is in it. Only after the writer commits."""
        if self._state is not WriterState.COMMITTED:
            raise WriterClosedError(
                f"SpillWriter for rank {self.rank} is {self._state}; only a committed spill is removed"
            )
        names = self.storage.listdir("")
        doomed = (
            [n for n in names if F.parse_rank_dirname(n) is not None] if everything else [F.rank_dirname(self.rank)]
        )
        if everything:
            doomed.append(F.MERGE_FAILED_NAME)
        for name in doomed:
            self.storage.rm_tree(name)
        self.storage.remove_empty_dir("")

    # ---------------------------------------------------------------------------------- merge
    def merge(
        self,
        out: str,
        dst: int = 0,
        *,
        wait: bool = False,
        parallel: bool = False,
        transport: str = "auto",
        transfer_chunk_bytes: int = DEFAULT_TRANSFER_CHUNK_BYTES,
        transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        **kwargs: Any,
    ) -> MergeReport | None:
        """Collective: every rank calls it after the ``with`` block. Rank ``dst`` merges and
        returns a :class:`~spillmerge.MergeReport`; other ranks return ``None``. ``kwargs`` go to
        :func:`spillmerge.merge` (``timeout`` defaults to 1800 s here).

        ``wait=True``: every rank returns only once the output is complete, so every rank can
        ``spillmerge.open(out)`` right after (the output must be on storage every rank sees). If
        the merge fails on ``dst``, every waiting rank raises :class:`~spillmerge.MergeFailedError`
        naming ``dst`` and its error within seconds; none waits past ``timeout``
        (:class:`~spillmerge.MergeTimeout`). Without ``wait`` the other ranks return once their
        shards are where ``dst`` can read them.

        ``transport`` says how ``dst`` gets the other ranks' shards:

        - ``"auto"`` (default): from storage when ``dst`` can see every rank's commit record;
          when some ranks spilled to node-local disks ``dst`` cannot see, their committed shards
          are moved to ``dst`` over torch.distributed first (NCCL when the default group has it,
          else gloo), one sender per group of ranks sharing a disk, in pieces of
          ``transfer_chunk_bytes`` through one reused staging buffer, each send and receive
          bounded by ``transfer_timeout`` seconds.
        - ``"storage"``: never move bytes over the network; ``dst`` waits on storage only (the
          only mode without torch.distributed, e.g. SLURM arrays).
        - ``"nccl"`` / ``"gloo"``: like ``"auto"`` with that backend for the shards ``dst``
          cannot see.

        Coordination uses the process group's key-value store (CPU, TCP), never a GPU
        collective; a rank whose writer failed or never arrives ends the merge on every rank with
        an error naming it.

        ``parallel=True`` spreads the merge over every rank: each writes the arrays of its share
        of the files (split by bytes, the same on every rank), records its part under the output,
        and returns ``None``; ``dst`` then waits on storage (up to ``timeout``) for every part and
        writes the index, consolidated metadata and completion marker. A rank whose part fails
        raises there, and ``dst`` raises :class:`~spillmerge.PartFailedError` naming it. Every rank
        must see the spill root and the output (shared storage; no network transport).
        """
        if self._state is WriterState.OPEN:
            raise WriterClosedError("call merge() after leaving the `with SpillWriter(...)` block")
        if not 0 <= dst < self.world_size:
            raise SpillValueError(f"dst={dst} is not a rank of world_size {self.world_size}")
        check_options(transport, transfer_chunk_bytes, transfer_timeout)
        kwargs.setdefault("timeout", 1800.0)
        kwargs.setdefault("storage_options", self.storage.storage_options)
        kwargs.setdefault("session", self._session_number)  # names this round in the completion marker
        network = transport in ("nccl", "gloo")
        if parallel:  # every rank writes a part; dst finalizes
            if network:
                raise ConfigError(
                    "parallel=True needs every rank to see the spill root; it cannot be combined with "
                    f"transport={transport!r}",
                    key="transport",
                )
            return self._merge_on_dst(
                out,
                dst,
                wait,
                kwargs,
                lambda: merge_parallel(
                    self.root, out, rank=self.rank, world_size=self.world_size, dst=dst, run_id=self.run_id, **kwargs
                ),
                every_rank_runs=True,
            )
        info: TransferInfo | None = None
        if transport != "storage" and self._coordinated() and not self._shards_here:
            # The first merge of a job gathers every shard where dst can read it; a later merge
            # of the same writer (another output or duplicate policy) needs no coordination.
            info = transfer_shards(
                self.session(), dst, transport, transfer_chunk_bytes, transfer_timeout, float(kwargs["timeout"])
            )
            self._shards_here = True
        elif network:
            raise ConfigError(
                f"transport={transport!r} needs torch.distributed initialised with this writer's rank "
                f"{self.rank} and world_size {self.world_size}",
                key="transport",
            )

        def run() -> MergeReport | None:
            report = merge(self.root, out, world_size=self.world_size, run_id=self.run_id, **kwargs)
            return report if info is None else info.add_to(report)

        return self._merge_on_dst(out, dst, wait, kwargs, run)

    def _merge_on_dst(
        self,
        out: str,
        dst: int,
        wait: bool,
        kwargs: dict[str, Any],
        run: Callable[[], MergeReport | None],
        *,
        every_rank_runs: bool = False,
    ) -> MergeReport | None:
        """``dst`` runs ``run()`` and tells waiting ranks how it ended (store and spill root);
        the others (after ``run()`` too when ``every_rank_runs``: a parallel merge's parts) wait
        for the output when ``wait``, else return None."""
        if self.rank != dst:
            if every_rank_runs:
                run()
            if wait:
                output = Storage(out, kwargs.get("out_storage_options", kwargs.get("storage_options")))
                _output.wait_complete(
                    output,
                    self.storage,
                    run_id=self.run_id,
                    session=self._session_number,
                    dst=dst,
                    timeout=float(kwargs["timeout"]),
                    outcome=OutcomeWatch(self.run_id, self._session_number).poll,
                )
            return None
        try:
            report = run()
        except BaseException as exc:
            n = self._session_number
            if wait:  # the other ranks (called with the same wait=True) are waiting: tell them on storage too
                _output.record_failure(self.storage, exc, rank=self.rank, run_id=self.run_id, session=n)
            publish_merge_outcome(self.run_id, n, {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"})
            raise
        publish_merge_outcome(self.run_id, self._session_number, {"ok": True})
        return report

    def session(self) -> Session:
        """This writer's session as the shard transfer sees it (rank, root, segment, state)."""
        if self.segment is None or self.run_id is None:
            raise WriterClosedError(f"SpillWriter for rank {self.rank} was never opened; there is nothing to merge")
        return Session(
            self.rank, self.world_size, self.run_id, self.storage, self._prefix, self.state, self._session_number
        )

    def _coordinated(self) -> bool:
        """True when torch.distributed is initialised with this writer's rank and world size."""
        if self.world_size < 2 or not dist_initialized() or self.run_id is None:
            return False
        import torch.distributed as dist

        return bool(dist.get_rank() == self.rank and dist.get_world_size() == self.world_size)

    def stats(self) -> dict[str, int]:
        """Counters of this writer: frames, rows, bytes, chunks, staging buffers allocated, and
        ``identical_rewrites``: writes of a key already written with the same bytes (kept once,
        under ``on_duplicate="error"``)."""
        return {
            "frames": len(getattr(self, "_keys", {})),
            "rows": getattr(self, "_n_rows", 0),
            "bytes": getattr(self, "_offset", 0),
            "chunks": getattr(self, "_n_chunks", 0),
            "staging_buffers": self._buffers.allocated,
            "identical_rewrites": getattr(self, "_identical_rewrites", 0),
        }
