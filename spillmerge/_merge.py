"""merge(): barrier → validate → plan → bulk-create output → copy stripes → consolidate → marker."""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import fsspec
import google_crc32c
import numpy as np
import zarr
from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata

from . import _codecs, _parts
from . import _format as F
from ._coverage import _runs, read_manifest
from ._errors import (
    CorruptSpillError,
    MissingPartsError,
    OutputExistsError,
    SpillStorageError,
    SpillValueError,
)
from ._plan import FilePlan, Plan, build, fingerprint, split
from ._spillroot import load_all, load_flushed, same_bytes, wait_for_commits
from ._storage import Storage
from ._writer import _array_meta

DEFAULT_MEMORY_BUDGET = 256 << 20


@dataclass(frozen=True, slots=True)
class MergeReport:
    """What a merge did."""

    out: str
    """Output path or URL."""
    n_files: int
    """Filenames (arrays or groups under ``files/``) written."""
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
    """Duplicate (filename, frame) copies dropped (identical content, or by the duplicate policy)."""
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
    ``dst``); its counts are the part's. None for a whole merge or a finalize."""
    codec: str = "none"
    """Output codec of the arrays under ``files/``."""
    transferred: dict[int, int] = field(default_factory=dict)
    """Rank → shard bytes moved to the merging rank over torch.distributed (node-local roots)."""
    transfer_senders: dict[int, list[int]] = field(default_factory=dict)
    """Sending rank → the ranks whose shards it moved (one sender per group sharing a disk)."""

    @property
    def filenames(self) -> int:  # the contract's name for the count
        return self.n_files

    @property
    def frames(self) -> int:
        return self.n_frames

    def __str__(self) -> str:
        gib = self.nbytes / (1 << 30)
        s = (
            (f"part {self.part}/{self.parts}: " if self.part is not None else "")
            + f"merged {self.n_files} files, {self.n_frames} frames, {gib:.3f} GiB from "
            f"{len(self.ranks)} ranks ({self.segments} segments) into {self.out}"
            + (f" in {self.parts} parts" if self.part is None and self.parts > 1 else "")
            + (f" with {self.codec}" if self.codec != "none" else "")
            + f" in {self.seconds:.2f} s "
            f"(wait {self.wait_seconds:.2f} s, merge {self.merge_seconds:.2f} s)"
        )
        if self.transferred:
            moved = sum(self.transferred.values()) / (1 << 30)
            s += f"; {moved:.3f} GiB of ranks {sorted(self.transferred)} moved over torch.distributed first"
        s += "".join(f"; {n}" for n in self.notes if n.startswith("part "))
        if self.duplicates:
            s += f"; {self.duplicates} duplicate frame copies dropped"
        if self.missing_ranks:
            s += f"; PARTIAL: ranks {self.missing_ranks} missing"
            if self.salvaged_frames:
                s += f" (salvaged from their flushed chunks: {self.salvaged_frames} frames by rank)"
        if self.frame_gaps:
            s += self._gaps_text()
        elif self.expected_files is not None:
            s += f"; every frame of the {self.expected_files} expected files is present"
        if self.missing_ranks:
            s += "".join(f"\n  note: {n}" for n in self.notes if not n.startswith("part "))
            if self.expected_files is None:
                s += (
                    "\n  (frames after a file's last merged frame, and files only the missing ranks held, "
                    "are not listed: pass expected= / --expected MANIFEST.csv to check against the counts)"
                )
        return s

    def _gaps_text(self, files: int = 20, chars: int = 160) -> str:
        n = sum(len(v) for v in self.frame_gaps.values())
        against = "against the expected counts" if self.expected_files is not None else "below each file's last frame"
        s = f"; {n} frame(s) missing in {len(self.frame_gaps)} file(s) {against}:"
        for name in sorted(self.frame_gaps)[:files]:
            runs = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b, _ in _runs(np.asarray(self.frame_gaps[name])))
            s += f"\n  {name!r}: frames {runs if len(runs) <= chars else runs[:chars] + ' ...'}"
        if len(self.frame_gaps) > files:
            s += f"\n  ... and {len(self.frame_gaps) - files} more file(s) (MergeReport.frame_gaps lists them all)"
        return s


def _contains(a: Storage, b: Storage) -> bool:
    """True when one storage path lies inside (or equals) the other on the same filesystem."""
    if type(a.fs) is not type(b.fs):
        return False
    pa, pb = a.root.rstrip("/") + "/", b.root.rstrip("/") + "/"
    return pa.startswith(pb) or pb.startswith(pa)


def _prepare_output(dst: Storage, overwrite: bool) -> None:
    if not dst.exists("") or not dst.listdir(""):
        return
    if not _is_ours(dst):
        raise _not_ours(dst)
    if dst.exists(F.COMPLETE_NAME) and not overwrite:
        raise OutputExistsError(
            f"{dst.describe()} already holds a complete merge; pass overwrite=True (--overwrite) to replace it",
            path=dst.describe(),
        )
    # An interrupted merge (no completion marker) or an explicit overwrite: start from scratch.
    dst.rm_tree("")


