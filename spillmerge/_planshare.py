"""A merge in parts plans once: part 0 publishes its plan under ``OUT/spillmerge-parts/plan/`` and
every other part and the finalize map it instead of planning the whole merge again
(docs/SCALE.md, *What breaks first*, 1; docs/FORMAT.md section 2.1).

Protocol:

1. (every part, the finalize) after the commit barrier: :func:`source_key` of the committed
   segments and the duplicate policy, computed without reading any catalog or index.
2. (part 0) :func:`find` a published plan of this key; none: plan, then, once it has claimed the
   output, :func:`publish`: every array of the plan as one object, then ``plan.json`` last. Only
   part 0 writes or removes the folder, and it removes only a plan of another key.
3. (parts 1..n-1, the finalize) :func:`find` waits up to the merge's ``timeout`` for ``plan.json``
   of their key, giving up early once part 0 left a record (done or failed) without it; found: the plan's arrays are
   mapped (local disks: page-cache maps of the objects, so a part touches only the rows of its
   chunks) or, on object stores, fetched into a private work folder on local disk. Not found: the
   process plans itself, as every process did before (the output is the same: the plan is
   deterministic, and the part records' fingerprints still have to agree).
4. (the finalize) removes the folder after the completion marker.

A published plan is one of the merge's own objects, like the part records: it is written under
the output's private name and only read by merges of the same source key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _format as F
from . import _poll
from ._errors import CorruptSpillError, SpillMergeError
from ._fetched import Fetches, fetched
from ._parts import PARTS_DIR
from ._plan import ROW_BLOCK, Plan, PlannedColumn, PlannedList, encoded_names
from ._plan_disk import PlanEntryError, RangeExchange, StringTable, WorkFolder
from ._spillroot import LoadedSegment, Segment
from ._storage import Storage

PLAN_DIR = f"{PARTS_DIR}/plan"
MANIFEST = f"{PLAN_DIR}/plan.json"
MANIFEST_MAX_BYTES = 256 << 20
"""``plan.json`` holds the columns, the files' column sets and the segments (not per-row data)."""
_KIND = "merge-plan"
_FETCH_BYTES = 64 << 20
"""Bytes per ranged read when a plan array is fetched from an object store."""


def source_key(segments: Sequence[Segment], on_duplicate: str) -> str:
    """What decides the plan, known before any catalog is read: every committed segment (its
    folder and commit record, which carries the checksums of its index and catalog) in write
    order, and the duplicate policy."""
    h = hashlib.blake2b(digest_size=16)
    head = {"format_version": F.FORMAT_VERSION, "on_duplicate": on_duplicate}
    h.update(json.dumps(head, sort_keys=True).encode())
    for s in segments:
        h.update(json.dumps([s.rel, repr(s.commit)], ensure_ascii=True).encode("ascii"))
    return h.hexdigest()


@dataclass
class Published:
    """A plan found under ``spillmerge-parts/plan/``, its arrays mapped."""

    plan: Plan
    fingerprint: str
    """``_plan.fingerprint`` of the plan with the publisher's ``chunk_bytes`` and ``codec``."""
    chunk_bytes: int
    codec: str
    work: WorkFolder | None
    """The local copy of a plan fetched from an object store (removed by :meth:`close`)."""

    def fingerprint_for(self, chunk_bytes: int, codec: str) -> str | None:
        """The fingerprint for these output settings when the publisher's were the same."""
        return self.fingerprint if (chunk_bytes, codec) == (self.chunk_bytes, self.codec) else None

    def close(self) -> None:
        if self.work is not None:
            self.work.close()


# -- publishing (part 0) -------------------------------------------------------------------------


