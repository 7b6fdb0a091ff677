"""A merge in parts shares the out-of-core plan's first step: each part sorts the runs of its share
of the segments and publishes them under ``OUT/spillmerge-parts/runs/``, and the other parts map
them instead of loading and sorting those segments themselves (docs/SCALE.md; docs/FORMAT.md
section 2.1).

Protocol (only for a merge in parts whose plan is built out of core, in ranges: ``_planranges``):

1. (every part) builds the runs of its own share (segment ``si``, write order, is part
   ``si % n``'s; ``_plan_disk.sort_run``) and :func:`publish` es each (:meth:`Published.built`):
   every array one object (a hard link to its work file where the file system allows),
   ``run.json`` last. A part run again takes its own published runs instead.
2. (every part, the finalize) takes the others, last first (:class:`Published`): a run with
   ``run.json`` is checked and mapped (page-cache maps locally, fetched into the plan's work
   folder from object stores); a run not there yet is built by the process itself (not
   published: its owner may be publishing it), so nobody waits for another part's run and the
   plan is the same whoever built each run.
3. (the finalize) removes the folder after the completion marker (:func:`remove`).

A published run is one of the merge's own objects, like the published plan: checked for what
would make the plan fail or read out of range (sizes, offsets, order, layouts, index ranges),
not against the spill root's catalog it was built from (docs/GUARANTEES.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import _format as F
from . import _format_spill as FS
from ._errors import SpillMergeError
from ._fetched import Fetches, prefetch
from ._parts import PARTS_DIR
from ._plan_disk import RUN_COLUMNS, DamagedRun, Run, RunSource, Sample, StringTable, WorkFolder
from ._planshare import put_array, read_array, removed_on_error
from ._spillroot import LoadedSegment, Segment, check_rows
from ._storage import Storage

RUNS_DIR = f"{PARTS_DIR}/runs"
RECORD_NAME = "run.json"
RECORD_MAX_BYTES = 64 << 20
"""``run.json`` holds the segment's layouts (not per-row data)."""
_KIND = "merge-run"

#: Object name of each array of a run (``Run`` field → name under the run's folder).
_OBJECTS = {"file": "file", "frame": "frame", "gl": "layout", "off": "offset", "nb": "nbytes", "crc": "crc"}


def folder(key: str, si: int) -> str:
    """The folder of segment ``si``'s run for the plan of source key ``key``."""
    return f"{RUNS_DIR}/{key}/{si:06d}"


def publish(output: Storage, rel: str, key: str, s: LoadedSegment, run: Run) -> int:
    """Write ``run`` (of segment ``s``) under ``rel``, ``run.json`` last; on an exception remove
    what was written (a run without ``run.json`` is never read). Returns how many arrays were
    hard links to the run's work files rather than copies."""
    linked = 0
    output.rm_tree(rel)  # a half-written run of an earlier attempt
    output.makedirs(rel)
    with removed_on_error(output, rel):

        def put(name: str, a: np.ndarray) -> None:
            nonlocal linked
            linked += put_array(output, f"{rel}/{name}", a)[1]  # a whole work file: linked where it can be

        data, offsets = run.names.raw()
        put("names", data)
        put("name_offsets", offsets)
        for field, name in _OBJECTS.items():
            put(name, getattr(run, field))
        checks = s.checks if s.checks is not None else np.zeros((0, FS.CHECK_COLUMNS), np.int64)
        put("checks", checks)
        record = {
            "kind": _KIND, "format_version": F.FORMAT_VERSION, "key": key, "segment": s.seg.rel,
            "layouts": [lay.to_obj() for lay in s.layouts], "n_files": len(run.names), "n_rows": len(run.file),
            "name_bytes": len(data), "n_checks": len(checks),
            "sample": run.sample.to_obj(),
        }  # fmt: skip
        output.put_atomic(f"{rel}/{RECORD_NAME}", F.dumps(record))
    return linked


def remove(output: Storage) -> None:
    """The finalize, after the completion marker (and a plan that found a run damaged): the runs
    are no longer needed."""
    output.rm_tree(RUNS_DIR)