def merge(
    root: str,
    out: str,
    *,
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
    world_size: int | None = None,
    run_id: str | None = None,
    timeout: float = 0.0,
    allow_partial: bool = False,
    on_duplicate: str = "error",
    overwrite: bool = False,
    chunk_bytes: int = F.DEFAULT_CHUNK_BYTES,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    threads: int | None = None,
    fsync: bool = True,
    progress: bool | None = None,
    codec: str = "none",
    part: tuple[int, int] | None = None,
    finalize: bool = False,
    expected: Mapping[str, int] | str | None = None,
) -> MergeReport:
    """Merge every committed segment under ``root`` into one Zarr v3 store at ``out``.

    Waits up to ``timeout`` seconds for missing commit records (0: check once), failing at once
    when a rank recorded a failure. ``allow_partial`` merges what is committed and reports the
    missing ranks. Memory stays under about ``memory_budget`` bytes whatever the payload (plus one
    frame when a single frame is larger). ``codec`` compresses the output arrays: ``"none"``
    (default: raw bytes), ``"blosc-lz4"`` or ``"zstd"``. Returns a :class:`MergeReport`.

    Scale-out over independent processes (SLURM array tasks; no torch.distributed needed):
    ``part=(i, n)`` writes only part ``i`` of ``n`` — the arrays of the files a deterministic
    split by bytes gives it — and then its part record; once all ``n`` parts ran, one call with
    ``finalize=True`` checks that every part is present and was planned identically (waiting up
    to ``timeout`` seconds for missing parts), then writes the index, the consolidated metadata
    and the completion marker. Every call needs the same spill root and planning options
    (``world_size``, ``run_id``, ``allow_partial``, ``on_duplicate``); the parts also need the same
    ``codec`` and ``chunk_bytes``, which finalize takes from their records.

    ``expected`` (a mapping filename → frame count, or the path of a ``filename,n_frames`` CSV
    manifest) checks the output against the frames the job should have produced: every frame
    ``0 .. count-1`` that is absent is listed in :attr:`MergeReport.frame_gaps`, files no rank
    wrote included. It changes what is reported, never what is merged.
    """
    if part is not None and finalize:
        raise SpillValueError("pass either part=(i, n) or finalize=True, not both")
    if part is not None:
        part = _check_part(part)
    job = _Job.open(
        root, out, storage_options=storage_options, out_storage_options=out_storage_options,
        world_size=world_size, run_id=run_id, timeout=timeout, allow_partial=allow_partial,
        on_duplicate=on_duplicate, chunk_bytes=chunk_bytes, memory_budget=memory_budget, threads=threads,
        fsync=fsync, progress=progress, codec=codec, expected=expected,
    )  # fmt: skip
    try:
        if finalize:
            return _finalize(job, None, timeout, overwrite)
        if part is not None:
            return _merge_part(job, part, overwrite, rank=None)
        return _merge_whole(job, overwrite)
    finally:
        job.src.close()


def merge_collective(
    root: str, out: str, *, rank: int, world_size: int, dst: int, run_id: str | None, timeout: float,
    overwrite: bool = False, **kwargs: Any,
) -> MergeReport | None:  # fmt: skip
    """``SpillWriter.merge(parallel=True)``: every rank writes part ``rank`` of ``world_size``;
    rank ``dst`` then waits on storage (not on a collective) for every part record, up to
    ``timeout`` seconds, and finalizes. Returns the report on ``dst``, None elsewhere."""
    for key in ("part", "finalize"):
        if key in kwargs:
            raise SpillValueError(f"{key}= cannot be combined with parallel=True (every rank is one part)")
    if rank != dst:
        kwargs.setdefault("progress", False)  # one progress bar per job, not one per rank
    job = _Job.open(root, out, world_size=world_size, run_id=run_id, timeout=timeout, **kwargs)
    try:
        _merge_part(job, (rank, world_size), overwrite, rank=rank)
        if rank != dst:
            return None
        return _finalize(job, world_size, timeout, overwrite, collective=True)
    finally:
        job.src.close()


def _check_part(part: Any) -> tuple[int, int]:
    ok = isinstance(part, (tuple, list)) and len(part) == 2
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in part)
    if not ok or not (part[1] >= 1 and 0 <= part[0] < part[1]):
        raise SpillValueError(f"part must be (i, n) with 0 <= i < n, got {part!r}")
    return int(part[0]), int(part[1])


