"""A merge in parts plans once: the planner (under the ``planner`` lease) stores the plan under
``OUT/spillmerge-parts/plan/`` in digested blocks, ``plan.json`` last; every other part and the
finalize read it, and a stored plan failing any digest is rebuilt, never trusted (docs/SCALE.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import OutputBusyError, SpillMergeError
from .._format import common as F
from .._spill.root import LoadedSegment, Segment
from .._storage import Storage
from .._util.poll import poll
from . import lease as _lease
from . import plan as _plan
from . import planblocks as _blocks
from .documents import NAME_BLOCK
from .nametable import NameTable, table_of
from .parts import PARTS_DIR
from .plan import Plan, PlannedColumn, PlannedList
from .planblocks import DamagedPlan

PLAN_DIR = f"{PARTS_DIR}/plan"
MANIFEST = f"{PLAN_DIR}/plan.json"
MANIFEST_MAX_BYTES = 256 << 20
"""``plan.json`` holds the columns, the files' column sets and the segments (not per-row data)."""
PLANNER = "planner"
"""The lease a part holds while it builds and stores the plan."""
_KIND = "merge-plan"
_COLUMN_FIELDS: dict[str, Callable[[Any], Any] | None] = {
    "name": None, "leaf": tuple, "kind": None, "dtype": None, "ndim": int, "shape": tuple, "inner": tuple,
    "has_valid": bool, "variant": None, "has_none": bool,
}  # fmt: skip
"""A :class:`PlannedColumn`'s fields ``plan.json`` holds, and how each is read back (its arrays are stored apart)."""
READ = "was read, not rebuilt"
"""In the report's note of a process that read the stored plan."""


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


@dataclass(frozen=True, slots=True)
class Obtained:
    """A plan and its fingerprint, and how this process came by it."""

    plan: Plan
    fingerprint: str
    """``_merge.plan.fingerprint`` for the caller's ``chunk_bytes`` and ``codec``."""
    notes: list[str]
    """For the report: read, built and stored, or built here, and why."""


def obtain(
    output: Storage, key: str, segments: Sequence[Segment], plan_here: Callable[[], tuple[Plan, str]], *,
    settings: dict[str, Any], timeout: float, may_store: bool, memory_limit: int,
) -> Obtained:  # fmt: skip
    """The plan of ``key``: read from the store, or built by ``plan_here`` (which returns the
    plan and its fingerprint for ``settings``) and, with ``may_store``, stored under the
    ``planner`` lease.
    ``timeout`` > 0 bounds the wait for a planner at work (0: as long as it is alive).
    ``memory_limit``: the blocks of a stored plan kept in memory at most."""
    notes: list[str] = []
    where = output.describe(PLAN_DIR)

    def stored() -> Obtained | None:
        """The stored plan of ``key`` when it is whole and sound, else None (a damaged one is noted)."""
        try:
            found = load(output, key, segments, memory_limit=memory_limit)
        except DamagedPlan as exc:
            note = f"the stored plan was not used: {exc}"
            if note not in notes:  # read again at every poll while a planner replaces it
                notes.append(note)
            return None
        if found is None:
            return None
        plan, fp, stored_settings = found
        notes.append(f"the plan stored in {where} {READ}")
        return Obtained(plan, fp if stored_settings == settings else _plan.fingerprint(plan, **settings), notes)

    for waited in poll(timeout if timeout > 0 else math.inf, first=0.05, cap=1.0):  # a planner's plan comes
        got = stored()
        if got is not None:
            return got
        if may_store:
            lease = _planner_lease(output)
            if lease is not None:
                with lease:  # (stored while we took the lease?)
                    return stored() or _build(output, lease, key, plan_here, settings, notes)
        elif not _lease.held(output, PLANNER):
            break  # nobody at it: plan here
        if waited >= timeout > 0:
            notes.append(f"no stored plan in {where} after waiting {timeout:.0f} s for the planner")
            break
    return _build(output, None, key, plan_here, settings, notes)


def rebuild(
    output: Storage, key: str, plan_here: Callable[[], tuple[Plan, str]], damage: BaseException, *,
    settings: dict[str, Any], may_store: bool,
) -> Obtained:  # fmt: skip
    """A stored plan found damaged while in use (a block failed its digest): built here from the
    spill root, and stored again in place of the damaged one when this process may store and no
    planner is at work."""
    notes = [f"the stored plan was not used: {damage}"]
    lease = _planner_lease(output) if may_store else None
    with lease or contextlib.nullcontext():
        return _build(output, lease, key, plan_here, settings, notes)