class Published(RunSource):
    """(part ``part``) The runs the other parts published for the plan of ``key``. With
    ``share``, the runs this part builds of its own share are published too (a plan in ranges:
    every part needs every run, ``_planranges``)."""

    def __init__(
        self, output: Storage, key: str, segments: Sequence[Segment], parts: int, part: int = 0, *, share: bool = False,
        fetches: Fetches | None = None,
    ) -> None:  # fmt: skip
        self.output, self.key, self.segments, self.parts, self.part = output, key, segments, parts, part
        self.share = self.reuse = share
        self.linked = 0
        """Arrays of this part's runs published as hard links to its work files."""
        self._listed: dict[str, int] | None = None
        self._records: dict[int, bytes] = {}
        """Records GET ahead of their runs' take (:meth:`coming`)."""
        self.fetches = Fetches() if fetches is None else fetches
        """What was fetched of the runs taken (object stores: what the part reads of them)."""

    def elsewhere(self, si: int) -> bool:
        return si % self.parts != self.part

    def built(self, si: int, record: LoadedSegment, run: Run) -> None:
        rel = folder(self.key, si)
        # Only its own share: a run of another's share it had to build may be being published
        # by its owner now (``publish`` clears the folder first).
        if self.share and not self.elsewhere(si) and not self.output.exists(f"{rel}/{RECORD_NAME}"):
            self.linked += publish(self.output, rel, self.key, record, run)

    def coming(self, sis: Sequence[int]) -> None:
        """On an object store, the records of the runs of ``sis`` GET at once (16 at a time), not
        one after another as each is taken (~5,000 round trips a part at 10^9 keys). A record
        not there yet, or unreadable, is asked for again when its run is taken."""
        if self.output.local or len(sis) < 2:
            return

        def get(si: int) -> tuple[int, bytes | None]:
            try:
                return si, self.output.get_or_none(f"{folder(self.key, si)}/{RECORD_NAME}", max_bytes=RECORD_MAX_BYTES)
            except SpillMergeError:
                return si, None

        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="spillmerge-runs") as pool:
            self._records.update((si, raw) for si, raw in pool.map(get, sis) if raw is not None)

    def _sizes(self, rel: str) -> dict[str, int]:
        """The objects under run folder ``rel`` and their sizes. On an object store, from one
        listing of every run (taken once, a request per run fewer: 5,000 at 10^9 keys) when it
        holds this run's record (which is written last); else the run's own listing."""
        if not self.output.local:
            if self._listed is None:
                self._listed = dict(self.output.find(f"{RUNS_DIR}/{self.key}"))
            if f"{rel}/{RECORD_NAME}" in self._listed:
                return {k: v for k, v in self._listed.items() if k.startswith(f"{rel}/")}
        return dict(self.output.find(rel))

    def take(self, si: int, work: WorkFolder, tag: str) -> tuple[LoadedSegment, Run] | None:
        rel = folder(self.key, si)
        where = self.output.describe(rel)
        try:
            raw = self._records.pop(si, None)
            if raw is None:
                raw = self.output.get_or_none(f"{rel}/{RECORD_NAME}", max_bytes=RECORD_MAX_BYTES)
            if raw is None:
                return None
            m = F.loads(raw, path=where)
            sizes = self._sizes(rel)
            return _load(self.output, rel, m, self.segments[si], self.key, work, tag, self.fetches, sizes)
        except DamagedRun:
            raise
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, OSError, SpillMergeError) as exc:
            # Unreadable (not a file, a link, too large, torn) or malformed: the spill root decides.
            raise DamagedRun(f"{where}: unusable published run ({type(exc).__name__}: {exc})", path=where) from exc


