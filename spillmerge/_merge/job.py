"""merge(): barrier → validate → plan → bulk-create output → copy stripes → consolidate → marker."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import fsspec

from .._errors import MissingPartsError, OutputBusyError, SpillMergeError, SpillStorageError, SpillValueError
from .._format import codecs as _codecs
from .._format import common as F
from .._format import output as FO
from .._format import spill as FS
from .._spill.barrier import wait_for_commits
from .._spill.removal import remove_merged
from .._spill.root import load_all, load_flushed, same_bytes
from .._storage import Storage
from .._util import poll as _poll
from .._util.frames import check_expected
from . import documents as Z
from . import index as _indexchunks
from . import lease as _lease
from . import ownership as _output
from . import parts as _parts
from . import planstore as _planstore
from .copy import Unit, copy_units, units
from .options import DEFAULT_MEMORY_BUDGET, DEFAULT_PLAN_BUDGET, MergeOptions
from .plan import Plan, build, fingerprint, split
from .report import MergeReport, gaps, plan_lookup


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
    payload (plus one frame when a single frame is larger). ``plan_budget`` is the memory limit of
    the planner and ``plan_dir`` its temporary folder (default: the system's temporary folder),
    emptied when the merge ends (docs/SCALE.md). ``codec`` compresses the output arrays: ``"none"``
    (default: raw bytes), ``"blosc-lz4"`` or ``"zstd"``. Returns a :class:`MergeReport`.

    Scale-out over independent processes (SLURM array tasks; no torch.distributed needed):
    ``part=(i, n)`` writes only part ``i`` of ``n`` — the output chunks a deterministic split
    by bytes gives it — and then its part record; once all ``n`` parts ran, one call with
    ``finalize=True`` checks that every part is present and was planned identically (waiting up
    to ``timeout`` seconds for missing parts), then writes the index, the consolidated metadata
    and the completion marker. The plan is built once: the first part to find no stored plan
    builds it under the output's ``planner`` lease and stores it in the output's work folder; the
    other parts and the finalize read it, waiting while the planner is alive (with ``timeout`` >
    0, at most that long), and plan themselves when nobody is at it. The plan budget does not
    change the plan. Every call needs the same spill root and planning options
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
    it was merged from (``_spill.removal.remove_merged``); the report lists what went and what stayed."""
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
    """``_merge.plan.fingerprint`` of the plan and the output settings."""
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
    lease: _lease.Lease | None = None
    """A part's lease, taken before it plans (two runs of one part never plan or write at once)
    and held until :meth:`close`; None for a whole merge and the finalize."""

    def close(self) -> None:
        """After the merge, whatever its outcome: the storage, then the part's lease."""
        try:
            self.src.close()
        finally:
            if self.lease is not None:
                self.lease.release(tidy=True)

    @classmethod
    def open(
        cls, root: str, out: str, options: MergeOptions, *, part: tuple[int, int] | None = None, finalize: bool = False
    ) -> _Job:
        """Barrier → load → plan: everything before the first byte of output. A part and a
        finalize read the stored plan when there is one (``_merge.planstore``)."""
        held: list[_lease.Lease] = []  # the part's lease, once _open took it
        try:
            job = cls._open(root, out, options, part=part, finalize=finalize, held=held)
        except SpillMergeError as exc:
            try:
                # Busy: another run of this part holds the lease and is at work; a failure record
                # of this part would describe that run's outcome wrongly.
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
            # readers refuse a chunk of several rows decoding to more (docs/FORMAT.md, *Size limits*)
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
            # A part holds its lease from here, while it plans: two runs of one part never plan
            # or write at once. Nobody waits on this lease for a plan (``_merge.planstore``).
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
        compare = functools.partial(same_bytes, src)

        def plan_here() -> tuple[Plan, str]:
            """Load every segment's catalog and index, then plan (and fingerprint) here."""
            t_load = time.perf_counter()
            loaded = load_all(src, segments) + extra
            phases["load"] = time.perf_counter() - t_load
            plan = build(loaded, options.on_duplicate, same_bytes=compare, work_dir=options.plan_dir,
                         memory_limit=options.plan_budget)  # fmt: skip
            return plan, fingerprint(plan, chunk_bytes=chunk_bytes, codec=codec)

        phases["load"] = 0.0
        if (part is not None or finalize) and not allow_partial:
            # One process plans and stores the plan; the others read it. Salvaged journals
            # (``allow_partial``) are read by every process, which then plans itself.
            key = _planstore.source_key(segments, options.on_duplicate)
            complete = output.exists(FO.COMPLETE_NAME) and not options.overwrite  # refused later: store nothing
            got = _planstore.obtain(
                output, key, segments, plan_here, lambda p: fingerprint(p, chunk_bytes=chunk_bytes, codec=codec),
                settings={"chunk_bytes": chunk_bytes, "codec": codec}, timeout=options.timeout,
                may_store=part is not None and not complete,
            )  # fmt: skip
            plan, plan_id = got.plan, got.fingerprint
            notes.extend(got.notes)
        else:
            plan, plan_id = plan_here()
        phases["plan"] = time.perf_counter() - t - phases["load"]
        options = replace(options, codec=codec)
        return cls(
            src, output, options, threads, state, segments, plan, plan_id, salvaged, notes, manifest, phases, t0
        )

    def report(self, *, todo: list[Unit] | None = None, parts: int = 1, part: int | None = None) -> MergeReport:
        plan = self.plan
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
        todo = units(job.plan, job.options.chunk_bytes)
        _copy(job, todo)
        job.phases["copy"] = time.perf_counter() - t
        t = time.perf_counter()
        _indexchunks.write(job.output, _indexchunks.index_chunks(job.plan, docs), threads=_threads(job, todo))
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
    # Two runs of the same part never write at once. A part took its lease before planning and
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
            options=_plan_options(job),
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
        # Chunks an earlier attempt of this part left are rewritten whole below, values and this
        # part's share of the index chunks (``_merge.index``); the documents are the finalizer's.
        t = time.perf_counter()
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
            index=True, options=_plan_options(job),
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
    if parts is None and job.options.timeout > 0:
        _await_a_part(output, job.options.timeout)
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