def publish(output: Storage, plan: Plan, key: str, fingerprint: str, *, chunk_bytes: int, codec: str) -> int:
    """Write ``plan`` under ``PLAN_DIR``, ``plan.json`` last; on an exception remove what was
    written (a half-published plan has no ``plan.json``, so nobody reads it anyway). An array
    that is an out-of-core plan's whole work file is hard-linked where the output's file system
    allows (``Storage.put_link``) rather than copied; returns how many were."""
    linked = 0
    output.rm_tree(PLAN_DIR)  # another key's plan (an older merge into this output)
    output.makedirs(PLAN_DIR)
    with removed_on_error(output, PLAN_DIR):
        arrays: dict[str, dict[str, Any]] = {}

        def put(name: str, a: np.ndarray) -> str:
            nonlocal linked
            arrays[name], was_linked = put_array(output, f"{PLAN_DIR}/{name}", a)
            linked += was_linked
            return name

        data, offsets = encoded_names(plan.filenames)
        put("names", data)
        put("name_offsets", offsets)
        for attr in ("file_offsets", "frame_idx", "rank", "copies", "file_layout", "seg", "offset", "nbytes", "crc"):
            put(attr, getattr(plan, attr))
        checks = [s.checks for s in plan.segments if s.checks is not None and len(s.checks)]
        put("checks", np.concatenate(checks) if checks else np.zeros((0, 3), np.int64))
        columns = []
        for ci, col in enumerate(plan.columns):
            entry: dict[str, Any] = {
                "name": col.name, "leaf": list(col.leaf), "kind": col.kind, "dtype": col.dtype, "ndim": col.ndim,
                "shape": None if col.shape is None else list(col.shape),
                "inner": None if col.inner is None else list(col.inner),
                "has_valid": col.has_valid, "variant": col.variant, "src": put(f"c{ci}.src", col.src),
            }  # fmt: skip
            if col.counts is not None:
                entry["counts"] = put(f"c{ci}.counts", col.counts)
                entry["offsets"] = put(f"c{ci}.offsets", col.offsets())
            if col.shapes is not None:
                entry["shapes"] = put(f"c{ci}.shapes", col.shapes)
            columns.append(entry)
        lists = [
            {"name": lst.name, "path": list(lst.path), "offsets": put(f"l{li}.offsets", lst.offsets)}
            for li, lst in enumerate(plan.lists)
        ]
        manifest = {
            "kind": _KIND, "format_version": F.FORMAT_VERSION, "key": key, "plan": fingerprint,
            "chunk_bytes": chunk_bytes, "codec": codec, "duplicates": plan.duplicates,
            "file_layouts": plan.file_layouts, "columns": columns, "lists": lists, "arrays": arrays,
            "segments": [
                {"rel": s.seg.rel, "chunk_bytes": s.chunk_bytes, "salvaged": s.salvaged,
                 "n_checks": 0 if s.checks is None else len(s.checks)}
                for s in plan.segments
            ],
        }  # fmt: skip
        output.put_atomic(MANIFEST, F.dumps(manifest))
    return linked


def put_array(output: Storage, rel: str, a: Any) -> tuple[dict[str, Any], bool]:
    """Write the array ``a`` (an array, a map or a ``_concat.Concat``) as the raw little-endian
    object ``rel``: hard-linked when it is an out-of-core plan's whole work file on the output's
    file system (``Storage.put_link``), else written a block at a time. Its ``dtype`` and
    ``shape`` spec, and whether it was linked."""
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    spec = {"dtype": dt.str, "shape": list(a.shape)}
    whole = _whole_file(a) if isinstance(a, np.ndarray) else None
    if whole is not None and output.put_link(rel, whole):
        return spec, True
    with output.open_write(rel) as sink:
        for i in range(0, len(a), ROW_BLOCK):  # maps of an out-of-core plan: a block at a time
            sink.write(np.ascontiguousarray(a[i : i + ROW_BLOCK], dtype=dt).reshape(-1).view(np.uint8))
    return spec, False


def _whole_file(a: np.ndarray) -> str | None:
    """The file ``a`` maps whole (an out-of-core plan's work file: offset 0, every byte, C order,
    little-endian), else None."""
    mm = getattr(a, "_mmap", None)
    if not isinstance(a, np.memmap) or mm is None or not a.filename or a.offset != 0:
        return None
    try:
        start = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        size = os.path.getsize(a.filename)
    except (ValueError, TypeError, OSError):
        return None
    if a.ctypes.data != start or a.nbytes != size or not a.flags.c_contiguous or a.dtype.byteorder == ">":
        return None
    return str(a.filename)