def _load(
    output: Storage, rel: str, m: Any, seg: Segment, key: str, work: WorkFolder, tag: str, fetches: Fetches,
    sizes: dict[str, int],
) -> tuple[LoadedSegment, Run]:  # fmt: skip
    where = output.describe(rel)

    def bad(why: str, *_: Any) -> DamagedRun:
        return DamagedRun(f"{where}: {why}", path=where)

    commit = seg.commit
    assert commit is not None
    if not isinstance(m, dict) or m.get("kind") != _KIND or m.get("format_version") != F.FORMAT_VERSION:
        raise bad("not a merge run of this format version")
    if m.get("key") != key or m.get("segment") != seg.rel:
        raise bad(f"is not the run of segment {seg.rel!r} for this plan")
    n_files, n_rows, n_checks, name_bytes = (int(m[k]) for k in ("n_files", "n_rows", "n_checks", "name_bytes"))
    if (n_files, n_rows, n_checks) != (commit.n_files, commit.n_rows, commit.n_checks):
        raise bad("its counts disagree with the segment's commit record")
    if not 0 <= name_bytes <= FS.catalog_max_bytes(commit.n_files, commit.n_rows):
        raise bad(f"its names cannot hold {name_bytes} bytes")
    if not isinstance(m["layouts"], list):
        raise bad("its layouts are not a list")
    layouts = [FS.Layout.from_obj(o, path=where) for o in m["layouts"]]

    def arr(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        obj = f"{rel}/{name}"
        return read_array(output, obj, dtype, shape, sizes.get(obj), None if output.local else work, bad, fetches)

    sample = Sample.from_obj(m["sample"], n_files, n_rows)
    names, noff = arr("names", "|u1", (name_bytes,)), arr("name_offsets", "<i8", (n_files + 1,))
    cols = {field: arr(name, "<i8", (n_rows,)) for field, name in _OBJECTS.items()}
    checks = arr("checks", "<i8", (n_checks, FS.CHECK_COLUMNS))
    prefetch([(noff, 0, 1), (noff, n_files, n_files + 1), (checks, 0, n_checks)])  # one round trip
    if noff[0] != 0 or noff[-1] != name_bytes:  # the lengths between: each range's planner, for its span
        raise bad("its name offsets are out of order or out of range")
    check_rows(bad, n_files, layouts, [c[:0] for c in (cols[f] for f in RUN_COLUMNS)], commit.nbytes, checks,
               commit.chunk_bytes)  # fmt: skip

    def check_span(na: int, nb: int, ea: int, eb: int) -> None:
        """What a range of the plan reads of the run: names ``na .. nb-1`` valid UTF-8 as a whole,
        none starting inside a character (so is every name), and the range checks of entries
        ``ea .. eb-1``, ordered by filename and naming only names ``na .. nb-1``. Each range's
        planner checks its own spans (O(rows / parts) per part). The ranges' spans follow each
        other (one range's end is the next one's start, the same search), the first starts at
        entry 0 and the last ends at the last: checked by every range, the run is ordered."""
        file = np.asarray(cols["file"][ea:eb])
        off = np.asarray(noff[na : nb + 1])
        lens = np.diff(off)
        if len(lens) and (lens.min() < 0 or lens.max() > sample.width):
            raise bad("its name offsets are out of order, or a name is longer than its record says")
        if (
            not 0 <= na <= nb <= n_files
            or not 0 <= ea <= eb <= n_rows
            or (na == 0 and ea != 0)
            or (nb == n_files and eb != n_rows)
            or (len(file) and (np.any(np.diff(file) < 0) or file[0] < na or file[-1] >= nb))
        ):
            raise bad("its entries are not ordered by filename, or name a filename it does not have")
        try:
            bytes(names[int(noff[na]) : int(noff[nb])]).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise bad(f"its names are not UTF-8 ({exc})") from None
        starts = off[:-1][lens > 0]
        if len(starts) and np.any((names[starts] & 0xC0) == 0x80):
            raise bad("a name starts inside a UTF-8 character")
        # The sampled entries of the span: the record's sample is the run's (the splitters and
        # every range's searches read it in place of the run).
        k = np.arange(-(-ea // sample.step), -(-eb // sample.step), dtype=np.int64)
        if len(k) and not np.array_equal(file[k * sample.step - ea], sample.files[k]):
            raise bad("its record's sample is not its entries'")
        s_off = np.concatenate([[0], np.cumsum(sample.lens)])
        for j in k.tolist():
            f = int(sample.files[j])
            got = np.asarray(names[int(noff[f]) : int(noff[f + 1])])
            if not np.array_equal(got, sample.raw[s_off[j] : s_off[j + 1]]):
                raise bad("its record's sample is not its names'")
        span = [file if f == "file" else np.asarray(cols[f][ea:eb]) for f in RUN_COLUMNS]
        check_rows(bad, n_files, layouts, span, commit.nbytes, checks, commit.chunk_bytes)

    record = LoadedSegment(
        seg, [], layouts, np.zeros((0, FS.INDEX_COLUMNS), np.int64), commit.chunk_bytes,
        checks=np.asarray(checks) if n_checks else None,
    )  # fmt: skip
    gmap = work.zeros(f"{tag}.gmap", np.int64, (n_files,))
    file, frame, gl, off, nb, crc = (cols[f] for f in RUN_COLUMNS)
    return record, Run(StringTable(names, noff), file, frame, gl, off, nb, crc, gmap, sample, where, check_span)
