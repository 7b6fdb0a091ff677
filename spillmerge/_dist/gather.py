"""One-call replacements of ``torch.distributed.gather_object`` / ``all_gather_object``.

Protocol (every rank calls the same function, like the torch collectives):
  (every rank)  SpillWriter(root) → write_batch(preds, a batch of frames at a time; flat records one
                write() each) → commit → SpillWriter.merge(out, dst, wait=True)
  (dst)         merges; (every rank) returns once the output is complete (or raises naming dst)
  (dst)         its merge removes the segments the output was merged from (remove_spill), unless keep_spill
  (other ranks) wait for dst's outcome, remove their own segment if still there (a node-local root)
  (every rank)  a barrier: nobody starts the next call while this call's spill is being removed
  gather: dst returns the opened :class:`MergedStore`, the others None; all_gather: every rank.
"""

from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from .._errors import ConfigError, CoordinationError, IncompleteOutputError, MergeFailedError
from .._read.store import MergedStore
from .._read.store import open as open_store
from .._storage import output_options
from .._util.gcpause import gc_paused
from .._util.poll import poll
from .._write.batch import mapping_items
from .._write.writer import SpillWriter
from .rank import on_gloo, refused, resolve_run_id
from .round import coordinated
from .store import OutcomeWatch

CHUNK_BYTES = 4 << 20
"""The chunk (and staging buffer) size of a call's writer: every prediction is in memory already
and written at once, so larger staging buffers would only add to each rank's peak."""


class CallWriter(SpillWriter):
    """The writer of one call: ``CHUNK_BYTES`` chunks, two of them, unless told otherwise; its
    flush thread starts only if a chunk fills, so a small call's one chunk is written,
    checksummed and journaled by its commit in the caller's thread (no thread started, no spare
    buffer prefaulted)."""

    _flush_at_commit = True
    _counts_refusal = False  # gather counts a refused writer, a bad option name included

    def __init__(self, *args: Any, chunk_bytes: int = CHUNK_BYTES, staging_bytes: int = 2 * CHUNK_BYTES, **kw: Any):
        super().__init__(*args, chunk_bytes=chunk_bytes, staging_bytes=staging_bytes, **kw)


def default_root(out: str | os.PathLike[str]) -> str:
    """The spill root ``gather`` / ``all_gather`` use when none is given: ``OUT.spill`` next to
    the output (never inside it)."""
    return os.fspath(out).rstrip("/") + ".spill"


def gather(
    preds: Mapping[str, Any],
    out: str | os.PathLike[str],
    *,
    dst: int = 0,
    root: str | os.PathLike[str] | None = None,
    keep_spill: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: float = 1800.0,
    overwrite: bool = True,
    writer_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    **merge_options: Any,
) -> MergedStore | None:
    """Replace ``dist.gather_object``: every rank passes its predictions (anything
    :meth:`SpillWriter.update` accepts: ``{filename: (frame_idx, value)}`` or
    ``{filename: {frame_idx: value}}``); rank ``dst`` gets the merged :class:`MergedStore` of
    every rank's predictions, the other ranks ``None``.

    Nothing is pickled and nothing is staged on a GPU: each rank spills to ``root`` (default
    ``OUT.spill``, next to the output), ``dst`` merges into ``out`` (replacing an earlier output
    there: ``overwrite`` defaults to True), and every rank returns once the output is complete
    and the segments it was merged from are removed, with the root when left empty
    (``keep_spill=True`` keeps them); so the next call with the same ``out`` can start at once. Rank and world size come from
    torch.distributed when it is initialised, else env ``RANK`` / ``WORLD_SIZE``, else 0 / 1.

    A crash leaves the spill root behind with what each rank committed: calling again with the
    same ``out`` merges those segments together with the new ones (identical duplicates are
    dropped); delete the spill root to start afresh. ``merge_options`` go to
    :meth:`SpillWriter.merge` (``codec``, ``transport`` ...); ``writer_options`` to
    :class:`SpillWriter` (``chunk_bytes`` ...). ``allow_pickle=True`` pickles values of no
    other kind (``gather_object``'s behaviour) and opens the result with ``allow_pickle=True``;
    off by default, so nothing is pickled or unpickled unless the caller asks.
    """
    out = os.fspath(out)
    spill = os.fspath(root) if root is not None else default_root(out)
    opts: dict[str, Any] = {"allow_pickle": allow_pickle, **(writer_options or {})}
    # The run id is agreed on here, within the call's timeout: the writer's own agreement sets
    # up a process group (dist.new_group) that would wait 300 s for a rank that exited.
    opts["run_id"] = resolve_run_id(opts.get("run_id"), timeout)
    try:
        writer = CallWriter(spill, rank, world_size, storage_options, **opts)
    except Exception as exc:
        refused(opts["run_id"], rank, world_size, exc)
        raise
    with writer as w:
        gc_paused(_write_all, w, preds)  # builds only acyclic lists and buffers
    # dst removes exactly the segments the output was merged from inside its merge (a segment of
    # a later call is never among them), before it tells the waiting ranks how the merge ended.
    merge_options = {"remove_spill": not keep_spill, **merge_options}
    w.merge(out, dst, wait=True, timeout=timeout, overwrite=overwrite, storage_options=storage_options, **merge_options)
    finish_call(w, dst, keep_spill, timeout)
    if w.rank != dst:
        return None
    out_options = output_options(spill, out, storage_options, merge_options.get("out_storage_options"))
    return open_store(out, storage_options=out_options, allow_pickle=allow_pickle)


