"""One output chunk of a column's ``values`` (a :class:`Unit`): its leaf rows read from the spill
chunks, checksum-verified as they are copied (a row's CRC-32C is its check and goes into the
chunk's), and the chunk written whole; :class:`PendingBlocks` completes the block checks whose
rows several chunks copy."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CorruptSpillError, TruncatedObjectError
from .._format import codecs as _codecs
from .._format import common as F
from .._format import crc as _crc
from .._format import lists as _lists
from .._format import spill as FS
from .._spill.root import check_of, corrupt, data_ranges, mismatch, verify_block
from .._storage import Storage
from .plan import Plan


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


_SCRATCH = threading.local()
COPY_ROWS = 1 << 16
"""Rows of one output chunk read and placed at a time (their views: ~100 B each)."""
PIECE_BYTES = 8 << 10
"""Mean row size from which a chunk's rows are written from the page cache as they are, not copied
into one buffer first."""


@dataclass(frozen=True, slots=True)
class _Touched:
    """Rows with bytes in one output chunk: each row's first and one-past-last unit in the chunk
    (relative to the row) and where its piece starts in the chunk's bytes."""

    rows: np.ndarray
    a: np.ndarray
    b: np.ndarray
    start: np.ndarray

    def __getitem__(self, sl: slice) -> _Touched:
        return _Touched(self.rows[sl], self.a[sl], self.b[sl], self.start[sl])


def _scratch(nbytes: int, slot: str = "buf") -> np.ndarray:
    """A per-thread buffer reused across chunks (fresh allocations of this size are mmapped and
    page-faulted anew each time)."""
    buf = getattr(_SCRATCH, slot, None)
    if buf is None or len(buf) < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        setattr(_SCRATCH, slot, buf)
    return buf[:nbytes]


@functools.lru_cache(maxsize=64)
def _zeros_crc(n: int) -> int:
    """The CRC-32C of ``n`` zero bytes (the padding between and after rows: a few sizes)."""
    return int(_crc.value(np.zeros(n, dtype=np.uint8)))