@dataclass(slots=True)
class _Job:
    """One merge call: its storage, the plan every path works from, settings and timings."""

    src: Storage
    """The spill root."""
    dst: Storage
    """The output."""
    state: Any
    """``SpillState`` of the spill root after the barrier."""
    segments: list[Any]
    """Committed segments, in write order."""
    plan: Plan
    """The merge plan."""
    fingerprint: str
    """``_plan.fingerprint`` of the plan and the output settings."""
    chunk_bytes: int
    """Target output chunk size."""
    memory_budget: int
    """Bytes of stripes in flight."""
    threads: int
    """Copy threads."""
    fsync: bool
    """Flush to the device before records and markers vouch for the data."""
    progress: bool | None
    """Progress bar (None: on a terminal)."""
    codec: str
    """Output codec name."""
    allow_partial: bool
    """Merging without every rank's commit."""
    run_id: str | None
    """Run id the barrier waited for (None: newest segments)."""
    salvaged: dict[int, int]
    """Rank → frames salvaged from journals."""
    notes: list[str]
    """Report notes."""
    expected: dict[str, int] | None
    """Filename → expected frame count, for the report (None: not given)."""
    phases: dict[str, float]
    """Seconds per phase."""
    t0: float
    """perf_counter at the start of the call."""

    @classmethod
    def open(
        cls,
        root: str,
        out: str,
        *,
        storage_options: dict[str, Any] | None = None,
        out_storage_options: dict[str, Any] | None = None,
        world_size: int | None = None,
        run_id: str | None = None,
        timeout: float = 0.0,
        allow_partial: bool = False,
        on_duplicate: str = "error",
        chunk_bytes: int = F.DEFAULT_CHUNK_BYTES,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        threads: int | None = None,
        fsync: bool = True,
        progress: bool | None = None,
        codec: str = "none",
        expected: Mapping[str, int] | str | None = None,
    ) -> _Job:
        """Barrier → load → plan: everything before the first byte of output."""
        t0 = time.perf_counter()
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise SpillValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        codec = _codecs.check(codec)
        manifest = _check_expected(expected)
        src = Storage(root, storage_options)
        if out_storage_options is None:  # the same credentials serve both ends when they share a protocol
            same = fsspec.core.split_protocol(str(root))[0] == fsspec.core.split_protocol(str(out))[0]
            out_storage_options = storage_options if same else None
        dst = Storage(out, out_storage_options)
        if threads is None:  # object stores need many requests in flight; local disks do not
            threads = 4 if src.local and dst.local else 16
        if not isinstance(threads, int) or threads < 1:
            raise SpillValueError(f"threads must be a positive int, got {threads!r}")
        if not src.exists(""):
            raise SpillStorageError(f"spill root {src.describe()} does not exist", path=src.describe())
        if _contains(src, dst):
            raise SpillValueError(
                f"output {dst.describe()} and spill root {src.describe()} overlap; choose another --out"
            )
        state = wait_for_commits(
            src, world_size=world_size, run_id=run_id, timeout=timeout, allow_partial=allow_partial
        )
        phases: dict[str, float] = {"wait": time.perf_counter() - t0}
        # Write order for the duplicate policy: segment start time, rank breaking ties.
        segments = sorted(state.committed, key=lambda s: (F.segment_sort_key(s.name)[1], s.rank, s.name))
        t = time.perf_counter()
        loaded = load_all(src, segments)
        salvaged: dict[int, int] = {}
        notes: list[str] = []
        if allow_partial:
            # Uncommitted segments of missing or failed ranks: merge what their journal proves durable.
            for rank, seg in sorted(state.partial.items()):
                part, problems = load_flushed(src, seg)
                notes.extend(problems)
                if len(part.index):
                    loaded.append(part)
                    salvaged[rank] = len({(int(r[0]), int(r[1])) for r in part.index[:, :2]})
        phases["load"] = time.perf_counter() - t
        t = time.perf_counter()
        plan = build(loaded, on_duplicate, same_bytes=functools.partial(same_bytes, src))
        fp = fingerprint(plan, chunk_bytes=chunk_bytes, codec=codec)
        phases["plan"] = time.perf_counter() - t
        return cls(
            src, dst, state, segments, plan, fp, chunk_bytes, memory_budget, threads, fsync, progress, codec,
            allow_partial, run_id, salvaged, notes, manifest, phases, t0,
        )  # fmt: skip

    def report(self, *, files: list[FilePlan] | None = None, parts: int = 1, part: int | None = None) -> MergeReport:
        chosen = self.plan.files if files is None else files
        t_end = time.perf_counter()
        t_wait = self.phases["wait"]
        return MergeReport(
            out=self.dst.describe(),
            n_files=len(chosen),
            n_frames=sum(len(f.frames) for f in chosen),
            nbytes=sum(len(f.frames) * f.frame_nbytes for f in chosen),
            ranks=sorted({s.rank for s in self.segments}),
            segments=len(self.segments),
            seconds=t_end - self.t0,
            wait_seconds=t_wait,
            merge_seconds=t_end - self.t0 - t_wait,
            duplicates=self.plan.duplicates,
            missing_ranks=sorted([*self.state.missing, *self.state.failed]),
            abandoned_segments=[self.src.describe(s.rel) for s in self.state.abandoned],
            salvaged_frames=self.salvaged,
            frame_gaps=_gaps(chosen, self.expected, whole=part is None)
            if self.allow_partial or self.expected is not None
            else {},
            expected_files=None if self.expected is None else len(self.expected),
            notes=self.notes,
            phases=self.phases,
            parts=parts,
            part=part,
            codec=self.codec,
        )


