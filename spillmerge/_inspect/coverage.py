"""Coverage of a spill root or a merged output: which frames of which file came from which rank,
which are missing (gaps, or against a manifest of expected frame counts) and which were written
more than once. Used by ``spillmerge inspect --json / --expected / --plot``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import SpillMergeError, require
from .._format import spill as FS
from .._read.export import whole_file
from .._read.store import MergedStore
from .._spill.root import Segment
from .._storage import Storage
from .._util.frames import gap_runs, n_below, runs
from .summary import summarize_read


@dataclass(frozen=True, slots=True)
class FileCoverage:
    """The frames of one filename."""

    filename: str
    frames: np.ndarray
    """Frame indices present, ascending, unique (int64)."""
    ranks: np.ndarray
    """Rank each frame came from (the first segment in write order for a spill root), or -1."""
    copies: np.ndarray
    """Number of segments that held each frame (1, or more when it was written twice)."""
    expected: int | None
    """Frames the manifest expects (frame indices ``0 .. expected-1``), or None without one."""

    @property
    def span(self) -> int:
        """Frames ``0 .. span-1`` are expected: the manifest's count, else up to the highest frame."""
        if self.expected is not None:
            return self.expected
        return int(self.frames[-1]) + 1 if len(self.frames) else 0

    @property
    def n_missing(self) -> int:
        """How many frames below :attr:`span` are absent (arithmetic, whatever the span)."""
        return self.span - n_below(self.frames, self.span)

    def unexpected(self) -> np.ndarray:
        """Frames at or beyond the manifest's count (none without a manifest)."""
        return self.frames[self.frames >= self.expected] if self.expected is not None else self.frames[:0]

    def duplicated(self) -> np.ndarray:
        return self.frames[self.copies > 1]


@dataclass
class Coverage:
    """Coverage of every file of a spill root or merged output (plus files only the manifest names)."""

    path: str
    kind: str
    """``"spill"`` or ``"merged"``."""
    files: list[FileCoverage]
    """Sorted by filename."""
    manifest: str | None = None
    """The manifest path, when one was given."""
    notes: list[str] = field(default_factory=list)
    """Segments that could not be read (spill roots)."""
    unlisted: list[str] = field(default_factory=list)
    """Files present that the manifest does not list."""

    @property
    def n_missing(self) -> int:
        return sum(f.n_missing for f in self.files)

    def to_json(self, max_files: int | None = None) -> dict[str, Any]:
        """Frame sets as inclusive ``[first, last]`` runs, so a million frames stay a few lines.
        ``max_files``: list at most that many files, those with missing, duplicated or unexpected
        frames (or not in the manifest) first; the totals always count every file."""
        problem: list[FileCoverage] = []
        clean: list[FileCoverage] = []
        n_missing = n_dup = present = 0
        unlisted = set(self.unlisted)
        for f in self.files:  # cheap per-file counts; the runs only for the files listed
            m, d = f.n_missing, int(np.count_nonzero(f.copies > 1))
            n_missing, n_dup, present = n_missing + m, n_dup + d, present + len(f.frames)
            bad = m or d or f.filename in unlisted or (f.expected is not None and len(f.unexpected()))
            (problem if bad else clean).append(f)
        files = [
            {
                "filename": f.filename,
                "frames": len(f.frames),
                "expected": f.expected,
                "by_rank": [[a, b, r] for a, b, r in runs(f.frames, f.ranks)],
                "missing": gap_runs(f.frames, f.span).tolist(),
                "duplicated": [[a, b] for a, b, _ in runs(f.duplicated())],
            }
            | ({} if f.expected is None else {"unexpected": [[a, b] for a, b, _ in runs(f.unexpected())]})
            for f in (problem + clean)[:max_files]  # (None: every file)
        ]
        return {
            "kind": self.kind,
            "path": self.path,
            "manifest": self.manifest,
            "missing_frames": n_missing,
            "missing_files": [f.filename for f in self.files if not len(f.frames) and f.span],
            "duplicated_frames": n_dup,
            "present_frames": present,
            "n_files": len(self.files),
            "files_with_problems": len(problem),
            "unlisted_files": self.unlisted,
            "files": files,
            "notes": self.notes,
        }


def coverage(
    path: str, storage_options: dict[str, Any] | None = None, *, expected: dict[str, int] | None = None
) -> Coverage:
    """Coverage of a spill root (committed segments, as the merge would see them) or a merged output;
    ``expected``: a manifest's counts as ``_util.frames.read_manifest`` reads and checks them."""
    storage = Storage(path, storage_options)
    read = summarize_read(storage, 0)[1]  # None: an interrupted merge, which MergedStore refuses by name
    return cover(storage, MergedStore(storage.url, storage.storage_options) if read is None else read, expected)


def cover(storage: Storage, read: Any, expected: dict[str, int] | None) -> Coverage:
    """:func:`coverage` from what ``summary.summarize_read`` read: a :class:`MergedStore`, or the
    committed segments' keys."""
    kind = "merged" if isinstance(read, MergedStore) else "spill"
    per_file, notes = _merged(read) if kind == "merged" else _spill(read)
    want = expected or {}  # (None: no manifest, so no file's count)
    names = sorted(set(per_file) | set(want))
    empty = np.zeros(0, dtype=np.int64)
    files = [FileCoverage(name, *per_file.get(name, (empty,) * 3), want.get(name)) for name in names]
    unlisted = [] if expected is None else [n for n in names if n not in expected]
    return Coverage(storage.describe(), kind, files, notes=notes, unlisted=unlisted)


