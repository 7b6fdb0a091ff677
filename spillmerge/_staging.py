"""Staging: host buffers a writer copies frames into, and the thread that uploads them.

Protocol (the writer drives it; docs/ARCHITECTURE.md, Memory):
  (caller's thread)  ``BufferPool.acquire`` → fill a :class:`Chunk` → ``Flusher.q.put(chunk)``
  (flush thread)     wait for the chunk's CUDA copies → CRC-32C of its rows → upload it whole
                     (``flush_threads`` in flight) → ``journal/N`` once chunks ``0..N`` are durable
                     → ``BufferPool.release``; ``None`` on the queue ends it.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import numpy as np
import torch

from . import _format as F
from ._storage import Storage


@dataclass(slots=True)
class Chunk:
    """A staging buffer on its way to storage."""

    number: int
    """Chunk number in ``data``."""
    host: torch.Tensor
    """uint8 host buffer of ``chunk_bytes`` (pinned when CUDA tensors were written)."""
    host_np: Any = None
    """``host.numpy()``, made once: host-side copies slice it (cheaper per call than torch)."""
    fill: int = 0
    """Bytes used."""
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    """(row, start, stop) byte ranges of index rows inside this chunk, for the checksums."""
    event: Any = None
    """CUDA event recorded after the last device-to-host copy into this buffer."""
    completed: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    """(row, file_id, frame, layout_id, offset, nbytes) of every row of the frames whose last byte
    is in this chunk: a journal entry lists whole frames only."""
    file_base: int = 0
    """Catalog id of ``new_files[0]``."""
    new_files: list[str] = field(default_factory=list)
    """Filenames registered since the previous chunk was handed off."""
    layout_base: int = 0
    """Catalog id of ``new_layouts[0]``."""
    new_layouts: list[F.Layout] = field(default_factory=list)
    """Layouts registered since the previous chunk was handed off."""


_WAKE = object()


class BufferPool:
    """At most ``n_buffers`` host buffers of ``chunk_bytes``, reused: ``acquire`` blocks while all
    of them wait for storage (backpressure), the flush thread ``release``s each after its upload
    and allocates the next one ahead (``prefault_spare``) so ``write()`` never pays for fresh
    pages. Buffers are pinned once ``pin()`` was called (the first CUDA write)."""

    def __init__(self, chunk_bytes: int, n_buffers: int) -> None:
        self.chunk_bytes, self.n_buffers = chunk_bytes, n_buffers
        self.allocated = 0
        """Buffers allocated so far (at most ``n_buffers``)."""
        self.pinned = False
        """True once CUDA tensors were written: new buffers are pinned."""
        self._lock = threading.Condition()
        self._free: list[torch.Tensor] = []

    def pin(self) -> None:
        self.pinned = True

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
                    return buf
                if self.allocated < self.n_buffers:
                    self.allocated += 1
                    break
                self._lock.wait(timeout=0.5)  # backpressure: wait for the flush thread
        return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned)

    def prefault_spare(self) -> None:
        """Allocate one more buffer (within ``n_buffers``) and touch its pages, so the page faults
        of fresh memory are paid by the flush thread, not inside ``write()``."""
        with self._lock:
            if self._free or self.allocated >= self.n_buffers:
                return
            self.allocated += 1
        buf = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        if not self.pinned:  # pinned memory is resident already
            buf.numpy()[::4096] = 0
        self.release(buf)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._lock.notify()

    def clear(self) -> None:
        """Drop the free buffers (the staging memory is only needed while writing)."""
        with self._lock:
            self._free.clear()


class Flusher(threading.Thread):
    """Background thread: waits for a chunk's device copies, checksums its rows, uploads it whole
    (``flush_threads`` uploads at a time), and writes each chunk's journal entry once that chunk
    and every earlier one are durable."""

    def __init__(
        self, pool: BufferPool, storage: Storage, prefix: str, *, rank: int, flush_threads: int,
        object_size: Callable[[Chunk], int],
    ) -> None:  # fmt: skip
        """Uploads go to ``storage`` under ``prefix`` (the segment); ``object_size(chunk)`` says
        how many bytes of a chunk's buffer its object holds (the writer decides: the last chunk
        of a small spill is stored exactly)."""
        super().__init__(name=f"spillmerge-flush-r{rank}", daemon=True)
        self.pool, self.storage, self.prefix = pool, storage, prefix
        self.flush_threads, self.object_size = flush_threads, object_size
        self.q: queue.Queue[Any] = queue.Queue()
        self.crc: dict[int, int] = {}
        self.error: BaseException | None = None
        self.durable = 0
        """Chunks ``0 .. durable-1`` are on storage (uploads finish out of order; this counts in order)."""
        self.durable_cond = threading.Condition()
        self._pending: collections.deque[tuple[Chunk, Future[None]]] = collections.deque()
        self._journals: list[Future[None]] = []
        self._pool = ThreadPoolExecutor(flush_threads, thread_name_prefix=f"spillmerge-put-r{rank}")

    def run(self) -> None:
        try:
            self.pool.prefault_spare()  # the first chunk's buffer, while the caller is still computing
            while True:
                chunk = self.q.get()
                if chunk is None:
                    break
                if chunk is _WAKE:  # an upload finished: journal it and free its buffer
                    self._retire(block=False)
                    continue
                if self.error is not None:
                    self.pool.release(chunk.host)
                    continue
                try:
                    self.pool.prefault_spare()  # off the caller's thread: write() finds warm memory
                    self._checksum(chunk)
                    fut = self._pool.submit(self._upload, chunk)
                    fut.add_done_callback(lambda _: self.q.put(_WAKE))
                    self._pending.append((chunk, fut))
                    self._retire(block=len(self._pending) > self.flush_threads)
                except BaseException as exc:  # noqa: BLE001 - handed to the user's thread
                    self.error = self.error or exc
            while self._pending:
                self._retire(block=True)
        finally:
            self._pool.shutdown(wait=True)
            for fut in self._journals:
                if fut.exception() is not None and self.error is None:
                    self.error = fut.exception()
            with self.durable_cond:  # wake a writer waiting for a chunk that will never land
                self.durable_cond.notify_all()

    def _checksum(self, chunk: Chunk) -> None:
        # Sequential on purpose: a row's CRC is extended chunk by chunk, in order.
        if chunk.event is not None:
            chunk.event.synchronize()
        buf = chunk.host.numpy()
        for row, start, stop in chunk.pieces:
            self.crc[row] = google_crc32c.extend(self.crc.get(row, 0), buf[start:stop])

    def _upload(self, chunk: Chunk) -> None:
        buf = chunk.host.numpy()
        size = self.object_size(chunk)
        if chunk.fill < size:
            buf[chunk.fill : size] = 0
        self.storage.put(f"{self.prefix}/{F.DATA_NAME}/c/{chunk.number}", buf[:size].data)

    def _retire(self, *, block: bool) -> None:
        """Journal finished uploads in chunk order; release their buffers."""
        while self._pending and (block or self._pending[0][1].done()):
            chunk, fut = self._pending.popleft()
            block = False
            try:
                fut.result()
                with self.durable_cond:
                    self.durable = chunk.number + 1
                    self.durable_cond.notify_all()
                if self.error is None:
                    # Its chunk and every earlier one are durable now; the PUT itself may overlap
                    # the next uploads (a reader replays entries in order and stops at a gap).
                    self._journals.append(self._pool.submit(self._journal, chunk))
            except BaseException as exc:  # noqa: BLE001
                self.error = self.error or exc
            finally:
                self.pool.release(chunk.host)

    def _journal(self, chunk: Chunk) -> None:
        # Written only after this chunk and every earlier one are durable, so every row it lists
        # (including rows that started in earlier chunks) can be read back.
        rows = np.array(
            [(f, fr, lay, off, nb, self.crc.get(row, 0)) for row, f, fr, lay, off, nb in chunk.completed],
            dtype="<i8",
        ).reshape(-1, F.INDEX_COLUMNS)
        entry = F.encode_journal(
            chunk.number, chunk.file_base, chunk.new_files, chunk.layout_base, chunk.new_layouts, rows
        )
        self.storage.put(f"{self.prefix}/{F.journal_name(chunk.number)}", entry)
