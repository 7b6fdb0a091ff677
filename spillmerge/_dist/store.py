"""Run-store signalling: the keys a job's ranks exchange through the process group's store.

torch.distributed's default store (a TCP key-value store on CPU every process group already has)
carries, under ``spillmerge/RUN_ID/``:

- ``failed/A/R`` (and the counter ``failed/A``): rank R's A-th writer session of the run failed
  (:func:`publish_failure`, written by ``SpillWriter.abort``; read by :class:`Coord` waits);
- ``merge-outcome/A/M``: how ``dst``'s M-th merge round of session A ended
  (:func:`publish_merge_outcome`; ranks waiting for the output watch it with :class:`OutcomeWatch`);
- ``part-failed/A/M/R``: rank R's part of the M-th round (``merge(parallel=True)``) of session A
  failed (:func:`publish_part_failure`; ``dst``'s finalize asks :func:`part_failures`);
- ``merge-A/...``: the JSON messages of one coordinated merge (:class:`Coord`: ``meta``,
  ``plan``, ``sees``, ``senders``, ``go``, ``abort``; see ``_dist.transfer.transfer_shards``).

No collective and no GPU: every wait polls the store with backoff and ends by its timeout.
Without torch.distributed (or a run id) nothing is published and the ranks rely on storage.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from .._errors import CommitTimeout, CoordinationError, RankFailedError, SpillMergeError
from .._util import poll as _poll

DONE_CHECK_MAX = 10.0
"""Longest pause between dst's checks of storage for commit records while ranks have not reached merge()."""


_SESSIONS: dict[str, itertools.count[int]] = {}


def next_session(run_id: str | None) -> int:
    """The number of this process's writer session within run ``run_id`` (0, 1, ...). Ranks that
    call the same code open the same number of writers, so "the A-th session" names the same
    round on every rank: a failure of round 0 (a crash) does not fail round 1 (the rerun) in the
    same process group."""
    return next(_SESSIONS.setdefault(run_id or "", itertools.count()))


def dist_initialized() -> bool:
    return bool(dist.is_available() and dist.is_initialized())


def _run_store(run_id: str | None) -> Any:
    """This run's keys in the process group's store, or None without torch.distributed (or a run
    id). Raises whatever the store raises."""
    if run_id is None or not dist_initialized():
        return None
    return dist.PrefixStore(f"spillmerge/{run_id}/", distributed_c10d._get_default_store())


def _publish(run_id: str | None, key: str, value: str, count: str | None = None) -> None:
    """Set ``key`` in the run's store (and add 1 to ``count``). Best effort: the caller's own error
    matters more, and the waiting ranks also watch storage."""
    with contextlib.suppress(Exception):
        store = _run_store(run_id)
        if store is not None:
            store.set(key, value)
            if count is not None:
                store.add(count, 1)


def publish_failure(run_id: str | None, rank: int, message: str, *, session: int = 0) -> None:
    """Tell a waiting ``dst`` at once that this rank's ``session``-th writer failed."""
    _publish(run_id, f"failed/{session}/{rank}", message[:4000], f"failed/{session}")


def publish_merge_outcome(run_id: str | None, session: int, round_: int, outcome: dict[str, Any]) -> None:
    """``dst``: tell ranks waiting for the output (``SpillWriter.merge(wait=True)``) how the
    merge ended: ``{"ok": true}`` or ``{"ok": false, "error": "Type: message"}``."""
    _publish(run_id, f"merge-outcome/{session}/{round_}", json.dumps(outcome)[:8000])


def publish_part_failure(run_id: str | None, session: int, round_: int, rank: int, exc: BaseException) -> None:
    """Tell ``dst``'s finalize at once that this rank's part failed, also before the part knew its
    plan (its failure record under the output counts only for a plan)."""
    _publish(run_id, f"part-failed/{session}/{round_}/{rank}", f"{type(exc).__name__}: {exc}"[:4000])


