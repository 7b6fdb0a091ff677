"""On-disk format of a merged output (docs/FORMAT.md section 2): its records (output and column
headers, completion marker, part records) and what a path holds when it is no output."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import CorruptSpillError, NotAnOutputError
from . import codecs as _codecs
from . import common as F
from .spill import parse_rank_dirname

if TYPE_CHECKING:
    from .._storage import Storage

COMPLETE_NAME = "spillmerge-complete.json"


@dataclass(frozen=True, slots=True)
class ChunkLimits:
    """What one chunk of an output array may be, from its ``zarr.json`` checked against the
    format (docs/FORMAT.md, *Size limits*): every read of a chunk is bounded by it before zarr decodes."""

    object_bytes: int
    """Most bytes of the stored chunk object (decoded size, plus a compressor's worst case and
    the CRC)."""
    decoded_bytes: int
    """Most bytes its ``bytes`` form may have: what a compressor's header may declare."""
    compressor: str | None
    """``blosc``, ``zstd`` or None."""
    crc: bool
    """The chain ends in ``crc32c`` (4 bytes at the end of the object)."""


def _ints(v: Any, what: str) -> list[int]:
    v = list(v) if isinstance(v, tuple) else v  # (zarr's metadata objects give tuples)
    if not F.int_list(v, most=F.MAX_NDIM + 1):
        raise ValueError(f"{what} {v!r:.200} is not a list of at most {F.MAX_NDIM + 1} non-negative ints")
    return v


