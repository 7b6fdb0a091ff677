"""Merge planning: which stored rows become which output rows and columns, checked before anything
is written (docs/FORMAT.md section 2): rows are the sorted distinct ``(filename, frame)`` keys, one
column per leaf path, duplicates resolved by the policy (identical bytes are never an error)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import DuplicateFrameError, SpillValueError
from .._format import common as F
from .._format import output as FO
from .._format import spill as FS
from .._format.keyorder import output_orders
from .._spill.root import Extent, LoadedSegment
from .._util.gcpause import gc_paused
from . import plansql as _plansql
from .nametable import NameTable
from .options import DEFAULT_PLAN_BUDGET
from .plancolumns import (
    ABSENT,
    NONE,
    ROW_BLOCK,
    Alloc,
    PlannedColumn,
    PlannedList,
    blocks,
    distinct,
    file_layouts_of,
    group_names,
    list_domains,
    plan_column,
    variant_groups,
)

SameBytes = Callable[[Sequence[Extent], Sequence[Extent]], bool]
"""``same_bytes(a, b)``: do two stored copies of a frame (leaf extents, in leaf order) hold the same bytes?"""


@dataclass(frozen=True, slots=True)
class Plan:
    """The merge plan and the row table it refers to."""

    filenames: NameTable
    """Sorted, distinct, as UTF-8 bytes and offsets."""
    file_offsets: np.ndarray
    """int64 (n_files + 1,): rows of file i are ``file_offsets[i] .. file_offsets[i+1]-1``."""
    frame_idx: np.ndarray
    """int64 (n_rows,): frame index of each output row."""
    rank: np.ndarray
    """int32 (n_rows,): rank whose segment each output row came from."""
    copies: np.ndarray
    """int32 (n_rows,): segments that held each row's frame (1 unless duplicated)."""
    file_layout: np.ndarray
    """int32 (n_files,): position in ``file_layouts`` of each file's column set."""
    file_layouts: list[list[str]]
    """Distinct sorted column-name sets of the files."""
    columns: list[PlannedColumn]
    """Sorted by name."""
    segments: list[LoadedSegment]
    """Source segments; ``seg`` values index this list."""
    seg: np.ndarray
    """Row table: source segment of each stored leaf row."""
    offset: np.ndarray
    """Row table: byte offset in the segment's data."""
    nbytes: np.ndarray
    """Row table: byte length."""
    crc: np.ndarray
    """Row table: CRC-32C."""
    duplicates: int
    """Duplicate (filename, frame) copies dropped (identical content or by policy)."""
    total_bytes: int
    """The payload bytes of every column's rows."""
    lists: list[PlannedList] = dataclasses.field(default_factory=list)
    """The list offsets of every list path, parents before children."""
    key_orders: dict[str, Any] | None = None
    """The output header's ``key_orders`` (``_format.keyorder.output_orders``): the dicts' key order,
    from the segments' layouts, kept with the plan so a stored plan carries it too."""

    @property
    def n_files(self) -> int:
        return len(self.filenames)

    @property
    def n_frames(self) -> int:
        return len(self.frame_idx)


def build(
    segments: Iterable[LoadedSegment], on_duplicate: str = "error", *, same_bytes: SameBytes,
    work_dir: str | None = None, memory_limit: int = DEFAULT_PLAN_BUDGET,
) -> Plan:  # fmt: skip
    """The plan for ``segments`` (in write order). ``same_bytes`` is asked, only for duplicate keys
    whose leaves, sizes and checksums all agree, whether the copies' bytes are the same; copies
    that differ go to the ``on_duplicate`` policy, whatever their checksums say.

    ``memory_limit``: DuckDB sorts the index rows out of core under half of it (or numpy in memory
    when few, ``_merge.plansql.in_memory``), in a work folder under ``work_dir`` (default: the
    system's temporary folder) removed before this returns. The other half holds one segment's rows,
    one sorted batch, the small tables, then the per-row arrays and temporaries of the steps below."""
    if on_duplicate not in ("error", "first", "last"):
        raise SpillValueError(f"on_duplicate must be 'error', 'first' or 'last', got {on_duplicate!r}")
    segments = list(segments)
    raw_lp: dict[tuple[str, ...], int] = {}
    layouts: list[FS.Layout] = []
    gl_id: dict[FS.Layout, int] = {}
    leaf_paths: list[tuple[str, ...]] = []

    def layout_ids(s: LoadedSegment) -> tuple[np.ndarray, np.ndarray]:
        # Global layout ids in write order, of segments that hold rows; leaf paths of every segment.
        pmap = np.array([raw_lp.setdefault(lay.leaf, len(raw_lp)) for lay in s.layouts], dtype=np.int64)
        if not s.n_rows:  # from the commit record: the index is not read here
            return np.zeros(0, np.int64), pmap
        ids = np.array([gl_id.setdefault(lay, len(gl_id)) for lay in s.layouts], dtype=np.int64)
        layouts.extend(list(gl_id)[len(layouts) :])  # in step with gl_id (``resolve`` reads it)
        return ids, pmap

    def lp_order() -> np.ndarray:
        leaf_paths.extend(sorted(raw_lp))
        pos = {p: i for i, p in enumerate(leaf_paths)}
        return np.array([pos[p] for p in raw_lp], dtype=np.int64)

    resolve = functools.partial(resolve_duplicates, segments=segments, on_duplicate=on_duplicate,
                                same_bytes=same_bytes, layouts=layouts)  # fmt: skip
    n_index = sum(s.n_rows for s in segments)  # from the commit records: nothing read yet
    with _plansql.workspace(work_dir) as folder:  # made only if the sort or an array needs it
        if _plansql.in_memory(n_index, memory_limit):
            srt = gc_paused(_plansql.sort_rows_in_memory, segments, layout_ids, lp_order, resolve)
        else:
            srt = _plansql.sort_rows(
                segments, layout_ids, lp_order, resolve, memory_limit=memory_limit, folder=folder()
            )
        return _assemble(srt, segments, layouts, leaf_paths, functools.partial(_plansql.alloc, folder))


