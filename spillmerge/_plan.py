"""Merge planning: which stored rows become which output rows, checked before anything is written.

Per filename: frames ascending and unique; every frame has the same leaves with the same dtype
and shape; duplicate keys resolved by the policy (identical content is never an error). Content is
identical only when the bytes are: the plan reads nothing itself, it asks a ``same_bytes`` callback
(``_spillroot.same_bytes`` over the merge's storage) about duplicates whose checksums agree.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _format as F
from ._errors import DuplicateFrameError, LayoutMismatchError, SpillValueError
from ._spillroot import Extent, LoadedSegment

SameBytes = Callable[[Sequence[Extent], Sequence[Extent]], bool]
"""``same_bytes(a, b)``: do two stored copies of a frame (leaf extents, in leaf order) hold the same bytes?"""


@dataclass(frozen=True, slots=True)
class LeafPlan:
    """One output array."""

    layout: F.Layout
    """Leaf path, dtype and frame shape."""
    node: str
    """Array path inside the output, e.g. ``files/video_001.mp4/boxes``."""
    rows: np.ndarray
    """Positions in the plan's row table, one per output row, in frame order."""


@dataclass(frozen=True, slots=True)
class FilePlan:
    """Everything written for one filename."""

    filename: str
    """Original filename."""
    index: int
    """Position in the sorted filename list."""
    key: str
    """Node name under ``files/``."""
    frames: np.ndarray
    """Ascending int64 frame indices."""
    leaves: list[LeafPlan]
    """Output arrays (one for tensor values, one per leaf for dict values)."""
    is_dict: bool
    """True when the value was a dict."""

    @property
    def frame_nbytes(self) -> int:
        return sum(leaf.layout.nbytes for leaf in self.leaves)


