"""Read a spill root: ranks, segments, commit and failure records, indexes — all validated,
because a spill root is untrusted input. The barrier on its commit records is ``_spill.barrier``."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CorruptSpillError
from .._format import common as F
from .._format import crc as _crc
from .._format import output as FO
from .._format import spill as FS
from .._storage import Storage
from .._util.gcpause import gc_paused


@dataclass(frozen=True, slots=True)
class Segment:
    """One writer session of one rank, as found on storage."""

    rank: int
    """Rank folder it lives in."""
    name: str
    """Segment folder name."""
    rel: str
    """Path relative to the spill root."""
    header: dict[str, Any] | None
    """Segment header from ``zarr.json`` (None when unreadable)."""
    commit: FS.CommitRecord | None
    """Commit record, when the segment is complete."""
    failure: FS.FailureRecord | None
    """Failure record, when the writer failed."""

    @property
    def run_id(self) -> str | None:
        rec = self.commit or self.failure
        rid = rec.run_id if rec is not None else (self.header or {}).get("run_id")
        return rid if isinstance(rid, str) else None

    @property
    def world_size(self) -> int | None:
        rec = self.commit or self.failure
        return rec.world_size if rec is not None else F.int_or_none(self.header or {}, "world_size")


@dataclass(frozen=True, slots=True)
class LoadedSegment:
    """A committed segment with its validated catalog and index."""

    seg: Segment
    filenames: list[str]
    """Catalog filenames (position = file_id)."""
    layouts: list[FS.Layout]
    """Catalog layouts (position = layout_id)."""
    index: np.ndarray
    """int64 (n_rows, 6) index, validated against the commit record."""
    chunk_bytes: int
    """Chunk size of the segment's ``data``."""
    checks: np.ndarray | None = None
    """int64 (n, 3) block checksums (offset, nbytes, CRC-32C) that rows with a negative CRC
    point at (``-1 - id``), validated; None when the segment has none."""

    @property
    def n_rows(self) -> int:
        return len(self.index)

    def release(self) -> None:
        """Nothing to let go: this segment was read whole (see :class:`LazySegment`)."""


def list_ranks(storage: Storage) -> list[int]:
    ranks = [FS.parse_rank_dirname(n) for n in storage.listdir("")]
    return sorted(r for r in ranks if r is not None)


def read_segment(storage: Storage, rank: int, name: str) -> Segment:
    rel = f"{FS.rank_dirname(rank)}/{name}"
    obj = FO.json_or_none(storage, f"{rel}/zarr.json", F.RECORD_MAX_BYTES)  # read leniently: no header then
    attrs = obj.get("attributes") if isinstance(obj, dict) else None
    header = attrs.get("spillmerge") if isinstance(attrs, dict) else None
    header = header if isinstance(header, dict) else None
    commit = failure = None
    raw = storage.get_or_none(f"{rel}/{FS.COMMIT_NAME}", max_bytes=F.RECORD_MAX_BYTES)
    if raw is not None:
        path = storage.describe(f"{rel}/{FS.COMMIT_NAME}")
        commit = FS.CommitRecord.from_json(raw, path=path)
        if commit.rank != rank or commit.segment != name:
            raise CorruptSpillError(
                f"{path}: commit record names rank {commit.rank} / {commit.segment}, "
                f"but it lies in {FS.rank_dirname(rank)}/{name}",
                path=path,
                rank=rank,
            )
        # One writer wrote both: a record that disagrees with its header is damaged, never a
        # segment of another run (which the barrier would call stale, naming the intact ones).
        said = F.int_or_none(header or {}, "world_size")
        if said is not None and said != commit.world_size:
            raise CorruptSpillError(
                f"{path}: commit record says world_size {commit.world_size}, but the segment's header "
                f"{storage.describe(f'{rel}/zarr.json')} says {said}: one of them is damaged",
                path=path,
                rank=rank,
            )
    raw = storage.get_or_none(f"{rel}/{FS.FAILURE_NAME}", max_bytes=F.FAILURE_MAX_BYTES)
    if raw is not None:
        failure = FS.FailureRecord.from_json(raw, path=storage.describe(f"{rel}/{FS.FAILURE_NAME}"))
    return Segment(rank, name, rel, header, commit, failure)