@contextmanager
def removed_on_error(output: Storage, rel: str) -> Iterator[None]:
    """Around writing the folder ``rel`` whose index object is written last: on an exception,
    remove what was written (without its index object nobody reads it anyway)."""
    try:
        yield
    except BaseException:
        try:
            output.rm_tree(rel)
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        raise


def read_array(
    output: Storage, rel: str, dtype: Any, shape: tuple[int, ...], size: int | None, work: WorkFolder | None,
    bad: Callable[[str], Exception], lazy: Fetches | None = None,
) -> Any:  # fmt: skip
    """The raw little-endian array object ``rel`` (whose listed size is ``size``): a page-cache map
    on a local disk (``work`` None), else fetched into ``work`` in ranged reads: whole, or with
    ``lazy`` a :class:`_fetched.Fetched` array that fetches what is read of it (counted in
    ``lazy``). ``bad(why)`` is raised when its size is not the one ``dtype`` and ``shape`` give."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    name = rel.rsplit("/", 1)[-1]
    if size != nbytes:
        raise bad(f"{name} holds {size} bytes, the manifest says {nbytes}")
    if work is None:  # local disk: the object's pages, mapped (a part reads the rows it copies)
        raw = output.view(rel, 0, None)
        if len(raw) != nbytes:
            raise bad(f"{name} holds {len(raw)} bytes, the manifest says {nbytes}")
        return raw.view(dt).reshape(shape)
    if lazy is not None:
        return fetched(output, rel, dt, shape, work.path(rel.replace("/", ".")), lazy)
    out = work.zeros(rel.replace("/", "."), dt, shape)
    flat = out.reshape(-1).view(np.uint8) if nbytes else np.zeros(0, np.uint8)
    for a in range(0, nbytes, _FETCH_BYTES):
        b = min(nbytes, a + _FETCH_BYTES)
        output.read_into([(rel, a, b)], flat[a:b].data)
    return out


@contextmanager
def blamed_for_range_errors(
    published: bool, output: Storage, folder: str = PLAN_DIR, exchange: RangeExchange | None = None
) -> Iterator[None]:
    """Around the work of a part or finalize that mapped a published plan (or ranges of it, under
    ``folder``; ``exchange``: where each range came from): its rows are not checked again against
    the spill root (docs/GUARANTEES.md), so an entry out of range there (damaged, or written by
    someone else) surfaces as an IndexError or the like, and one that names other bytes of the
    spill as a checksum mismatch that the spill's own index does not share. Report either as a
    damaged plan, naming the range published for the file when known."""
    try:
        yield
    except PlanEntryError as exc:
        if not published:
            raise
        where = (exchange.where_file(exc.file) if exchange is not None else None) or output.describe(folder)
        raise CorruptSpillError(
            f"{where}: {exc}; remove {output.describe(folder)} and run the parts again",
            path=where,
        ) from exc
    except (IndexError, ValueError, OverflowError, KeyError) as exc:
        if not published or isinstance(exc, SpillMergeError):
            raise
        where = output.describe(folder)
        raise CorruptSpillError(
            f"{where}: the published merge plan holds an entry out of range ({type(exc).__name__}: {exc}); remove "
            f"{where} and run the parts again",
            path=where,
        ) from exc


def remove(output: Storage) -> None:
    """The finalize, after the completion marker (and a whole merge's clean-up): the plan is no
    longer needed."""
    output.rm_tree(PLAN_DIR)


# -- finding and mapping (the other parts, the finalize) ------------------------------------------


def find(
    output: Storage, key: str, segments: Sequence[Segment], *, timeout: float, work_dir: str | None,
    give_up: Callable[[], bool] = lambda: False,
) -> Published | None:  # fmt: skip
    """The published plan of ``key``, waiting up to ``timeout`` seconds for it (``give_up``:
    stop waiting early, e.g. part 0 failed); None when there is none: the caller plans itself."""
    for waited in _poll.poll(timeout, first=0.05, cap=2.0):
        manifest = _manifest(output, key)
        if manifest is not None:
            return _load(output, manifest, segments, work_dir)
        if waited >= timeout or give_up():
            return None
    return None  # pragma: no cover - poll() ends with a check at the deadline


def published(output: Storage, key: str) -> bool:
    """Whether the plan of ``key`` is published (its ``plan.json`` there, its arrays not read)."""
    try:
        return _manifest(output, key) is not None
    except SpillMergeError:
        return False


def _manifest(output: Storage, key: str) -> dict[str, Any] | None:
    """``plan.json`` when it is there and of ``key``, else None (``CorruptSpillError``: not JSON)."""
    raw = output.get_or_none(MANIFEST, max_bytes=MANIFEST_MAX_BYTES)
    if raw is None:
        return None
    obj = F.loads(raw, path=output.describe(MANIFEST))
    return obj if isinstance(obj, dict) and obj.get("key") == key else None


def _load(output: Storage, m: dict[str, Any], segments: Sequence[Segment], work_dir: str | None) -> Published:
    where = output.describe(MANIFEST)

    def bad(why: str) -> CorruptSpillError:
        return CorruptSpillError(f"{where}: {why}", path=where)

    if m.get("kind") != _KIND or m.get("format_version") != F.FORMAT_VERSION:
        raise bad("not a merge plan of this format version")
    work = None if output.local else WorkFolder(work_dir)
    try:
        specs = m["arrays"]
        sizes = dict(output.find(PLAN_DIR))  # declared sizes are checked before anything is mapped or fetched

        def arr(name: str) -> np.ndarray:
            spec = specs[name]
            shape = tuple(int(x) for x in spec["shape"])
            rel = f"{PLAN_DIR}/{name}"
            return read_array(output, rel, spec["dtype"], shape, sizes.get(rel), work, bad)

        by_rel = {s.rel: s for s in segments}
        checks = arr("checks")
        segs, c0 = [], 0
        for s in m["segments"]:
            if s["rel"] not in by_rel:
                raise bad(f"segment {s['rel']!r} is not committed")
            n = int(s["n_checks"])
            segs.append(
                LoadedSegment(
                    by_rel[s["rel"]], [], [], np.zeros((0, 6), np.int64), int(s["chunk_bytes"]), bool(s["salvaged"]),
                    checks=np.asarray(checks[c0 : c0 + n]) if n else None,
                )  # fmt: skip
            )
            c0 += n
        columns = []
        for c in m["columns"]:
            counts = arr(c["counts"]) if "counts" in c else None
            columns.append(
                PlannedColumn(
                    c["name"], tuple(c["leaf"]), c["kind"], c["dtype"], int(c["ndim"]),
                    None if c["shape"] is None else tuple(c["shape"]),
                    None if c["inner"] is None else tuple(c["inner"]),
                    arr(c["src"]), counts, arr(c["shapes"]) if "shapes" in c else None, bool(c["has_valid"]),
                    c["variant"], arr(c["offsets"]) if "offsets" in c else None,
                )  # fmt: skip
            )
        lists = [PlannedList(lst["name"], tuple(lst["path"]), arr(lst["offsets"])) for lst in m["lists"]]
        plan = Plan(
            StringTable(arr("names"), arr("name_offsets")), arr("file_offsets"), arr("frame_idx"), arr("rank"),
            arr("copies"), arr("file_layout"), [list(x) for x in m["file_layouts"]], columns, segs, arr("seg"),
            arr("offset"), arr("nbytes"), arr("crc"), int(m["duplicates"]), lists,
        )  # fmt: skip
        if len(plan.file_offsets) != plan.n_files + 1 or any(len(c.src) != plan.n_frames for c in columns):
            raise bad("its arrays disagree in length")
        return Published(plan, str(m["plan"]), int(m["chunk_bytes"]), str(m["codec"]), work)
    except (KeyError, TypeError, ValueError) as exc:
        if work is not None:
            work.close()
        raise bad(f"malformed ({type(exc).__name__}: {exc})") from exc
    except BaseException:
        if work is not None:
            work.close()
        raise

