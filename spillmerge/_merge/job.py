"""merge() and merge_parallel(): a whole merge under the output's lease, a merge in parts, the spill removed after."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .._errors import SpillStorageError, SpillValueError
from .._format import common as F
from .._format import output as FO
from .._spill.removal import remove_merged
from . import documents as Z
from . import index as _indexchunks
from . import lease as _lease
from . import opening as _opening
from . import ownership as _output
from . import scaleout as _scaleout
from .copy import copy_units, units
from .options import DEFAULT_MEMORY_BUDGET, DEFAULT_PLAN_BUDGET, MergeOptions
from .report import MergeReport, plan_lookup


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
    with _opening.Job.open(root, out, options) as job:
        if finalize:
            return _remove_spill(job, _scaleout.finalize(job, None))
        if options.part is not None:
            return _scaleout.merge_part(job, rank=None)
        return _remove_spill(job, _merge_whole(job))


def merge_parallel(
    root: str, out: str, *, rank: int, world_size: int, dst: int, run_id: str | None, timeout: float,
    overwrite: bool = False, told: _scaleout.Told | None = None, **kwargs: Any,
) -> MergeReport | None:  # fmt: skip
    """``SpillWriter.merge(parallel=True)``: every rank writes part ``rank`` of ``world_size``;
    rank ``dst`` then waits on storage (not on a collective) for every part record, up to
    ``timeout`` seconds, or until ``told`` names a failed part, and finalizes. Returns the report
    on ``dst``, None elsewhere."""
    for key in ("part", "finalize"):
        if key in kwargs:
            raise SpillValueError(f"{key}= cannot be combined with parallel=True (every rank is one part)")
    if rank != dst:
        kwargs.setdefault("progress", False)  # one progress bar per job, not one per rank
    options = MergeOptions(
        world_size=world_size, run_id=run_id, timeout=timeout, overwrite=overwrite, part=(rank, world_size), **kwargs
    )
    with _opening.Job.open(root, out, options) as job:
        _scaleout.merge_part(job, rank=rank)
        if rank != dst:
            return None
        return _remove_spill(job, _scaleout.finalize(job, world_size, collective=True, told=told))


def _remove_spill(job: _opening.Job, report: MergeReport) -> MergeReport:
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
        read = [*job.segments, *job.state.partial.values()]  # the salvaged journals too
        report.kept_segments.update({job.src.describe(s.rel): why for s in read})
        return report
    try:
        done = remove_merged(job.src, job.segments, plan_lookup(job.plan))
    except SpillStorageError as exc:  # e.g. a read-only credential: the output is whole all the same
        raise exc.prefixed(
            f"the merge into {job.output.describe()} is complete, but removing the spill it was merged "
            f"from failed (what was not removed stays in {job.src.url})"
        ) from None
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


def _merge_whole(job: _opening.Job) -> MergeReport:
    """One process writes everything, holding the output's exclusive lease."""
    output = job.output
    _output.check_claimable(output)
    created = not output.exists("")
    output.makedirs("")
    try:
        with _lease.whole(output) as lease:  # before any change: one merge per output
            todo = units(job.plan, job.options.chunk_bytes)
            if output.exists(FO.COMPLETE_NAME):
                if not job.options.overwrite:
                    raise _output.complete_error(output, "replace it")
                # A complete output goes only once every source row of its replacement has been read
                # and checked: a spill byte that rotted must not cost the output that holds it whole.
                with job.phase("check"):
                    copy_units(job, todo, check=True)
            _output.remove_ours(output, lease)  # an interrupted merge, or an overwrite: from scratch
            try:
                with job.phase("metadata"):
                    docs = job.docs()
                    # The root document goes first, alone and whole: it marks the folder as a spillmerge
                    # output, so an interrupted merge can be recognised and rebuilt.
                    _opening.put_record(job, "zarr.json", Z.json_doc(docs[""]))
                    output.put_many({f"{path}/zarr.json": Z.json_doc(doc) for path, doc in docs.items() if path})
                with job.phase("copy"):
                    copy_units(job, todo)
                with job.phase("index"):
                    chunks = _indexchunks.index_chunks(job.plan, docs)
                    _indexchunks.write(job.output, chunks, threads=_opening.copy_threads(job, todo))
                _opening.finish(job, docs, lease)
            except BaseException:
                # The output is unusable without its completion marker anyway; removing what we
                # wrote keeps the next merge (or a reader) from seeing half a store. Only while the
                # lease is still ours: a merge that took over after it expired owns the output now.
                with contextlib.suppress(Exception):
                    _output.remove_ours(output, lease)
                raise
    except BaseException:
        if created:  # leave no empty folder behind where there was none
            output.remove_empty_dir("")
        raise
    return job.report()