@dataclass(frozen=True, slots=True)
class Plan:
    """The merge plan and the row table it refers to."""

    files: list[FilePlan]
    """Sorted by filename."""
    segments: list[LoadedSegment]
    """Source segments; ``seg`` column values index this list."""
    seg: np.ndarray
    """Row table: source segment of each row."""
    offset: np.ndarray
    """Row table: byte offset in the segment's data."""
    nbytes: np.ndarray
    """Row table: byte length."""
    crc: np.ndarray
    """Row table: CRC-32C."""
    duplicates: int
    """Duplicate (filename, frame) copies dropped (identical content or by policy)."""
    copies: np.ndarray
    """Row table: how many segments held this row's (filename, frame) (1 unless duplicated)."""

    @property
    def n_frames(self) -> int:
        return sum(len(f.frames) for f in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(len(f.frames) * f.frame_nbytes for f in self.files)


def _ranks(segments: list[LoadedSegment], seg_ids: np.ndarray) -> list[int]:
    return sorted({segments[int(s)].seg.rank for s in seg_ids})


def build(segments: list[LoadedSegment], on_duplicate: str = "error", *, same_bytes: SameBytes) -> Plan:
    """The plan for ``segments`` (in write order). ``same_bytes`` is asked, only for duplicate keys
    whose leaves, sizes and checksums all agree, whether the copies' bytes are the same; copies
    that differ go to the ``on_duplicate`` policy, whatever their checksums say."""
    if on_duplicate not in ("error", "first", "last"):
        raise SpillValueError(f"on_duplicate must be 'error', 'first' or 'last', got {on_duplicate!r}")
    names = sorted({f for s in segments for f in s.filenames})
    gid = {f: i for i, f in enumerate(names)}
    leaf_paths = sorted({lay.leaf for s in segments for lay in s.layouts})
    lp_id = {p: i for i, p in enumerate(leaf_paths)}
    layouts: list[F.Layout] = []
    gl_id: dict[F.Layout, int] = {}
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("file", "frame", "lp", "gl", "seg", "off", "nb", "crc")}
    for si, s in enumerate(segments):
        idx = s.index
        if not len(idx):
            continue
        fmap = np.array([gid[f] for f in s.filenames], dtype=np.int64)
        lay_ids = []
        for lay in s.layouts:
            if lay not in gl_id:
                gl_id[lay] = len(layouts)
                layouts.append(lay)
            lay_ids.append(gl_id[lay])
        lmap = np.array(lay_ids, dtype=np.int64)
        pmap = np.array([lp_id[lay.leaf] for lay in s.layouts], dtype=np.int64)
        cols["file"].append(fmap[idx[:, F.COL_FILE]])
        cols["frame"].append(idx[:, F.COL_FRAME])
        cols["lp"].append(pmap[idx[:, F.COL_LAYOUT]])
        cols["gl"].append(lmap[idx[:, F.COL_LAYOUT]])
        cols["seg"].append(np.full(len(idx), si, dtype=np.int64))
        cols["off"].append(idx[:, F.COL_OFFSET])
        cols["nb"].append(idx[:, F.COL_NBYTES])
        cols["crc"].append(idx[:, F.COL_CRC])
    if not cols["file"]:
        empty = np.zeros(0, np.int64)
        return Plan([], segments, empty, empty, empty, empty, duplicates=0, copies=empty)
    c = {k: np.concatenate(v) for k, v in cols.items()}

    # 1. dtype/shape of a leaf must not change between frames of one file (across ranks).
    order = np.lexsort((c["gl"], c["lp"], c["file"]))
    f_s, lp_s, gl_s = c["file"][order], c["lp"][order], c["gl"][order]
    bad = (np.diff(f_s) == 0) & (np.diff(lp_s) == 0) & (np.diff(gl_s) != 0)
    if np.any(bad):
        i = int(np.argmax(bad))
        fidx, lpidx = int(f_s[i]), int(lp_s[i])
        sel = (c["file"] == fidx) & (c["lp"] == lpidx)
        variants = []
        for g in np.unique(c["gl"][sel]):
            lay = layouts[int(g)]
            variants.append(
                f"{lay.dtype}{list(lay.shape)} on rank(s) {_ranks(segments, c['seg'][sel & (c['gl'] == g)])}"
            )
        leaf = "/".join(leaf_paths[lpidx]) or "<tensor>"
        raise LayoutMismatchError(
            f"{names[fidx]!r:.200}: leaf {leaf!r} has different dtype/shape across frames: " + "; ".join(variants),
            filename=names[fidx],
            leaf=leaf,
            ranks=_ranks(segments, c["seg"][sel]),
        )

    # 2. duplicates: the same (file, frame) from more than one segment.
    order = np.lexsort((c["lp"], c["seg"], c["frame"], c["file"]))
    for col in c:
        c[col] = c[col][order]
    new_key = np.ones(len(order), dtype=bool)
    new_key[1:] = (np.diff(c["file"]) != 0) | (np.diff(c["frame"]) != 0)
    key_start = np.flatnonzero(new_key)
    new_seg = new_key.copy()
    new_seg[1:] |= np.diff(c["seg"]) != 0
    segs_per_key = np.add.reduceat(new_seg.astype(np.int64), key_start)
    keep = np.ones(len(order), dtype=bool)
    duplicates = 0
    key_end = np.append(key_start[1:], len(order))
    c["copies"] = np.repeat(segs_per_key, key_end - key_start)
    for k in np.flatnonzero(segs_per_key > 1):
        a, b = int(key_start[k]), int(key_end[k])
        groups: dict[int, list[int]] = {}
        for r in range(a, b):  # rows of one key: by segment, then leaf
            groups.setdefault(int(c["seg"][r]), []).append(r)
        seg_ids = sorted(groups)  # segment order = write order (segments sorted by start time)
        sigs = {tuple((int(c["lp"][r]), int(c["nb"][r]), int(c["crc"][r])) for r in rows) for rows in groups.values()}
        identical = len(sigs) == 1
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
                + (" (their CRC-32C checksums agree, their bytes do not)" if len(sigs) == 1 else "")
                + "; merge with on_duplicate='first' "
                "or 'last' (--on-duplicate) to pick one",
                filename=fname,
                frame_idx=frame,
                ranks=ranks,
            )
        chosen = seg_ids[-1] if on_duplicate == "last" and not identical else seg_ids[0]
        keep[a:b] = c["seg"][a:b] == chosen
        duplicates += len(seg_ids) - 1
    if not keep.all():
        for col in c:
            c[col] = c[col][keep]

    # 3. every frame of a file has the file's full set of leaves.
    new_key = np.ones(len(c["file"]), dtype=bool)
    new_key[1:] = (np.diff(c["file"]) != 0) | (np.diff(c["frame"]) != 0)
    key_start = np.flatnonzero(new_key)
    leaves_per_key = np.diff(np.append(key_start, len(c["file"])))
    file_of_key = c["file"][key_start]
    lp_sets: dict[int, set[int]] = {}
    for f, lp in zip(c["file"].tolist(), c["lp"].tolist(), strict=True):
        lp_sets.setdefault(f, set()).add(lp)
    want = np.array([len(lp_sets[int(f)]) for f in file_of_key], dtype=np.int64)
    short = np.flatnonzero(leaves_per_key != want)
    if len(short):
        kk = int(short[0])
        a = int(key_start[kk])
        fidx, frame = int(c["file"][a]), int(c["frame"][a])
        have = set(c["lp"][a : a + int(leaves_per_key[kk])].tolist())
        lacking = sorted(lp_sets[fidx] - have)
        missing = ["/".join(leaf_paths[p]) or "<tensor>" for p in lacking]
        with_it = (c["file"] == fidx) & np.isin(c["lp"], lacking)
        first = int(np.flatnonzero(with_it)[0])
        rank = _ranks(segments, c["seg"][a : a + 1])[0]
        others = _ranks(segments, c["seg"][with_it])
        raise LayoutMismatchError(
            f"{names[fidx]!r:.200} frame {frame} (rank {rank}) lacks leaves {missing} that other frames of this "
            f"file have (written by rank(s) {others}, e.g. frame {int(c['frame'][first])}); every frame needs "
            "the same leaves",
            filename=names[fidx],
            leaf=missing[0] if missing else "",
            ranks=sorted({rank, *others}),
        )

    # 4. per file, per leaf: rows in frame order.
    order = np.lexsort((c["frame"], c["lp"], c["file"]))
    f_s, lp_s = c["file"][order], c["lp"][order]
    brk = np.ones(len(order), dtype=bool)
    brk[1:] = (np.diff(f_s) != 0) | (np.diff(lp_s) != 0)
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], len(order))
    keys = F.node_names(names)
    files: list[FilePlan] = []
    by_file: dict[int, list[tuple[int, np.ndarray]]] = {}
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        by_file.setdefault(int(f_s[a]), []).append((int(lp_s[a]), order[a:b]))
    for fidx in sorted(by_file):
        parts = by_file[fidx]
        key = keys[names[fidx]]
        leaf_tuples = [leaf_paths[lp] for lp, _ in parts]
        is_dict = leaf_tuples != [()]
        nodes: dict[tuple[str, ...], str] = _leaf_nodes(leaf_tuples) if is_dict else {(): ""}
        leaves = []
        for (_lp, rows), leaf_path in zip(parts, leaf_tuples, strict=True):
            gl = int(c["gl"][rows[0]])
            node = f"files/{key}" + (f"/{nodes[leaf_path]}" if is_dict else "")
            leaves.append(LeafPlan(layouts[gl], node, rows))
        frames = c["frame"][parts[0][1]]
        files.append(FilePlan(names[fidx], len(files), key, frames.copy(), leaves, is_dict))
    return Plan(files, segments, c["seg"], c["off"], c["nb"], c["crc"], duplicates, c["copies"])


