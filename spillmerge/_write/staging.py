"""Staging: the host buffers a writer copies frames into (the flush side: ``_write.flush``).

Protocol (the writer drives it through :class:`Staging`; docs/GUARANTEES.md, *Memory*):
  (caller's thread)  ``Staging.add_frame``: ``BufferPool.acquire`` → fill a :class:`Chunk` (the
                     CRC-32C of each block of host rows right after its copy: ``add_frames``
                     one per leaf per block, ``add_frame`` one per run of whole frames) →
                     ``Staging.hand_off``: ``Flusher.q.put(chunk)``
  (flush thread)     ``_write.flush.Flusher``: checksums, writes and fsyncs the chunk, journals
                     it in chunk order, gives its buffer back.
A direct writer (a local disk, and a first frame on the host of at least :data:`DIRECT_MIN_BYTES`:
a smaller one costs less copied than written by a system call) writes each chunk's bytes into its
file in ``_add_by_leaf`` / ``add_host_frame`` / ``add_frames`` instead of copying them, the bytes
and layout of a staged chunk, the checksums from the caller's memory; ``hand_off`` closes the file
and queues the chunk, which the flush thread only makes durable and journals.
"""

from __future__ import annotations

import array
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._errors import SpillMergeError, SpillStorageError
from .._format import crc as _crc
from .._format import spill as FS
from .._storage import Storage
from .flush import BufferPool, Chunk, Flusher, completed_rows

CHECK_BYTES = 1 << 20
"""Largest block checksum (docs/FORMAT.md, ``checks``) ``add_frames`` makes, unless one row is larger."""
COMPARE_WINDOW = 1 << 20
"""Bytes compared at a time when a key is written again (bounded memory for any frame size)."""
DIRECT_MIN_BYTES = 64 << 10
"""Smallest first frame (bytes, all leaves) that makes a local-disk writer write directly."""
NO_BUFFER = torch.empty(0, dtype=torch.uint8)
"""The ``Chunk.host`` of a direct chunk: it has no staging buffer."""
SIDE_STREAM_BYTES = 1 << 20
"""A CUDA leaf of at least this many bytes is copied on the writer's own stream, overlapping the
producer's next kernels; a smaller one on the caller's stream (``Staging._prepare_cuda``)."""


