"""From the plan's kept rows to the output's columns (docs/FORMAT.md section 2, *Columns*): each
leaf path and variant one :class:`PlannedColumn` (where each row's bytes come from, its kind,
dtype and shapes), each list path one :class:`PlannedList` of offsets, each file's column set.
Per-row work is vectorised; per-leaf and per-layout tables are small Python ones."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, fields

import numpy as np

from .._errors import LayoutMismatchError
from .._format import common as F
from .._format import output as FO
from .._format import spill as FS

ROW_BLOCK = 1 << 18
"""Rows per block of the loops over per-row arrays: a temporary is 2 MiB of int64 at most,
whatever the plan's size."""

Alloc = Callable[..., np.ndarray]
"""``new(name, shape, dtype, fill=None)``: a new array (``_merge.plansql.alloc`` over the plan's
work folder: a map of a file beyond ``_merge.plansql.MAPPED_ROWS`` rows)."""


def blocks(n: int) -> Iterator[tuple[int, int]]:
    """``(a, b)`` of each block of ``ROW_BLOCK`` rows of ``n``."""
    for a in range(0, n, ROW_BLOCK):
        yield a, min(n, a + ROW_BLOCK)


def cumulate(a: np.ndarray) -> np.ndarray:
    """``a`` (a 0, then counts) made offsets in place: its running sums, a block at a time."""
    total = 0
    for lo, hi in blocks(len(a)):
        np.cumsum(a[lo:hi], out=a[lo:hi])
        a[lo:hi] += total
        total = int(a[hi - 1])
    return a


@dataclass(frozen=True, slots=True)
class PlannedColumn(FO.ColumnHeader):
    """The plan of one leaf column of the output, ``columns/<name>/``: its header (the fields of
    :class:`~spillmerge._format.output.ColumnHeader`: ``variant`` set when the leaf has several
    variants that are not only numeric dtypes, ``variant_groups``) and where each row's bytes come
    from (the merge side; the reader's is ``_read.column.OpenColumn``)."""

    ndim: int
    """Dimensions of one row's value (0 for str, bytes, pickle; 1 for strlist)."""
    chunk_max_bytes: int | None = None
    """Not planned: None."""
    _: KW_ONLY
    name: str
    """Node name under ``columns/``."""
    src: np.ndarray
    """int64 (n_rows,): position in the plan's row table of each output row's bytes; ``ABSENT``
    when the row lacks the leaf, ``NONE`` when it holds None there."""
    n_present: int
    """Rows that have a value."""
    shape: tuple[int, ...] | None = None
    """``fixed``: the shape of every row's value."""
    offsets: np.ndarray | None = None
    """int64 (n_rows + 1,): row ``r``'s units of ``values`` are ``offsets[r] .. offsets[r+1]-1``,
    for ragged, bytes, pickle and strlist columns, and fixed columns with absent rows (whose
    ``values`` hold only the rows that have a value: no zeros are stored for the others)."""
    shapes: np.ndarray | None = None
    """int64 (n_rows, ndim): per-row shapes of a ragged column without ``inner_shape``; of a
    list-of-str column, (n_rows, 1): the strings in each row."""

    @property
    def storage(self) -> str:
        """numpy dtype of ``values``: ``uint8`` (bytes) for the non-numeric kinds."""
        if self.kind not in FO.NUMERIC_KINDS:
            return "uint8"
        return F.DTYPES[self.dtype].storage

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Shape of one unit (one first-dimension entry) of ``values``."""
        if self.kind == "fixed":
            assert self.shape is not None
            return self.shape
        if self.kind == "ragged" and self.inner_shape is not None:
            return self.inner_shape
        return ()

    @property
    def unit_bytes(self) -> int:
        """Bytes of one unit of ``values`` (numeric kinds and bytes/pickle)."""
        return np.dtype(self.storage).itemsize * math.prod(self.unit_shape)

    @property
    def n_units(self) -> int:
        """Length of ``values``' first dimension."""
        return len(self.src) if self.offsets is None else int(self.offsets[-1])

    def header(self) -> FO.ColumnHeader:
        """The column group's ``spillmerge`` attributes (docs/FORMAT.md section 2, *Columns*)."""
        return FO.ColumnHeader(*(getattr(self, f.name) for f in fields(FO.ColumnHeader)))


