"""The byte-copy engine: leaf rows from spill chunks into whole output chunks of the columns'
``values``, checksum-verified, at most a memory budget of chunks in flight
(docs/ARCHITECTURE.md, Memory).

The work is a list of :class:`Unit` s, one per output chunk; a merge in parts gives each part a
share of the units (``_plan.split``), so no two processes ever write the same object.
"""

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
from . import _format_spill as FS
from ._errors import CorruptSpillError
from ._plan import Plan, PlannedColumn
from ._spillroot import check_of, data_ranges, verify_block
from ._storage import Storage
from ._zarrmeta import values_chunk


@dataclass(frozen=True, slots=True)
class Unit:
    """One output chunk: units ``[lo, hi)`` of one column's ``values``."""

    column: int
    """Position in ``plan.columns``."""
    chunk: int
    """Chunk number along the first dimension."""
    lo: int
    """First unit (row, element or byte) of the chunk."""
    hi: int
    """One past the last unit."""
    k: int
    """Units per chunk of this array (the chunk shape's first dimension)."""
    nbytes: int
    """Payload bytes: the memory budget and the split between parts count these."""


def units(plan: Plan, chunk_bytes: int) -> list[Unit]:
    """Every output chunk of every column, in column order (deterministic: parts split this list)."""
    out: list[Unit] = []
    for ci, col in enumerate(plan.columns):
        n = col.n_units
        if n == 0 or col.unit_bytes == 0:
            continue  # no elements: the array has no chunk to write
        k = values_chunk(plan, col, chunk_bytes)
        for j, lo in enumerate(range(0, n, k)):
            hi = min(lo + k, n)
            size = (hi - lo) * col.unit_bytes
            out.append(Unit(ci, j, lo, hi, k, max(size, 1)))
    return out


def _done_cb(done: Any, size: int, fut: Future[None]) -> None:
    done(fut, size)


def copy_units(
    src: Storage, output: Storage, plan: Plan, todo: list[Unit], *, codec: str, memory_budget: int, threads: int,
    progress: bool | None,
) -> None:  # fmt: skip
    """Write the output chunks ``todo`` (``codec``), at most ``memory_budget`` bytes of chunks in
    flight over ``threads`` threads; a progress bar when ``progress`` (None: on a terminal)."""
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=sum(u.nbytes for u in todo), unit="B", unit_scale=True, unit_divisor=1024, desc="merge",
            file=sys.stderr,
        )  # fmt: skip
    cond = threading.Condition()
    in_flight = 0
    errors: list[BaseException] = []
    offsets: dict[int, np.ndarray] = {}
    checked: set[tuple[int, int]] = set()  # (segment, block checksum) verified by this merge
    for u in todo:  # once per column, before the threads share them
        col = plan.columns[u.column]
        if col.counts is not None and u.column not in offsets:
            offsets[u.column] = col.offsets()

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
            for u in todo:
                size = u.nbytes
                with cond:
                    # Bounded memory: wait until this chunk fits in the budget (one chunk always may run).
                    while in_flight and in_flight + size > memory_budget and not errors:
                        cond.wait()
                    if errors:
                        break
                    in_flight += size
                job = _OutputChunk(src, plan, plan.columns[u.column], u, offsets.get(u.column), checked)
                fut = pool.submit(job.write, output, codec)
                fut.add_done_callback(functools.partial(_done_cb, done, size))
    finally:
        if bar is not None:
            bar.close()
    if errors:
        raise errors[0]


_SCRATCH = threading.local()


def _scratch(nbytes: int, slot: str = "buf") -> np.ndarray:
    """A per-thread buffer reused across chunks. Fresh allocations of this size are mmapped and
    page-faulted anew each time; on the VMs we measured that tripled the merge's CPU time."""
    buf = getattr(_SCRATCH, slot, None)
    if buf is None or len(buf) < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        setattr(_SCRATCH, slot, buf)
    return buf[:nbytes]


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.uint8)


