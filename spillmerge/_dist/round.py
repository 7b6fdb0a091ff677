"""The merge round: what every rank's ``SpillWriter.merge`` call does, who merges, who waits, and
how the outcome and failures travel. The writer delegates here; nothing below imports it.

Protocol (every rank calls :meth:`Rounds.merge` through ``SpillWriter.merge``):
  (every rank)    check the options alike; when torch.distributed is initialised with the writer's
                  rank and world size (:func:`coordinated`) and ``transport`` is not ``"storage"``,
                  the first round of a writer session runs ``_dist.transfer.transfer_shards`` so ``dst``
                  can read every committed shard under its own root (on ``dst`` as the first step
                  of its merge: a failed transfer is the round's outcome, told to waiting ranks)
  (dst)           ``_merge.job.merge`` (``parallel``: every rank runs ``_merge.job.merge_parallel`` and
                  ``dst`` finalizes; a part that fails tells it through the store), then
                  ``_dist.store.publish_merge_outcome``; a failure is also recorded in the spill
                  root when the others wait
  (other ranks)   return ``None``, or with ``wait`` :func:`wait_complete`: this round's completion
                  marker in the output, ``dst``'s outcome in the store, or its failure record
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .._errors import ConfigError, CorruptSpillError, MergeFailedError, MergeTimeout, SpillValueError
from .._format import output as FO
from .._format import spill as FS
from .._merge import parts as _parts
from .._merge.job import merge, merge_parallel
from .._merge.report import MergeReport
from .._storage import Storage, output_options
from .._util import poll as _poll
from .store import OutcomeWatch, dist_initialized, part_failures, publish_merge_outcome, publish_part_failure
from .transfer import Session, TransferInfo, check_options, transfer_shards


class Rounds:
    """The merge rounds of one writer session (``SpillWriter.merge`` calls). The first
    coordinated round moves every shard where ``dst`` reads it; a later round of the same writer
    (another output or duplicate policy) needs no coordination."""

    def __init__(self) -> None:
        self.shards_here = False
        """Set by a completed coordinated round: ``dst``'s root holds every committed shard."""
        self.calls = 0
        """This session's rounds so far: every rank calls ``merge`` alike, so it names a round's keys."""

    def merge(
        self,
        session: Session,
        out: str,
        dst: int,
        /,  # kwargs go to the merge, and may hold a `session` of their own
        *,
        wait: bool,
        parallel: bool,
        transport: str,
        transfer_chunk_bytes: int,
        transfer_timeout: float,
        **kwargs: Any,
    ) -> MergeReport | None:
        """One round, on this rank (``SpillWriter.merge`` documents the arguments)."""
        self.calls += 1
        if not 0 <= dst < session.world_size:
            raise SpillValueError(f"dst={dst} is not a rank of world_size {session.world_size}")
        check_options(transport, transfer_chunk_bytes, transfer_timeout)
        for key in ("world_size", "run_id"):
            if key in kwargs:
                raise SpillValueError(f"{key}= cannot be passed to SpillWriter.merge: the merge takes the writer's own")
        kwargs.setdefault("timeout", 1800.0)
        kwargs.setdefault("storage_options", session.storage.storage_options)
        kwargs.setdefault("session", session.number)  # names this round in the completion marker
        network = transport in ("nccl", "gloo")
        root = session.storage.url
        if parallel:  # every rank writes a part; dst finalizes
            if network:
                raise ConfigError(
                    "parallel=True needs every rank to see the spill root; it cannot be combined with "
                    f"transport={transport!r}",
                    key="transport",
                )
            told = part_failures(session.run_id, session.number, self.calls)
            part = functools.partial(
                merge_parallel, root, out, rank=session.rank, world_size=session.world_size, dst=dst,
                run_id=session.run_id, told=told, **kwargs,
            )  # fmt: skip
            if session.rank != dst:
                try:  # dst's own part runs in its merge_parallel call, which then finalizes
                    part()
                except BaseException as exc:  # told to dst at once, also before the part had a plan
                    publish_part_failure(session.run_id, session.number, self.calls, session.rank, exc)
                    raise
            return _merge_on_dst(session, self.calls, out, dst, wait, kwargs, part, parts=True)
        if network and not coordinated(session):
            raise ConfigError(
                f"transport={transport!r} needs torch.distributed initialised with this writer's rank "
                f"{session.rank} and world_size {session.world_size}",
                key="transport",
            )

        # one spelling of the output, to compare the ranks' (absolute; a URL without a final /)
        spelling = os.path.abspath(out) if "://" not in os.fspath(out) else os.fspath(out).rstrip("/")

        def transfer() -> TransferInfo | None:  # the class docstring says when
            if transport == "storage" or not coordinated(session) or self.shards_here:
                return None
            info = transfer_shards(
                session, dst, transport, transfer_chunk_bytes, transfer_timeout, float(kwargs["timeout"]),
                progress=kwargs.get("progress"), out=spelling if wait or session.rank == dst else None,
            )  # fmt: skip
            self.shards_here = True
            return info

        def run() -> MergeReport | None:
            info = transfer()  # on dst, inside the round: a failed transfer is told to the waiting ranks
            report = merge(root, out, world_size=session.world_size, run_id=session.run_id, **kwargs)
            return report if info is None else info.add_to(report)

        if session.rank != dst:
            transfer()
        return _merge_on_dst(session, self.calls, out, dst, wait, kwargs, run)