class _StoreView:
    """The run's store as a waiting rank reads it: once the store is gone (its host process,
    usually rank 0, exited) every answer is None and the caller relies on storage alone."""

    def __init__(self, run_id: str | None) -> None:
        try:
            self.store: Any = _run_store(run_id)
        except Exception:  # noqa: BLE001 - no store: storage only
            self.store = None

    def _ask(self, question: Callable[[Any], Any]) -> Any:
        if self.store is None:
            return None
        try:
            return question(self.store)
        except Exception:  # noqa: BLE001 - the store's host went away: storage only from now on
            self.store = None
            return None


def part_failures(run_id: str | None, session: int, round_: int) -> Callable[[list[int]], dict[int, str]]:
    """``dst``'s check for :func:`publish_part_failure`: ``told(ranks)`` maps those of ``ranks``
    whose part failed to "Type: message"; nothing once the store is gone (the part records on
    storage remain)."""
    view, prefix = _StoreView(run_id), f"part-failed/{session}/{round_}"

    def told(ranks: list[int]) -> dict[int, str]:
        keys = {r: f"{prefix}/{r}" for r in ranks}
        got = view._ask(lambda s: {r: s.get(k).decode(errors="replace") for r, k in keys.items() if s.check([k])})
        return got or {}

    return told


class OutcomeWatch(_StoreView):
    """A waiting rank's view of ``merge-outcome`` in the process group's store: ``poll()`` returns
    the outcome once published, else None."""

    def __init__(self, run_id: str | None, session: int, round_: int) -> None:
        super().__init__(run_id)
        self.key = f"merge-outcome/{session}/{round_}"  # an earlier round's outcome is not this one's

    def poll(self) -> dict[str, Any] | None:
        got = self._ask(lambda s: json.loads(s.get(self.key)) if s.check([self.key]) else None)
        return got if isinstance(got, dict) else None