class Staging:
    """The writer's side of staging: the only object that touches the staging chunks, the
    buffer pool and the flush thread. The writer calls, in order: :meth:`start` (at open),
    :meth:`add_frame` / :meth:`add_frames` (copies the bytes; host or CUDA), then :meth:`finish`
    (commit) or :meth:`stop` (abort), :meth:`take_rows` and :meth:`checksums` for the index, then
    retires :attr:`pool`.
    Full chunks go to the :class:`Flusher` on their own; each carries the catalog entries (filenames, layouts) added
    since the previous one, read from the two append-only lists given to :meth:`start`."""

    flusher: Flusher
    """The flush thread, made by :meth:`start`."""

    def __init__(self, chunk_bytes: int, n_buffers: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.pool = BufferPool(chunk_bytes, n_buffers)
        self.offset = 0
        """Bytes staged so far: where the next leaf's bytes start in the segment's ``data``."""
        self.n_chunks = 0
        """Chunks started so far (the last one may still be filling)."""
        self.n_checks = 0
        """Block checksums assigned so far (``add_frames``)."""
        self.frames = 0
        """Frames staged so far (rewrites of a key included): the progress record's count of
        what the writer has taken, durable or not yet (one int, read by the flush thread)."""
        self._current: Chunk | None = None
        self._cuda_stream: Any = None
        self._closing = False
        self.direct: bool | None = None
        """Chunks are written straight into their files; None until the first frame decides (in
        ``add_frame`` or ``add_frames``: a template's frames follow a frame staged by them)."""
        self._sealed_rows: list[np.ndarray] = []
        """The rows of the chunks handed off since :meth:`take_rows` last took them."""

    def start(
        self, storage: Storage, prefix: str, *, rank: int, flush_threads: int, filenames: list[str],
        layouts: list[FS.Layout], fsync: bool = True, at_commit: bool = False,
    ) -> None:  # fmt: skip
        """Start the flush thread for the segment ``prefix`` of ``storage``. ``filenames`` and
        ``layouts`` are the writer's catalog (append-only). ``at_commit``: start it only when a
        chunk fills; a segment whose bytes fit in one chunk is then flushed by :meth:`finish`
        (or :meth:`stop`) in the writer's thread, no thread started (a short-lived writer: no
        progress record is written before that)."""
        self._storage, self._prefix, self._path = storage, prefix, storage.describe(prefix)
        self._filenames, self._layouts = filenames, layouts
        self._journaled_files = self._journaled_layouts = 0
        self.flusher = Flusher(
            self.pool, storage, prefix, rank=rank, flush_threads=flush_threads, object_size=self._object_size,
            fsync=fsync,
        )  # fmt: skip
        self.flusher.progress.staged = lambda: (self.frames, self.offset)
        if not at_commit:
            self.flusher.start()

    # -------------------------------------------------------------------------------- copies
    def add_frame(self, row: int, file_id: int, frame: int, layout_ids: tuple[int, ...], leaves: list[Any]) -> None:
        """Stage one frame's leaves (index rows ``row``, ``row + 1`` ...) exactly as ``_add_by_leaf``
        would: when every leaf is on the host and the frame fits in the current chunk, in
        one step (no held list, no per-leaf call); otherwise through ``_add_by_leaf``."""
        data, sizes = [leaf.data for leaf in leaves], [leaf.nbytes for leaf in leaves]
        total = sum(sizes)
        if self.direct is None:
            self._decide(total, not any(getattr(d, "is_cuda", False) for d in data))
        if total and set(map(type, data)) == {np.ndarray}:
            self.add_host_frame(row, file_id, frame, layout_ids, data, sizes, total)
            return
        self.frames += 1
        self._add_by_leaf(row, file_id, frame, layout_ids, data, sizes)

    def add_host_frame(
        self, row: int, file_id: int, frame: int, layout_ids: tuple[int, ...], data: list[np.ndarray] | bytes,
        sizes: Any, total: int,
    ) -> None:  # fmt: skip
        """``add_frame`` of a frame whose leaves are host uint8 arrays ``data`` of ``sizes``
        bytes (or those bytes back to back, one copy), ``total`` > 0 in all: in one step when the
        frame fits in the current chunk (no held list, no per-leaf call), its rows joining the
        chunk's open block of whole frames; otherwise leaf by leaf through ``_add_by_leaf``."""
        self.frames += 1
        chunk = self._current
        if chunk is None or chunk.fill + total >= self.chunk_bytes:
            if isinstance(data, bytes):
                data = np.split(np.frombuffer(data, dtype=np.uint8), np.cumsum(sizes[:-1]))
            self._add_by_leaf(row, file_id, frame, layout_ids, data, sizes)
            return
        if chunk.direct:
            # Into the direct chunk with one pwritev, before any bookkeeping (a failed write lists
            # nothing); the open block's CRC-32C extends over the leaves, from the caller's memory.
            parts = [data] if isinstance(data, bytes) else [d for d, n in zip(data, sizes, strict=True) if n]
            self._write_parts(chunk.fd, parts, chunk.fill)
            crc = chunk.run_crc if chunk.run else 0
            for d in parts:
                crc = _crc.extend(crc, d)
            chunk.run_crc = crc
        elif isinstance(data, bytes):
            memoryview(chunk.host_np)[chunk.fill : chunk.fill + total] = data
        else:
            host, fill = chunk.host_np, chunk.fill
            for d, n in zip(data, sizes, strict=True):
                host[fill : fill + n] = d
                fill += n
        # The rows join the chunk's open block of whole frames (checked with the block: a CRC call
        # per row held the GIL).
        fill, base = chunk.fill, self.offset - chunk.fill
        run, tail = chunk.run, chunk.tail
        if not run:
            chunk.run_start = fill
        for j, n in enumerate(sizes):
            if n:
                run.append(row + j)
            tail.extend((row + j, file_id, frame, layout_ids[j], base + fill, n))
            fill += n
        chunk.fill = fill
        self.offset += total
        if fill - chunk.run_start >= CHECK_BYTES:
            self._close_run(chunk)

    def add_frames(
        self, row: int, file_ids: np.ndarray | int, frames: np.ndarray | None, layout_ids: np.ndarray,
        sizes: np.ndarray, columns: list[np.ndarray],
    ) -> None:  # fmt: skip
        """Stage whole frames at once: frame ``i`` has index rows ``row + i * L + j`` for its
        ``L`` leaves; leaf ``j`` is ``sizes[i, j]`` bytes (every frame has some) of catalog layout
        ``layout_ids[i, j]``, the next bytes of ``columns[j]`` (leaf ``j``'s rows back to back).
        ``file_ids``: int64 per frame, or an int (frame ``i`` is file ``file_ids + i``);
        ``frames``: int64 per frame, or None (frame 0 each). The frames that fit whole in the
        current chunk are staged a leaf at a time, one copy per leaf (its rows one byte range) and
        a block checksum per CHECK_BYTES of its rows; a frame straddling two chunks goes through
        ``_add_by_leaf`` (a CRC per row, as ``write`` does)."""
        n, n_leaves = sizes.shape
        ends = np.cumsum(sizes, axis=0)
        starts = ends - sizes
        frame_ends = np.cumsum(sizes.sum(axis=1))
        gaps = (sizes == 0).any(axis=0).tolist()  # per leaf: a row of no bytes, in no block
        if self.direct is None:
            self._decide(int(frame_ends[0]), True)
        self.frames += n
        grid = np.arange(n * n_leaves, dtype=np.int64).reshape(n, n_leaves) + row
        fids = np.arange(file_ids, file_ids + n, dtype=np.int64) if isinstance(file_ids, int) else file_ids
        i = 0
        while i < n:
            chunk = self._current_chunk()
            done = int(frame_ends[i - 1]) if i else 0
            k = int(np.searchsorted(frame_ends, done + self.chunk_bytes - chunk.fill, side="right")) - i
            fr = 0 if frames is None else int(frames[i])
            if k == 0:  # this frame straddles the chunk boundary: leaf by leaf, as write() does
                nbs = sizes[i].tolist()
                pieces = [col[a : a + nb] for col, a, nb in zip(columns, starts[i].tolist(), nbs, strict=True)]
                self._add_by_leaf(int(grid[i, 0]), int(fids[i]), fr, layout_ids[i].tolist(), pieces, nbs)
                i += 1
                continue
            self._close_run(chunk)  # the open block of write()'s frames ends where this block starts
            part = slice(i, i + k)
            cube = np.empty((k, n_leaves, 6), dtype=np.int64)
            cube[:, :, 0] = grid[part]
            cube[:, :, 1] = fids[part, None]
            cube[:, :, 2] = 0 if frames is None else frames[part, None]
            cube[:, :, 3] = layout_ids[part]
            cube[:, :, 5] = sizes[part]
            fill, base = chunk.fill, self.offset - chunk.fill
            for j in range(n_leaves):
                a, b = int(starts[i, j]), int(ends[i + k - 1, j])
                lo, hi = starts[part, j] - a, ends[part, j] - a  # the rows' bytes in this block of the leaf
                cube[:, j, 4] = base + fill + lo
                if a == b:
                    continue
                src = columns[j][a:b]
                if chunk.direct:
                    self._write_parts(chunk.fd, [src], fill)
                else:
                    chunk.host_np[fill : fill + b - a] = src
                r = 0
                while r < k:  # block checksums of at most CHECK_BYTES (or one larger row)
                    s = max(r + 1, int(np.searchsorted(hi, lo[r] + CHECK_BYTES, side="right")))
                    rows = cube[r:s, j, 0][sizes[i + r : i + s, j] > 0] if gaps[j] else cube[r:s, j, 0]
                    if len(rows):
                        value = _crc.value(src[lo[r] : hi[s - 1]]) if chunk.direct else None
                        self._block(chunk, fill + int(lo[r]), fill + int(hi[s - 1]), rows, value)
                    r = s
                fill += b - a
            chunk.complete_block(cube.reshape(k * n_leaves, 6))
            self.offset += fill - chunk.fill
            chunk.fill = fill
            i += k
            if chunk.fill == self.chunk_bytes:
                self.hand_off()

    def _add_by_leaf(self, row: int, file_id: int, frame: int, layout_ids: Any, pieces: list[Any], sizes: Any) -> None:
        """Copy one frame (index rows ``row`` ...; at least one leaf) into staging at
        :attr:`offset`, a leaf at a time: ``pieces[j]`` a flat uint8 ndarray or contiguous tensor
        of ``sizes[j]`` bytes. The rows wait in ``held`` until the last leaf is copied: they all go
        to the chunk holding the frame's last byte, so the journal entry of that chunk lists the
        whole frame and a frame whose large leaf never became durable is never salvaged by halves."""
        held: list[Any] = []
        for j, (data, nbytes) in enumerate(zip(pieces, sizes, strict=True)):
            done = crc = 0
            is_cuda = isinstance(data, torch.Tensor) and data.is_cuda
            if self.direct:
                data, is_cuda = data.cpu().numpy() if isinstance(data, torch.Tensor) else data, False
            if is_cuda:
                stream = self._prepare_cuda(data, nbytes)
                device = data.get_device()
            while done < nbytes:
                chunk = self._current_chunk()
                if chunk.run:  # the open block of whole frames ends where these bytes start
                    self._close_run(chunk)
                n = min(nbytes - done, self.chunk_bytes - chunk.fill)
                if is_cuda:
                    self._copy_cuda(chunk, data if n == nbytes else data[done : done + n], n, stream, device)
                elif chunk.direct:  # into its file; the row's CRC-32C extended from the caller's memory
                    piece = data if n == nbytes else data[done : done + n]
                    self._write_parts(chunk.fd, [piece], chunk.fill)
                    crc = _crc.extend(crc, piece)  # a row may continue from the previous chunk
                    chunk.row_crcs.append((row + j, crc))
                else:
                    chunk.host_np[chunk.fill : chunk.fill + n] = data[done : done + n]
                if not chunk.direct:  # a direct chunk's rows were checksummed as written
                    chunk.pieces.append((row + j, chunk.fill, chunk.fill + n))
                chunk.fill += n
                done += n
                self.offset += n
                if done < nbytes:  # the chunk is full: the rest goes to the next one
                    self.hand_off()
            held.append((row + j, file_id, frame, int(layout_ids[j]), self.offset - nbytes, nbytes))
        tail = (chunk if nbytes else self._current_chunk()).tail  # the last leaf's chunk
        for e in held:
            tail.extend(e)
        if nbytes and chunk.fill == self.chunk_bytes:
            self.hand_off()

    def _write_parts(self, fd: int, parts: list[Any], at: int) -> None:
        """Write ``parts`` (host buffers) back to back at byte ``at`` of the direct chunk file
        ``fd``: one ``pwritev`` for them all, another for what a short write left. At an explicit
        offset, so a write that failed half way leaves the next one in its place."""
        with self._storage.storage_errors("write", self._prefix):
            views = [memoryview(p).cast("B") for p in parts]
            while views:
                n = os.pwritev(fd, views, at)
                at += n
                while views and n >= len(views[0]):
                    n -= len(views.pop(0))
                if n:
                    views[0] = views[0][n:]

    def _decide(self, nbytes: int, host: bool) -> None:
        """Write directly or stage, for good: by the writer's first frame."""
        self.direct = self._storage.local and host and nbytes >= DIRECT_MIN_BYTES
        if self.direct:
            self.pool.retire()  # the spare the flush thread may have made ready goes

    def _close_run(self, chunk: Chunk) -> None:
        """Close the open block of ``write``'s frames of ``chunk`` into a block checksum."""
        if chunk.run:
            rows = np.frombuffer(chunk.run, dtype=np.int64)
            self._block(chunk, chunk.run_start, chunk.fill, rows, chunk.run_crc if chunk.direct else None)
            chunk.run = array.array("q")

    def _block(self, chunk: Chunk, start: int, stop: int, rows: np.ndarray, value: int | None = None) -> None:
        """A block checksum of host bytes ``start:stop`` of ``chunk`` (rows ``rows``, ascending),
        computed here, in the caller's thread, while the bytes just copied are in its cache
        (``value``: computed already, from the caller's memory, for a direct chunk)."""
        if value is None:
            value = _crc.value(chunk.host_np[start:stop])
        chunk.blocks.append((self.n_checks, start, stop, rows, value))
        self.n_checks += 1

    def _prepare_cuda(self, data: torch.Tensor, nbytes: int) -> Any:
        """The stream that copies ``data`` to host: None for the caller's current stream, which
        copies a leaf under :data:`SIDE_STREAM_BYTES` like any operation the caller queues there:
        after the producer's work and before whatever the caller queues next (overwriting the
        tensor in place, freeing it), with no cross-stream bookkeeping (each call into
        ``torch.cuda``'s stream helpers costs more than a small leaf's copy). A larger leaf is
        copied on the writer's own stream, so the producer's next kernels overlap it."""
        self.pool.pinned = True
        if nbytes < SIDE_STREAM_BYTES:
            return None
        current = torch.cuda.current_stream(data.device)
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream(device=data.device)
        # Copies run on our own stream after the producer's work; the allocator must not
        # reuse the tensor's memory before our copy has read it.
        self._cuda_stream.wait_stream(current)
        data.record_stream(self._cuda_stream)
        return self._cuda_stream

    def _copy_cuda(self, chunk: Chunk, src: torch.Tensor, n: int, stream: Any, device: int) -> None:
        """Queue the copy of ``src`` into ``chunk`` at its fill, on ``stream`` (None: the caller's
        current stream), noting the stream so that ``seal`` marks its end."""
        dst = chunk.host[chunk.fill : chunk.fill + n]
        if stream is None:
            dst.copy_(src, non_blocking=True)
            chunk.streams[torch.cuda.current_stream(device).cuda_stream] = device
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        chunk.streams[stream.cuda_stream] = device
        # Work the caller queues next (e.g. overwriting this tensor in place) runs after our
        # copy, without blocking the host: write() keeps its copy semantics on CUDA.
        torch.cuda.current_stream(src.device).wait_stream(stream)

    def seal(self, chunk: Chunk) -> list[Any]:
        """Record an event on every stream that copied into ``chunk`` so far, after its copies
        (one per stream and chunk, not per leaf), and return the chunk's events."""
        if chunk.streams:
            chunk.events = []
            for raw, device in chunk.streams.items():
                event = torch.cuda.Event()
                event.record(torch.cuda.ExternalStream(raw, device=device))
                chunk.events.append(event)
        return chunk.events

    def _current_chunk(self) -> Chunk:
        if self._current is None:
            if self.direct:
                self._wait_journaled()
                chunk = Chunk(self.n_chunks, NO_BUFFER, check_base=self.n_checks, direct=True)
                # Created (or truncated) under its final name, as ``put`` does: a journal entry
                # names it only once durable.
                rel = f"{self._prefix}/{FS.DATA_NAME}/c/{self.n_chunks}"
                with self._storage.storage_errors("write", rel):
                    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                    chunk.fd = os.open(self._storage.path(rel), flags, 0o644)
                self._current = chunk
            else:
                buf = self.pool.acquire(self.check)
                self._current = Chunk(self.n_chunks, buf, buf.numpy(), check_base=self.n_checks)
            self.n_chunks += 1
        return self._current

    def _wait_journaled(self) -> None:
        """Backpressure of a direct writer, as the staging buffers give a staged one: at most
        ``n_buffers`` chunk files not yet journaled, the one being written included (the bytes
        a crash may lose)."""
        fl = self.flusher
        if self.n_chunks - fl.journaled >= self.pool.n_buffers and fl.ident is not None:
            self._wait(lambda: self.n_chunks - fl.journaled < self.pool.n_buffers)

    def _wait(self, done: Callable[[], bool]) -> None:
        """Block until ``done()`` (the flush thread notifies its progress), or the flush thread
        failed (its error raised here) or ended."""
        fl = self.flusher
        with fl.written_cond:
            while not done() and fl.error is None and fl.is_alive():
                fl.written_cond.wait(0.5)
        self.check()

    def hand_off(self) -> None:
        """Queue the current chunk (if any) for upload, with the catalog entries added since the
        previous one."""
        chunk, self._current = self._current, None
        if chunk is not None:
            self._close_run(chunk)
            if chunk.fd >= 0:  # a direct chunk: padded with zeros to its object size, as a staged one
                fd, chunk.fd, size = chunk.fd, -1, self._object_size(chunk)
                with self._storage.storage_errors("write", self._prefix):
                    try:
                        if chunk.fill < size:
                            os.ftruncate(fd, size)
                    finally:
                        os.close(fd)
            chunk.file_base, chunk.new_files = self._journaled_files, self._filenames[self._journaled_files :]
            chunk.layout_base, chunk.new_layouts = self._journaled_layouts, self._layouts[self._journaled_layouts :]
            self._journaled_files, self._journaled_layouts = len(self._filenames), len(self._layouts)
            self.seal(chunk)
            self._sealed_rows.append(completed_rows(chunk))
            if not self._closing and self.flusher.ident is None:
                self.flusher.start()  # at_commit, and a chunk filled: the flush thread takes over
            self.flusher.q.put(chunk)

    def take_rows(self) -> list[np.ndarray]:
        """The index rows staged since the last call, as int64 ``(n, 6)`` parts (row, file,
        frame, layout, offset, nbytes: the rows the journal lists); the current chunk's rows
        come again with the next call, until it is handed off."""
        parts, self._sealed_rows = self._sealed_rows, []
        if self._current is not None:
            parts.append(completed_rows(self._current))
        return parts

    def _object_size(self, chunk: Chunk) -> int:
        # A spill smaller than one chunk is stored as one exactly-sized chunk; otherwise the last
        # chunk is padded to the chunk size, as zarr's regular chunk grid requires.
        if self._closing and chunk.number == 0 and self.n_chunks == 1:
            return max(chunk.fill, 1)
        return self.chunk_bytes

    # ------------------------------------------------------------------------------ read back
    def same_bytes(self, leaves: list[tuple[int, Any, int]]) -> bool:
        """Do the staged bytes at ``(offset, data, nbytes)`` of every leaf equal ``data``?

        Only a rewrite of a key gets here (rare), so this may wait for the flush thread and read
        back from storage; writes of new keys never checksum or compare anything. The earlier
        bytes are read where they are: in the current staging chunk, else (once the flush thread
        has uploaded their chunk) from storage, ``COMPARE_WINDOW`` bytes at a time. CUDA leaves
        are copied to the host, synchronously, window by window."""
        reader: Storage | None = None
        try:
            for off, data, nbytes in leaves:
                pos = 0
                while pos < nbytes:
                    c, lo = divmod(off + pos, self.chunk_bytes)
                    m = min(nbytes - pos, self.chunk_bytes - lo, COMPARE_WINDOW)
                    new = data[pos : pos + m]
                    if isinstance(new, torch.Tensor):
                        new = new.cpu().numpy()
                    cur = self._current
                    if cur is not None and cur.number == c and not cur.direct:
                        for event in self.seal(cur):  # its device-to-host copies may still run
                            event.synchronize()
                        old = cur.host.numpy()[lo : lo + m]
                    else:
                        if cur is None or cur.number != c:  # a direct chunk's file has its bytes already
                            self._wait_written(c)
                        if reader is None:  # its own handle cache, closed below
                            reader = Storage(self._storage.url, self._storage.storage_options)
                        old = np.empty(m, dtype=np.uint8)
                        reader.read_into([(f"{self._prefix}/{FS.DATA_NAME}/c/{c}", lo, lo + m)], old.data)
                    if not np.array_equal(old, new):
                        return False
                    pos += m
        finally:
            if reader is not None:
                reader.close()
        return True

    def _wait_written(self, chunk: int) -> None:
        """Block until data chunk ``chunk`` is on storage (the flush thread uploads in the
        background); raise the flush thread's error if it failed instead."""
        fl = self.flusher
        self._wait(lambda: fl.written > chunk)
        if fl.written <= chunk:  # pragma: no cover - the flush thread ended without an error
            raise SpillStorageError(f"data chunk {chunk} of {self._path} was never written", path=self._path)

    # ------------------------------------------------------------------------------ the end
    def check(self) -> None:
        """Raise the flush thread's error, if it failed."""
        err = self.flusher.error
        if err is not None:
            if isinstance(err, SpillMergeError):
                raise err
            raise SpillStorageError(
                f"spilling to {self._path} failed in the background: {type(err).__name__}: {err}",
                path=self._path,
            ) from err

    def finish(self) -> None:
        """Commit: upload the last chunk (exactly sized when it is the only one), wait for every
        upload and journal entry, raise the flush thread's error."""
        self._closing = True
        self.hand_off()
        self._end()
        self.check()

    def _end(self) -> None:
        """The final ``None`` to the flusher; wait for it, or run it here if it never started."""
        fl = self.flusher
        fl.q.put(None)
        if fl.ident is None:
            fl.run_here()
        else:
            fl.join()

    def stop(self) -> bool:
        """Abort: flush what was staged (so it stays readable) if the flush thread still runs;
        True when the flush thread never failed (what it wrote can be indexed)."""
        self._closing = True
        fl = self.flusher
        if fl.is_alive() or (fl.ident is None and not fl.inline):  # not yet ended
            self.hand_off()
            self._end()
        return fl.error is None

    def abandon(self) -> None:
        """The writer was dropped while open: the flush thread ends once the chunks handed to it
        are written and journaled (as a killed writer's: no record), the open chunk file is closed.
        Waits for nothing: the garbage collector may call it on any thread."""
        self.flusher.q.put(None)
        chunk = self._current
        if chunk is not None and chunk.fd >= 0:
            fd, chunk.fd = chunk.fd, -1
            os.close(fd)

    def checksums(self, rows: np.ndarray) -> np.ndarray:
        """Set the CRC column of the index rows ``rows`` (every row staged, in order; 0 there
        before) and return the int64 ``(n, 3)`` block checksums (offset, nbytes, CRC-32C) their
        negative CRCs point at (complete once :meth:`finish` returned)."""
        fl = self.flusher
        rows[: len(fl.crc), FS.COL_CRC] = fl.crc[: len(rows)]
        return fl.checks[: fl.n_checks].copy()
