"""A merge in parts: part ``i`` of ``n`` writes its output chunks and its part record; the finalize
checks every record and writes the shared documents, index and completion marker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .._errors import MissingPartsError, SpillMergeError
from .._format import output as FO
from .._storage import Storage
from .._util import poll as _poll
from . import documents as Z
from . import index as _indexchunks
from . import lease as _lease
from . import opening as _opening
from . import ownership as _output
from . import parts as _parts
from . import planstore as _planstore
from .copy import copy_units, split, units
from .plan import fingerprint
from .report import MergeReport


def merge_part(job: _opening.Job, *, rank: int | None) -> MergeReport:
    """Part ``i`` of ``n`` (``job.options.part``): the output chunks ``split`` gives it, then its
    part record. It deletes only its own nodes and records, and with ``overwrite`` a completion
    marker and records of another plan; the shared nodes (index, groups, consolidated root,
    marker) are the finalizer's. A stored plan that fails a check in use is rebuilt and the part
    redone (``Job.redone``)."""
    return job.redone(lambda: _write_part(job, rank))


def _write_part(job: _opening.Job, rank: int | None) -> MergeReport:
    assert job.options.part is not None
    i, n = job.options.part
    every = units(job.plan, job.options.chunk_bytes)
    mine = [every[k] for k in split(job.plan, every, n)[i]]
    # Two runs of the same part never write at once: a part took its lease (in the output, which
    # it checked it may claim) before planning and keeps it until the job closes.
    output, plan_id, overwrite, lease = job.output, job.fingerprint, job.options.overwrite, job.lease
    assert lease is not None
    lease.check()
    _output.refuse_links(output, overwrite)
    if output.exists(FO.COMPLETE_NAME):  # only the marker goes: other parts may be writing beside us
        if not overwrite:
            raise _output.complete_error(output, "rebuild it (every part, then finalize)")
        output.rm_tree(FO.COMPLETE_NAME)  # from here on the output is incomplete until finalized
    records = _parts.read_records(output)
    if not overwrite and any(
        isinstance(r, FO.PartDoneRecord) and (r.part, r.parts, r.plan) == (i, n, plan_id) for r in records
    ):
        # Done before (e.g. a requeued array task): the record vouches for data flushed before it.
        where = output.describe(_parts.record_name(i, n))
        job.notes.append(f"{_parts.describe(i, n, rank)} was already complete ({where}); nothing rewritten")
        return job.report(todo=mine, parts=n, part=i)
    foreign = _parts.foreign(records, n, plan_id)
    if foreign and not overwrite:
        raise _parts.mismatch_error(
            output,
            foreign,
            n,
            plan_id,
            hint="rerun every part with overwrite=True (--overwrite), or choose another out= (--out)",
            options=_opening.plan_options(job),
        )
    lease.check()
    for r in foreign:  # overwrite: an older merge's records; its arrays are replaced or pruned at finalize
        output.rm_tree(_parts.record_name(r.part, r.parts))
    output.rm_tree(_parts.record_name(i, n))
    output.rm_tree(_parts.record_name(i, n, failed=True))  # a failure record of an earlier attempt of this part
    try:
        with job.phase("metadata"):
            docs = job.docs()
            if not output.exists("zarr.json"):  # marks the folder as ours before anything else lands in it
                _opening.put_record(job, "zarr.json", Z.json_doc(docs[""]))
        # Chunks an earlier attempt of this part left are rewritten whole below, values and this
        # part's share of the index chunks (``_merge.index``); the documents are the finalizer's.
        with job.phase("copy"):
            copy_units(job, mine)
        with job.phase("index"):
            share = _indexchunks.share(_indexchunks.index_chunks(job.plan, docs), i, n)
            _indexchunks.write(output, share, threads=job.threads)
        with job.phase("sync"):
            if job.options.fsync:  # the part record vouches for every chunk of the part
                output.fsync_tree()
            lease.check()
            done = FO.PartDoneRecord.now(
                part=i, parts=n, plan=plan_id, rank=rank, run_id=job.options.run_id, n_files=job.plan.n_files,
                n_frames=job.plan.n_frames, nbytes=sum(u.nbytes for u in mine), codec=job.options.codec,
                chunk_bytes=job.options.chunk_bytes, index=True, options=_opening.plan_options(job),
            )  # fmt: skip
            _parts.put(output, done)
    except BaseException as exc:
        # Nothing is removed: other parts' work stays, and a rerun of this part replaces its own.
        _parts.write_failure(output, i, n, plan_id, rank, job.options.run_id, exc)
        raise
    return job.report(todo=mine, parts=n, part=i)


Told = Callable[[list[int]], dict[int, str]]
"""Failures of these parts known outside the output (``_merge.parts.wait``'s ``told``)."""


def finalize(
    job: _opening.Job, parts: int | None, *, collective: bool = False, told: Told | None = None
) -> MergeReport:
    """After every part: check the part records (present, same plan), then index, consolidated
    metadata and completion marker — the same documents a one-process merge writes."""
    output = job.output
    if parts is None and job.options.timeout > 0:
        _await_a_part(output, job.options.timeout)
    if not _output.is_ours(output):
        if output.exists("") and output.listdir(""):
            raise _output.not_ours(output)
        raise MissingPartsError(
            f"{output.describe()}: no parts found; {_parts.RUN_EVERY_PART}",
            path=output.describe(),
            missing=[],
            parts=parts or 0,
        )
    with _lease.finalize(output) as lease:  # shared with parts; exclusive with a whole merge
        _output.refuse_links(output, overwrite=False)  # pruning through a linked folder deletes elsewhere
        return job.redone(lambda: _finalize_locked(job, parts, collective, lease, told))


def _await_a_part(output: Storage, timeout: float) -> None:
    """A finalize started with the parts (a SLURM array's last task): up to ``timeout`` seconds for
    the first part record, which tells it the part count; the records' own wait follows."""
    for _ in _poll.poll(timeout, first=0.05, cap=2.0):  # (it ends after the check at the deadline)
        try:
            if output.exists(_parts.PARTS_DIR) and _parts.read_records(output):
                return
        except SpillMergeError:
            return  # a damaged record: the finalize names it


def _finalize_locked(
    job: _opening.Job, parts: int | None, collective: bool, lease: _lease.Lease, told: Told | None
) -> MergeReport:
    output = job.output
    complete = output.exists(FO.COMPLETE_NAME)
    if complete and not job.options.overwrite:
        raise _output.complete_error(output, "finalize it again")
    records = _parts.read_records(output)
    n = parts if parts is not None else _parts.infer_parts(output, records)
    done = [r for r in records if isinstance(r, FO.PartDoneRecord) and r.parts == n]
    if not collective and done:
        # The parts decided the array documents: finalize with their codec and chunk size rather
        # than make every caller repeat them (the fingerprint still catches parts that disagree).
        before = (job.options.codec, job.options.chunk_bytes)
        job.options = replace(job.options, codec=done[0].codec, chunk_bytes=done[0].chunk_bytes)
        if (job.options.codec, job.options.chunk_bytes) != before:  # else the fingerprint stands
            job.fingerprint = fingerprint(job.plan, chunk_bytes=job.options.chunk_bytes, codec=job.options.codec)
    with job.phase("parts"):
        finished = _parts.wait(
            output,
            n,
            job.fingerprint,
            timeout=job.options.timeout,
            collective=collective,
            run_id=job.options.run_id if collective else None,
            options=_opening.plan_options(job),
            told=told,
        )
    with job.phase("metadata"):
        lease.check()
        if complete:
            output.rm_tree(FO.COMPLETE_NAME)
        lists = {lst.name for lst in job.plan.lists}
        if output.exists("lists") and not lists:
            output.rm_tree("lists")
        for folder, keep in (("columns", {c.name for c in job.plan.columns}), ("lists", lists)):
            for name in output.listdir(folder) if output.exists(folder) else ():
                if name not in keep and name != "zarr.json":  # left by an older merge into this output
                    output.rm_tree(f"{folder}/{name}")
        docs = job.docs()
        output.put_many({f"{path}/zarr.json": Z.json_doc(doc) for path, doc in docs.items() if path})
    with job.phase("index"):
        # Each part wrote its share of the index chunks; a part whose record does not say so (a
        # release before the shares) leaves its share to the finalize.
        chunks = _indexchunks.index_chunks(job.plan, docs)
        left = [c for p, r in enumerate(finished) if not r.index for c in _indexchunks.share(chunks, p, n)]
        _indexchunks.write(output, left, threads=job.threads)
    _opening.finish(job, docs, lease)
    report = job.report(parts=n)  # before the stored plan goes: the gaps against ``expected`` read it
    output.rm_tree(_planstore.PLAN_DIR)  # the parts are done with it (the output is complete)
    return report