# ------------------------------------------------------------------------------ coordination
class Coord:
    """JSON messages through the process group's store (a TCP key-value store on CPU). Waits poll
    with backoff (at most 4 times a second) and look for failures each time, so a failed rank or
    an aborted merge ends every wait promptly and every wait ends by ``timeout``."""

    def __init__(self, run_id: str, rank: int, world_size: int, dst: int, timeout: float, session: int = 0) -> None:
        self.base = _run_store(run_id)
        self.session = session
        self.diagnose: Callable[[], dict[int, str]] = dict  # none known until the caller says
        """Failure records of this run on storage (rank -> "Type: message"), for a lost store."""
        # One coordinated merge per writer session (later merges of a writer need none), so the
        # session number names this merge's keys alike on every rank, even where an earlier
        # round failed before merging on some ranks.
        self.store = dist.PrefixStore(f"merge-{session}/", self.base)
        self.rank, self.world_size, self.dst, self.timeout = rank, world_size, dst, timeout

    def put(self, key: str, obj: Any) -> None:
        try:
            self.store.set(key, json.dumps(obj))
        except RuntimeError as exc:  # the store's host went away before we could publish
            raise self._store_lost(f"publishing {key}", exc) from exc

    def _store_lost(self, what: str, exc: BaseException) -> SpillMergeError:
        """The store's host went away (rank 0 exited, usually because some rank failed): name the
        root cause from the failure records on storage when this rank can see them."""
        failures = self.diagnose()
        lost = f"rank {self.rank}: lost the process group's store (hosted by rank 0) while {what} ({exc})"
        if failures:
            names = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
            return RankFailedError(
                f"{lost}; the spill root records the cause: rank(s) {sorted(failures)} failed ({names})",
                failures=failures,
            )
        return CoordinationError(
            f"{lost}; no failure record is visible on this rank's storage: look at rank 0's log first, then at "
            "each rank's ROOT/rank-RRRRR/seg-*/failed.json where the spill roots live",
            rank=self.rank,
        )

    def abort(self, exc: BaseException) -> None:
        """Publish why the merge stopped; every waiting rank raises it."""
        doc = {
            "rank": self.rank,
            "type": type(exc).__name__,
            "message": str(exc)[:4000],
            "failures": {str(k): v for k, v in getattr(exc, "failures", {}).items()},
        }
        with contextlib.suppress(Exception):  # the store may be what failed
            self.store.set("abort", json.dumps(doc))

    def _check_failures(self, pending: list[int]) -> None:
        if int(self.base.add(f"failed/{self.session}", 0)) > 0:
            failed = {
                r: self.base.get(f"failed/{self.session}/{r}").decode(errors="replace")
                for r in pending
                if self.base.check([f"failed/{self.session}/{r}"])
            }
            if failed:
                # Every rank whose failure record exists, not only those that reached the store
                # first: two ranks failing together are both named.
                for r, m in self.diagnose().items():
                    failed.setdefault(r, m)
                names = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
                raise RankFailedError(f"rank(s) {sorted(failed)} failed before the merge ({names})", failures=failed)
        if self.store.check(["abort"]):
            doc = json.loads(self.store.get("abort"))
            msg = f"rank {self.rank}: the merge stopped on rank {doc['rank']}: {doc['type']}: {doc['message']}"
            if doc["failures"]:
                raise RankFailedError(msg, failures={int(k): v for k, v in doc["failures"].items()})
            raise CoordinationError(msg, rank=self.rank)

    def _absent(self) -> list[int]:
        """The ranks that never posted ``meta`` (never reached the merge round); none once the store is gone."""
        try:
            return [r for r in range(self.world_size) if not self.store.check([f"meta/{r}"])]
        except RuntimeError:
            return []

    def collect(self, prefix: str, what: str, done: Callable[[], bool] | None = None) -> dict[int, Any]:
        """Wait for ``prefix/R`` from every rank R, or until ``done()`` (asked after 1 s, then
        less and less often, at most every 10 s: it may list storage) says waiting is no longer
        needed; then the replies so far."""
        return self._wait({r: f"{prefix}/{r}" for r in range(self.world_size)}, what, done)

    def wait_one(self, key: str, what: str) -> Any:
        return self._wait({self.dst: key}, what)[self.dst]

    def _wait(self, keys: dict[int, str], what: str, done: Callable[[], bool] | None = None) -> dict[int, Any]:
        pending = dict(keys)
        got: dict[int, Any] = {}
        done_every = 1.0
        next_done = time.monotonic() + done_every
        for waited in _poll.poll(self.timeout, first=0.001, cap=0.25, factor=1.25):  # a small round waits ms
            try:
                for r, key in list(pending.items()):
                    if self.store.check([key]):
                        got[r] = json.loads(self.store.get(key))
                        del pending[r]
                if not pending:
                    return got
                self._check_failures(sorted(pending))
                if done is not None and time.monotonic() >= next_done:
                    if done():
                        return got
                    done_every = min(done_every * 1.5, DONE_CHECK_MAX)
                    next_done = time.monotonic() + done_every
            except SpillMergeError:
                raise
            except RuntimeError as exc:  # the store itself is gone (its host process died)
                raise self._store_lost(what, exc) from exc
            if waited >= self.timeout:
                missing = sorted(pending)
                absent = self._absent() if missing == [self.dst] and self.rank != self.dst else []
                if absent and absent != missing:  # dst is there, itself waiting for them
                    what = f"{what}; rank {self.dst} waits for them"
                    missing = absent
                raise CommitTimeout(
                    f"rank {self.rank}: rank(s) {missing} did not arrive within {self.timeout:.0f} s "
                    f"({what}); did they crash, or not call SpillWriter.merge()?",
                    missing=missing,
                    waited_s=waited,
                )
        raise AssertionError("unreachable: poll() ends only after a check at the deadline")  # pragma: no cover