_PerFile = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]


def _merged(res: MergedStore) -> tuple[_PerFile, list[str]]:
    names, off, frames, ranks, copies = res.index_arrays()
    e = off.tolist()  # each file's slices of the index arrays: no lookup per file
    spans = zip(names, e[:-1], e[1:], strict=True)
    return {name: (frames[a:b], ranks[a:b], copies[a:b]) for name, a, b in spans}, []


def _spill(read: list[tuple[Segment, Any]]) -> tuple[_PerFile, list[str]]:
    rows: list[np.ndarray] = []  # (file id, frame, rank) of each segment's frames
    gid: dict[str, int] = {}
    notes = []
    # Write order, as the merge's duplicate policy sees it: segment start time, then rank.
    for seg, got in sorted(read, key=lambda r: (FS.segment_sort_key(r[0].name)[1], r[0].rank, r[0].name)):
        if isinstance(got, str):  # the segment's error
            notes.append(got)
            continue
        filenames, keys = got
        fmap = np.array([gid.setdefault(f, len(gid)) for f in filenames], dtype=np.int64)
        rows.append(np.column_stack([fmap[keys[:, 0]], keys[:, 1], np.full(len(keys), seg.rank, np.int64)]))
    if not any(map(len, rows)):  # (np.split of no rows gives one empty part)
        return {}, notes
    c = np.concatenate(rows)
    file_s, frame_s, rank_s = c[np.lexsort((c[:, 1], c[:, 0]))].T  # stable: copies stay in write order
    first = np.ones(len(c), dtype=bool)
    first[1:] = (np.diff(file_s) != 0) | (np.diff(frame_s) != 0)
    starts = np.flatnonzero(first)
    copies = np.diff(np.append(starts, len(c)))
    kf = file_s[starts]
    bounds = np.flatnonzero(np.diff(kf)) + 1
    kept = (frame_s[starts], rank_s[starts], copies)
    parts = zip(kf[np.append(0, bounds)].tolist(), *(np.split(a, bounds) for a in kept), strict=True)
    names = list(gid)  # by id: ids were given in insertion order
    return {names[f]: (frames, ranks, n) for f, frames, ranks, n in parts}, notes


def plot(cov: Coverage, png: str, *, max_files: int = 200) -> None:
    """Draw one row per file: frames coloured by source rank, missing frames in red, duplicated
    frames marked with a black tick. Needs matplotlib (``pip install 'spillmerge[plot]'``)."""
    mpl = require("matplotlib", package="matplotlib", extra="plot", feature="spillmerge inspect --plot")
    mpl.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    files = cov.files[:max_files]
    n = max(len(files), 1)
    fig, ax = plt.subplots(figsize=(10, min(2.0 + 0.3 * n, 60.0)), dpi=100)
    ranks = sorted({int(r) for f in files for r in np.unique(f.ranks)})
    # tab10 without its red (index 3), which is reserved for missing frames; viridis past 9 ranks.
    tab = [plt.get_cmap("tab10")(i) for i in range(10) if i != 3]
    many = plt.get_cmap("viridis")
    few = len(ranks) <= len(tab)
    color = {r: tab[i] if few else many(i / max(len(ranks) - 1, 1)) for i, r in enumerate(ranks)}
    # Runs, not frames: one bar collection per colour and file, so drawing costs O(frames) whatever
    # the span of frame indices. Bars are at least ~1 pixel wide, so an isolated frame stays
    # visible next to a gap of billions; missing runs go below the present ones.
    width = max((f.span for f in files), default=1)
    least = max(width, 1) / 500
    for y, f in enumerate(files):
        gaps = gap_runs(f.frames, f.span)
        if len(gaps):
            bars = [(a - 0.5, max(b - a + 1, least)) for a, b in gaps.tolist()]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors="red", linewidth=0)
        by_rank: dict[int, list[tuple[float, float]]] = {}
        for a, b, r in runs(f.frames, f.ranks):
            by_rank.setdefault(r, []).append((a - 0.5, max(b - a + 1, least)))
        for r, bars in by_rank.items():
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color[r], linewidth=0)
        dup = f.duplicated()
        if len(dup):  # a black tick above each (the "|" marker, no line)
            ax.plot(dup, np.full(len(dup), y + 0.3), "|", color="black", markersize=12, markeredgewidth=2)
    ax.set_yticks(range(len(files)))
    ax.set_yticklabels([f.filename if len(f.filename) <= 40 else "…" + f.filename[-39:] for f in files], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("frame index")
    ax.set_xlim(-0.5, max(width, 1) - 0.5)
    handles = [Patch(color=color[r], label=f"rank {r}") for r in ranks]
    handles.append(Patch(color="red", label=f"missing ({cov.n_missing})"))
    handles.append(Patch(color="black", label=f"duplicated ({sum(len(f.duplicated()) for f in cov.files)})"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    more = f" (first {len(files)} of {len(cov.files)} files)" if len(cov.files) > len(files) else ""
    ax.set_title(f"{cov.kind} {cov.path}{more}", fontsize=8)
    fig.tight_layout()
    try:
        with whole_file(png, f"the plot to {png}") as tmp:  # the file appears only when whole, replacing what was there
            fig.savefig(tmp, format="png")
    except OSError as exc:
        raise SpillMergeError(f"cannot write the plot to {png}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
