"""The merge plan out of core: the same :class:`~spillmerge._plan.Plan` as ``_plan.build``, built
with memory bounded by a budget whatever the number of rows and files (docs/ARCHITECTURE.md,
*Memory*; docs/SCALE.md).

Everything that grows with rows or files lives in files of a private work folder on local disk
(``MergeOptions.plan_dir``, default the system's temporary folder), mapped with ``np.memmap``:
the plan's arrays are those maps, so the copy and the index writer read them a block at a time
and the operating system pages them in and out. The folder is removed when the merge ends,
successful or not (:meth:`DiskPlan.close`); it is never inside the output.

Steps (each holds at most one segment's catalog and index, or one block of rows, in memory):

1. *Runs*: each segment in turn is loaded; its filenames are sorted (code point order = UTF-8
   byte order, lone surrogates included) into a name run, its index rows ordered by filename
   into an entry run (``sort_run``). Only the segment's record stays in memory. In a merge in
   parts, the other parts build and publish the runs of their share of the segments
   (``_planruns``) and this step builds only the runs it is not given; the global layout ids
   are numbered after it, in write order.
2. *Names*: the name runs are merged, in rounds of a bounded number of names, into the sorted
   distinct filenames of the merge (a string table on disk); each run gets the map of its names
   to global file ids, which is increasing, so each entry run stays ordered by global file id.
3. *Pass 1*, per block of whole files (at most ``block_entries`` index rows unless one file has
   more): the entries of every run in the block, in segment order — exactly the slice of the
   in-memory plan's table — have their duplicates resolved and dtypes checked by ``_plan``'s own
   functions and are written, in row order, as the row table and the per-row index arrays.
4. *Columns*: the dtype codes of every leaf decide the columns (globally, as ``_plan``); pass 2
   writes each column's source rows and each file's column set; pass 3 each column's counts,
   shapes and offsets.

A block is a run of whole files and a key's copies are all in its file's block, so duplicates,
per-file dtype checks and rows are the in-memory plan's: the output is byte-identical
(tests/test_plan_disk.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, overload

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from . import _format as F
from . import _format_spill as FS
from . import _plan as P
from ._concat import concat, concat_offsets
from ._errors import CorruptSpillError, SpillValueError
from ._fetched import prefetch
from ._spillroot import LoadedSegment
from ._zarrmeta import NAME_BLOCK

#: Bytes one index row costs in a pass-1 block (the table's columns and the sorts' temporaries).
ENTRY_BYTES = 400

#: Rows per block of the passes over per-row arrays (pass 3, the fingerprint, the index writer).
ROW_BLOCK = P.ROW_BLOCK

#: Bytes of the names' keys one round of step 2 holds, all runs together (``_merge_names``).
NAMES_ROUND_BYTES = 32 << 20

#: Threads that check pass 1's blocks at most (fewer on fewer cores).
PLAN_THREADS = 4

#: Ranges of filenames a plan is built in when ``build`` is not told (``_Builder.run``). One:
#: until the parts of a merge plan a range each, ranges in one process only cost a little.
RANGES = 1

#: Names sampled from each run for the splitters of a plan in ranges (at equal steps of its entries).
SPLIT_SAMPLE = 1024

#: Names a search for a range's first name in a run reads in one block (``_lower_bound``).
_SEARCH_BLOCK = 4096

_I8 = np.dtype("<i8")


def _narrow(n_layouts: int, n_dtypes: int) -> dict[str, np.dtype[Any]]:
    """Dtypes of pass 1's entry arrays that only this module reads, in fewer bytes than int64
    when the ids fit (less to write and read back: ~0.4 GB at 10^7 keys): layout and leaf-path
    ids (at most one per layout), dtype codes (one per dtype name, -1 for none)."""
    ids = np.dtype("<i4") if n_layouts < 2**31 else _I8
    return {"gl": ids, "lp": ids, "code": np.dtype("<i2") if n_dtypes < 2**15 else _I8}


#: glibc's ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (malloc.h) and its documented
#: default value: buffers of this size or more get their own mapping, unmapped when freed.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 128 * 1024


def map_large_buffers() -> None:
    """Make the C heap serve buffers of 128 KiB or more from their own mappings for the rest of
    the process (glibc ``mallopt(M_MMAP_THRESHOLD, 128 KiB)``; on other C libraries nothing).

    Why: glibc's threshold is dynamic by default. The first free of a large mapped buffer raises
    it to that buffer's size (up to 32 MiB), and from then on buffers below it come from the heap,
    whose free chunks between live ones are neither returned nor always reused. Step 1 allocates
    and frees, segment after segment, buffers of 2-36 MB (a catalog's bytes, the index, its sorts),
    so the heap fragmented and the process's resident memory crept up with the number of
    segments: the merge peak at 10^7 keys in 40 sessions was 1.11-1.14x that at 10^6 in 4 (issue
    24; ``malloc_trim`` after each segment removed only half of it). Setting the threshold fixes
    it at glibc's default value and turns the dynamic rise off: each large buffer is unmapped when
    freed, and step 1's peak no longer depends on how many segments came before (a later step
    still grows: the whole merge's peak at 10^7 keys is 1.17x that at 10^6, docs/SCALE.md).

    Only the out-of-core plan sets it: merges large enough that their memory bound matters. Once
    the plan is built, :func:`reuse_heap` sets the thresholds glibc's dynamic rule would have
    reached (glibc cannot turn the rule back on)."""
    _mallopt((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))


#: ``M_TRIM_THRESHOLD`` and the values :func:`reuse_heap` sets: glibc's largest dynamic mmap
#: threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB) and twice that for the
#: trim threshold, as the dynamic rule sets it.
_M_TRIM_THRESHOLD = -1
_REUSE = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 64 << 20))


def reuse_heap() -> None:
    """After the plan (``build``): buffers up to 32 MiB come from the heap again and freed heap
    memory is kept up to 64 MiB, as glibc's dynamic thresholds would be by then. With
    :func:`map_large_buffers`' 128 KiB left set, every buffer of the copy that follows was mapped,
    faulted in and unmapped, and the trim threshold stayed at 128 KiB: a part's copy at 10^7 keys
    took 6.0-6.4 s against 4.3-4.6 s without (issue 24, docs/SCALE.md)."""
    _mallopt(*_REUSE)


def _mallopt(*settings: tuple[int, int]) -> None:
    """glibc ``mallopt`` of each ``(parameter, value)``; nothing on other C libraries."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    for param, value in settings:
        mallopt(param, value)


class StringTable(Sequence[str]):
    """Strings in a file of UTF-8 bytes (``surrogatepass``) and an int64 offsets map: a
    ``Sequence[str]`` that holds none of them in memory."""

    def __init__(
        self, data: np.ndarray, offsets: np.ndarray, heads: tuple[int, np.ndarray, np.ndarray] | None = None
    ) -> None:
        self._data, self._off = data, offsets
        self._heads = heads
        """``(block, bytes, offsets)`` of every ``block``-th string, when the planner made them
        (a plan in ranges: each range's, so no process reads every string for them)."""

    def __len__(self) -> int:
        return len(self._off) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(a, b, step)]
            return self.block(a, b)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return bytes(self._data[int(self._off[i]) : int(self._off[i + 1])]).decode("utf-8", "surrogatepass")

    def block(self, a: int, b: int) -> list[str]:
        """Strings ``a .. b-1``, decoded in one go."""
        off = np.asarray(self._off[a : b + 1])
        raw = bytes(self._data[int(off[0]) : int(off[-1])]) if b > a else b""
        rel = (off - off[0]).tolist()
        return [raw[rel[j] : rel[j + 1]].decode("utf-8", "surrogatepass") for j in range(b - a)]

    def raw(self) -> tuple[np.ndarray, np.ndarray]:
        """The UTF-8 bytes of every string back to back and the int64 offsets (n + 1)."""
        return self._data, self._off

    def encoded(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """The UTF-8 bytes of strings ``a .. b-1`` and their lengths, without decoding."""
        off = np.asarray(self._off[a : b + 1])
        return np.asarray(self._data[int(off[0]) : int(off[-1])]), np.diff(off)

    def index_arrays(self, block: int) -> dict[str, np.ndarray]:
        """``_zarrmeta.filename_arrays`` of these (sorted) names without decoding them: the bytes
        and offsets are the table's own maps; the heads are every ``block``-th name."""
        if self._heads is not None and self._heads[0] == block:
            return {"filenames": self._data, "filename_offsets": self._off, "filename_heads": self._heads[1],
                    "filename_head_offsets": self._heads[2]}  # fmt: skip
        heads = [bytes(self._data[int(self._off[i]) : int(self._off[i + 1])]) for i in range(0, len(self), block)]
        hoff = np.zeros(len(heads) + 1, dtype=np.int64)
        np.cumsum([len(h) for h in heads], out=hoff[1:])
        return {
            "filenames": self._data,
            "filename_offsets": self._off,
            "filename_heads": np.frombuffer(b"".join(heads), dtype=np.uint8),
            "filename_head_offsets": hoff,
        }

    def __iter__(self) -> Iterator[str]:
        for a in range(0, len(self), ROW_BLOCK):
            yield from self.block(a, min(a + ROW_BLOCK, len(self)))

    def search(self, name: str) -> int:
        """Position of ``name`` in this sorted table, or -1."""
        key = name.encode("utf-8", "surrogatepass")
        lo, hi = 0, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            v = bytes(self._data[int(self._off[mid]) : int(self._off[mid + 1])])
            if v < key:
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < len(self) and self[lo] == name else -1


def _check_sorted(run: Run, keys: np.ndarray, before: Any) -> None:
    """A published run's names (after the key ``before``) strictly increase, as the k-way merge
    needs; ``keys`` as :func:`name_keys` makes them."""
    if (before is not None and len(keys) and not before < keys[0]) or not np.all(keys[1:] > keys[:-1]):
        raise DamagedRun(f"{run.source}: its filenames are not sorted and distinct", path=run.source)


def name_keys(raw: np.ndarray, lens: np.ndarray, width: int) -> np.ndarray:
    """Fixed-width keys that order as the names' bytes do: each name's UTF-8 bytes padded with
    zero bytes to ``width`` (at least the longest name), then its length in 4 big-endian bytes,
    as a numpy ``S`` array, whose comparisons and sorts are bytewise over the whole width. The
    length breaks the tie of a name and the same name followed by zero bytes, and sorts the
    shorter first, as bytes do. ``raw``: the names back to back; ``lens``: their lengths."""
    n = len(lens)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    mat = np.empty((n, width + 4), dtype=np.uint8)
    body = mat[:, :width]
    body[:] = sliding_window_view(np.concatenate([raw, np.zeros(width, np.uint8)]), width)[starts]
    body[np.arange(width) >= lens[:, None]] = 0
    mat[:, width:] = lens.astype(">u4").view(np.uint8).reshape(n, 4)
    return mat.reshape(-1).view(f"S{width + 4}")


def key_names(keys: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The names back to back and their int64 lengths, from :func:`name_keys`' ``keys``."""
    mat = np.ascontiguousarray(keys).view(np.uint8).reshape(-1, width + 4)
    lens = mat[:, width:].copy().view(">u4").reshape(-1).astype(np.int64)
    return mat[:, :width][np.arange(width) < lens[:, None]], lens


class WorkFolder:
    """The private work folder: append-only arrays, then maps of them."""

    def __init__(self, parent: str | None) -> None:
        if parent is not None:
            os.makedirs(parent, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix=f"spillmerge-plan-{os.getpid()}-", dir=parent)
        self._files: dict[str, Any] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def append(self, name: str, a: np.ndarray) -> None:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.path(name), "wb")  # noqa: SIM115 - closed in done()
        f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # no copy of the bytes first

    def done(self, name: str, dtype: Any, shape_tail: tuple[int, ...] = ()) -> np.ndarray:
        """The array appended to ``name``, mapped read-only (an empty array when nothing was)."""
        f = self._files.pop(name, None)
        if f is not None:
            f.close()
        return self.map(name, dtype, shape_tail)

    def map(self, name: str, dtype: Any, shape_tail: tuple[int, ...] = (), *, mode: str = "r") -> np.ndarray:
        dt = np.dtype(dtype)
        p = self.path(name)
        size = os.path.getsize(p) if os.path.exists(p) else 0
        per = dt.itemsize * int(np.prod(shape_tail, dtype=np.int64))
        if size == 0 or per == 0:
            return np.zeros((0, *shape_tail), dtype=dt)
        return np.memmap(p, dtype=dt, mode=mode, shape=(size // per, *shape_tail))  # type: ignore[call-overload]

    def zeros(self, name: str, dtype: Any, shape: tuple[int, ...], fill: int = 0) -> np.ndarray:
        """A new writable map of ``shape`` filled with ``fill``."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        if n == 0:
            return np.full(shape, fill, dtype=dt)
        with open(self.path(name), "wb") as f:
            f.truncate(n * dt.itemsize)
        out = np.memmap(self.path(name), dtype=dt, mode="r+", shape=shape)
        if fill:
            for a in range(0, shape[0], ROW_BLOCK):
                out[a : a + ROW_BLOCK] = fill
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class SegmentSource:
    """A segment the plan loads when it gets to it (in write order)."""

    load: Callable[[], LoadedSegment]
    """Reads and validates its catalog and index."""


@dataclass(frozen=True, slots=True)
class Run:
    """One segment's entries on disk, ordered by filename."""

    names: StringTable
    """The segment's filenames, sorted."""
    file: np.ndarray
    """Position of each entry's filename in ``names`` (non-decreasing)."""
    frame: np.ndarray
    gl: np.ndarray
    """The segment's own layout id (catalog position; the plan's ``lmaps`` give the global one)."""
    off: np.ndarray
    nb: np.ndarray
    crc: np.ndarray
    gmap: np.ndarray
    """Global file id of each of ``names`` (filled in step 2; increasing)."""
    sample: Sample
    """What the splitters and the searches for a range's span read of the run."""
    source: str | None = None
    """Where another process published it (``_planruns``), whose names step 2 checks are sorted
    and distinct; None: built here."""
    check: Callable[[int, int, int, int], None] | None = None
    """A published run's checks of the names ``na .. nb-1`` and entries ``ea .. eb-1`` a range
    of the plan reads (``DamagedRun``), made when the range is planned; None: built here."""


@dataclass(frozen=True, slots=True)
class Sample:
    """Every ``step``-th entry of a run (entries 0, step, 2 step ...; ``step`` = its entries //
    ``SPLIT_SAMPLE``, at least 1): their filename ids and those names, and the run's longest
    name. The splitters are the sample's names, and a range's span in the run is searched
    between two samples, so a part reads of another part's published run (its ``run.json``
    holds the sample) only the spans of its own range (docs/SCALE.md, *The plan in ranges*)."""

    step: int
    files: np.ndarray
    """The filename id of each sampled entry (int64)."""
    raw: np.ndarray
    """Their names' UTF-8 bytes back to back (uint8)."""
    lens: np.ndarray
    """Their names' lengths (int64)."""
    width: int
    """The run's longest name, in bytes (0: no names)."""

    @classmethod
    def of(cls, names: StringTable, file: np.ndarray) -> Sample:
        step = max(1, len(file) // SPLIT_SAMPLE)
        files = np.asarray(file[::step], dtype=np.int64)
        data, off = names.raw()
        starts, ends = np.asarray(off[files]), np.asarray(off[files + 1])
        parts = [np.asarray(data[a:b]) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        raw = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        width = 0
        for a in range(0, len(off) - 1, ROW_BLOCK):
            width = max(width, int(np.diff(np.asarray(off[a : a + ROW_BLOCK + 1])).max()))
        return cls(step, files, raw.astype(np.uint8, copy=False), (ends - starts).astype(np.int64), width)

    def to_obj(self) -> dict[str, Any]:
        return {"step": self.step, "files": self.files.tolist(), "names": self.raw.tobytes().hex(),
                "lens": self.lens.tolist(), "width": self.width}  # fmt: skip

    @classmethod
    def from_obj(cls, o: Any, n_files: int, n_rows: int) -> Sample:
        """From a run's record, checked to fit a run of ``n_files`` names and ``n_rows`` entries
        (``ValueError`` else). That it is the run's own sample is checked by each range's planner
        for the entries of its span (``_planruns``)."""
        step, width = _int(o["step"]), _int(o["width"])
        files = np.array(_ints(o["files"]), dtype=np.int64)
        lens = np.array(_ints(o["lens"]), dtype=np.int64)
        if not isinstance(o["names"], str):
            raise ValueError("names is not a string")
        raw = np.frombuffer(bytes.fromhex(o["names"]), dtype=np.uint8)
        if step != max(1, n_rows // SPLIT_SAMPLE) or len(files) != -(-n_rows // step) or len(lens) != len(files):
            raise ValueError("the sample does not fit the run's entries")
        if not 0 <= width <= F.FILENAME_MAX_BYTES or (n_files and width < 1):
            raise ValueError(f"width {width} is out of range")
        if len(files) and (files.min() < 0 or files.max() >= n_files or np.any(np.diff(files) < 0)):
            raise ValueError("the sampled filename ids are out of order or out of range")
        if len(lens) and (lens.min() < 0 or lens.max() > width) or int(lens.sum()) != len(raw):
            raise ValueError("the sampled names' lengths disagree with their bytes")
        return cls(step, files, raw, lens, width)

    def keys(self, width: int) -> np.ndarray:
        """:func:`name_keys` of the sampled names."""
        return name_keys(self.raw, self.lens, width)


@dataclass
class DiskPlan:
    """An out-of-core plan and the work folder its arrays live in."""

    plan: P.Plan
    work: WorkFolder
    taken: int = 0
    """Segments whose runs another process built (``RunSource``)."""
    exchange: RangeExchange | None = None
    """Where the other ranges' pieces came from (a plan in ranges of a merge in parts)."""

    def close(self) -> None:
        """Remove the work folder (after the merge, whatever its outcome)."""
        try:
            self.work.close()
        finally:
            if self.exchange is not None:
                self.exchange.close()


def estimate_bytes(n_rows: int, n_files: int) -> int:
    """Memory ``_plan.build`` needs for ``n_rows`` index rows naming ``n_files`` filenames (summed
    over segments): measured ~814 B per one-frame key of three leaves (issue 24)."""
    return 260 * n_rows + 120 * n_files


def build(
    sources: Sequence[SegmentSource], on_duplicate: str, *, same_bytes: P.SameBytes, budget: int,
    work_dir: str | None = None, shared: RunSource | None = None, ranges: int | None = None,
    exchange: RangeExchange | None = None,
) -> DiskPlan:  # fmt: skip
    """The plan of ``sources`` (in write order), equal to ``_plan.build`` of the loaded segments,
    holding at most about ``budget`` bytes (plus one segment's catalog and index) in memory.
    ``shared``: runs other processes built, used instead of building them here. ``ranges``:
    ranges of filenames planned apart (``_Builder.run``; default ``RANGES``); the plan is the
    same for any. ``exchange``: where other processes plan the other ranges (``_Builder.run``);
    the plan keeps it and closes it with its work folder."""
    if on_duplicate not in ("error", "first", "last"):
        raise SpillValueError(f"on_duplicate must be 'error', 'first' or 'last', got {on_duplicate!r}")
    if not isinstance(budget, int) or budget < 1:
        raise SpillValueError(f"plan_budget must be a positive int, got {budget!r}")
    work = WorkFolder(work_dir)
    try:
        builder = _Builder(work, max(1, budget // ENTRY_BYTES), on_duplicate, same_bytes)
        plan = builder.run(sources, shared, RANGES if ranges is None else ranges, exchange)
        reuse_heap()
        return DiskPlan(plan, work, builder.taken, exchange)
    except BaseException:
        work.close()  # nothing of a failed plan stays on disk
        if exchange is not None:
            exchange.close()
        raise


def sort_run(work: WorkFolder, tag: str, s: LoadedSegment) -> Run:
    """Step 1 for one loaded segment: its filenames sorted (code point order = UTF-8 byte order,
    lone surrogates included) into a name run, its index rows ordered by filename into an entry
    run, both appended to ``work`` under names starting with ``tag``. ``gl`` holds the segment's
    own layout ids (catalog positions): the plan maps them to global ids once every segment's
    layouts are known, so a run does not depend on the segments before it (parts build them
    for part 0, ``_planruns``)."""
    idx = s.index
    enc = [f.encode("utf-8", "surrogatepass") for f in s.filenames]
    order = sorted(range(len(enc)), key=enc.__getitem__)
    rank_of = np.empty(len(enc), dtype=np.int64)
    rank_of[np.array(order, dtype=np.int64)] = np.arange(len(enc), dtype=np.int64)
    lens = np.fromiter((len(enc[i]) for i in order), dtype=np.int64, count=len(order))
    off = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    work.append(f"{tag}.names", np.frombuffer(b"".join(enc[i] for i in order), dtype=np.uint8))
    work.append(f"{tag}.noff", off)
    del enc, order
    f = rank_of[idx[:, FS.COL_FILE]]
    eo = np.argsort(f, kind="stable")
    for name, col in (
        ("file", f),
        ("frame", idx[:, FS.COL_FRAME]),
        ("gl", idx[:, FS.COL_LAYOUT]),
        ("off", idx[:, FS.COL_OFFSET]),
        ("nb", idx[:, FS.COL_NBYTES]),
        ("crc", idx[:, FS.COL_CRC]),
    ):
        work.append(f"{tag}.{name}", col[eo])
    names = StringTable(work.done(f"{tag}.names", np.uint8), work.done(f"{tag}.noff", _I8))
    c = {k: work.done(f"{tag}.{k}", _I8) for k in RUN_COLUMNS}
    gmap = work.zeros(f"{tag}.gmap", _I8, (len(names),))
    sample = Sample.of(names, c["file"])
    return Run(names, c["file"], c["frame"], c["gl"], c["off"], c["nb"], c["crc"], gmap, sample)


#: The per-entry columns of a run, in the order of the ``Run`` fields.
RUN_COLUMNS = ("file", "frame", "gl", "off", "nb", "crc")


def record_of(s: LoadedSegment) -> LoadedSegment:
    """What the plan keeps of a loaded segment: its record, not its catalog's filenames and its
    index (the copy needs its folder, chunk size, layouts and block checksums only)."""
    return replace(s, filenames=[], index=np.zeros((0, FS.INDEX_COLUMNS), np.int64))


class RunSource:
    """Runs of some segments built by another process (``_planruns``: the other parts of a merge
    in parts). The plan builds its own share first, then asks for the others, last first, and
    builds any it is not given itself, so it never waits for one."""

    def elsewhere(self, si: int) -> bool:
        """Whether segment ``si`` (write order) is another process's to build."""
        raise NotImplementedError

    def take(self, si: int, work: WorkFolder, tag: str) -> tuple[LoadedSegment, Run] | None:
        """Segment ``si``'s record and run if they were built (checked), else None."""
        raise NotImplementedError

    def built(self, si: int, record: LoadedSegment, run: Run) -> None:
        """Segment ``si``'s run was built here (to publish it for others, if they need it)."""

    def coming(self, sis: Sequence[int]) -> None:
        """The plan will ask for the runs of segments ``sis`` next, in that order (to fetch what
        it can of them at once)."""

    reuse = False
    """Whether a run of this process's own share is taken when it was published (by an earlier
    run of the same part) rather than built again."""


class _Builder:
    def __init__(self, work: WorkFolder, block_entries: int, on_duplicate: str, same_bytes: P.SameBytes) -> None:
        self.work, self.block_entries = work, block_entries
        self.on_duplicate, self.same_bytes = on_duplicate, same_bytes
        self.layouts: list[FS.Layout] = []
        self.segments: list[LoadedSegment] = []
        self.runs: list[Run] = []
        self.lmaps: list[np.ndarray] = []
        """Each run's map of its segment's layout ids to global ones."""
        self.taken = 0
        """Runs another process built (``RunSource.take``)."""
        self._keys: dict[int, np.ndarray] = {}
        """Each run's sample as :func:`name_keys` (``_sample_keys``)."""
        self._seen: dict[FS.Layout, None] = {}
        self.workers = max(1, min(PLAN_THREADS, os.cpu_count() or 1))
        """Threads that check pass 1's blocks (``_in_order``); each block is a 1/workers share."""

    # -- step 1: runs -------------------------------------------------------------------------

    def _runs(self, sources: Sequence[SegmentSource], shared: RunSource | None) -> None:
        n = len(sources)
        segments: list[LoadedSegment | None] = [None] * n
        runs: list[Run | None] = [None] * n

        def add(si: int, record: LoadedSegment, run: Run) -> None:
            segments[si], runs[si] = record, run
            if len(run.file):  # ``_plan.build`` skips an empty segment's layouts too
                self._seen.update(dict.fromkeys(record.layouts))
            # Decided by the layouts alone, and a layout never leaves: known after the first
            # segment that has it, before the other segments are sorted into runs for nothing.
            why = in_memory_only(list(self._seen))
            if why is not None:
                raise InMemoryOnly(why)

        def build(si: int) -> None:
            s = sources[si].load()
            record, run = record_of(s), sort_run(self.work, f"s{si}", s)
            add(si, record, run)
            if shared is not None:
                shared.built(si, record, run)

        later = []
        for si in range(n):
            if shared is not None and shared.elsewhere(si):
                later.append(si)
            elif shared is not None and shared.reuse and (got := shared.take(si, self.work, f"s{si}")) is not None:
                add(si, *got)  # its own, published by an earlier run of this process's part
            else:
                build(si)
        if shared is not None and later:
            shared.coming(later[::-1])
        for si in reversed(later):  # last first: a part still building its share starts at its first
            got = shared.take(si, self.work, f"s{si}") if shared is not None else None
            if got is None:
                build(si)
            else:
                self.taken += 1
                add(si, *got)
        # Global layout ids in write order, as ``_plan.build`` numbers them.
        gl_id: dict[FS.Layout, int] = {}
        for record, run in zip(segments, runs, strict=True):
            assert record is not None and run is not None
            for lay in record.layouts if len(run.file) else []:
                if lay not in gl_id:
                    gl_id[lay] = len(self.layouts)
                    self.layouts.append(lay)
            self.lmaps.append(np.array([gl_id.get(lay, -1) for lay in record.layouts], dtype=np.int64))
            self.segments.append(record)
            self.runs.append(run)

    # -- step 2: names ------------------------------------------------------------------------

    def _merge_names(self, tag: str, spans: list[tuple[int, int, int, int, int]], width: int, lo: Any, hi: Any) -> StringTable:
        """Sorted distinct filenames of one range: names ``na .. nb-1`` of each run ``si`` in
        ``spans`` (``si, na, nb, ...``); fills those names' ids (counted from 0 in the range) in
        each run's ``gmap``. A published run's names are checked sorted, distinct and inside the
        range's keys ``lo`` (included) to ``hi`` (excluded; None: open).

        In rounds: each run holds its next names read (at most an equal share of
        ``min(block_entries, ROW_BLOCK // 4)`` names and of ``NAMES_ROUND_BYTES`` of keys, topped
        up once half of it is taken); every held name up to the smallest last held name of a run that
        has more is taken (a name equal to it is taken from every run in the same round, so a
        name never spans two rounds); the round's names are sorted together and given the next
        ids. Names are held as :func:`name_keys` (fixed width, the longest name's), so a
        round is a few numpy calls, not Python per name (4.6 s of part 0's plan at 10^7 keys,
        issue 24). Memory depends on neither the number of runs nor of names: a ``heapq``
        merge of one tuple per name, with Python lists of every id pending, made the 10^7-key
        plan's peak 1.14x the 10^6 one (issue 24)."""
        w = self.work
        live = [(self.runs[si], na, nb) for si, na, nb, _ea, _eb in spans if nb > na]
        per_round = min(ROW_BLOCK // 4, self.block_entries, max(1, NAMES_ROUND_BYTES // (width + 4)))
        share = max(1, per_round // max(1, len(live)))
        empty = np.zeros(0, dtype=f"S{width + 4}")
        held = [empty] * len(live)  # keys read, not yet taken
        last: list[Any] = [None] * len(live)  # each run's last key read: where the next read must start above
        first = [na for _r, na, _nb in live]  # name of each run's first held key
        n_names = 0
        while True:
            bound: Any = None  # the smallest last held key of a run with more to read
            for i, (r, na, nb) in enumerate(live):
                h = len(held[i])
                b = first[i] + h  # the run's next name not read yet
                if h <= share // 2 and b < nb:  # topped up, so that no run holds few and makes the round small
                    raw, lens = r.names.encoded(b, min(b + share - h, nb))
                    keys = name_keys(raw, lens, width)
                    if r.source is not None:
                        _check_sorted(r, keys, last[i])
                        if (b == na and lo is not None and keys[0] < lo) or (
                            b + len(keys) == nb and hi is not None and not keys[-1] < hi
                        ):
                            raise DamagedRun(f"{r.source}: its filenames are not sorted and distinct", path=r.source)
                    last[i] = keys[-1]
                    held[i] = np.concatenate([held[i], keys]) if h else keys
                    b += len(keys)
                if len(held[i]) and b < nb and (bound is None or held[i][-1] < bound):
                    bound = held[i][-1]
            taken: list[np.ndarray] = []
            takes: list[tuple[int, int, int]] = []  # run, first in pool, count
            pos = 0
            for i, got in enumerate(held):
                k = len(got) if bound is None else int(np.searchsorted(got, bound, side="right"))
                if k:
                    takes.append((i, pos, k))
                    taken.append(got[:k])
                    held[i] = got[k:]
                    pos += k
            if not taken:
                break
            pool = np.concatenate(taken)
            order = np.argsort(pool, kind="stable")
            srt = pool[order]
            new = np.ones(len(srt), dtype=bool)
            new[1:] = srt[1:] != srt[:-1]
            ids = np.empty(len(pool), dtype=np.int64)
            ids[order] = np.cumsum(new) - 1 + n_names
            data, lens = key_names(srt[new], width)
            w.append(f"{tag}.names", data)
            w.append(f"{tag}.nlen", lens)
            n_names += len(lens)
            for i, p, k in takes:
                live[i][0].gmap[first[i] : first[i] + k] = ids[p : p + k]
                first[i] += k
        nlen = w.done(f"{tag}.nlen", _I8)
        off = w.zeros(f"{tag}.noff", _I8, (len(nlen) + 1,))
        if len(nlen):
            np.cumsum(nlen, out=off[1:])
        return StringTable(w.done(f"{tag}.names", np.uint8), off)

    # -- step 3: pass 1 -----------------------------------------------------------------------

    def _blocks(
        self, n_files: int, spans: list[tuple[int, int, int, int, int]]
    ) -> Iterator[tuple[int, int, list[tuple[int, int, int]]]]:
        """``(first file, one past the last, [(run, entry lo, entry hi)])`` of each block of whole
        files of one range (``spans``: each run's ``si, na, nb, ea, eb``, its names and entries
        in the range) holding at most ``block_entries`` entries (more only when one file alone
        has more). Files are the range's ids (``gmap``)."""
        cur = {si: ea for si, _na, _nb, ea, _eb in spans}  # next entry of each run
        g = 0
        share = max(1, self.block_entries // self.workers // max(1, len(spans)))
        while g < n_files:
            # The block ends below the file at which some run's share ends, so no run gives more.
            end = n_files
            for si, _na, _nb, _ea, eb in spans:
                e = cur[si] + share
                if e < eb:
                    r = self.runs[si]
                    end = min(end, int(r.gmap[int(r.file[e])]))
            if end <= g:  # one file holds more than a share of some run: it is a block alone
                end = g + 1
            out = []
            for si, na, nb, ea, eb in spans:
                r, a = self.runs[si], cur[si]
                local_end = na + int(np.searchsorted(r.gmap[na:nb], end, side="left"))
                b = ea + int(np.searchsorted(r.file[ea:eb], local_end, side="left"))
                out.append((si, a, b))
                cur[si] = b
            yield g, end, out
            g = end

    def _entries(self, spans: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
        """The block's entries in segment order (the in-memory table's order)."""
        c: dict[str, list[np.ndarray]] = {k: [] for k in ("file", "frame", "lp", "gl", "seg", "off", "nb", "crc")}
        for si, a, b in spans:
            if b <= a:
                continue
            r = self.runs[si]
            gl = self.lmaps[si][np.asarray(r.gl[a:b])]
            c["file"].append(np.asarray(r.gmap)[np.asarray(r.file[a:b])])
            c["frame"].append(np.asarray(r.frame[a:b]))
            c["lp"].append(self.pmap[gl])
            c["gl"].append(gl)
            c["seg"].append(np.full(b - a, si, dtype=np.int64))
            c["off"].append(np.asarray(r.off[a:b]))
            c["nb"].append(np.asarray(r.nb[a:b]))
            c["crc"].append(np.asarray(r.crc[a:b]))
        if not c["file"]:
            return {k: np.zeros(0, np.int64) for k in c}
        return {k: np.concatenate(v) for k, v in c.items()}

    # -- the plan in ranges of filenames ------------------------------------------------------

    def run(
        self, sources: Sequence[SegmentSource], shared: RunSource | None = None, ranges: int = 1,
        exchange: RangeExchange | None = None,
    ) -> P.Plan:  # fmt: skip
        """The plan: step 1 (runs), then the filenames split into ``ranges`` ranges by
        :meth:`_splitters`, each planned on its own in three phases that exchange only small
        summaries (docs/SCALE.md, *The plan in ranges*): A, the range's names and pass 1 (its
        files, entries and rows, numbered from 0); B, pass 2 once every range's dtype codes
        decided the columns; C, the range's per-row and per-file arrays once every range's
        column counts and layouts are known. The plan's arrays are the ranges' pieces back to
        back (``_concat``): the same values, whatever ``ranges`` is.

        ``exchange``: where the other processes planning the other ranges (the parts of a merge,
        ``_planranges``) publish their summaries and pieces, and this one its own; a range whose
        planner is gone is planned here. None: every range here."""
        map_large_buffers()
        self._runs(sources, shared)
        self.leaf_paths = sorted({lay.leaf for lay in self.layouts})
        lp_id = {p: i for i, p in enumerate(self.leaf_paths)}
        self.pmap = np.array([lp_id[lay.leaf] for lay in self.layouts], dtype=np.int64)
        if not any(len(r.file) for r in self.runs):
            e = np.zeros(0, np.int64)
            return P.Plan([], np.zeros(1, np.int64), e, e.astype(np.int32), e.astype(np.int32), e.astype(np.int32),
                          [], [], self.segments, e, e, e, e, duplicates=0)  # fmt: skip
        ex = exchange if exchange is not None else RangeExchange()
        width = self._name_width()
        bounds = [None, *self._splitters(width, ranges), None]
        n = len(bounds) - 1
        mine = [r for r in range(n) if ex.mine(r)]
        order = mine + [r for r in range(n) if r not in mine]  # this process's ranges first
        local_a: dict[int, _RangeA] = {}
        local_b: dict[int, _RangeB] = {}
        done = {r: got for r in order if (got := ex.pieces(r, wait=False)) is not None}  # published whole before

        def a_of(r: int) -> _RangeA:
            if r not in local_a:
                local_a[r] = self._phase_a(r, width, bounds[r], bounds[r + 1])
            return local_a[r]

        # Phase A.
        sa: dict[int, SummaryA] = {}
        for r in order:
            if r in done:
                sa[r] = done[r].a
                continue
            got_a = None if r in mine else ex.summary_a(r)
            if got_a is None:
                got_a = a_of(r).summary()
                ex.publish_a(r, got_a)
            sa[r] = got_a

        # Between A and B: the columns, from every range's dtype codes.
        dnames = P.dtype_names(self.layouts)
        for r in range(n):  # published summaries drive the indexing below: their shapes first
            _refuse(ex, r, n, sa[r].problem(len(self.leaf_paths), len(dnames), len(self.runs)))
        bad = _untiled([sa[r].spans for r in range(n)], self.runs)
        if bad is not None:
            r, why = bad
            _refuse(ex, r, n, f"{why}: {ex.where(r - 1) or f'range {r - 1}'}" if r else why)
        first = np.full(len(self.leaf_paths), -1, dtype=np.int64)
        for r in range(n):
            first = _lowest_codes(first, np.array(sa[r].first, dtype=np.int64))
        keys: set[int] = set()
        for r in range(n):
            keys.update(sa[r].kinds)
            # Rows without a code join their leaf's first (``_plan.group_keys``).
            keys.update(lp * (len(dnames) + 1) + int(first[lp]) + 1 for lp in sa[r].nocode)
        uniq = np.array(sorted(keys), dtype=np.int64)
        groups = P.decode_groups(uniq, dnames)
        names_of = P.group_names(groups, self.leaf_paths)
        if len(groups) > 62:
            raise TooManyColumns(len(groups))
        e_base = np.cumsum([0] + [sa[r].n_ent for r in range(n)])
        f_base = np.cumsum([0] + [sa[r].n_files for r in range(n)])
        ex.file_bases = f_base.tolist()

        def b_of(r: int) -> _RangeB:
            if r not in local_b:
                local_b[r] = self._phase_b(a_of(r), int(e_base[r]), int(f_base[r]), uniq, first, len(dnames))
            return local_b[r]

        # Phase B.
        sb: dict[int, SummaryB] = {}
        for r in order:
            if r in done:
                sb[r] = done[r].b
                continue
            got_b = None if r not in local_a else b_of(r).summary()
            if got_b is None:
                got_b = ex.summary_b(r)
            if got_b is None:
                got_b = b_of(r).summary()
            if r in local_b:
                ex.publish_b(r, got_b)
            sb[r] = got_b

        # Between B and C: files' column sets, columns' kinds and each range's first unit.
        for r in range(n):
            _refuse(ex, r, n, sb[r].problem(len(uniq), len(self.layouts)))
        n_rows = sum(sa[r].n_rows for r in range(n))
        uniq_masks = np.unique(np.array([m for r in range(n) for m in sb[r].masks_seen], dtype=np.int64))
        file_layouts = [sorted(names_of[g] for g in range(len(groups)) if (int(mk) >> g) & 1) for mk in uniq_masks]
        hist = np.sum([np.array(sb[r].hist, dtype=np.int64).reshape(len(groups), len(self.layouts)) for r in range(n)],
                      axis=0)  # fmt: skip
        present = np.sum([np.array(sb[r].present, dtype=np.int64) for r in range(n)], axis=0)
        specs = [
            self._column_spec(names_of[g], self.leaf_paths[groups[g][0]], np.flatnonzero(hist[g]).tolist(),
                              int(present[g]) < n_rows)
            for g in range(len(groups))
        ]  # fmt: skip
        units = np.array(
            [[s.units(sb[r].present[g], np.array(sb[r].hist[g], dtype=np.int64), sb[r].nbytes[g])
              for g, s in enumerate(specs)] for r in range(n)], dtype=np.int64,
        ).reshape(n, len(specs))  # fmt: skip
        u_base = np.zeros_like(units)
        np.cumsum(units[:-1], axis=0, out=u_base[1:])
        r_base = np.cumsum([0] + [sa[r].n_rows for r in range(n)])
        n_base = np.cumsum([0] + [sa[r].name_bytes for r in range(n)])
        h_base = np.cumsum([0] + [sb[r].head_bytes for r in range(n)])
        bases = [
            Bases(int(r_base[r]), int(n_base[r]), int(e_base[r]), u_base[r].tolist(), units[r].tolist(), int(f_base[r]),
                  int(h_base[r]))
            for r in range(n)
        ]  # fmt: skip

        # Phase C, and every range's pieces.
        pieces: dict[int, Pieces] = {}
        for r in order:
            if r in done:
                got_p: Pieces | None = done[r]
            elif r in local_b:
                got_p = None
            else:
                got_p = ex.pieces(r, wait=True)
            if got_p is None:
                a, b = a_of(r), b_of(r)
                c = self._phase_c(a, b, specs, uniq_masks, bases[r])
                got_p = Pieces.of(a, b, c, sa[r], sb[r])
                ex.publish_pieces(r, got_p)
            _refuse(ex, r, n, got_p.problem(sa[r], sb[r], bases[r], specs))
            pieces[r] = got_p

        ps = [pieces[r] for r in range(n)]
        heads = (NAME_BLOCK, concat([p.heads for p in ps]), concat_offsets([p.head_offsets for p in ps]))
        names = StringTable(concat([p.names for p in ps]), concat_offsets([p.name_offsets for p in ps]), heads)
        columns = []
        for g, s in enumerate(specs):
            col = P.PlannedColumn(
                s.name, s.leaf, s.kind, s.dtype, s.ndim, s.shape, s.inner, concat([p.src[g] for p in ps]),
                None if s.count_mode is None else concat(_present([p.counts[g] for p in ps])),
                None if s.table is None else concat(_present([p.shapes[g] for p in ps])), s.has_valid,
                offs=None if s.count_mode is None else concat_offsets(_present([p.offs[g] for p in ps])),
                known_present=int(present[g]),
            )  # fmt: skip
            columns.append(col)
        columns.sort(key=lambda col: col.name)
        return P.Plan(
            names, concat_offsets([p.file_offsets for p in ps]), concat([p.frame_idx for p in ps]),
            concat([p.rank for p in ps]), concat([p.copies for p in ps]), concat([p.file_layout for p in ps]),
            file_layouts, columns, self.segments, concat([p.seg for p in ps]), concat([p.off for p in ps]),
            concat([p.nb for p in ps]), concat([p.crc for p in ps]), sum(sa[r].duplicates for r in range(n)),
            range_digests=[p.digest() for p in ps] if n > 1 else None,
            known_bytes=sum(sum(sb[r].nbytes) for r in range(n)),
        )  # fmt: skip

    def _splitters(self, width: int, ranges: int) -> list[Any]:
        """``ranges - 1`` filename keys (:func:`name_keys`) that cut the merge's names into
        ``ranges`` ranges of about as many entries: the distinct names of every run's
        :class:`Sample`, sorted together, taken at equal steps. Decided by the runs' samples
        alone, so any process that holds the same runs finds the same splitters (and the ranges'
        spans, recorded in their summaries, are checked to tile every run). Equal splitters make
        empty ranges."""
        if ranges <= 1:
            return []
        samples = [np.unique(self._sample_keys(si, width)) for si in range(len(self.runs))]
        keys = np.sort(np.concatenate(samples))
        return [keys[len(keys) * j // ranges] for j in range(1, ranges)]

    def _sample_keys(self, si: int, width: int) -> np.ndarray:
        if si not in self._keys:
            self._keys[si] = self.runs[si].sample.keys(width)
        return self._keys[si]

    def _name_width(self) -> int:
        """The longest filename of every run (at least 1 byte: a window of 0 is refused): the width
        of the names' keys (:func:`name_keys`); each run's is in its sample."""
        return max([1, *(r.sample.width for r in self.runs)])

    def _name_window(self, si: int, key: Any, width: int) -> tuple[int, int]:
        """Run ``si``'s names ``lo .. hi`` between which its first name whose key is not below
        ``key`` lies: between the names of two of its samples (which are sorted: the run's names
        are)."""
        r = self.runs[si]
        s = r.sample
        j = int(np.searchsorted(self._sample_keys(si, width), key, side="left"))
        hi = int(s.files[j]) if j < len(s.files) else len(r.names)
        return (min(hi, int(s.files[j - 1]) + 1) if j else 0), hi

    def _lower_bound(self, si: int, key: Any, width: int) -> int:
        """The first of run ``si``'s names whose key is not below ``key``: in its
        :meth:`_name_window`, by a binary search and then one block of names, so a published run
        is read there only."""
        r = self.runs[si]
        lo, hi = self._name_window(si, key, width)
        while hi - lo > _SEARCH_BLOCK:
            mid = (lo + hi) // 2
            if name_keys(*r.names.encoded(mid, mid + 1), width)[0] < key:
                lo = mid + 1
            else:
                hi = mid
        return lo + int(np.searchsorted(name_keys(*r.names.encoded(lo, hi), width), key, side="left"))

    def _entry_window(self, si: int, name: int) -> tuple[int, int]:
        """Run ``si``'s entries ``lo .. hi`` between which its first entry whose filename id is
        not below ``name`` lies: between two samples."""
        r = self.runs[si]
        s = r.sample
        k = int(np.searchsorted(s.files, name, side="left"))
        hi = min(k * s.step, len(r.file))
        return (min(hi, (k - 1) * s.step + 1) if k else 0), hi

    def _entry_bound(self, si: int, name: int) -> int:
        """The first of run ``si``'s entries whose filename id is not below ``name``: in its
        :meth:`_entry_window`, one slice of the run's ``file``."""
        lo, hi = self._entry_window(si, name)
        return lo + int(np.searchsorted(np.asarray(self.runs[si].file[lo:hi]), name, side="left"))

    def _spans(self, lo: Any, hi: Any, width: int) -> list[tuple[int, int, int, int, int]]:
        """Each run's ``si, na, nb, ea, eb``: its names and entries from key ``lo`` (included) to
        key ``hi`` (excluded; None: open), checked (``Run.check``). A published run on an object
        store is read where the searches and the spans fall, in a few rounds of reads of every
        run at once (``_fetched.prefetch``), not one run and array after another."""
        runs = self.runs
        keys = [k for k in (lo, hi) if k is not None]
        wins = [(si, self._name_window(si, k, width)) for si in range(len(runs)) for k in keys]
        wins = [(si, (a, b)) for si, (a, b) in wins if b - a <= _SEARCH_BLOCK]
        tables = [r.names.raw() for r in runs]  # each run's names and offsets
        prefetch([(tables[si][1], a, b + 1) for si, (a, b) in wins])
        prefetch([(tables[si][0], int(tables[si][1][a]), int(tables[si][1][b])) for si, (a, b) in wins])
        names = []
        for si, r in enumerate(runs):
            na = 0 if lo is None else self._lower_bound(si, lo, width)
            nb = len(r.names) if hi is None else self._lower_bound(si, hi, width)
            if nb < na:
                raise DamagedRun(f"{r.source}: its filenames are not sorted and distinct", path=r.source)
            names.append((na, nb))
        ewins = [(si, self._entry_window(si, x)) for si, (na, nb) in enumerate(names) for x in (na, nb)]
        prefetch([(runs[si].file, a, b) for si, (a, b) in ewins])
        spans = []
        for si, (na, nb) in enumerate(names):
            r = runs[si]
            ea = 0 if lo is None else self._entry_bound(si, na)
            eb = len(r.file) if hi is None else self._entry_bound(si, nb)
            if eb < ea:
                raise DamagedRun(f"{r.source}: its entries are not ordered by filename", path=r.source)
            spans.append((si, na, nb, ea, eb))
        # What the checks and the names merge and pass 1 read of each run, at once.
        reads: list[tuple[Any, int, int]] = []
        for si, na, nb, ea, eb in spans:
            data, off = tables[si]
            reads += [(off, na, nb + 1), (data, int(off[na]), int(off[nb]))]
            reads += [(getattr(runs[si], f), ea, eb) for f in RUN_COLUMNS]
        prefetch(reads)
        for si, na, nb, ea, eb in spans:
            check = runs[si].check
            if check is not None:
                check(na, nb, ea, eb)
        return spans

    # -- phase A: a range's names and pass 1 --------------------------------------------------

    def _phase_a(self, i: int, width: int, lo: Any, hi: Any) -> _RangeA:
        """Range ``i`` (filenames from key ``lo`` to below key ``hi``, None: open): its names
        merged (step 2) and its entries checked into rows (pass 1), numbered from 0 in the range."""
        w, tag = self.work, f"r{i}"
        spans = self._spans(lo, hi, width)  # run, first and one past the last name, entry
        names = self._merge_names(tag, spans, width, lo, hi)
        n_files = len(names)
        n_lp = len(self.leaf_paths)
        dnames = P.dtype_names(self.layouts)
        narrow = _narrow(len(self.layouts), len(dnames))
        first = np.full(n_lp, -1, dtype=np.int64)
        kinds: set[int] = set()
        nocode: set[int] = set()
        duplicates = 0
        blocks: list[tuple[int, int, int, int, int, int]] = []  # files, entries, rows
        n_ent = n_rows = 0
        ranks = np.array([s.seg.rank for s in self.segments], dtype=np.int32)

        def one_block(block: tuple[int, int, list[tuple[int, int, int]]]) -> _Block:
            """A block's rows, checked: everything of pass 1 that depends on this block alone."""
            g0, g1, bspans = block
            c = self._entries(bspans)
            c, copies, dups = P.resolve_duplicates(c, names, self.segments, self.on_duplicate, self.same_bytes)
            new_key = np.ones(len(c["file"]), dtype=bool)  # ``c`` is in row order: (file, frame, leaf)
            new_key[1:] = (np.diff(c["file"]) != 0) | (np.diff(c["frame"]) != 0)
            _, code = P.pair_codes(c, self.layouts, self.leaf_paths, names, self.segments)
            has = code >= 0
            kinds = _small_distinct(c["lp"][has] * (len(dnames) + 1) + code[has] + 1)
            first = P.leaf_first(c["lp"], code, n_lp)
            return _Block(g0, g1, c, copies, dups, new_key, code, first, kinds, _small_distinct(c["lp"][~has]))

        # Blocks are checked by a few threads at once (numpy leaves the GIL in its sorts and
        # gathers), in order, each a 1/workers share of the budget; their rows are written here.
        for b in _in_order(one_block, self._blocks(n_files, spans), self.workers):
            g0, g1, c, copies, code = b.g0, b.g1, b.c, b.copies, b.code
            duplicates += b.duplicates
            first = _lowest_codes(first, b.first)
            kinds.update(b.kinds)
            nocode.update(b.nocode)
            n_block, new_key = len(c["file"]), b.new_key
            key_start = np.flatnonzero(new_key)
            for k in ("seg", "off", "nb", "crc"):
                w.append(f"{tag}.t.{k}", c[k])
            for k, arr in (("gl", c["gl"]), ("lp", c["lp"]), ("code", code)):  # read only here: narrower
                w.append(f"{tag}.t.{k}", arr.astype(narrow[k]))
            w.append(f"{tag}.t.row", np.cumsum(new_key) - 1 + n_rows)
            w.append(f"{tag}.t.file", c["file"])
            w.append(f"{tag}.frame_idx", c["frame"][key_start])
            w.append(f"{tag}.rank", ranks[c["seg"][key_start]])
            w.append(f"{tag}.copies", copies[key_start].astype(np.int32))
            w.append(f"{tag}.fcount", np.bincount(c["file"][key_start] - g0, minlength=g1 - g0).astype(np.int64))
            blocks.append((g0, g1, n_ent, n_ent + n_block, n_rows, n_rows + len(key_start)))
            n_ent += n_block
            n_rows += len(key_start)
        t = {
            k: w.done(f"{tag}.t.{k}", narrow.get(k, _I8))
            for k in ("seg", "off", "nb", "crc", "gl", "lp", "code", "row", "file")
        }
        return _RangeA(
            tag, names, n_files, n_ent, n_rows, duplicates, first, sorted(kinds), sorted(nocode), blocks, t,
            w.done(f"{tag}.frame_idx", _I8), w.done(f"{tag}.rank", np.int32), w.done(f"{tag}.copies", np.int32),
            w.done(f"{tag}.fcount", _I8), int(names.raw()[1][-1]) if n_files else 0,
            [x for sp in spans for x in sp[1:]],
        )  # fmt: skip

    # -- phase B: pass 2 ----------------------------------------------------------------------

    def _phase_b(
        self, a: _RangeA, e_base: int, f_base: int, uniq: np.ndarray, first: np.ndarray, n_dtypes: int
    ) -> _RangeB:
        """Each column's source entry (its number in the whole plan: ``e_base`` + the range's)
        and layout per row of the range, each file's set of columns, and what the columns'
        kinds and first units need of the range: rows per column and layout, bytes per column;
        and the bytes of its filename heads (its names whose number in the plan, ``f_base`` +
        the range's, is a multiple of ``NAME_BLOCK``)."""
        w, t, tag = self.work, a.t, a.tag
        n_groups, n_layouts = len(uniq), len(self.layouts)
        kinds = np.array([F.DTYPES[lay.dtype].kind for lay in self.layouts])
        none_gl = kinds == "none"
        src = [w.zeros(f"{tag}.src{g}", _I8, (a.n_rows,), fill=-1) for g in range(n_groups)]
        rowgl = [w.zeros(f"{tag}.rowgl{g}", np.int32, (a.n_rows,), fill=-1) for g in range(n_groups)]
        present = np.zeros(n_groups, dtype=np.int64)
        hist = np.zeros((n_groups, n_layouts), dtype=np.int64)
        nbytes = np.zeros(n_groups, dtype=np.int64)
        masks = w.zeros(f"{tag}.masks", np.int64, (a.n_files,))
        seen = []
        for g0, g1, e0, e1, _r0, _r1 in a.blocks:
            lp, code = t["lp"][e0:e1].astype(np.int64), t["code"][e0:e1].astype(np.int64)
            gl, row = t["gl"][e0:e1].astype(np.int64), np.asarray(t["row"][e0:e1])
            group = np.searchsorted(uniq, P.group_keys(lp, code, first, n_dtypes))
            m = np.zeros(g1 - g0, dtype=np.int64)
            np.bitwise_or.at(m, np.asarray(t["file"][e0:e1]) - g0, np.left_shift(np.int64(1), group))
            masks[g0:g1] = m
            seen.append(np.unique(m))
            ok = ~none_gl[gl]
            nb = None
            for g in _small_distinct(group[ok]):
                sel = np.flatnonzero((group == g) & ok)
                src[g][row[sel]] = e_base + e0 + sel
                rowgl[g][row[sel]] = gl[sel]
                present[g] += len(sel)
                hist[g] += np.bincount(gl[sel], minlength=n_layouts)
                nb = np.asarray(t["nb"][e0:e1]) if nb is None else nb
                nbytes[g] += int(nb[sel].sum())
        masks_seen = np.unique(np.concatenate(seen)) if seen else np.zeros(0, np.int64)
        off = a.names.raw()[1]
        heads = _head_ids(f_base, a.n_files)
        head_bytes = int((np.asarray(off[heads + 1]) - np.asarray(off[heads])).sum()) if len(heads) else 0
        return _RangeB(src, rowgl, masks, masks_seen, present, hist, nbytes, head_bytes)

    # -- phase C: per-file and per-row arrays ------------------------------------------------

    def _phase_c(self, a: _RangeA, b: _RangeB, specs: list[_ColumnSpec], uniq_masks: np.ndarray, at: Bases) -> _RangeC:
        """The range's pieces of the plan's arrays that count from the ranges before it: file
        and name offsets, file layouts, and each column's per-row counts, shapes and offsets."""
        w, tag = self.work, a.tag
        file_offsets = _offsets(w, f"{tag}.file_offsets", a.fcount, at.rows)
        name_offsets = a.names.raw()[1]
        if at.name_bytes:
            name_offsets = _shifted(w, f"{tag}.name_offsets", name_offsets, at.name_bytes)
        file_layout = w.zeros(f"{tag}.file_layout", np.int32, (a.n_files,))
        for s in range(0, a.n_files, ROW_BLOCK):
            file_layout[s : s + ROW_BLOCK] = np.searchsorted(uniq_masks, b.masks[s : s + ROW_BLOCK])
        nb = a.t["nb"]
        columns = []
        for g, spec in enumerate(specs):
            counts, shapes, offs = spec.pieces(w, f"{tag}.c{g}", b.src[g], b.rowgl[g], nb, at.entries, at.units[g])
            if offs is not None and int(offs[-1]) != at.units[g] + at.count[g]:
                raise AssertionError(f"column {spec.name!r}: range {tag} counted {int(offs[-1]) - at.units[g]} "
                                     f"units, its summary {at.count[g]}")  # fmt: skip
            columns.append((counts, shapes, offs))
        heads = _head_ids(at.files, a.n_files)
        off = a.names.raw()[1]
        starts, ends = np.asarray(off[heads]), np.asarray(off[heads + 1])
        data = a.names.raw()[0]
        for x, y in zip(starts.tolist(), ends.tolist(), strict=True):
            w.append(f"{tag}.heads", np.asarray(data[x:y]))
        head_offsets = np.full(len(heads) + 1, at.head_bytes, dtype=np.int64)
        np.cumsum(ends - starts, out=head_offsets[1:])
        head_offsets[1:] += at.head_bytes
        return _RangeC(file_offsets, name_offsets, file_layout, columns, w.done(f"{tag}.heads", np.uint8), head_offsets)

    def _column_spec(self, name: str, leaf: tuple[str, ...], lay_ids: list[int], has_valid: bool) -> _ColumnSpec:
        """What ``_plan._column`` decides of a column from its layouts, the same in every range."""
        layouts = self.layouts
        lays = [layouts[g] for g in lay_ids]
        non_empty = [lay for lay in lays if not (F.DTYPES[lay.dtype].numeric and 0 in lay.shape)]
        dt = F.DTYPES[(non_empty or lays)[0].dtype] if lays else F.DTYPES["float64"]
        n_layouts = len(layouts)
        if lays and not dt.numeric:
            # Format 3: every non-numeric kind is bytes + byte offsets; a list of str also has
            # its strings per row as (n_rows, 1) shapes (``_plan._column``).
            kind = P.KIND[dt.kind]
            table = None
            if kind == "strlist":
                table = np.zeros((n_layouts + 1, 1), dtype=np.int64)  # row -1: absent
                for g in lay_ids:
                    table[g, 0] = layouts[g].shape[0]
            return _ColumnSpec(name, leaf, kind, kind, 1 if kind == "strlist" else 0, None, None, has_valid, "bytes",
                               None, table)  # fmt: skip
        ndim = len(lays[0].shape) if lays else 0
        shapes = {lay.shape for lay in lays}
        if len(shapes) <= 1:
            shape = next(iter(shapes)) if shapes else ()
            return _ColumnSpec(name, leaf, "fixed", dt.name, ndim, shape, None, has_valid,
                               "valid" if has_valid else None, None, None)  # fmt: skip
        table = np.zeros((n_layouts + 1, ndim), dtype=np.int64)  # row -1: absent
        for g in lay_ids:
            table[g] = layouts[g].shape
        inner_set = {lay.shape[1:] for lay in lays}
        if len(inner_set) == 1:
            return _ColumnSpec(name, leaf, "ragged", dt.name, ndim, None, next(iter(inner_set)), has_valid, "units",
                               table[:, 0].copy(), None)  # fmt: skip
        return _ColumnSpec(name, leaf, "ragged", dt.name, ndim, None, None, has_valid, "units",
                           np.prod(table, axis=1, dtype=np.int64), table)  # fmt: skip


def _present(pieces: list[np.ndarray | None]) -> list[np.ndarray]:
    """Pieces every range made (a column's counts, shapes or offsets)."""
    out = [p for p in pieces if p is not None]
    assert len(out) == len(pieces)
    return out


def _shifted(w: WorkFolder, name: str, a: np.ndarray, base: int) -> np.ndarray:
    """``a + base`` in a new work file, a block at a time."""
    out = w.zeros(name, _I8, (len(a),))
    for i in range(0, len(a), ROW_BLOCK):
        out[i : i + ROW_BLOCK] = np.asarray(a[i : i + ROW_BLOCK]) + base
    return out


def _offsets(w: WorkFolder, name: str, counts: np.ndarray, base: int) -> np.ndarray:
    """Offsets of ``counts`` (``len + 1``) starting at ``base``, in a new work file."""
    off = w.zeros(name, _I8, (len(counts) + 1,))
    np.cumsum(counts, out=off[1:])
    if base:
        for a in range(0, len(off), ROW_BLOCK):
            off[a : a + ROW_BLOCK] += base
    return off


@dataclass(frozen=True, slots=True)
class _ColumnSpec:
    """A column as its layouts decide it (``_Builder._column_spec``), and how each range makes
    its pieces of the per-row arrays."""

    name: str
    leaf: tuple[str, ...]
    kind: str
    dtype: str
    ndim: int
    shape: tuple[int, ...] | None
    inner: tuple[int, ...] | None
    has_valid: bool
    count_mode: str | None
    """Units of ``values`` per row: ``bytes`` (its entry's size), ``valid`` (1 when present),
    ``units`` (``unit_of`` its layout), None: no offsets."""
    unit_of: np.ndarray | None
    """Units per row of each layout (the last: absent, 0)."""
    table: np.ndarray | None
    """Per-row shapes of each layout (the last: absent, zeros), when the column has shapes."""

    def units(self, present: int, hist: np.ndarray, nbytes: int) -> int:
        """The units of a range of ``present`` rows with this column, ``hist`` of them per
        layout, of ``nbytes`` bytes in all."""
        if self.count_mode == "bytes":
            return int(nbytes)
        if self.count_mode == "valid":
            return int(present)
        if self.count_mode == "units":
            assert self.unit_of is not None
            return int((hist * self.unit_of[:-1]).sum())
        return 0

    def pieces(
        self, w: WorkFolder, tag: str, src: np.ndarray, rowgl: np.ndarray, nb: np.ndarray, e_base: int, base: int
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """A range's counts, shapes and offsets (from ``base``), from its rows' source entries
        ``src`` (numbered from ``e_base`` in the range's ``nb``) and layouts ``rowgl`` (-1: absent)."""
        n_rows = len(src)

        def per_row(
            name: str, fn: Callable[[np.ndarray, np.ndarray, slice], np.ndarray], tail: tuple[int, ...] = ()
        ) -> np.ndarray:
            out = w.zeros(f"{tag}.{name}", _I8, (n_rows, *tail))
            for a in range(0, n_rows, ROW_BLOCK):
                sl = slice(a, min(a + ROW_BLOCK, n_rows))
                g = np.asarray(rowgl[sl])
                out[sl] = fn(g, g >= 0, sl)
            return out

        counts = shapes = offs = None
        unit_of, table = self.unit_of, self.table
        if self.count_mode == "bytes":
            nbs = np.asarray(nb)
            counts = per_row("counts", lambda g, ok, sl: np.where(ok, nbs[np.maximum(np.asarray(src[sl]) - e_base, 0)], 0))
        elif self.count_mode == "valid":
            counts = per_row("valid", lambda g, ok, sl: ok.astype(np.int64))
        elif unit_of is not None:
            counts = per_row("counts", lambda g, ok, sl: unit_of[g])
        if table is not None:
            shapes = per_row("shapes", lambda g, ok, sl: table[g], table.shape[1:])
        if counts is not None:
            offs = _offsets(w, f"{tag}.offsets", counts, base)
        return counts, shapes, offs


@dataclass(frozen=True, slots=True)
class _RangeA:
    """Phase A of one range (``_Builder._phase_a``): its names and pass 1, numbered from 0."""

    tag: str
    names: StringTable
    n_files: int
    n_ent: int
    n_rows: int
    duplicates: int
    first: np.ndarray
    """``_plan.leaf_first`` of the range."""
    kinds: list[int]
    """Column keys of its rows that have a dtype code."""
    nocode: list[int]
    """Leaf paths of its rows without one (they join their leaf's first: known after every range)."""
    blocks: list[tuple[int, int, int, int, int, int]]
    t: dict[str, np.ndarray]
    """The range's row table (entries after duplicates, in row order) and its per-entry ids."""
    frame_idx: np.ndarray
    rank: np.ndarray
    copies: np.ndarray
    fcount: np.ndarray
    """Rows per file."""
    name_bytes: int
    spans: list[int]
    """``SummaryA.spans``."""

    def summary(self) -> SummaryA:
        return SummaryA(self.n_files, self.n_ent, self.n_rows, self.duplicates, self.name_bytes,
                        self.first.tolist(), list(self.kinds), list(self.nocode), list(self.spans))  # fmt: skip


@dataclass(frozen=True, slots=True)
class _RangeB:
    """Phase B of one range (``_Builder._phase_b``): pass 2."""

    src: list[np.ndarray]
    rowgl: list[np.ndarray]
    masks: np.ndarray
    """Each file's set of columns (bit per column)."""
    masks_seen: np.ndarray
    present: np.ndarray
    """Rows per column."""
    hist: np.ndarray
    """Rows per column and layout."""
    nbytes: np.ndarray
    """Bytes of the rows per column."""
    head_bytes: int
    """Bytes of the range's filename heads."""

    def summary(self) -> SummaryB:
        return SummaryB(self.present.tolist(), self.hist.tolist(), self.nbytes.tolist(), self.masks_seen.tolist(),
                        self.head_bytes)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _RangeC:
    """Phase C of one range (``_Builder._phase_c``): its pieces of the plan's arrays."""

    file_offsets: np.ndarray
    name_offsets: np.ndarray
    file_layout: np.ndarray
    columns: list[tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]]
    """Each column's counts, shapes and offsets (None: the column has none)."""
    heads: np.ndarray
    """The range's filename heads (``_phase_b``), UTF-8 bytes back to back."""
    head_offsets: np.ndarray
    """Their offsets (heads + 1), in the whole plan's values."""


# -- the plan in ranges: what the ranges exchange -------------------------------------------------


@dataclass(frozen=True, slots=True)
class SummaryA:
    """What every range needs of another's phase A (``_RangeA.summary``)."""

    n_files: int
    n_ent: int
    n_rows: int
    duplicates: int
    name_bytes: int
    first: list[int]
    """``_plan.leaf_first`` of the range, per leaf path."""
    kinds: list[int]
    """Column keys of its rows that have a dtype code."""
    nocode: list[int]
    """Leaf paths of its rows without one."""
    spans: list[int]
    """Of each run, the names ``na .. nb-1`` and entries ``ea .. eb-1`` the range planned:
    ``na, nb, ea, eb`` back to back. Every process checks that the ranges' spans tile each run
    (:func:`_untiled`): processes that disagreed on a splitter or a search (one of them read a
    damaged published run) would otherwise leave entries out or plan them twice."""

    def to_obj(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]

    def problem(self, n_lp: int, n_dtypes: int, n_runs: int) -> str | None:
        """What does not fit a plan of ``n_lp`` leaf paths, ``n_dtypes`` dtype codes and
        ``n_runs`` runs, or None."""
        if min(self.n_files, self.n_ent, self.n_rows, self.duplicates, self.name_bytes) < 0:
            return "its summary A holds a negative count"
        if len(self.spans) != 4 * n_runs:
            return "its summary A does not have one span per run"
        if self.n_rows > self.n_ent or len(self.first) != n_lp or any(not -1 <= c < n_dtypes for c in self.first):
            return "its summary A does not fit the plan's leaves and dtypes"
        if any(not 0 <= k < n_lp * (n_dtypes + 1) for k in self.kinds) or any(not 0 <= p < n_lp for p in self.nocode):
            return "its summary A names a column key or leaf the plan does not have"
        return None

    @classmethod
    def from_obj(cls, o: Any) -> SummaryA:
        """From JSON, checked: ints where ints go (``ValueError`` else)."""
        n_files, n_ent, n_rows, duplicates, name_bytes = (
            _int(o[f]) for f in ("n_files", "n_ent", "n_rows", "duplicates", "name_bytes")
        )
        return cls(n_files, n_ent, n_rows, duplicates, name_bytes, _ints(o["first"]), _ints(o["kinds"]),
                   _ints(o["nocode"]), _ints(o["spans"]))  # fmt: skip


@dataclass(frozen=True, slots=True)
class SummaryB:
    """What every range needs of another's phase B (``_RangeB.summary``)."""

    present: list[int]
    """Rows per column."""
    hist: list[list[int]]
    """Rows per column and layout."""
    nbytes: list[int]
    """Bytes of the rows per column."""
    masks_seen: list[int]
    """The files' distinct column sets (bit per column)."""
    head_bytes: int
    """Bytes of the range's filename heads (``_Builder._phase_b``)."""

    def to_obj(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]

    def problem(self, n_groups: int, n_layouts: int) -> str | None:
        """What does not fit a plan of ``n_groups`` columns and ``n_layouts`` layouts, or None."""
        if len(self.present) != n_groups or len(self.nbytes) != n_groups or len(self.hist) != n_groups:
            return "its summary B does not have one entry per column"
        if any(len(h) != n_layouts or min(h, default=0) < 0 for h in self.hist):
            return "its summary B does not have one row count per layout"
        if min(self.present, default=0) < 0 or min(self.nbytes, default=0) < 0 or self.head_bytes < 0:
            return "its summary B holds a negative count"
        if any(not 0 <= m < 1 << n_groups for m in self.masks_seen):
            return "its summary B names a column set the plan does not have"
        return None

    @classmethod
    def from_obj(cls, o: Any) -> SummaryB:
        if not isinstance(o["hist"], list):
            raise ValueError("hist is not a list")
        return cls(_ints(o["present"]), [_ints(h) for h in o["hist"]], _ints(o["nbytes"]), _ints(o["masks_seen"]),
                   _int(o["head_bytes"]))  # fmt: skip


def _head_ids(f_base: int, n_files: int) -> np.ndarray:
    """The files of a range (numbered from 0) whose number in the plan (``f_base`` + theirs) is
    a multiple of ``NAME_BLOCK``: the filename heads of the output's index it holds."""
    return np.arange((-f_base) % NAME_BLOCK, n_files, NAME_BLOCK, dtype=np.int64)


def _untiled(spans: list[list[int]], runs: list[Run]) -> tuple[int, str] | None:
    """The first range (and why) whose spans do not continue the range before it in some run
    (the first range starts each run at its first name and entry, the last ends it at its
    last, each range's ends are the next one's starts, none runs backwards), or None."""
    sp = np.array(spans, dtype=np.int64).reshape(len(spans), len(runs), 4)
    start = np.zeros((len(runs), 2), dtype=np.int64)
    ends = np.array([[len(r.names), len(r.file)] for r in runs], dtype=np.int64).reshape(len(runs), 2)
    for r in range(len(spans)):
        if not np.array_equal(sp[r, :, [0, 2]].T, start) or np.any(sp[r, :, [1, 3]].T < start):
            return r, "its spans of the runs do not continue the range before it (the parts disagree on the runs)"
        start = sp[r, :, [1, 3]].T
    if not np.array_equal(start, ends):
        return len(spans) - 1, "its spans of the runs do not end at the runs' ends (the parts disagree on the runs)"
    return None


def _refuse(ex: RangeExchange, r: int, n: int, why: str | None) -> None:
    """``DamagedRange`` naming range ``r``'s published objects, when ``why`` says what is wrong."""
    if why is not None:
        where = ex.where(r)
        raise DamagedRange(f"{where or f'range {r} of {n} of the plan'}: {why}", path=where)


def _int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < -(2**63) or x >= 2**63:
        raise ValueError(f"{x!r} is not an int64")
    return x


def _ints(xs: Any) -> list[int]:
    if not isinstance(xs, list):
        raise ValueError(f"{xs!r:.80} is not a list")
    return [_int(x) for x in xs]


@dataclass(frozen=True, slots=True)
class Bases:
    """Where a range's pieces start in the whole plan, and its units per column."""

    rows: int
    name_bytes: int
    entries: int
    units: list[int]
    """Each column's first unit (offsets' first value)."""
    count: list[int]
    """Each column's units in the range."""
    files: int
    head_bytes: int
    """Bytes of the filename heads of the ranges before."""


#: Arrays of a range's pieces: name → (dtype, what its length is).
PIECE_ARRAYS = {
    "names": ("|u1", "name_bytes"), "name_offsets": ("<i8", "files+1"), "file_offsets": ("<i8", "files+1"),
    "file_layout": ("<i4", "files"), "frame_idx": ("<i8", "rows"), "rank": ("<i4", "rows"), "copies": ("<i4", "rows"),
    "seg": ("<i8", "entries"), "off": ("<i8", "entries"), "nb": ("<i8", "entries"), "crc": ("<i8", "entries"),
    "heads": ("|u1", "head_bytes"), "head_offsets": ("<i8", "heads+1"),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Pieces:
    """One range's pieces of the plan's arrays (``_Builder.run``), local or published."""

    a: SummaryA
    b: SummaryB
    arrays: dict[str, np.ndarray]
    """``PIECE_ARRAYS``."""
    src: list[np.ndarray]
    counts: list[np.ndarray | None]
    shapes: list[np.ndarray | None]
    offs: list[np.ndarray | None]
    known_digest: str | None = None
    """The digest its publisher computed (``c.json``), for pieces mapped from storage; or this
    process, once :meth:`digest` ran."""

    def digest(self) -> str:
        """BLAKE2b-128 of every array of the range (names, offsets, file layouts, rows, the row
        table, each column's source entries, counts, shapes and offsets), a block at a time,
        each array's length first: what ``_plan.fingerprint`` hashes of the range, and more."""
        if self.known_digest is not None:
            return self.known_digest
        h = hashlib.blake2b(digest_size=16)
        cols = [a for g in range(len(self.src)) for a in (self.src[g], self.counts[g], self.shapes[g], self.offs[g])]
        for a in [*(self.arrays[k] for k in PIECE_ARRAYS), *cols]:
            if a is None:
                h.update(b"-")
                continue
            h.update(np.array(a.shape, dtype="<i8").tobytes())
            for i in range(0, len(a), ROW_BLOCK):
                h.update(np.ascontiguousarray(a[i : i + ROW_BLOCK]).data)
        object.__setattr__(self, "known_digest", h.hexdigest())  # once: published, then fingerprinted
        return h.hexdigest()

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def of(cls, a: _RangeA, b: _RangeB, c: _RangeC, sa: SummaryA, sb: SummaryB) -> Pieces:
        arrays = {
            "names": a.names.raw()[0], "name_offsets": c.name_offsets, "file_offsets": c.file_offsets,
            "file_layout": c.file_layout, "frame_idx": a.frame_idx, "rank": a.rank, "copies": a.copies,
            "seg": a.t["seg"], "off": a.t["off"], "nb": a.t["nb"], "crc": a.t["crc"],
            "heads": c.heads, "head_offsets": c.head_offsets,
        }  # fmt: skip
        counts, shapes, offs = ([col[k] for col in c.columns] for k in range(3))
        return cls(sa, sb, arrays, list(b.src), counts, shapes, offs)

    def problem(self, sa: SummaryA, sb: SummaryB, at: Bases, specs: list[_ColumnSpec]) -> str | None:
        """What disagrees with the range's summaries and bases (lengths, dtypes, first and last
        offsets), or None. The values between are not read (the copy's checks see them)."""
        if self.a != sa or self.b != sb:
            return "its summaries are not the ones the plan was built from"
        n = {"name_bytes": sa.name_bytes, "files+1": sa.n_files + 1, "files": sa.n_files, "rows": sa.n_rows,
             "entries": sa.n_ent, "head_bytes": sb.head_bytes, "heads+1": len(_head_ids(at.files, sa.n_files)) + 1}  # fmt: skip
        want: list[tuple[str, np.ndarray | None, str | None, tuple[int, ...] | None]] = [
            (k, self.arrays.get(k), dt, (n[size],)) for k, (dt, size) in PIECE_ARRAYS.items()
        ]
        if len(self.src) != len(specs) or not len(self.counts) == len(self.shapes) == len(self.offs) == len(specs):
            return "its columns are not the plan's"
        for g, s in enumerate(specs):
            want.append((f"column {g} src", self.src[g], "<i8", (sa.n_rows,)))
            has = s.count_mode is not None
            want.append((f"column {g} counts", self.counts[g], "<i8" if has else None, (sa.n_rows,) if has else None))
            want.append((f"column {g} offsets", self.offs[g], "<i8" if has else None, (sa.n_rows + 1,) if has else None))
            tail = None if s.table is None else (sa.n_rows, *s.table.shape[1:])
            want.append((f"column {g} shapes", self.shapes[g], None if tail is None else "<i8", tail))
        for what, arr, dt, shape in want:
            if (arr is None) != (dt is None):
                return f"{what} is {'missing' if arr is None else 'unexpected'}"
            if arr is not None and (np.dtype(arr.dtype) != np.dtype(dt) or tuple(arr.shape) != shape):
                return f"{what} is {arr.dtype}{tuple(arr.shape)}, not {np.dtype(dt)}{shape}"
        ends = [("name offsets", self.name_offsets, at.name_bytes, sa.name_bytes),
                ("file offsets", self.file_offsets, at.rows, sa.n_rows),
                ("head offsets", self.head_offsets, at.head_bytes, sb.head_bytes)]  # fmt: skip
        ends += [(f"column {g} offsets", o, at.units[g], at.count[g]) for g, o in enumerate(self.offs) if o is not None]
        for what, off, base, count in ends:
            if int(off[0]) != base or int(off[-1]) != base + count:
                return f"its {what} run {int(off[0])}..{int(off[-1])}, not {base}..{base + count}"
        return None


class RangeExchange:
    """Where the processes planning the ranges of one plan meet (``_planranges`` for the parts
    of a merge). This base class is one process planning every range: nothing is published or
    found."""

    mapped: list[int]
    """Ranges whose pieces were found published (``pieces``)."""
    planned: list[int]
    """Ranges of other processes planned here (published by ``publish_*``)."""

    file_bases: list[int]
    """Files before each range, then all of them (set once the ranges' summaries are known)."""

    def __init__(self) -> None:
        self.mapped, self.planned, self.file_bases = [], [], []

    def where_file(self, f: int) -> str | None:
        """Where the range holding the plan's file ``f`` was published, when it was mapped."""
        r = int(np.searchsorted(self.file_bases, f, side="right")) - 1
        return self.where(r) if 0 <= r < len(self.file_bases) - 1 and r in self.mapped else None

    def mine(self, r: int) -> bool:
        """Whether range ``r`` is this process's to plan."""
        return True

    def summary_a(self, r: int) -> SummaryA | None:
        """Range ``r``'s phase A summary, waiting while its planner is at work; None: plan it here."""
        return None

    def summary_b(self, r: int) -> SummaryB | None:
        return None

    def pieces(self, r: int, *, wait: bool) -> Pieces | None:
        """Range ``r``'s published pieces (``wait``: while its planner is at work)."""
        return None

    def publish_a(self, r: int, s: SummaryA) -> None:
        pass

    def publish_b(self, r: int, s: SummaryB) -> None:
        pass

    def publish_pieces(self, r: int, p: Pieces) -> None:
        pass

    def where(self, r: int) -> str | None:
        """Where range ``r``'s pieces are published (for messages)."""
        return None

    def close(self) -> None:
        """Remove what was fetched for the plan (after the merge)."""


@dataclass(frozen=True, slots=True)
class _Block:
    """One block of pass 1, checked (``_Builder.run``'s ``one_block``)."""

    g0: int
    g1: int
    """Its files: ``g0 .. g1-1``."""
    c: dict[str, np.ndarray]
    """Its entries after duplicates, in row order."""
    copies: np.ndarray
    duplicates: int
    new_key: np.ndarray
    """Where a key (file, frame) starts."""
    code: np.ndarray
    first: np.ndarray
    """``_plan.leaf_first`` of this block alone."""
    kinds: list[int]
    """Its (leaf, dtype code) pairs, as column keys before ``first`` applies."""
    nocode: list[int]
    """Leaf paths of its entries without a dtype code."""


def _in_order(fn: Callable[[Any], Any], items: Iterator[Any], workers: int) -> Iterator[Any]:
    """``map(fn, items)``, with up to ``workers`` calls running at once in threads, results in
    order, no more than ``workers`` items taken ahead (memory stays that of ``workers`` items)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="spillmerge-plan")
    pending: deque[Future[Any]] = deque()
    try:
        for item in items:
            if len(pending) >= workers:
                yield pending.popleft().result()
            pending.append(pool.submit(fn, item))
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _lowest_codes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per leaf the lower of two ``leaf_first`` results (-1: no code): blocks folded in any grouping."""
    return np.where((b >= 0) & ((a < 0) | (b < a)), b, a)


def _small_distinct(a: np.ndarray) -> list[int]:
    """The distinct values of ``a``, non-negative ints of a small range (column keys, layout ids),
    ascending: counted rather than sorted (``np.unique`` sorted every block's entries)."""
    return np.flatnonzero(np.bincount(a)).tolist() if len(a) else []


def in_memory_only(layouts: Sequence[FS.Layout]) -> str | None:
    """Why a plan of these layouts must be built by ``_plan`` in memory, or None. Only grows with
    the layouts: once a reason, always one."""
    why = several_variants(layouts)
    if why is None and any(lay.dtype in ("pylist", "pytuple") for lay in layouts):
        # format 4's list offsets number the items of every row: built by the in-memory plan
        why = "values hold lists or tuples of items (their list offsets are planned in memory)"
    return why


def several_variants(layouts: Sequence[FS.Layout]) -> str | None:
    """Why a plan of these layouts needs ``_plan``'s variant grouping (docs/FORMAT.md, *Value
    model*), or None. Out of core, a leaf's column is decided per block of files
    (``_plan.pair_codes``) and its leaf (``leaf_first``), which equals ``_plan._variant_groups``
    when each leaf holds one variant: one kind, dtype and ``ndim`` in every file (rows of ``None``
    or of zero elements fitting it). The layouts decide it before any row is read."""
    sigs: dict[tuple[str, ...], set[tuple[str, str, int]]] = {}
    empty: dict[tuple[str, ...], set[tuple[str, int]]] = {}
    for lay in layouts:
        dt = F.DTYPES[lay.dtype]
        if dt.kind == "none":
            continue
        if dt.numeric and 0 in lay.shape:
            empty.setdefault(lay.leaf, set()).add((lay.dtype, len(lay.shape)))
            continue
        sig = ("num", lay.dtype, len(lay.shape)) if dt.numeric else (dt.kind, dt.kind, 0)
        sigs.setdefault(lay.leaf, set()).add(sig)
    for leaf in sorted(set(sigs) | set(empty)):
        have, zeros = sigs.get(leaf, set()), empty.get(leaf, set())
        fits = len(have) == 1 and all(
            (s[0] == "num" and s[2] == nd) or (nd == 1 and s[0] == "strlist") for s in have for _, nd in zeros
        )
        if not (fits or (not have and len(zeros) <= 1)):
            return f"leaf {'/'.join(leaf)!r} holds several variants (kinds, dtypes or dimensions)"
    return None


class DamagedRun(CorruptSpillError):
    """A run another process published is damaged (``_planruns``): the merge plans again without
    the published runs."""


class DamagedRange(CorruptSpillError):
    """A range of the plan another process published is damaged (``_planranges``)."""


class PlanEntryError(CorruptSpillError):
    """The copy read a plan entry whose bytes fail their checksum, and the spill root's own index
    has no such row: the plan is damaged, not the spill (``_planshare.blamed_for_range_errors``
    names the published range or plan holding file ``file``)."""

    def __init__(self, message: str, *, path: str, file: int) -> None:
        super().__init__(message, path=path)
        self.file = file


class InMemoryOnly(Exception):
    """A plan the out-of-core builder does not make (the merge plans in memory instead, and its
    report says why): more than 62 columns (the per-file column sets need more than one int64
    mask), or a leaf of several variants."""


class TooManyColumns(InMemoryOnly):
    def __init__(self, n: int) -> None:
        super().__init__(f"{n} columns need more than one int64 mask per file")
        self.n = n
