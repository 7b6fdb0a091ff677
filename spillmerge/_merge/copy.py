"""The byte-copy engine's schedule: the output chunks of the columns' ``values`` (units), written
by a bounded pool of threads — at most a memory budget of chunks in flight (docs/GUARANTEES.md,
*Memory*). A merge in parts gives each part a share of the units (:func:`split`), so no
two processes ever write the same object. One chunk's copy is ``_merge.outputchunk``."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .._util.progress import bar as progress_bar
from .documents import values_chunk
from .opening import Job, copy_threads
from .outputchunk import OutputChunk, PendingBlocks, Unit
from .plan import Plan


def units(plan: Plan, chunk_bytes: int) -> list[Unit]:
    """Every output chunk of every column, in column order (deterministic: parts split this list)."""
    out: list[Unit] = []
    for ci, col in enumerate(plan.columns):
        n = col.n_units
        if n == 0 or col.unit_bytes == 0:
            continue  # no elements: the array has no chunk to write
        k = values_chunk(col, chunk_bytes)
        for j, lo in enumerate(range(0, n, k)):
            hi = min(lo + k, n)
            out.append(Unit(ci, j, lo, hi, k, max((hi - lo) * col.unit_bytes, 1)))
    return out


def split(plan: Plan, every: Sequence[Unit], parts: int) -> list[list[int]]:
    """Positions in ``every`` (:func:`units`) of the output chunks each of ``parts`` parts writes:
    the chunks in key order (where each starts in its column, as a fraction of it, then column)
    cut into ``parts`` runs of about equal bytes, so a part reads one range of a stored plan. A
    unit is one whole chunk: no two processes write one object (zarr-python#3682 loses rows when
    processes share a chunk), and every process computes the same split from the same plan."""
    size = [max(plan.columns[c].n_units, 1) for c in range(len(plan.columns))]
    order = sorted(range(len(every)), key=lambda k: (every[k].lo / size[every[k].column], every[k].column))
    total = sum(u.nbytes for u in every)
    out: list[list[int]] = [[] for _ in range(parts)]
    done = 0
    for k in order:
        nb = every[k].nbytes
        out[min(parts - 1, (2 * done + nb) * parts // max(2 * total, 1))].append(k)
        done += nb
    return [sorted(ks) for ks in out]


def copy_units(job: Job, todo: list[Unit], check: bool = False) -> None:
    """Write the output chunks ``todo`` of ``job``, at most its ``memory_budget`` bytes of chunks in
    flight over ``copy_threads`` threads, each fsynced (``fsync``) by the thread that wrote it; a
    progress bar when ``progress`` (None: on a terminal). ``check``: only read and check their
    source rows (before a complete output is replaced)."""
    o, threads = job.options, copy_threads(job, todo)
    cond = threading.Condition()
    in_flight = 0
    errors: list[BaseException] = []
    pending = PendingBlocks()
    chunk_bytes = np.array([s.chunk_bytes for s in job.plan.segments], dtype=np.int64)
    bar = progress_bar(sum(u.nbytes for u in todo), "check" if check else "merge", show=o.progress, unit_divisor=1024)

    def run(u: Unit) -> None:
        chunk = OutputChunk(job.src, job.plan, u, chunk_bytes, pending)
        chunk.check() if check else chunk.write(job.output, o.codec, o.fsync)
        bar.update(u.nbytes)

    def done(fut: Future[None], size: int) -> None:
        nonlocal in_flight
        with cond:
            in_flight -= size
            exc = fut.exception()
            if exc is not None:
                errors.append(exc)
            cond.notify_all()

    with bar:
        if threads <= 1:  # one chunk at a time in this thread: a small merge starts no pool
            for u in todo:
                run(u)
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spillmerge-merge") as pool:
                for u in todo:
                    with cond:
                        # Bounded memory: wait until this chunk fits in the budget (one chunk always may run).
                        while in_flight and in_flight + u.nbytes > o.memory_budget and not errors:
                            cond.wait()
                        if errors:
                            break
                        in_flight += u.nbytes
                    pool.submit(run, u).add_done_callback(functools.partial(done, size=u.nbytes))
    if errors:
        raise errors[0]
    pending.finish()
