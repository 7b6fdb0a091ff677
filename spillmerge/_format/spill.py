"""On-disk format of a spill root (docs/FORMAT.md section 1): rank and segment names, the index
columns, and its records (segment header, catalog layouts, journal, commit and failure records)."""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._errors import CorruptSpillError
from . import common as F
from . import crc as _crc

RANK_PREFIX = "rank-"
SEGMENT_PREFIX = "seg-"
COMMIT_NAME = "commit.json"
FAILURE_NAME = "failed.json"
MERGE_FAILED_NAME = "spillmerge-failed.json"
DATA_NAME = "data"
INDEX_NAME = "index"
CATALOG_NAME = "catalog"
JOURNAL_NAME = "journal"
CHECKS_NAME = "checks"
CHECK_COLUMNS = 3  # offset, nbytes, crc32c of a range of data
JOURNAL_MAGIC = b"SMJ1"
INDEX_COLUMNS = 6  # file_id, frame_idx, layout_id, offset, nbytes, crc32c (or -1 - check id)
COL_FILE, COL_FRAME, COL_LAYOUT, COL_OFFSET, COL_NBYTES, COL_CRC = range(INDEX_COLUMNS)


def catalog_max_bytes(n_files: int, n_rows: int) -> int:
    """Largest catalog a commit record of ``n_files`` files and ``n_rows`` rows admits: 1 MiB,
    plus 64 KiB per filename, plus 4 KiB per row (at most one layout per row), and never above 2 GiB."""
    return min(F.HARD_MAX_BYTES, (1 << 20) + (64 << 10) * n_files + (4 << 10) * n_rows)