def _assemble(
    srt: _plansql.Sorted, segments: list[LoadedSegment], layouts: list[FS.Layout],
    leaf_paths: list[tuple[str, ...]], new: Alloc,
) -> Plan:  # fmt: skip
    """The plan from the sorted kept rows and keys (the output rows): ranks, lists, variants,
    columns and each file's column set, a block of rows at a time; every per-row array it makes
    from ``new`` (a map of a file of the plan's work folder beyond ``_merge.plansql.MAPPED_ROWS``
    rows), so what the plan holds in anonymous memory does not grow with its rows."""
    names, c, n_rows = srt.names, srt.rows, len(srt.keys["frame_idx"])
    seg_rank = np.array([s.seg.rank for s in segments], dtype=np.int32)
    rank, copies = new("rank", n_rows, np.int32), new("copies", n_rows, np.int32)
    for a, b in blocks(n_rows):  # int32, as the output's index arrays hold them
        rank[a:b] = seg_rank[srt.keys["key_seg"][a:b]]
        copies[a:b] = srt.keys["copies"][a:b]

    heads = {lay.leaf for lay in layouts if lay.dtype in ("pylist", "pytuple")}
    gpaths, gp, drow, lists, sizes = list_domains(c["lp"], srt.row_of, leaf_paths, n_rows, heads, new)
    c["lp"] = gp  # from here on a column's path: every item position of a list is one child path
    group, groups = variant_groups(c, layouts, gpaths, new)
    names_of = group_names(groups, gpaths)
    is_none = np.array([F.DTYPES[lay.dtype].kind == "none" for lay in layouts], dtype=bool)
    # every column's source rows in one pass over the entries: a value's entry, or NONE
    srcs = [new("src", sizes[F.list_domain(gpaths[p])], np.int64, ABSENT) for p, _ in groups]
    for a, b in blocks(len(c["file"])):
        gb = np.asarray(group[a:b])
        none = is_none[c["gl"][a:b]]
        db = np.asarray(drow[a:b])
        for g in distinct(gb).tolist():
            m = np.flatnonzero(gb == g)
            srcs[g][db[m]] = np.where(none[m], NONE, a + m)
    columns = []
    for g, (p, tag) in enumerate(groups):
        planned = plan_column(names_of[g], gpaths[p], srcs[g], c, layouts, len(srcs[g]), new)
        if tag is not None and not (planned.kind in FO.NUMERIC_KINDS and tag == planned.dtype):
            # the header names the variant its name carries (a split by numeric dtype alone does not)
            planned = dataclasses.replace(planned, variant=tag)
        columns.append(planned)
    columns.sort(key=lambda col: col.name)
    total = sum(int(c["nb"][s].sum()) for col in columns for s in _present(col))

    file_layout, file_layouts = file_layouts_of(c["file"], group, len(names), names_of, new)
    return Plan(
        names, srt.file_offsets, srt.keys["frame_idx"], rank, copies, file_layout, file_layouts, columns, segments,
        c["seg"], c["off"], c["nb"], c["crc"], srt.duplicates, total, lists,
        output_orders(names, segments, srt.file_ids, new=new),
    )  # fmt: skip


