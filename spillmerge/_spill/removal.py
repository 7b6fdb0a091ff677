"""``remove_spill``: delete exactly the segments an output holds: those the merge planned, and
ended uncommitted ones (a failure record, or a later session merged) whose every journaled frame
is in it (:func:`remove_merged`); rank folders and the root only when left empty, nothing else."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import SpillMergeError
from .._format import spill as FS
from .._storage import Storage
from .root import LoadedSegment, Segment, list_ranks, load_flushed, read_segment

Lookup = Callable[[str], Any]
"""Filename → the frame indices the output holds for it (array-like), or None when it has none."""


@dataclass(slots=True)
class Removal:
    """What a removal deleted and what it kept."""

    removed: list[str] = field(default_factory=list)
    """Segments deleted (paths as the storage describes them)."""
    kept: dict[str, str] = field(default_factory=dict)
    """Segment → why it stays."""


def lacking(seg: LoadedSegment, lookup: Lookup) -> int:
    """How many of the (filename, frame) keys ``seg`` holds the output lacks."""
    idx = seg.index
    if not len(idx):
        return 0
    keys = np.unique(idx[:, [FS.COL_FILE, FS.COL_FRAME]], axis=0)  # sorted by file, then frame
    starts = np.flatnonzero(np.r_[True, keys[1:, 0] != keys[:-1, 0]])
    total = 0
    for a, b in zip(starts, [*starts[1:], len(keys)], strict=True):
        want = keys[a:b, 1]
        have = lookup(seg.filenames[int(keys[a, 0])])
        total += len(want) if have is None else int(np.count_nonzero(~np.isin(want, np.asarray(have))))
    return total


def remove_merged(src: Storage, merged: Collection[Segment], lookup: Lookup) -> Removal:
    """After a complete merge of ``merged`` (the committed segments its plan was built from):
    delete them and the ended uncommitted segments whose frames the output holds (the module's
    rule; ``_why_kept`` says why any other stays), then the merge failure record (of a merge this
    one replaces), the rank folders left empty and the root if nothing else is in it."""
    planned = {s.rel for s in merged}
    newest: dict[int, tuple[int, str]] = {}  # rank -> sort key of its last merged segment
    for s in merged:
        key = FS.segment_sort_key(s.name)
        newest[s.rank] = max(newest.get(s.rank, key), key)
    out = Removal()
    for rank in list_ranks(src):
        folder = FS.rank_dirname(rank)
        for name in sorted(n for n in src.listdir(folder) if FS.is_segment_name(n)):
            rel = f"{folder}/{name}"
            why = None if rel in planned else _why_kept(src, rank, name, newest.get(rank), lookup)
            if why is None:
                src.rm_tree(rel)
                out.removed.append(src.describe(rel))
            else:
                out.kept[src.describe(rel)] = why
        src.remove_empty_dir(folder)
    src.rm_tree(FS.MERGE_FAILED_NAME)
    src.remove_empty_dir("")
    return out


def remove_listed(src: Storage, rels: Collection[str], *, failure_record: bool) -> None:
    """Delete the segments ``rels`` (relative to the root) that are still there, then the rank
    folders left empty and the root if nothing else is in it (and the merge failure record when
    ``failure_record``). The caller has checked that the output holds each of them."""
    for rel in sorted(rels):
        if src.exists(rel):
            src.rm_tree(rel)
    for folder in sorted({rel.split("/")[0] for rel in rels}):
        src.remove_empty_dir(folder)
    if failure_record:
        src.rm_tree(FS.MERGE_FAILED_NAME)
    src.remove_empty_dir("")


def _why_kept(src: Storage, rank: int, name: str, newest_merged: tuple[int, str] | None, lookup: Lookup) -> str | None:
    """Why a segment the merge did not plan stays, or None when the output holds it."""
    try:
        seg = read_segment(src, rank, name)
    except SpillMergeError as exc:
        return f"unreadable ({exc})"
    if seg.commit is not None:
        return "committed but not merged (committed after the merge's plan was made)"
    superseded = newest_merged is not None and FS.segment_sort_key(name) < newest_merged
    if seg.failure is None and not superseded:
        return "no commit or failure record: still being written, or its writer was killed"
    try:
        flushed, problems = load_flushed(src, seg)
    except SpillMergeError as exc:
        return f"uncommitted and its journal is unreadable ({exc})"
    if problems and src.listdir(f"{seg.rel}/{FS.DATA_NAME}/c"):  # what its data holds is unknown
        return f"uncommitted and its journal is damaged ({'; '.join(problems)})"
    missing = lacking(flushed, lookup)
    if missing:
        return (
            f"uncommitted ({'failed' if seg.failure is not None else 'abandoned'}): {missing} of the frames its "
            f"journal holds are not in the output"
        )
    return None
