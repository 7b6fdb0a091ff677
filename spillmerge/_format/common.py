"""What both halves of docs/FORMAT.md share (the normative description; keep them in step): the
versions, size limits, JSON in and out, the dtype table, node names and record checks. The spill
root's records are in ``_format.spill``, the output's in ``_format.output``."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import socket
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from .._errors import CorruptSpillError, FormatVersionError

FORMAT_VERSION = 7
"""The version of the outputs a merge writes, and the only one a reader reads."""
SPILL_FORMAT_VERSION = 4
"""The version a writer's spill records carry, and the only one a merge reads. It counts apart
from :data:`FORMAT_VERSION`: a change to the merged output alone leaves spill roots as they are."""


def version_error(path: str, found: object, *, spill: bool) -> FormatVersionError:
    """The one refusal of a tree of another format version: names ``path``, the version found and
    the one this spillmerge reads, and what to do (no reader of another version is kept)."""
    if spill:
        supported, what, a = SPILL_FORMAT_VERSION, "spill root", "a"
        todo = "run the job again with this spillmerge, or merge the spill root with the spillmerge that wrote it"
    else:
        supported, what, a = FORMAT_VERSION, "output", "an"
        todo = "merge its spill root again with this spillmerge (or read it with the spillmerge that wrote it)"
    return FormatVersionError(
        f"{path}: {a} {what} of format version {found!r:.40}; this spillmerge reads {what} format version "
        f"{supported} only: {todo}",
        path=path,
        found=found,
        supported=supported,
    )


def check_version(obj: dict[str, Any], path: str, *, spill: bool) -> int:
    """``obj['format_version']`` when it is the version this spillmerge reads, else :func:`version_error`."""
    version = obj.get("format_version")
    if type(version) is not int or version != (SPILL_FORMAT_VERSION if spill else FORMAT_VERSION):
        raise version_error(path, version, spill=spill)
    return version


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
HARD_MAX_BYTES = 1 << 31
"""The most bytes of any object read whole, whatever a size formula gives (catalog, journal, chunk)."""


FILENAME_MAX_BYTES = 64 << 10
"""Longest filename (UTF-8 bytes) a writer accepts and a reader's limits admit (a string chunk of
the output's ``index/filenames`` allows 64 KiB + 4 per name)."""
STRING_MAX_BYTES = 1 << 30
"""Largest ``str`` leaf, or ``strlist`` leaf (its length prefixes included), in UTF-8 bytes: a
string chunk of an output holding it stays under :data:`HARD_MAX_BYTES` after a compressor's
worst case."""
MAX_CHUNK_BYTES = 256 << 20
"""The most bytes a chunk of an output array may decode to, unless one row alone is larger (a
chunk of one row): the merge's ``chunk_bytes`` may not exceed it."""
EMPTY_EXTENT_MAX = 1 << 16
"""A shape with a zero dimension may have at most this many entries before its first zero
(``[65536, 0]`` yes, ``[2**27, 0]`` no): readers that build nested lists (Arrow) allocate that
many list entries for an array of no element, so the format bounds them."""
SHAPE_ELEMS_MAX = 1 << 62
"""Products of dimensions are computed saturating at this bound (no int64 wrap-around to 0)."""


def shape_problem(shape: tuple[int, ...] | list[int]) -> str | None:
    """What is wrong with a leaf's shape by the format's bounds (None: nothing): more than
    :data:`SHAPE_ELEMS_MAX` elements, or :data:`EMPTY_EXTENT_MAX` entries before a zero dimension.
    Shared by the writer, the spill reader and ``_format.invariants.shape_products`` (vectorised)."""
    n = 1
    for d in shape:
        if d == 0:
            if n > EMPTY_EXTENT_MAX:
                return (
                    f"shape {list(shape)!r:.200} has {n} entries before a zero dimension "
                    f"(at most {EMPTY_EXTENT_MAX} in an empty value)"
                )
            return None
        n *= d
        if n > SHAPE_ELEMS_MAX:
            return f"shape {list(shape)!r:.200} has more than 2**62 elements"
    return None


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
    # (float4_e2m1fn_x2: two 4-bit floats packed in each byte)
    **dict.fromkeys(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"), "uint8"),
    **dict.fromkeys(("float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8"), "uint8"),
    "bits16": "uint16",
}

