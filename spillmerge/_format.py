"""On-disk format version 2: names, dtype table, node-name encoding and record schemas.

docs/FORMAT.md is the normative description; keep the two in step.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import socket
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ._errors import CorruptSpillError, FormatVersionError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Versions this spillmerge reads: version 1 spill roots are a subset of version 2; version 1
outputs are read by the reader's version-1 path (docs/FORMAT.md section 5)."""

RANK_PREFIX = "rank-"
SEGMENT_PREFIX = "seg-"
COMMIT_NAME = "commit.json"
FAILURE_NAME = "failed.json"
COMPLETE_NAME = "spillmerge-complete.json"
MERGE_FAILED_NAME = "spillmerge-failed.json"
DATA_NAME = "data"
INDEX_NAME = "index"
CATALOG_NAME = "catalog"
JOURNAL_NAME = "journal"
JOURNAL_MAGIC = b"SMJ1"
INDEX_COLUMNS = 6  # file_id, frame_idx, layout_id, offset, nbytes, crc32c
COL_FILE, COL_FRAME, COL_LAYOUT, COL_OFFSET, COL_NBYTES, COL_CRC = range(INDEX_COLUMNS)

DEFAULT_CHUNK_BYTES = 16 << 20
#: Largest single leaf (bytes) and largest declared spill (bytes) a reader accepts from an index;
#: guards against hostile indexes asking for absurd allocations.
MAX_LEAF_BYTES = 1 << 40
MAX_NDIM = 32

# Size limits of the objects a reader reads whole (docs/FORMAT.md, *Size limits*). Storage is
# untrusted: each is checked before a byte is read, so no object can make a reader allocate more.
RECORD_MAX_BYTES = 64 << 10
"""Segment header, commit record, the ``zarr.json`` of index and catalog, part record, marker."""
FAILURE_MAX_BYTES = 1 << 20
"""Failure records (spill and part): bounded message and traceback (``exception_fields``)."""
ARRAY_DOC_MAX_BYTES = 1 << 20
"""An output array's or group's ``zarr.json`` (its attributes hold one filename)."""
ROOT_DOC_MAX_BYTES = 256 << 20
"""An output's root ``zarr.json``: the consolidated metadata of every node."""
_HARD_MAX_BYTES = 1 << 31


def catalog_max_bytes(n_files: int, n_rows: int) -> int:
    """Largest catalog a commit record of ``n_files`` files and ``n_rows`` rows admits: 1 MiB,
    plus 64 KiB per filename, plus 4 KiB per row (at most one layout per row), and never above 2 GiB."""
    return min(_HARD_MAX_BYTES, (1 << 20) + (64 << 10) * n_files + (4 << 10) * n_rows)


def chunk_max_bytes(meta: Any, *, path: str) -> int:
    """Largest chunk object an output array's ``zarr.json`` admits: its chunk's elements at their
    item size (64 KiB per string, the catalog's bound per filename), plus an eighth and 64 KiB
    for what a compressor adds to incompressible data, and the 4 CRC-32C bytes."""
    try:
        shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
        n = 1
        for d in shape:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ValueError(f"chunk shape {shape!r}")
            n *= d
        dt = meta["data_type"]
        item = (64 << 10) + 4 if dt == "string" else np.dtype(dt).itemsize
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptSpillError(f"{path}: malformed array metadata ({exc!r:.200})", path=path) from None
    raw = n * item
    return raw + raw // 8 + (64 << 10) + 4