def list_segments(storage: Storage, rank: int, problems: list[str] | None = None) -> list[Segment]:
    """A rank's segments in order; with ``problems``, one whose records are damaged is listed
    there and left out instead of raising."""
    names = [n for n in storage.listdir(FS.rank_dirname(rank)) if FS.is_segment_name(n)]
    out = []
    for name in sorted(names, key=FS.segment_sort_key):
        try:
            out.append(read_segment(storage, rank, name))
        except CorruptSpillError as exc:
            if problems is None:
                raise
            problems.append(str(exc))
    return out


def scan(storage: Storage, problems: list[str] | None = None) -> dict[int, list[Segment]]:
    """Every rank folder and its segments, in natural order (``problems``: see :func:`list_segments`)."""
    return {r: list_segments(storage, r, problems) for r in list_ranks(storage)}


def corrupt(storage: Storage, seg: Segment, msg: str, rel: str = "") -> CorruptSpillError:
    """The error naming segment ``seg`` (or its object ``rel``)."""
    path = storage.describe(f"{seg.rel}/{rel}" if rel else seg.rel)
    return CorruptSpillError(f"{path}: {msg}", path=path, rank=seg.rank)


def mismatch(storage: Storage, seg: Segment, what: str, note: str = "") -> CorruptSpillError:
    """The error for data bytes ``what`` (``at bytes a..b``) that fail their checksum."""
    msg = f"checksum mismatch {what} ({note}rank {seg.rank}): the spill is corrupt; run `spillmerge verify` on the root"
    return corrupt(storage, seg, msg, FS.DATA_NAME)


def load_segment(storage: Storage, seg: Segment) -> LoadedSegment:
    """Read and validate a committed segment's catalog and index against its commit record."""
    return gc_paused(_load_segment, storage, seg)  # type: ignore[no-any-return]  # (a catalog: many small objects)


