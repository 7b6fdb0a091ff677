"""The commit barrier on a spill root: what its records say of every rank (:class:`SpillState`),
stale segments of an earlier job, and the wait for every rank's commit record
(:func:`wait_for_commits`, :func:`commit_looks`), which says on stderr whom it waits for (:class:`WaitNotices`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .._errors import (
    CommitTimeout,
    CorruptSpillError,
    IncompleteSpillError,
    RankFailedError,
    SpillMergeError,
    StaleSpillError,
)
from .._format import spill as FS
from .._format.output import header
from .._storage import Storage
from .._util import poll as _poll
from .._util import progress as _progress
from .._util.units import duration_text as _duration
from .root import Segment, list_ranks, list_segments, scan

WAIT_NOTICE_FIRST, WAIT_NOTICE_EVERY = 2.0, 30.0
"""Seconds a merge waits for ranks to commit before it says so on stderr, then between two lines
(read at each call: a test shortens them)."""


@dataclass(frozen=True, slots=True)
class SpillState:
    """What a spill root holds for ranks ``0..world_size-1``."""

    world_size: int
    """World size the ranks ran with."""
    committed: list[Segment]
    """Segments to merge (committed, of the run when a run id was given)."""
    failed: dict[int, FS.FailureRecord]
    """Ranks whose newest relevant segment failed."""
    missing: list[int]
    """Ranks with no usable commit."""
    abandoned: list[Segment]
    """Uncommitted segments superseded by a later commit of the same rank (ignored)."""
    partial: dict[int, Segment]
    """Missing or failed rank → its newest uncommitted segment (what ``allow_partial`` salvages)."""


def assess(
    storage: Storage, segments: dict[int, list[Segment]], world_size: int | None, run_id: str | None
) -> SpillState:
    if world_size is None:
        sizes = {s.commit.world_size for segs in segments.values() for s in segs if s.commit is not None}
        sizes = sizes or {s.world_size for segs in segments.values() for s in segs if s.world_size is not None}
        if not sizes:
            output = storage.exists("zarr.json") and header(storage) is not None
            hint = "it is a merged output, not a spill root" if output else "is this a spill root?"
            raise IncompleteSpillError(f"{storage.describe()}: no spill segments found ({hint})", missing=[])
        if len(sizes) > 1:
            # The newest committed segment's run is taken as the one to merge; the others are stale.
            newest = max(
                (s for segs in segments.values() for s in segs if s.commit is not None),
                key=lambda s: s.name.split("-")[2],  # seg-SEQ-TIME-RAND: TIME in microseconds, UTC
                default=None,
            )
            world_size = newest.commit.world_size if newest is not None and newest.commit else max(sizes)
            raise stale_error(storage, stale_segments(storage, segments, world_size), world_size)
        world_size = sizes.pop()
    state = SpillState(world_size, committed=[], failed={}, missing=[], abandoned=[], partial={})
    stale = stale_segments(storage, segments, world_size)
    if stale:
        raise stale_error(storage, stale, world_size)
    extra = sorted(r for r in segments if r >= world_size)
    if extra:
        raise CorruptSpillError(
            f"{storage.describe()}: rank folders {extra[:10]} are outside world_size {world_size}",
            path=storage.describe(),
            rank=extra[0],
        )
    for rank in range(world_size):
        segs = segments.get(rank, [])
        state.committed.extend(s for s in segs if s.commit is not None)  # with a run id: earlier runs' too
        if run_id is None:  # the newest segment is the run's; an uncommitted one before a commit is abandoned
            last_commit = max((i for i, s in enumerate(segs) if s.commit is not None), default=-1)
            state.abandoned.extend(s for s in segs[:last_commit] if s.commit is None)
        mine = [s for s in segs if s.run_id == run_id] if run_id is not None else segs[-1:]
        if any(s.commit is not None for s in mine):
            continue
        failures = [s.failure for s in mine if s.failure is not None]
        if failures:
            state.failed[rank] = failures[-1]
        else:
            state.missing.append(rank)
        if mine:
            state.partial[rank] = mine[-1]
    return state


def stale_segments(storage: Storage, segments: dict[int, list[Segment]], world_size: int) -> dict[str, int]:
    """Segments left by an earlier run with another world size: committed ones whose commit
    record says so, and those in rank folders outside ``world_size`` (by their header), as
    path → the world size they were written with. An empty rank folder, or one whose segments
    say nothing, is no run's: ``assess`` reports it as it is."""
    out: dict[str, int] = {}
    for rank, segs in sorted(segments.items()):
        for s in segs:
            ws = s.commit.world_size if s.commit is not None else s.world_size if rank >= world_size else None
            if ws is not None and ws != world_size:
                out[storage.describe(s.rel)] = ws
    return out