RAW_BITS = frozenset(_RAW)
"""Dtypes stored as raw bits of an unsigned type (read back through ``ml_dtypes`` / torch views)."""
#: Python scalars (and lists of one scalar type) keep their Python type: stored as the
#: numeric dtype ``storage`` and read back as ``int`` / ``float`` / ``bool`` / ``complex`` (0-d) or
#: nested lists of them; and the headers of Python containers (docs/FORMAT.md, *Value model*),
#: int64 0-d values holding a container's length.
PY_SCALARS = {"pybool": "bool", "pyint": "int64", "pyfloat": "float64", "pycomplex": "complex128"}
PY_HEADERS = ("pylist", "pytuple", "pydict", "pyrecords")
_STORED_AS = {**{n: n for n in _NATIVE}, **_RAW, **PY_SCALARS, **dict.fromkeys(PY_HEADERS, "int64")}
DTYPES: dict[str, DType] = {n: DType(n, np.dtype(s).itemsize, s, n == s) for n, s in _STORED_AS.items()}
#: Non-numeric kinds: bytes in ``data`` as docs/FORMAT.md section 1 says; itemsize 1
#: (a byte), ``none`` 0. Their layout shape is ``[n_bytes]`` (``[n, n_bytes]`` for ``strlist``,
#: ``[]`` for ``none``).
NON_NUMERIC = ("str", "bytes", "pickle", "strlist", "none")
DTYPES |= {n: DType(n, 0 if n == "none" else 1, "uint8", False, n) for n in NON_NUMERIC}


_SHOWN = {"pybool": "bool", "pyint": "int", "pyfloat": "float", "pycomplex": "complex"}
_SHOWN_AS = {"pylist": "list", "pytuple": "tuple", "pydict": "dict", "pyrecords": "list[dict]", "strlist": "list[str]"}


def dtype_text(dtype: str, ndim: int | None = 0) -> str:
    """A dtype as users see it in messages and listings: the Python type of ``py*`` leaves
    (``int``, ``list[int]`` for ``ndim`` 1 ...) and containers (``list``, ``list[dict]``),
    ``list[str]`` for ``strlist``; other dtype names as they are."""
    if dtype in _SHOWN:
        n = ndim if isinstance(ndim, int) and 0 <= ndim <= 8 else 0
        return "list[" * n + _SHOWN[dtype] + "]" * n
    return _SHOWN_AS.get(dtype, dtype)


# --------------------------------------------------------------------------------------------
# leaf path segments of the value model (docs/FORMAT.md section 1, *Value model*)

MARK = "\x1f"
"""First character of a header (``MARK``) or list item (``MARK`` + index) path segment."""


def user_key(key: str) -> str:
    """The path segment of a user's dict key: escaped with one more ``MARK`` when it starts with
    one, so it never reads as a header or item segment."""
    return MARK + key if key.startswith(MARK) else key


def key_of(seg: str) -> str:
    """The dict key of a path segment: ``user_key`` undone."""
    return seg[1:] if seg.startswith(MARK) else seg


def is_marker(seg: str) -> bool:
    """A header or list item segment (not a user key)."""
    return seg.startswith(MARK) and not seg.startswith(MARK + MARK)


ITEM = MARK + "*"
"""The segment of a list's items in an output's leaf paths: every item of the lists
at ``P`` is a row of the child path ``(*P, ITEM)`` (docs/FORMAT.md, *Lists*). The spill keeps
each item's position (``MARK`` + index), which a merge turns into list offsets."""


def item_index(seg: str) -> int | None:
    """The position of a spill list item segment (``MARK`` + decimal digits), else None."""
    return int(seg[1:]) if len(seg) > 1 and seg[0] == MARK and seg[1:].isdigit() and seg[1:].isascii() else None


def general_path(path: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A spill leaf path with every item position replaced by ``ITEM``, and those positions
    (outermost first): ``("a", "\x1f3", "b")`` is ``(("a", ITEM, "b"), (3,))``."""
    if not any(s and s[0] == MARK for s in path):
        return path, ()
    idx = [item_index(seg) for seg in path]
    segs = tuple(seg if i is None else ITEM for seg, i in zip(path, idx, strict=True))
    return segs, tuple(i for i in idx if i is not None)


def list_domain(path: tuple[str, ...]) -> tuple[str, ...]:
    """The list whose items an output leaf path's rows are (its prefix up to its last ``ITEM``),
    ``()`` for a path whose rows are the output's rows."""
    return path[: len(path) - path[::-1].index(ITEM)] if ITEM in path else ()


def path_text(path: tuple[str, ...]) -> str:
    """A leaf path for messages: user keys joined by ``/``, list items as ``[i]``."""

    def text(seg: str) -> str:
        if not is_marker(seg):
            return key_of(seg)
        return "[*]" if seg == ITEM else f"[{seg[1:]}]" if len(seg) > 1 else "<header>"

    return "/".join(map(text, path)) if path else "<value>"


# --------------------------------------------------------------------------------------------
# node names (docs/FORMAT.md "Node names")

_SAFE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]")
# Names zarr uses itself ("zarr.json", "zarr.*.partial" temporaries) and names Windows reserves.
_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}


def _reserved(name: str) -> bool:
    low = name.lower()
    return low.startswith("zarr.") or low.split(".", 1)[0] in _RESERVED


def _plain_ok(name: str) -> bool:
    return bool(_SAFE_RE.fullmatch(name)) and not _reserved(name)  # (not re.match: "$" takes "abc\n")