def _planner_lease(output: Storage) -> _lease.Lease | None:
    """The ``planner`` lease, or None while another process holds it."""
    try:
        return _lease.Lease(output, name=PLANNER, role="planner", exclusive=False)
    except OutputBusyError:
        return None


def _build(
    output: Storage, lease: _lease.Lease | None, key: str, plan_here: Callable[[], tuple[Plan, str]],
    settings: dict[str, Any], notes: list[str],
) -> Obtained:  # fmt: skip
    """The plan built here, and under the planner ``lease`` (if held) stored for the other parts."""
    plan, fp = plan_here()
    if lease is None:
        notes.append("the plan was built here (not stored)")
    else:
        lease.check()
        store(output, plan, key, fp, settings)
        notes.append(f"the plan was built here and stored in {output.describe(PLAN_DIR)} for the other parts")
    return Obtained(plan, fp, notes)


# -- storing ---------------------------------------------------------------------------------------


def _body_digest(body: dict[str, Any]) -> str:
    return _blocks.digest(json.dumps(body, sort_keys=True, ensure_ascii=True).encode("ascii"))


def store(output: Storage, plan: Plan, key: str, fingerprint: str, settings: dict[str, Any]) -> None:
    """Write ``plan`` under ``PLAN_DIR``, every array in blocks (``_merge.planblocks``) and
    ``plan.json`` last and atomically; on an exception remove what was written (without
    ``plan.json`` nobody reads it anyway)."""
    output.rm_tree(PLAN_DIR)  # another key's plan, or a damaged or half-written one
    output.makedirs(PLAN_DIR)
    try:
        arrays: dict[str, dict[str, Any]] = {}

        def put(name: str, a: np.ndarray) -> str:
            arrays[name] = _blocks.put_blocks(output, f"{PLAN_DIR}/{name}", a)
            return name

        table = table_of(plan.filenames)
        put("names", table.data)
        put("name_offsets", table.offsets)
        heads = table.index_arrays(NAME_BLOCK)
        put("name_heads", heads["filename_heads"])
        put("name_head_offsets", heads["filename_head_offsets"])
        for attr in ("file_offsets", "frame_idx", "rank", "copies", "file_layout", "seg", "offset", "nbytes", "crc"):
            put(attr, getattr(plan, attr))
        checks = [s.checks for s in plan.segments if s.checks is not None and len(s.checks)]
        put("checks", np.concatenate(checks) if checks else np.zeros((0, 3), np.int64))
        columns = []
        for ci, col in enumerate(plan.columns):
            entry: dict[str, Any] = {k: getattr(col, k) for k in _COLUMN_FIELDS}
            entry["present"] = col.n_present
            arrays_of = {"src": col.src, "offsets": col.offsets, "shapes": col.shapes}
            entry.update({k: put(f"c{ci}.{k}", a) for k, a in arrays_of.items() if a is not None})
            columns.append(entry)
        lists = [
            {"name": lst.name, "path": list(lst.path), "offsets": put(f"l{li}.offsets", lst.offsets)}
            for li, lst in enumerate(plan.lists)
        ]
        body = {
            "key": key, "plan": fingerprint, "settings": settings, "duplicates": plan.duplicates,
            "file_layouts": plan.file_layouts, "columns": columns, "lists": lists, "arrays": arrays,
            "key_orders": plan.key_orders, "total_bytes": plan.total_bytes, "names_per_head": NAME_BLOCK,
            "segments": [
                {"rel": s.seg.rel, "chunk_bytes": s.chunk_bytes, "salvaged": s.salvaged,
                 "n_checks": 0 if s.checks is None else len(s.checks)}
                for s in plan.segments
            ],
        }  # fmt: skip
        doc = {"kind": _KIND, "format_version": F.FORMAT_VERSION, "body": body, "digest": _body_digest(body)}
        output.put_atomic(MANIFEST, json.dumps(doc, sort_keys=True, ensure_ascii=True).encode("ascii"))
    except BaseException:
        with contextlib.suppress(Exception):  # the original error matters more
            output.rm_tree(PLAN_DIR)
        raise


# -- reading ---------------------------------------------------------------------------------------