def _merge_whole(job: _Job, overwrite: bool) -> MergeReport:
    """One process writes everything."""
    _prepare_output(job.dst, overwrite)
    try:
        t = time.perf_counter()
        docs = {**_shared_docs(job.plan, job.state.world_size), **_file_docs(job, job.plan.files)}
        # The root document goes first, alone: it marks the folder as a spillmerge output, so an
        # interrupted merge can be recognised and rebuilt.
        job.dst.makedirs("")
        job.dst.put("zarr.json", _json_doc(docs[""]))
        job.dst.put_many({f"{path}/zarr.json": _json_doc(doc) for path, doc in docs.items() if path})
        job.phases["metadata"] = time.perf_counter() - t
        t = time.perf_counter()
        _copy(job, job.plan.files)
        job.phases["copy"] = time.perf_counter() - t
        _write_index(job)
        _finish(job, docs)
    except BaseException:
        # The output is unusable without its completion marker anyway; removing it keeps the
        # next merge (or a reader) from seeing half a store.
        try:
            job.dst.rm_tree("")
        except Exception:  # noqa: BLE001
            pass
        raise
    return job.report()


def _merge_part(job: _Job, part: tuple[int, int], overwrite: bool, *, rank: int | None) -> MergeReport:
    """Part ``i`` of ``n``: the arrays of the files ``split`` gives it, then its part record.

    Touches nothing another part of the same plan owns: the shared nodes (index, groups,
    consolidated root, marker) are the finalizer's, and a part only ever deletes its own nodes,
    its own records, a completion marker (``overwrite``) and records of another plan
    (``overwrite``)."""
    i, n = part
    dst, fp = job.dst, job.fingerprint
    mine = [job.plan.files[k] for k in split(job.plan, n)[i]]
    name = _parts.describe(i, n, rank)
    _claim(dst, overwrite)
    records = _parts.scan(dst)
    if not overwrite and any(r.part == i and r.parts == n and r.plan == fp and not r.failed for r in records):
        # Done before (e.g. a requeued array task): the record vouches for data flushed before it.
        job.notes.append(f"{name} was already complete ({dst.describe(_parts.record_name(i, n))}); nothing rewritten")
        return job.report(files=mine, parts=n, part=i)
    foreign = _parts.foreign(records, n, fp)
    if foreign and not overwrite:
        raise _parts.mismatch_error(
            dst, foreign, n, fp, hint="rerun every part with overwrite=True (--overwrite), or choose another --out"
        )
    for r in foreign:  # overwrite: an older merge's records; its arrays are replaced or pruned at finalize
        _parts.remove(dst, r.part, r.parts, failed=False)
    _parts.remove(dst, i, n, failed=False)
    _parts.remove(dst, i, n, failed=True)  # a failure record of an earlier attempt of this part
    try:
        t = time.perf_counter()
        if not dst.exists("zarr.json"):  # marks the folder as ours before anything else lands in it
            dst.put_atomic("zarr.json", _json_doc(_shared_docs(job.plan, job.state.world_size)[""]))
        docs = _file_docs(job, mine)
        present = set(dst.listdir("files"))
        for fp_ in mine:  # an earlier attempt of this part (or an older merge) may have left chunks
            if fp_.key in present:
                dst.rm_tree(f"files/{fp_.key}")
        dst.put_many({f"{path}/zarr.json": _json_doc(doc) for path, doc in docs.items()})
        job.phases["metadata"] = time.perf_counter() - t
        t = time.perf_counter()
        _copy(job, mine)
        job.phases["copy"] = time.perf_counter() - t
        t = time.perf_counter()
        if job.fsync:  # the part record vouches for every chunk of the part
            dst.fsync_tree("")
        _parts.write_done(
            dst, i, n, fp, rank, job.run_id, n_files=len(mine), n_frames=sum(len(f.frames) for f in mine),
            nbytes=sum(len(f.frames) * f.frame_nbytes for f in mine), codec=job.codec, chunk_bytes=job.chunk_bytes,
        )  # fmt: skip
        job.phases["sync"] = time.perf_counter() - t
    except BaseException as exc:
        # Nothing is removed: other parts' work stays, and a rerun of this part replaces its own.
        _parts.write_failure(dst, i, n, fp, rank, job.run_id, exc)
        raise
    return job.report(files=mine, parts=n, part=i)