def _leaf_nodes(leaves: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """Node path (relative to the file's group) of each leaf, encoding every dict level.

    A key that is both a leaf and a parent (impossible for one dict value) is refused."""
    children: dict[tuple[str, ...], set[str]] = {}
    for leaf in leaves:
        for depth in range(len(leaf)):
            children.setdefault(leaf[:depth], set()).add(leaf[depth])
    enc = {parent: F.node_names(sorted(names)) for parent, names in children.items()}
    out = {}
    for leaf in leaves:
        parts = [enc[leaf[:d]][leaf[d]] for d in range(len(leaf))]
        out[leaf] = "/".join(parts)
    leaf_set = set(leaves)
    for parent in children:
        if parent in leaf_set:
            raise LayoutMismatchError(
                f"leaf {'/'.join(parent)!r} is a value in some frames and a dict in others",
                filename="",
                leaf="/".join(parent),
            )
    return out


def fingerprint(plan: Plan, **settings: Any) -> str:
    """A digest of everything that decides the output's bytes: the source segments, every file's
    key, leaves and frames, the source rows chosen for them (segment, offset, size, checksum) and
    the output ``settings`` (chunk size, codec). Two processes that compute the same fingerprint
    write the same output; parts of a parallel merge record it and refuse to mix."""
    h = hashlib.blake2b(digest_size=16)
    head = {
        "format_version": F.FORMAT_VERSION,
        "settings": settings,
        "segments": [s.seg.rel for s in plan.segments],
        "files": [
            [f.filename, f.key, f.is_dict, [[leaf.node, leaf.layout.to_obj()] for leaf in f.leaves]] for f in plan.files
        ],
    }
    # ensure_ascii: filenames may hold lone surrogates, which UTF-8 cannot encode.
    h.update(json.dumps(head, sort_keys=True, ensure_ascii=True).encode("ascii"))
    if plan.files:
        rows = np.concatenate([leaf.rows for f in plan.files for leaf in f.leaves])
        frames = np.concatenate([f.frames for f in plan.files])
        for col in (frames, plan.seg[rows], plan.offset[rows], plan.nbytes[rows], plan.crc[rows]):
            h.update(np.ascontiguousarray(col, dtype="<i8").tobytes())
    return h.hexdigest()


def split(plan: Plan, parts: int) -> list[list[int]]:
    """Positions in ``plan.files`` of the files each of ``parts`` parts writes: greedy
    largest-first by payload bytes (ties: fewest files, then lowest part), so every process
    computes the same split from the same plan and no file is split between parts (whole arrays
    per process: zarr-python#3682 loses rows when processes share a chunk)."""
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise SpillValueError(f"parts must be a positive int, got {parts!r}")
    sizes = [len(f.frames) * f.frame_nbytes for f in plan.files]
    heap = [(0, 0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, count, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (load + sizes[i], count + 1, p))
    return [sorted(files) for files in out]
