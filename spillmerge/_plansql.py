"""The merge plan's row table, sorted out of core by DuckDB.

Every segment's index rows go into one DuckDB table (a segment at a time), each row with its
filename as a BLOB of its UTF-8 bytes (``surrogatepass``: filenames may hold lone surrogates, NUL
or newlines), whose byte order is the code-point order of Python's ``str`` sort. DuckDB sorts the
rows by (filename, frame, segment, leaf) under ``memory_limit``, spilling to a ``temp_directory``
in a private work folder, and the sorted rows come back as Arrow batches: each batch's names
become file numbers, the rows of a key held by several segments go to the caller's ``resolve``
(the duplicate rule lives with the plan), and the kept rows are appended to files of the work
folder, mapped back as numpy arrays.

Memory: DuckDB's ``memory_limit``, one segment's rows (Arrow) while it is inserted, one batch of
sorted rows (``BATCH``), and the distinct filenames (Python strings, as the plan keeps them).

The work folder ``spillmerge-sqlplan-<pid>-*`` (under ``work_dir``, else the system's temporary
folder) is removed when the sort is done, whether it succeeds or fails; the arrays mapped from it
stay readable (their files are unlinked, not truncated). A folder left by a killed process (its
pid is gone) is removed by the next plan that looks in the same parent folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _format_spill as FS
from ._spillroot import LoadedSegment

BATCH = 1 << 18
"""Sorted rows per Arrow batch read back from DuckDB, at most (fewer under a small memory limit:
one row per KiB of it, so a batch holds a small part of the limit whatever the names' lengths)."""

MAPPED_ROWS = 1 << 20
"""Row tables of more rows than this are maps of the work folder's files; smaller ones are read
into memory."""

PREFIX = "spillmerge-sqlplan-"

COLUMNS = ("file", "frame", "lp", "gl", "seg", "off", "nb", "crc")
"""The row table's int64 columns (``_plan``'s names): file number, frame, leaf path, global
layout, segment, byte offset, byte length, CRC-32C."""

Resolve = Callable[[dict[str, np.ndarray], list[str]], tuple[np.ndarray, int]]
"""``resolve(rows, names)``: the rows (sorted) of keys held by several segments and the names so
far; returns which rows to keep and the copies dropped."""


@dataclass
class Sorted:
    """The kept rows of every key, in (filename, frame, leaf) order."""

    names: list[str]
    """The distinct filenames, sorted; ``file`` numbers them."""
    rows: dict[str, np.ndarray]
    """``COLUMNS`` of every kept row."""
    copies: np.ndarray
    """int64: segments that held each kept row's key."""
    duplicates: int
    """Copies dropped."""


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


def sort_rows(
    segments: Iterable[LoadedSegment],
    layout_ids: Callable[[LoadedSegment], tuple[np.ndarray, np.ndarray]],
    lp_order: Callable[[], np.ndarray],
    resolve: Resolve,
    *,
    work_dir: str | None,
    memory_limit: int,
    threads: int,
) -> Sorted:
    """Sort the index rows of ``segments`` (in write order; ``seg`` numbers them) with DuckDB.

    ``layout_ids(s)``: the global layout and raw leaf-path number of each of ``s``'s catalog
    layouts (called once per segment, in order, also for an empty one); ``lp_order()`` then maps
    a raw leaf-path number to its position in the sorted leaf paths."""
    import duckdb  # a dependency of merging only: reading never imports it
    import pyarrow as pa

    parent = work_dir if work_dir is not None else tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    _remove_stale(parent)
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)
    try:
        con = duckdb.connect(os.path.join(folder, "plan.duckdb"))
        try:
            con.execute(f"SET memory_limit = '{max(int(memory_limit), 1 << 20)}B'")
            con.execute(f"SET threads = {max(1, int(threads))}")
            con.execute(f"SET temp_directory = '{os.path.join(folder, 'tmp')}'")
            con.execute("SET preserve_insertion_order = false")
            con.execute(
                "CREATE TABLE e (fname BLOB, frame BIGINT, rlp INTEGER, gl INTEGER, seg INTEGER, "
                "off BIGINT, nb BIGINT, crc BIGINT)"
            )
            for si, s in enumerate(segments):
                gmap, pmap = layout_ids(s)
                idx = s.index
                if not len(idx):
                    continue
                enc = pa.array([f.encode("utf-8", "surrogatepass") for f in s.filenames], pa.binary())
                lay = idx[:, FS.COL_LAYOUT]
                batch = pa.table({
                    "fname": enc.take(pa.array(idx[:, FS.COL_FILE])),
                    "frame": idx[:, FS.COL_FRAME],
                    "rlp": pmap[lay].astype(np.int32),
                    "gl": gmap[lay].astype(np.int32),
                    "seg": np.full(len(idx), si, dtype=np.int32),
                    "off": idx[:, FS.COL_OFFSET],
                    "nb": idx[:, FS.COL_NBYTES],
                    "crc": idx[:, FS.COL_CRC],
                })  # fmt: skip
                con.register("segment_rows", batch)
                con.execute("INSERT INTO e SELECT * FROM segment_rows")
                con.unregister("segment_rows")
                del batch, enc
            order = lp_order()
            con.register("lp_map", pa.table({"rlp": np.arange(len(order), dtype=np.int32), "lp": order.astype(np.int32)}))
            reader = con.sql(
                "SELECT fname, frame, lp, gl, seg, off, nb, crc FROM e JOIN lp_map USING (rlp) "
                "ORDER BY fname, frame, seg, lp"
            ).to_arrow_reader(max(2048, min(BATCH, int(memory_limit) >> 10)))
            return _collect(reader, resolve, folder)
        finally:
            con.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Spool:
    """Append-only int64 arrays in files of the work folder, mapped (or read) when done."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.files: dict[str, Any] = {}
        self.n = 0

    def append(self, name: str, a: np.ndarray) -> None:
        f = self.files.get(name)
        if f is None:
            f = self.files[name] = open(os.path.join(self.folder, f"{name}.i8"), "wb")  # noqa: SIM115 - done()
        f.write(np.ascontiguousarray(a, dtype=np.int64).data)

    def done(self, name: str, n: int) -> np.ndarray:
        f = self.files.pop(name, None)
        if f is not None:
            f.close()
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        path = os.path.join(self.folder, f"{name}.i8")
        if n <= MAPPED_ROWS:
            return np.fromfile(path, dtype=np.int64)
        # copy-on-write map: the plan may rewrite a column in place; the file is unlinked with the
        # folder, its pages stay file-backed while the map lives
        return np.memmap(path, dtype=np.int64, mode="c", shape=(n,))


def _collect(reader: Any, resolve: Resolve, folder: str) -> Sorted:
    """The sorted batches: file numbers, duplicates resolved, kept rows spooled."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names: list[str] = []
    spool = _Spool(folder)
    last_name: bytes | None = None
    carry: dict[str, np.ndarray] | None = None
    n_kept = duplicates = 0

    def flush(c: dict[str, np.ndarray], final: bool) -> dict[str, np.ndarray] | None:
        """Resolve and spool the whole keys of ``c``; return the rows of its last key unless final."""
        nonlocal n_kept, duplicates
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
        segs_per_key = np.add.reduceat(new_seg.astype(np.int64), key_start)
        copies = np.repeat(segs_per_key, np.diff(np.append(key_start, n)))
        dup = copies > 1
        if dup.any():
            rows = np.flatnonzero(dup)
            keep_dup, dropped = resolve({k: v[rows] for k, v in c.items()}, names)
            duplicates += dropped
            keep = np.ones(n, dtype=bool)
            keep[rows] = keep_dup
            c = {k: v[keep] for k, v in c.items()}
            copies = copies[keep]
        for k in COLUMNS:
            spool.append(k, c[k])
        spool.append("copies", copies)
        n_kept += len(copies)
        return rest

    for batch in reader:
        if not batch.num_rows:
            continue
        fname = batch.column(0)
        n = len(fname)
        new_name = np.empty(n, dtype=bool)
        new_name[0] = last_name is None or fname[0].as_py() != last_name
        if n > 1:
            same = pc.equal(fname.slice(1), fname.slice(0, n - 1)).to_numpy(zero_copy_only=False)
            new_name[1:] = ~same
        fresh = fname.filter(pa.array(new_name))
        first = len(names)
        names.extend(b.decode("utf-8", "surrogatepass") for b in fresh.to_pylist())
        last_name = fname[n - 1].as_py()
        c = {"file": first - 1 + np.cumsum(new_name, dtype=np.int64)}
        for j, k in enumerate(COLUMNS[1:], start=1):
            c[k] = batch.column(j).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        if carry is not None:
            c = {k: np.concatenate([carry[k], c[k]]) for k in c}
        carry = flush(c, final=False)
    if carry is not None and len(carry["file"]):
        flush(carry, final=True)
    rows = {k: spool.done(k, n_kept) for k in COLUMNS}
    return Sorted(names, rows, spool.done("copies", n_kept), duplicates)