def load(
    output: Storage, key: str, segments: Sequence[Segment], *, memory_limit: int
) -> tuple[Plan, str, dict[str, Any]] | None:
    """The stored plan of ``key``, its fingerprint and the settings it was computed for; None when
    there is none (or one of another key). Its arrays are :class:`~spillmerge._merge.planblocks.StoredArray`:
    a block is read, and checked against its digest, when an index first touches it.
    :class:`DamagedPlan` naming the file when ``plan.json`` or a block read here is missing,
    fails its digest or does not parse; a block read later raises it where it is read. At most
    ``memory_limit`` bytes of blocks are kept in memory."""
    try:
        raw = output.get_or_none(MANIFEST, max_bytes=MANIFEST_MAX_BYTES)
    except SpillMergeError as exc:
        raise DamagedPlan(f"{output.describe(MANIFEST)}: {exc}", path=output.describe(MANIFEST)) from exc
    if raw is None:
        return None

    def bad(rel: str, why: str) -> DamagedPlan:
        where = output.describe(rel)
        return DamagedPlan(f"{where}: {why}", path=where)

    try:
        doc = json.loads(raw.decode("utf-8"))
        body = doc["body"]
        ok = doc["kind"] == _KIND and doc["format_version"] == F.FORMAT_VERSION and isinstance(body, dict)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise bad(MANIFEST, f"not a stored merge plan ({type(exc).__name__}: {exc})") from None
    if not ok or doc.get("digest") != _body_digest(body):
        raise bad(MANIFEST, "fails its digest: the stored plan is damaged")
    if body.get("key") != key:
        return None  # another spill root's (or policy's) plan: replaced by the next planner
    try:
        specs = body["arrays"]
        cache = _blocks.BlockCache(memory_limit)

        def arr(name: str, *, monotonic: bool = False) -> Any:
            return _blocks.StoredArray(output, f"{PLAN_DIR}/{name}", specs[name], cache, bad, monotonic=monotonic)

        by_rel = {s.rel: s for s in segments}
        checks = np.asarray(arr("checks")[:])  # a few rows per data block of the spill: read whole
        segs, c0 = [], 0
        for s in body["segments"]:
            if s["rel"] not in by_rel:
                raise bad(MANIFEST, f"segment {s['rel']!r} is not committed")
            n = int(s["n_checks"])
            seg = LoadedSegment(
                by_rel[s["rel"]], [], [], np.zeros((0, 6), np.int64), int(s["chunk_bytes"]), bool(s["salvaged"]),
                checks=np.asarray(checks[c0 : c0 + n]) if n else None,
            )  # fmt: skip
            segs.append(seg)
            c0 += n
        columns = []
        for c in body["columns"]:
            kw = {k: c[k] if f is None or c[k] is None else f(c[k]) for k, f in _COLUMN_FIELDS.items()}
            col = PlannedColumn(
                **kw, src=arr(c["src"]), offsets=arr(c["offsets"], monotonic=True) if "offsets" in c else None,
                shapes=arr(c["shapes"]) if "shapes" in c else None, n_present=int(c["present"]),
            )  # fmt: skip
            columns.append(col)
        lists = [
            PlannedList(lst["name"], tuple(lst["path"]), arr(lst["offsets"], monotonic=True)) for lst in body["lists"]
        ]
        data, offs = arr("names"), arr("name_offsets", monotonic=True)
        if len(offs) < 1 or offs[0] != 0 or offs[-1] != len(data):
            raise bad(f"{PLAN_DIR}/name_offsets", "offsets not rising from 0 to the names' bytes")
        if int(body["names_per_head"]) != NAME_BLOCK:
            raise bad(MANIFEST, f"names_per_head {body['names_per_head']!r} is not {NAME_BLOCK}")
        heads = (arr("name_heads"), arr("name_head_offsets", monotonic=True))
        names = NameTable(data, offs, heads={NAME_BLOCK: heads})  # decoded when asked for
        plan = Plan(
            names, arr("file_offsets", monotonic=True), arr("frame_idx"), arr("rank"), arr("copies"),
            arr("file_layout"), [list(x) for x in body["file_layouts"]], columns, segs, arr("seg"), arr("offset"),
            arr("nbytes"), arr("crc"), int(body["duplicates"]), int(body["total_bytes"]), lists,
            body.get("key_orders"),
        )  # fmt: skip
        if len(plan.file_offsets) != plan.n_files + 1 or any(len(c.src) != plan.n_frames for c in columns):
            raise bad(MANIFEST, "its arrays disagree in length")
        return plan, str(body["plan"]), dict(body["settings"])
    except DamagedPlan:
        raise
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise bad(MANIFEST, f"malformed ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # noqa: BLE001 - anything else a damaged plan provokes: rebuilt, never trusted
        if isinstance(exc, SpillMergeError):
            raise
        raise bad(MANIFEST, f"unreadable ({type(exc).__name__}: {exc})") from None