def journal_max_bytes(chunk_bytes: int) -> int:
    """Largest journal entry of a segment of ``chunk_bytes`` chunks: 64 MiB of header (the catalog
    entries first used), plus one 48-byte row per byte of the chunk, and never above 1 GiB."""
    return min(_HARD_MAX_BYTES // 2, (64 << 20) + INDEX_COLUMNS * 8 * chunk_bytes + 12)


_RANK_RE = re.compile(r"^rank-(\d{5,})$")
_SEGMENT_RE = re.compile(r"^seg-(\d{6,})-(\d{8}T\d{12}Z)-[0-9a-f]{8}$")


def rank_dirname(rank: int) -> str:
    return f"{RANK_PREFIX}{rank:05d}"


def parse_rank_dirname(name: str) -> int | None:
    m = _RANK_RE.match(name)
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
    m = _SEGMENT_RE.match(name)
    if not m:
        raise ValueError(name)
    return int(m.group(1)), m.group(2)


def is_segment_name(name: str) -> bool:
    return bool(_SEGMENT_RE.match(name))


def utcnow() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def dumps(obj: Any) -> bytes:
    """Deterministic JSON (sorted keys) as UTF-8 bytes."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, allow_nan=False).encode("utf-8")


# A JSON escape of a UTF-16 surrogate: valid in pairs, a lone one decodes to a str no UTF-8
# encoder (filesystem, hash, zarr) accepts.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def loads(data: bytes, *, path: str) -> Any:
    """Parse a JSON record read from storage; every problem is a :class:`CorruptSpillError`,
    lone surrogates (``"\\ud800"``) in any string included, so no name from storage can fail later
    as a ``UnicodeEncodeError``."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptSpillError(f"{path}: not valid UTF-8 JSON ({exc})", path=path) from None
    if _SURROGATE_ESCAPE.search(data):  # rare: only then pay for a second pass
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            raise CorruptSpillError(
                f"{path}: holds a lone surrogate {bad!r} in a string: not valid Unicode text", path=path
            ) from None
    return obj


# --------------------------------------------------------------------------------------------
# dtypes


@dataclass(frozen=True, slots=True)
class DType:
    """One entry of the dtype table (docs/FORMAT.md section 3)."""

    name: str
    """Format name (the torch name without ``torch.``)."""
    itemsize: int
    """Bytes per element."""
    storage: str
    """numpy dtype name used for output arrays (raw bits for torch-only types)."""
    native: bool
    """True when numpy has this type itself (``storage == name``)."""
    kind: str = "num"
    """``num`` (a numeric array), or one of the non-numeric kinds ``str``, ``bytes``, ``pickle``,
    ``strlist``, ``none`` (docs/FORMAT.md section 1, *catalog*)."""

    @property
    def numeric(self) -> bool:
        return self.kind == "num"


_NATIVE = [
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
_RAW = {
    "bfloat16": "uint16",
    "complex32": "uint32",
    "float8_e4m3fn": "uint8",
    "float8_e4m3fnuz": "uint8",
    "float8_e5m2": "uint8",
    "float8_e5m2fnuz": "uint8",
    "float8_e8m0fnu": "uint8",
    "float4_e2m1fn_x2": "uint8",  # two 4-bit floats packed in each byte
    "bits1x8": "uint8",
    "bits2x4": "uint8",
    "bits4x2": "uint8",
    "bits8": "uint8",
    "bits16": "uint16",
}

DTYPES: dict[str, DType] = {}
for _n in _NATIVE:
    DTYPES[_n] = DType(_n, np.dtype(_n).itemsize, _n, True)
for _n, _s in _RAW.items():
    DTYPES[_n] = DType(_n, np.dtype(_s).itemsize, _s, False)
#: Non-numeric kinds (version 2): bytes in ``data`` as docs/FORMAT.md section 1 says; itemsize 1
#: (a byte), ``none`` 0. Their layout shape is ``[n_bytes]`` (``[n, n_bytes]`` for ``strlist``,
#: ``[]`` for ``none``).
NON_NUMERIC = ("str", "bytes", "pickle", "strlist", "none")
for _n in NON_NUMERIC:
    DTYPES[_n] = DType(_n, 0 if _n == "none" else 1, "uint8", False, _n)
_LAYOUT_NDIM = {"str": 1, "bytes": 1, "pickle": 1, "strlist": 2, "none": 0}


def get_dtype(name: object, *, path: str = "?") -> DType:
    if not isinstance(name, str) or name not in DTYPES:
        raise CorruptSpillError(f"{path}: unknown dtype {name!r}", path=path)
    return DTYPES[name]


# --------------------------------------------------------------------------------------------
# node names (docs/FORMAT.md "Node names")

_SAFE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]")
# Names zarr uses itself ("zarr.json", "zarr.*.partial" temporaries) and names Windows reserves.
_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}


def _plain_ok(name: str) -> bool:
    if not _SAFE_RE.match(name):
        return False
    low = name.lower()
    return not low.startswith("zarr.") and low.split(".", 1)[0] not in _RESERVED


def hashed_name(name: str) -> str:
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    slug = _SLUG_RE.sub("_", name).lstrip("._")[:60]
    if slug.lower().startswith("zarr.") or slug.lower().split(".", 1)[0] in _RESERVED:
        slug = "_" + slug[:59]
    return f"{slug}~{digest}"


