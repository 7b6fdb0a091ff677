"""Merge planning: which stored rows become which output rows and columns, checked before anything
is written (format version 2: one array per leaf column across all rows, docs/FORMAT.md section 2).

Rows are the distinct ``(filename, frame)`` keys, files sorted, frames ascending within a file.
Every leaf path of the merge is one column; a leaf keeps one kind, dtype and ``ndim`` across the
merge (its shape may vary: the column is then ragged). Duplicate keys are resolved by the policy
(identical content is never an error). Content is identical only when the bytes are: the plan
reads nothing itself, it asks a ``same_bytes`` callback (``_spillroot.same_bytes`` over the
merge's storage) about duplicates whose checksums agree. Everything is vectorised over rows: a
million one-frame files plan in seconds, with no Python object per file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _format as F
from . import _format_output as FO
from . import _format_spill as FS
from . import _plansql
from ._errors import DuplicateFrameError, LayoutMismatchError, SpillValueError
from ._options import DEFAULT_PLAN_BUDGET
from ._spillroot import Extent, LoadedSegment

SameBytes = Callable[[Sequence[Extent], Sequence[Extent]], bool]
"""``same_bytes(a, b)``: do two stored copies of a frame (leaf extents, in leaf order) hold the same bytes?"""

VALUE_COLUMN = F.VALUE_COLUMN

ROW_BLOCK = 1 << 20
"""Rows per block of the loops over per-row arrays (bounded temporaries whatever the plan size)."""

#: Output column kind of each non-numeric spill dtype (numeric ones are ``fixed`` or ``ragged``).
KIND = {"str": "str", "bytes": "bytes", "pickle": "pickle", "strlist": "strlist"}


@dataclass(frozen=True, slots=True)
class PlannedColumn:
    """The plan of one leaf column of the output, ``columns/<name>/``: where each row's bytes come
    from (the merge side; the reader's is ``_views.OpenColumn``)."""

    name: str
    """Node name under ``columns/``."""
    leaf: tuple[str, ...]
    """Dict keys from the frame value to the leaf."""
    kind: str
    """``fixed``, ``ragged``, ``str``, ``bytes``, ``pickle`` or ``strlist``."""
    dtype: str
    """Dtype name (numeric kinds) or the kind."""
    ndim: int
    """Dimensions of one row's value (0 for str, bytes, pickle; 1 for strlist)."""
    shape: tuple[int, ...] | None
    """``fixed``: the shape of every row's value."""
    inner: tuple[int, ...] | None
    """``ragged``: the dimensions after the first when only the first varies, else None."""
    src: np.ndarray
    """int64 (n_rows,): position in the plan's row table of each output row's bytes, -1 when absent."""
    counts: np.ndarray | None
    """int64 (n_rows,): units of ``values`` per row (offsets' steps), for kinds with offsets."""
    shapes: np.ndarray | None
    """int64 (n_rows, ndim): per-row shapes of a ragged column without ``inner``; of a list-of-str
    column, (n_rows, 1): the strings in each row."""
    has_valid: bool
    """Some row lacks the leaf (a ``valid`` array is written)."""
    variant: str | None = None
    """The variant tag of a leaf's column when the leaf has several variants that are not only
    numeric dtypes (``_variant_groups``); None otherwise (the name carries at most the dtype)."""
    offs: np.ndarray | None = None
    """``offsets()`` computed once (an out-of-core plan keeps them on disk), else None."""
    known_present: int | None = None
    """:meth:`present` when the planner knows it (a plan in ranges: the ranges' summaries), so
    that no process reads every row's ``src`` for it (the whole plan, from an object store)."""

    @property
    def storage(self) -> str:
        """numpy dtype of ``values``: ``uint8`` (bytes) for the non-numeric kinds."""
        if self.kind in ("str", "strlist", "bytes", "pickle"):
            return "uint8"
        return F.DTYPES[self.dtype].storage

    @property
    def has_offsets(self) -> bool:
        """Ragged, bytes, pickle and strlist columns, and fixed columns with absent rows (whose
        ``values`` hold only the rows that have a value: no zeros are stored for the others)."""
        return self.counts is not None

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Shape of one unit (one first-dimension entry) of ``values``."""
        if self.kind == "fixed":
            assert self.shape is not None
            return self.shape
        if self.kind == "ragged" and self.inner is not None:
            return self.inner
        return ()

    @property
    def unit_bytes(self) -> int:
        """Bytes of one unit of ``values`` (numeric kinds and bytes/pickle)."""
        n = np.dtype(self.storage).itemsize if self.storage != "string" else 1
        for d in self.unit_shape:
            n *= d
        return n

    def offsets(self) -> np.ndarray:
        assert self.counts is not None
        if self.offs is not None:
            return self.offs
        out = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=out[1:])
        return out

    @property
    def n_units(self) -> int:
        """Length of ``values``' first dimension."""
        if self.counts is None:
            return len(self.src)
        if self.offs is not None:
            return int(self.offs[-1])
        return int(self.counts.sum())

    def present(self) -> int:
        """Rows that have a value (read a block at a time)."""
        if self.known_present is not None:
            return self.known_present
        return sum(int(np.count_nonzero(self.src[a : a + ROW_BLOCK] >= 0)) for a in range(0, len(self.src), ROW_BLOCK))

    def header(self, chunk_max_bytes: int | None = None) -> FO.ColumnHeader:
        """The column group's ``spillmerge`` attributes (docs/FORMAT.md section 2, *Columns*)."""
        return FO.ColumnHeader(
            leaf=self.leaf,
            kind=self.kind,
            dtype=self.dtype,
            ndim=self.ndim,
            inner_shape=self.inner,
            has_valid=self.has_valid,
            chunk_max_bytes=chunk_max_bytes,
            variant=self.variant,
        )


@dataclass(frozen=True, slots=True)
class PlannedList:
    """The list offsets of one list path of the output (format 4, ``lists/<name>/offsets``): the
    items of the lists at ``path[:-1]`` in row ``r`` of its parent domain are the rows
    ``offsets[r] .. offsets[r + 1] - 1`` of the columns under ``path``."""

    name: str
    """Node name under ``lists/`` (the node name of ``path``, as a column of it would have)."""
    path: tuple[str, ...]
    """The child path, ending in ``ITEM``."""
    offsets: np.ndarray
    """int64 (n_parent + 1,), from 0 to the number of items."""

    @property
    def parent(self) -> tuple[str, ...]:
        """The list whose items hold these lists (``()``: the output's rows)."""
        return F.list_domain(self.path[:-1])


@dataclass(frozen=True, slots=True)
class Plan:
    """The merge plan and the row table it refers to."""

    filenames: Sequence[str]
    """Sorted, distinct (a list, or an out-of-core plan's ``_plan_disk.StringTable``)."""
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
    lists: list[PlannedList] = dataclasses.field(default_factory=list)
    """Format 4: the list offsets of every list path, parents before children."""
    range_digests: list[str] | None = None
    """A plan built in ranges by several processes (``_plan_disk``, ``_planranges``): each
    range's digest of its arrays, which its planner computed; the fingerprint hashes these
    instead of every array (each process then reads only its own range to fingerprint the plan)."""
    known_bytes: int | None = None
    """:attr:`total_bytes` when the planner knows it (a plan in ranges: the ranges' summaries), so
    that no process reads every row's size for it (the whole plan, from an object store)."""

    @property
    def n_files(self) -> int:
        return len(self.filenames)

    @property
    def n_frames(self) -> int:
        return len(self.frame_idx)

    @property
    def total_bytes(self) -> int:
        if self.known_bytes is not None:
            return self.known_bytes
        total = 0
        for c in self.columns:  # a block of rows at a time: the arrays may be maps of files
            for a in range(0, len(c.src), ROW_BLOCK):
                s = np.asarray(c.src[a : a + ROW_BLOCK])
                total += int(self.nbytes[s[s >= 0]].sum())
        return total

    def file_rows(self, i: int) -> tuple[int, int]:
        return int(self.file_offsets[i]), int(self.file_offsets[i + 1])

    def top_row(self, col: PlannedColumn, r: int) -> int:
        """The output row whose value holds row ``r`` of ``col`` (a list's item: through the
        offsets of its lists, innermost first), for messages naming a file and frame."""
        offs = {lst.path: lst.offsets for lst in self.lists}
        domain = F.list_domain(col.leaf)
        for k in range(len(domain) - 1, -1, -1):
            if domain[k] == F.ITEM:
                r = int(np.searchsorted(offs[domain[: k + 1]], r, side="right")) - 1
        return r


def _ranks(segments: list[LoadedSegment], seg_ids: np.ndarray) -> list[int]:
    return sorted({segments[int(s)].seg.rank for s in np.unique(seg_ids)})


def _leaf_name(leaf: tuple[str, ...]) -> str:
    return "/".join(leaf) or "<value>"


def column_names(leaves: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """Node name under ``columns/`` of each leaf path (docs/FORMAT.md section 2, *Columns*)."""
    text = {leaf: F.leaf_text(leaf) for leaf in leaves if leaf}
    if len(set(text.values())) != len(text):
        a, b = [p for p in text if list(text.values()).count(text[p]) > 1][:2]
        raise LayoutMismatchError(
            f"leaf paths {list(a)} and {list(b)} have the same name; rename a dict key",
            filename="",
            leaf=_leaf_name(a),
        )
    enc = F.node_names(sorted(text.values()))
    out = {leaf: enc[s] for leaf, s in text.items()}
    if () in leaves:
        out[()] = VALUE_COLUMN
    return out


def build(
    segments: Iterable[LoadedSegment], on_duplicate: str = "error", *, same_bytes: SameBytes,
    work_dir: str | None = None, memory_limit: int = DEFAULT_PLAN_BUDGET, threads: int | None = None,
) -> Plan:  # fmt: skip
    """The plan for ``segments`` (in write order). ``same_bytes`` is asked, only for duplicate keys
    whose leaves, sizes and checksums all agree, whether the copies' bytes are the same; copies
    that differ go to the ``on_duplicate`` policy, whatever their checksums say.

    The index rows are sorted out of core by DuckDB (``_plansql``) under ``memory_limit`` bytes,
    with ``threads`` threads (default: up to 4) and its temporary files in a work folder under
    ``work_dir`` (default: the system's temporary folder), removed before this returns. Memory:
    ``memory_limit`` for the sort, one segment's rows while it is inserted, and the small tables
    (layouts, leaf paths, the distinct filenames); then the per-row arrays of the plan (maps of
    files, not anonymous memory, beyond ``_plansql.MAPPED_ROWS`` rows) and the numpy temporaries
    of the steps below, which are per-row (about a dozen int64 arrays of the plan's rows)."""
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
        if not len(s.index):
            return np.zeros(0, np.int64), pmap
        for lay in s.layouts:
            if lay not in gl_id:
                gl_id[lay] = len(layouts)
                layouts.append(lay)
        return np.array([gl_id[lay] for lay in s.layouts], dtype=np.int64), pmap

    def lp_order() -> np.ndarray:
        leaf_paths.extend(sorted(raw_lp))
        pos = {p: i for i, p in enumerate(leaf_paths)}
        return np.array([pos[p] for p in raw_lp], dtype=np.int64)

    def resolve(rows: dict[str, np.ndarray], names: list[str]) -> tuple[np.ndarray, int]:
        return resolve_duplicates(rows, names, segments, on_duplicate, same_bytes)

    srt = _plansql.sort_rows(
        segments, layout_ids, lp_order, resolve, work_dir=work_dir, memory_limit=memory_limit,
        threads=threads if threads is not None else min(4, os.cpu_count() or 1),
    )  # fmt: skip
    names, c, copies, duplicates = srt.names, srt.rows, srt.copies, srt.duplicates
    if not len(c["file"]):
        e = np.zeros(0, np.int64)
        return Plan([], np.zeros(1, np.int64), e, e.astype(np.int32), e.astype(np.int32), e.astype(np.int32), [],
                    [], segments, e, e, e, e, duplicates=0)  # fmt: skip

    # Rows: distinct (file, frame), in order (DuckDB sorted them); every entry's row number.
    n_ent = len(c["file"])
    new_key = np.ones(n_ent, dtype=bool)
    new_key[1:] = (np.diff(c["file"]) != 0) | (np.diff(c["frame"]) != 0)
    row_of = np.cumsum(new_key) - 1
    key_start = np.flatnonzero(new_key)
    n_rows = len(key_start)
    file_of_row = c["file"][key_start]
    frame_idx = c["frame"][key_start].copy()
    seg_rank = np.array([s.seg.rank for s in segments], dtype=np.int32)
    rank = seg_rank[c["seg"][key_start]]
    file_offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(np.bincount(file_of_row, minlength=len(names)), out=file_offsets[1:])

    heads = {lay.leaf for lay in layouts if lay.dtype in ("pylist", "pytuple")}
    gpaths, gp, drow, lists, sizes = list_domains(c["lp"], row_of, leaf_paths, n_rows, heads)
    c["lp"] = gp  # from here on a column's path: every item position of a list is one child path
    group, groups = _variant_groups(c, layouts, gpaths)
    names_of = group_names(groups, gpaths)
    kinds = np.array([F.DTYPES[lay.dtype].kind for lay in layouts])
    is_none = kinds[c["gl"]] == "none"
    columns = []
    for g, (p, tag) in enumerate(groups):
        sel = np.flatnonzero(group == g)
        present = sel[~is_none[sel]]
        n_dom = sizes[F.list_domain(gpaths[p])]
        src = np.full(n_dom, -1, dtype=np.int64)
        src[drow[present]] = present
        planned = _column(names_of[g], gpaths[p], src, c, layouts, n_dom)
        if tag is not None and not (planned.kind in FO.NUMERIC_KINDS and tag == planned.dtype):
            # the header names the variant its name carries (a split by dtype alone: version 2's rule)
            planned = dataclasses.replace(planned, variant=tag)
        columns.append(planned)
    columns.sort(key=lambda col: col.name)

    file_layout, file_layouts = _file_layouts(c["file"], group, len(names), names_of)
    return Plan(
        names, file_offsets, frame_idx, rank, copies[key_start].astype(np.int32), file_layout, file_layouts,
        columns, segments, c["seg"], c["off"], c["nb"], c["crc"], duplicates, lists,
    )  # fmt: skip


def list_domains(
    lp: np.ndarray, row_of: np.ndarray, leaf_paths: list[tuple[str, ...]], n_rows: int,
    headers: set[tuple[str, ...]] = frozenset(),  # type: ignore[assignment]
) -> tuple[list[tuple[str, ...]], np.ndarray, np.ndarray, list[PlannedList], dict[tuple[str, ...], int]]:  # fmt: skip
    """Arrow's list model over the spill's item positions (docs/FORMAT.md, *Lists*): every spill
    path ``P/\x1f<i>/...`` becomes the child path ``P/\x1f*/...``, whose rows are the items of
    all the lists at ``P``, flattened (row ``r``'s items are rows ``offsets[r] ..
    offsets[r+1]-1``), to any depth. A list's length is one more than its highest item position
    (every item of a list has a leaf: a value, ``None``, or a header), so the offsets come from
    the catalog alone. ``headers``: the leaf paths of ``pylist`` / ``pytuple`` headers, whose
    lists get offsets even where every one of them is empty. Returns the column paths, each
    entry's path and row in its path's domain, the lists (parents first) and every domain's size
    (``()``: the output's rows)."""
    general = [F.general_path(p) for p in leaf_paths]
    gpaths = sorted({g for g, _ in general})
    gid = {g: i for i, g in enumerate(gpaths)}
    gp = np.array([gid[g] for g, _ in general], dtype=np.int64)[lp] if len(leaf_paths) else lp.copy()
    drow = row_of.astype(np.int64, copy=True)
    sizes: dict[tuple[str, ...], int] = {(): n_rows}
    list_paths = {g[: d + 1] for g, _ in general for d, seg in enumerate(g) if seg == F.ITEM}
    list_paths |= {(*F.general_path(h[:-1])[0], F.ITEM) for h in headers}
    if not list_paths:
        return gpaths, gp, drow, [], sizes
    depth = max(len(ix) for _, ix in general)
    # per level k: each leaf path's list (its prefix up to its k-th item segment) and position
    chain = np.full((max(depth, 1), len(leaf_paths)), -1, dtype=np.int64)
    pos = np.zeros((max(depth, 1), len(leaf_paths)), dtype=np.int64)
    ordered = sorted(list_paths, key=lambda p: (p.count(F.ITEM), p))
    list_id = {p: i for i, p in enumerate(ordered)}
    for j, (g, ix) in enumerate(general):
        ends = [d for d, seg in enumerate(g) if seg == F.ITEM]
        for k, d in enumerate(ends):
            chain[k, j] = list_id[g[: d + 1]]
            pos[k, j] = ix[k]
    lists: list[PlannedList] = []
    names = column_names(ordered)
    for lid, path in enumerate(ordered):
        k = path.count(F.ITEM) - 1
        sel = np.flatnonzero(chain[k][lp] == lid) if k < depth and len(lp) else np.zeros(0, np.int64)
        idx = pos[k][lp[sel]] if len(sel) else sel
        n_parent = sizes[F.list_domain(path[:-1])]
        lengths = np.zeros(n_parent, dtype=np.int64)
        np.maximum.at(lengths, drow[sel], idx + 1)
        offsets = np.zeros(n_parent + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        drow[sel] = offsets[drow[sel]] + idx
        sizes[path] = int(offsets[-1])
        lists.append(PlannedList(names[path], path, offsets))
    return gpaths, gp, drow, lists, sizes


def resolve_duplicates(
    c: dict[str, np.ndarray],
    names: Sequence[str],
    segments: list[LoadedSegment],
    on_duplicate: str,
    same_bytes: SameBytes,
) -> tuple[np.ndarray, int]:
    """The rows ``c`` of keys held by several segments, in (file, frame, segment, leaf) order:
    which to keep (one segment's per key, ``_keep``) and how many copies are dropped. Keys are
    decided in order: the first whose copies differ raises under ``on_duplicate='error'``."""
    n = len(c["file"])
    new_key = np.ones(n, dtype=bool)
    new_key[1:] = (np.diff(c["file"]) != 0) | (np.diff(c["frame"]) != 0)
    key_start = np.flatnonzero(new_key)
    keep = np.ones(n, dtype=bool)
    duplicates = 0
    key_end = np.append(key_start[1:], n)
    for k in range(len(key_start)):
        a, b = int(key_start[k]), int(key_end[k])
        groups: dict[int, list[int]] = {}
        for r in range(a, b):  # rows of one key: by segment, then leaf
            groups.setdefault(int(c["seg"][r]), []).append(r)
        seg_ids = sorted(groups)  # segment order = write order (segments sorted by start time)
        # A negative CRC names a block checksum, not the bytes: a leaf whose copies mix a row CRC
        # and a block pointer (write() and write_batch(), or one copy in a block of frames) is
        # compared by bytes; two row CRCs that differ prove different bytes.
        sigs = {tuple((int(c["lp"][r]), int(c["nb"][r])) for r in rows) for rows in groups.values()}
        identical = len(sigs) == 1
        if identical:
            crcs = np.array([[int(c["crc"][r]) for r in rows] for rows in groups.values()], dtype=np.int64)
            identical = all(len({int(v) for v in col if v >= 0}) <= 1 for col in crcs.T)
        agree = identical  # sizes and checksums agree: only their bytes can tell
        if identical:  # equal checksums are not equal bytes (CRC-32C collides): compare the bytes
            ext = {
                s: [Extent(segments[s], int(c["off"][r]), int(c["nb"][r]), int(c["crc"][r])) for r in groups[s]]
                for s in seg_ids
            }
            identical = all(same_bytes(ext[seg_ids[0]], ext[s]) for s in seg_ids[1:])
        if not identical and on_duplicate == "error":
            fname, frame = names[int(c["file"][a])], int(c["frame"][a])
            ranks = _ranks(segments, np.array(seg_ids))
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
        chosen = _keep(segments, seg_ids, on_duplicate, identical=identical)
        keep[a:b] = c["seg"][a:b] == chosen
        duplicates += len(seg_ids) - 1
    return keep, duplicates


def _variant_groups(
    c: dict[str, np.ndarray], layouts: list[FS.Layout], leaf_paths: list[tuple[str, ...]]
) -> tuple[np.ndarray, list[tuple[int, str | None]]]:
    """Which column each stored leaf row goes to: one per leaf path and *variant* (kind, dtype,
    ndim; docs/FORMAT.md, *Value model*). A leaf that holds one variant everywhere is one column,
    as in version 2; one that is ``float16`` in some rows and a ``str`` or a 2-d ``float32`` in
    others makes one column per variant, each with the rows of its variant (the others absent):
    nothing is converted, and a row has a value in at most one of them. Rows that say nothing
    about the variant (``None``, numeric rows of zero elements) join a compatible variant of their
    file (the lowest), else of their leaf, else one of their own. Returns each entry's group and
    the groups' (leaf path position, variant tag or None when the leaf has one column)."""
    sig_code: dict[tuple[str, str, int], int] = {}
    lcode = np.full(len(layouts), -1, dtype=np.int64)
    for g, lay in enumerate(layouts):
        dt = F.DTYPES[lay.dtype]
        if dt.kind == "none" or (dt.numeric and 0 in lay.shape):
            continue
        sig = ("num", lay.dtype, len(lay.shape)) if dt.numeric else (dt.kind, dt.kind, 1 if dt.kind == "strlist" else 0)
        lcode[g] = sig_code.setdefault(sig, len(sig_code))
    code = lcode[c["gl"]]
    weak = np.flatnonzero(code < 0)
    if len(weak):
        n_lp, n_sig = len(leaf_paths), max(len(sig_code), 1)
        definite = code >= 0
        pair = c["file"] * n_lp + c["lp"]
        pair_codes = np.unique(pair[definite] * n_sig + code[definite])
        leaf_codes: dict[int, set[int]] = {}
        for k in np.unique(c["lp"][definite] * n_sig + code[definite]).tolist():
            leaf_codes.setdefault(k // n_sig, set()).add(k % n_sig)
        sigs = sorted(sig_code, key=sig_code.__getitem__)
        weak_gl = c["gl"][weak]
        # empty numeric rows first: a leaf whose only variant is theirs then takes its None rows too
        for g in sorted(np.unique(weak_gl).tolist(), key=lambda g: layouts[g].dtype == "none"):
            lay = layouts[g]
            rows = weak[weak_gl == g]
            if lay.dtype == "none":
                ok = list(range(len(sigs)))
            else:  # zero elements: the same ndim; ``[]`` is also an empty list of strings
                nd = len(lay.shape)
                ok = [i for i, s in enumerate(sigs) if s[0] == "num" and s[2] == nd]
                ok += [i for i, s in enumerate(sigs) if nd == 1 and s[0] == "strlist"]
            got = np.full(len(rows), -1, dtype=np.int64)
            for cand in ok:
                hit = (got < 0) & np.isin(pair[rows] * n_sig + cand, pair_codes)
                got[hit] = cand
            left = got < 0
            for p in np.unique(c["lp"][rows[left]]).tolist() if left.any() else ():
                m = left & (c["lp"][rows] == p)
                have = leaf_codes.setdefault(p, set())
                found = next((i for i in ok if i in have), None)
                if found is not None:
                    cand = found
                else:
                    own = ("none", "none", 0) if lay.dtype == "none" else ("num", lay.dtype, len(lay.shape))
                    cand = sig_code.setdefault(own, len(sig_code))
                    if cand == len(sigs):
                        sigs.append(own)
                    if own[0] != "none":
                        ok.append(cand)
                    have.add(cand)
                got[m] = cand
            code[rows] = got
    n_codes = max(len(sig_code), 1)
    key = c["lp"] * n_codes + code
    uniq, group = np.unique(key, return_inverse=True)
    by_leaf: dict[int, list[tuple[str, str, int]]] = {}
    sigs_all = sorted(sig_code, key=sig_code.__getitem__)
    for k in uniq.tolist():
        by_leaf.setdefault(k // n_codes, []).append(sigs_all[k % n_codes])
    groups: list[tuple[int, str | None]] = []
    for k in uniq.tolist():
        p, sig = k // n_codes, sigs_all[k % n_codes]
        variants = by_leaf[p]
        if len(variants) == 1:
            groups.append((p, None))
        elif all(v[0] == "num" and v[2] == sig[2] for v in variants):
            groups.append((p, sig[1]))  # version 2's split by dtype: ``<col>.<dtype>``
        else:
            groups.append((p, variant_tag(sig)))
    return group.reshape(-1), groups


def variant_tag(sig: tuple[str, str, int]) -> str:
    """The name suffix of a variant column (``<col>.<tag>``): ``<dtype>.<ndim>d`` for numeric
    variants, the kind for the others."""
    kind, dtype, ndim = sig
    return f"{dtype}.{ndim}d" if kind == "num" else kind


def _keep(segments: Sequence[LoadedSegment], seg_ids: list[int], on_duplicate: str, *, identical: bool) -> int:
    """Which copy of a duplicated (filename, frame) a row comes from (docs/GUARANTEES.md, *Duplicates*).

    Identical copies (by bytes): the lowest rank's, then its earliest segment — a rule of the spill
    root's contents alone, so ``frame_rank`` names the same rank whatever order the segments were
    started, listed or loaded in (DistributedSampler's padding always attributes to the lowest
    rank that wrote the frame). Different content: the policy picks by write order — ``first`` the
    earliest segment start, ``last`` the latest (rank breaks ties); ``seg_ids`` are positions in
    ``segments``, which are in that order."""
    if identical:
        return min(seg_ids, key=lambda s: (segments[s].seg.rank, s))
    return seg_ids[-1] if on_duplicate == "last" else seg_ids[0]


def dtype_names(layouts: list[FS.Layout]) -> list[str]:
    """The numeric dtypes that decide a column (zero-element layouts say nothing), sorted: a
    dtype's code is its position."""
    return sorted({lay.dtype for lay in layouts if F.DTYPES[lay.dtype].numeric and 0 not in lay.shape})


def pair_codes(
    c: dict[str, np.ndarray], layouts: list[FS.Layout], leaf_paths: list[tuple[str, ...]], names: Sequence[str],
    segments: list[LoadedSegment],
) -> tuple[list[str], np.ndarray]:  # fmt: skip
    """Each entry's dtype code (position in ``dtype_names``) as its file's rows of its leaf agree
    on it, -1 where none of them says (``None``, zero elements); a leaf of two dtypes in one file
    raises. File-local: a plan built in blocks of whole files gets the same codes."""
    n_lp = len(leaf_paths)
    dnames = dtype_names(layouts)
    code_of = {d: i for i, d in enumerate(dnames)}
    lcode = np.array(
        [code_of[lay.dtype] if F.DTYPES[lay.dtype].numeric and 0 not in lay.shape else -1 for lay in layouts],
        dtype=np.int64,
    )
    known = lcode[c["gl"]]
    pair = c["file"] * n_lp + c["lp"]
    # Rows in (file, frame, leaf) order whose files have one frame each (images, documents) are
    # already grouped by (file, leaf): no sort (1.8 s of part 0's pass 1 at 10^7 keys, issue 24).
    order = None if bool(np.all(pair[1:] >= pair[:-1])) else np.argsort(pair, kind="stable")
    ps, ks = (pair, known) if order is None else (pair[order], known[order])
    starts = np.flatnonzero(np.r_[True, ps[1:] != ps[:-1]])
    hi = np.maximum.reduceat(ks, starts)
    lo = np.minimum.reduceat(np.where(ks < 0, len(dnames), ks), starts)
    bad = np.flatnonzero((hi >= 0) & (lo != hi))
    if len(bad):
        f, p = divmod(int(ps[starts[bad[0]]]), n_lp)
        sel = (c["file"] == f) & (c["lp"] == p) & (known >= 0)
        codes = sorted({int(k) for k in known[sel]})
        leaf = _leaf_name(leaf_paths[p])
        each = [f"{dnames[k]} on rank(s) {_ranks(segments, c['seg'][sel & (known == k)])}" for k in codes]
        raise LayoutMismatchError(
            f"{names[f]!r:.200}: leaf {leaf!r} is {' and '.join(dnames[k] for k in codes)} in different frames "
            f"({'; '.join(each)}); a leaf keeps its dtype in every frame of a file",
            filename=names[f],
            leaf=leaf,
            ranks=_ranks(segments, c["seg"][sel]),
        )
    grouped = np.repeat(hi, np.diff(np.r_[starts, len(ps)]))
    if order is None:
        return dnames, grouped
    code = np.empty(len(pair), dtype=np.int64)
    code[order] = grouped
    return dnames, code


def leaf_first(lp: np.ndarray, code: np.ndarray, n_lp: int, first: np.ndarray | None = None) -> np.ndarray:
    """Each leaf's lowest dtype code (-1: none), where rows without one go; ``first`` from earlier
    blocks is folded in."""
    out = np.full(n_lp, np.iinfo(np.int64).max, dtype=np.int64)
    if first is not None:
        out[first >= 0] = first[first >= 0]
    has = code >= 0
    np.minimum.at(out, lp[has], code[has])
    out[out == np.iinfo(np.int64).max] = -1
    return out


def group_keys(lp: np.ndarray, code: np.ndarray, first: np.ndarray, n_dtypes: int) -> np.ndarray:
    """Each entry's column key: its leaf and dtype code (its leaf's first where it has none);
    ascending keys are the columns' order."""
    code = np.where(code >= 0, code, first[lp])
    return lp * (n_dtypes + 1) + (code + 1)


def decode_groups(keys: np.ndarray, dnames: list[str]) -> list[tuple[int, str | None]]:
    """The (leaf path position, dtype or None) of each column key."""
    m = len(dnames) + 1
    return [(int(k) // m, None if k % m == 0 else dnames[int(k % m) - 1]) for k in keys]


def group_names(groups: list[tuple[int, str | None]], leaf_paths: list[tuple[str, ...]]) -> list[str]:
    """Column name of each group: the leaf's name (``column_names``), and, for a leaf split by
    dtype, that name ``.`` the dtype (hashed if it would equal another column's name)."""
    base = column_names(leaf_paths)
    per_leaf: dict[int, int] = {}
    for p, _ in groups:
        per_leaf[p] = per_leaf.get(p, 0) + 1
    out = [base[leaf_paths[p]] if per_leaf[p] == 1 else f"{base[leaf_paths[p]]}.{dt}" for p, dt in groups]
    taken = set(base.values())
    for g, (p, dt) in enumerate(groups):
        if per_leaf[p] > 1 and (out[g] in taken or out.count(out[g]) > 1):
            out[g] = F.split_column_name(base[leaf_paths[p]], str(dt))
    return out


def _column(
    name: str, leaf: tuple[str, ...], src: np.ndarray, c: dict[str, np.ndarray], layouts: list[FS.Layout], n_rows: int
) -> PlannedColumn:
    """The column of one leaf path from the row table positions of its present rows."""
    present = src >= 0
    has_valid = not bool(present.all())
    gl = c["gl"][src[present]]
    lay_ids = np.unique(gl)
    lays = [layouts[int(g)] for g in lay_ids]
    non_empty = [lay for lay in lays if not (F.DTYPES[lay.dtype].numeric and 0 in lay.shape)]
    dt = F.DTYPES[(non_empty or lays)[0].dtype] if lays else F.DTYPES["float64"]
    if lays and not dt.numeric:
        kind = KIND[dt.kind]
        # Format 3: every non-numeric kind is uint8 bytes + byte offsets (Arrow's large_binary /
        # large_string layout), so any Zarr v3 reader (tensorstore has no string type) reads it.
        counts = np.zeros(n_rows, dtype=np.int64)
        counts[present] = c["nb"][src[present]]
        strings = None
        if kind == "strlist":  # (n_rows, 1): strings per row (its n uint32 lengths open the row's bytes)
            n_of = np.zeros(len(layouts), dtype=np.int64)
            for g in lay_ids:
                n_of[int(g)] = layouts[int(g)].shape[0]
            strings = np.zeros((n_rows, 1), dtype=np.int64)
            strings[present, 0] = n_of[gl]
        return PlannedColumn(name, leaf, kind, kind, 1 if kind == "strlist" else 0, None, None, src,
                      counts, strings, has_valid)  # fmt: skip
    ndim = len(lays[0].shape) if lays else 0
    shapes = {lay.shape for lay in lays}
    if len(shapes) <= 1:
        shape = next(iter(shapes)) if shapes else ()
        present_counts = present.astype(np.int64) if has_valid else None
        return PlannedColumn(name, leaf, "fixed", dt.name, ndim, shape, None, src, present_counts, None, has_valid)
    table = np.zeros((len(layouts), ndim), dtype=np.int64)
    for g in lay_ids:
        table[int(g)] = layouts[int(g)].shape
    row_shapes = np.zeros((n_rows, ndim), dtype=np.int64)
    row_shapes[present] = table[gl]
    inner_set = {lay.shape[1:] for lay in lays}
    if len(inner_set) == 1:
        inner = next(iter(inner_set))
        return PlannedColumn(
            name, leaf, "ragged", dt.name, ndim, None, inner, src, row_shapes[:, 0].copy(), None, has_valid
        )
    counts = np.prod(row_shapes, axis=1, dtype=np.int64)
    return PlannedColumn(name, leaf, "ragged", dt.name, ndim, None, None, src, counts, row_shapes, has_valid)


def _file_layouts(
    file_of: np.ndarray, lp_of: np.ndarray, n_files: int, lp_names: list[str]
) -> tuple[np.ndarray, list[list[str]]]:
    # lp_of / lp_names: each entry's column group and the groups' names.
    """Each file's set of columns (a leaf counts when any frame has a value or ``None`` for it), as
    a position in the list of distinct sets."""
    pairs = np.unique(file_of * len(lp_names) + lp_of)
    pf, pl = pairs // len(lp_names), pairs % len(lp_names)
    if len(lp_names) <= 62:  # one int64 bit mask per file: vectorised for millions of files
        masks = np.zeros(n_files, dtype=np.int64)
        np.bitwise_or.at(masks, pf, np.left_shift(np.int64(1), pl))
        uniq, inverse = np.unique(masks, return_inverse=True)
        sets = [[lp_names[b] for b in range(len(lp_names)) if (int(m) >> b) & 1] for m in uniq]
    else:
        per_file: list[list[int]] = [[] for _ in range(n_files)]
        for f, p in zip(pf.tolist(), pl.tolist(), strict=True):
            per_file[f].append(p)
        keyed = {tuple(v): i for i, v in enumerate(sorted({tuple(v) for v in per_file}))}
        inverse = np.array([keyed[tuple(v)] for v in per_file], dtype=np.int64)
        sets = [[lp_names[b] for b in k] for k in sorted(keyed, key=keyed.__getitem__)]
    return inverse.astype(np.int32).reshape(-1), [sorted(s) for s in sets]


def encoded_names(names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The UTF-8 bytes (``surrogatepass``) of ``names`` back to back and their int64 offsets
    (``len(names) + 1``); an out-of-core plan's string table gives its own maps."""
    raw = getattr(names, "raw", None)
    if raw is not None:
        data, offsets = raw()
        return data, offsets
    enc = [f.encode("utf-8", "surrogatepass") for f in names]
    offsets = np.zeros(len(enc) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in enc], out=offsets[1:])
    return np.frombuffer(b"".join(enc), dtype=np.uint8), offsets


def fingerprint(plan: Plan, **settings: Any) -> str:
    """A digest of everything that decides the output's bytes: the source segments, the files,
    rows and columns, the source rows chosen for them (segment, offset, size, checksum) and the
    output ``settings`` (chunk size, codec). Two processes that compute the same fingerprint write
    the same output; parts of a parallel merge record it and refuse to mix. A plan built in
    ranges hashes its ranges' digests (``Plan.range_digests``) in place of the arrays."""
    h = hashlib.blake2b(digest_size=16)
    head = {
        "format_version": F.FORMAT_VERSION,
        "settings": settings,
        "segments": [s.seg.rel for s in plan.segments],
        "columns": [c.header().to_obj() for c in plan.columns],
        "file_layouts": plan.file_layouts,
        "lists": [[lst.name, list(lst.path)] for lst in plan.lists],
    }
    if plan.range_digests is not None:
        head["ranges"] = plan.range_digests
    h.update(json.dumps(head, sort_keys=True, ensure_ascii=True).encode("ascii"))
    if plan.range_digests is not None:
        return h.hexdigest()
    # The names as UTF-8 bytes (surrogatepass: filenames may hold lone surrogates) and their
    # offsets, which an out-of-core plan already holds: no name is decoded (decoding 10^7 names
    # into str took most of the fingerprint's 6 s, issue 24).
    data, offsets = encoded_names(plan.filenames)
    for i in range(0, len(data), ROW_BLOCK * 16):
        h.update(np.ascontiguousarray(data[i : i + ROW_BLOCK * 16]).data)
    for i in range(0, len(offsets), ROW_BLOCK):
        h.update(np.ascontiguousarray(offsets[i : i + ROW_BLOCK], dtype="<i8").view(np.uint8).data)
    # Hashed a block at a time (the arrays may be maps of an out-of-core plan's files): the
    # digest is that of the whole arrays back to back. Each block is hashed from its buffer, not
    # a bytes copy of it (0.8 s of 2.7 at 10^7 keys).
    for a in (plan.file_offsets, plan.frame_idx, plan.file_layout):
        for i in range(0, len(a), ROW_BLOCK):
            h.update(np.ascontiguousarray(a[i : i + ROW_BLOCK], dtype="<i8").data)
    for lst in plan.lists:
        h.update(np.ascontiguousarray(lst.offsets, dtype="<i8").data)
    for col in plan.columns:
        for i in range(0, len(col.src), ROW_BLOCK):
            h.update(np.ascontiguousarray(col.src[i : i + ROW_BLOCK], dtype="<i8").data)
        for table in (plan.seg, plan.offset, plan.nbytes, plan.crc):
            for i in range(0, len(col.src), ROW_BLOCK):
                s = np.asarray(col.src[i : i + ROW_BLOCK])
                h.update(np.ascontiguousarray(table[s[s >= 0]], dtype="<i8").data)
    return h.hexdigest()


def split(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Positions of the work units (output chunks) each of ``parts`` parts writes: greedy
    largest-first by bytes (ties: fewest units, then lowest part), so every process computes the
    same split from the same plan. A unit is one whole chunk, so no two processes ever write the
    same object (zarr-python#3682 loses rows when processes share a chunk)."""
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise SpillValueError(f"parts must be a positive int, got {parts!r}")
    heap = [(0, 0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, count, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (load + weights[i], count + 1, p))
    return [sorted(units) for units in out]