def hashed_name(name: str) -> str:
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    slug = _SLUG_RE.sub("_", name).lstrip("._")[:60]
    if _reserved(slug):
        slug = "_" + slug[:59]
    return f"{slug}~{digest}"


def node_names(names: list[str]) -> dict[str, str]:
    """Map each string to a zarr node name that is safe on every filesystem and unique, also
    case-insensitively, among ``names``. Deterministic for a given set of names."""
    folded = Counter(n.lower() for n in names if _plain_ok(n))
    out = {n: n if _plain_ok(n) and folded[n.lower()] == 1 else hashed_name(n) for n in names}
    if len(set(out.values())) != len(out):  # 64-bit hash collision: refuse rather than overwrite
        raise CorruptSpillError("two names map to the same node name; rename one of them")
    return out


VALUE_COLUMN = "_value"
"""Column name of the leaf ``[]`` (a frame value that is itself a tensor, string ...). No user
leaf is named so: :func:`node_names` gives a name that starts with a letter or digit, or one
that ends in ``~`` and 16 hex digits; nor does it start with ``__``, which Zarr v3 reserves."""


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
    if dtype is not None:
        bases |= {f"{b}.{dtype}" for b in bases} | {split_column_name(b, dtype) for b in bases}
    return bases


# --------------------------------------------------------------------------------------------
# what every record's reader checks (the records: _format_spill, _format_output)


def check_header(obj: Any, kind: str, path: str) -> dict[str, Any]:
    """A spill record's JSON object of ``kind``, of this spillmerge's spill format version."""
    if not isinstance(obj, dict):
        raise CorruptSpillError(f"{path}: expected a JSON object", path=path)
    check_version(obj, path, spill=True)
    if obj.get("kind") != kind:
        raise CorruptSpillError(f"{path}: expected kind {kind!r}, got {obj.get('kind')!r}", path=path)
    return obj


def int_field(obj: dict[str, Any], key: str, path: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CorruptSpillError(f"{path}: field {key!r} must be an integer in [{lo}, {hi}], got {v!r}", path=path)
    return v


def int_fields(obj: dict[str, Any], path: str, bounds: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The fields ``bounds`` names (key -> (lo, hi)), each read by :func:`int_field`."""
    return {key: int_field(obj, key, path, lo=lo, hi=hi) for key, (lo, hi) in bounds.items()}


def int_list(v: Any, *, lo: int = 0, hi: float = float("inf"), most: int | None = None) -> TypeGuard[list[int]]:
    """``v`` is a JSON list (of at most ``most`` entries) of ints from ``lo`` up to below ``hi``."""
    return isinstance(v, list) and (most is None or len(v) <= most) and all(type(d) is int and lo <= d < hi for d in v)


def str_list(v: Any) -> TypeGuard[list[str]]:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def str_or_none(obj: dict[str, Any], key: str, path: str) -> str | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise CorruptSpillError(f"{path}: field {key!r} must be a string", path=path)
    return v


def exception_fields(exc: BaseException, *, message_chars: int = 2000) -> dict[str, Any]:
    """The :class:`ExceptionRecord` fields of ``exc``, now, each bounded in size (every failure
    record is built from these)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    fields = {"error_type": type(exc).__name__, "message": str(exc)[:message_chars], "traceback": tb[-20000:]}
    return fields | {"time": utcnow()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ExceptionRecord:
    """What every failure record carries: the exception (:func:`exception_fields`) and when."""

    error_type: str
    message: str
    traceback: str
    time: str

    def summary(self) -> str:
        return f"{self.error_type}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessFailure(ExceptionRecord):
    """What every record of a failed merge process carries (a part's, the collective merge's):
    the exception and the process, from :func:`failure_now` / :func:`failure_read`."""

    host: str
    pid: int


def failure_now(exc: BaseException, *, message_chars: int) -> dict[str, Any]:
    """The fields a process failure record (part or merge) takes from ``exc`` and this process."""
    return exception_fields(exc, message_chars=message_chars) | {"host": socket.gethostname(), "pid": os.getpid()}


def exception_read(obj: dict[str, Any], *, message_chars: int, missing: Any, missing_type: Any) -> dict[str, Any]:
    """The :class:`ExceptionRecord` fields read back from a record's JSON object, bounded
    (``missing_type`` stands in for an absent error type, ``missing`` for an absent message or
    traceback)."""
    return {
        "error_type": str(obj.get("error_type", missing_type))[:200],
        "message": str(obj.get("message", missing))[:message_chars],
        "traceback": str(obj.get("traceback", missing))[-20000:],
        "time": str(obj.get("time")),
    }


def failure_read(obj: dict[str, Any], **bounds: Any) -> dict[str, Any]:
    """The :class:`ProcessFailure` fields read back (``bounds``: :func:`exception_read`'s)."""
    return exception_read(obj, **bounds) | {"host": str(obj.get("host"))[:256], "pid": int_or_none(obj, "pid") or 0}


def int_or_none(obj: dict[str, Any], key: str) -> int | None:
    v = obj.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None