def coordinated(session: Session) -> bool:
    """True when torch.distributed is initialised with this writer's rank and world size."""
    if session.world_size < 2 or not dist_initialized() or session.run_id is None:
        return False
    return bool(dist.get_rank() == session.rank and dist.get_world_size() == session.world_size)


def _merge_on_dst(
    session: Session,
    round_: int,
    out: str,
    dst: int,
    wait: bool,
    kwargs: dict[str, Any],
    run: Callable[[], MergeReport | None],
    *,
    parts: bool = False,
) -> MergeReport | None:
    """``dst`` runs ``run()`` and tells waiting ranks how it ended (store and spill root); the
    others wait for the output when ``wait``, else return None."""
    n = session.number
    if session.rank != dst:
        if wait:
            opts = output_options(
                session.storage.url, out, kwargs["storage_options"], kwargs.get("out_storage_options")
            )
            output = Storage(out, opts)
            wait_complete(
                output, session.storage, run_id=session.run_id, session=n, dst=dst, timeout=float(kwargs["timeout"]),
                round_=round_, detail=functools.partial(_missing_parts, output, session.world_size) if parts else None,
            )  # fmt: skip
        return None
    try:
        report = run()
    except BaseException as exc:
        if wait:  # the other ranks (called with the same wait=True) are waiting: tell them on storage too
            # (ROOT/spillmerge-failed.json, in the spill root every rank knows; never in the output,
            # which may not be ours). Best effort: storage may be what failed, the store tells them too.
            with contextlib.suppress(Exception):  # the merge's own error matters more
                record = FS.MergeFailureRecord.of(exc, rank=session.rank, run_id=session.run_id, session=n)
                session.storage.put_atomic(FS.MERGE_FAILED_NAME, record.to_json())
        publish_merge_outcome(
            session.run_id, n, round_, {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        )
        raise
    publish_merge_outcome(session.run_id, n, round_, {"ok": True})
    return report


def wait_complete(
    output: Storage,
    spill: Storage,
    *,
    run_id: str | None,
    session: int,
    dst: int,
    timeout: float,
    round_: int = 1,
    detail: Callable[[], str] | None = None,
) -> None:
    """A rank other than ``dst``: return once the output holds a completion marker of this run
    (``run_id``), or the process group's store says the merge succeeded (:class:`OutcomeWatch`); raise
    :class:`MergeFailedError` naming ``dst`` as soon as its merge is known to have failed (the
    store, or a failure record of this run in the spill root); :class:`MergeTimeout` after
    ``timeout`` seconds. ``round_``: which merge round of the writer session this is (1, 2, ...).
    While the store answers, it alone tells a failure: the spill root's failure record may be an
    earlier round's of the same session. ``detail()``: what the timeout's message adds."""
    outcome = OutcomeWatch(run_id, session, round_)
    for waited in _poll.poll(timeout, first=0.002, cap=1.0, factor=1.25):  # a small merge takes ms
        told = outcome.poll()
        if told is not None:
            if told.get("ok"):
                return
            _raise_failed(output, spill, dst, str(told.get("error", "unknown error")))
        # A later round of one writer session into the same output finds the earlier round's
        # marker (it names run and session only): while the store answers, it alone tells.
        if (round_ == 1 or outcome.store is None) and complete_for(output, run_id, session):
            return
        raw = spill.get_or_none(FS.MERGE_FAILED_NAME, max_bytes=1 << 20) if outcome.store is None else None
        with contextlib.suppress(CorruptSpillError):  # a torn or foreign record: no failure of this round
            rec = FS.MergeFailureRecord.from_json(raw, path=spill.describe(FS.MERGE_FAILED_NAME)) if raw else None
            if rec is not None and rec.run_id == run_id and rec.session == session:
                _raise_failed(output, spill, rec.rank, rec.summary())
        if waited >= timeout:
            known = detail() if detail is not None else ""
            raise MergeTimeout(
                f"waited {waited:.0f} s for rank {dst} to complete the merge into {output.describe()}; it neither "
                f"finished nor recorded a failure there{known}. Check rank {dst}'s log (was it killed?), and that "
                "every rank sees the output (wait=True needs shared storage for the output)",
                path=output.describe(),
                waited_s=waited,
            )


def _missing_parts(output: Storage, n: int) -> str:
    """For a waiting rank's timeout in a merge in parts: the parts (part ``i`` is rank ``i``) that
    have no completion record of ``n`` parts, or nothing when that cannot be told."""
    try:
        done = {r.part for r in _parts.read_records(output) if isinstance(r, FO.PartDoneRecord) and r.parts == n}
    except Exception:  # noqa: BLE001 - only the message's detail is lost
        return ""
    missing = [_parts.describe(p, n, p) for p in range(n) if p not in done]
    if not missing:
        return ""
    return f" (no completion record from {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''})"


def complete_for(output: Storage, run_id: str | None, session: int) -> bool:
    obj = FO.json_or_none(output, FO.COMPLETE_NAME, 1 << 20)
    return isinstance(obj, dict) and obj.get("run_id") == run_id and obj.get("session") == session


def _raise_failed(output: Storage, spill: Storage, dst: int, error: str) -> None:
    raise MergeFailedError(
        f"the merge into {output.describe()} failed on rank {dst}: {error} (its traceback is in "
        f"{spill.describe(FS.MERGE_FAILED_NAME)} or rank {dst}'s log)",
        rank=dst,
        failures={dst: error},
    )
