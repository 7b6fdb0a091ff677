"""The flush side of staging: the staging buffers (:class:`BufferPool`), a buffer on its way to
storage (:class:`Chunk`), and the :class:`Flusher` thread with its upload workers and its in-order
journal thread.

Protocol (``_write.staging.Staging`` hands full chunks to the flusher's queue):
  (flush thread)     wait for the chunk's CUDA copies → CRC-32C of the rows ``_add_by_leaf`` staged
                     one by one → a flush worker writes it whole and gives its buffer back
                     (``BufferPool.release``; ``flush_threads`` in flight, finishing in any
                     order) → once chunks ``0..N`` are written, the journal thread makes them
                     durable (one group commit: the chunks written since its last one and their
                     folder, fsynced together) and writes ``journal/N`` (entries in chunk
                     order); ``None`` on the queue ends it. A direct chunk
                     (``_write.staging``: the caller wrote its file) skips the worker: it is
                     written already, only made durable and journaled in order.
"""

from __future__ import annotations

import array
import collections
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._format import crc as _crc
from .._format import spill as FS
from .._storage import Storage
from .._util.gcpause import gc_paused
from .._util.progress import PROGRESS_INTERVAL, ProgressWriter


@dataclass(slots=True)
class Chunk:
    """A staging buffer on its way to storage."""

    number: int
    """Chunk number in ``data``."""
    host: torch.Tensor
    """uint8 host buffer of ``chunk_bytes`` (pinned when CUDA tensors were written)."""
    host_np: Any = None
    """``host.numpy()`` (None for a direct chunk): host-side copies slice it (cheaper per call
    than torch)."""
    fill: int = 0
    """Bytes used."""
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    """(row, start, stop) byte ranges of index rows inside this chunk, for the checksums (rows
    staged by ``Staging._add_by_leaf``; a row may continue in the next chunk)."""
    blocks: list[tuple[int, int, int, np.ndarray, int]] = field(default_factory=list)
    """(check id, start, stop, rows, CRC-32C) of every block checksum of this chunk: bytes
    ``start:stop`` hold the rows ``rows`` (int64) back to back (one leaf of a block of
    ``add_frames``, or a run of whole frames of ``add_frame``), checksummed in one call
    (docs/FORMAT.md, ``checks``) by the caller's thread right after its copy (``_block``)."""
    check_base: int = 0
    """Id of this chunk's first block checksum (the number of blocks of earlier chunks)."""
    run: array.array[int] = field(default_factory=lambda: array.array("q"))
    """Rows of the open block of ``write``'s frames (``Staging.add_frame``): consecutive whole
    frames from ``run_start`` to ``fill``, closed into ``blocks`` at CHECK_BYTES, before any other
    copy into this chunk, and at hand-off."""
    run_start: int = 0
    """Where the open block starts in this chunk."""
    streams: dict[int, int] = field(default_factory=dict)
    """The CUDA streams that copied into this buffer (raw handle -> device index): small leaves
    are copied on the caller's stream, large ones on the writer's own (``Staging._add_by_leaf``)."""
    events: list[Any] = field(default_factory=list)
    """CUDA events recorded on each of ``streams`` after their copies (``Staging.seal``), when the
    chunk leaves the writer's hands: whoever reads ``host`` waits for them first."""
    completed: list[np.ndarray] = field(default_factory=list)
    """(row, file_id, frame, layout_id, offset, nbytes) of every row of the frames whose last byte
    is in this chunk, in order, as int64 ``(n, 6)`` arrays: a block of ``Staging.add_frames``, or
    the rows ``tail`` collected before it. A journal entry lists whole frames only."""
    tail: array.array[int] = field(default_factory=lambda: array.array("q"))
    """The rows completed one by one (``Staging._add_by_leaf``, ``add_frame``) since the last block
    of ``completed``, six int64 each, not a tuple per row (a chunk of tiny rows holds up to a million
    of them)."""
    file_base: int = 0
    """Catalog id of ``new_files[0]``."""
    new_files: list[str] = field(default_factory=list)
    """Filenames registered since the previous chunk was handed off."""
    released: bool = False
    """The buffer went back to the pool (once its bytes were written, before their fsync)."""
    layout_base: int = 0
    """Catalog id of ``new_layouts[0]``."""
    new_layouts: list[FS.Layout] = field(default_factory=list)
    """Layouts registered since the previous chunk was handed off."""
    direct: bool = False
    """Written by the caller straight into its chunk file (``_write.staging``), no staging buffer:
    handed off whole, closed, padded; the flush thread only makes it durable and journals it."""
    fd: int = -1
    """The open chunk file of a direct chunk, until its hand-off."""
    row_crcs: list[tuple[int, int]] = field(default_factory=list)
    """(row, CRC-32C of its bytes so far) of the rows a direct chunk took one by one
    (``Staging._add_by_leaf``), computed by the caller from its memory; the last one counts."""
    run_crc: int = 0
    """CRC-32C of the open block of whole frames of a direct chunk (``run_start`` to ``fill``)."""

    def complete_block(self, block: np.ndarray) -> None:
        """Append a block of completed rows after the rows completed one by one so far."""
        if self.tail:
            self.completed.append(np.frombuffer(self.tail, dtype=np.int64).reshape(-1, 6))
            self.tail = array.array("q")
        self.completed.append(block)