def journal_max_bytes(chunk_bytes: int) -> int:
    """Largest journal entry of a segment of ``chunk_bytes`` chunks: 64 MiB of header (the catalog
    entries first used), plus one 48-byte row per byte of the chunk, and never above 1 GiB."""
    return min(F.HARD_MAX_BYTES // 2, (64 << 20) + INDEX_COLUMNS * 8 * chunk_bytes + 12)


_RANK_RE = re.compile(r"rank-(\d{5,})")
_SEGMENT_RE = re.compile(r"seg-(\d{6,})-(\d{8}T\d{12}Z)-[0-9a-f]{8}")


def rank_dirname(rank: int) -> str:
    return f"{RANK_PREFIX}{rank:05d}"


def parse_rank_dirname(name: str) -> int | None:
    m = _RANK_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def new_segment_name(existing: list[str]) -> str:
    """``seg-SEQ-TIME-RAND``: SEQ is one more than the rank's highest existing segment, so a rank's
    segments order by SEQ whatever the clocks say; TIME (UTC, microseconds) orders segments of
    different ranks; RAND keeps two writers that wrongly share a rank apart."""
    seqs = [segment_sort_key(n)[0] for n in existing if is_segment_name(n)]
    now = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{SEGMENT_PREFIX}{max(seqs, default=-1) + 1:06d}-{now}-{os.urandom(4).hex()}"


def segment_sort_key(name: str) -> tuple[int, str]:
    """(sequence number, UTC time) of a segment name."""
    m = _SEGMENT_RE.fullmatch(name)
    if not m:
        raise ValueError(name)
    return int(m.group(1)), m.group(2)


def is_segment_name(name: str) -> bool:
    return bool(_SEGMENT_RE.fullmatch(name))


_LAYOUT_NDIM = {"str": 1, "bytes": 1, "pickle": 1, "strlist": 2, "none": 0}


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """Contents of ``commit.json``: written last; its presence means the segment is complete."""

    rank: int
    world_size: int
    segment: str
    run_id: str | None
    """Identifier shared by the ranks of one job run."""
    n_rows: int
    """Rows in ``index``."""
    n_frames: int
    n_files: int
    nbytes: int
    """Payload bytes in ``data`` (without padding)."""
    n_chunks: int
    chunk_bytes: int
    """Chunk size of ``data``."""
    index_crc32c: int
    """CRC-32C of the raw index bytes."""
    catalog_crc32c: int
    """CRC-32C of the catalog JSON bytes."""
    finished: str
    rewrites: int
    """Writes of a key this segment already held, dropped by the writer's duplicate policy."""
    n_checks: int
    """Rows of ``checks`` (0: the segment has no ``checks`` array: every row has its own CRC)."""
    checks_crc32c: int
    """CRC-32C of the raw ``checks`` bytes."""

    def to_json(self) -> bytes:
        return F.dumps({"format_version": F.SPILL_FORMAT_VERSION, "kind": "spill-commit", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> CommitRecord:
        obj = F.check_header(F.loads(data, path=path), "spill-commit", path)
        segment = obj.get("segment")
        if not isinstance(segment, str) or not is_segment_name(segment):
            raise CorruptSpillError(f"{path}: bad segment name {segment!r}", path=path)
        run_id, finished = F.str_or_none(obj, "run_id", path), str(obj.get("finished"))
        return cls(segment=segment, run_id=run_id, finished=finished, **F.int_fields(obj, path, _COMMIT_INTS))


MAX_WORLD_SIZE = 1 << 24
"""The largest world size a record may give (docs/FORMAT.md)."""
_RANK_INTS = {"rank": (0, MAX_WORLD_SIZE), "world_size": (1, MAX_WORLD_SIZE)}
_COMMIT_INTS = {
    **_RANK_INTS,
    **dict.fromkeys(("n_rows", "n_frames", "n_files", "n_chunks", "rewrites", "n_checks"), (0, 1 << 40)),
    "nbytes": (0, 1 << 56),
    "chunk_bytes": (1, 1 << 34),
    **dict.fromkeys(("index_crc32c", "catalog_crc32c", "checks_crc32c"), (0, 0xFFFFFFFF)),
}


@dataclass(frozen=True, slots=True)
class FailureRecord(F.ExceptionRecord):
    """Contents of ``failed.json``: the writer session ended on an exception."""

    rank: int
    world_size: int
    segment: str
    run_id: str | None

    def to_json(self) -> bytes:
        return F.dumps({"format_version": F.SPILL_FORMAT_VERSION, "kind": "spill-failure", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> FailureRecord:
        obj = F.check_header(F.loads(data, path=path), "spill-failure", path)
        fields = F.exception_read(obj, message_chars=2000, missing=None, missing_type=None)
        return cls(
            segment=str(obj.get("segment")),
            run_id=F.str_or_none(obj, "run_id", path),
            **(fields | F.int_fields(obj, path, _RANK_INTS)),
        )


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """A segment's ``zarr.json`` (a zarr group) attributes, key ``spillmerge``: the first object a
    writer creates. Readers read it leniently (``_spill.root.Segment.header``): only
    ``chunk_bytes`` is required, to salvage a segment that never committed."""

    rank: int
    world_size: int
    segment: str
    run_id: str | None
    chunk_bytes: int
    """Size of each data chunk object."""
    started: str
    expected: int | None = None
    """Frames the whole job will write (all ranks), when the user said (``SpillWriter(expected=)``);
    only ``spillmerge status`` reads it, to estimate the end."""

    def to_json(self) -> bytes:
        """The whole ``zarr.json`` document of the segment group."""
        attrs = {"format_version": F.SPILL_FORMAT_VERSION, "kind": "spill-segment", **asdict(self)}
        return F.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"spillmerge": attrs}})


@dataclass(frozen=True, slots=True)
class MergeFailureRecord(F.ProcessFailure):
    """``ROOT/spillmerge-failed.json``: ``SpillWriter.merge`` failed on the merging rank, so ranks
    waiting for the output (``wait=True``) raise at once, not at the timeout. Only its ``run_id``'s
    waiting ranks read it; a later failure replaces it."""

    rank: int
    """The merging rank."""
    run_id: str | None
    """Run id of the job whose merge failed (waiting ranks of other runs ignore it)."""
    session: int
    """Which writer session of the run (a rerun in the same job ignores an earlier round's)."""

    @classmethod
    def of(cls, exc: BaseException, *, rank: int, run_id: str | None, session: int) -> MergeFailureRecord:
        return cls(rank=rank, run_id=run_id, session=session, **F.failure_now(exc, message_chars=2000))

    def to_json(self) -> bytes:
        return F.dumps({"format_version": F.SPILL_FORMAT_VERSION, "kind": "merge-failure", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> MergeFailureRecord:
        obj = F.check_header(F.loads(data, path=path), "merge-failure", path)
        return cls(
            rank=F.int_field(obj, "rank", path, hi=MAX_WORLD_SIZE),
            run_id=F.str_or_none(obj, "run_id", path),
            session=F.int_field(obj, "session", path, hi=1 << 40),
            **F.failure_read(obj, message_chars=2000, missing=None, missing_type=None),
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """One leaf layout of the catalog: where in the value, which dtype, which frame shape."""

    leaf: tuple[str, ...]
    """Dict keys from the value's root to the leaf (empty for a plain tensor)."""
    dtype: str
    shape: tuple[int, ...]
    """Shape of the leaf in one frame."""
    pos: tuple[int, ...] | None = None
    """Per leaf segment, the key's position in the dict the user wrote (-1: a dict in sorted
    order, or a list item); None when every dict along the path was in sorted order
    (``_format.keyorder``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of one row of this layout in ``data`` (docs/FORMAT.md section 1)."""
        dt = F.DTYPES[self.dtype]
        if dt.kind == "strlist":
            return self.shape[1]
        if not dt.numeric:
            return self.shape[0] if self.shape else 0
        return dt.itemsize * math.prod(self.shape)

    @property
    def kind(self) -> str:
        return F.DTYPES[self.dtype].kind

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"leaf": list(self.leaf), "dtype": self.dtype, "shape": list(self.shape)}
        if self.pos is not None:
            obj["pos"] = list(self.pos)
        return obj

    @classmethod
    def many(cls, objs: list[Any], *, path: str) -> list[Layout]:
        """:meth:`from_obj` of each of ``objs`` (a catalog's layouts), each distinct layout
        checked once in this process: a list or string leaf has one layout per length (1,800 in
        an LLM segment), most of them again in every rank's segment and every merge."""
        out = []
        for obj in objs:
            key = _exact_key(obj)
            lay = None if key is None else _KNOWN.get(key)
            if lay is None:
                lay = cls.from_obj(obj, path=path)
                if key is not None:
                    if len(_KNOWN) >= KNOWN_LAYOUTS:
                        _KNOWN.clear()
                    _KNOWN[key] = lay
            out.append(lay)
        return out

    @classmethod
    def from_obj(cls, obj: Any, *, path: str) -> Layout:
        if not isinstance(obj, dict):
            raise CorruptSpillError(f"{path}: layout must be an object", path=path)
        leaf, dtype, shape = obj.get("leaf"), obj.get("dtype"), obj.get("shape")
        if not F.str_list(leaf) or len(leaf) > 64:
            raise CorruptSpillError(f"{path}: layout leaf must be a list of strings", path=path)
        if not isinstance(dtype, str) or dtype not in F.DTYPES:
            raise CorruptSpillError(f"{path}: unknown dtype {dtype!r}", path=path)
        dt = F.DTYPES[dtype]
        if not F.int_list(shape, hi=1 << 40, most=F.MAX_NDIM):
            raise CorruptSpillError(f"{path}: layout shape must be a list of non-negative ints", path=path)
        want = _LAYOUT_NDIM.get(dtype)
        if want is not None and len(shape) != want:
            raise CorruptSpillError(f"{path}: a {dtype} layout has {want} dims, got shape {shape}", path=path)
        pos = obj.get("pos")
        if pos is not None and (not F.int_list(pos, lo=-1, hi=1 << 31) or len(pos) != len(leaf)):
            what = f"layout pos must be one int >= -1 per leaf segment, got {pos!r:.200}"
            raise CorruptSpillError(f"{path}: {what}", path=path)
        lay = cls(tuple(leaf), dtype, tuple(shape), None if pos is None else tuple(pos))
        nbytes, kind = lay.nbytes, dt.kind
        if nbytes > F.MAX_LEAF_BYTES:
            raise CorruptSpillError(f"{path}: layout {lay} is larger than {F.MAX_LEAF_BYTES} bytes", path=path)
        # The writer's bounds (_values.check_leaf_limits), which every output reader enforces: a
        # merge of such a leaf would succeed and leave an unreadable output.
        bad = F.shape_problem(lay.shape) if kind == "num" and nbytes == 0 else None
        if kind == "strlist" and 4 * shape[0] > shape[1]:
            # each string has a 4-byte length in its bytes: 2**31 strings in 12 bytes would make
            # the merge's copy read lengths past the leaf
            bad = f"{shape[0]} strings cannot fit in {shape[1]} bytes (4 length bytes each)"
        if kind in ("str", "strlist") and nbytes > F.STRING_MAX_BYTES:
            bad = f"a string of {nbytes} bytes, more than {F.STRING_MAX_BYTES}"
        if bad is not None:
            raise CorruptSpillError(f"{path}: layout {lay}: {bad} (the format's limit)", path=path)
        return lay


KNOWN_LAYOUTS = 1 << 16
"""Layouts :meth:`Layout.many` keeps checked (then it starts afresh): a few MB."""
_KNOWN: dict[tuple[Any, ...], Layout] = {}


def _exact_key(obj: Any) -> tuple[Any, ...] | None:
    """A layout object's fields as a key equal only for the same JSON (ints as ints, never as the
    floats or booleans Python finds equal to them); None when its fields have other types."""
    if type(obj) is not dict:
        return None
    leaf, dtype, shape, pos = obj.get("leaf"), obj.get("dtype"), obj.get("shape"), obj.get("pos")
    if type(leaf) is not list or type(dtype) is not str or type(shape) is not list:
        return None
    if not (all(type(p) is str for p in leaf) and all(type(d) is int for d in shape)):
        return None
    if pos is not None and (type(pos) is not list or not all(type(d) is int for d in pos)):
        return None
    return (tuple(leaf), dtype, tuple(shape), None if pos is None else tuple(pos))


def text_problem(kind: str, count: int, row: Any) -> str | None:
    """What is wrong with the bytes of a ``str`` leaf (valid UTF-8) or a ``strlist`` leaf of
    ``count`` strings (``count`` uint32 lengths adding up to its size, each string valid UTF-8);
    None when sound. Shared by the merge's copy and ``verify``: a root verify calls sound merges."""
    buf = memoryview(row).cast("B") if not isinstance(row, np.ndarray) else row.view(np.uint8).reshape(-1)
    if kind == "strlist":
        n = len(buf)
        uneven = f"a list of {count} strings whose lengths do not add up to its {n} bytes"
        if 4 * count > n:
            return uneven
        lens = np.frombuffer(buf, dtype="<u4", count=count)
        ends = 4 * count + np.cumsum(lens, dtype=np.int64)
        if (int(ends[-1]) if count else 0) != n:
            return uneven
        pieces = [buf[s:e] for s, e in zip((ends - lens).tolist(), ends.tolist(), strict=True)]
    else:
        pieces = [buf]
    for b in pieces:
        try:
            bytes(b).decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"a string is not valid UTF-8 ({exc.reason} at byte {exc.start})"
    return None


# --------------------------------------------------------------------------------------------
# journal entries (docs/FORMAT.md "journal")


def journal_name(chunk: int) -> str:
    return f"{JOURNAL_NAME}/{chunk:06d}"


def encode_catalog(filenames: list[str], layouts: list[Layout]) -> bytes:
    """A segment's catalog (docs/FORMAT.md "catalog")."""
    return F.dumps({"filenames": filenames, "layouts": [lay.to_obj() for lay in layouts]})


def encode_journal(
    chunk: int, file_base: int, files: list[str], layout_base: int, layouts: list[Layout], rows: np.ndarray,
    check_base: int = 0, checks: np.ndarray | None = None,
) -> bytes:  # fmt: skip
    head: dict[str, Any] = {
        "chunk": chunk,
        "file_base": file_base,
        "filenames": files,
        "layout_base": layout_base,
        "layouts": [lay.to_obj() for lay in layouts],
        "n_rows": len(rows),
    }
    if checks is not None and len(checks):  # the block checksums of this chunk's rows
        head["check_base"] = check_base
        head["checks"] = checks.tolist()
    header = F.dumps(head)
    body = JOURNAL_MAGIC + len(header).to_bytes(4, "little") + header + rows.astype("<i8").tobytes()
    return body + _crc.value(body).to_bytes(4, "little")


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One decoded journal entry: what became durable with one data chunk."""

    chunk: int
    """Data chunk number it belongs to."""
    file_base: int
    """Catalog id of the first new filename."""
    filenames: list[str]
    """Filenames first used since the previous entry."""
    layout_base: int
    """Catalog id of the first new layout."""
    layouts: list[Layout]
    """Layouts first used since the previous entry."""
    rows: np.ndarray
    """int64 (n, 6) index rows completed in this chunk."""
    check_base: int = 0
    """Id of the first entry of ``checks``."""
    checks: np.ndarray | None = None
    """int64 (m, 3) block checksums (offset, nbytes, crc32c) first listed in this entry; None when
    it lists none."""


def decode_journal(blob: bytes, *, path: str) -> JournalEntry:
    if len(blob) < 12 or blob[:4] != JOURNAL_MAGIC:
        raise CorruptSpillError(f"{path}: not a journal entry", path=path)
    if _crc.value(blob[:-4]) != int.from_bytes(blob[-4:], "little"):
        raise CorruptSpillError(f"{path}: journal checksum mismatch (torn or corrupt)", path=path)
    hlen = int.from_bytes(blob[4:8], "little")
    if 8 + hlen > len(blob) - 4:
        raise CorruptSpillError(f"{path}: journal header length out of range", path=path)
    h = F.loads(blob[8 : 8 + hlen], path=path)
    raw = blob[8 + hlen : -4]
    if not isinstance(h, dict):
        raise CorruptSpillError(f"{path}: journal header must be an object", path=path)
    n = F.int_field(h, "n_rows", path, hi=1 << 40)
    if len(raw) != n * INDEX_COLUMNS * 8:
        raise CorruptSpillError(f"{path}: journal rows do not match n_rows", path=path)
    files, lays = h.get("filenames"), h.get("layouts")
    if not F.str_list(files) or not isinstance(lays, list):
        raise CorruptSpillError(f"{path}: journal catalog entries malformed", path=path)
    checks = None
    if "checks" in h:
        raw_checks = h["checks"]
        ok = isinstance(raw_checks, list) and all(F.int_list(c, hi=1 << 56) and len(c) == CHECK_COLUMNS for c in raw_checks)
        if not ok:
            raise CorruptSpillError(f"{path}: journal checks malformed", path=path)
        checks = np.array(raw_checks, dtype=np.int64).reshape(len(raw_checks), CHECK_COLUMNS)
    return JournalEntry(
        **F.int_fields(h, path, dict.fromkeys(("chunk", "file_base", "layout_base"), (0, 1 << 40))),
        filenames=files,
        layouts=[Layout.from_obj(o, path=path) for o in lays],
        rows=np.frombuffer(raw, dtype="<i8").reshape(n, INDEX_COLUMNS).astype(np.int64),
        check_base=F.int_field(h, "check_base", path, hi=1 << 40) if checks is not None else 0,
        checks=checks,
    )
