"""A merge in parts plans once: the planner (under the ``planner`` lease) stores the plan under
``OUT/spillmerge-parts/plan/`` in digested blocks, ``plan.json`` last; the others read a block when
they first touch it, and a stored plan failing any digest is rebuilt, never trusted (docs/SCALE.md)."""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CorruptSpillError, OutputBusyError, SpillMergeError
from .._format import common as F
from .._spill.root import LoadedSegment, Segment
from .._storage import Storage
from .._util.poll import poll
from . import lease as _lease
from . import plan as _plan
from .documents import NAME_BLOCK
from .nametable import NameTable
from .parts import PARTS_DIR
from .plan import Plan, PlannedColumn, PlannedList

PLAN_DIR = f"{PARTS_DIR}/plan"
MANIFEST = f"{PLAN_DIR}/plan.json"
MANIFEST_MAX_BYTES = 256 << 20
"""``plan.json`` holds the columns, the files' column sets and the segments (not per-row data)."""
PLANNER = "planner"
"""The lease a part holds while it builds and stores the plan."""
_KIND = "merge-plan"
_COLUMN_FIELDS: dict[str, Callable[[Any], Any] | None] = {
    "name": None, "leaf": tuple, "kind": None, "dtype": None, "ndim": int, "shape": tuple, "inner_shape": tuple,
    "has_valid": bool, "variant": None, "has_none": bool,
}  # fmt: skip
"""A :class:`PlannedColumn`'s fields ``plan.json`` holds, and how each is read back (its arrays are stored apart)."""
READ = "was read, not rebuilt"
"""In the report's note of a process that read the stored plan."""
BLOCK_BYTES = 4 << 20
"""About the bytes of one stored block (whole rows of the array)."""


class DamagedPlan(CorruptSpillError):
    """A stored plan file fails its digest or does not parse (the caller plans again)."""


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
    """The plan of ``key``: read from the store, or built by ``plan_here`` (the plan and its
    fingerprint for ``settings``) and, with ``may_store``, stored under the ``planner`` lease.
    ``timeout`` > 0 bounds the wait for a planner at work (0: as long as it is alive);
    ``memory_limit`` the blocks of a stored plan kept in memory."""
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


def digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def put_blocks(output: Storage, rel: str, a: np.ndarray) -> dict[str, Any]:
    """Write ``a`` as blocks ``rel.0``, ``rel.1``, ...; the spec ``plan.json`` keeps for it: dtype,
    shape, rows per block, each block's digest and (1-d integers) each block's first element."""
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    row_bytes = dt.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
    rows = max(1, BLOCK_BYTES // max(row_bytes, 1))
    digests, firsts = [], []
    for k, lo in enumerate(range(0, len(a), rows)):
        block = np.ascontiguousarray(a[lo : lo + rows], dtype=dt)
        raw = block.reshape(-1).view(np.uint8).data
        output.put(f"{rel}.{k}", raw)
        digests.append(digest(raw))
        if block.ndim == 1 and dt.kind in "iu":
            firsts.append(int(block[0]))
    spec: dict[str, Any] = {"dtype": dt.str, "shape": [int(d) for d in a.shape], "rows": rows, "blake2b": digests}
    if a.ndim == 1 and dt.kind in "iu":
        spec["first"] = firsts
    return spec


def _body_digest(body: dict[str, Any]) -> str:
    return digest(json.dumps(body, sort_keys=True, ensure_ascii=True).encode("ascii"))


def store(output: Storage, plan: Plan, key: str, fingerprint: str, settings: dict[str, Any]) -> None:
    """Write ``plan`` under ``PLAN_DIR``, every array in blocks (:func:`put_blocks`) and
    ``plan.json`` last and atomically; on an exception remove what was written (without
    ``plan.json`` nobody reads it anyway)."""
    output.rm_tree(PLAN_DIR)  # another key's plan, or a damaged or half-written one
    output.makedirs(PLAN_DIR)
    try:
        arrays: dict[str, dict[str, Any]] = {}

        def put(name: str, a: np.ndarray) -> str:
            arrays[name] = put_blocks(output, f"{PLAN_DIR}/{name}", a)
            return name

        table = plan.filenames
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
                {"rel": s.seg.rel, "chunk_bytes": s.chunk_bytes, "n_checks": 0 if s.checks is None else len(s.checks)}
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


class BlockCache:
    """The blocks a stored plan holds in memory, least recently used evicted beyond ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self._blocks: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def put(self, key: tuple[str, int], block: np.ndarray) -> None:
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = block
            self.bytes += block.nbytes
            while self.bytes > self.limit and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= old.nbytes


class StoredArray:
    """One array of a stored plan, read a block at a time: ``len``, ``shape``, ``dtype``, indexing
    by an int, a slice, an int or bool array, and :meth:`searchsorted` on a sorted 1-d array (one
    block read). ``np.asarray`` reads it all."""

    def __init__(
        self, output: Storage, rel: str, spec: dict[str, Any], cache: BlockCache,
        bad: Callable[[str, str], DamagedPlan], *, monotonic: bool = False,
    ) -> None:  # fmt: skip
        self._output, self._rel, self._cache, self._bad = output, rel, cache, bad
        self.dtype = np.dtype(spec["dtype"])
        self.shape = tuple(int(d) for d in spec["shape"])
        if not self.shape or any(d < 0 for d in self.shape):
            raise bad(rel, f"a bad shape {self.shape}")
        self.ndim = len(self.shape)
        self._rows = int(spec["rows"])
        self._digests = [str(d) for d in spec["blake2b"]]
        n_blocks = -(-self.shape[0] // self._rows) if self._rows > 0 else -1
        if self._rows < 1 or len(self._digests) != n_blocks:
            raise bad(rel, f"{len(self._digests)} block digests for {self.shape[0]} rows of {self._rows}")
        self._row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        if self._rows * self._row_bytes > max(BLOCK_BYTES, self._row_bytes) or self._row_bytes > BLOCK_BYTES:
            # what a block (and an index into it) may allocate is bounded before anything is read
            raise bad(rel, f"blocks of {self._rows} rows of {self._row_bytes} bytes: more than a block holds")
        first = spec.get("first")
        self._first = None if first is None else [int(x) for x in first]
        if self._first is not None and len(self._first) != n_blocks:
            raise bad(rel, "a first element per block is missing")
        self._monotonic = monotonic
        if monotonic and (
            self._first is None or any(b < a for a, b in zip(self._first, self._first[1:], strict=False))
        ):
            raise bad(rel, "offsets that do not rise")

    def __len__(self) -> int:
        return self.shape[0]

    def block(self, k: int) -> np.ndarray:
        """Block ``k``, checked against its digest (and, for offsets, rising)."""
        key = (self._rel, k)
        got = self._cache.get(key)
        if got is not None:
            return got
        rel = f"{self._rel}.{k}"
        n = min(self._rows, self.shape[0] - k * self._rows)
        nbytes = n * self._row_bytes
        try:
            data = self._output.get(rel, max_bytes=nbytes)
        except FileNotFoundError:
            raise self._bad(rel, "missing") from None
        except SpillMergeError as exc:
            raise self._bad(rel, str(exc)) from None
        if len(data) != nbytes or digest(data) != self._digests[k]:
            raise self._bad(rel, "fails its digest in plan.json: the stored plan is damaged")
        block = np.frombuffer(data, dtype=self.dtype).reshape((n, *self.shape[1:]))
        if self._first is not None and n and int(block[0]) != self._first[k]:
            raise self._bad(rel, "its first element is not the one plan.json names")
        if self._monotonic and n > 1 and bool(np.any(block[1:] < block[:-1])):
            raise self._bad(rel, "offsets that do not rise")
        self._cache.put(key, block)
        return block

    def __getitem__(self, key: Any) -> Any:
        n, rows = self.shape[0], self._rows
        if isinstance(key, (int, np.integer)):
            k = int(key) + n if int(key) < 0 else int(key)
            if not 0 <= k < n:
                raise IndexError(f"index {key} out of {n} rows of {self._rel}")
            return self.block(k // rows)[k % rows]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                return self[np.arange(start, stop, step, dtype=np.int64)]
            if stop <= start:
                return np.zeros((0, *self.shape[1:]), dtype=self.dtype)
            k0, k1 = start // rows, (stop - 1) // rows
            pieces = [self.block(k)[max(start - k * rows, 0) : stop - k * rows] for k in range(k0, k1 + 1)]
            return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        idx = np.asarray(key)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False)
        out = np.empty((*idx.shape, *self.shape[1:]), dtype=self.dtype)
        if not idx.size:
            return out
        flat = np.where(idx < 0, idx + n, idx).reshape(-1)
        if int(flat.min()) < 0 or int(flat.max()) >= n:
            raise IndexError(f"index out of {n} rows of {self._rel}")
        dest = out.reshape((-1, *self.shape[1:]))
        which = flat // rows
        k0, k1 = int(which.min()), int(which.max())
        if k0 == k1:  # (nearly always: a chunk's rows lie in one block; no sort of the indices)
            dest[:] = self.block(k0)[flat - k0 * rows]
        else:
            for k in np.unique(which).tolist():
                m = which == k
                dest[m] = self.block(k)[flat[m] - k * rows]
        return out

    def searchsorted(self, v: int, side: str = "left") -> int:
        """``ndarray.searchsorted`` of a rising 1-d integer array, reading one block."""
        if self._first is None:
            raise TypeError(f"{self._rel} is not a stored 1-d integer array")
        find = bisect.bisect_left if side == "left" else bisect.bisect_right
        k = find(self._first, int(v)) - 1
        if k < 0:
            return 0
        return k * self._rows + int(np.searchsorted(self.block(k), v, side=side))  # type: ignore[call-overload]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


def load(
    output: Storage, key: str, segments: Sequence[Segment], *, memory_limit: int
) -> tuple[Plan, str, dict[str, Any]] | None:
    """The stored plan of ``key``, its fingerprint and the settings it was computed for; None when
    there is none (or one of another key). Its arrays are :class:`StoredArray` (at most
    ``memory_limit`` bytes of blocks kept). :class:`DamagedPlan` naming the file when ``plan.json``
    or a block is missing, fails its digest or does not parse, raised where it is read."""
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
        cache = BlockCache(memory_limit)

        def arr(name: str, *, monotonic: bool = False) -> Any:
            return StoredArray(output, f"{PLAN_DIR}/{name}", specs[name], cache, bad, monotonic=monotonic)

        by_rel = {s.rel: s for s in segments}
        checks = np.asarray(arr("checks")[:])  # a few rows per data block of the spill: read whole
        segs, c0 = [], 0
        for s in body["segments"]:
            if s["rel"] not in by_rel:
                raise bad(MANIFEST, f"segment {s['rel']!r} is not committed")
            n = int(s["n_checks"])
            own = np.asarray(checks[c0 : c0 + n]) if n else None
            segs.append(LoadedSegment(by_rel[s["rel"]], [], [], np.zeros((0, 6), np.int64), int(s["chunk_bytes"]), own))
            c0 += n
        columns = []
        for c in body["columns"]:
            kw = {k: c[k] if f is None or c[k] is None else f(c[k]) for k, f in _COLUMN_FIELDS.items()}
            columns.append(PlannedColumn(
                **kw, src=arr(c["src"]), offsets=arr(c["offsets"], monotonic=True) if "offsets" in c else None,
                shapes=arr(c["shapes"]) if "shapes" in c else None, n_present=int(c["present"]),
            ))  # fmt: skip
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
    except SpillMergeError:  # DamagedPlan naming its file, or the storage's own error
        raise
    except Exception as exc:  # noqa: BLE001 - anything a damaged plan provokes: rebuilt, never trusted
        raise bad(MANIFEST, f"malformed ({type(exc).__name__}: {exc})") from None
