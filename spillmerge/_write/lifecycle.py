"""A SpillWriter's steps after the ``with`` block: the collective merge round (``merge``,
``session``) and ``remove_spill`` once the output holds the segment."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._dist.round import complete_for
from .._dist.transfer import DEFAULT_TRANSFER_CHUNK_BYTES, DEFAULT_TRANSFER_TIMEOUT, Session
from .._errors import IncompleteOutputError, WriterClosedError
from .._format import output as FO
from .._format import spill as FS
from .._spill.removal import remove_listed
from .._spill.root import list_ranks
from .._storage import Storage, output_options
from .segment import SegmentSteps, WriterState

if TYPE_CHECKING:
    from .._merge.report import MergeReport


class MergeSteps(SegmentSteps):
    """``SpillWriter``'s methods for the merge round and what follows it, after its segment's."""

    @property
    def state(self) -> str:
        """The lifecycle state (:class:`WriterState`), as its string: ``"new"``, ``"open"``,
        ``"closing"``, ``"aborting"``, ``"committed"`` or ``"failed"``."""
        return str(self._state.value)

    _merged_into: tuple[str, dict[str, Any] | None, MergeReport | None] | None = None
    """The output of this writer's last merge round on this rank, its storage options, and the
    round's report (on the merging rank; None elsewhere)."""

    def remove_spill(self, *, everything: bool = False) -> None:
        """Delete this writer's own segment once the output of its last :meth:`merge` holds it
        (the merge's report lists it, or the output is complete with this writer's round: its
        completion marker names this run and session); nothing when it is already gone (the
        merging rank removed it). ``everything`` (the merging rank,
        after a node-local transfer brought every shard to its root): every segment the merge's
        report lists as merged, and the merge failure record. Never a segment the output was not
        merged from (another rank's later session, an uncommitted one), never another rank's
        segment without ``everything``; rank folders and the root go only when left empty. Only
        after the writer commits and merges; raises otherwise, deleting nothing."""
        if self._state is not WriterState.COMMITTED:
            raise WriterClosedError(
                f"SpillWriter for rank {self.rank} is {self._state}; only a committed spill is removed"
            )
        if self._merged_into is None:
            raise WriterClosedError(
                f"SpillWriter for rank {self.rank}: call merge() before remove_spill(); only a segment the output "
                f"holds is removed ({self.storage.describe(self._prefix)} stays)"
            )
        out, out_options, report = self._merged_into
        merged = set(report.merged_segments) if report is not None else set()
        if everything:
            if report is None:
                raise WriterClosedError(
                    f"SpillWriter for rank {self.rank}: remove_spill(everything=True) is for the rank that merged "
                    "(it knows which segments the output was merged from); other ranks remove their own segment"
                )
            output = Storage(out, out_options)
            if not output.exists(FO.COMPLETE_NAME):
                raise IncompleteOutputError(
                    f"{output.describe()} has no completion marker: the spill it was merged from stays",
                    path=output.describe(),
                )
            rels = [f"{FS.rank_dirname(r)}/{n}" for r in list_ranks(self.storage)
                    for n in self.storage.listdir(FS.rank_dirname(r)) if FS.is_segment_name(n)]  # fmt: skip
            remove_listed(self.storage, [r for r in rels if self.storage.describe(r) in merged], failure_record=True)
            return
        if not self.storage.exists(f"{self._prefix}/{FS.COMMIT_NAME}"):
            return  # removed by the merging rank
        where = self.storage.describe(self._prefix)
        if where not in merged:  # then the output must be complete with this writer's round
            output = Storage(out, out_options)
            if not complete_for(output, self.run_id, self._session_number):
                raise IncompleteOutputError(
                    f"{where} not removed: {output.describe()} holds no completed merge of this writer's round "
                    f"(run {self.run_id}, session {self._session_number}); call merge(..., wait=True) and let it "
                    "return first",
                    path=where,
                )
        remove_listed(self.storage, [self._prefix], failure_record=False)

    def merge(
        self,
        out: str,
        dst: int = 0,
        *,
        wait: bool = False,
        parallel: bool = False,
        transport: str = "auto",
        transfer_chunk_bytes: int = DEFAULT_TRANSFER_CHUNK_BYTES,
        transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        **kwargs: Any,
    ) -> MergeReport | None:
        """Collective: every rank calls it after the ``with`` block. Rank ``dst`` merges and
        returns a :class:`~spillmerge.MergeReport`; other ranks return ``None``. ``kwargs`` go to
        :func:`spillmerge.merge` (``timeout`` defaults to 1800 s here; while ``dst`` waits for
        commit records it names the missing ranks on stderr every 30 s, unless ``progress=False``).

        ``wait=True``: every rank returns only once the output is complete, so every rank can
        ``spillmerge.open(out)`` right after (the output must be on storage every rank sees). If
        the merge fails on ``dst``, every waiting rank raises :class:`~spillmerge.MergeFailedError`
        naming ``dst`` and its error within seconds; none waits past ``timeout``
        (:class:`~spillmerge.MergeTimeout`). Without ``wait`` the other ranks return once their
        shards are where ``dst`` can read them.

        ``transport`` says how ``dst`` gets the other ranks' shards:

        - ``"auto"`` (default): from storage when ``dst`` can see every rank's commit record;
          when some ranks spilled to node-local disks ``dst`` cannot see, their committed shards
          are moved to ``dst`` over torch.distributed first (NCCL when the default group has it,
          else gloo), one sender per group of ranks sharing a disk, in pieces of
          ``transfer_chunk_bytes`` through one reused staging buffer, each send and receive
          bounded by ``transfer_timeout`` seconds.
        - ``"storage"``: never move bytes over the network; ``dst`` waits on storage only (the
          only mode without torch.distributed, e.g. SLURM arrays).
        - ``"nccl"`` / ``"gloo"``: like ``"auto"`` with that backend for the shards ``dst``
          cannot see.

        Coordination uses the process group's key-value store (CPU, TCP), never a GPU
        collective; a rank whose writer failed or never arrives ends the merge on every rank with
        an error naming it.

        ``parallel=True`` spreads the merge over every rank: each writes the arrays of its share
        of the files (split by bytes, the same on every rank), records its part under the output,
        and returns ``None``; ``dst`` then waits on storage (up to ``timeout``) for every part and
        writes the index, consolidated metadata and completion marker. A rank whose part fails
        raises there, and ``dst`` raises :class:`~spillmerge.PartFailedError` naming it. Every rank
        must see the spill root and the output (shared storage; no network transport).
        """
        if self._state is WriterState.OPEN:
            raise WriterClosedError("call merge() after leaving the `with SpillWriter(...)` block")
        report = self._rounds.merge(
            self.session(), out, dst, wait=wait, parallel=parallel, transport=transport,
            transfer_chunk_bytes=transfer_chunk_bytes, transfer_timeout=transfer_timeout, **kwargs,
        )  # fmt: skip
        opts = output_options(
            self.root,
            out,
            kwargs.get("storage_options", self.storage.storage_options),
            kwargs.get("out_storage_options"),
        )
        self._merged_into = (out, opts, report)
        return report

    def session(self) -> Session:
        """This writer's session as the merge round and the shard transfer see it (rank, root,
        segment, state)."""
        if self.segment is None:
            raise WriterClosedError(f"SpillWriter for rank {self.rank} was never opened; there is nothing to merge")
        return Session(
            self.rank, self.world_size, self.run_id, self.storage, self._prefix, self.state, self._session_number
        )