def node_names(names: list[str]) -> dict[str, str]:
    """Map each string to a zarr node name that is safe on every filesystem and unique, also
    case-insensitively, among ``names``. Deterministic for a given set of names."""
    folded: dict[str, int] = {}
    for n in names:
        if _plain_ok(n):
            folded[n.lower()] = folded.get(n.lower(), 0) + 1
    out: dict[str, str] = {}
    for n in names:
        out[n] = n if _plain_ok(n) and folded[n.lower()] == 1 else hashed_name(n)
    if len(set(out.values())) != len(out):  # 64-bit hash collision: refuse rather than overwrite
        raise CorruptSpillError("two names map to the same node name; rename one of them")
    return out


VALUE_COLUMN = "__value__"
"""Column name of the leaf ``[]`` (a frame value that is itself a tensor, string ...)."""


def leaf_text(leaf: tuple[str, ...]) -> str:
    """The string a column name is encoded from: the keys joined by ``/`` (JSON when a key holds
    ``/`` or is empty, so two leaf paths never share it by accident)."""
    return "/".join(leaf) if all(k and "/" not in k for k in leaf) else json.dumps(list(leaf), ensure_ascii=True)


def split_column_name(base: str, dtype: str) -> str:
    """The hashed name of a leaf's ``dtype`` column when ``base.dtype`` is taken (docs/FORMAT.md)."""
    return hashed_name(f"{base}\x00{dtype}")


def column_name_choices(leaf: tuple[str, ...], dtype: str | None) -> set[str]:
    """Every name a merge may give the column of ``leaf`` (and, for a leaf split by dtype,
    ``dtype``): readers refuse a column group whose name is not one of them (docs/FORMAT.md
    section 2, *Columns*)."""
    if not leaf:
        bases = {VALUE_COLUMN}
    else:
        text = leaf_text(leaf)
        bases = {hashed_name(text), *([text] if _plain_ok(text) else [])}
    out = set(bases)
    if dtype is not None:
        out |= {f"{b}.{dtype}" for b in bases} | {split_column_name(b, dtype) for b in bases}
    return out


def is_safe_node_name(name: str) -> bool:
    return bool(_SAFE_RE.match(name)) or bool(re.match(r"^[A-Za-z0-9._-]{0,60}~[0-9a-f]{16}$", name))


# --------------------------------------------------------------------------------------------
# records