class OutputChunk:
    """Builds and writes one output chunk."""

    def __init__(
        self, src: Storage, plan: Plan, unit: Unit, chunk_bytes: np.ndarray, pending: PendingBlocks
    ) -> None:
        """``chunk_bytes``: each segment's data chunk size, by position in ``plan.segments``;
        ``pending``: shared by the chunks of one merge (a block checksum covers rows of many
        chunks), where rows checked by a block leave their CRC-32C."""
        col = plan.columns[unit.column]
        self.src, self.plan, self.col, self.u, self.off = src, plan, col, unit, col.offsets
        self.chunk_bytes, self.pending, self.checked = chunk_bytes, pending, pending.checked
        self.crc: int | None = None
        """The CRC-32C of the chunk's bytes, when the copy derived it from its rows' (``_pieces``)."""

    def write(self, output: Storage, codec: str, fsync: bool = False) -> None:
        col = self.col
        buffers = self._numeric(raw=codec == "none")
        enc = _codecs.encoder(codec, np.dtype(col.storage).itemsize)
        if enc is not None:
            whole = buffers[0] if len(buffers) == 1 else np.concatenate([np.frombuffer(b, np.uint8) for b in buffers])
            buffers = [np.frombuffer(enc.encode(whole), dtype=np.uint8)]
        # combined from the rows' CRCs when it was (raw bytes): no second read
        out_crc = self.crc if enc is None and self.crc is not None else functools.reduce(_crc.extend, buffers, 0)
        key = f"columns/{col.name}/values/c/{self.u.chunk}" + "/0" * len(col.unit_shape)
        output.makedirs(key.rsplit("/", 1)[0])
        output.put(key, [*buffers, np.uint32(out_crc).astype("<u4").tobytes()], fsync=fsync)  # type: ignore[list-item]

    def check(self) -> None:
        """Read and check the chunk's source rows as ``write`` does, writing nothing."""
        self._numeric(raw=False)

    # -- reading source rows -----------------------------------------------------------------

    def _touched(self) -> _Touched:
        """Every row with bytes in this chunk, in order; rows cut by the chunk's edges included
        (only kinds with offsets). Computed on arrays: a lookup per row in the plan's maps cost
        more than copying the row (docs/SCALE.md)."""
        lo, hi, src, off = self.u.lo, self.u.hi, self.col.src, self.off
        if off is None:
            return self._present(lo, hi)
        r0 = int(off.searchsorted(lo, side="right")) - 1
        r1 = int(off.searchsorted(hi, side="left"))
        rows = np.arange(r0, r1, dtype=np.int64)
        a, b = np.asarray(off[r0:r1]), np.asarray(off[r0 + 1 : r1 + 1])
        keep = (b > a) & (np.asarray(src[r0:r1]) >= 0)
        rows, a, b = rows[keep], a[keep], b[keep]
        first, stop = np.maximum(a, lo), np.minimum(b, hi)
        return _Touched(rows, first - a, stop - a, (first - lo) * self.col.unit_bytes)

    def _rows(self, rows: np.ndarray, crcs_out: list[int] | None = None) -> list[np.ndarray]:
        """The whole stored bytes of each of ``rows`` as uint8 arrays (the CRC-32C extension takes
        no memoryview), each checked against its CRC-32C. On a local disk a row is a slice of its
        data chunk object, mapped once per output chunk (millions of small rows: no lookup per row),
        and ``crcs_out`` gets each row's CRC-32C, computed once for the check and the chunk's CRC (a
        row checked by a block then goes to ``pending``). Elsewhere: one batched read."""
        plan = self.plan
        ent = np.asarray(self.col.src[rows], dtype=np.int64)
        ents, segs, offs, sizes, crcs = (
            x.tolist() for x in (ent, plan.seg[ent], plan.offset[ent], plan.nbytes[ent], plan.crc[ent])
        )
        out = []
        remote, pos = not self.src.local, 0
        if remote:  # the rows are slices of one batched read
            buf = _scratch(sum(sizes), "rows")
            pieces = []
            for s, off, n in zip(segs, offs, sizes, strict=True):
                pieces.extend(data_ranges(plan.segments[s], off, n))
            self.src.read_into(pieces, buf.data)
        maps: dict[tuple[int, int], np.ndarray] = {}
        for r, e, s, off, n, crc in zip(rows.tolist(), ents, segs, offs, sizes, crcs, strict=True):
            seg = plan.segments[s]
            cb = seg.chunk_bytes
            c = off // cb
            if remote:
                row, pos = buf[pos : pos + n], pos + n
            elif n and (off + n - 1) // cb != c:  # the row crosses data chunk objects
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
            v = _crc.value(row) if crcs_out is not None or crc >= 0 else 0
            if crcs_out is not None:  # one CRC of the row: its check and the output's CRC
                crcs_out.append(v)
            if crc >= 0:
                if v != crc:
                    self._mismatch(r, e)
            elif crcs_out is None:  # checked by its block: once per merge
                self.check_block(s, crc, r, e)
            elif (s, crc) not in self.checked:
                self.pending.add(self, s, crc, r, e, off, v, n)
            out.append(row)
        return out

    def check_block(self, s: int, crc: int, r: int, e: int) -> None:
        """Read and check block ``crc`` of segment ``s`` unless checked already; raise naming row
        ``r`` (plan entry ``e``) when it does not match (on a local disk: or is short)."""
        if (s, crc) in self.checked:
            return
        try:
            verify_block(self.src, self.plan.segments[s], crc)
        except CorruptSpillError as exc:
            if self.src.local and isinstance(exc, TruncatedObjectError):
                raise  # a data chunk object shorter than the block: said as such
            self._mismatch(r, e, crc)
        self.checked.add((s, crc))

    def _mismatch(self, r: int, e: int, block: int | None = None) -> None:
        """Raise for output row ``r`` (plan entry ``e``) whose bytes, or whose block's bytes
        (``block``: the row's negative CRC), fail their checksum."""
        plan = self.plan
        seg, row = self._row_where(r, e)
        in_block = ""
        if block is not None:
            b_off, b_nb, _ = check_of(seg, block)
            in_block = f" (in the block at bytes {b_off}..{b_off + b_nb}, checked as one)"
        at = f"{int(plan.offset[e])}..{int(plan.offset[e] + plan.nbytes[e])}"
        raise mismatch(self.src, seg.seg, f"for {row} at bytes {at}{in_block}")

    def _row_where(self, r: int, e: int) -> tuple[Any, str]:
        """For a message about row ``r`` (plan entry ``e``): its segment, and its file, frame and leaf."""
        plan = self.plan
        seg = plan.segments[int(plan.seg[e])]
        offs = {lst.path: lst.offsets for lst in plan.lists}
        r = _lists.top_row(offs, F.list_domain(self.col.leaf), r)
        f = int(plan.file_offsets.searchsorted(r, side="right")) - 1
        row = f"{plan.filenames[f]!r:.200} frame {int(plan.frame_idx[r])} leaf {F.path_text(self.col.leaf)!r}"
        return seg, row

    # -- numeric and byte columns -------------------------------------------------------------

    def _numeric(self, *, raw: bool) -> list[Any]:
        """The chunk's bytes (padded to the chunk shape) as buffers written back to back."""
        col, u = self.col, self.u
        ub = col.unit_bytes
        full = u.k * ub
        if raw and self.src.local and (self.off is not None or u.hi - u.lo <= COPY_ROWS):
            touched = self._touched()
            n = len(touched.rows)
            # Few large rows: written straight from the page cache. Small rows are copied into one
            # buffer below: a write per row costs more than the copy.
            if n <= COPY_ROWS and full >= n * PIECE_BYTES:
                crcs: list[int] = []
                return self._pieces(touched, self._rows(touched.rows, crcs), full, crcs)
        # Many small rows (a chunk of 2**21 int64 labels): copied into one buffer COPY_ROWS rows at
        # a time, so the per-row views never exceed COPY_ROWS.
        out = _scratch(full)
        pos = 0  # bytes of the chunk produced so far
        if self.off is not None:
            touched = self._touched()
            batches = (touched[i : i + COPY_ROWS] for i in range(0, len(touched.rows), COPY_ROWS))
        else:  # built a batch at a time
            batches = (self._present(lo, min(lo + COPY_ROWS, u.hi)) for lo in range(u.lo, u.hi, COPY_ROWS))
        for t in batches:
            placed = self._place_local(t, out, pos) if self.src.local and col.kind != "strlist" else None
            if placed is not None:
                pos = placed
                continue
            data = self._rows(t.rows)  # row by row: the path that says exactly what is wrong
            self._texts(t.rows, data)
            for start, a, b, row in zip(t.start.tolist(), t.a.tolist(), t.b.tolist(), data, strict=True):
                if start > pos:  # rows without a value read as zeros
                    out[pos:start] = 0
                piece = row if self.off is None else row[a * ub : b * ub]
                pos = start + len(piece)
                out[start:pos] = piece
        if pos < full:
            out[pos:full] = 0
        return [out]

    def _place_local(self, t: _Touched, out: np.ndarray, pos: int) -> int | None:
        """Rows ``t`` of a local spill root copied into ``out`` (from byte ``pos`` on, zeros
        between) with numpy: the rows of one data chunk object are checked (checksums, text) as a
        group and copied a run of back-to-back rows at a time; a row that crosses data chunk
        objects is read as the row-by-row way reads it, after the others (so an error names the
        first bad row). Returns the new ``pos``; None when the batch goes the row-by-row way,
        which raises the precise error: a row larger than :data:`PIECE_BYTES` (read whole as a
        view, never copied), an object shorter than the index says, a wrong checksum or string."""
        plan, col = self.plan, self.col
        n = len(t.rows)
        if n == 0:
            return pos
        ub = col.unit_bytes
        e = np.asarray(col.src[t.rows], dtype=np.int64)
        seg, off, nb, crc = (np.asarray(a[e], dtype=np.int64) for a in (plan.seg, plan.offset, plan.nbytes, plan.crc))
        if int(nb.max()) > PIECE_BYTES:
            return None  # large rows: views of the page cache, row by row, never copies of whole rows
        cb = self.chunk_bytes[seg]
        c = off // cb
        across = (nb > 0) & ((off + nb - 1) // cb != c)
        first, size = t.a * ub, (t.b - t.a) * ub  # (a row of a column without offsets: its whole unit)
        start = t.start
        # Groups: one data chunk object each. Its rows, whatever their sizes (token ids and texts
        # have nearly one size a row), are checked together and copied a run at a time: rows
        # back to back both there and in ``out`` are one slice.
        gkey = np.stack([seg, c])
        order = np.lexsort(gkey[::-1])
        sk = gkey[:, order]
        edges = np.flatnonzero(np.any(sk[:, 1:] != sk[:, :-1], axis=0)) + 1
        text = col.kind == "str"
        whole_piece = (first == 0) & (size == nb)  # (rows cut by the chunk's edges: at most two)
        for g in np.split(order, edges):
            s_, c_ = int(seg[g[0]]), int(c[g[0]])
            g = g[(nb[g] > 0) & ~across[g]]  # (an empty row has nothing to check or copy)
            if len(g) == 0:
                continue
            segment = plan.segments[s_]
            whole = self.src.view(f"{segment.seg.rel}/data/c/{c_}", 0, None)
            # (an object shorter than the index says fails the rows' or blocks' checksums below)
            lo, n_g = off[g] - c_ * int(cb[g[0]]), nb[g]
            for i in np.flatnonzero(crc[g] >= 0).tolist():
                a = int(lo[i])
                if _crc.value(whole[a : a + int(n_g[i])]) != int(crc[g[i]]):
                    return None
            for b in np.unique(crc[g][crc[g] < 0]).tolist():
                if (s_, b) not in self.checked:
                    if not self._block_sound(s_, b):
                        return None
                    self.checked.add((s_, b))
            if text:  # a row cut by the chunk's edges is checked whole here, the others once copied
                for i in np.flatnonzero(~whole_piece[g]).tolist():
                    if not _utf8_back_to_back(whole[int(lo[i]) : int(lo[i] + n_g[i])], np.zeros(1, np.int64)):
                        return None
            _copy(whole, lo + first[g], start[g], size[g], out)
        cut = np.flatnonzero(across)
        if len(cut):
            data = self._rows(t.rows[cut])
            self._texts(t.rows[cut], data)
            for i, row in zip(cut.tolist(), data, strict=True):
                out[int(start[i]) : int(start[i] + size[i])] = row[int(first[i]) : int(first[i] + size[i])]
        ends = start + size
        gaps = np.flatnonzero(start > np.concatenate(([pos], ends[:-1])))
        for i in gaps.tolist():  # rows without a value read as zeros
            out[int(ends[i - 1]) if i else pos : int(start[i])] = 0
        # The whole rows as copied, in one check: each row then runs to the next one's start (zeros
        # between are valid UTF-8 and end no character); a row that crosses objects was checked above.
        done = np.flatnonzero(whole_piece & (nb > 0) & ~across)
        if text and len(done):
            a, b = int(start[done[0]]), int(ends[done[-1]])
            if not _utf8_back_to_back(out[a:b], start[done] - a):
                return None
        return int(ends[-1])

    def _block_sound(self, s: int, crc: int) -> bool:
        """Whether the block checksum ``crc`` (negative: a block of rows) of segment ``s`` holds
        on a local spill root: its bytes, a view of their data chunk object, all there and
        matching. The caller says what is wrong when not."""
        segment = self.plan.segments[s]
        b_off, b_nb, value = check_of(segment, crc)
        bc, b_lo = divmod(b_off, segment.chunk_bytes)
        block = self.src.view(f"{segment.seg.rel}/data/c/{bc}", 0, None)[b_lo:][:b_nb]
        return len(block) == b_nb and _crc.value(block) == value

    def _pieces(self, touched: _Touched, data: list[np.ndarray], full: int, crcs: list[int]) -> list[Any]:
        """The chunk as buffers written back to back: the rows' own bytes, zeros between. Sets
        :attr:`crc` from the rows' CRC-32Cs ``crcs`` (a piece cut from a row and the zeros
        are checksummed themselves)."""
        col = self.col
        ub = col.unit_bytes
        self._texts(touched.rows, data)
        buffers: list[Any] = []
        pos = 0  # bytes of the chunk produced so far
        out_crc = 0
        for start, a, b, row, row_crc in zip(
            touched.start.tolist(), touched.a.tolist(), touched.b.tolist(), data, crcs, strict=True
        ):  # fmt: skip
            if start > pos:  # rows without a value read as zeros
                buffers.append(np.zeros(start - pos, dtype=np.uint8))
                out_crc = _crc.combine(out_crc, _zeros_crc(start - pos), start - pos)
            piece = row if self.off is None else row[a * ub : b * ub]
            if len(piece) != len(row):
                row_crc = _crc.value(piece)
            buffers.append(piece)
            out_crc = _crc.combine(out_crc, row_crc, len(piece))
            pos = start + len(piece)
        if pos < full:
            buffers.append(np.zeros(full - pos, dtype=np.uint8))
            out_crc = _crc.combine(out_crc, _zeros_crc(full - pos), full - pos)
        self.crc = out_crc
        return buffers

    def _present(self, lo: int, hi: int) -> _Touched:
        """Rows ``[lo, hi)`` of a column without offsets that have a value, each one unit."""
        rows = lo + np.flatnonzero(np.asarray(self.col.src[lo:hi]) >= 0)
        zero = np.zeros(len(rows), dtype=np.int64)
        return _Touched(rows, zero, zero + 1, (rows - self.u.lo) * self.col.unit_bytes)

    # -- string columns -----------------------------------------------------------------------

    def _texts(self, rows: np.ndarray, data: list[np.ndarray]) -> None:
        """Each row of a ``str`` column is valid UTF-8; of a list-of-``str`` column, ``n`` uint32
        lengths that add up to its size, each string valid UTF-8 (``_format.spill.text_problem``).
        Text is checked where it becomes output text; other kinds have nothing to check here."""
        kind = self.col.kind
        if kind not in ("str", "strlist"):
            return
        if kind == "str" and data:  # one decode of all rows; row by row (to say which) if it fails
            lens = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
            whole = np.concatenate(data) if len(data) > 1 else data[0]
            if _utf8_back_to_back(whole, (np.cumsum(lens) - lens)[lens > 0]):
                return
        for r, row in zip(rows.tolist(), data, strict=True):
            count = 0
            if kind == "strlist":  # its layout's shape[0]
                assert self.col.shapes is not None
                count = int(self.col.shapes[r][0])
            bad = FS.text_problem(kind, count, row)
            if bad is not None:
                seg, what = self._row_where(r, int(self.col.src[r]))
                msg = f"{what} (rank {seg.seg.rank}) holds {bad}: the spill is corrupt"
                raise corrupt(self.src, seg.seg, msg, FS.DATA_NAME)


WINDOW_ROWS = 48
"""Runs of one size from which :func:`_copy` moves them in one numpy copy, not a slice each."""


def _copy(whole: np.ndarray, src: np.ndarray, dst: np.ndarray, n: np.ndarray, out: np.ndarray) -> None:
    """``out[dst:dst + n] = whole[src:src + n]`` for every row (sources and destinations each apart):
    rows back to back in both as one run; many runs of one size (fixed-size rows, short strings)
    by one fancy-indexed copy of windows of that size, the others a memoryview slice each (a
    numpy slice costs twice as much: a row of a few hundred bytes is copied faster than sliced)."""
    cut = np.flatnonzero((src[1:] != src[:-1] + n[:-1]) | (dst[1:] != dst[:-1] + n[:-1])) + 1
    first, last = np.concatenate(([0], cut)), np.append(cut, len(n)) - 1
    xs, ds = src[first], dst[first]
    ns = dst[last] + n[last] - ds
    order = np.argsort(ns, kind="stable")
    sizes, begin, counts = np.unique(ns[order], return_index=True, return_counts=True)
    loose = []
    for w, b, k in zip(sizes.tolist(), begin.tolist(), counts.tolist(), strict=True):
        sel = order[b : b + k]
        if k < WINDOW_ROWS or w == 0:
            loose.append(sel)
            continue
        window = np.lib.stride_tricks.sliding_window_view
        window(out, w, writeable=True)[ds[sel]] = window(whole, w)[xs[sel]]
    if loose:
        sel = np.concatenate(loose)
        om, wm = out.data, whole.data
        for x, d, m in zip(xs[sel].tolist(), ds[sel].tolist(), ns[sel].tolist(), strict=True):
            om[d : d + m] = wm[x : x + m]


def _utf8_back_to_back(whole: np.ndarray, starts: np.ndarray) -> bool:
    """Whether the rows whose bytes are ``whole`` back to back, starting at ``starts`` (those of
    non-empty rows), are each valid UTF-8. Arrow checks each row in C++ without making a Python
    string of them: 4-10x faster than decoding the whole (benchmarks/RESULTS.md)."""
    import pyarrow as pa

    ends = np.append(starts, len(whole)).astype(np.int64)
    rows = pa.Array.from_buffers(pa.large_string(), len(starts), [None, pa.py_buffer(ends), pa.py_buffer(whole)])
    try:
        rows.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


class PendingBlocks:
    """Block checksums verified from the CRC-32Cs of their rows, computed as the rows are copied:
    a block's rows (back to back in one data chunk) often go to several output chunks, so each
    row's CRC waits here until the block is whole, then their combine is compared with the
    block's. Each spill byte is read once by the merge's checks. Blocks never made whole (some
    of their rows are not in this merge) are read and checked by :meth:`finish`."""

    def __init__(self) -> None:
        self.checked: set[tuple[int, int]] = set()
        """The (segment, block checksum) pairs this merge verified already."""
        self._lock = threading.Lock()
        self._blocks: dict[tuple[int, int], tuple[OutputChunk, int, int, dict[int, tuple[int, int]], list[int]]] = {}
        """(segment, block) -> (a chunk job, output row, plan entry: for the error message; the
        rows seen so far: spill offset -> (CRC-32C, nbytes); [their bytes in all])."""

    def add(self, job: OutputChunk, s: int, block: int, r: int, e: int, off: int, crc: int, n: int) -> None:
        """Row ``r`` (plan entry ``e``) of segment ``s``, checked by ``block``, at spill offset
        ``off`` has ``n`` bytes of CRC-32C ``crc``; raise when it makes its block whole and the
        block's CRC does not hold."""
        key = (s, block)
        with self._lock:
            if key in self.checked:
                return
            entry = self._blocks.setdefault(key, (job, r, e, {}, [0]))
            rows, seen = entry[3], entry[4]
            if off not in rows:
                rows[off] = (crc, n)
                seen[0] += n
            b_off, b_nb, value = check_of(job.plan.segments[s], block)
            if seen[0] < b_nb:
                return
            del self._blocks[key]
            got, pos = 0, b_off
            for o in sorted(rows):
                c, m = rows[o]
                if o != pos:  # not the block's rows back to back: read the block itself
                    got = -1
                    break
                got, pos = _crc.combine(got, c, m), pos + m
            if got == value and pos == b_off + b_nb:
                self.checked.add(key)
                return
        job.check_block(s, block, r, e)  # raises, naming the row, when the block is wrong

    def finish(self) -> None:
        """Check the blocks whose rows were not all copied by reading them."""
        for (s, block), (job, r, e, _, _) in sorted(self._blocks.items(), key=lambda kv: kv[0]):
            if (s, block) not in self.checked:
                job.check_block(s, block, r, e)
        self._blocks.clear()
