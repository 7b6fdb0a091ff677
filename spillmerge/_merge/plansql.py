"""The merge plan's row table, sorted out of core by DuckDB under half the plan budget (docs/SCALE.md)
in a private work folder removed when done; filenames go in as UTF-8 BLOBs (``surrogatepass``),
whose byte order is ``str``'s; a killed process's folder is removed by the next plan."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import SpillValueError
from .._format import spill as FS
from .._spill.root import LoadedSegment
from . import plancheck
from .nametable import NameTable, table_of

BATCH = 1 << 18
"""Sorted rows per Arrow batch read back from DuckDB, at most (fewer under a small memory limit:
one row per KiB of it, so a batch holds a small part of the limit whatever the names' lengths)."""

MAPPED_ROWS = 1 << 16
"""Per-row arrays of more rows than this are maps of the work folder's files; smaller ones (512
KiB of int64 at most) are in memory."""

ROW_GROUP = 1 << 16
"""Rows per Parquet row group of a segment's rows: what DuckDB reads at a time per thread."""

MIN_SORT_MEMORY = 64 << 20
"""DuckDB's memory limit at the least: its sort of a million rows fails in less."""

THREAD_MEMORY = 128 << 20
"""DuckDB's memory limit per sort thread, at the least: each thread's sort buffers come beside the
limit."""

SMALL_PLAN_ROWS = 1 << 18
"""Index rows below which the sort runs on one thread: DuckDB's worker threads cost more to start
than a small sort gains from them."""

ENGINE_SHARE = 2
"""DuckDB's memory limit is the plan budget divided by this: the rest holds what Python keeps
beside the engine (the sorted batch, the filenames, the plan's per-row steps after the sort)."""


PARQUET: dict[str, Any] = {
    "compression": "none",
    "use_dictionary": ["frame", "rlp", "gl", "seg", "nb"],
    "write_statistics": False,
}
"""The sort's input files, read once by the same process: no compression nor statistics, and a
dictionary only for the columns of few distinct values. Names, offsets, checksums and catalog
numbers are nearly all distinct: the encoder would try a dictionary for each row group, then fall
back."""

PREFIX = "spillmerge-sqlplan-"

COLUMNS = ("file", "frame", "lp", "gl", "seg", "off", "nb", "crc")
"""The row table's int64 columns (``_merge.plan``'s names): file number, frame, leaf path, global
layout, segment, byte offset, byte length, CRC-32C."""

Resolve = Callable[[dict[str, np.ndarray], np.ndarray, Callable[[int], str]], tuple[np.ndarray, int]]
"""``resolve(rows, key_start, name_of)``: the rows (sorted) of keys held by several segments, where
each key starts in them, and the name of a file number so far; returns which rows to keep and the
copies dropped."""


@dataclass
class Sorted:
    """The kept rows of every key, in (filename, frame, leaf) order."""

    names: NameTable
    """The distinct filenames, sorted; ``file`` numbers them."""
    rows: dict[str, np.ndarray]
    """``COLUMNS`` of every kept row."""
    row_of: np.ndarray
    """int64: each kept row's key's number (its output row)."""
    keys: dict[str, np.ndarray]
    """int64, per key: its ``frame_idx``, the segment it is kept from (``key_seg``) and the
    segments that held it (``copies``)."""
    file_offsets: np.ndarray
    """int64 (n_files + 1,): the first key of each file, then the number of keys."""
    duplicates: int
    """Copies dropped."""
    file_ids: list[np.ndarray]
    """Per segment: the file number of each of its filenames (-1 where it holds no row)."""


def _remove_stale(parent: str) -> None:
    """Remove the work folders of plans whose process is gone (killed before its cleanup)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\w+", name)
            if m is None or int(m.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            except OSError:  # alive, another user's
                pass


@contextlib.contextmanager
def workspace(work_dir: str | None) -> Iterator[Callable[[], str]]:
    """A private work folder under ``work_dir`` (else the system's temporary folder), made when
    first asked for (``folder()``: a small plan maps no file) and removed on exit whether the body
    succeeds or fails; folders of killed plans under it go first. Arrays mapped from its files stay
    readable after (their pages stay file-backed while mapped)."""
    made: list[str] = []

    def folder() -> str:
        if not made:
            parent = work_dir if work_dir is not None else tempfile.gettempdir()
            os.makedirs(parent, exist_ok=True)
            _remove_stale(parent)
            made.append(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
        return made[0]

    try:
        yield folder
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def alloc(
    folder: str | Callable[[], str] | None, name: str, shape: int | tuple[int, ...], dtype: Any, fill: int | None = None
) -> np.ndarray:
    """A new array of ``shape``: in memory up to ``MAPPED_ROWS`` rows (or with no ``folder``),
    else a shared map of a new file of ``folder`` (a path, or a call that gives one: its pages
    file-backed, written back, not anonymous memory), filled with ``fill`` (None: zeros)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if shape[0] <= MAPPED_ROWS or folder is None:
        return np.full(shape, 0 if fill is None else fill, dtype=dtype)
    folder = folder() if callable(folder) else folder
    path = os.path.join(folder, f"{name}-{len(os.listdir(folder))}.bin")
    a = np.memmap(path, dtype=dtype, mode="w+", shape=shape)  # a sparse file: zeros
    if fill:
        a[:] = fill  # a scalar: no temporary, the pages file-backed
    return a


def sort_rows(
    segments: Iterable[LoadedSegment],
    layout_ids: Callable[[LoadedSegment], tuple[np.ndarray, np.ndarray]],
    lp_order: Callable[[], np.ndarray],
    resolve: Resolve,
    *,
    memory_limit: int,
    folder: str,
) -> Sorted:
    """Sort the index rows of ``segments`` (in write order; ``seg`` numbers them) with DuckDB,
    whose memory limit is ``memory_limit / ENGINE_SHARE`` (at least ``MIN_SORT_MEMORY``), on one
    thread for a small plan (:data:`SMALL_PLAN_ROWS`), else up to 4. ``layout_ids(s)``: the global
    layout and raw leaf-path number of each of ``s``'s catalog layouts (called once per segment,
    in order, an empty one too); ``lp_order()`` then maps a raw leaf-path number to its position
    in the sorted leaf paths. ``folder``: the caller's :func:`workspace`, which keeps the maps' files."""
    import duckdb  # a dependency of merging only: reading never imports it
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Each segment's rows go to a Parquet file that DuckDB reads: no Python object is scanned
    # (that path imports pandas), and the rows live on disk, not in the engine's memory. A large
    # segment is read a block at a time (``LazySegment.open_stream``).
    segments = list(segments)
    n_files = 0
    n_names: list[int] = []
    for si, s in enumerate(segments):
        open_stream = getattr(s, "open_stream", None)
        st = open_stream(folder, si) if open_stream is not None else None
        n_names.append(st.n_files if st is not None else len(s.filenames))
        writer = None
        try:
            for table in _segment_rows(si, s, layout_ids, st):
                if writer is None:
                    path = os.path.join(folder, f"rows-{n_files:06d}.parquet")
                    writer = pq.ParquetWriter(path, table.schema, **PARQUET)
                writer.write_table(table, row_group_size=ROW_GROUP)
        finally:
            if writer is not None:
                writer.close()
                n_files += 1
        s.release()  # one segment's catalog and index in memory at a time
    order = lp_order()
    lp_map = pa.Table.from_arrays([_i64(np.arange(len(order))), _i64(order)], names=["rlp", "lp"])
    pq.write_table(lp_map, os.path.join(folder, "lp.parquet"), compression="none")
    if not n_files:  # no rows: no names, every segment's filenames unnumbered
        return _collect([], resolve, None, n_names)
    # Threads and memory in the connection's config: a connection made with defaults starts a
    # worker per core before any SET could say otherwise.
    limit = max(int(memory_limit) // ENGINE_SHARE, MIN_SORT_MEMORY)
    threads = 1 if sum(s.n_rows for s in segments) < SMALL_PLAN_ROWS else min(4, os.cpu_count() or 1)
    threads = max(1, min(threads, limit // THREAD_MEMORY))
    con = duckdb.connect(config={"threads": threads, "memory_limit": f"{limit}B"})
    try:
        con.execute(f"SET temp_directory = '{_quoted(os.path.join(folder, 'tmp'))}'")
        con.execute("SET preserve_insertion_order = false")
        con.execute("SET enable_progress_bar = false")  # DuckDB's own bar writes to stdout
        # the files by name, not a glob: the folder's path may hold glob characters
        rows = ", ".join(f"'{_quoted(os.path.join(folder, f'rows-{i:06d}.parquet'))}'" for i in range(n_files))
        lp = _quoted(os.path.join(folder, "lp.parquet"))
        reader = con.sql(
            f"SELECT fname, frame, lp, gl, seg, off, nb, crc, lf FROM read_parquet([{rows}]) "
            f"JOIN read_parquet('{lp}') USING (rlp) ORDER BY fname, frame, seg, lp"
        ).to_arrow_reader(max(2048, min(BATCH, limit >> 10)))
        try:
            return _collect(_from_arrow(reader), resolve, folder, n_names, segments)
        except (duckdb.OutOfMemoryException, OSError) as exc:
            # DuckDB's limit met while the Arrow reader pulls a batch comes as an OSError
            if not isinstance(exc, duckdb.OutOfMemoryException) and "Out of Memory" not in str(exc):
                raise
            raise SpillValueError(
                f"the merge plan's sort needs more memory than plan_budget allows "
                f"({limit >> 20} MiB of {int(memory_limit) >> 20} MiB for the sort); raise plan_budget "
                f"(--plan-budget): {exc}"
            ) from None
    finally:
        con.close()
        shutil.rmtree(os.path.join(folder, "tmp"), ignore_errors=True)
        for name in os.listdir(folder):  # the sort's inputs; the folder keeps the maps' files
            if name.endswith(".parquet"):
                os.unlink(os.path.join(folder, name))


def _segment_rows(
    si: int, s: LoadedSegment, layout_ids: Callable[[LoadedSegment], tuple[np.ndarray, np.ndarray]],
    st: Any = None,
) -> Iterator[Any]:  # fmt: skip
    """Segment number ``si``'s index rows as the Arrow tables DuckDB sorts, :data:`BATCH` rows
    at a time (none when it has none): name bytes, frame, raw leaf path, global layout, segment,
    extent, local file number (``layout_ids`` is called for an empty segment too). With ``st``
    (``_spill.stream.Stream``) neither the index nor the filenames are ever held whole."""
    import pyarrow as pa

    gmap, pmap = layout_ids(s)
    if not s.n_rows:
        return
    if st is not None:
        names = st.names()
        batches = s.rows(BATCH)  # type: ignore[attr-defined]
    else:
        idx = s.index
        t = table_of(s.filenames)  # the names' UTF-8 bytes (``surrogatepass``)
        names = pa.Array.from_buffers(pa.large_binary(), len(t), [None, pa.py_buffer(t.offsets), pa.py_buffer(t.data)])
        batches = (idx[a : a + BATCH] for a in range(0, len(idx), BATCH))
    for ib in batches:
        cols = {"fname": names.take(_i64(ib[:, FS.COL_FILE]))}
        cols.update({k: _i64(v) for k, v in _index_columns(si, ib, gmap, pmap).items()})
        yield pa.Table.from_arrays(list(cols.values()), names=list(cols))


def _index_columns(si: int, ib: np.ndarray, gmap: np.ndarray, pmap: np.ndarray) -> dict[str, np.ndarray]:
    """Index rows ``ib`` of segment ``si`` as int64 columns: frame, raw leaf path, global layout,
    segment, extent, local file number."""
    lay = ib[:, FS.COL_LAYOUT]
    return {
        "frame": ib[:, FS.COL_FRAME].astype(np.int64), "rlp": pmap[lay].astype(np.int64),
        "gl": gmap[lay].astype(np.int64), "seg": np.full(len(ib), si, dtype=np.int64),
        "off": ib[:, FS.COL_OFFSET].astype(np.int64), "nb": ib[:, FS.COL_NBYTES].astype(np.int64),
        "crc": ib[:, FS.COL_CRC].astype(np.int64), "lf": ib[:, FS.COL_FILE].astype(np.int64),
    }  # fmt: skip


def _quoted(path: str) -> str:
    """``path`` inside a single-quoted SQL string."""
    return path.replace("'", "''")


def _i64(a: np.ndarray) -> Any:
    """An Arrow int64 array over ``a``'s values (built from its buffer: ``pa.array`` of numpy
    imports pandas)."""
    import pyarrow as pa

    a = np.ascontiguousarray(a, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(a), [None, pa.py_buffer(a)])


def _binary_parts(col: Any) -> tuple[np.ndarray, np.ndarray]:
    """The bytes and int64 offsets (rebased to 0) of an Arrow binary array without nulls."""
    import pyarrow as pa

    wide = pa.types.is_large_binary(col.type)
    bufs = col.buffers()
    off = np.frombuffer(bufs[1], dtype=np.int64 if wide else np.int32)[col.offset : col.offset + len(col) + 1]
    off = off.astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return data[int(off[0]) : int(off[-1])], off - off[0]


def _ints(col: Any) -> np.ndarray:
    """An Arrow integer array without nulls as int64 numpy."""
    dt = np.dtype(str(col.type))
    return np.frombuffer(col.buffers()[1], dtype=dt)[col.offset : col.offset + len(col)].astype(np.int64)


class _Spool:
    """Append-only int64 (or uint8: ``.u8`` names) arrays in files of the work folder, read (or
    mapped) when done; in memory buffers when there is no folder (a sort of few rows,
    :func:`in_memory`)."""

    def __init__(self, folder: str | None) -> None:
        self.folder = folder
        self.files: dict[str, Any] = {}

    def _file(self, name: str) -> Any:
        f = self.files.get(name)
        if f is None:
            path = None if self.folder is None else os.path.join(self.folder, f"{name}.spool")
            f = self.files[name] = io.BytesIO() if path is None else open(path, "w+b")  # noqa: SIM115 - done()
        return f

    def append(self, name: str, a: np.ndarray) -> None:
        self._file(name).write(np.ascontiguousarray(a, dtype=_dtype(name)).data)

    def done(self, name: str, n: int) -> np.ndarray:
        """The ``n`` elements appended to ``name``: read, or a map beyond ``MAPPED_ROWS`` int64s'
        worth of bytes."""
        dtype, f = _dtype(name), self._file(name)
        if self.folder is not None and n * dtype.itemsize > MAPPED_ROWS * 8:
            f.close()
            # int64: a copy-on-write map (the plan may rewrite a column in place); the file is
            # unlinked with the folder, its pages stay file-backed while the map lives
            return np.memmap(f.name, dtype=dtype, mode="r" if dtype == np.uint8 else "c", shape=(n,))
        out = np.empty(n, dtype=dtype)
        f.seek(0)
        f.readinto(out.data)
        f.close()
        return out

    def name(self, i: int) -> str:
        """Name ``i`` of those spooled so far, for a message about a duplicated key (read back)."""
        off = np.frombuffer(self._read("name_off", 8 * i, 16), np.int64)
        return self._read("names.u8", int(off[0]), int(off[1] - off[0])).decode("utf-8", "surrogatepass")

    def _read(self, name: str, pos: int, n: int) -> bytes:
        f = self.files[name]
        f.seek(pos)
        data: bytes = f.read(n)
        f.seek(0, os.SEEK_END)  # appends go on at the end
        return data


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(np.uint8 if name.endswith(".u8") else np.int64)


Batch = tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]
"""A block of sorted rows: which rows start a new filename, the new names' UTF-8 bytes and offsets,
and the int64 columns (``COLUMNS`` but ``file``, and ``lf``: the row's file number in its segment)."""


def _from_arrow(reader: Any) -> Iterator[Batch]:
    """DuckDB's sorted Arrow batches as :func:`_collect` takes them: which rows start a name is
    compared by Arrow's kernel (a bool per name, no per-byte temporaries), a batch's first name
    with the last one of the batch before."""
    import pyarrow.compute as pc

    last_name: bytes | None = None
    for batch in reader:
        n = batch.num_rows
        if not n:
            continue
        col = batch.column(0)
        data, off = _binary_parts(col)
        new_name = np.ones(n, dtype=bool)
        if n >= 2:
            ne = pc.not_equal(col[1:], col[:-1])  # names are never null: its bitmap is the answer
            # unpacked by numpy: a boolean array's to_numpy() imports pandas (~1 s of a fresh merge)
            bits = np.frombuffer(ne.buffers()[1], np.uint8)
            new_name[1:] = np.unpackbits(bits, count=ne.offset + n - 1, bitorder="little")[ne.offset :]
        new_name[0] = last_name is None or data[: int(off[1])].tobytes() != last_name
        last_name = data[int(off[-2]) : int(off[-1])].tobytes()
        fdata, foff = _binary_parts(col.take(_i64(np.flatnonzero(new_name))))
        yield new_name, fdata, foff, {k: _ints(batch.column(j)) for j, k in enumerate((*COLUMNS[1:], "lf"), 1)}


def _collect(
    batches: Iterable[Batch], resolve: Resolve, folder: str | None, n_names: list[int], segments: Sequence[Any] = ()
) -> Sorted:
    """The sorted batches: file numbers, duplicates resolved, kept rows and their keys (the
    output rows, each file's first) spooled; the distinct names spooled as UTF-8 bytes and
    offsets (no Python string per name); each segment's filenames numbered (``Sorted.file_ids``,
    a map of a file beyond ``MAPPED_ROWS``). With ``segments``, the checks of a whole segment are
    made on the way (``_merge.plancheck``)."""
    base = np.cumsum([0, *n_names], dtype=np.int64)
    file_ids = alloc(folder, "file_ids", int(base[-1]), np.int64, fill=-1)
    spool = _Spool(folder)
    n_distinct = 0  # names spooled so far
    spool.append("name_off", np.zeros(1, np.int64))
    name_bytes = 0
    carry: dict[str, np.ndarray] | None = None
    n_kept = n_keys = duplicates = 0
    last_file = -1

    def flush(c: dict[str, np.ndarray], final: bool) -> dict[str, np.ndarray] | None:
        """Resolve and spool the whole keys of ``c``; return the rows of its last key unless final."""
        nonlocal n_kept, n_keys, duplicates, last_file
        n = len(c["file"])
        new_key = np.ones(n, dtype=bool)
        new_key[1:] = (c["file"][1:] != c["file"][:-1]) | (c["frame"][1:] != c["frame"][:-1])
        key_start = np.flatnonzero(new_key)
        rest = None
        if not final:  # the last key may go on in the next batch
            cut = int(key_start[-1])
            rest = {k: v[cut:] for k, v in c.items()}
            c = {k: v[:cut] for k, v in c.items()}
            key_start, n = key_start[:-1], cut
            if n == 0:
                return rest
        new_seg = new_key[:n].copy()
        new_seg[1:] |= c["seg"][1:] != c["seg"][:-1]
        copies = np.add.reduceat(new_seg.astype(np.int64), key_start)  # per key
        dup = np.repeat(copies > 1, np.diff(np.append(key_start, n)))
        if dup.any():
            rows = np.flatnonzero(dup)
            keep_dup, dropped = resolve({k: v[rows] for k, v in c.items()}, np.flatnonzero(new_key[rows]), spool.name)
            duplicates += dropped
            keep = np.ones(n, dtype=bool)
            keep[rows] = keep_dup
            c = {k: v[keep] for k, v in c.items()}
        for k in COLUMNS:
            spool.append(k, c[k])
        n_kept += len(c["file"])
        starts = np.ones(len(c["file"]), dtype=bool)  # the kept rows that start a key (a batch starts one)
        starts[1:] = (c["file"][1:] != c["file"][:-1]) | (c["frame"][1:] != c["frame"][:-1])
        spool.append("row_of", n_keys - 1 + np.cumsum(starts))
        ks = np.flatnonzero(starts)
        spool.append("frame_idx", c["frame"][ks])
        spool.append("key_seg", c["seg"][ks])
        spool.append("copies", copies)  # each key keeps one segment's rows, at least one
        files = c["file"][ks]  # each file's keys follow each other, its first may end the batch before
        spool.append("file_offsets", n_keys + np.flatnonzero(files != np.append(last_file, files[:-1])))
        n_keys, last_file = n_keys + len(ks), int(files[-1])
        return rest

    for new_name, fdata, foff, cols in batches:
        spool.append("names.u8", fdata)
        spool.append("name_off", name_bytes + foff[1:])
        name_bytes += int(foff[-1])
        c = {"file": n_distinct - 1 + np.cumsum(new_name, dtype=np.int64), **cols}
        n_distinct += len(foff) - 1
        file_ids[base[c["seg"]] + c["lf"]] = c["file"]
        if carry is not None:
            c = {k: np.concatenate([carry[k], c[k]]) for k in c}
        if segments:
            plancheck.twice(c, segments, spool.name)
        carry = flush(c, final=False)
    if carry is not None and len(carry["file"]):
        flush(carry, final=True)
    rows = {k: spool.done(k, n_kept) for k in COLUMNS}
    spool.append("file_offsets", np.array([n_keys]))
    keys = {k: spool.done(k, n_keys) for k in ("frame_idx", "key_seg", "copies")}
    ids = [file_ids[int(base[i]) : int(base[i + 1])] for i in range(len(n_names))]
    if any(getattr(s, "stream", None) is not None for s in segments):
        plancheck.distinct_names(segments, ids, alloc(folder, "stamp", n_distinct, np.int32, fill=-1))
    table = NameTable(spool.done("names.u8", name_bytes), spool.done("name_off", n_distinct + 1))
    file_offsets = spool.done("file_offsets", n_distinct + 1)
    return Sorted(table, rows, spool.done("row_of", n_kept), keys, file_offsets, duplicates, ids)


IN_MEMORY_ROWS = 1 << 16
"""Index rows below which :func:`sort_rows_in_memory` sorts instead of DuckDB whatever the budget:
starting DuckDB (its import and ``connect``, 0.1-0.2 s) costs more than the whole sort."""
IN_MEMORY_ROW_BYTES = 2048
"""Budget a row of :func:`sort_rows_in_memory` is given (its arrays and name, a few times over,
take a few hundred bytes): a plan of up to ``plan_budget / IN_MEMORY_ROW_BYTES`` rows is sorted
in memory too (256k rows under the default budget)."""


def in_memory(n_rows: int, memory_limit: int) -> bool:
    """Whether a plan of ``n_rows`` index rows is sorted in memory under ``memory_limit``."""
    return n_rows < max(IN_MEMORY_ROWS, memory_limit // IN_MEMORY_ROW_BYTES)


def sort_rows_in_memory(
    segments: Iterable[LoadedSegment],
    layout_ids: Callable[[LoadedSegment], tuple[np.ndarray, np.ndarray]],
    lp_order: Callable[[], np.ndarray],
    resolve: Resolve,
) -> Sorted:
    """:func:`sort_rows` for few rows (:func:`in_memory`): the same order
    (names as UTF-8 bytes in byte order, as DuckDB sorts them; then frame, segment, leaf path)
    by a numpy ``lexsort``, collected the same way into arrays in memory, without Arrow (whose
    compute kernels are slow to import). Memory: the rows, a few times over."""
    n_names: list[int] = []
    parts: list[dict[str, np.ndarray]] = []
    encoded: list[bytes] = []  # every segment's names, back to back
    for si, s in enumerate(segments):
        n_names.append(len(s.filenames))
        encoded.extend(f.encode("utf-8", "surrogatepass") for f in s.filenames)
        gmap, pmap = layout_ids(s)
        if s.n_rows:
            parts.append(_index_columns(si, s.index, gmap, pmap))
    if not parts:
        return _collect([], resolve, None, n_names)
    rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    distinct = sorted(set(encoded))
    rank_of = {name: i for i, name in enumerate(distinct)}
    base = np.cumsum([0, *n_names], dtype=np.int64)
    rank = np.array([rank_of[n] for n in encoded], dtype=np.int64)[base[rows["seg"]] + rows["lf"]]
    lp = lp_order()[rows["rlp"]]
    order = np.lexsort((lp, rows["seg"], rows["frame"], rank))  # stable: ties keep their order
    rank = rank[order]
    new_name = np.ones(len(rank), dtype=bool)
    new_name[1:] = rank[1:] != rank[:-1]
    names = [distinct[r] for r in rank[new_name].tolist()]
    foff = np.cumsum([0, *map(len, names)], dtype=np.int64)
    rows["lp"] = lp
    cols = {k: rows[k][order] for k in (*COLUMNS[1:], "lf")}
    return _collect([(new_name, np.frombuffer(b"".join(names), np.uint8), foff, cols)], resolve, None, n_names)
