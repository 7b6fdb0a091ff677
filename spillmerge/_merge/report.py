"""What a merge did: :class:`MergeReport`, and the frame arithmetic behind its gaps."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from .._spill.removal import Lookup
from .._util.frames import first_missing, runs
from .._util.units import size_text
from .plan import ROW_BLOCK, Plan

_INLINE_NOTES = ("part ", "spill root ")
"""Notes printed on the report's first line (the rest only under a partial merge)."""


@dataclass(frozen=True, slots=True)
class MergeReport:
    """What a merge did."""

    out: str
    """Output path or URL."""
    n_files: int
    """Filenames written."""
    n_frames: int
    """Frames written."""
    nbytes: int
    """Payload bytes written (without checksums)."""
    ranks: list[int]
    """Ranks whose committed segments were merged."""
    segments: int
    """Committed segments merged."""
    seconds: float
    """Wall time of the whole call."""
    wait_seconds: float
    """Time spent waiting for commit records (the barrier)."""
    merge_seconds: float
    """Time spent validating, planning and writing."""
    duplicates: int
    """Duplicate (filename, frame) copies dropped across segments (identical content, or by the
    duplicate policy); copies a rank wrote twice itself are in ``rewrites``."""
    missing_ranks: list[int] = field(default_factory=list)
    """Ranks without a commit record (only with ``allow_partial=True``)."""
    abandoned_segments: list[str] = field(default_factory=list)
    """Uncommitted segments superseded by a later commit of the same rank (not merged)."""
    salvaged_frames: dict[int, int] = field(default_factory=dict)
    """Rank → frames merged from its uncommitted segment's journal (``allow_partial``)."""
    frame_gaps: dict[str, list[int]] = field(default_factory=dict)
    """Filename → missing frame indices (at most 10,000 listed per file), with ``allow_partial`` or
    ``expected``. Without ``expected``: the frames absent between 0 and the file's highest merged
    frame. With ``expected`` (filename → frame count): every frame ``0 .. count-1`` absent, files
    the manifest lists that no rank wrote included."""
    expected_files: int | None = None
    """Filenames in the ``expected`` manifest (None without one)."""
    notes: list[str] = field(default_factory=list)
    """Problems that stopped salvaging a journal (torn or corrupt entries); a part that was
    already complete and was not rewritten."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: wait, load (indexes), plan, metadata, copy, parts (waiting for part
    records), index, sync, finish (and transfer, when shards were moved over torch.distributed
    first)."""
    parts: int = 1
    """Parts (processes) the output is written in: 1 for a one-process merge."""
    part: int | None = None
    """The part this call wrote (``part=(i, n)``, or a rank of ``parallel=True`` that is not
    ``dst``). A part plans every file, so ``n_files`` / ``n_frames`` are the whole merge's and
    ``nbytes`` the payload of the part's own output chunks. None for a whole merge or a finalize."""
    codec: str = "none"
    """Output codec of the arrays under ``columns/``."""
    transferred: dict[int, int] = field(default_factory=dict)
    """Rank → shard bytes moved to the merging rank over torch.distributed (node-local roots)."""
    transfer_senders: dict[int, list[int]] = field(default_factory=dict)
    """Sending rank → the ranks whose shards it moved (one sender per group sharing a disk)."""
    rewrites: int = 0
    """Duplicate copies each rank dropped itself (a key written twice by one writer; the sum of
    its ``stats()["rewrites"]``, from the commit records of the merged segments)."""
    merged_segments: list[str] = field(default_factory=list)
    """The committed segments the output was merged from (paths under the spill root)."""
    removed_segments: list[str] = field(default_factory=list)
    """Segments ``remove_spill`` deleted: the merged ones, and uncommitted ones that ended whose
    every journaled frame the output holds."""
    kept_segments: dict[str, str] = field(default_factory=dict)
    """Segment → why ``remove_spill`` kept it (committed after the plan, still being written,
    frames the output lacks, or a reason that kept the whole root)."""

    @property
    def dropped_duplicates(self) -> int:
        """Every duplicate (filename, frame) copy dropped: across segments (``duplicates``) and
        within a rank (``rewrites``). With a ``DistributedSampler`` that pads the last batch, this
        is the padding."""
        return self.duplicates + self.rewrites

    def to_json(self) -> bytes:
        """The report as JSON (dict keys that are ranks become strings; ``from_json`` restores them)."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> MergeReport:
        """The report ``to_json`` wrote (unknown keys are ignored: a newer spillmerge may add some)."""
        obj: dict[str, Any] = json.loads(data)
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in obj.items() if k in known}
        for name in ("salvaged_frames", "transferred", "transfer_senders"):  # JSON keys are strings
            if isinstance(kw.get(name), dict):
                kw[name] = {int(k): v for k, v in kw[name].items()}
        return cls(**kw)

    @property
    def filenames(self) -> int:  # the contract's name for the count
        return self.n_files

    @property
    def frames(self) -> int:
        return self.n_frames

    def __str__(self) -> str:
        s = (
            (f"part {self.part}/{self.parts}: " if self.part is not None else "")
            + f"merged {self.n_files} files, {self.n_frames} frames, {size_text(self.nbytes)} from "
            f"{len(self.ranks)} ranks ({self.segments} segments) into {self.out}"
            + (f" in {self.parts} parts" if self.part is None and self.parts > 1 else "")
            + (f" with {self.codec}" if self.codec != "none" else "")
            + f" in {self.seconds:.2f} s "
            f"(wait {self.wait_seconds:.2f} s, merge {self.merge_seconds:.2f} s)"
        )
        if self.transferred:
            moved = size_text(sum(self.transferred.values()))
            s += f"; {moved} of ranks {sorted(self.transferred)} moved over torch.distributed first"
        s += "".join(f"; {n}" for n in self.notes if n.startswith(_INLINE_NOTES))
        if self.dropped_duplicates:
            s += f"; {self.dropped_duplicates} duplicate frame copies dropped"
        if self.missing_ranks:
            s += f"; PARTIAL: ranks {self.missing_ranks} missing"
            if self.salvaged_frames:
                s += f" (salvaged from their flushed chunks: {self.salvaged_frames} frames by rank)"
        if self.frame_gaps:
            s += self._gaps_text()
        elif self.expected_files is not None:
            s += f"; every frame of the {self.expected_files} expected files is present"
        if self.missing_ranks:
            s += "".join(f"\n  note: {n}" for n in self.notes if not n.startswith(_INLINE_NOTES))
            if self.expected_files is None:
                s += (
                    "\n  (frames after a file's last merged frame, and files only the missing ranks held, "
                    "are not listed: pass expected= / --expected MANIFEST.csv to check against the counts)"
                )
        return s + self._kept_text()

    def _kept_text(self, lines: int = 10) -> str:
        """The segments ``remove_spill`` kept, one line per reason."""
        by_why: dict[str, list[str]] = {}
        for path, why in sorted(self.kept_segments.items()):
            by_why.setdefault(why, []).append(path)
        s = ""
        for why, paths in list(by_why.items())[:lines]:
            more = f" and {len(paths) - 1} more segment(s)" if len(paths) > 1 else ""
            s += f"\n  kept {paths[0]}{more}: {why}"
        if len(by_why) > lines:
            s += "\n  ... and more kept segments (MergeReport.kept_segments lists them all)"
        return s

    def _gaps_text(self, files: int = 20, chars: int = 160) -> str:
        n = sum(len(v) for v in self.frame_gaps.values())
        against = "against the expected counts" if self.expected_files is not None else "below each file's last frame"
        s = f"; {n} frame(s) missing in {len(self.frame_gaps)} file(s) {against}:"
        for name in sorted(self.frame_gaps)[:files]:
            text = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b, _ in runs(np.asarray(self.frame_gaps[name])))
            s += f"\n  {name!r}: frames {text if len(text) <= chars else text[:chars] + ' ...'}"
        if len(self.frame_gaps) > files:
            s += f"\n  ... and {len(self.frame_gaps) - files} more file(s) (MergeReport.frame_gaps lists them all)"
        return s


def plan_lookup(plan: Plan) -> Lookup:
    """:data:`~spillmerge._spill.removal.Lookup` of a merge plan (what a complete output written from it holds)."""
    find = plan.filenames.search
    off, frames = plan.file_offsets, plan.frame_idx

    def lookup(name: str) -> Any:
        i = find(name)
        return None if i < 0 else frames[off[i] : off[i + 1]]

    return lookup


def gaps(plan: Plan, expected: dict[str, int] | None, *, whole: bool, limit: int = 10000) -> dict[str, list[int]]:
    """Per filename, the frame indices absent: below the manifest's count when it lists the file,
    else between 0 and the highest frame merged. ``whole``: also the files only the manifest names
    (a part leaves those to the finalize). At most ``limit`` per file. Files whose frames are
    exactly ``0 .. n-1`` (nearly all) are skipped without a Python step each."""
    out: dict[str, list[int]] = {}
    off, frames = plan.file_offsets, plan.frame_idx
    check: set[int] = set()
    for a in range(0, plan.n_files, ROW_BLOCK):  # a block of files at a time (an out-of-core plan maps them)
        o = np.asarray(off[a : a + ROW_BLOCK + 1])
        n_rows = np.diff(o)
        last = np.where(n_rows > 0, frames[np.maximum(o[1:] - 1, 0)], -1)
        check.update((a + np.flatnonzero(last + 1 != n_rows)).tolist())  # a gap below the last frame
    find = plan.filenames.search
    if expected:
        check.update(i for i in map(find, expected) if i >= 0)
    for i in sorted(check):
        name = plan.filenames[i]
        have = frames[off[i] : off[i + 1]]
        span = expected.get(name) if expected is not None else None
        if span is None:
            span = int(have[-1]) + 1 if len(have) else 0
        have = have[have < span]
        if len(have) != span:
            out[name] = first_missing(have, span, limit)
    if expected and whole:
        out.update({name: list(range(min(n, limit))) for name, n in expected.items() if n > 0 and find(name) < 0})
    return out