def _check_header(obj: Any, kind: str, path: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise CorruptSpillError(f"{path}: expected a JSON object", path=path)
    version = obj.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise FormatVersionError(
            f"{path}: format_version {version!r} is not supported by this spillmerge "
            f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade spillmerge or re-spill",
            path=path,
        )
    if obj.get("kind") != kind:
        raise CorruptSpillError(f"{path}: expected kind {kind!r}, got {obj.get('kind')!r}", path=path)
    return obj


def _int(obj: dict[str, Any], key: str, path: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CorruptSpillError(f"{path}: field {key!r} must be an integer in [{lo}, {hi}], got {v!r}", path=path)
    return v


def _str_or_none(obj: dict[str, Any], key: str, path: str) -> str | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise CorruptSpillError(f"{path}: field {key!r} must be a string", path=path)
    return v


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """Contents of ``commit.json``: written last; its presence means the segment is complete."""

    rank: int
    """Rank that wrote the segment."""
    world_size: int
    """World size the writer ran with."""
    segment: str
    """Segment folder name."""
    run_id: str | None
    """Identifier shared by the ranks of one job run."""
    n_rows: int
    """Rows in ``index``."""
    n_frames: int
    """Distinct frames written."""
    n_files: int
    """Distinct filenames written."""
    nbytes: int
    """Payload bytes in ``data`` (without padding)."""
    n_chunks: int
    """Chunk objects of ``data``."""
    chunk_bytes: int
    """Chunk size of ``data``."""
    index_crc32c: int
    """CRC-32C of the raw index bytes."""
    catalog_crc32c: int
    """CRC-32C of the catalog JSON bytes."""
    finished: str
    """UTC time the commit was written."""
    rewrites: int = 0
    """Writes of a key this segment already held, dropped by the writer's duplicate policy (0 in
    records written before the field existed)."""

    def to_json(self) -> bytes:
        return dumps({"format_version": FORMAT_VERSION, "kind": "spill-commit", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> CommitRecord:
        obj = _check_header(loads(data, path=path), "spill-commit", path)
        segment = obj.get("segment")
        if not isinstance(segment, str) or not is_segment_name(segment):
            raise CorruptSpillError(f"{path}: bad segment name {segment!r}", path=path)
        finished = obj.get("finished")
        return cls(
            rank=_int(obj, "rank", path, hi=1 << 24),
            world_size=_int(obj, "world_size", path, lo=1, hi=1 << 24),
            segment=segment,
            run_id=_str_or_none(obj, "run_id", path),
            n_rows=_int(obj, "n_rows", path, hi=1 << 40),
            n_frames=_int(obj, "n_frames", path, hi=1 << 40),
            n_files=_int(obj, "n_files", path, hi=1 << 40),
            nbytes=_int(obj, "nbytes", path, hi=1 << 56),
            n_chunks=_int(obj, "n_chunks", path, hi=1 << 40),
            chunk_bytes=_int(obj, "chunk_bytes", path, lo=1, hi=1 << 34),
            index_crc32c=_int(obj, "index_crc32c", path, hi=0xFFFFFFFF),
            catalog_crc32c=_int(obj, "catalog_crc32c", path, hi=0xFFFFFFFF),
            finished=str(finished),
            rewrites=_int(obj, "rewrites", path, hi=1 << 40) if "rewrites" in obj else 0,
        )


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """Contents of ``failed.json``: the writer session ended on an exception."""

    rank: int
    """Rank whose writer failed."""
    world_size: int
    """World size the writer ran with."""
    segment: str
    """Segment folder name."""
    run_id: str | None
    """Run identifier of the writer."""
    error_type: str
    """Exception class name."""
    message: str
    """Exception message."""
    traceback: str
    """Formatted traceback."""
    time: str
    """UTC time of the failure."""

    def to_json(self) -> bytes:
        return dumps({"format_version": FORMAT_VERSION, "kind": "spill-failure", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> FailureRecord:
        obj = _check_header(loads(data, path=path), "spill-failure", path)
        return cls(
            rank=_int(obj, "rank", path, hi=1 << 24),
            world_size=_int(obj, "world_size", path, lo=1, hi=1 << 24),
            segment=str(obj.get("segment")),
            run_id=_str_or_none(obj, "run_id", path),
            error_type=str(obj.get("error_type"))[:200],
            message=str(obj.get("message"))[:2000],
            traceback=str(obj.get("traceback"))[:20000],
            time=str(obj.get("time")),
        )

    def summary(self) -> str:
        return f"{self.error_type}: {self.message}"


def exception_fields(exc: BaseException, *, message_chars: int = 2000) -> tuple[str, str, str]:
    """``(error_type, message, traceback)`` of a failure record, each bounded in size (every
    failure record is built from these)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return type(exc).__name__, str(exc)[:message_chars], tb[-20000:]


def _host() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def _failure_now(exc: BaseException, *, message_chars: int) -> dict[str, Any]:
    """The fields a process failure record (part or merge) takes from ``exc`` and this process."""
    error_type, message, tb = exception_fields(exc, message_chars=message_chars)
    host, pid = _host()
    return {"error_type": error_type, "message": message, "traceback": tb, "time": utcnow(), "host": host, "pid": pid}


def _failure_read(obj: dict[str, Any], *, message_chars: int, missing: Any, missing_type: Any) -> dict[str, Any]:
    """The same fields read back from a record's JSON object, bounded (``missing_type`` stands in
    for an absent error type, ``missing`` for an absent message or traceback)."""
    return {
        "error_type": str(obj.get("error_type", missing_type))[:200],
        "message": str(obj.get("message", missing))[:message_chars],
        "traceback": str(obj.get("traceback", missing))[-20000:],
        "time": str(obj.get("time")),
        "host": str(obj.get("host"))[:256],
        "pid": _int_or_none(obj, "pid") or 0,
    }


@dataclass(frozen=True, slots=True)
class PartDoneRecord:
    """``OUT/spillmerge-parts/part-I-of-N.json``: part ``I`` of an output written in parts is done."""

    part: int
    """Which part, 0-based."""
    parts: int
    """Number of parts of the merge."""
    plan: str
    """Plan fingerprint; every part of one output has the same."""
    rank: int | None
    """Rank of a collective merge (``SpillWriter.merge(parallel=True)``), else None."""
    run_id: str | None
    """Run id of a collective merge."""
    n_files: int
    """Files the part wrote."""
    n_frames: int
    """Frames the part wrote."""
    nbytes: int
    """Payload bytes the part wrote."""
    codec: str
    """Output codec."""
    chunk_bytes: int
    """Target output chunk size."""
    finished: str
    """UTC time the record was written."""
    host: str
    """Host of the writing process."""
    pid: int
    """Its process id."""

    @classmethod
    def now(cls, **fields: Any) -> PartDoneRecord:
        host, pid = _host()
        return cls(finished=utcnow(), host=host, pid=pid, **fields)

    def to_json(self) -> bytes:
        return dumps({"format_version": FORMAT_VERSION, "kind": "merge-part", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str, part: int, parts: int) -> PartDoneRecord:
        obj = _part_header(data, "merge-part", path, part, parts)
        return cls(
            part=part,
            parts=parts,
            plan=obj["plan"],
            rank=_int_or_none(obj, "rank"),
            run_id=_str_or_none(obj, "run_id", path),
            n_files=_int(obj, "n_files", path, hi=1 << 40),
            n_frames=_int(obj, "n_frames", path, hi=1 << 40),
            nbytes=_int(obj, "nbytes", path, hi=1 << 56),
            codec=str(obj.get("codec")),
            chunk_bytes=_int(obj, "chunk_bytes", path, lo=1, hi=1 << 40),
            finished=str(obj.get("finished")),
            host=str(obj.get("host"))[:256],
            pid=_int_or_none(obj, "pid") or 0,
        )


@dataclass(frozen=True, slots=True)
class PartFailureRecord:
    """``OUT/spillmerge-parts/part-I-of-N.failed.json``: part ``I`` raised (removed when it reruns)."""

    part: int
    """Which part, 0-based."""
    parts: int
    """Number of parts of the merge."""
    plan: str
    """Plan fingerprint of the failed attempt."""
    rank: int | None
    """Rank of a collective merge, else None."""
    run_id: str | None
    """Run id of a collective merge (tells this attempt's failure from an earlier one's)."""
    error_type: str
    """Exception class name."""
    message: str
    """Exception message."""
    traceback: str
    """Formatted traceback."""
    time: str
    """UTC time of the failure."""
    host: str
    """Host of the failed process."""
    pid: int
    """Its process id."""

    @classmethod
    def of(cls, exc: BaseException, **fields: Any) -> PartFailureRecord:
        return cls(**_failure_now(exc, message_chars=4000), **fields)

    def to_json(self) -> bytes:
        return dumps({"format_version": FORMAT_VERSION, "kind": "merge-part-failure", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str, part: int, parts: int) -> PartFailureRecord:
        obj = _part_header(data, "merge-part-failure", path, part, parts)
        return cls(
            part=part,
            parts=parts,
            plan=obj["plan"],
            rank=_int_or_none(obj, "rank"),
            run_id=_str_or_none(obj, "run_id", path),
            **_failure_read(obj, message_chars=4000, missing="", missing_type="Error"),
        )

    def summary(self) -> str:
        return f"{self.error_type}: {self.message}"


def _part_header(data: bytes, kind: str, path: str, part: int, parts: int) -> dict[str, Any]:
    """A part record's object, checked to be the record its name says it is."""
    obj = loads(data, path=path)
    ok = (
        isinstance(obj, dict)
        and obj.get("kind") == kind
        and obj.get("part") == part
        and obj.get("parts") == parts
        and isinstance(obj.get("plan"), str)
    )
    if not ok:
        raise CorruptSpillError(f"{path}: not a spillmerge {kind} record for part {part} of {parts}", path=path)
    if obj.get("format_version") not in READABLE_VERSIONS or isinstance(obj.get("format_version"), bool):
        raise FormatVersionError(f"{path}: unknown format_version {obj.get('format_version')!r}", path=path)
    return dict(obj)


def _int_or_none(obj: dict[str, Any], key: str) -> int | None:
    v = obj.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """A segment's ``zarr.json`` (a zarr group) attributes, key ``spillmerge``: the first object a
    writer creates. Readers read it leniently (``_spillroot.Segment.header``): only
    ``chunk_bytes`` is required, to salvage a segment that never committed."""

    rank: int
    """Rank that writes the segment."""
    world_size: int
    """World size the writer runs with."""
    segment: str
    """Segment folder name."""
    run_id: str | None
    """Identifier shared by the ranks of one job run."""
    chunk_bytes: int
    """Size of each data chunk object."""
    started: str
    """UTC time the writer opened the segment."""

    def to_json(self) -> bytes:
        """The whole ``zarr.json`` document of the segment group."""
        attrs = {"format_version": FORMAT_VERSION, "kind": "spill-segment", **asdict(self)}
        return dumps({"zarr_format": 3, "node_type": "group", "attributes": {"spillmerge": attrs}})


@dataclass(frozen=True, slots=True)
class OutputHeader:
    """The merged output's root ``zarr.json`` attributes, key ``spillmerge``."""

    n_files: int
    """Filenames in the output."""
    n_frames: int
    """Rows over all files."""
    nbytes: int
    """Payload bytes."""
    ranks: list[int]
    """Ranks whose segments were merged."""
    world_size: int
    """World size of the spill."""
    segments: int
    """Segments merged."""
    created: str
    """UTC time the merge planned the output."""
    file_layouts: list[list[str]]
    """The distinct column sets of the files (``index/file_layout`` points into it)."""

    def to_obj(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "kind": "merged", **asdict(self)}


@dataclass(frozen=True, slots=True)
class MergeFailureRecord:
    """``ROOT/spillmerge-failed.json`` (in the spill root): the merge of ``SpillWriter.merge``
    failed on the merging rank, so ranks waiting for the output (``wait=True``) raise at once
    instead of at the timeout. Only its ``run_id``'s waiting ranks read it; a later failure
    replaces it."""

    rank: int
    """The merging rank."""
    run_id: str | None
    """Run id of the job whose merge failed (waiting ranks of other runs ignore it)."""
    session: int
    """Which writer session of the run (a rerun in the same job ignores an earlier round's)."""
    error_type: str
    """Exception class name."""
    message: str
    """Exception message."""
    traceback: str
    """Formatted traceback."""
    time: str
    """UTC time of the failure."""
    host: str
    """Host of the merging process."""
    pid: int
    """Its process id."""

    @classmethod
    def of(cls, exc: BaseException, *, rank: int, run_id: str | None, session: int) -> MergeFailureRecord:
        return cls(rank=rank, run_id=run_id, session=session, **_failure_now(exc, message_chars=2000))

    def to_json(self) -> bytes:
        return dumps({"format_version": FORMAT_VERSION, "kind": "merge-failure", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> MergeFailureRecord:
        obj = _check_header(loads(data, path=path), "merge-failure", path)
        return cls(
            rank=_int(obj, "rank", path, hi=1 << 24),
            run_id=_str_or_none(obj, "run_id", path),
            session=_int(obj, "session", path, hi=1 << 40),
            **_failure_read(obj, message_chars=2000, missing=None, missing_type=None),
        )

    def summary(self) -> str:
        return f"{self.error_type}: {self.message}"


@dataclass(frozen=True, slots=True)
class CompletionMarker:
    """``OUT/spillmerge-complete.json``: written last; its presence means the output is whole."""

    n_files: int
    """Filenames in the output."""
    n_frames: int
    """Rows over all files."""
    nbytes: int
    """Payload bytes."""
    finished: str
    """UTC time the marker was written."""
    written_by: dict[str, Any]
    """The run that wrote it: its lease's ``owner`` token, ``role``, ``host``, ``pid``."""
    spill_root: str
    """The spill root it merged."""
    plan: str
    """Plan fingerprint."""
    run_id: str | None
    """Run id the merge waited for (None: the newest segments)."""
    session: int | None = None
    """The writer session of the run it serves (``SpillWriter.merge``; None from the CLI): ranks
    waiting for this merge (``wait=True``) tell its marker from an earlier round's by it."""

    def to_json(self) -> bytes:
        return dumps({"format_version": FORMAT_VERSION, "kind": "merge-complete", **asdict(self)})


@dataclass(frozen=True, slots=True)
class Layout:
    """One leaf layout of the catalog: where in the value, which dtype, which frame shape."""

    leaf: tuple[str, ...]
    """Dict keys from the value's root to the leaf (empty for a plain tensor)."""
    dtype: str
    """Dtype name from the dtype table."""
    shape: tuple[int, ...]
    """Shape of the leaf in one frame."""

    @property
    def nbytes(self) -> int:
        """Bytes of one row of this layout in ``data`` (docs/FORMAT.md section 1)."""
        dt = DTYPES[self.dtype]
        if dt.kind == "strlist":
            return self.shape[1]
        if not dt.numeric:
            return self.shape[0] if self.shape else 0
        n = dt.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def kind(self) -> str:
        return DTYPES[self.dtype].kind

    def to_obj(self) -> dict[str, Any]:
        return {"leaf": list(self.leaf), "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_obj(cls, obj: Any, *, path: str) -> Layout:
        if not isinstance(obj, dict):
            raise CorruptSpillError(f"{path}: layout must be an object", path=path)
        leaf, dtype, shape = obj.get("leaf"), obj.get("dtype"), obj.get("shape")
        if not isinstance(leaf, list) or not all(isinstance(k, str) for k in leaf) or len(leaf) > 64:
            raise CorruptSpillError(f"{path}: layout leaf must be a list of strings", path=path)
        get_dtype(dtype, path=path)
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 40) for d in shape)
        ):
            raise CorruptSpillError(f"{path}: layout shape must be a list of non-negative ints", path=path)
        want = _LAYOUT_NDIM.get(str(dtype))
        if want is not None and len(shape) != want:
            raise CorruptSpillError(f"{path}: a {dtype} layout has {want} dims, got shape {shape}", path=path)
        lay = cls(tuple(leaf), str(dtype), tuple(shape))
        if lay.nbytes > MAX_LEAF_BYTES:
            raise CorruptSpillError(f"{path}: layout {lay} is larger than {MAX_LEAF_BYTES} bytes", path=path)
        return lay

    def leaf_name(self) -> str:
        return "/".join(self.leaf) if self.leaf else "<tensor>"


# --------------------------------------------------------------------------------------------
# journal entries (docs/FORMAT.md "journal")


def journal_name(chunk: int) -> str:
    return f"{JOURNAL_NAME}/{chunk:06d}"


def encode_journal(
    chunk: int, file_base: int, files: list[str], layout_base: int, layouts: list[Layout], rows: np.ndarray
) -> bytes:
    import google_crc32c

    header = dumps(
        {
            "chunk": chunk,
            "file_base": file_base,
            "filenames": files,
            "layout_base": layout_base,
            "layouts": [lay.to_obj() for lay in layouts],
            "n_rows": len(rows),
        }
    )
    body = JOURNAL_MAGIC + len(header).to_bytes(4, "little") + header + rows.astype("<i8").tobytes()
    return body + google_crc32c.value(body).to_bytes(4, "little")


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


def decode_journal(blob: bytes, *, path: str) -> JournalEntry:
    import google_crc32c

    if len(blob) < 12 or blob[:4] != JOURNAL_MAGIC:
        raise CorruptSpillError(f"{path}: not a journal entry", path=path)
    if google_crc32c.value(blob[:-4]) != int.from_bytes(blob[-4:], "little"):
        raise CorruptSpillError(f"{path}: journal checksum mismatch (torn or corrupt)", path=path)
    hlen = int.from_bytes(blob[4:8], "little")
    if 8 + hlen > len(blob) - 4:
        raise CorruptSpillError(f"{path}: journal header length out of range", path=path)
    h = loads(blob[8 : 8 + hlen], path=path)
    raw = blob[8 + hlen : -4]
    if not isinstance(h, dict):
        raise CorruptSpillError(f"{path}: journal header must be an object", path=path)
    n = _int(h, "n_rows", path, hi=1 << 40)
    if len(raw) != n * INDEX_COLUMNS * 8:
        raise CorruptSpillError(f"{path}: journal rows do not match n_rows", path=path)
    files, lays = h.get("filenames"), h.get("layouts")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files) or not isinstance(lays, list):
        raise CorruptSpillError(f"{path}: journal catalog entries malformed", path=path)
    return JournalEntry(
        chunk=_int(h, "chunk", path, hi=1 << 40),
        file_base=_int(h, "file_base", path, hi=1 << 40),
        filenames=files,
        layout_base=_int(h, "layout_base", path, hi=1 << 40),
        layouts=[Layout.from_obj(o, path=path) for o in lays],
        rows=np.frombuffer(raw, dtype="<i8").reshape(n, INDEX_COLUMNS).astype(np.int64),
    )