def chunk_limits(meta: Any, *, path: str) -> ChunkLimits:
    """The bounds of a chunk of the output array whose ``zarr.json`` is ``meta`` (a dict), or a
    :class:`CorruptSpillError` naming ``path`` when the metadata itself breaks the format (its
    message names the rule). Computed in Python ints, so nothing overflows."""
    try:
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        shape = _ints(meta.get("shape"), "shape")
        grid: Any = meta.get("chunk_grid")
        regular = isinstance(grid, dict) and grid.get("name") == "regular"
        config = grid.get("configuration") if regular else None
        if not isinstance(config, dict):
            raise ValueError(f"chunk grid {grid!r:.200} is not a regular grid")
        chunks = _ints(config.get("chunk_shape"), "chunk shape")
        if len(chunks) != len(shape) or 0 in chunks:
            raise ValueError(f"chunk shape {chunks} does not fit shape {shape}")
        big = [d for d, (c, s) in enumerate(zip(chunks, shape, strict=True)) if c > max(s, 1)]
        if big:
            raise ValueError(f"chunk shape {chunks} is larger than the array's shape {shape} in dimension {big[0]}")
        bad = F.shape_problem(shape[1:])
        if bad is not None:
            raise ValueError(f"a row's {bad}")
        compressor, crc = _codecs.chain(meta.get("codecs"))
        dt = meta.get("data_type")
        if not isinstance(dt, str):
            raise ValueError(f"data type {dt!r:.100} must be numeric and bytes encoded")
        row = np.dtype(dt).itemsize * math.prod(chunks[1:])
        decoded = row * chunks[0]
        if decoded > max(F.MAX_CHUNK_BYTES, row):
            raise ValueError(
                f"a chunk of shape {chunks} decodes to {decoded} bytes, more than the {F.MAX_CHUNK_BYTES} the "
                "format allows a chunk of several rows"
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptSpillError(
            f"{path}: array metadata breaks the format: {exc}", path=path, reason=str(exc)
        ) from None
    return ChunkLimits(decoded + decoded // 8 + (64 << 10) + 4, decoded, compressor, crc)


def check_chunk(limits: ChunkLimits, data: memoryview, *, path: str) -> None:
    """Refuse a chunk object (before zarr decodes it) whose size, or whose compressor header's
    decoded size, is more than its array's :class:`ChunkLimits` allow."""
    if len(data) > limits.object_bytes:
        raise CorruptSpillError(
            f"{path} is {len(data)} bytes, more than the {limits.object_bytes} its format allows", path=path
        )
    body = data[:-4] if limits.crc else data
    if limits.compressor is not None:
        try:
            n = _codecs.decoded_size(limits.compressor, body)
        except ValueError as exc:
            raise CorruptSpillError(f"{path}: not a {limits.compressor} chunk ({exc})", path=path) from None
        if n > limits.decoded_bytes:
            raise CorruptSpillError(
                f"{path}: its {limits.compressor} header declares {n} decoded bytes, more than the "
                f"{limits.decoded_bytes} its array's chunk shape allows (a decompression bomb?)",
                path=path,
            )


@dataclass(frozen=True, slots=True)
class PartDoneRecord:
    """``OUT/spillmerge-parts/part-I-of-N.json``: part ``I`` of an output written in parts is done."""

    part: int
    """Which part, 0-based."""
    parts: int
    plan: str
    """Plan fingerprint; every part of one output has the same."""
    rank: int | None
    """Rank of a collective merge (``SpillWriter.merge(parallel=True)``), else None."""
    run_id: str | None
    n_files: int
    n_frames: int
    nbytes: int
    codec: str
    chunk_bytes: int
    """Target output chunk size."""
    index: bool
    """The part wrote its share of the index chunks (every ``parts``-th chunk, from its number:
    docs/FORMAT.md, *Outputs written in parts*); when false the finalize writes its share."""
    finished: str
    host: str
    pid: int
    options: dict[str, Any] | None = None
    """The options that decide the plan and the output, so that parts that disagree are told which."""

    @classmethod
    def now(cls, **fields: Any) -> PartDoneRecord:
        return cls(finished=F.utcnow(), host=socket.gethostname(), pid=os.getpid(), **fields)

    def to_json(self) -> bytes:
        return F.dumps({"format_version": F.FORMAT_VERSION, "kind": "merge-part", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str, part: int, parts: int) -> PartDoneRecord:
        obj, common = _part_header(data, "merge-part", path, part, parts)
        return cls(
            **(common | F.int_fields(obj, path, _PART_INTS)),
            codec=str(obj.get("codec")),
            index=obj.get("index") is True,
            finished=str(obj.get("finished")),
            host=str(obj.get("host"))[:256],
            pid=F.int_or_none(obj, "pid") or 0,
            options=obj["options"] if isinstance(obj.get("options"), dict) else None,
        )


_PART_INTS = {"n_files": (0, 1 << 40), "n_frames": (0, 1 << 40), "nbytes": (0, 1 << 56), "chunk_bytes": (1, 1 << 40)}


@dataclass(frozen=True, slots=True)
class PartFailureRecord(F.ProcessFailure):
    """``OUT/spillmerge-parts/part-I-of-N.failed.json``: part ``I`` raised (removed when it reruns)."""

    part: int
    """Which part, 0-based."""
    parts: int
    plan: str
    """Plan fingerprint of the failed attempt."""
    rank: int | None
    """Rank of a collective merge, else None."""
    run_id: str | None
    """Run id of a collective merge (tells this attempt's failure from an earlier one's)."""

    @classmethod
    def of(cls, exc: BaseException, **fields: Any) -> PartFailureRecord:
        return cls(**F.failure_now(exc, message_chars=4000), **fields)

    def to_json(self) -> bytes:
        return F.dumps({"format_version": F.FORMAT_VERSION, "kind": "merge-part-failure", **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, *, path: str, part: int, parts: int) -> PartFailureRecord:
        obj, common = _part_header(data, "merge-part-failure", path, part, parts)
        return cls(
            **common,
            **F.failure_read(obj, message_chars=4000, missing="", missing_type="Error"),
        )


def _part_header(data: bytes, kind: str, path: str, part: int, parts: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A part record's object, checked to be the record its name says it is, and the fields every
    part record has (part, parts, plan, rank, run_id)."""
    obj = F.loads(data, path=path)
    ok = (
        isinstance(obj, dict)
        and obj.get("kind") == kind
        and obj.get("part") == part
        and obj.get("parts") == parts
        and isinstance(obj.get("plan"), str)
    )
    if not ok:
        raise CorruptSpillError(f"{path}: not a spillmerge {kind} record for part {part} of {parts}", path=path)
    F.check_version(obj, path, spill=False)
    common = {"part": part, "parts": parts, "plan": obj["plan"], "rank": F.int_or_none(obj, "rank")}
    return dict(obj), {**common, "run_id": F.str_or_none(obj, "run_id", path)}


@dataclass(frozen=True, slots=True)
class OutputHeader:
    """The merged output's root ``zarr.json`` attributes, key ``spillmerge``."""

    n_files: int
    n_frames: int
    nbytes: int
    ranks: list[int]
    """Ranks whose segments were merged."""
    world_size: int
    segments: int
    created: str
    """UTC time the merge planned the output."""
    file_layouts: list[list[str]]
    """The distinct column sets of the files (``index/file_layout`` points into it)."""
    key_orders: dict[str, Any] | None = None
    """The files' dict key orders (``_format.keyorder.output_orders``); None (not written) when every
    dict was in sorted key order."""

    def to_obj(self) -> dict[str, Any]:
        obj = {"format_version": F.FORMAT_VERSION, "kind": "merged", **asdict(self)}
        if obj["key_orders"] is None:
            del obj["key_orders"]
        return obj


COLUMN_KINDS = ("fixed", "ragged", "str", "bytes", "pickle", "strlist")
"""The kinds of an output column (docs/FORMAT.md section 2, *Columns*)."""
NUMERIC_KINDS = ("fixed", "ragged")
"""The column kinds whose ``dtype`` is a numeric dtype name (the others' is the kind itself)."""


@dataclass(frozen=True, slots=True)
class ColumnHeader:
    """A column group's ``columns/<name>/zarr.json`` attributes, key ``spillmerge``: which leaf
    the column holds and how (docs/FORMAT.md section 2, *Columns*)."""

    leaf: tuple[str, ...]
    """Dict keys from the value's root to the leaf (empty for plain tensor values)."""
    kind: str
    """``fixed``, ``ragged``, ``str``, ``bytes``, ``pickle`` or ``strlist``."""
    dtype: str
    """Dtype name (section 3) for numeric kinds, else the kind."""
    ndim: int | None
    """Dimensions of a value (numeric kinds); read as None when not an int."""
    inner_shape: tuple[int, ...] | None
    """Dimensions after the first of a ragged column's values (None: flat values + ``shapes``)."""
    has_valid: bool
    """Some row lacks the leaf: the group has a ``valid`` array."""
    chunk_max_bytes: int | None
    """Largest string chunk the merge wrote (string columns); read as None when not an int >= 0."""
    variant: str | None = None
    """The variant tag (``<col>.<variant>``) of a column of a leaf holding several kinds or dimensions."""
    has_none: bool = False
    """Some row holds ``None`` here: the group has a ``none`` array (a row lacking the leaf is neither)."""

    def to_obj(self) -> dict[str, Any]:
        inner = None if self.inner_shape is None else list(self.inner_shape)
        obj = asdict(self) | {"leaf": list(self.leaf), "inner_shape": inner}
        if self.variant is None:
            del obj["variant"]
        if not self.has_none:
            del obj["has_none"]
        return obj

    @classmethod
    def from_obj(cls, obj: Any, *, name: str, path: str) -> ColumnHeader:
        """The header of the column group ``name`` (at ``path``), or ``CorruptSpillError`` with
        the ``reason`` when a field is missing or contradicts the group's name."""

        def bad(reason: str) -> CorruptSpillError:
            return CorruptSpillError(f"{path}: {reason}", path=path, reason=reason)

        if not isinstance(obj, dict):
            raise bad("no spillmerge column header (leaf, kind, dtype)")
        leaf, kind, dtype = obj.get("leaf"), obj.get("kind"), obj.get("dtype")
        if not F.str_list(leaf):
            raise bad(f"leaf {leaf!r:.200} is not a list of dict keys")
        if any(F.item_index(k) is not None for k in leaf):  # a spill's item position, never an output's
            raise bad(f"leaf {leaf!r:.200} names a list item by position (an output's list items are one path)")
        numeric_dt = dtype if kind in NUMERIC_KINDS and isinstance(dtype, str) else None
        variant = obj.get("variant")
        if variant is not None and not isinstance(variant, str):
            raise bad(f"variant {variant!r:.100} is not a string")
        if name not in F.column_name_choices(tuple(leaf), variant or numeric_dt):
            raise bad(f"column {name!r} holds leaf {leaf!r:.200}, which a merge names otherwise")
        if kind not in COLUMN_KINDS:
            raise bad(f"unknown kind {kind!r:.50} (known: {', '.join(COLUMN_KINDS)})")
        numeric = kind in NUMERIC_KINDS
        dt = F.DTYPES.get(dtype) if isinstance(dtype, str) else None
        if numeric and (dt is None or not dt.numeric):
            raise bad(f"unknown dtype {dtype!r:.50} (known: docs/FORMAT.md section 3)")
        if not numeric and dtype != kind:
            raise bad(f"dtype {dtype!r:.50} of a {kind} column (must be {kind!r})")
        inner = obj.get("inner_shape")
        if inner is not None and not F.int_list(inner):
            raise bad(f"inner_shape {inner!r:.100} is not a list of non-negative ints")
        cmb = F.int_or_none(obj, "chunk_max_bytes")
        return cls(
            leaf=tuple(leaf),
            kind=str(kind),
            dtype=str(dtype),
            ndim=F.int_or_none(obj, "ndim"),
            inner_shape=tuple(inner) if inner is not None else None,
            has_valid=bool(obj.get("has_valid")),
            chunk_max_bytes=cmb if cmb is not None and cmb >= 0 else None,
            variant=variant,
            has_none=bool(obj.get("has_none")),
        )


@dataclass(frozen=True, slots=True)
class CompletionMarker:
    """``OUT/spillmerge-complete.json``: written last; its presence means the output is whole."""

    n_files: int
    n_frames: int
    nbytes: int
    finished: str
    written_by: dict[str, Any]
    """The run that wrote it: its lease's ``owner`` token, ``role``, ``host``, ``pid``."""
    spill_root: str
    plan: str
    run_id: str | None
    """Run id the merge waited for (None: the newest segments)."""
    session: int | None = None
    """The writer session of the run it serves (``SpillWriter.merge``; None from the CLI): ranks
    waiting for this merge (``wait=True``) tell its marker from an earlier round's by it."""

    def to_json(self) -> bytes:
        return F.dumps({"format_version": F.FORMAT_VERSION, "kind": "merge-complete", **asdict(self)})


def json_or_none(storage: Storage, rel: str, max_bytes: int) -> Any:
    """The JSON object ``rel``; None when absent or no JSON (torn, or another tool's)."""
    raw = storage.get_or_none(rel, max_bytes=max_bytes)
    try:
        return None if raw is None else F.loads(raw, path=storage.describe(rel))
    except CorruptSpillError:
        return None


def header(storage: Storage) -> dict[str, Any] | None:
    """The output header (root ``zarr.json`` attributes ``spillmerge``) when ``storage`` holds a
    merged output's root document, else None (absent, torn or not ours). The one reader of
    "is this a merged output?" for the merge, ``inspect`` and ``open``."""
    obj = json_or_none(storage, "zarr.json", F.ROOT_DOC_MAX_BYTES)
    attrs = obj.get("attributes") if isinstance(obj, dict) else None
    head = attrs.get("spillmerge") if isinstance(attrs, dict) else None
    return head if isinstance(head, dict) and head.get("kind") == "merged" else None


def what_is(storage: Storage) -> str:
    """What is at a path that is not a (complete or torn) output: ``"missing"``, ``"file"``,
    ``"spill"`` (it has rank folders) or ``"other"``; so a message can name the next step."""
    with storage.storage_errors("check", ""):
        if not storage.fs.exists(storage.path("")):
            return "missing"
        if storage.fs.isfile(storage.path("")):
            return "file"
    return "spill" if any(parse_rank_dirname(n) is not None for n in storage.listdir("")) else "other"


def not_an_output(storage: Storage, kind: str | None = None) -> NotAnOutputError:
    """The error for opening, inspecting or verifying something that is no output, naming what it is."""
    kind = kind or what_is(storage)
    where, no_doc = storage.describe(), "no zarr.json"
    if kind == "other" and storage.exists("zarr.json"):  # torn, or another tool's
        no_doc = f"{storage.describe('zarr.json')} is no spillmerge output's root document"
    why = {
        "missing": f"{where} does not exist",
        "file": f"{where} is a file, not a spillmerge output (a folder)",
        "spill": f"{where} is a spill root, not a merged output: run `spillmerge merge {where} --out OUT` and open OUT",
        "other": f"{where} is not a spillmerge output ({no_doc}) nor a spill root (no rank-NNNNN folders)",
    }[kind]
    return NotAnOutputError(why, path=where, kind=kind)