_WAKE = object()
_SPARE = object()


class BufferPool:
    """At most ``n_buffers`` host buffers of ``chunk_bytes``, reused: ``acquire`` blocks while all
    of them wait for storage (backpressure), the flush thread ``release``s each after its upload
    and allocates the next one ahead (``prefault_spare``) so ``write()`` never pays for fresh
    pages. Buffers are pinned once ``pinned`` is set (the first CUDA write)."""

    def __init__(self, chunk_bytes: int, n_buffers: int) -> None:
        self.chunk_bytes, self.n_buffers = chunk_bytes, n_buffers
        self.allocated = 0
        """Buffers allocated so far (at most ``n_buffers``)."""
        self.pinned = False
        """True once CUDA tensors were written (``Staging._prepare_cuda``): new buffers are pinned."""
        self._lock = threading.Condition()
        self._free: list[torch.Tensor] = []
        self.retired = False
        """Set by :meth:`retire`."""
        self.wants_spare: Callable[[], None] | None = None
        """Called when ``acquire`` took the last free buffer and more may be allocated: the flush
        thread then prefaults the next one while the caller fills this one."""

    def retire(self) -> None:
        """No buffer is needed any more (the writer writes its chunks directly, or takes no more
        writes): drop the free ones, prefault no spare, keep none given back."""
        with self._lock:
            self.retired = True
            self._free.clear()

    def acquire(self, check: Callable[[], None]) -> torch.Tensor:
        """A free buffer, waiting for one while all are in use; ``check()`` runs while waiting
        (it raises the flush thread's error instead of waiting forever)."""
        with self._lock:
            while True:
                check()
                if self._free:
                    buf = self._free.pop()
                    if self.pinned and not buf.is_pinned():
                        break  # allocated before the first CUDA write: replace it with pinned memory
                    if not self._free and self.allocated < self.n_buffers and self.wants_spare is not None:
                        self.wants_spare()
                    return buf
                if self.allocated < self.n_buffers:
                    self.allocated += 1
                    break
                self._lock.wait(timeout=0.5)  # backpressure: wait for the flush thread
        return self._new_buffer()

    def _new_buffer(self) -> torch.Tensor:
        if self.pinned:
            return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        # numpy's allocation, not torch's: numpy asks the kernel for transparent huge pages
        # (madvise) for buffers of 4 MiB or more, so a fresh buffer costs a page fault per 2 MiB,
        # not per 4 KiB (its first touch was ~a third of write_batch's time in short runs)
        return torch.from_numpy(np.empty(self.chunk_bytes, dtype=np.uint8))

    def prefault_spare(self) -> None:
        """Allocate one more buffer (within ``n_buffers``) and touch its pages, so the page faults
        of fresh memory are paid by the flush thread, not inside ``write()``."""
        with self._lock:
            if self.retired or self._free or self.allocated >= self.n_buffers:
                return
            self.allocated += 1
        buf = self._new_buffer()
        if not self.pinned:  # pinned memory is resident already
            # torch, not numpy: its fill releases the GIL, so the caller's write_batch runs on
            # while this thread takes a page fault per 4 KiB (milliseconds per buffer)
            buf[::4096].fill_(0)
        self.release(buf)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            if not self.retired:
                self._free.append(buf)
            self._lock.notify()