def stale_error(storage: Storage, stale: dict[str, int], world_size: int) -> StaleSpillError:
    """The error naming stale segments (``stale_segments``) and the way out; nothing is corrupt."""
    sizes = ", ".join(map(str, sorted(set(stale.values()))))
    shown = ", ".join(f"{p} (world_size {ws})" for p, ws in list(stale.items())[:5])
    more = f" and {len(stale) - 5} more" if len(stale) > 5 else ""
    root = storage.describe()
    return StaleSpillError(
        f"{root} holds {len(stale)} segment(s) of an earlier run with world_size {sizes}, but this run has "
        f"world_size {world_size}: {shown}{more}. Nothing is corrupt, but runs of different world sizes cannot "
        f"be merged together: remove the spill root (or those segments), or spill to another root",
        path=root,
        world_size=world_size,
        stale=stale,
    )


def check_not_stale(storage: Storage, rank: int, world_size: int) -> None:
    """A writer's check before any compute: its own rank folder and rank 0's (which every run
    writes) hold no commit of another world size, and no rank folder lies outside
    ``world_size``; a few listings and small reads, whatever the size of the root."""
    segments = {rank: list_segments(storage, rank)}  # first its own folder, which open() lists anyway
    ranks = list_ranks(storage)
    for r in {0} & set(ranks) | set([r for r in ranks if r >= world_size][:5]):
        segments.setdefault(r, list_segments(storage, r))
    stale = stale_segments(storage, segments, world_size)
    if stale:
        raise stale_error(storage, stale, world_size)


def raise_for_state(storage: Storage, state: SpillState, *, waited_s: float | None = None) -> None:
    if state.failed:
        failures = {r: rec.summary() for r, rec in sorted(state.failed.items())}
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failures.items())
        raise RankFailedError(
            f"{len(failures)} rank(s) failed while spilling to {storage.describe()}: {detail}",
            failures=failures,
        )
    if state.missing:
        # rank -> path of its newest segment, which has neither commit nor failure record
        incomplete = {r: storage.describe(state.partial[r].rel) for r in state.missing if r in state.partial}
        parts = []
        for r in state.missing:
            if r in incomplete:
                journal = storage.listdir(f"{state.partial[r].rel}/{FS.JOURNAL_NAME}")
                n = sum(name.isdigit() for name in journal)  # one entry per data chunk made durable
                parts.append(f"rank {r} (uncommitted segment {incomplete[r]}, {n} chunk(s) flushed)")
            else:
                parts.append(f"rank {r} (no segment)")
        msg = (
            f"{storage.describe()}: {len(state.missing)} of {state.world_size} rank(s) have no commit "
            f"record: {', '.join(parts[:20])}{' ...' if len(parts) > 20 else ''}"
        )
        if waited_s is not None:
            raise CommitTimeout(
                f"{msg} after waiting {waited_s:.1f} s; check those ranks' logs, or merge what is "
                "committed with allow_partial=True (--allow-partial)",
                missing=state.missing,
                incomplete=incomplete,
                waited_s=waited_s,
            )
        raise IncompleteSpillError(
            f"{msg}; wait for them (timeout=...) or merge what is committed with allow_partial=True (--allow-partial)",
            missing=state.missing,
            incomplete=incomplete,
        )