def _finalize(
    job: _Job, parts: int | None, timeout: float, overwrite: bool, *, collective: bool = False
) -> MergeReport:
    """After every part: check the part records (present, same plan), then index, consolidated
    metadata and completion marker — the same documents a one-process merge writes."""
    dst = job.dst
    if not _is_ours(dst):
        if dst.exists("") and dst.listdir(""):
            raise _not_ours(dst)
        raise MissingPartsError(
            f"{dst.describe()}: no parts found; run every part first (spillmerge merge ROOT --out OUT --part I/N)",
            path=dst.describe(),
            missing=[],
            parts=parts or 0,
        )
    complete = dst.exists(F.COMPLETE_NAME)
    if complete and not overwrite:
        raise OutputExistsError(
            f"{dst.describe()} already holds a complete merge; pass overwrite=True (--overwrite) to finalize it again",
            path=dst.describe(),
        )
    t = time.perf_counter()
    records = _parts.scan(dst)
    n = parts if parts is not None else _parts.infer_parts(dst, records)
    done = [r for r in records if not r.failed and r.parts == n]
    if not collective and done and done[0].codec is not None and done[0].chunk_bytes is not None:
        # The parts decided the array documents: finalize with their codec and chunk size rather
        # than make every caller repeat them (the fingerprint still catches parts that disagree).
        job.codec, job.chunk_bytes = done[0].codec, done[0].chunk_bytes
        job.fingerprint = fingerprint(job.plan, chunk_bytes=job.chunk_bytes, codec=job.codec)
    _parts.wait(
        dst, n, job.fingerprint, timeout=timeout, collective=collective, run_id=job.run_id if collective else None
    )
    job.phases["parts"] = time.perf_counter() - t
    t = time.perf_counter()
    if complete:
        dst.rm_tree(F.COMPLETE_NAME)
    keys = {f.key for f in job.plan.files}
    for name in dst.listdir("files"):
        if name not in keys and name != "zarr.json":  # left by an older merge into this output
            dst.rm_tree(f"files/{name}")
    shared = _shared_docs(job.plan, job.state.world_size)
    dst.put_many({f"{path}/zarr.json": _json_doc(doc) for path, doc in shared.items() if path})
    job.phases["metadata"] = job.phases.get("metadata", 0.0) + time.perf_counter() - t
    _write_index(job)
    _finish(job, {**shared, **_file_docs(job, job.plan.files)})
    return job.report(parts=n)


def _not_ours(dst: Storage) -> OutputExistsError:
    return OutputExistsError(
        f"{dst.describe()} exists and is not a spillmerge output; choose another --out "
        "(spillmerge never deletes a folder it did not write)",
        path=dst.describe(),
    )


def _is_ours(dst: Storage) -> bool:
    raw = dst.get_or_none("zarr.json", max_bytes=64 << 20)
    if raw is None:
        return dst.exists(_parts.PARTS_DIR)
    try:
        obj = F.loads(raw, path=dst.describe("zarr.json"))
        return bool(obj.get("attributes", {}).get("spillmerge", {}).get("kind") == "merged")
    except (CorruptSpillError, AttributeError):
        return False


def _claim(dst: Storage, overwrite: bool) -> None:
    """A part's ``_prepare_output``: the output must be empty or ours; never delete anything but
    the completion marker (``overwrite``), because other parts may be writing next to us."""
    if dst.exists(""):
        names = [x for x in dst.listdir("") if not x.startswith("zarr.json.tmp-")]  # a part claiming it now
        if names and not _is_ours(dst):
            raise _not_ours(dst)
        if dst.exists(F.COMPLETE_NAME):
            if not overwrite:
                raise OutputExistsError(
                    f"{dst.describe()} already holds a complete merge; pass overwrite=True (--overwrite) to "
                    "rebuild it (every part, then finalize)",
                    path=dst.describe(),
                )
            dst.rm_tree(F.COMPLETE_NAME)  # from here on the output is incomplete until finalized
    dst.makedirs("")


def _gaps(
    files: list[FilePlan], expected: dict[str, int] | None, *, whole: bool, limit: int = 10000
) -> dict[str, list[int]]:
    """Per filename, the frame indices absent: below the manifest's count when it lists the file,
    else between 0 and the highest frame merged. ``whole``: also the files only the manifest names
    (a part leaves those to the finalize). At most ``limit`` per file."""
    out: dict[str, list[int]] = {}
    for fp in files:
        span = expected.get(fp.filename) if expected is not None else None
        if span is None:
            span = int(fp.frames[-1]) + 1
        have = fp.frames[fp.frames < span]
        if len(have) != span:
            out[fp.filename] = _first_missing(have, span, limit)
    if expected is not None and whole:
        seen = {fp.filename for fp in files}
        for name, count in expected.items():
            if name not in seen and count > 0:
                out[name] = list(range(min(count, limit)))
    return out


def _first_missing(have: np.ndarray, span: int, limit: int) -> list[int]:
    """The first ``limit`` integers of ``0 .. span-1`` not in ``have`` (ascending, unique), without
    materialising ``span`` integers when it is huge."""
    out: list[int] = []
    start = 0
    for a, b, _ in _runs(have):
        out.extend(range(start, min(a, start + limit - len(out))))
        start = b + 1
        if len(out) >= limit:
            return out
    out.extend(range(start, min(span, start + limit - len(out))))
    return out


def _check_expected(expected: Mapping[str, int] | str | None) -> dict[str, int] | None:
    """``expected=``: a CSV manifest's path, or a mapping filename → non-negative frame count."""
    if expected is None:
        return None
    if isinstance(expected, (str, os.PathLike)):
        return read_manifest(os.fspath(expected))
    if not isinstance(expected, Mapping):
        raise SpillValueError(
            f"expected must be a mapping filename -> frame count or a CSV path, got {type(expected).__name__}"
        )
    out: dict[str, int] = {}
    for name, count in expected.items():
        if not isinstance(name, str) or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise SpillValueError(f"expected[{name!r}] must map a filename to a non-negative int, got {count!r}")
        out[name] = count
    return out


