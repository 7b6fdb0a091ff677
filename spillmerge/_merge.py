"""merge(): barrier → validate → plan → bulk-create output → copy stripes → consolidate → marker."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import fsspec

from . import _codecs, _indexchunks, _lease, _output, _parts, _plan_disk, _planranges, _planruns, _planshare
from . import _format as F
from . import _format_output as FO
from . import _format_spill as FS
from . import _zarrmeta as Z
from ._copy import Unit, copy_units, units
from ._errors import (
    CorruptSpillError,
    MissingPartsError,
    OutputBusyError,
    SpillMergeError,
    SpillStorageError,
    SpillValueError,
)
from ._frames import check_expected
from ._options import DEFAULT_MEMORY_BUDGET, DEFAULT_PLAN_BUDGET, MergeOptions
from ._plan import Plan, build, fingerprint, split
from ._removal import plan_lookup, remove_merged
from ._report import MergeReport, gaps
from ._spillroot import load_all, load_flushed, load_segment, same_bytes, wait_for_commits
from ._storage import Storage


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
    plan_budget: int = DEFAULT_PLAN_BUDGET,
    plan_dir: str | None = None,
    threads: int | None = None,
    fsync: bool = True,
    progress: bool | None = None,
    codec: str = "none",
    part: tuple[int, int] | None = None,
    finalize: bool = False,
    expected: Mapping[str, int] | str | None = None,
    session: int | None = None,
    remove_spill: bool = False,
) -> MergeReport:
    """Merge every committed segment under ``root`` into one Zarr v3 store at ``out``.

    Waits up to ``timeout`` seconds for missing commit records (0: check once), failing at once
    when a rank recorded a failure. ``allow_partial`` merges what is committed and reports the
    missing ranks. Memory stays under about ``memory_budget`` bytes of output chunks whatever the
    payload (plus one frame when a single frame is larger) and ``plan_budget`` bytes of plan
    whatever the number of rows and files: a larger plan is built out of core, in temporary files
    under ``plan_dir`` (default: the system's temporary folder) removed when the merge ends
    (docs/SCALE.md; plus one segment's catalog and index at a time). ``codec`` compresses the output arrays: ``"none"``
    (default: raw bytes), ``"blosc-lz4"`` or ``"zstd"``. Returns a :class:`MergeReport`.

    Scale-out over independent processes (SLURM array tasks; no torch.distributed needed):
    ``part=(i, n)`` writes only part ``i`` of ``n`` — the output chunks a deterministic split
    by bytes gives it — and then its part record; once all ``n`` parts ran, one call with
    ``finalize=True`` checks that every part is present and was planned identically (waiting up
    to ``timeout`` seconds for missing parts), then writes the index, the consolidated metadata
    and the completion marker. Part 0 publishes its plan in the output; the other parts and the
    finalize wait up to ``timeout`` seconds for it and map it instead of planning again (no plan
    by then: they plan themselves). With ``timeout=0`` a part waits while part 0 is at work on
    the plan (it holds its lease from the start) and plans itself at once when part 0 is not
    running. Every call needs the same spill root and planning options
    (``world_size``, ``run_id``, ``allow_partial``, ``on_duplicate``); the parts also need the same
    ``codec`` and ``chunk_bytes``, which finalize takes from their records.

    ``expected`` (a mapping filename → frame count, or the path of a ``filename,n_frames`` CSV
    manifest) checks the output against the frames the job should have produced: every frame
    ``0 .. count-1`` that is absent is listed in :attr:`MergeReport.frame_gaps`, files no rank
    wrote included. It changes what is reported, never what is merged.

    ``remove_spill=True`` deletes exactly the segments the output was merged from once the
    output is complete (its completion marker written, every row's checksum checked while
    copying) and nothing is missing: no missing rank, no frame missing against ``expected`` (or,
    with ``allow_partial``, at all); otherwise nothing is deleted. A segment committed after the
    plan was made stays, and so does an uncommitted one unless it ended (failed, or a later
    session of its rank was merged) and the output holds every frame of its journal; rank
    folders and the root go only when left empty. :attr:`MergeReport.removed_segments` and
    :attr:`MergeReport.kept_segments` (with the reason) say what went and what stayed. A part
    (``part=(i, n)``) never removes anything; the finalize does. A failed or interrupted merge
    raises before this point.
    """
    # Every keyword parameter, by name: a test keeps them and MergeOptions' fields the same.
    options = MergeOptions(**{k: v for k, v in locals().items() if k not in ("root", "out")})
    if part is not None and finalize:
        raise SpillValueError("pass either part=(i, n) or finalize=True, not both")
    if part is not None:
        options = replace(options, part=_check_part(part))
    job = _Job.open(root, out, options, part=options.part, finalize=finalize)
    try:
        if finalize:
            return _remove_spill(job, _finalize(job, None))
        if options.part is not None:
            return _merge_part(job, options.part, rank=None)
        return _remove_spill(job, _merge_whole(job))
    finally:
        job.close()


def merge_parallel(
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
    options = MergeOptions(world_size=world_size, run_id=run_id, timeout=timeout, overwrite=overwrite, **kwargs)
    job = _Job.open(root, out, options, part=(rank, world_size))
    try:
        _merge_part(job, (rank, world_size), rank=rank)
        if rank != dst:
            return None
        return _remove_spill(job, _finalize(job, world_size, collective=True))
    finally:
        job.close()


def _remove_spill(job: _Job, report: MergeReport) -> MergeReport:
    """``remove_spill``: after a complete output that misses nothing, delete exactly the segments
    it was merged from (``_removal.remove_merged``); the report lists what went and what stayed."""
    if not job.options.remove_spill:
        return report
    why = None
    if not job.output.exists(FO.COMPLETE_NAME):
        why = "the output has no completion marker"
    elif report.missing_ranks:  # frames salvaged from a journal are only ever those of a missing rank
        why = f"ranks {report.missing_ranks} are missing"
    elif report.frame_gaps and (job.options.allow_partial or report.expected_files is not None):
        why = f"frames are missing in {len(report.frame_gaps)} file(s)"
    if why is not None:
        report.notes.append(f"spill root {job.src.url} kept: {why}")
        report.kept_segments.update({job.src.describe(s.rel): why for s in job.segments})
        return report
    done = remove_merged(job.src, job.segments, plan_lookup(job.plan))
    report.removed_segments.extend(done.removed)
    report.kept_segments.update(done.kept)
    if not job.src.exists(""):
        report.notes.append(f"spill root {job.src.url} removed")
    else:
        report.notes.append(
            f"spill root {job.src.url}: {len(done.removed)} merged segment(s) removed"
            + (f", {len(done.kept)} kept (MergeReport.kept_segments says why)" if done.kept else "")
        )
    return report


def _check_part(part: Any) -> tuple[int, int]:
    ok = isinstance(part, (tuple, list)) and len(part) == 2
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in part)
    if not ok or not (part[1] >= 1 and 0 <= part[0] < part[1]):
        raise SpillValueError(f"part must be (i, n) with 0 <= i < n, got {part!r}")
    return int(part[0]), int(part[1])


@dataclass(slots=True)
class _Job:
    """One merge call: its storage, the plan every path works from, options and timings."""

    src: Storage
    """The spill root."""
    output: Storage
    """The output folder."""
    options: MergeOptions
    """The call's options, ``codec`` checked (finalize takes ``codec`` and ``chunk_bytes`` from
    the part records)."""
    threads: int
    """Copy threads (``options.threads``, or the default for these storages)."""
    state: Any
    """``SpillState`` of the spill root after the barrier."""
    segments: list[Any]
    """Committed segments, in write order."""
    plan: Plan
    """The merge plan."""
    fingerprint: str
    """``_plan.fingerprint`` of the plan and the output settings."""
    salvaged: dict[int, int]
    """Rank → frames salvaged from journals."""
    notes: list[str]
    """Report notes."""
    manifest: dict[str, int] | None
    """Filename → expected frame count (``options.expected`` read), for the report (None: not given)."""
    phases: dict[str, float]
    """Seconds per phase."""
    t0: float
    """perf_counter at the start of the call."""
    disk: _plan_disk.DiskPlan | None = None
    """The work folder of an out-of-core plan (removed by :meth:`close`), else None."""
    shared: _planshare.Published | None = None
    """The plan part 0 published, when this process mapped it rather than planning (a part other
    than 0, a finalize), else None."""
    source_key: str | None = None
    """``_planshare.source_key`` of a part or finalize (None: a whole merge, or ``allow_partial``,
    whose salvaged journals are planned by every process)."""
    lease: _lease.Lease | None = None
    """A part's lease, taken before it plans (the other parts wait for part 0's plan, or for a
    part's range of the plan, while it holds it: ``_find_shared``, ``_planranges``) and held
    until :meth:`close`; None for a whole merge and the finalize."""
    ranged: bool = False
    """The plan was built in ranges, one per part (``_planranges``): part 0 publishes no plan."""

    def close(self) -> None:
        """After the merge, whatever its outcome: the plan's temporary files, then the storage,
        then the part's lease."""
        try:
            if self.disk is not None:
                self.disk.close()
            if self.shared is not None:
                self.shared.close()
        finally:
            try:
                self.src.close()
            finally:
                if self.lease is not None:
                    self.lease.release(tidy=True)

    @classmethod
    def open(
        cls, root: str, out: str, options: MergeOptions, *, part: tuple[int, int] | None = None, finalize: bool = False
    ) -> _Job:
        """Barrier → load → plan: everything before the first byte of output. A part other than 0
        and a finalize map the plan part 0 published when there is one (``_planshare``)."""
        held: list[_lease.Lease] = []  # the part's lease, once _open took it
        try:
            job = cls._open(root, out, options, part=part, finalize=finalize, held=held)
        except SpillMergeError as exc:
            try:
                # Busy: another run of this part holds the lease and is at work; a failure record
                # would tell the parts waiting for its plan (or its range) that it failed.
                busy = isinstance(exc, OutputBusyError)
                if part is not None and not options.allow_partial and not busy:
                    _plan_failed(root, out, options, part, exc)
            finally:
                for lease in held:
                    lease.release(tidy=True)
            raise
        except BaseException:
            for lease in held:
                lease.release(tidy=True)
            raise
        job.lease = held[0] if held else None
        return job

    @classmethod
    def _open(
        cls, root: str, out: str, options: MergeOptions, *, part: tuple[int, int] | None, finalize: bool,
        held: list[_lease.Lease],
    ) -> _Job:  # fmt: skip
        t0 = time.perf_counter()
        chunk_bytes, threads = options.chunk_bytes, options.threads
        if not isinstance(chunk_bytes, int) or not 1 <= chunk_bytes <= F.MAX_CHUNK_BYTES:
            # readers refuse a chunk of several rows decoding to more (docs/FORMAT.md 2.3)
            raise SpillValueError(f"chunk_bytes must be an int in [1, {F.MAX_CHUNK_BYTES}], got {chunk_bytes!r}")
        codec = _codecs.check(options.codec)
        manifest = check_expected(options.expected)
        storage_options = options.storage_options
        src = Storage(root, storage_options)
        output = _output_storage(root, out, options)
        if threads is None:  # object stores need many requests in flight; local disks do not
            threads = 4 if src.local and output.local else 16
        if not isinstance(threads, int) or threads < 1:
            raise SpillValueError(f"threads must be a positive int, got {threads!r}")
        if not src.exists(""):
            raise SpillStorageError(f"spill root {src.describe()} does not exist", path=src.describe())
        if _output.overlaps(src, output):
            raise SpillValueError(
                f"output {output.describe()} and spill root {src.describe()} overlap; choose another --out"
            )
        if part is not None:
            # A part holds its lease from here, while it plans: the other parts wait for part 0's
            # plan (``_find_shared``) or its range of the plan (``_planranges``) as long as it
            # does, and two runs of one part never plan at once.
            _output.check_claimable(output)
            output.makedirs("")
            held.append(_lease.part(output, part[0], part[1]))
        allow_partial = options.allow_partial
        state = wait_for_commits(
            src,
            world_size=options.world_size,
            run_id=options.run_id,
            timeout=options.timeout,
            allow_partial=allow_partial,
            progress=options.progress,
        )
        phases: dict[str, float] = {"wait": time.perf_counter() - t0}
        # Write order for the duplicate policy: segment start time, rank breaking ties.
        segments = sorted(state.committed, key=lambda s: (FS.segment_sort_key(s.name)[1], s.rank, s.name))
        t = time.perf_counter()
        salvaged: dict[int, int] = {}
        notes: list[str] = []
        extra = []
        if allow_partial:
            # Uncommitted segments of missing or failed ranks: merge what their journal proves durable.
            for rank, seg in sorted(state.partial.items()):
                flushed, problems = load_flushed(src, seg)
                notes.extend(problems)
                if len(flushed.index):
                    extra.append(flushed)
                    salvaged[rank] = len({(int(r[0]), int(r[1])) for r in flushed.index[:, :2]})
        need = _plan_disk.estimate_bytes(
            sum(s.commit.n_rows for s in segments if s.commit is not None) + sum(len(p.index) for p in extra),
            sum(s.commit.n_files for s in segments if s.commit is not None) + sum(len(p.filenames) for p in extra),
        )
        def mapped(shared: _planshare.Published) -> _Job:
            """The job of the plan part 0 published, mapped instead of planned here."""
            plan_id = shared.fingerprint_for(chunk_bytes, codec) or fingerprint(
                shared.plan, chunk_bytes=chunk_bytes, codec=codec
            )
            phases["plan"] = time.perf_counter() - t
            notes.append(f"the plan part 0 published in {output.describe(_planshare.PLAN_DIR)} was mapped, not rebuilt")
            return cls(
                src, output, replace(options, codec=codec), threads, state, segments, shared.plan, plan_id,
                salvaged, notes, manifest, phases, t0, None, shared, key,
            )  # fmt: skip

        key = None
        ranges = 0  # parts that plan a range each (``_planranges``), else 0
        if (part is not None or finalize) and not allow_partial:
            key = _planshare.source_key(segments, options.on_duplicate)
            if part is None:  # the finalize: the parts' ranges, whatever this call's plan_budget
                ranges = _finalize_ranges(output, key)
            elif need > options.plan_budget:
                ranges = part[1] if part[1] > 1 else 0
            shared = None
            try:
                if ranges:  # every part plans its range of the plan; nobody publishes or maps a whole plan
                    pass
                elif finalize or (part is not None and part[0] > 0):
                    shared = _find_shared(output, key, segments, options, part)
                elif part is not None:  # part 0: its own published plan when it runs again
                    shared = _planshare.find(output, key, segments, timeout=0.0, work_dir=options.plan_dir)
            except CorruptSpillError as exc:  # damaged: plan here (part 0 publishes it anew)
                notes.append(f"planned again: {exc}")
            if shared is not None:
                phases["load"] = 0.0
                return mapped(shared)
        compare = functools.partial(same_bytes, src)
        disk = None
        if need <= options.plan_budget and not ranges:
            loaded = load_all(src, segments) + extra
            phases["load"] = time.perf_counter() - t
            t = time.perf_counter()
            plan = build(loaded, options.on_duplicate, same_bytes=compare, work_dir=options.plan_dir,
                         memory_limit=options.plan_budget)  # fmt: skip
        else:
            # Out of core: each segment is loaded when the plan gets to it, one at a time.
            sources = [_plan_disk.SegmentSource(functools.partial(load_segment, src, s)) for s in segments]
            sources += [_plan_disk.SegmentSource(functools.partial(lambda p: p, p)) for p in extra]
            phases["load"] = time.perf_counter() - t
            t = time.perf_counter()
            runs = exchange = None
            if ranges and key is not None:
                me = part[0] if part is not None else None
                exchange = _planranges.Exchange(
                    output, key, ranges, me, timeout=options.timeout, work_dir=options.plan_dir
                )
                runs = _planruns.Published(
                    output, key, segments, ranges, -1 if me is None else me, share=True, fetches=exchange.fetches
                )
            plan_out_of_core = functools.partial(
                _plan_disk.build, sources, options.on_duplicate, same_bytes=compare, budget=options.plan_budget,
                work_dir=options.plan_dir, ranges=max(1, ranges),
            )  # fmt: skip
            try:
                try:
                    try:
                        disk = plan_out_of_core(shared=runs, exchange=exchange)
                    except _plan_disk.DamagedRun as exc:  # the spill root is the truth: sort every segment here
                        notes.append(f"planned without the runs the other parts published: {exc}")
                        disk = plan_out_of_core(exchange=exchange)
                except _plan_disk.DamagedRange as exc:  # every range here, from the spill root
                    notes.append(f"planned every range here, without the ranges the other parts published: {exc}")
                    if exchange is not None:
                        exchange.close()
                    exchange = None
                    disk = plan_out_of_core()
                plan = disk.plan
                if exchange is not None:
                    notes.append(
                        f"the plan was built in {ranges} ranges of filenames, one per part "
                        f"({output.describe(_planranges.RANGES_DIR)})"
                        + (f"; ranges {sorted(exchange.mapped)} were mapped, not rebuilt" if exchange.mapped else "")
                        + (f"; ranges {sorted(exchange.planned)} were planned here, their parts not at work"
                           if exchange.planned else "")
                    )  # fmt: skip
                    linked = exchange.linked + (runs.linked if isinstance(runs, _planruns.Published) else 0)
                    if linked:
                        notes.append(
                            f"{linked} arrays of the runs and ranges this part published are hard links to its work "
                            f"files (one file system), not copies"
                        )
                notes.append(
                    f"the merge plan (about {need >> 20} MiB in memory) exceeds plan_budget ({options.plan_budget >> 20} "
                    f"MiB): built out of core in {disk.work.dir} (removed after the merge)"
                )
                if disk.taken:
                    notes.append(
                        f"the runs of {disk.taken} of {len(segments)} segments were sorted by the other parts "
                        f"({output.describe(_planruns.RUNS_DIR)}), not here"
                    )
            except _plan_disk.InMemoryOnly as exc:  # rare (> 62 columns, leaves of several variants): in memory
                if exchange is not None:
                    exchange.close()
                ranges = 0
                if key is not None and (finalize or (part is not None and part[0] > 0)):
                    # Part 0 plans in memory too and publishes that plan: map it.
                    shared = _find_shared(output, key, segments, options, part)
                    if shared is not None:
                        return mapped(shared)
                notes.append(f"the plan was built in memory: {exc}")
                plan = build(load_all(src, segments) + extra, options.on_duplicate, same_bytes=compare)
        try:
            plan_id = fingerprint(plan, chunk_bytes=chunk_bytes, codec=codec)
        except BaseException:
            if disk is not None:
                disk.close()
            raise
        phases["plan"] = time.perf_counter() - t
        options = replace(options, codec=codec)
        return cls(
            src, output, options, threads, state, segments, plan, plan_id, salvaged, notes, manifest, phases, t0, disk,
            None, key, ranged=bool(ranges) and disk is not None,
        )  # fmt: skip

    def report(self, *, todo: list[Unit] | None = None, parts: int = 1, part: int | None = None) -> MergeReport:
        plan = self.plan
        ex = self.disk.exchange if self.disk is not None else None
        if isinstance(ex, _planranges.Exchange) and ex.work is not None and ex.fetches.size:
            self.notes.append(
                f"read {ex.fetches} of the runs and ranges of the plan the other parts published (object store: "
                f"the spans this process's plan, copy and index read)"
            )
        t_end = time.perf_counter()
        t_wait = self.phases["wait"]
        return MergeReport(
            out=self.output.describe(),
            n_files=plan.n_files,
            n_frames=plan.n_frames,
            nbytes=plan.total_bytes if todo is None else sum(u.nbytes for u in todo),
            ranks=sorted({s.rank for s in self.segments}),
            segments=len(self.segments),
            merged_segments=[self.src.describe(s.rel) for s in self.segments],
            seconds=t_end - self.t0,
            wait_seconds=t_wait,
            merge_seconds=t_end - self.t0 - t_wait,
            duplicates=plan.duplicates,
            rewrites=sum(s.commit.rewrites for s in self.segments if s.commit is not None),
            missing_ranks=sorted([*self.state.missing, *self.state.failed]),
            abandoned_segments=[self.src.describe(s.rel) for s in self.state.abandoned],
            salvaged_frames=self.salvaged,
            frame_gaps=gaps(plan, self.manifest, whole=part is None)
            if self.options.allow_partial or self.manifest is not None
            else {},
            expected_files=None if self.manifest is None else len(self.manifest),
            notes=self.notes,
            phases=self.phases,
            parts=parts,
            part=part,
            codec=self.options.codec,
        )


def _merge_whole(job: _Job) -> MergeReport:
    """One process writes everything, holding the output's exclusive lease."""
    output = job.output
    _output.check_claimable(output)
    created = not output.exists("")
    output.makedirs("")
    try:
        with _lease.whole(output) as lease:  # before any change: one merge per output
            _merge_whole_locked(job, lease)
    except BaseException:
        if created:  # leave no empty folder behind where there was none
            output.remove_empty_dir("")
        raise
    return job.report()


def _merge_whole_locked(job: _Job, lease: _lease.Lease) -> None:
    """Everything of a whole merge that happens under its lease."""
    output = job.output
    _output.prepare(output, job.options.overwrite, lease)
    try:
        t = time.perf_counter()
        docs = Z.output_docs(job.plan, job.state.world_size, job.options.chunk_bytes, job.options.codec)
        # The root document goes first, alone and whole: it marks the folder as a spillmerge
        # output, so an interrupted merge can be recognised and rebuilt.
        output.put_atomic("zarr.json", Z.json_doc(docs[""]))
        output.put_many({f"{path}/zarr.json": Z.json_doc(doc) for path, doc in docs.items() if path})
        job.phases["metadata"] = time.perf_counter() - t
        t = time.perf_counter()
        _copy(job, units(job.plan, job.options.chunk_bytes))
        job.phases["copy"] = time.perf_counter() - t
        t = time.perf_counter()
        _indexchunks.write(job.output, _indexchunks.index_chunks(job.plan, docs), threads=job.threads)
        job.phases["index"] = time.perf_counter() - t
        _finish(job, docs, lease)
    except BaseException:
        # The output is unusable without its completion marker anyway; removing what we
        # wrote keeps the next merge (or a reader) from seeing half a store. Only while the
        # lease is still ours: a merge that took over after it expired owns the output now.
        try:
            _output.remove_ours(output, lease)
        except Exception:  # noqa: BLE001
            pass
        raise


def _merge_part(job: _Job, part: tuple[int, int], *, rank: int | None) -> MergeReport:
    """Part ``i`` of ``n``: the output chunks ``split`` gives it, then its part record.

    Touches nothing another part of the same plan owns: the shared nodes (index, groups,
    consolidated root, marker) are the finalizer's, and a part only ever deletes its own nodes,
    its own records, a completion marker (``overwrite``) and records of another plan
    (``overwrite``)."""
    i, n = part
    output = job.output
    every = units(job.plan, job.options.chunk_bytes)
    mine = [every[k] for k in split([u.nbytes for u in every], n)[i]]
    _output.check_claimable(output)
    output.makedirs("")
    # Two runs of the same part never write at once. Part 0 took its lease before planning and
    # keeps it until the job closes.
    taken = contextlib.nullcontext(job.lease) if job.lease is not None else _lease.part(output, i, n)
    with taken as lease:
        _output.claim(output, job.options.overwrite, lease)
        return _write_part(job, part, mine, rank, lease)


def _write_part(
    job: _Job, part: tuple[int, int], mine: list[Unit], rank: int | None, lease: _lease.Lease
) -> MergeReport:
    i, n = part
    overwrite = job.options.overwrite
    output, plan_id = job.output, job.fingerprint
    name = _parts.describe(i, n, rank)
    records = _parts.read_records(output)
    if not overwrite and any(r.part == i and r.parts == n and r.plan == plan_id and not r.failed for r in records):
        # Done before (e.g. a requeued array task): the record vouches for data flushed before it.
        job.notes.append(
            f"{name} was already complete ({output.describe(_parts.record_name(i, n))}); nothing rewritten"
        )
        return job.report(todo=mine, parts=n, part=i)
    foreign = _parts.foreign(records, n, plan_id)
    if foreign and not overwrite:
        raise _parts.mismatch_error(
            output,
            foreign,
            n,
            plan_id,
            hint="rerun every part with overwrite=True (--overwrite), or choose another --out",
        )
    lease.check()
    for r in foreign:  # overwrite: an older merge's records; its arrays are replaced or pruned at finalize
        _parts.remove(output, r.part, r.parts, failed=False)
    _parts.remove(output, i, n, failed=False)
    _parts.remove(output, i, n, failed=True)  # a failure record of an earlier attempt of this part
    try:
        t = time.perf_counter()
        if not output.exists("zarr.json"):  # marks the folder as ours before anything else lands in it
            docs = Z.output_docs(job.plan, job.state.world_size, job.options.chunk_bytes, job.options.codec)
            output.put_atomic("zarr.json", Z.json_doc(docs[""]))
        job.phases["metadata"] = time.perf_counter() - t
        if i == 0 and job.source_key is not None and job.shared is None and not job.ranged:
            # The other parts and the finalize map this plan instead of planning it again.
            t = time.perf_counter()
            linked = _planshare.publish(
                output, job.plan, job.source_key, plan_id, chunk_bytes=job.options.chunk_bytes, codec=job.options.codec
            )
            job.phases["publish"] = time.perf_counter() - t
            if linked:
                job.notes.append(
                    f"{linked} arrays of the published plan are hard links to the plan's work files (one file "
                    f"system), not copies"
                )
        # Chunks an earlier attempt of this part left are rewritten whole below, values and this
        # part's share of the index chunks (``_indexchunks``); the documents are the finalizer's.
        t = time.perf_counter()
        with _planshare.blamed_for_range_errors(*_mapped(job)):
            _copy(job, mine)
            job.phases["copy"] = time.perf_counter() - t
            t = time.perf_counter()
            _indexchunks.write(output, _index_share(job, i, n), threads=job.threads)
        job.phases["index"] = time.perf_counter() - t
        t = time.perf_counter()
        if job.options.fsync:  # the part record vouches for every chunk of the part
            output.fsync_tree("")
        lease.check()
        _parts.write_done(
            output, i, n, plan_id, rank, job.options.run_id, n_files=job.plan.n_files, n_frames=job.plan.n_frames,
            nbytes=sum(u.nbytes for u in mine), codec=job.options.codec, chunk_bytes=job.options.chunk_bytes,
            index=True,
        )  # fmt: skip
        job.phases["sync"] = time.perf_counter() - t
    except BaseException as exc:
        # Nothing is removed: other parts' work stays, and a rerun of this part replaces its own.
        _parts.write_failure(output, i, n, plan_id, rank, job.options.run_id, exc)
        raise
    return job.report(todo=mine, parts=n, part=i)


def _finalize(job: _Job, parts: int | None, *, collective: bool = False) -> MergeReport:
    """After every part: check the part records (present, same plan), then index, consolidated
    metadata and completion marker — the same documents a one-process merge writes."""
    output = job.output
    if not _output.is_ours(output):
        if output.exists("") and output.listdir(""):
            raise _output.not_ours(output)
        raise MissingPartsError(
            f"{output.describe()}: no parts found; run every part first (spillmerge merge ROOT --out OUT --part I/N)",
            path=output.describe(),
            missing=[],
            parts=parts or 0,
        )
    with _lease.finalize(output) as lease:  # shared with parts; exclusive with a whole merge
        _output.refuse_links(output, overwrite=False)  # pruning through a linked files/ deletes elsewhere
        return _finalize_locked(job, parts, collective, lease)


def _finalize_locked(job: _Job, parts: int | None, collective: bool, lease: _lease.Lease) -> MergeReport:
    output = job.output
    complete = output.exists(FO.COMPLETE_NAME)
    if complete and not job.options.overwrite:
        raise _output.complete_error(output, "finalize it again")
    t = time.perf_counter()
    records = _parts.read_records(output)
    n = parts if parts is not None else _parts.infer_parts(output, records)
    done = [r for r in records if not r.failed and r.parts == n]
    if not collective and done and done[0].codec is not None and done[0].chunk_bytes is not None:
        # The parts decided the array documents: finalize with their codec and chunk size rather
        # than make every caller repeat them (the fingerprint still catches parts that disagree).
        before = (job.options.codec, job.options.chunk_bytes)
        job.options = replace(job.options, codec=done[0].codec, chunk_bytes=done[0].chunk_bytes)
        if (job.options.codec, job.options.chunk_bytes) != before:  # else the fingerprint stands (2 s at 10^7 keys)
            known = None if job.shared is None else job.shared.fingerprint_for(job.options.chunk_bytes, job.options.codec)
            job.fingerprint = known or fingerprint(job.plan, chunk_bytes=job.options.chunk_bytes, codec=job.options.codec)
    finished = _parts.wait(
        output,
        n,
        job.fingerprint,
        timeout=job.options.timeout,
        collective=collective,
        run_id=job.options.run_id if collective else None,
    )
    job.phases["parts"] = time.perf_counter() - t
    t = time.perf_counter()
    lease.check()
    if complete:
        output.rm_tree(FO.COMPLETE_NAME)
    keep = {c.name for c in job.plan.columns}
    for name in output.listdir("columns"):
        if name not in keep and name != "zarr.json":  # left by an older merge into this output
            output.rm_tree(f"columns/{name}")
    lists = {lst.name for lst in job.plan.lists}
    if output.exists("lists") and not lists:
        output.rm_tree("lists")
    for name in output.listdir("lists") if lists and output.exists("lists") else ():
        if name not in lists and name != "zarr.json":  # left by an older merge into this output
            output.rm_tree(f"lists/{name}")
    if output.exists("files"):  # an older (format 1) merge into this output
        output.rm_tree("files")
    docs = Z.output_docs(job.plan, job.state.world_size, job.options.chunk_bytes, job.options.codec)
    output.put_many({f"{path}/zarr.json": Z.json_doc(doc) for path, doc in docs.items() if path})
    job.phases["metadata"] = job.phases.get("metadata", 0.0) + time.perf_counter() - t
    t = time.perf_counter()
    with _planshare.blamed_for_range_errors(*_mapped(job)):
        # Each part wrote its share of the index chunks; a part whose record does not say so (a
        # release before the shares) leaves its share to the finalize.
        chunks = _indexchunks.index_chunks(job.plan, docs)
        left = [c for p, r in enumerate(finished) if not r.index for c in _indexchunks.share(chunks, p, n)]
        _indexchunks.write(output, left, threads=job.threads)
    job.phases["index"] = time.perf_counter() - t
    _finish(job, docs, lease)
    _planshare.remove(output)  # the parts are done with it (the output is complete)
    _planruns.remove(output)
    _planranges.remove(output)
    return job.report(parts=n)


def _output_storage(root: str, out: str, options: MergeOptions) -> Storage:
    out_storage_options = options.out_storage_options
    if out_storage_options is None:  # the same credentials serve both ends when they share a protocol
        same = fsspec.core.split_protocol(str(root))[0] == fsspec.core.split_protocol(str(out))[0]
        out_storage_options = options.storage_options if same else None
    return Storage(out, out_storage_options)


def _plan_failed(root: str, out: str, options: MergeOptions, part: tuple[int, int], exc: BaseException) -> None:
    """Part 0 failed before it could publish its plan: a failure record (of no plan) tells the
    parts waiting for the plan to stop waiting (they plan themselves, and meet the same error).
    Only into an output that is absent, empty or ours; best effort."""
    try:
        output = _output_storage(root, out, options)
        if not output.exists("") or not output.listdir("") or _output.is_ours(output):
            _parts.write_failure(output, 0, part[1], "", None, options.run_id, exc)
    except Exception:  # noqa: BLE001 - the original error matters more
        pass


#: "No deadline": waiting then ends only when ``give_up`` says so.
_UNTIL_GIVEN_UP = 10.0 * 365 * 86400


def _find_shared(
    output: Storage, key: str, segments: list[Any], options: MergeOptions, part: tuple[int, int] | None
) -> _planshare.Published | None:
    """The plan part 0 published, waiting for it; None when this process should plan itself.

    With ``timeout`` > 0 (and for the finalize): up to ``timeout`` seconds, but not once part 0
    left a record, done or failed, without it (another spill root or policy, a failed plan). With
    ``timeout=0`` (the default), a part other than 0 waits as long as part 0 holds its lease,
    which it takes before planning: part 0 is at work and its plan comes (at 10^7 keys, a part
    that did not wait planned everything again beside part 0, issue 24). It plans itself at once
    when part 0 is not running, and as soon as part 0 leaves a record or lets its lease go."""
    if part is None or part[0] == 0 or options.timeout > 0:
        return _planshare.find(
            output, key, segments, timeout=options.timeout, work_dir=options.plan_dir,
            give_up=lambda: _part0_ended(output, part),
        )  # fmt: skip
    name = _lease.part_name(0, part[1])
    return _planshare.find(
        output, key, segments, timeout=_UNTIL_GIVEN_UP, work_dir=options.plan_dir,
        give_up=lambda: _part0_ended(output, part) or not _lease.held(output, name),
    )  # fmt: skip


def _mapped(job: _Job) -> tuple[bool, Storage, str, _plan_disk.RangeExchange | None]:
    """Whether ``job`` mapped a plan, or ranges of it, that other processes published, and where."""
    if job.ranged:
        ex = job.disk.exchange if job.disk else None
        return bool(ex and ex.mapped), job.output, _planranges.RANGES_DIR, ex
    return job.shared is not None, job.output, _planshare.PLAN_DIR, None


def _finalize_ranges(output: Storage, key: str) -> int:
    """(the finalize) The parts whose ranges of the plan of ``key`` were published, else 0."""
    try:
        n = _parts.infer_parts(output, _parts.read_records(output))
    except SpillMergeError:
        return 0
    return n if _planranges.published_ranges(output, key, n) else 0


def _part0_ended(output: Storage, part: tuple[int, int] | None) -> bool:
    """Whether part 0 (of as many parts as ``part``) left a record, done or failed."""
    try:
        records = _parts.read_records(output)
    except SpillMergeError:
        return False
    return any(r.part == 0 and (part is None or r.parts == part[1]) for r in records)


def _index_share(job: _Job, i: int, n: int) -> list[_indexchunks.IndexChunk]:
    """Part ``i``'s share of the output's index chunks."""
    docs = Z.output_docs(job.plan, job.state.world_size, job.options.chunk_bytes, job.options.codec)
    return _indexchunks.share(_indexchunks.index_chunks(job.plan, docs), i, n)


def _copy(job: _Job, todo: list[Unit]) -> None:
    copy_units(
        job.src, job.output, job.plan, todo, codec=job.options.codec, memory_budget=job.options.memory_budget, threads=job.threads,
        progress=job.options.progress,
    )  # fmt: skip


def _finish(job: _Job, docs: dict[str, dict[str, Any]], lease: _lease.Lease) -> None:
    """Flush, then the consolidated root, then the completion marker: last, once."""
    output, plan = job.output, job.plan
    root = Z.consolidated_root(docs)
    t = time.perf_counter()
    if job.options.fsync:  # every chunk and document is durable before the root and the marker vouch for them
        output.fsync_tree("")
    job.phases["sync"] = job.phases.get("sync", 0.0) + time.perf_counter() - t
    t = time.perf_counter()
    lease.check()  # a merge that lost its lease must not vouch for an output another one writes
    output.put_atomic("zarr.json", Z.json_doc(root))
    marker = FO.CompletionMarker(
        n_files=plan.n_files,
        n_frames=plan.n_frames,
        nbytes=plan.total_bytes,
        finished=F.utcnow(),
        written_by=lease.record(),  # a second merge into this output can be told apart
        spill_root=job.src.describe(),
        plan=job.fingerprint,
        run_id=job.options.run_id,
        session=job.options.session,
    )
    lease.check()
    output.put_atomic(FO.COMPLETE_NAME, marker.to_json())
    job.phases["finish"] = time.perf_counter() - t
