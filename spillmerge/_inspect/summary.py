"""Summaries and integrity checks of a spill root or a merged output (``inspect`` / ``verify``)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import zarr

from .._errors import SpillMergeError
from .._format import common as F
from .._format import crc as _crc
from .._format import invariants as V
from .._format import lists as L
from .._format import output as FO
from .._format import spill as FS
from .._read import index as LZ
from .._read.cache import DEFAULT_CACHE_BYTES, ChunkCache
from .._read.outputstore import NoFillStore
from .._read.store import MergedStore, OutputFiles
from .._read.views import RaggedView
from .._spill.root import Segment, data_ranges, load_segment, scan
from .._storage import Storage
from .._util.progress import bar as _bar
from .._util.units import size_text as _human


def detect(storage: Storage) -> str:
    """``"merged"``, ``"spill"``; raises when ``path`` is neither."""
    kind = FO.what_is(storage)
    if kind not in ("missing", "file") and FO.header(storage) is not None:
        return "merged"
    if kind == "spill":
        return "spill"
    raise FO.not_an_output(storage, kind)


def summarize(path: str, storage_options: dict[str, Any] | None = None, *, max_files: int = 20) -> dict[str, Any]:
    return summarize_read(Storage(path, storage_options), max_files)[0]


def summarize_read(storage: Storage, max_files: int) -> tuple[dict[str, Any], Any]:
    """The summary, and what it read for ``coverage.cover``: the output opened (None when its merge
    did not finish), or each committed segment with its filenames and (file, frame) keys, or its error."""
    return (_summarize_merged if detect(storage) == "merged" else _summarize_spill)(storage, max_files)


def _summarize_spill(storage: Storage, max_files: int) -> tuple[dict[str, Any], list[tuple[Segment, Any]]]:
    segments = scan(storage)
    every = [s for segs in segments.values() for s in segs]
    committed = [s.commit for s in every if s.commit is not None]
    read: list[tuple[Segment, Any]] = []
    ranks = []
    files: Counter[str] = Counter()
    dtypes: set[str] = set()
    with _bar(len(committed), "inspect", "segment", leave=False) as bar:
        for rank, segs in segments.items():
            entries = []
            for s in segs:
                status = "committed" if s.commit else "failed" if s.failure else "incomplete"
                entry: dict[str, Any] = {"segment": s.name, "status": status}
                if s.commit is not None:
                    entry.update(frames=s.commit.n_frames, files=s.commit.n_files, bytes=s.commit.nbytes)
                    try:
                        loaded = load_segment(storage, s)
                        # Frames, not index rows: a frame whose value is a dict has one row per leaf.
                        keys = np.unique(loaded.index[:, [FS.COL_FILE, FS.COL_FRAME]], axis=0)
                        per_file = np.bincount(keys[:, 0], minlength=len(loaded.filenames)).tolist()
                        files.update({f: n for f, n in zip(loaded.filenames, per_file, strict=True) if n})
                        dtypes.update(F.dtype_text(lay.dtype, len(lay.shape)) for lay in loaded.layouts)
                        read.append((s, (loaded.filenames, keys)))
                    except SpillMergeError as exc:
                        entry["error"] = str(exc)
                        read.append((s, entry["error"]))
                    bar.update(1)
                if s.failure is not None:
                    entry["error"] = s.failure.summary()
                entries.append(entry)
            ranks.append({"rank": rank, "segments": entries})
    top = sorted(files.items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "kind": "spill",
        "path": storage.describe(),
        "world_size": sorted({s.world_size for s in every if s.world_size is not None}),
        "ranks": ranks,
        "n_files": len(files),
        "files": [{"filename": f, "frames": n} for f, n in top[:max_files]],
        "dtypes": sorted(dtypes),
        "frames": sum(c.n_frames for c in committed),
        "bytes": sum(c.nbytes for c in committed),
        "segments": len(every),
    }, read


def _summarize_merged(storage: Storage, max_files: int) -> tuple[dict[str, Any], MergedStore | None]:
    if not storage.exists(FO.COMPLETE_NAME):
        # (the header is read from storage: none of its keys stands in for what we found)
        return {**(FO.header(storage) or {}), "kind": "merged", "path": storage.describe(), "complete": False}, None
    res = MergedStore(storage.url, storage.storage_options)
    # the dtypes are the columns', no file need be opened (every column: a leaf that files
    # disagreed on has one per dtype or kind)
    dtypes = {F.dtype_text(c.info.dtype, c.info.ndim) for c in res.files.columns.values()}
    # leaves whose paths read alike (a key holding "/" beside nested dicts) by their column names
    renamed = {leaf: n for n, leaf in res.files.leaf_names.items() if n != "/".join(leaf)}
    files = [
        {
            "filename": name,
            "frames": len(frames),
            "first_frame": int(frames[0]) if len(frames) else None,
            "last_frame": int(frames[-1]) if len(frames) else None,
            "leaves": [_leaf(arr, renamed) for arr in _leaves(res[name])],
        }
        for name, frames in ((name, res.frames(name)) for name in res.filenames[:max_files])
    ]
    h = res.header
    return {
        "kind": "merged",
        "path": storage.describe(),
        "complete": True,
        "n_files": h["n_files"],
        "frames": h["n_frames"],
        "bytes": h["nbytes"],
        "ranks": h.get("ranks"),
        "segments": h.get("segments"),
        "dtypes": sorted(dtypes),
        "files": files,
    }, res


def _leaf(arr: Any, renamed: dict[tuple[str, ...], str]) -> dict[str, Any]:
    """A leaf as a listing shows it: its dict keys joined by ``/`` (or its ``renamed`` column name),
    a list's items as ``[*]``, a container (its header) by its own path, ``<value>`` for the value
    itself; dtype; row shape."""
    info = arr.info
    leaf = info.leaf[:-1] if info.leaf and info.leaf[-1] == F.MARK else info.leaf
    text = renamed.get(info.leaf) or F.path_text(leaf)
    return {"leaf": text, "dtype": F.dtype_text(info.dtype, info.ndim), "shape": _row_shape(arr)}


def _row_shape(arr: Any) -> list[int | None]:
    """The shape of one row of a leaf: ``None`` for a dimension that varies (ragged leaves), ``[]``
    for strings, bytes and lists of strings, Python values and containers."""
    info = arr.info
    if info.dtype in F.PY_SCALARS or info.dtype in F.PY_HEADERS or not F.DTYPES[info.dtype].numeric:
        return []
    if isinstance(arr, RaggedView):
        shapes = arr.shapes
        if not len(shapes):
            return [None] * arr.ndim
        same = (shapes == shapes[0]).all(axis=0)
        return [int(d) if ok else None for d, ok in zip(shapes[0], same, strict=True)]
    return list(arr.shape[1:])  # (a numeric leaf not ragged: a FixedView)


def _leaves(value: Any) -> list[Any]:
    """The leaf views of a file's value (a view, or a nested dict of them)."""
    return [x for v in value.values() for x in _leaves(v)] if isinstance(value, dict) else [value]