def _frames_per_chunk(fp: FilePlan, chunk_bytes: int) -> int:
    """Frames per output chunk: at most ``chunk_bytes`` worth, balanced over the chunks the file
    needs, so the last chunk is nearly full. Zarr stores every chunk at full size (an uncompressed
    edge chunk is zero-padded): with plain ``chunk_bytes // frame_bytes`` a 100-frame file of
    384 KiB frames in 16 MiB chunks would store 126 rows; balanced, it stores 102."""
    n = len(fp.frames)
    cap = int(max(1, min(n, chunk_bytes // max(fp.frame_nbytes, 1))))
    n_chunks = -(-n // cap)
    return -(-n // n_chunks)


def _shared_docs(plan: Plan, world_size: int) -> dict[str, dict[str, Any]]:
    """``zarr.json`` documents of the nodes every file shares: root (with the output header),
    ``files``, ``index`` and the index arrays — the finalizer's in a parallel merge."""
    header = {
        "format_version": F.FORMAT_VERSION,
        "kind": "merged",
        "n_files": len(plan.files),
        "n_frames": plan.n_frames,
        "nbytes": plan.total_bytes,
        "ranks": sorted({s.seg.rank for s in plan.segments}),
        "world_size": world_size,
        "segments": len(plan.segments),
        "created": F.utcnow(),
    }
    nodes: dict[str, Any] = {
        "": GroupMetadata(attributes={"spillmerge": header}),
        "files": GroupMetadata(),
        "index": GroupMetadata(),
    }
    n = len(plan.files)
    total_frames = plan.n_frames
    str_meta: dict[str, Any] = {
        "zarr_format": 3, "node_type": "array", "shape": [n], "data_type": "string",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(n, 1)]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": "", "codecs": [{"name": "vlen-utf8"}, {"name": "crc32c"}], "attributes": {},
    }  # fmt: skip
    row_chunks = (max(1, min(total_frames, 1 << 21)),)
    index_meta = {
        "filenames": {**str_meta, "dimension_names": ["file"]},
        "keys": {**str_meta, "dimension_names": ["file"]},
        "frame_offsets": {**_array_meta((n + 1,), (n + 1,), "int64", crc=True), "dimension_names": ["file_edge"]},
        "frame_idx": {**_array_meta((total_frames,), row_chunks, "int64", crc=True), "dimension_names": ["row"]},
        # Provenance per output row, for coverage reports (`spillmerge inspect --plot`): the rank whose
        # segment the row came from, and how many segments held that frame (>1: a duplicate was dropped).
        "frame_rank": {**_array_meta((total_frames,), row_chunks, "int32", crc=True), "dimension_names": ["row"]},
        "frame_copies": {**_array_meta((total_frames,), row_chunks, "int32", crc=True), "dimension_names": ["row"]},
    }
    for name, meta in index_meta.items():
        nodes[f"index/{name}"] = ArrayV3Metadata.from_dict(meta)
    return {path: node.to_dict() for path, node in nodes.items()}


def _file_docs(job: _Job, files: list[FilePlan]) -> dict[str, dict[str, Any]]:
    """``zarr.json`` documents of the nodes of ``files`` (arrays, and groups of dict values),
    normalised by zarr's own metadata classes so the consolidated root matches zarr's."""
    nodes: dict[str, Any] = {}
    for fp in files:
        k = _frames_per_chunk(fp, job.chunk_bytes)
        if fp.is_dict:
            nodes[f"files/{fp.key}"] = GroupMetadata(
                attributes={"spillmerge": {"filename": fp.filename, "file_index": fp.index}}
            )
        for leaf in fp.leaves:
            lay = leaf.layout
            dt = F.DTYPES[lay.dtype]
            attrs = {
                "spillmerge": {
                    "filename": fp.filename,
                    "file_index": fp.index,
                    "leaf": list(lay.leaf),
                    "dtype": lay.dtype,
                }
            }
            meta = _array_meta(
                (len(fp.frames), *lay.shape),
                (k, *(max(d, 1) for d in lay.shape)),
                dt.storage,
                crc=True,
                attributes=attrs,
            )
            meta = _codecs.with_codec(meta, job.codec, np.dtype(dt.storage).itemsize)
            # dimension_names (xarray needs them): unique per array within its group, "frame"
            # shared by the leaves of one dict value (same length); docs/FORMAT.md.
            rel = leaf.node.removeprefix(f"files/{fp.key}").strip("/").replace("/", ".")
            name = rel if fp.is_dict else fp.key
            meta["dimension_names"] = ["frame" if fp.is_dict else f"{name}.frame"] + [
                f"{name}.dim_{d}" for d in range(1, len(lay.shape) + 1)
            ]
            nodes[leaf.node] = ArrayV3Metadata.from_dict(meta)
            parent = leaf.node.rsplit("/", 1)[0]
            while parent != "files" and parent not in nodes:  # groups of nested dict levels
                nodes[parent] = GroupMetadata()
                parent = parent.rsplit("/", 1)[0]
    # Every node's zarr.json is built here and written in one concurrent batch; the consolidated
    # metadata is assembled from the same documents, so nothing is read back (zarr's own
    # create_hierarchy / consolidate_metadata cost one or more requests per node: 16 s + 6 s for
    # 1,000 files on a local S3 server).
    return {path: node.to_dict() for path, node in nodes.items()}


def _write_index(job: _Job) -> None:
    t = time.perf_counter()
    plan = job.plan
    n = len(plan.files)
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(f.frames) for f in plan.files])
    store = job.dst.zarr_store()
    # write_empty_chunks: an index chunk that happens to be all zeros must still exist on disk
    # (verify treats a missing chunk as damage).
    with zarr.config.set({"array.write_empty_chunks": True}):
        index = zarr.open_group(store, mode="r+", use_consolidated=False)["index"]
        if n:
            index["filenames"][:] = np.array([f.filename for f in plan.files], dtype=object)  # type: ignore[index]
            index["keys"][:] = np.array([f.key for f in plan.files], dtype=object)  # type: ignore[index]
        index["frame_offsets"][:] = offsets  # type: ignore[index]
        if plan.n_frames:
            index["frame_idx"][:] = np.concatenate([f.frames for f in plan.files])  # type: ignore[index]
            seg_rank = np.array([s.seg.rank for s in plan.segments], dtype=np.int32)
            rows = np.concatenate([f.leaves[0].rows for f in plan.files])
            index["frame_rank"][:] = seg_rank[plan.seg[rows]]  # type: ignore[index]
            index["frame_copies"][:] = plan.copies[rows].astype(np.int32)  # type: ignore[index]
    job.phases["index"] = time.perf_counter() - t


def _finish(job: _Job, docs: dict[str, dict[str, Any]]) -> None:
    """Flush, then the consolidated root, then the completion marker: last, once."""
    dst, plan = job.dst, job.plan
    root = dict(docs[""])
    root["consolidated_metadata"] = {
        "kind": "inline",
        "must_understand": False,
        "metadata": {path: _consolidated_entry(doc) for path, doc in sorted(docs.items()) if path},
    }
    t = time.perf_counter()
    if job.fsync:  # every chunk and document is durable before the root and the marker vouch for them
        dst.fsync_tree("")
    job.phases["sync"] = job.phases.get("sync", 0.0) + time.perf_counter() - t
    t = time.perf_counter()
    dst.put_atomic("zarr.json", _json_doc(root))
    marker = {
        "format_version": F.FORMAT_VERSION,
        "kind": "merge-complete",
        "n_files": len(plan.files),
        "n_frames": plan.n_frames,
        "nbytes": plan.total_bytes,
        "finished": F.utcnow(),
    }
    dst.put_atomic(F.COMPLETE_NAME, F.dumps(marker))
    job.phases["finish"] = time.perf_counter() - t


def _json_doc(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _consolidated_entry(doc: dict[str, Any]) -> dict[str, Any]:
    # zarr-python writes child groups into the inline consolidated metadata with an empty
    # consolidated block of their own; mirror it so reading never falls back to listing.
    if doc.get("node_type") == "group":
        return {**doc, "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {}}}
    return doc


@dataclass(slots=True)
class _Stripe:
    """The frames ``[start, stop)`` of one file: one chunk of each of its arrays."""

    file: FilePlan
    """The file."""
    chunk: int
    """Chunk number along the frame axis."""
    start: int
    """First output row."""
    stop: int
    """One past the last output row."""
    k: int
    """Frames per chunk of this file's arrays."""

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.file.frame_nbytes


def _stripes(files: list[FilePlan], chunk_bytes: int) -> list[_Stripe]:
    out = []
    for fp in files:
        k = _frames_per_chunk(fp, chunk_bytes)
        for j, a in enumerate(range(0, len(fp.frames), k)):
            out.append(_Stripe(fp, j, a, min(a + k, len(fp.frames)), k))
    return out


def _done_cb(done: Any, size: int, fut: Future[None]) -> None:
    done(fut, size)


def _copy(job: _Job, files: list[FilePlan]) -> None:
    """Copy the frames of ``files`` into their output chunks, ``job.memory_budget`` bytes in flight."""
    src, dst, plan, budget = job.src, job.dst, job.plan, job.memory_budget
    stripes = _stripes(files, job.chunk_bytes)
    show = sys.stderr.isatty() if job.progress is None else job.progress
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=sum(s.nbytes for s in stripes),
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="merge",
            file=sys.stderr,
        )
    cond = threading.Condition()
    in_flight = 0
    errors: list[BaseException] = []

    def done(fut: Future[None], size: int) -> None:
        nonlocal in_flight
        with cond:
            in_flight -= size
            exc = fut.exception()
            if exc is not None:
                errors.append(exc)
            cond.notify_all()
        if bar is not None and exc is None:
            bar.update(size)

    try:
        with ThreadPoolExecutor(max_workers=job.threads, thread_name_prefix="spillmerge-merge") as pool:
            for stripe in stripes:
                size = stripe.nbytes
                with cond:
                    # Bounded memory: wait until this stripe fits in the budget (one stripe always may run).
                    while in_flight and in_flight + size > budget and not errors:
                        cond.wait()
                    if errors:
                        break
                    in_flight += size
                fut = pool.submit(_copy_stripe, src, dst, plan, stripe, job.codec)
                fut.add_done_callback(functools.partial(_done_cb, done, size))
    finally:
        if bar is not None:
            bar.close()
    if errors:
        raise errors[0]


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread buffer reused across stripes. Fresh allocations of this size are mmapped and
    page-faulted anew each time; on the VMs we measured that tripled the merge's CPU time."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


def _copy_stripe(src: Storage, dst: Storage, plan: Plan, stripe: _Stripe, codec: str) -> None:
    for leaf in stripe.file.leaves:
        rows = leaf.rows[stripe.start : stripe.stop]
        item = leaf.layout.nbytes
        if item == 0:  # zero-size frames: the array has no elements, so no chunk to write
            continue
        full = stripe.k * item  # the last chunk of an array is padded to the chunk shape
        used = len(rows) * item
        key = f"{leaf.node}/c/{stripe.chunk}" + "/0" * len(leaf.layout.shape)
        enc = _codecs.encoder(codec, np.dtype(F.DTYPES[leaf.layout.dtype].storage).itemsize)
        if src.local and enc is None:
            # Frames are written straight from the page cache (mmap), never copied into our memory.
            parts: list[Any] = []
            for j, r in enumerate(rows.tolist()):
                views = [src.view(rel, lo, hi) for rel, lo, hi in _pieces(plan, rows[j : j + 1])]
                got = 0
                for v in views:
                    got = google_crc32c.extend(got, v)
                if got != int(plan.crc[r]):
                    _raise_mismatch(src, plan, stripe, leaf, j, r)
                parts.extend(views)
            if used < full:
                parts.append(_zeros(full - used))
        else:
            # A compressor needs the whole chunk in one buffer: one copy into a reused one.
            buf = _scratch(full if enc is not None else used)
            if src.local:
                pos = 0
                for j, r in enumerate(rows.tolist()):
                    got = 0
                    for rel, lo, hi in _pieces(plan, rows[j : j + 1]):
                        v = src.view(rel, lo, hi)
                        got = google_crc32c.extend(got, v)
                        buf[pos : pos + hi - lo] = np.frombuffer(v, dtype=np.uint8)
                        pos += hi - lo
                    if got != int(plan.crc[r]):
                        _raise_mismatch(src, plan, stripe, leaf, j, r)
            else:
                src.read_into(_pieces(plan, rows), buf[:used].data)
                for j, r in enumerate(rows.tolist()):
                    if google_crc32c.value(buf[j * item : (j + 1) * item]) != int(plan.crc[r]):
                        _raise_mismatch(src, plan, stripe, leaf, j, r)
            if enc is not None:
                buf[used:full] = 0
                parts = [np.frombuffer(enc.encode(buf[:full]), dtype=np.uint8)]
            else:
                parts = [buf[:used]] + ([_zeros(full - used)] if used < full else [])
        out_crc = 0
        for part in parts:
            out_crc = google_crc32c.extend(out_crc, part)
        dst.makedirs(key.rsplit("/", 1)[0])
        dst.put(key, [*parts, np.uint32(out_crc).astype("<u4").tobytes()])


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.uint8)


def _raise_mismatch(src: Storage, plan: Plan, stripe: _Stripe, leaf: Any, j: int, r: int) -> None:
    seg = plan.segments[int(plan.seg[r])]
    where = src.describe(f"{seg.seg.rel}/{F.DATA_NAME}")
    raise CorruptSpillError(
        f"{where}: checksum mismatch for {stripe.file.filename!r:.200} frame "
        f"{int(stripe.file.frames[stripe.start + j])} leaf {leaf.layout.leaf_name()!r} at bytes "
        f"{int(plan.offset[r])}..{int(plan.offset[r] + plan.nbytes[r])} (rank {seg.seg.rank}): "
        "the spill is corrupt; run `spillmerge verify` on the root",
        path=where,
        rank=seg.seg.rank,
    )


def _pieces(plan: Plan, rows: np.ndarray) -> list[tuple[str, int, int]]:
    """Byte ranges of ``rows`` in their data chunk objects, adjacent ranges coalesced."""
    out: list[tuple[str, int, int]] = []
    for r in rows.tolist():
        seg = plan.segments[int(plan.seg[r])]
        cb = seg.chunk_bytes
        off, end = int(plan.offset[r]), int(plan.offset[r] + plan.nbytes[r])
        while off < end:
            c = off // cb
            stop = min(end, (c + 1) * cb)
            rel = f"{seg.seg.rel}/{F.DATA_NAME}/c/{c}"
            lo, hi = off - c * cb, stop - c * cb
            if out and out[-1][0] == rel and out[-1][2] == lo:
                out[-1] = (rel, out[-1][1], hi)
            else:
                out.append((rel, lo, hi))
            off = stop
    return out


def committed_keys(root: str, storage_options: dict[str, Any] | None = None) -> dict[str, set[int]]:
    """Filename → frame indices already committed under a spill root, by any rank and session.

    A rerun after a crash can skip these keys; the merge unions all sessions."""
    from ._spillroot import committed_keys as _keys

    storage = Storage(root, storage_options)
    if not storage.exists(""):
        return {}
    return _keys(storage)
