"""A merge call opened (``Job``): options checked, the commit barrier, segments loaded, the plan
built or read; its report, and the write steps every path shares (copy, flush, completion marker)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeGuard, TypeVar

from .._errors import ConfigError, OutputBusyError, SpillMergeError, SpillStorageError, SpillValueError
from .._format import codecs as _codecs
from .._format import common as F
from .._format import output as FO
from .._format import spill as FS
from .._spill.barrier import wait_for_commits
from .._spill.lazy import load_all
from .._spill.root import load_flushed, same_bytes
from .._storage import Storage, output_options, overlaps
from .._util.frames import check_expected
from . import documents as Z
from . import lease as _lease
from . import ownership as _output
from . import parts as _parts
from . import planstore as _planstore
from .options import MergeOptions
from .outputchunk import Unit
from .plan import Plan, build, fingerprint
from .planstore import DamagedPlan
from .report import MergeReport, gaps

T = TypeVar("T")


@dataclass(slots=True)
class Job:
    """One merge call: its storage, the plan every path works from, options and timings."""

    src: Storage
    """The spill root."""
    output: Storage
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
    fingerprint: str
    """``_merge.plan.fingerprint`` of the plan and the output settings."""
    salvaged: dict[int, int]
    """Rank → frames salvaged from journals."""
    notes: list[str]
    manifest: dict[str, int] | None
    """Filename → expected frame count (``options.expected`` read), for the report (None: not given)."""
    phases: dict[str, float]
    """Seconds per phase."""
    t0: float
    """perf_counter at the start of the call."""
    lease: _lease.Lease | None = None
    """A part's lease, taken before it plans (two runs of one part never plan or write at once)
    and held until :meth:`close`; None for a whole merge and the finalize."""
    rebuild: Callable[[BaseException], _planstore.Obtained] | None = None
    """For a part or a finalize: builds the plan again from the spill root (:meth:`redone`)."""

    def redone(self, work: Callable[[], T]) -> T:
        """``work()``; when the stored plan this job reads fails a check while in use (a block
        fails its digest), plan again from the spill root and ``work()`` again: nothing of a
        damaged plan is trusted. Not for a plan built here, nor once the marker is written."""
        try:
            return work()
        except DamagedPlan as exc:
            if self.rebuild is None or "finish" in self.phases:
                raise
            got = self.rebuild(exc)
        self.rebuild = None
        self.plan, self.fingerprint = got.plan, got.fingerprint
        self.notes[:] = [n for n in self.notes if _planstore.READ not in n] + got.notes
        return work()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The body's seconds added to phase ``name`` when it succeeds (``finish`` then says
        that the marker is written)."""
        t = time.perf_counter()
        yield
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t

    def docs(self) -> dict[str, dict[str, Any]]:
        """Every ``zarr.json`` of the output (``_merge.documents.output_docs``)."""
        return Z.output_docs(self.plan, self.state.world_size, self.options.chunk_bytes, self.options.codec)

    def close(self) -> None:
        """After the merge, whatever its outcome: the storage, then the part's lease."""
        try:
            self.src.close()
        finally:
            if self.lease is not None:
                self.lease.release(tidy=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def open(cls, root: str, out: str, options: MergeOptions) -> Job:
        """Barrier → load → plan: everything before the first byte of output. A part and a
        finalize read the stored plan when there is one (``_merge.planstore``)."""
        held: list[_lease.Lease] = []  # the part's lease, once _open took it
        try:
            job = cls._open(root, out, options, held)
        except BaseException as exc:
            try:
                # Busy: another run of this part holds the lease and is at work; a failure record
                # of this part would describe that run's outcome wrongly.
                failed = isinstance(exc, SpillMergeError) and not isinstance(exc, OutputBusyError)
                if failed and options.part is not None and not options.allow_partial:
                    _plan_failed(root, out, options, options.part, exc)
            finally:
                for lease in held:
                    lease.release(tidy=True)
            raise
        job.lease = held[0] if held else None
        return job

    @classmethod
    def _open(cls, root: str, out: str, options: MergeOptions, held: list[_lease.Lease]) -> Job:
        t0 = time.perf_counter()
        part = options.part
        chunk_bytes, threads = options.chunk_bytes, options.threads
        if not _is_int(chunk_bytes) or not 1 <= chunk_bytes <= F.MAX_CHUNK_BYTES:
            # readers refuse a chunk of several rows decoding to more (docs/FORMAT.md, *Size limits*)
            raise SpillValueError(f"chunk_bytes must be an int in [1, {F.MAX_CHUNK_BYTES}], got {chunk_bytes!r}")
        for name in ("memory_budget", "plan_budget"):
            budget = getattr(options, name)
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:  # NaN too
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{name} ({flag}) must be a number of bytes >= 0, got {budget!r}", key=name)
        codec = _codecs.check(options.codec)
        manifest = check_expected(options.expected)
        src = Storage(root, options.storage_options)
        output = _output_storage(root, out, options)
        if threads is None:  # object stores need many requests in flight; local disks do not
            threads = 4 if src.local and output.local else 16
        if not _is_int(threads) or threads < 1:
            raise SpillValueError(f"threads must be a positive int, got {threads!r}")
        if options.world_size is not None and not (_is_int(options.world_size) and options.world_size >= 1):
            raise SpillValueError(f"world_size must be a positive int, got {options.world_size!r}")
        if not src.exists(""):
            raise SpillStorageError(f"spill root {src.describe()} does not exist", path=src.describe())
        if overlaps(src, output):
            raise SpillValueError(
                f"output {output.describe()} and spill root {src.describe()} overlap; choose another out= (--out)"
            )
        if part is not None:
            # A part holds its lease from here, while it plans: two runs of one part never plan
            # or write at once. Nobody waits on this lease for a plan (``_merge.planstore``).
            _output.check_claimable(output)
            output.makedirs("")
            held.append(_lease.part(output, part[0], part[1]))
        state = wait_for_commits(
            src,
            world_size=options.world_size,
            run_id=options.run_id,
            timeout=options.timeout,
            allow_partial=options.allow_partial,
            progress=options.progress,
        )
        phases: dict[str, float] = {"wait": time.perf_counter() - t0}
        # Write order for the duplicate policy: segment start time, rank breaking ties.
        segments = sorted(state.committed, key=lambda s: (FS.segment_sort_key(s.name)[1], s.rank, s.name))
        t = time.perf_counter()
        salvaged: dict[int, int] = {}
        notes: list[str] = []
        extra = []
        if options.allow_partial:
            # Uncommitted segments of missing or failed ranks: merge what their journal proves durable.
            for rank, seg in sorted(state.partial.items()):
                flushed, problems = load_flushed(src, seg)
                notes.extend(problems)
                if len(flushed.index):
                    extra.append(flushed)
                    salvaged[rank] = len({(int(r[0]), int(r[1])) for r in flushed.index[:, :2]})

        def plan_here() -> tuple[Plan, str]:
            """Load every segment's catalog and index, then plan (and fingerprint) here."""
            t_load = time.perf_counter()
            loaded = load_all(src, segments) + extra
            phases["load"] = time.perf_counter() - t_load
            plan = build(loaded, options.on_duplicate, same_bytes=functools.partial(same_bytes, src),
                         work_dir=options.plan_dir, memory_limit=options.plan_budget)  # fmt: skip
            return plan, fingerprint(plan, chunk_bytes=chunk_bytes, codec=codec)

        phases["load"] = 0.0
        rebuild = None
        if (part is not None or options.finalize) and not options.allow_partial:
            # One process plans and stores the plan; the others read it. Salvaged journals
            # (``allow_partial``) are read by every process, which then plans itself.
            key = _planstore.source_key(segments, options.on_duplicate)
            settings = {"chunk_bytes": chunk_bytes, "codec": codec}
            # a complete output is refused later, unless overwritten: store nothing into it
            may_store = part is not None and not (output.exists(FO.COMPLETE_NAME) and not options.overwrite)
            got = _planstore.obtain(
                output, key, segments, plan_here, settings=settings, timeout=options.timeout, may_store=may_store,
                memory_limit=max(options.plan_budget // 2, 16 << 20),  # of the stored plan's blocks in memory
            )  # fmt: skip
            plan, plan_id = got.plan, got.fingerprint
            notes.extend(got.notes)
            # a stored block may yet fail its digest (a plan built here raises no DamagedPlan)
            rebuild = functools.partial(_planstore.rebuild, output, key, plan_here, settings=settings,
                                        may_store=may_store)  # fmt: skip
        else:
            plan, plan_id = plan_here()
        phases["plan"] = time.perf_counter() - t - phases["load"]
        options = replace(options, codec=codec)
        return cls(src, output, options, threads, state, segments, plan, plan_id, salvaged, notes, manifest, phases, t0,
                   rebuild=rebuild)  # fmt: skip

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


def _is_int(x: object) -> TypeGuard[int]:
    """An int, not a bool (``True`` is no count); a float or numpy int would reach the JSON records."""
    return isinstance(x, int) and not isinstance(x, bool)


def _output_storage(root: str, out: str, options: MergeOptions) -> Storage:
    return Storage(out, output_options(root, out, options.storage_options, options.out_storage_options))


def _plan_failed(root: str, out: str, options: MergeOptions, part: tuple[int, int], exc: BaseException) -> None:
    """A part failed before it had a plan: its failure record (of no plan) says so to ``status``
    and to whoever reruns it. Only into an output that is absent, empty or ours; best effort."""
    with contextlib.suppress(Exception):  # the original error matters more
        output = _output_storage(root, out, options)
        if not output.exists("") or not output.listdir("") or _output.is_ours(output):
            _parts.write_failure(output, part[0], part[1], "", None, options.run_id, exc)


def plan_options(job: Job) -> dict[str, Any]:
    """The options that decide the plan and the output, as a part record carries them (messages
    name those on which parts disagree; the plan budget and folder never change the plan)."""
    o = job.options
    return {
        "on_duplicate": o.on_duplicate, "world_size": job.state.world_size, "run_id": o.run_id,
        "allow_partial": o.allow_partial, "codec": o.codec, "chunk_bytes": o.chunk_bytes, "session": o.session,
    }  # fmt: skip


SMALL_MERGE_BYTES = 4 << 20
"""Output chunks of at most this many bytes in all, on local storage, are written by the merging
thread itself: starting a pool's threads costs more than they gain on a small merge."""


def copy_threads(job: Job, todo: list[Unit]) -> int:
    """The copy and index threads for ``todo``: 1 for a small merge between local storages."""
    small = job.src.local and job.output.local and sum(u.nbytes for u in todo) <= SMALL_MERGE_BYTES
    return 1 if small else job.threads


def put_record(job: Job, rel: str, data: bytes) -> None:
    """A document or marker of the output, seen whole or not at all; durable unless the merge
    flushes nothing (``fsync=False``: objects outlive the process, not a power loss)."""
    if job.options.fsync:
        job.output.put_atomic(rel, data)
    else:
        with job.output.open_write(rel) as sink:  # locally a temporary name, renamed: never half
            sink.write(data)


def finish(job: Job, docs: dict[str, dict[str, Any]], lease: _lease.Lease) -> None:
    """Flush, then the consolidated root, then the completion marker: last, once."""
    output, plan = job.output, job.plan
    root = Z.consolidated_root(docs)
    with job.phase("sync"):
        if job.options.fsync:  # every chunk and document is durable before the root and the marker vouch for them
            output.fsync_tree()
    with job.phase("finish"):
        lease.check()  # a merge that lost its lease must not vouch for an output another one writes
        put_record(job, "zarr.json", Z.json_doc(root))
        marker = FO.CompletionMarker(
            n_files=plan.n_files,
            n_frames=plan.n_frames,
            nbytes=plan.total_bytes,
            finished=F.utcnow(),
            # who wrote it: a second merge into this output can be told apart
            written_by={k: getattr(lease.holder, k) for k in ("owner", "role", "host", "pid")},
            spill_root=job.src.describe(),
            plan=job.fingerprint,
            run_id=job.options.run_id,
            session=job.options.session,
        )
        lease.check()
        put_record(job, FO.COMPLETE_NAME, marker.to_json())