class _HereExecutor:
    """``submit`` runs the call at once in the calling thread and returns its finished Future
    (``Flusher.run_here``: the executors' interface, no thread)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the Future carries it, as a pool's does
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


def completed_rows(chunk: Chunk) -> np.ndarray:
    """The int64 ``(n, 6)`` rows (row, file, frame, layout, offset, nbytes) completed in ``chunk``,
    in order: its blocks (``completed``), then the rows completed one by one after them (``tail``).
    Joined once and kept as the chunk's one block: only the thread holding the chunk calls it (the
    writer's, until the hand-off; then the flush thread finds them joined)."""
    if chunk.tail or len(chunk.completed) != 1:
        chunk.complete_block(np.zeros((0, 6), dtype=np.int64))  # the tail joins the blocks
        chunk.completed = [np.concatenate(chunk.completed)]
    return chunk.completed[0]


def grown(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` when it has ``n`` rows, else a copy padded with zeros to at least twice its rows (a
    reader of ``a`` still sees every value set before it grew)."""
    if n <= len(a):
        return a
    out = np.zeros((max(n, 2 * len(a)), *a.shape[1:]), dtype=a.dtype)
    out[: len(a)] = a
    return out


class Flusher(threading.Thread):
    """Background thread: waits for a chunk's device copies, checksums its rows, uploads it whole
    (``flush_threads`` uploads at a time), and writes each chunk's journal entry once that chunk
    and every earlier one are durable."""

    def __init__(
        self, pool: BufferPool, storage: Storage, prefix: str, *, rank: int, flush_threads: int,
        object_size: Callable[[Chunk], int], fsync: bool = True,
    ) -> None:  # fmt: skip
        """Uploads go to ``storage`` under ``prefix`` (the segment); ``object_size(chunk)`` says
        how many bytes of a chunk's buffer its object holds (the writer decides: the last chunk
        of a small spill is stored exactly). ``fsync``: each chunk and its folder are fsynced
        before a journal entry names it (local disks), so a journal entry lists only bytes that
        survive a power loss."""
        super().__init__(name=f"spillmerge-flush-r{rank}", daemon=True)
        self.pool, self.storage, self.prefix, self.fsync = pool, storage, prefix, fsync
        self.flush_threads, self.object_size = flush_threads, object_size
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        """Chunks to write, then ``None``; a SimpleQueue, whose ``put`` a finalizer may call at any moment."""
        self.crc = np.zeros(1024, dtype=np.int64)
        """Index row -> CRC-32C of its bytes (rows without bytes: 0, the CRC of nothing), or
        ``-1 - id`` of the block checksum covering it. Only this thread writes it; it grows by
        copying, so a reader of the old array still sees every CRC computed before it grew."""
        self.checks = np.zeros((64, FS.CHECK_COLUMNS), dtype=np.int64)
        """Block checksum id -> (offset in ``data``, nbytes, CRC-32C); grows like ``crc``."""
        self.n_checks = 0
        """Block checksums computed so far (ids ``0 .. n_checks-1``, in chunk order)."""
        self.error: BaseException | None = None
        self.written = 0
        """Chunks ``0 .. written-1`` are on storage, readable, durable once journaled (uploads
        finish out of order; this counts in order)."""
        self.written_cond = threading.Condition()
        self._synced = 0
        """Chunks ``0 .. _synced-1`` are fsynced, their folder too (the journal thread's count)."""
        self.journaled = 0
        """Chunks ``0 .. journaled-1`` have their journal entry (a direct writer waits on it)."""
        self._unjournaled: collections.deque[Future[None]] = collections.deque()
        """Journal entries submitted, not yet written: at most ``flush_threads + n_buffers``
        chunks are written and not yet durable (the dirty pages a crash may lose)."""
        self._pending: collections.deque[tuple[Chunk, Future[None]]] = collections.deque()
        self._journals: list[Future[None]] = []
        self._pool = ThreadPoolExecutor(flush_threads, thread_name_prefix=f"spillmerge-put-r{rank}")
        # Journal entries land one after another, in chunk order: a reader replays them in order
        # and stops at a gap, so entry N written before N-1 would be lost to a kill between them.
        self._journal_pool = ThreadPoolExecutor(1, thread_name_prefix=f"spillmerge-journal-r{rank}")
        self.progress = ProgressWriter(storage, prefix, rank=rank)
        pool.wants_spare = lambda: self.q.put(_SPARE)
        self.inline = False
        """Run by :meth:`run_here` in the writer's thread, not as a thread of its own."""

    def run_here(self) -> None:
        """:meth:`run` in the calling thread, the uploads and journal entries too (one after
        another, in chunk order), once the queue holds every chunk and the final ``None``; no
        thread starts."""
        self.inline = True
        self.pool.retire()  # no spare buffer, none kept: no write follows
        self._pool = self._journal_pool = _HereExecutor()  # type: ignore[assignment]
        self.run()

    def run(self) -> None:
        try:
            self.pool.prefault_spare()  # the first chunk's buffer, while the caller is still computing
            while True:
                try:
                    chunk = self.q.get(timeout=PROGRESS_INTERVAL)
                except queue.Empty:  # idle: the progress record catches up with the last chunks
                    if self.progress.behind():
                        self._journals.append(self._pool.submit(self.progress.maybe_write, trailing=True))
                    continue
                if chunk is None:
                    break
                if chunk is _WAKE:  # an upload finished: journal it and free its buffer
                    self._retire(block=False)
                    continue
                if chunk is _SPARE:  # the caller took the prefaulted buffer: ready the next one
                    self.pool.prefault_spare()
                    continue
                if self.error is not None:
                    self._release(chunk)
                    continue
                try:
                    if chunk.direct:  # already written whole: durable and journaled in order
                        self._checksum(chunk)
                        fut = _HereExecutor().submit(self._release, chunk)
                    else:
                        self.pool.prefault_spare()  # off the caller's thread: write() finds warm memory
                        self._checksum(chunk)
                        self._bound_unsynced()
                        fut = self._pool.submit(self._upload, chunk)
                        fut.add_done_callback(lambda _: self.q.put(_WAKE))
                    self._pending.append((chunk, fut))
                    # Buffers bound what is pending: at most n_buffers unwritten, one fsync a worker.
                    self._retire(block=len(self._pending) > self.flush_threads + self.pool.n_buffers)
                except BaseException as exc:  # noqa: BLE001 - handed to the user's thread
                    self.error = self.error or exc
            while self._pending:
                self._retire(block=True)
        finally:
            self._pool.shutdown(wait=True)
            self._journal_pool.shutdown(wait=True)
            # Final counts before a commit or failure record lands (a failed rank's stay exact).
            self.progress.maybe_write(trailing=True)
            for fut in self._journals:
                if fut.exception() is not None and self.error is None:
                    self.error = fut.exception()
            with self.written_cond:  # wake a writer waiting for a chunk that will never land
                self.written_cond.notify_all()

    def _checksum(self, chunk: Chunk) -> None:
        # Sequential on purpose: a row's CRC is extended chunk by chunk, in order.
        for event in chunk.events:
            event.synchronize()
        buf = chunk.host.numpy()
        top = max(
            [p[0] for p in chunk.pieces[-1:]] + [r for r, _ in chunk.row_crcs[-1:]] + [int(b[3][-1]) for b in chunk.blocks],
            default=-1,
        )  # fmt: skip
        crc = self.crc = grown(self.crc, top + 1)
        for row, start, stop in chunk.pieces:
            crc[row] = _crc.extend(int(crc[row]), buf[start:stop])
        for row, value in chunk.row_crcs:
            crc[row] = value
        if not chunk.blocks:
            return
        need = chunk.check_base + len(chunk.blocks)
        self.checks = grown(self.checks, need)
        # The caller computed each block's CRC-32C (``Staging._block``); its rows point at it by id.
        base = chunk.number * self.pool.chunk_bytes
        for check, start, stop, rows, value in chunk.blocks:
            self.checks[check] = (base + start, stop - start, value)
            crc[rows] = -1 - check
        self.n_checks = need

    def _upload(self, chunk: Chunk) -> None:
        buf = chunk.host.numpy()
        size = self.object_size(chunk)
        if chunk.fill < size:
            buf[chunk.fill : size] = 0
        # Written, not yet durable: the journal thread fsyncs the chunks written since its last
        # fsync together (``_journal``). The buffer is free once the bytes are written: write()
        # refills it while the disk flushes.
        self.storage.put(f"{self.prefix}/{FS.DATA_NAME}/c/{chunk.number}", buf[:size].data)
        self._release(chunk)

    def _bound_unsynced(self) -> None:
        """Wait until one more chunk may be written: at most ``n_buffers + 1`` written chunks
        await their journal entry, plus ``flush_threads`` being written (docs/GUARANTEES.md,
        *Memory*: the dirty pages a crash may lose). The buffers alone do not bound this: a
        worker gives its buffer back before its upload's future is done."""
        while len(self._unjournaled) + len(self._pending) >= self.pool.n_buffers + 1 + self.flush_threads:
            if self._unjournaled:
                futures_wait([self._unjournaled.popleft()])
            else:
                self._retire(block=True)

    def _release(self, chunk: Chunk) -> None:
        """Give ``chunk``'s buffer back to the pool, once (its bytes were written, or never will be)."""
        if not chunk.released:
            chunk.released = True
            if not chunk.direct:
                self.pool.release(chunk.host)

    def _retire(self, *, block: bool) -> None:
        """Journal finished uploads in chunk order; release their buffers."""
        while self._pending and (block or self._pending[0][1].done()):
            chunk, fut = self._pending.popleft()
            block = False
            try:
                fut.result()
                with self.written_cond:
                    self.written = chunk.number + 1
                    self.written_cond.notify_all()
                if self.error is None:
                    # Its chunk and every earlier one are written now; the journal thread makes
                    # them durable and journals them while the next uploads run.
                    journal = self._journal_pool.submit(self._journal, chunk, completed_rows(chunk))
                    self._journals.append(journal)
                    self._unjournaled.append(journal)
                    bound = self.pool.n_buffers  # + flush_threads uploads in flight
                    while self._unjournaled and (self._unjournaled[0].done() or len(self._unjournaled) > bound):
                        futures_wait([self._unjournaled.popleft()])
            except BaseException as exc:  # noqa: BLE001
                self.error = self.error or exc
            finally:
                self._release(chunk)

    def _journal(self, chunk: Chunk, done: np.ndarray) -> None:
        """Make ``chunk`` and every earlier one durable, then write its journal entry (``done``:
        ``completed_rows(chunk)``), so every row the entry lists (rows that started in earlier
        chunks too) can be read back after a power loss."""
        if self.error is not None:  # an earlier chunk may not be durable: name nothing after it
            return
        try:
            if self.fsync and chunk.number >= self._synced:
                # One group commit: every chunk written since the last one (this one included) and
                # their folder (their names), fsynced at once. A disk busy with one commit lets the
                # next gather the chunks written meanwhile: fewer cache flushes than one a chunk.
                upto = self.written
                names = [f"{self.prefix}/{FS.DATA_NAME}/c/{c}" for c in range(self._synced, upto)]
                self.storage.sync(names, up=False)
                self._synced = upto
            self.progress.durable(chunk.number, done)
            crc = self.crc
            rows = np.empty((len(done), FS.INDEX_COLUMNS), dtype="<i8")
            rows[:, : FS.COL_CRC] = done[:, 1:]
            rows[:, FS.COL_CRC] = crc[np.minimum(done[:, 0], len(crc) - 1)] * (done[:, 0] < len(crc))
            checks = self.checks[chunk.check_base : chunk.check_base + len(chunk.blocks)]
            entry = gc_paused(
                FS.encode_journal, chunk.number, chunk.file_base, chunk.new_files, chunk.layout_base,
                chunk.new_layouts, rows, chunk.check_base, checks,
            )  # fmt: skip
            self.storage.put(f"{self.prefix}/{FS.journal_name(chunk.number)}", entry)
            with self.written_cond:
                self.journaled = chunk.number + 1
                self.written_cond.notify_all()
            self.progress.maybe_write()
        except BaseException as exc:  # noqa: BLE001 - handed to the user's thread
            self.error = self.error or exc
            raise