def _load_segment(storage: Storage, seg: Segment) -> LoadedSegment:
    commit = seg.commit
    assert commit is not None
    bad = functools.partial(corrupt, storage, seg)
    cat_rel = f"{seg.rel}/{FS.CATALOG_NAME}"
    limit = FS.catalog_max_bytes(commit.n_files, commit.n_rows)
    raw_cat, cat_crc = read_small_array(storage, seg, FS.CATALOG_NAME, max_bytes=limit, expect_shape=None)
    if cat_crc != commit.catalog_crc32c:
        raise bad("catalog checksum does not match the commit record", FS.CATALOG_NAME)
    cat_path = storage.describe(cat_rel)
    cat = F.loads(bytes(raw_cat), path=cat_path)
    if (
        not isinstance(cat, dict)
        or not isinstance(cat.get("filenames"), list)
        or not isinstance(cat.get("layouts"), list)
    ):
        raise bad("catalog must hold 'filenames' and 'layouts' lists", FS.CATALOG_NAME)
    filenames = cat["filenames"]
    if not all(isinstance(f, str) for f in filenames) or len(set(filenames)) != len(filenames):
        raise bad("catalog filenames must be distinct strings", FS.CATALOG_NAME)
    long = next(
        (f for f in filenames if len(f) > F.FILENAME_MAX_BYTES // 4 and len(f.encode()) > F.FILENAME_MAX_BYTES), None
    )
    if long is not None:  # a merge of it would write an output no reader opens (docs/FORMAT.md, *Size limits*)
        raise bad(
            f"catalog filename {long!r:.200}... is more than the {F.FILENAME_MAX_BYTES} bytes a filename may have",
            FS.CATALOG_NAME,
        )
    layouts = FS.Layout.many(cat["layouts"], path=cat_path)

    expect = commit.n_rows * FS.INDEX_COLUMNS * 8
    raw_idx, idx_crc = read_small_array(
        storage, seg, FS.INDEX_NAME, max_bytes=expect, expect_shape=[commit.n_rows, FS.INDEX_COLUMNS]
    )
    if len(raw_idx) != expect:
        raise bad(f"index has {len(raw_idx)} bytes, the commit record says {expect}", FS.INDEX_NAME)
    if idx_crc != commit.index_crc32c:
        raise bad("index checksum does not match the commit record", FS.INDEX_NAME)
    # A read-only view of the bytes read, not a copy: at millions of rows the index is the largest
    # thing a merge loads (a segment at a time, docs/SCALE.md).
    index = np.frombuffer(raw_idx, dtype="<i8").reshape(commit.n_rows, FS.INDEX_COLUMNS).astype(np.int64, copy=False)

    checks = read_checks(storage, seg)
    _validate_rows(bad, filenames, layouts, index, commit.nbytes, checks, commit.chunk_bytes)
    return LoadedSegment(seg, filenames, layouts, index, commit.chunk_bytes, checks=checks)


def read_checks(storage: Storage, seg: Segment) -> np.ndarray | None:
    """A committed segment's block checksums, checked against its commit record (None: it has
    none), once every data chunk the record promises is found: this also bounds what a hostile
    record can make the merge allocate by what is really on storage."""
    commit = seg.commit
    assert commit is not None
    if commit.n_chunks * commit.chunk_bytes < commit.nbytes:
        raise corrupt(storage, seg, "commit record's chunks cannot hold its bytes")
    present = set(storage.listdir(f"{seg.rel}/{FS.DATA_NAME}/c"))
    for c in range(commit.n_chunks):
        if str(c) not in present:
            raise corrupt(storage, seg, f"data chunk {c} is missing", f"{FS.DATA_NAME}/c/{c}")
    if not commit.n_checks:
        return None
    want = commit.n_checks * FS.CHECK_COLUMNS * 8
    raw, crc = read_small_array(
        storage, seg, FS.CHECKS_NAME, max_bytes=want, expect_shape=[commit.n_checks, FS.CHECK_COLUMNS]
    )
    if len(raw) != want or crc != commit.checks_crc32c:
        raise corrupt(storage, seg, "checks do not match the commit record", FS.CHECKS_NAME)
    return np.frombuffer(raw, dtype="<i8").reshape(commit.n_checks, FS.CHECK_COLUMNS).astype(np.int64)


def _validate_rows(
    bad: Any, filenames: list[str], layouts: list[FS.Layout], index: np.ndarray, data_nbytes: int,
    checks: np.ndarray | None = None, chunk_bytes: int = 1,
) -> None:  # fmt: skip
    """Check every index row against the catalog and the data size, and every block checksum
    against the data and the rows that point at it (untrusted input)."""
    check_rows(bad, len(filenames), layouts, list(index.T), data_nbytes, checks, chunk_bytes)
    fid, frame, lid = index[:, FS.COL_FILE], index[:, FS.COL_FRAME], index[:, FS.COL_LAYOUT]
    # A frame's leaves share (file, frame); the same leaf of a frame may not appear twice, not
    # even with two shapes (each shape has a layout of its own): compare leaf paths.
    leaf = _leaf_ids(layouts)[lid]
    order = lex_order(fid, frame, leaf)
    dup = (np.diff(fid[order]) == 0) & (np.diff(frame[order]) == 0) & (np.diff(leaf[order]) == 0)
    if np.any(dup):
        i = order[int(np.argmax(dup))]
        raise bad(f"index lists frame {int(frame[i])} of {filenames[int(fid[i])]!r:.200} twice", FS.INDEX_NAME)


def lex_order(*keys: np.ndarray) -> np.ndarray:
    """``np.lexsort`` of int64 ``keys`` given most significant first: the same stable order, from
    one sort of the keys packed into one int64 when their ranges fit in 63 bits."""
    n = len(keys[0])
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    lows = [int(k.min()) for k in keys]
    widths = [(int(k.max()) - lo).bit_length() for k, lo in zip(keys, lows, strict=True)]
    if sum(widths) > 62:
        return np.lexsort(keys[::-1])
    packed = np.zeros(n, dtype=np.int64)
    for k, lo, width in zip(keys, lows, widths, strict=True):
        if width:
            packed <<= width
            packed |= k - lo
    return np.argsort(packed, kind="stable")


def check_rows(
    bad: Any, n_files: int, layouts: Sequence[FS.Layout], columns: Sequence[np.ndarray], data_nbytes: int,
    checks: np.ndarray | None = None, chunk_bytes: int = 1,
) -> None:  # fmt: skip
    """The range checks of index rows given as their six columns (``FS.COL_*`` order): file ids
    below ``n_files``, known layouts, sizes matching them, bytes inside the data, checksums
    possible; and every block checksum inside one data chunk. Not the check that no frame lists a
    leaf twice (``load_segment`` makes it)."""
    if checks is not None and len(checks):
        c_off, c_nb, c_crc = checks[:, 0], checks[:, 1], checks[:, 2]
        if (
            c_off.min() < 0
            or c_nb.min() < 1
            or np.any(c_off > data_nbytes - c_nb)
            or np.any(c_off // chunk_bytes != (c_off + c_nb - 1) // chunk_bytes)
            or c_crc.min() < 0
            or c_crc.max() > 0xFFFFFFFF
        ):
            raise bad("a block checksum covers bytes outside one data chunk, or is impossible", FS.CHECKS_NAME)
    fid, frame, lid = columns[FS.COL_FILE], columns[FS.COL_FRAME], columns[FS.COL_LAYOUT]
    off, nb, crc = columns[FS.COL_OFFSET], columns[FS.COL_NBYTES], columns[FS.COL_CRC]
    if not len(fid):
        return
    if fid.min() < 0 or fid.max() >= n_files:
        raise bad("index refers to a filename the catalog does not have", FS.INDEX_NAME)
    if lid.min() < 0 or lid.max() >= len(layouts):
        raise bad("index refers to a layout the catalog does not have", FS.INDEX_NAME)
    if frame.min() < 0:
        raise bad("index has a negative frame index", FS.INDEX_NAME)
    n_checks = 0 if checks is None else len(checks)
    if crc.min() < -n_checks or crc.max() > 0xFFFFFFFF:
        raise bad("index has an impossible checksum", FS.INDEX_NAME)
    blocked = np.flatnonzero(crc < 0)
    if len(blocked):  # a row checked by a block lies inside that block
        assert checks is not None
        c = checks[-1 - crc[blocked]]
        if np.any(off[blocked] < c[:, 0]) or np.any(off[blocked] + nb[blocked] > c[:, 0] + c[:, 1]):
            raise bad("index row lies outside the block checksum it points at", FS.INDEX_NAME)
    sizes = np.array([lay.nbytes for lay in layouts], dtype=np.int64)
    if np.any(nb != sizes[lid]):
        raise bad("index row sizes do not match their layouts", FS.INDEX_NAME)
    if off.min() < 0 or np.any(off > data_nbytes - nb):
        raise bad(f"index has offsets outside the {data_nbytes} bytes of data", FS.INDEX_NAME)


def _leaf_ids(layouts: list[FS.Layout]) -> np.ndarray:
    """Layout id -> the position of its leaf path in sorted order (a value's leaves are written
    in that order, so within one write of a frame these strictly increase)."""
    order = {p: i for i, p in enumerate(sorted({lay.leaf for lay in layouts}))}
    return np.array([order[lay.leaf] for lay in layouts], dtype=np.int64)


def read_small_array(
    storage: Storage, seg: Segment, name: str, *, max_bytes: int, expect_shape: list[int] | None
) -> tuple[memoryview, int]:
    """Read a segment's one-chunk crc32c array ``name``, checking its metadata first so a hostile
    ``zarr.json`` cannot make us allocate or read without bound: its chunk holds at most
    ``max_bytes`` bytes plus the 4 CRC bytes. Returns the bytes and their CRC-32C."""
    rel, bad = f"{seg.rel}/{name}", functools.partial(corrupt, storage, seg)
    path = storage.describe(rel)
    try:
        meta = F.loads(storage.get(f"{rel}/zarr.json", max_bytes=F.RECORD_MAX_BYTES), path=f"{path}/zarr.json")
    except FileNotFoundError:
        raise bad(f"missing (the segment is committed but has no {name})", name) from None
    shape = meta.get("shape") if isinstance(meta, dict) else None
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CorruptSpillError(f"{path}/zarr.json: bad shape {shape!r}", path=path, rank=seg.rank)
    if expect_shape is not None and shape != expect_shape:
        raise bad(f"shape {shape} does not match the commit record {expect_shape}", name)
    if any(d == 0 for d in shape):
        return memoryview(b""), 0
    chunk = f"{name}/c/" + "/".join("0" * len(shape))
    try:
        blob = storage.get(f"{seg.rel}/{chunk}", max_bytes=max_bytes + 4)
    except FileNotFoundError:
        raise bad("missing chunk", chunk) from None
    if len(blob) < 4:
        raise bad("truncated chunk", chunk)
    raw, stored = memoryview(blob)[:-4], int.from_bytes(blob[-4:], "little")  # a view: an index is large
    if _crc.value(raw) != stored:
        raise bad("chunk checksum mismatch (corrupt or torn write)", chunk)
    return raw, stored


def load_flushed(storage: Storage, seg: Segment) -> tuple[LoadedSegment, list[str]]:
    """Rebuild an uncommitted segment's index from its journal: every entry in chunk order up to
    the first missing or corrupt one. Returns the segment and the problems that stopped it."""
    problems: list[str] = []
    if seg.header is None and not storage.exists(f"{seg.rel}/zarr.json"):
        # The header is the first object a writer creates (atomically): without it the rank was
        # stopped while setting up, before any data chunk, so there is nothing to salvage.
        note = (
            f"{storage.describe(seg.rel)}: rank {seg.rank}'s segment has no header (the rank stopped before "
            "its segment was set up); nothing to salvage from it"
        )
        empty = np.zeros((0, FS.INDEX_COLUMNS), dtype=np.int64)
        return LoadedSegment(seg, [], [], empty, F.DEFAULT_CHUNK_BYTES), [note]
    header = seg.header or {}
    if seg.header is not None:  # never misread another format
        F.check_version(header, storage.describe(f"{seg.rel}/zarr.json"), spill=True)
    chunk_bytes = header.get("chunk_bytes")
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or not 1 <= chunk_bytes <= (1 << 34):
        raise CorruptSpillError(f"{storage.describe(seg.rel)}: segment header has no valid chunk_bytes", rank=seg.rank)
    filenames: list[str] = []
    layouts: list[FS.Layout] = []
    parts: list[np.ndarray] = []
    check_parts: list[np.ndarray] = []
    for n in itertools.count():  # n: the entries read, once the loop ends
        rel = f"{seg.rel}/{FS.journal_name(n)}"
        blob = storage.get_or_none(rel, max_bytes=FS.journal_max_bytes(chunk_bytes))
        if blob is None:
            # Entries land in chunk order: a later one without this one is damage, not the end.
            names = storage.listdir(f"{seg.rel}/{FS.JOURNAL_NAME}")
            later = [e for e in names if e.isascii() and e.isdigit() and int(e) > n]  # '²' is a digit to isdigit
            if later:
                problems.append(f"{storage.describe(rel)}: journal entry missing, but {len(later)} later one(s) exist")
            break
        try:
            entry = FS.decode_journal(blob, path=storage.describe(rel))
            if (
                entry.chunk != n
                or entry.file_base != len(filenames)
                or entry.layout_base != len(layouts)
                or (entry.checks is not None and entry.check_base != sum(map(len, check_parts)))
            ):
                raise CorruptSpillError(
                    f"{storage.describe(rel)}: journal entry out of sequence", path=storage.describe(rel)
                )
        except CorruptSpillError as exc:
            problems.append(str(exc))
            break
        filenames.extend(entry.filenames)
        layouts.extend(entry.layouts)
        parts.append(entry.rows)
        if entry.checks is not None:
            check_parts.append(entry.checks)
    index = np.concatenate(parts) if parts else np.zeros((0, FS.INDEX_COLUMNS), dtype=np.int64)

    def bad(msg: str, rel: str = "") -> CorruptSpillError:  # the journal, whatever object a check names
        return corrupt(storage, seg, msg, FS.JOURNAL_NAME)

    # With on_duplicate="last" a later write of a key replaces the earlier one: keep the last
    # write's rows.
    if len(index):
        index = _last_writes(index, layouts)

    if len(set(filenames)) != len(filenames):
        raise bad("journal lists a filename twice")
    checks = np.concatenate(check_parts) if check_parts else None
    _validate_rows(bad, filenames, layouts, index, n * chunk_bytes, checks, chunk_bytes)
    return LoadedSegment(seg, filenames, layouts, index, chunk_bytes, checks=checks), problems


@dataclass(frozen=True, slots=True)
class Extent:
    """The bytes of one leaf of one stored frame: what a duplicate is compared by."""

    segment: LoadedSegment
    """Segment whose ``data`` holds them."""
    offset: int
    """Byte offset in that ``data``."""
    nbytes: int
    crc: int
    """CRC-32C the index gives for them."""


_COMPARE_WINDOW = 1 << 20


def data_ranges(seg: LoadedSegment, offset: int, nbytes: int) -> list[tuple[str, int, int]]:
    """Byte ranges ``(rel, start, stop)`` of bytes ``[offset, offset + nbytes)`` of a segment's
    ``data``, one per chunk object they touch, for :meth:`Storage.read_into`."""
    out = []
    cb, end = seg.chunk_bytes, offset + nbytes
    while offset < end:
        c = offset // cb
        stop = min(end, (c + 1) * cb)
        out.append((f"{seg.seg.rel}/{FS.DATA_NAME}/c/{c}", offset - c * cb, stop - c * cb))
        offset = stop
    return out


def check_of(seg: LoadedSegment, crc: int) -> tuple[int, int, int]:
    """``(offset, nbytes, CRC-32C)`` of the block checksum an index row's negative ``crc``
    points at (validated at load: it exists and holds the row)."""
    assert seg.checks is not None
    off, nb, value = seg.checks[-1 - crc].tolist()
    return off, nb, value


def verify_block(storage: Storage, seg: LoadedSegment, crc: int) -> None:
    """Read the block an index row's negative ``crc`` points at and check its CRC-32C (a block
    lies in one data chunk: at most ``chunk_bytes`` read)."""
    off, nb, value = check_of(seg, crc)
    buf = np.empty(nb, dtype=np.uint8)
    storage.read_into(data_ranges(seg, off, nb), buf.data)
    if _crc.value(buf) != value:
        raise mismatch(storage, seg.seg, f"for the block at bytes {off}..{off + nb}", f"block checksum {-1 - crc}, ")


def same_bytes(storage: Storage, a: Sequence[Extent], b: Sequence[Extent]) -> bool:
    """True when two stored copies of a frame (their leaves, in the same order) hold the same
    bytes, which equal checksums do not prove (CRC-32C collides). Both are read
    ``_COMPARE_WINDOW`` bytes at a time, each leaf's CRC-32C checked on the way: a corrupt copy
    is reported as corrupt, not as different content."""
    if len(a) != len(b) or any(x.nbytes != y.nbytes for x, y in zip(a, b, strict=True)):
        return False
    size = min(_COMPARE_WINDOW, max((x.nbytes for x in a), default=0))
    buf_a, buf_b = np.empty(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)
    # A handle cache of its own: the caller's storage may never be closed if the plan raises.
    reader = Storage(storage.url, storage.storage_options)
    equal = True
    try:
        for x, y in zip(a, b, strict=True):
            crc_x = crc_y = 0
            for start in range(0, x.nbytes, _COMPARE_WINDOW):
                n = min(_COMPARE_WINDOW, x.nbytes - start)
                reader.read_into(data_ranges(x.segment, x.offset + start, n), buf_a[:n].data)
                reader.read_into(data_ranges(y.segment, y.offset + start, n), buf_b[:n].data)
                crc_x = _crc.extend(crc_x, buf_a[:n])
                crc_y = _crc.extend(crc_y, buf_b[:n])
                equal = equal and bool(np.array_equal(buf_a[:n], buf_b[:n]))
            for e, got in ((x, crc_x), (y, crc_y)):
                if e.crc < 0:  # checked by a block checksum: check the whole block
                    verify_block(reader, e.segment, e.crc)
                elif got != e.crc:
                    raise mismatch(storage, e.segment.seg, f"at bytes {e.offset}..{e.offset + e.nbytes}")
    finally:
        reader.close()
    return equal


def _last_writes(index: np.ndarray, layouts: list[FS.Layout]) -> np.ndarray:
    """Keep only the rows of the last write of each ``(file, frame)`` of a journal: a write's rows
    are contiguous with strictly increasing leaf paths, so one starts where the key changes or a
    leaf path does not increase (a rewrite may have other shapes or other leaves)."""
    lid = index[:, FS.COL_LAYOUT]
    if lid.min() < 0 or lid.max() >= len(layouts):
        return index  # _validate_rows names the bad row
    fid, frame, leaf = index[:, FS.COL_FILE], index[:, FS.COL_FRAME], _leaf_ids(layouts)[lid]
    starts = np.ones(len(index), dtype=bool)
    starts[1:] = (fid[1:] != fid[:-1]) | (frame[1:] != frame[:-1]) | (leaf[1:] <= leaf[:-1])
    write = np.cumsum(starts) - 1
    _, inverse = np.unique(index[:, [FS.COL_FILE, FS.COL_FRAME]], axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    last = np.full(int(inverse.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(last, inverse, write)
    return index[write == last[inverse]]


def committed_keys(root: str, storage_options: dict[str, Any] | None = None) -> dict[str, set[int]]:
    """Filename → frame indices already committed under a spill root, by any rank and session.

    A rerun after a crash can skip these keys; the merge unions all sessions."""
    return load_committed_keys(Storage(root, storage_options))


def load_committed_keys(storage: Storage, *, exclude: str | None = None) -> dict[str, set[int]]:
    """Filename → frame indices already committed under the root (every rank, every segment but
    ``exclude``)."""
    out: dict[str, set[int]] = {}
    for segs in scan(storage).values():
        for seg in segs:
            if seg.commit is None or seg.name == exclude:
                continue
            loaded = load_segment(storage, seg)
            for fid, frame in set(map(tuple, loaded.index[:, :2].tolist())):
                out.setdefault(loaded.filenames[fid], set()).add(frame)
    return out