@dataclass(frozen=True, slots=True)
class PlannedList:
    """The list offsets of one list path of the output (``lists/<name>/offsets``): the
    items of the lists at ``path[:-1]`` in row ``r`` of its parent domain are the rows
    ``offsets[r] .. offsets[r + 1] - 1`` of the columns under ``path``."""

    name: str
    """Node name under ``lists/`` (the node name of ``path``, as a column of it would have)."""
    path: tuple[str, ...]
    """The child path, ending in ``ITEM``."""
    offsets: np.ndarray
    """int64 (n_parent + 1,), from 0 to the number of items."""


def column_names(leaves: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """Node name under ``columns/`` of each leaf path (docs/FORMAT.md section 2, *Columns*)."""
    text = {leaf: F.leaf_text(leaf) for leaf in leaves if leaf}
    if len(set(text.values())) != len(text):
        a, b = [p for p in text if list(text.values()).count(text[p]) > 1][:2]
        raise LayoutMismatchError(
            f"leaf paths {list(a)} and {list(b)} have the same name; rename a dict key",
            filename="",
            leaf="/".join(a) or "<value>",
        )
    enc = F.node_names(sorted(text.values()))
    out = {leaf: enc[s] for leaf, s in text.items()}
    if () in leaves:
        out[()] = F.VALUE_COLUMN
    return out


def list_domains(
    lp: np.ndarray, row_of: np.ndarray, leaf_paths: list[tuple[str, ...]], n_rows: int,
    headers: set[tuple[str, ...]], new: Alloc,
) -> tuple[list[tuple[str, ...]], np.ndarray, np.ndarray, list[PlannedList], dict[tuple[str, ...], int]]:  # fmt: skip
    """Arrow's list model over the spill's item positions (docs/FORMAT.md, *Lists*): every spill
    path ``P/\x1f<i>/...`` becomes the child path ``P/\x1f*/...``, whose rows are the items of
    all the lists at ``P``, flattened (row ``r``'s items are rows ``offsets[r] ..
    offsets[r+1]-1``), to any depth. A list's length is one more than its highest item position
    (every item of a list has a leaf: a value, ``None``, or a header), so the offsets come from
    the catalog alone. ``headers``: the leaf paths of ``pylist`` / ``pytuple`` headers, whose
    lists get offsets even where every one of them is empty. Returns the column paths, each
    entry's path and row in its path's domain (``row_of``, each entry's output row, rewritten),
    the lists (parents first) and every domain's size (``()``: the output's rows). Per-entry work
    a block of entries at a time, into ``new`` arrays."""
    general = [F.general_path(p) for p in leaf_paths]
    gpaths = sorted({g for g, _ in general})
    gid = {g: i for i, g in enumerate(gpaths)}
    gtab = np.array([gid[g] for g, _ in general], dtype=np.int64)
    n = len(lp)
    gp = new("gp", n, np.int64)
    for a, b in blocks(n):
        gp[a:b] = gtab[lp[a:b]]
    sizes: dict[tuple[str, ...], int] = {(): n_rows}
    list_paths = {g[: d + 1] for g, _ in general for d, seg in enumerate(g) if seg == F.ITEM}
    list_paths |= {(*F.general_path(h[:-1])[0], F.ITEM) for h in headers}
    drow = row_of  # made each entry's row in its path's domain, in place, a level at a time
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

    def items(k: int, lid: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per block: the block's rows in ``drow`` (a view), its entries of list ``lid`` and their item positions."""
        if k >= depth:
            return
        for a, b in blocks(n):
            lpb = np.asarray(lp[a:b])
            sel = np.flatnonzero(chain[k][lpb] == lid)
            if len(sel):
                yield drow[a:b], sel, pos[k][lpb[sel]]

    for lid, path in enumerate(ordered):
        k = path.count(F.ITEM) - 1
        n_parent = sizes[F.list_domain(path[:-1])]
        offsets = new("offsets", n_parent + 1, np.int64)
        for dr, sel, idx in items(k, lid):  # each list's length, then the offsets
            np.maximum.at(offsets[1:], np.asarray(dr[sel]), idx + 1)
        cumulate(offsets)
        for dr, sel, idx in items(k, lid):
            dr[sel] = offsets[np.asarray(dr[sel])] + idx
        sizes[path] = int(offsets[-1])
        lists.append(PlannedList(names[path], path, offsets))
    return gpaths, gp, drow, lists, sizes


def distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a``, sorted: by a sort (faster than numpy 2's hashing ``np.unique``)."""
    v = np.sort(np.asarray(a).reshape(-1))
    if len(v) < 2:
        return v
    return v[np.concatenate(([True], v[1:] != v[:-1]))]


def variant_groups(
    c: dict[str, np.ndarray], layouts: list[FS.Layout], leaf_paths: list[tuple[str, ...]], new: Alloc
) -> tuple[np.ndarray, list[tuple[int, str | None]]]:
    """Which column each stored leaf row goes to: one per leaf path and *variant* (kind, dtype,
    ndim; docs/FORMAT.md, *Value model*). A leaf that holds one variant everywhere is one column;
    one that is ``float16`` in some rows and a ``str`` or a 2-d ``float32`` in others makes one
    column per variant, each with the rows of its variant: nothing is converted. Rows that say
    nothing about the variant join a compatible variant of their file (the lowest), else of their
    leaf, else one of their own: ``None`` any variant, an empty Python list (a ``py*`` row of zero
    elements) a ``py*`` variant of its ndim or a list of strings, as it reads back the same from
    each. An empty array keeps its dtype. Returns each entry's group and the groups' (leaf path
    position, variant tag or None when the leaf has one column)."""
    lsig: dict[int, tuple[str, str, int]] = {}
    for g, lay in enumerate(layouts):
        dt = F.DTYPES[lay.dtype]
        if dt.kind == "none" or (lay.dtype in F.PY_SCALARS and 0 in lay.shape):
            continue
        lsig[g] = (
            ("num", lay.dtype, len(lay.shape)) if dt.numeric else (dt.kind, dt.kind, 1 if dt.kind == "strlist" else 0)
        )
    # variants numbered in sorted order, not in the order the writers met them: "the lowest" below
    # is then the same however the frames were written (row by row or in batches)
    sig_code = {sig: i for i, sig in enumerate(sorted(set(lsig.values())))}
    lcode = np.array([sig_code[lsig[g]] if g in lsig else -1 for g in range(len(layouts))], dtype=np.int64)
    n = len(c["gl"])
    code = new("code", n, np.int64)
    weak_parts = [np.zeros(0, np.int64)]
    for a, b in blocks(n):
        cb = code[a:b] = lcode[c["gl"][a:b]]
        weak_parts.append(a + np.flatnonzero(cb < 0))
    weak = np.concatenate(weak_parts)
    del weak_parts
    sigs = sorted(sig_code, key=sig_code.__getitem__)  # kept in step with sig_code below
    if len(weak):
        n_lp, n_sig = len(leaf_paths), max(len(sig_code), 1)
        definite = code >= 0
        pair = c["file"] * n_lp + c["lp"]
        pair_codes = distinct(pair[definite] * n_sig + code[definite])
        leaf_codes: dict[int, set[int]] = {}
        for k in distinct(c["lp"][definite] * n_sig + code[definite]).tolist():
            leaf_codes.setdefault(k // n_sig, set()).add(k % n_sig)
        weak_gl = c["gl"][weak]
        # empty numeric rows first: a leaf whose only variant is theirs then takes its None rows too
        for g in sorted(distinct(weak_gl).tolist(), key=lambda g: layouts[g].dtype == "none"):
            lay = layouts[g]
            rows = weak[weak_gl == g]
            if lay.dtype == "none":
                ok = list(range(len(sigs)))
            else:  # an empty Python list: the same ndim; ``[]`` is also an empty list of strings
                nd = len(lay.shape)
                ok = [i for i, s in enumerate(sigs) if s[0] == "num" and s[1] in F.PY_SCALARS and s[2] == nd]
                ok += [i for i, s in enumerate(sigs) if nd == 1 and s[0] == "strlist"]
            got = np.full(len(rows), -1, dtype=np.int64)
            for cand in ok:
                hit = (got < 0) & np.isin(pair[rows] * n_sig + cand, pair_codes)
                got[hit] = cand
            left = got < 0
            for p in distinct(c["lp"][rows[left]]).tolist() if left.any() else ():
                m = left & (c["lp"][rows] == p)
                have = leaf_codes.setdefault(p, set())
                pick = next((i for i in ok if i in have), None)
                if pick is None:
                    own = ("none", "none", 0) if lay.dtype == "none" else ("num", lay.dtype, len(lay.shape))
                    pick = sig_code.setdefault(own, len(sig_code))
                    if pick == len(sigs):
                        sigs.append(own)
                    if own[0] != "none":
                        ok.append(pick)
                    have.add(pick)
                got[m] = pick
            code[rows] = got
    n_codes = max(len(sig_code), 1)
    # the distinct (leaf, variant) pairs, numbered in order: a table of every possible pair
    # (leaves x variants, small), not a sort of the rows
    seen = np.zeros(len(leaf_paths) * n_codes, dtype=np.int64)
    for a, b in blocks(n):
        seen[c["lp"][a:b] * n_codes + code[a:b]] = 1
    uniq = np.flatnonzero(seen)
    number = np.cumsum(seen) - 1
    group = code  # each entry's variant code made its group's number, in place
    for a, b in blocks(n):
        group[a:b] = number[c["lp"][a:b] * n_codes + code[a:b]]
    del seen, number
    by_leaf: dict[int, list[tuple[str, str, int]]] = {}
    for k in uniq.tolist():
        by_leaf.setdefault(k // n_codes, []).append(sigs[k % n_codes])
    groups: list[tuple[int, str | None]] = []
    for k in uniq.tolist():
        p, sig = k // n_codes, sigs[k % n_codes]
        variants = by_leaf[p]
        if len(variants) == 1:
            groups.append((p, None))
        elif all(v[0] == "num" and v[2] == sig[2] for v in variants):
            groups.append((p, sig[1]))  # numeric variants of one ndim: ``<col>.<dtype>``
        else:  # ``<col>.<dtype>.<ndim>d`` for a numeric variant, ``<col>.<kind>`` for the others
            groups.append((p, f"{sig[1]}.{sig[2]}d" if sig[0] == "num" else sig[0]))
    return group, groups


def group_names(groups: list[tuple[int, str | None]], leaf_paths: list[tuple[str, ...]]) -> list[str]:
    """Column name of each group: the leaf's name (``column_names``), and, for a leaf split by
    dtype, that name ``.`` the dtype (hashed if it would equal another column's name)."""
    base = column_names(leaf_paths)
    per_leaf = Counter(p for p, _ in groups)
    out = [base[leaf_paths[p]] if per_leaf[p] == 1 else f"{base[leaf_paths[p]]}.{dt}" for p, dt in groups]
    taken = set(base.values())
    for g, (p, dt) in enumerate(groups):
        if per_leaf[p] > 1 and (out[g] in taken or out.count(out[g]) > 1):
            out[g] = F.split_column_name(base[leaf_paths[p]], str(dt))
    return out


ABSENT = -1
"""``PlannedColumn.src`` of a row that lacks the column's leaf."""
NONE = -2
"""``PlannedColumn.src`` of a row whose value at the column's leaf is None (a row of no variant:
``variant_groups`` gave it to this column)."""


def plan_column(
    name: str, leaf: tuple[str, ...], src: np.ndarray, c: dict[str, np.ndarray], layouts: list[FS.Layout], n_rows: int,
    new: Alloc,
) -> PlannedColumn:  # fmt: skip
    """The column of one leaf path from the row table positions of its present rows (a block of
    rows at a time; per-row arrays from ``new``)."""

    def each() -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """Per block of rows: its bounds, which rows are present and their layouts."""
        for a, b in blocks(n_rows):
            s = np.asarray(src[a:b])
            p = s >= 0
            yield a, b, p, c["gl"][s[p]]

    n_present = 0
    lay_ids = np.zeros(0, np.int64)
    for _, _, p, gl in each():
        n_present += int(np.count_nonzero(p))
        lay_ids = distinct(np.concatenate([lay_ids, distinct(gl)]))
    has_valid = n_present < n_rows
    has_none = has_valid and any(bool((np.asarray(src[a:b]) == NONE).any()) for a, b in blocks(n_rows))
    column = functools.partial(
        PlannedColumn, leaf, name=name, src=src, has_valid=has_valid, n_present=n_present, has_none=has_none
    )
    lays = [layouts[int(g)] for g in lay_ids]
    non_empty = [lay for lay in lays if not (F.DTYPES[lay.dtype].numeric and 0 in lay.shape)]
    dt = F.DTYPES[(non_empty or lays)[0].dtype] if lays else F.DTYPES["float64"]
    if lays and not dt.numeric:
        kind = dt.kind  # str, bytes, pickle or strlist (numeric ones are fixed or ragged)
        # Every non-numeric kind is uint8 bytes + byte offsets (Arrow's large_binary /
        # large_string layout), so any Zarr v3 reader (tensorstore has no string type) reads it.
        offsets = new("offsets", n_rows + 1, np.int64)
        strings = new("strings", (n_rows, 1), np.int64) if kind == "strlist" else None
        n_of = np.zeros(len(layouts), dtype=np.int64)
        if strings is not None:  # (n_rows, 1): strings per row (its n uint32 lengths open the row's bytes)
            for g in lay_ids:
                n_of[int(g)] = layouts[int(g)].shape[0]
        for a, b, p, gl in each():
            s = np.asarray(src[a:b])
            offsets[a + 1 : b + 1][p] = c["nb"][s[p]]
            if strings is not None:
                strings[a:b, 0][p] = n_of[gl]
        return column(kind, kind, 1 if kind == "strlist" else 0, None, offsets=cumulate(offsets), shapes=strings)
    ndim = len(lays[0].shape) if lays else 0
    shapes = {lay.shape for lay in lays}
    if len(shapes) <= 1:
        shape = next(iter(shapes)) if shapes else ()
        present = None
        if has_valid:
            present = new("offsets", n_rows + 1, np.int64)
            for a, b, p, _ in each():
                present[a + 1 : b + 1] = p
            cumulate(present)
        return column("fixed", dt.name, ndim, None, shape=shape, offsets=present)
    table = np.zeros((len(layouts), ndim), dtype=np.int64)
    for g in lay_ids:
        table[int(g)] = layouts[int(g)].shape
    inner_set = {lay.shape[1:] for lay in lays}
    offsets = new("offsets", n_rows + 1, np.int64)
    if len(inner_set) == 1:
        inner = next(iter(inner_set))
        for a, b, p, gl in each():
            offsets[a + 1 : b + 1][p] = table[gl, 0]
        return column("ragged", dt.name, ndim, inner, offsets=cumulate(offsets))
    row_shapes = new("shapes", (n_rows, ndim), np.int64)
    for a, b, p, gl in each():
        row_shapes[a:b][p] = table[gl]
        offsets[a + 1 : b + 1] = np.prod(row_shapes[a:b], axis=1, dtype=np.int64)
    return column("ragged", dt.name, ndim, None, offsets=cumulate(offsets), shapes=row_shapes)


def file_layouts_of(
    file_of: np.ndarray, lp_of: np.ndarray, n_files: int, lp_names: list[str], new: Alloc
) -> tuple[np.ndarray, list[list[str]]]:
    # file_of: each entry's file, ascending (the plan's rows are sorted by file); lp_of / lp_names:
    # each entry's column group and the groups' names.
    """Each file's set of columns (a leaf counts when any frame has a value or ``None`` for it), as
    a position in the list of distinct sets."""
    n = len(file_of)
    if len(lp_names) <= 62:  # one int64 bit mask per file: vectorised, a block of rows at a time
        masks = new("masks", n_files, np.int64)
        for a, b in blocks(n):
            fb = np.asarray(file_of[a:b])
            starts = np.flatnonzero(np.diff(fb, prepend=-1))
            bits = np.left_shift(np.int64(1), np.asarray(lp_of[a:b], dtype=np.int64))
            masks[fb[starts]] |= np.bitwise_or.reduceat(bits, starts)  # a file may go on from the last block
        uniq = np.zeros(0, np.int64)
        for a, b in blocks(n_files):
            uniq = distinct(np.concatenate([uniq, distinct(masks[a:b])]))
        inverse = new("file_layout", n_files, np.int32)
        for a, b in blocks(n_files):
            inverse[a:b] = np.searchsorted(uniq, masks[a:b])
        sets = [[lp_names[b] for b in range(len(lp_names)) if (int(m) >> b) & 1] for m in uniq]
        return inverse, [sorted(s) for s in sets]
    # more column sets than bits: the distinct (file, column) pairs, sorted (a whole array)
    pairs = np.unique(np.asarray(file_of, dtype=np.int64) * len(lp_names) + lp_of)
    pf, pl = pairs // len(lp_names), pairs % len(lp_names)
    per_file = [tuple(v.tolist()) for v in np.split(pl, np.searchsorted(pf, np.arange(1, n_files)))]
    keyed = {v: i for i, v in enumerate(sorted(set(per_file)))}
    inverse = np.array([keyed[v] for v in per_file], dtype=np.int32)
    return inverse, [sorted(lp_names[b] for b in k) for k in keyed]  # keyed is in its numbers' order