def resolve_duplicates(
    c: dict[str, np.ndarray],
    key_start: np.ndarray,
    name_of: Callable[[int], str],
    segments: list[LoadedSegment],
    on_duplicate: str,
    same_bytes: SameBytes,
    layouts: Sequence[FS.Layout],
) -> tuple[np.ndarray, int]:
    """The rows ``c`` of keys held by several segments, in (file, frame, segment, leaf) order, each
    key's first at ``key_start``: which to keep (one segment's per key) and how many copies are dropped. Keys are
    decided in order: the first whose copies differ raises under ``on_duplicate='error'``.
    Copies are identical when their leaves have the same dtypes, shapes and bytes (``layouts``:
    by global layout id; a dict's key order aside, as ``==`` has it)."""
    n = len(c["file"])
    keep = np.ones(n, dtype=bool)
    duplicates = 0
    for a, b in zip(key_start.tolist(), [*key_start[1:].tolist(), n], strict=True):
        groups: dict[int, list[int]] = {}
        for r in range(a, b):  # rows of one key: by segment, then leaf
            groups.setdefault(int(c["seg"][r]), []).append(r)
        seg_ids = sorted(groups)  # segment order = write order (segments sorted by start time)
        # A negative CRC names a block checksum, not the bytes: a leaf whose copies mix a row CRC
        # and a block pointer (write() and write_batch(), or one copy in a block of frames) is
        # compared by bytes; two row CRCs that differ prove different bytes.
        sigs = {
            tuple((int(c["lp"][r]), int(c["nb"][r]), layouts[c["gl"][r]].dtype, layouts[c["gl"][r]].shape) for r in rows)
            for rows in groups.values()
        }
        # sizes and checksums agree (the same leaves: one row of each copy per leaf): only the bytes can tell
        agree = len(sigs) == 1 and all(
            len({int(c["crc"][r]) for r in leaf if c["crc"][r] >= 0}) <= 1 for leaf in zip(*groups.values(), strict=True)
        )
        identical = agree
        if agree:  # equal checksums are not equal bytes (CRC-32C collides): compare the bytes
            ext = {s: [Extent(segments[s], int(c["off"][r]), int(c["nb"][r]), int(c["crc"][r])) for r in groups[s]]
                   for s in seg_ids}  # fmt: skip
            identical = all(same_bytes(ext[seg_ids[0]], ext[s]) for s in seg_ids[1:])
        if not identical and on_duplicate == "error":
            fname, frame = name_of(int(c["file"][a])), int(c["frame"][a])
            ranks = sorted({segments[s].seg.rank for s in seg_ids})
            raise DuplicateFrameError(
                f"frame {frame} of {fname!r:.200} was written with different content by rank(s) {ranks} "
                f"({', '.join(segments[s].seg.rel for s in seg_ids)})"
                + (" (their CRC-32C checksums agree, their bytes do not)" if agree else "")
                + "; merge with on_duplicate='first' "
                "or 'last' (--on-duplicate) to pick one",
                filename=fname,
                frame_idx=frame,
                ranks=ranks,
            )
        # Which copy the key's rows come from (docs/GUARANTEES.md, *Resuming a crashed job*).
        # Identical copies: the lowest rank's, then its earliest segment — a rule of the spill
        # root's contents alone, so ``frame_rank`` names the same rank whatever order the segments
        # were started, listed or loaded in (DistributedSampler's padding always attributes to the
        # lowest rank that wrote the frame). Different content: the policy picks by write order —
        # ``first`` the earliest segment start, ``last`` the latest (rank breaks ties); ``seg_ids``
        # are positions in ``segments``, which are in that order.
        chosen = (min(seg_ids, key=lambda s: (segments[s].seg.rank, s)) if identical
                  else seg_ids[-1] if on_duplicate == "last" else seg_ids[0])  # fmt: skip
        keep[a:b] = c["seg"][a:b] == chosen
        duplicates += len(seg_ids) - 1
    return keep, duplicates


def fingerprint(plan: Plan, **settings: Any) -> str:
    """A digest of everything that decides the output's bytes: the source segments, the files,
    rows and columns, the source rows chosen for them (segment, offset, size, checksum) and the
    output ``settings`` (chunk size, codec). Two processes that compute the same fingerprint write
    the same output; parts of a parallel merge record it and refuse to mix."""
    h = hashlib.blake2b(digest_size=16)
    head = {
        "format_version": F.FORMAT_VERSION,
        "settings": settings,
        "segments": [s.seg.rel for s in plan.segments],
        "columns": [c.header().to_obj() for c in plan.columns],
        "file_layouts": plan.file_layouts,
        "lists": [[lst.name, list(lst.path)] for lst in plan.lists],
        "key_orders": plan.key_orders,
    }
    h.update(json.dumps(head, sort_keys=True, ensure_ascii=True).encode("ascii"))

    def feed(a: Any, dtype: str = "<i8", step: int = ROW_BLOCK) -> None:
        """Hash ``a`` a block at a time (the arrays may be maps of files), each from its buffer:
        the digest is that of the whole arrays back to back."""
        for i in range(0, len(a), step):
            h.update(np.ascontiguousarray(a[i : i + step], dtype=dtype).data)

    # The names as UTF-8 bytes (surrogatepass: filenames may hold lone surrogates) and their offsets.
    names = plan.filenames
    feed(names.data, "u1", ROW_BLOCK * 16)
    for a in (names.offsets, plan.file_offsets, plan.frame_idx, plan.file_layout, *(x.offsets for x in plan.lists)):
        feed(a)
    for col in plan.columns:
        feed(col.src)
        for table in (plan.seg, plan.offset, plan.nbytes, plan.crc):
            for s in _present(col):
                feed(table[s])
    return h.hexdigest()


def _present(col: PlannedColumn) -> Iterator[np.ndarray]:
    """The row table positions of ``col``'s present rows, a block of rows at a time."""
    for a in range(0, len(col.src), ROW_BLOCK):
        s = np.asarray(col.src[a : a + ROW_BLOCK])
        yield s[s >= 0]