def _await_a_part(output: Storage, timeout: float) -> None:
    """A finalize started with the parts (a SLURM array's last task): up to ``timeout`` seconds for
    the first part record, which tells it the part count; the records' own wait follows."""
    for waited in _poll.poll(timeout, first=0.05, cap=2.0):
        try:
            if output.exists(_parts.PARTS_DIR) and _parts.read_records(output):
                return
        except SpillMergeError:
            return  # a damaged record: the finalize names it
        if waited >= timeout:
            return


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
            job.fingerprint = fingerprint(job.plan, chunk_bytes=job.options.chunk_bytes, codec=job.options.codec)
    finished = _parts.wait(
        output,
        n,
        job.fingerprint,
        timeout=job.options.timeout,
        collective=collective,
        run_id=job.options.run_id if collective else None,
        options=_plan_options(job),
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
    # Each part wrote its share of the index chunks; a part whose record does not say so (a
    # release before the shares) leaves its share to the finalize.
    chunks = _indexchunks.index_chunks(job.plan, docs)
    left = [c for p, r in enumerate(finished) if not r.index for c in _indexchunks.share(chunks, p, n)]
    _indexchunks.write(output, left, threads=job.threads)
    job.phases["index"] = time.perf_counter() - t
    _finish(job, docs, lease)
    _planstore.remove(output)  # the parts are done with it (the output is complete)
    return job.report(parts=n)


def _output_storage(root: str, out: str, options: MergeOptions) -> Storage:
    out_storage_options = options.out_storage_options
    if out_storage_options is None:  # the same credentials serve both ends when they share a protocol
        same = fsspec.core.split_protocol(str(root))[0] == fsspec.core.split_protocol(str(out))[0]
        out_storage_options = options.storage_options if same else None
    return Storage(out, out_storage_options)


def _plan_failed(root: str, out: str, options: MergeOptions, part: tuple[int, int], exc: BaseException) -> None:
    """A part failed before it had a plan: its failure record (of no plan) says so to ``status``
    and to whoever reruns it. Only into an output that is absent, empty or ours; best effort."""
    try:
        output = _output_storage(root, out, options)
        if not output.exists("") or not output.listdir("") or _output.is_ours(output):
            _parts.write_failure(output, part[0], part[1], "", None, options.run_id, exc)
    except Exception:  # noqa: BLE001 - the original error matters more
        pass


def _plan_options(job: _Job) -> dict[str, Any]:
    """The options that decide the plan and the output, as a part record carries them (messages
    name those on which parts disagree; the plan budget and folder never change the plan)."""
    o = job.options
    return {
        "on_duplicate": o.on_duplicate, "world_size": job.state.world_size, "run_id": o.run_id,
        "allow_partial": o.allow_partial, "codec": o.codec, "chunk_bytes": o.chunk_bytes, "session": o.session,
    }  # fmt: skip


def _index_share(job: _Job, i: int, n: int) -> list[_indexchunks.IndexChunk]:
    """Part ``i``'s share of the output's index chunks."""
    docs = Z.output_docs(job.plan, job.state.world_size, job.options.chunk_bytes, job.options.codec)
    return _indexchunks.share(_indexchunks.index_chunks(job.plan, docs), i, n)


SMALL_MERGE_BYTES = 4 << 20
"""Output chunks of at most this many bytes in all, on local storage, are written by the merging
thread itself: starting a pool's threads costs more than they gain on a small merge."""


def _threads(job: _Job, todo: list[Unit]) -> int:
    """The copy and index threads for ``todo``: 1 for a small merge between local storages."""
    small = job.src.local and job.output.local and sum(u.nbytes for u in todo) <= SMALL_MERGE_BYTES
    return 1 if small else job.threads


def _copy(job: _Job, todo: list[Unit]) -> None:
    copy_units(
        job.src, job.output, job.plan, todo, codec=job.options.codec, memory_budget=job.options.memory_budget,
        threads=_threads(job, todo), progress=job.options.progress, fsync=job.options.fsync,
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
