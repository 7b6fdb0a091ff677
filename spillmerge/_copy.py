"""The byte-copy engine: frames from spill chunks into whole output chunks, checksum-verified,
at most a memory budget of stripes in flight (docs/ARCHITECTURE.md, Memory)."""

from __future__ import annotations

import functools
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np

from . import _codecs
from . import _format as F
from ._errors import CorruptSpillError
from ._plan import FilePlan, Plan
from ._storage import Storage
from ._zarrmeta import frames_per_chunk


@dataclass(slots=True)
class _Stripe:
    """The frames ``[start, stop)`` of one file: one chunk of each of its arrays."""

    file: FilePlan
    """The file."""
    chunk: int
    """Chunk number along the frame axis."""
    start: int
    """First output row."""
    stop: int
    """One past the last output row."""
    k: int
    """Frames per chunk of this file's arrays."""

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.file.frame_nbytes


def _stripes(files: list[FilePlan], chunk_bytes: int) -> list[_Stripe]:
    out = []
    for fp in files:
        k = frames_per_chunk(fp, chunk_bytes)
        for j, a in enumerate(range(0, len(fp.frames), k)):
            out.append(_Stripe(fp, j, a, min(a + k, len(fp.frames)), k))
    return out


def _done_cb(done: Any, size: int, fut: Future[None]) -> None:
    done(fut, size)


def copy_files(
    src: Storage, output: Storage, plan: Plan, files: list[FilePlan], *, chunk_bytes: int, codec: str,
    memory_budget: int, threads: int, progress: bool | None,
) -> None:  # fmt: skip
    """Copy the frames of ``files`` into their output chunks (``chunk_bytes`` target, ``codec``),
    at most ``memory_budget`` bytes of stripes in flight over ``threads`` threads; a progress bar
    when ``progress`` (None: on a terminal)."""
    budget = memory_budget
    stripes = _stripes(files, chunk_bytes)
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=sum(s.nbytes for s in stripes),
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="merge",
            file=sys.stderr,
        )
    cond = threading.Condition()
    in_flight = 0
    errors: list[BaseException] = []

    def done(fut: Future[None], size: int) -> None:
        nonlocal in_flight
        with cond:
            in_flight -= size
            exc = fut.exception()
            if exc is not None:
                errors.append(exc)
            cond.notify_all()
        if bar is not None and exc is None:
            bar.update(size)

    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spillmerge-merge") as pool:
            for stripe in stripes:
                size = stripe.nbytes
                with cond:
                    # Bounded memory: wait until this stripe fits in the budget (one stripe always may run).
                    while in_flight and in_flight + size > budget and not errors:
                        cond.wait()
                    if errors:
                        break
                    in_flight += size
                fut = pool.submit(_copy_stripe, src, output, plan, stripe, codec)
                fut.add_done_callback(functools.partial(_done_cb, done, size))
    finally:
        if bar is not None:
            bar.close()
    if errors:
        raise errors[0]


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread buffer reused across stripes. Fresh allocations of this size are mmapped and
    page-faulted anew each time; on the VMs we measured that tripled the merge's CPU time."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


def _copy_stripe(src: Storage, output: Storage, plan: Plan, stripe: _Stripe, codec: str) -> None:
    for leaf in stripe.file.leaves:
        rows = leaf.rows[stripe.start : stripe.stop]
        item = leaf.layout.nbytes
        if item == 0:  # zero-size frames: the array has no elements, so no chunk to write
            continue
        full = stripe.k * item  # the last chunk of an array is padded to the chunk shape
        used = len(rows) * item
        key = f"{leaf.node}/c/{stripe.chunk}" + "/0" * len(leaf.layout.shape)
        enc = _codecs.encoder(codec, np.dtype(F.DTYPES[leaf.layout.dtype].storage).itemsize)
        if src.local and enc is None:
            # Frames are written straight from the page cache (mmap), never copied into our memory.
            buffers: list[Any] = []
            for j, r in enumerate(rows.tolist()):
                views = [src.view(rel, lo, hi) for rel, lo, hi in pieces(plan, rows[j : j + 1])]
                got = 0
                for v in views:
                    got = google_crc32c.extend(got, v)
                if got != int(plan.crc[r]):
                    _raise_mismatch(src, plan, stripe, leaf, j, r)
                buffers.extend(views)
            if used < full:
                buffers.append(_zeros(full - used))
        else:
            # A compressor needs the whole chunk in one buffer: one copy into a reused one.
            buf = _scratch(full if enc is not None else used)
            if src.local:
                pos = 0
                for j, r in enumerate(rows.tolist()):
                    got = 0
                    for rel, lo, hi in pieces(plan, rows[j : j + 1]):
                        v = src.view(rel, lo, hi)
                        got = google_crc32c.extend(got, v)
                        buf[pos : pos + hi - lo] = np.frombuffer(v, dtype=np.uint8)
                        pos += hi - lo
                    if got != int(plan.crc[r]):
                        _raise_mismatch(src, plan, stripe, leaf, j, r)
            else:
                src.read_into(pieces(plan, rows), buf[:used].data)
                for j, r in enumerate(rows.tolist()):
                    if google_crc32c.value(buf[j * item : (j + 1) * item]) != int(plan.crc[r]):
                        _raise_mismatch(src, plan, stripe, leaf, j, r)
            if enc is not None:
                buf[used:full] = 0
                buffers = [np.frombuffer(enc.encode(buf[:full]), dtype=np.uint8)]
            else:
                buffers = [buf[:used]] + ([_zeros(full - used)] if used < full else [])
        out_crc = 0
        for part in buffers:
            out_crc = google_crc32c.extend(out_crc, part)
        output.makedirs(key.rsplit("/", 1)[0])
        output.put(key, [*buffers, np.uint32(out_crc).astype("<u4").tobytes()])


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.uint8)


def _raise_mismatch(src: Storage, plan: Plan, stripe: _Stripe, leaf: Any, j: int, r: int) -> None:
    seg = plan.segments[int(plan.seg[r])]
    where = src.describe(f"{seg.seg.rel}/{F.DATA_NAME}")
    raise CorruptSpillError(
        f"{where}: checksum mismatch for {stripe.file.filename!r:.200} frame "
        f"{int(stripe.file.frames[stripe.start + j])} leaf {leaf.layout.leaf_name()!r} at bytes "
        f"{int(plan.offset[r])}..{int(plan.offset[r] + plan.nbytes[r])} (rank {seg.seg.rank}): "
        "the spill is corrupt; run `spillmerge verify` on the root",
        path=where,
        rank=seg.seg.rank,
    )


def pieces(plan: Plan, rows: np.ndarray) -> list[tuple[str, int, int]]:
    """Byte ranges of ``rows`` in their data chunk objects, adjacent ranges coalesced."""
    out: list[tuple[str, int, int]] = []
    for r in rows.tolist():
        seg = plan.segments[int(plan.seg[r])]
        cb = seg.chunk_bytes
        off, end = int(plan.offset[r]), int(plan.offset[r] + plan.nbytes[r])
        while off < end:
            c = off // cb
            stop = min(end, (c + 1) * cb)
            rel = f"{seg.seg.rel}/{F.DATA_NAME}/c/{c}"
            lo, hi = off - c * cb, stop - c * cb
            if out and out[-1][0] == rel and out[-1][2] == lo:
                out[-1] = (rel, out[-1][1], hi)
            else:
                out.append((rel, lo, hi))
            off = stop
    return out