class _OutputChunk:
    """Builds and writes one output chunk."""

    def __init__(
        self, src: Storage, plan: Plan, col: PlannedColumn, unit: Unit, offsets: np.ndarray | None,
        checked: set[tuple[int, int]],
    ) -> None:  # fmt: skip
        """``checked``: the ``(segment, block checksum)`` pairs this merge verified already
        (shared by the chunks of one merge; a block checksum covers rows of many chunks)."""
        self.src, self.plan, self.col, self.u, self.off = src, plan, col, unit, offsets
        self.checked = checked

    @property
    def key(self) -> str:
        return f"columns/{self.col.name}/values/c/{self.u.chunk}" + "/0" * len(self.col.unit_shape)

    def write(self, output: Storage, codec: str) -> None:
        col = self.col
        buffers = self._numeric(raw=codec == "none")
        itemsize = np.dtype(col.storage).itemsize
        enc = _codecs.encoder(codec, itemsize)
        if enc is not None:
            whole = buffers[0] if len(buffers) == 1 else np.concatenate([np.frombuffer(b, np.uint8) for b in buffers])
            buffers = [np.frombuffer(enc.encode(whole), dtype=np.uint8)]
        out_crc = 0
        for part in buffers:
            out_crc = google_crc32c.extend(out_crc, part)
        output.makedirs(self.key.rsplit("/", 1)[0])
        output.put(self.key, [*buffers, np.uint32(out_crc).astype("<u4").tobytes()])  # type: ignore[list-item]

    # -- reading source rows -----------------------------------------------------------------

    def _touched(self) -> list[tuple[int, int, int]]:
        """``(row, first unit, one past the last unit)`` in row units of every row with bytes in
        this chunk, in order; rows cut by the chunk's edges included (only kinds with offsets)."""
        lo, hi, src = self.u.lo, self.u.hi, self.col.src
        if self.off is None:
            rows = np.arange(lo, hi)
            rows = rows[src[lo:hi] >= 0]
            return [(r, 0, 1) for r in rows.tolist()]
        off = self.off
        r0 = int(np.searchsorted(off, lo, side="right")) - 1
        r1 = int(np.searchsorted(off, hi, side="left"))
        out = []
        for r in range(r0, r1):
            a, b = int(off[r]), int(off[r + 1])
            if b > a and src[r] >= 0:
                out.append((r, max(lo, a) - a, min(hi, b) - a))
        return out

    def _rows(self, rows: list[int]) -> list[np.ndarray]:
        """The whole stored bytes of each of ``rows`` as uint8 arrays (views of the page cache on
        local disks, else one batched read into a scratch buffer), each checked against its
        CRC-32C. Arrays, not memoryviews: the CRC-32C extension takes only read-only buffers."""
        plan, src = self.plan, self.col.src
        ents = [int(src[r]) for r in rows]
        if self.src.local:
            return self._local_rows(rows, ents)
        sizes = [int(plan.nbytes[e]) for e in ents]
        buf = _scratch(sum(sizes), "rows")
        pieces = []
        for e in ents:
            pieces.extend(data_ranges(plan.segments[int(plan.seg[e])], int(plan.offset[e]), int(plan.nbytes[e])))
        self.src.read_into(pieces, buf.data)
        out, pos = [], 0
        for r, e, n in zip(rows, ents, sizes, strict=True):
            v = buf[pos : pos + n]
            crc = int(plan.crc[e])
            if crc < 0:  # checked by its block: read and verify the block once per merge
                key = (int(plan.seg[e]), crc)
                if key not in self.checked:
                    try:
                        verify_block(self.src, plan.segments[key[0]], crc)
                    except CorruptSpillError:
                        self._mismatch(r, e, crc)
                    self.checked.add(key)
            elif google_crc32c.value(v) != crc:
                self._mismatch(r, e)
            out.append(v)
            pos += n
        return out

    def _local_rows(self, rows: list[int], ents: list[int]) -> list[np.ndarray]:
        """:meth:`_rows` on a local disk: each data chunk object is mapped once per output chunk
        and a row within one object is a slice of it (the many-keys case: millions of small
        rows, where a lookup per row would dominate)."""
        plan = self.plan
        maps: dict[tuple[int, int], np.ndarray] = {}
        out = []
        for r, e in zip(rows, ents, strict=True):
            s, off, n = int(plan.seg[e]), int(plan.offset[e]), int(plan.nbytes[e])
            seg = plan.segments[s]
            cb = seg.chunk_bytes
            c = off // cb
            if n and (off + n - 1) // cb != c:  # the row crosses data chunk objects
                views = [self.src.view(rel, a, b) for rel, a, b in data_ranges(seg, off, n)]
                row = np.concatenate(views)
            else:
                whole = maps.get((s, c))
                if whole is None:
                    whole = maps[(s, c)] = self.src.view(f"{seg.seg.rel}/data/c/{c}", 0, None)
                lo = off - c * cb
                row = whole[lo : lo + n]
                if len(row) != n:  # the object is shorter than the index says
                    self.src.view(f"{seg.seg.rel}/data/c/{c}", lo, lo + n)  # raises TruncatedObjectError
            crc = int(plan.crc[e])
            if crc < 0:  # checked by its block (in one data chunk): verified once per merge
                if (s, crc) not in self.checked:
                    b_off, b_nb, value = check_of(seg, crc)
                    bc, b_lo = divmod(b_off, cb)
                    whole_b = maps.get((s, bc))
                    if whole_b is None:
                        whole_b = maps[(s, bc)] = self.src.view(f"{seg.seg.rel}/data/c/{bc}", 0, None)
                    block = whole_b[b_lo : b_lo + b_nb]
                    if len(block) != b_nb:  # the object is shorter than the checks say
                        self.src.view(f"{seg.seg.rel}/data/c/{bc}", b_lo, b_lo + b_nb)  # raises TruncatedObjectError
                    if google_crc32c.value(block) != value:
                        self._mismatch(r, e, crc)
                    self.checked.add((s, crc))
            elif google_crc32c.value(row) != crc:
                self._mismatch(r, e)
            out.append(row)
        return out

    def _mismatch(self, r: int, e: int, block: int | None = None) -> None:
        """Raise for output row ``r`` (plan entry ``e``) whose bytes, or whose block's bytes
        (``block``: the row's negative CRC), fail their checksum."""
        plan = self.plan
        seg = plan.segments[int(plan.seg[e])]
        where = self.src.describe(f"{seg.seg.rel}/data")
        r = plan.top_row(self.col, r)
        f = int(np.searchsorted(plan.file_offsets, r, side="right")) - 1
        in_block = ""
        if block is not None:
            b_off, b_nb, _ = check_of(seg, block)
            in_block = f" (in the block at bytes {b_off}..{b_off + b_nb}, checked as one)"
        raise CorruptSpillError(
            f"{where}: checksum mismatch for {plan.filenames[f]!r:.200} frame {int(plan.frame_idx[r])} leaf "
            f"{F.path_text(self.col.leaf)!r} at bytes {int(plan.offset[e])}..{int(plan.offset[e] + plan.nbytes[e])}"
            f"{in_block} (rank {seg.seg.rank}): the spill is corrupt; run `spillmerge verify` on the root",
            path=where,
            rank=seg.seg.rank,
        )

    # -- numeric and byte columns -------------------------------------------------------------

    def _numeric(self, *, raw: bool) -> list[Any]:
        """The chunk's bytes (padded to the chunk shape) as buffers written back to back."""
        col, u = self.col, self.u
        ub = col.unit_bytes
        full = u.k * ub
        touched = self._touched()
        data = self._rows([r for r, _, _ in touched])
        if col.kind in ("str", "strlist"):  # text is checked where it becomes output text
            for (r, _, _), row in zip(touched, data, strict=True):
                self._text(r, row)
        buffers: list[Any] = []
        pos = 0  # bytes of the chunk produced so far
        for (r, a, b), row in zip(touched, data, strict=True):
            start = (r - u.lo) * ub if self.off is None else (int(self.off[r]) + a - u.lo) * ub
            if start > pos:  # rows without a value read as zeros
                buffers.append(_zeros(start - pos))
            piece = row if self.off is None else row[a * ub : b * ub]
            buffers.append(piece)
            pos = start + len(piece)
        if pos < full:
            buffers.append(_zeros(full - pos))
        if raw and self.src.local:
            return buffers  # written straight from the page cache, never copied into our memory
        out = _scratch(full)
        p = 0
        for x in buffers:
            n = x.nbytes
            out[p : p + n] = np.frombuffer(x, dtype=np.uint8)
            p += n
        return [out]

    # -- string columns -----------------------------------------------------------------------

    def _text(self, r: int, row: np.ndarray) -> None:
        """Row ``r`` of a ``str`` column is valid UTF-8; of a list-of-``str`` column, ``n`` uint32
        lengths that add up to its size, each string valid UTF-8 (``_format_spill.text_problem``)."""
        count = self._strlist_count(r) if self.col.kind == "strlist" else 0
        bad = FS.text_problem(self.col.kind, count, row)
        if bad is not None:
            self._corrupt(r, bad)

    def _strlist_count(self, r: int) -> int:
        """Strings in row ``r`` of a list-of-``str`` column (its layout's ``shape[0]``)."""
        assert self.col.shapes is not None
        return int(self.col.shapes[r, 0])

    def _corrupt(self, r: int, what: str) -> None:
        plan, e = self.plan, int(self.col.src[r])
        seg = plan.segments[int(plan.seg[e])]
        where = self.src.describe(f"{seg.seg.rel}/data")
        r = plan.top_row(self.col, r)
        f = int(np.searchsorted(plan.file_offsets, r, side="right")) - 1
        raise CorruptSpillError(
            f"{where}: {plan.filenames[f]!r:.200} frame {int(plan.frame_idx[r])} leaf "
            f"{F.path_text(self.col.leaf)!r} (rank {seg.seg.rank}) holds {what}: the spill is corrupt",
            path=where,
            rank=seg.seg.rank,
        )