def _frames(n: int) -> str:
    return f"{n} frame" if n == 1 else f"{n} frames"


def one_line(text: str) -> str:
    """``text`` as one printable line: a message read from storage (a failure record) neither breaks
    a table's row nor sends control characters to the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_text(s: dict[str, Any]) -> str:
    lines = []
    if s["kind"] == "spill":
        lines.append(f"spill root {s['path']}")
        lines.append(
            f"  world size {', '.join(map(str, s['world_size'])) or '?'}; {len(s['ranks'])} rank folders, "
            f"{s['segments']} segments; committed: {s['frames']} frames, {s['n_files']} files, {_human(s['bytes'])}"
        )
        lines.append(f"  dtypes: {', '.join(s['dtypes']) or '-'}")
        for r in s["ranks"]:
            for e in r["segments"]:
                done = e["status"] == "committed"  # (a committed entry has the counts)
                extra = f"{e['frames']} frames, {e['files']} files, {_human(e['bytes'])}" if done else ""
                err = f"  ERROR: {one_line(e['error'])}" if "error" in e else ""
                lines.append(f"  rank {r['rank']:>4}  {e['segment']}  {e['status']:<10} {extra}{err}")
        if s["files"]:
            lines.append("  files (most frames first):")
            lines += [f"    {f['filename']!r}: {_frames(f['frames'])}" for f in s["files"]]
            if s["n_files"] > len(s["files"]):
                lines.append(f"    ... and {s['n_files'] - len(s['files'])} more")
    else:
        lines.append(f"merged output {s['path']}" + ("" if s["complete"] else "  INCOMPLETE (merge did not finish)"))
        if s["complete"]:
            lines.append(
                f"  {s['n_files']} files, {s['frames']} frames, {_human(s['bytes'])} from ranks {s['ranks']} "
                f"({s['segments']} segments); dtypes: {', '.join(s['dtypes'])}"
            )
            for f in s["files"]:
                leaves = "; ".join(f"{x['leaf']}: {x['dtype']}{x['shape'] or ''}" for x in f["leaves"])
                frames = f"{_frames(f['frames'])} [{f['first_frame']}..{f['last_frame']}]"
                lines.append(f"    {f['filename']!r}: {frames}  {leaves}")
            if s["n_files"] > len(s["files"]):
                lines.append(f"    ... and {s['n_files'] - len(s['files'])} more")
    return "\n".join(lines)


def _ranges(runs: list[list[int]], limit: int = 8) -> str:
    parts = [f"{r[0]}" if r[0] == r[1] else f"{r[0]}..{r[1]}" for r in runs[:limit]]
    return ", ".join(parts) + (f", ... ({len(runs) - limit} more runs)" if len(runs) > limit else "")


def format_coverage(cov: Any, max_files: int = 20) -> str:
    """Text coverage report: totals, then each file with missing, duplicated or unexpected frames."""
    j = cov.to_json(max_files=max_files)  # files with problems come first
    against = f" against {j['manifest']}" if j["manifest"] else " (gaps below each file's highest frame)"
    lines = [
        f"  coverage{against}: {j['present_frames']} frames present, {j['missing_frames']} missing"
        f"{' (' + str(len(j['missing_files'])) + ' files entirely)' if j['missing_files'] else ''}, "
        f"{j['duplicated_frames']} written more than once"
        + (f", {len(j['unlisted_files'])} files not in the manifest" if j["unlisted_files"] else "")
    ]
    for f in j["files"]:
        problems = []
        if f["missing"]:
            problems.append(f"missing {_ranges(f['missing'])}")
        if f["duplicated"]:
            problems.append(f"duplicated {_ranges(f['duplicated'])}")
        if f["filename"] in j["unlisted_files"]:
            problems.append("not in the manifest")
        if f.get("unexpected"):
            problems.append(f"beyond the manifest's {f['expected']} frames: {_ranges(f['unexpected'])}")
        if problems:
            lines.append(f"    {f['filename']!r}: " + "; ".join(problems))
    if j["files_with_problems"] > max_files:
        lines.append(f"    ... and {j['files_with_problems'] - max_files} more files with problems (--max-files N)")
    lines.extend(f"  note: {n}" for n in j["notes"])
    return "\n".join(lines)


@dataclass
class VerifyReport:
    """Result of :func:`verify`."""

    path: str
    """What was checked."""
    kind: str
    """``"spill"`` or ``"merged"``."""
    checked_objects: int = 0
    """Objects (chunks, indexes) whose checksums were verified."""
    checked_bytes: int = 0
    """Payload bytes verified."""
    problems: list[str] = field(default_factory=list)
    """One line per corrupt or missing object, naming its path."""
    unfinished: list[str] = field(default_factory=list)
    """Those of ``problems`` that are no corruption: a segment without a commit record (a rank still
    writing, failed or killed), an output whose merge did not finish."""

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: str, storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """Check every checksum of a spill root (index, catalog, every frame) or a merged output
    (every chunk), collecting every problem rather than stopping at the first."""
    storage = Storage(path, storage_options)
    kind = detect(storage)
    rep = VerifyReport(storage.describe(), kind)
    (_verify_spill if kind == "spill" else _verify_merged)(storage, rep)
    storage.close()
    return rep


def _verify_spill(storage: Storage, rep: VerifyReport) -> None:
    segments = [s for segs in scan(storage, rep.problems).values() for s in segs]  # (ranks ascending)
    with _bar(sum(s.commit.nbytes for s in segments if s.commit), "verify", leave=False) as bar:
        for seg in segments:
            if seg.commit is None:
                what = "failed" if seg.failure else "incomplete"
                rep.unfinished.append(f"{storage.describe(seg.rel)}: {what} segment (no commit record)")
                rep.problems.append(rep.unfinished[-1])
                continue
            try:
                loaded = load_segment(storage, seg)
            except SpillMergeError as exc:
                rep.problems.append(str(exc))
                continue
            _verify_segment(storage, rep, seg, loaded, bar)
            rep.checked_objects += 2 + seg.commit.n_chunks  # index, catalog, data chunks


def _verify_segment(storage: Storage, rep: VerifyReport, seg: Any, loaded: Any, bar: Any) -> None:
    """Every checksum of a committed segment's data: its blocks (``write_batch``'s rows: one
    checksum per leaf of a block, in one chunk), then its other rows, in data order."""
    cb = seg.commit.chunk_bytes
    bad_chunks: set[int] = set()

    def read(off: int, nb: int, crc: int, row: Any = None) -> np.ndarray | None:
        """Data bytes ``off .. off+nb`` (a block's, or index ``row``'s) when they match ``crc``;
        else None, the problem noted and their chunks not read again."""
        span = range(off // cb, (off + nb - 1) // cb + 1)
        if bad_chunks.intersection(span):
            return None
        pieces = data_ranges(loaded, off, nb)
        buf = np.empty(nb, dtype=np.uint8)
        try:
            storage.read_into(pieces, buf.data)
        except SpillMergeError as exc:
            rep.problems.append(str(exc))
            bad_chunks.update(span)
            return None
        if _crc.value(buf) != crc:
            chunks = ", ".join(storage.describe(p[0]) for p in pieces)
            what = "a block of rows" if row is None else _frame_text(loaded, row)
            where = f"bytes {off}..{off + nb} of rank {seg.rank}'s data"
            rep.problems.append(f"{chunks}: checksum mismatch in {what} ({where})")
            bad_chunks.update(span)
            return None
        return buf

    for off, nb, crc in [] if loaded.checks is None else loaded.checks.tolist():
        read(off, nb, crc)
    idx = loaded.index
    for row in idx[np.argsort(idx[:, FS.COL_OFFSET], kind="stable")]:
        off, nb, crc = int(row[FS.COL_OFFSET]), int(row[FS.COL_NBYTES]), int(row[FS.COL_CRC])
        if nb and crc < 0:  # checked with its block above
            rep.checked_bytes += 0 if off // cb in bad_chunks else nb
        elif nb and (buf := read(off, nb, crc, row)) is not None:
            rep.checked_bytes += nb
            lay = loaded.layouts[int(row[FS.COL_LAYOUT])]
            # what the merge's copy checks of text (a hand edit with its CRC fixed up)
            bad = FS.text_problem(lay.kind, lay.shape[0], buf) if lay.kind in ("str", "strlist") else None
            if bad is not None:
                leaf = "/".join(lay.leaf) or "<tensor>"
                where = f"{storage.describe(seg.rel)}: {_frame_text(loaded, row)} leaf {leaf!r}"
                rep.problems.append(f"{where} holds {bad}: the merge would refuse it")
        bar.update(nb)


def _frame_text(loaded: Any, row: np.ndarray) -> str:
    return f"{loaded.filenames[int(row[FS.COL_FILE])]!r:.200} frame {int(row[FS.COL_FRAME])}"


def _verify_merged(storage: Storage, rep: VerifyReport) -> None:
    complete = storage.exists(FO.COMPLETE_NAME)
    if not complete:
        rep.unfinished.append(f"{storage.describe()}: no {FO.COMPLETE_NAME}; the merge did not finish")
        rep.problems.append(rep.unfinished[-1])
    else:  # read as open() reads it: a torn or planted marker is a problem, not "OK"
        try:
            F.loads(storage.get(FO.COMPLETE_NAME), path=storage.describe(FO.COMPLETE_NAME))
        except SpillMergeError as exc:
            rep.problems.append(str(exc))
    try:
        store = NoFillStore(storage.zarr_store(), storage)
        group = zarr.open_group(store, mode="r")
    except Exception as exc:  # noqa: BLE001
        rep.problems.append(f"{storage.describe()}: cannot open as zarr: {exc}")
        return
    header = group.attrs.get("spillmerge")
    if isinstance(header, dict) and header.get("format_version") != F.FORMAT_VERSION:
        # another format's arrays would be reported as damage one by one: say what it is instead
        rep.problems.append(str(F.version_error(storage.describe(), header.get("format_version"), spill=False)))
        return
    damaged: set[str] = set()
    arrays = []
    try:
        listed = sorted((p, node) for p, node in group.members(max_depth=None) if isinstance(node, zarr.Array))
    except KeyError as exc:  # zarr nests the consolidated listing by key order: an edited one breaks it
        rep.problems.append(f"{storage.describe('zarr.json')}: the consolidated metadata is inconsistent ({exc})")
        return
    for name, arr in listed:
        # The metadata first, against the format: a chunk grid it breaks (a chunk larger than
        # its array, 2**40 rows of chunks) is reported without reading a chunk of it.
        bad = V.grid_problems(name, arr)
        if bad:
            rep.problems.extend(f"{storage.describe(rel)}: {what}" for rel, what in bad)
            damaged.add(name)
        elif arr.size:
            arrays.append((name, arr))
    with _bar(len(arrays), "verify", "array", leave=False) as bar:
        for name, arr in arrays:
            _verify_array(storage, rep, name, arr, damaged)
            bar.update(1)
    if complete:  # an interrupted merge may not have written its index yet
        rep.problems.extend(_index_problems(storage, group, header, damaged))


MISSING_LISTED = 20
"""Absent chunks of one array that ``verify`` names one by one; beyond, it counts them."""


def _verify_array(storage: Storage, rep: VerifyReport, name: str, arr: Any, damaged: set[str]) -> None:
    """Read every stored chunk of ``arr`` (decoding checks its CRC) and report the absent ones, in
    time proportional to the chunks stored, not to the grid its metadata declares: the chunks are
    listed once, and the grid is walked only to name absent chunks when there are few."""
    try:
        stored = storage.find(f"{name}/c")
    except SpillMergeError as exc:  # a link, FIFO or device among the chunks, named
        rep.problems.append(str(exc))
        damaged.add(name)
        return
    grid = tuple(int(n) for n in arr.cdata_shape)
    declared = math.prod(grid)
    present: list[tuple[int, ...]] = []
    prefix = f"{name}/c/"
    for rel, _ in stored:
        try:
            coords = tuple(int(p) for p in rel[len(prefix) :].split("/"))
        except ValueError:
            continue  # not a chunk key (a temporary name): zarr never reads it
        if len(coords) == len(grid) and all(0 <= c < n for c, n in zip(coords, grid, strict=True)):
            present.append(coords)
    missing = declared - len(present)
    if missing:
        damaged.add(name)
        if missing <= MISSING_LISTED:
            have = set(present)
            for coords in itertools.product(*(range(n) for n in grid)):
                if coords not in have:
                    rep.problems.append(
                        f"{storage.describe(name + '/c/' + '/'.join(map(str, coords)))}: chunk "
                        f"{', '.join(map(str, coords))} of {name} is missing (zarr would read it as zeros)"
                    )
        else:
            rep.problems.append(
                f"{storage.describe(name)}: {missing} of its {declared} chunks are missing "
                f"({len(present)} stored; zarr would read the others as zeros)"
            )
    for coords in present:
        sel = tuple(slice(c * k, (c + 1) * k) for c, k in zip(coords, arr.chunks, strict=True))
        try:
            rep.checked_bytes += int(np.asarray(arr[sel]).nbytes)
            rep.checked_objects += 1
        except Exception as exc:  # noqa: BLE001 - zarr reports codec errors as ValueError etc.
            at = f"{storage.describe(name)}: chunk {', '.join(map(str, coords))}"
            rep.problems.append(str(exc) if isinstance(exc, SpillMergeError) else f"{at} is corrupt or missing ({exc})")
            damaged.add(name)


def _found(problems: list[V.Problem]) -> None:
    if problems:
        raise LZ.Found(problems)


def _index_problems(storage: Storage, group: Any, header: Any, damaged: set[str]) -> list[str]:
    """Every broken invariant of the output's index (docs/FORMAT.md) by the checks ``open`` makes
    (``_read.store.OutputFiles``), over every block of filenames and rows, then what is checked
    as values are read; not when an array those checks read was already reported damaged."""
    read_by_open = ("/offsets", "/shapes", "/valid")
    if any(p.startswith(("index/", "lists/")) or p.endswith(read_by_open) for p in damaged):
        return []
    out: list[V.Problem] = []
    try:
        cache = ChunkCache(DEFAULT_CACHE_BYTES)
        files = OutputFiles(group, header if isinstance(header, dict) else {}, _found, False, cache, storage)
        steps: list[Callable[[], object]] = [lambda: list(files.filenames)]
        steps += [partial(files.checks.rows, r, r + 1) for r in range(LZ.ROW_BLOCK, files.n_rows, LZ.ROW_BLOCK)]
        for step in steps:
            try:
                step()
            except LZ.Found as exc:
                out.extend(exc.args[0])
        out = list(dict.fromkeys(files.checks.found + out))
        out = out or _value_problems(group, files.columns, files.list_offsets, damaged)
    except LZ.Found as exc:
        out = exc.args[0]
    except SpillMergeError as exc:  # an index array is absent or unreadable: nothing to check against
        return [str(exc)]
    return [f"{storage.describe(rel)}: {what}" for rel, what in out]


def _value_problems(
    group: Any, columns: dict[str, Any], list_offs: dict[tuple[str, ...], np.ndarray], damaged: set[str]
) -> list[V.Problem]:
    """What ``open`` checks of values as it reads them, each array whole: text valid UTF-8, list
    headers against their lists' offsets, lists of dicts against their keys."""
    out: list[V.Problem] = []
    heads = []
    for col in columns.values():
        c: V.StoredColumn = col.info
        readable = f"columns/{c.name}/values" not in damaged
        if c.dtype in ("pylist", "pytuple") and c.kind == "fixed":  # a list header
            valid = None if col.valid is None else np.asarray(col.valid, dtype=bool)
            lengths = np.asarray(V.read_array(col.values), dtype=np.int64) if readable else None
            heads.append((c, valid, lengths))
        if c.kind in V.STRING_KINDS and col.offsets is not None and readable:
            shapes = None if col.shapes is None else np.asarray(col.shapes)
            out.extend(V.text_problems(c, V.read_array(col.values), np.asarray(col.offsets), shapes))
    out.extend(L.header_problems(L.read_lists(group)[0], list_offs, heads))
    whole = {n: c.info for n, c in columns.items() if not any(d.startswith(f"columns/{n}/") for d in damaged)}
    out.extend(V.records_problems(whole))
    return out