def commit_looks(
    storage: Storage, world_size: int | None, run_id: str | None
) -> Iterator[tuple[SpillState, dict[int, list[Segment]]]]:
    """Every rank's state (and the segments it was assessed from) at each ``next()``: the first
    look lists the whole root, later ones only the ranks still missing."""
    segments = scan(storage)
    while True:
        state = assess(storage, segments, world_size, run_id)
        yield state, segments
        for rank in state.missing:
            segments[rank] = list_segments(storage, rank)


def wait_for_commits(
    storage: Storage,
    *,
    world_size: int | None,
    run_id: str | None,
    timeout: float,
    allow_partial: bool = False,
    progress: bool | None = None,
) -> SpillState:
    """The barrier: poll storage (with backoff, re-reading only unfinished ranks) until every rank
    has committed; fail fast on a failure record; time out naming the missing ranks. Unless
    ``progress`` is False, a line on stderr says which ranks it waits for and what each is doing
    (:class:`WaitNotices`)."""
    looks = commit_looks(storage, world_size, run_id)
    notices = WaitNotices(storage, timeout, quiet=progress is False)
    for waited in _poll.poll(timeout, first=0.05, cap=2.0):
        state, segments = next(looks)
        if state.failed or not state.missing:
            break
        if waited < timeout:
            notices(state, segments, run_id)
        elif allow_partial:
            return state
        else:
            raise_for_state(storage, state, waited_s=waited if timeout > 0 else None)
    if state.failed and not allow_partial:
        raise_for_state(storage, state)
    return state


class WaitNotices:
    """What a merge waiting for commit records says on stderr (a batch job's log too: where a hung
    merge is looked for), unless ``quiet``: after ``WAIT_NOTICE_FIRST`` seconds, then every
    ``WAIT_NOTICE_EVERY``, one line naming each missing rank (up to 8) and what storage shows of
    it: no segment, or writing, with the frames flushed and the age of the last (``progress.json``)."""

    def __init__(self, storage: Storage, timeout: float, *, quiet: bool = False) -> None:
        self.storage, self.timeout, self.quiet = storage, timeout, quiet
        self.start = time.monotonic()
        self.noticed: float | None = None

    def due(self) -> bool:
        """Is a line due now?"""
        waited = time.monotonic() - self.start
        return not self.quiet and waited >= (
            WAIT_NOTICE_FIRST if self.noticed is None else self.noticed + WAIT_NOTICE_EVERY
        )

    def __call__(
        self, state: SpillState, segments: dict[int, list[Segment]], run_id: str | None,
        waiting: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Print a line if one is due, naming ``waiting`` (default: the ranks without a commit
        record; a coordinated merge: those not at merge() either)."""
        missing = state.missing if waiting is None else waiting
        if not missing or not self.due():
            return
        waited = self.noticed = time.monotonic() - self.start
        shown = [self._rank_text(r, state, segments, run_id) for r in missing[:8]]
        more = len(missing) - len(shown)
        ranks = ", ".join(shown) + (f" and {more} more" if more > 0 else "")
        print(
            f"spillmerge merge: waiting for {len(missing)} of {state.world_size} rank(s) to commit to "
            f"{self.storage.describe()} ({waited:.0f} s of {self.timeout:g} s): {ranks}",
            file=sys.stderr,
            flush=True,
        )

    def _rank_text(self, rank: int, state: SpillState, segments: dict[int, list[Segment]], run_id: str | None) -> str:
        seg = state.partial.get(rank)
        if seg is None:
            of_run = " of this run" if run_id is not None and segments.get(rank) else ""
            return f"rank {rank} (no segment{of_run} yet: has it started?)"
        try:
            rec = _progress.read(self.storage, seg.rel)
        except SpillMergeError:  # an advisory record: the notice goes on without it
            rec = None
        now = time.time()
        if rec is not None and rec.frames:
            return f"rank {rank} (writing, {rec.frames} frames flushed, last write {_duration(now - rec.updated)} ago)"
        started = _progress.iso_to_unix((seg.header or {}).get("started"))
        since = f" for {_duration(now - started)}" if started is not None else ""
        return f"rank {rank} (writing{since}, nothing flushed yet)"