def all_gather(
    preds: Mapping[str, Any],
    out: str | os.PathLike[str],
    *,
    dst: int = 0,
    root: str | os.PathLike[str] | None = None,
    keep_spill: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: float = 1800.0,
    overwrite: bool = True,
    writer_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    **merge_options: Any,
) -> MergedStore:
    """Replace ``dist.all_gather_object``: like :func:`gather`, but every rank gets the merged
    :class:`MergedStore` (lazy: a rank reads only what it indexes, from storage every rank sees;
    nothing is copied to every rank's memory). Rank ``dst`` does the merge; a failure there is
    raised on every rank as :class:`~spillmerge.MergeFailedError` naming ``dst``."""
    store = gather(
        preds, out, dst=dst, root=root, keep_spill=keep_spill, rank=rank, world_size=world_size,
        storage_options=storage_options, timeout=timeout, overwrite=overwrite, writer_options=writer_options,
        allow_pickle=allow_pickle, **merge_options,
    )  # fmt: skip
    if store is None:  # a rank other than dst, once the output is complete
        spill = os.fspath(root) if root is not None else default_root(out)
        out_options = output_options(spill, os.fspath(out), storage_options, merge_options.get("out_storage_options"))
        store = open_store(os.fspath(out), storage_options=out_options, allow_pickle=allow_pickle)
    return store


def finish_call(w: SpillWriter, dst: int, keep_spill: bool, timeout: float) -> None:
    """Return only once this call's spill is gone (unless ``keep_spill``), on every rank (the
    module docstring's last steps): the ranks call again with the same ``out`` right after, and a
    rank that returned while dst was still removing would create its next segment in folders
    being removed. Without torch.distributed (ranks from the environment) a rank returns at the
    completion marker; dst never deletes a segment of the next call, which it did not merge."""
    session = w.session()
    together = coordinated(session)
    if together and w.rank != dst:  # dst's merge outcome, in the process group's store
        watch = OutcomeWatch(session.run_id, session.number, 1)  # a call's writer merges once
        for waited in poll(timeout, first=0.002, cap=0.25, factor=1.25):
            told = watch.poll()
            if told is not None:
                if not told.get("ok"):
                    raise MergeFailedError(
                        f"the merge on rank {dst} failed after the output was complete: {told.get('error')}",
                        rank=dst,
                        failures={dst: str(told.get("error"))},
                    )
                break
            if watch.store is None or waited >= timeout:
                raise CoordinationError(
                    f"rank {dst} completed the output but did not say within {timeout:.0f} s that it removed the "
                    f"spill (lost the process group's store, or rank {dst} exited)",
                    rank=dst,
                )
    error: BaseException | None = None
    if not keep_spill and w.rank != dst:  # dst's merge removed what it merged, its own segment included
        try:
            w.remove_spill()
        except IncompleteOutputError as exc:
            error = exc
            if together:  # dst said the output is complete: this rank does not see it
                error = ConfigError(
                    f"rank {w.rank}: rank {dst} completed the output, but this rank does not see it, so its spill "
                    f"stays ({exc}): the output must be on storage every rank sees (memory:// is each process's "
                    "own, a relative path each rank's working directory's)",
                    key="out",
                )
                error.__cause__ = exc
        except BaseException as exc:  # noqa: BLE001 - raised after the barrier, so no rank waits for this one
            error = exc
    if together:
        limit = datetime.timedelta(seconds=timeout)
        on_gloo(w.rank, timeout, "finished the call", dist.monitored_barrier, timeout=limit)
    if error is not None:
        raise error


GATHER_BATCH = 256
"""Frames handed to ``write_batch`` at a time: its per-frame cost without holding every
prediction's flattened leaves at once."""


def _write_all(w: SpillWriter, preds: Mapping[str, Any]) -> None:
    """Write ``preds`` (what ``update`` takes) a batch of frames at a time."""
    items = iter(mapping_items(preds))
    while batch := list(itertools.islice(items, GATHER_BATCH)):
        names, frames, values = (list(column) for column in zip(*batch, strict=True))
        w.write_batch(names, values, frames)
