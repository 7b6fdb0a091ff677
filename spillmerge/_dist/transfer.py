"""Node-local spill roots: move committed shards to the merging rank over torch.distributed.

Used by the merge round (``_dist.round``) only. Protocol (every rank runs :func:`transfer_shards`, then ``dst`` merges from its own root):

1. Every rank publishes ``meta/R`` (its segment, committed or not; the ``dst`` it passed and the
   output it waits for) in torch.distributed's key-value store (the TCPStore every process group
   already has; no collective, no GPU).
2. ``dst`` waits for all metas, stops the round if a rank passed another ``dst`` or waits for
   another output, checks which ranks' commit records it cannot see under its own root, and
   publishes ``plan`` = those ranks and the backend (and its ``dst`` and output, which a rank
   arriving late checks). Nothing invisible: every other rank returns and ``dst`` merges from
   storage as usual.
3. Every rank reports which of those ranks' commit records *it* can see (``sees/R``); ``dst``
   picks one sender per group of ranks that share storage (the lowest rank that sees them: one
   sender per node) and publishes ``senders``.
4. Senders take turns (``dst`` says ``go/S``). Per turn: a manifest (object names and sizes),
   then every object in fixed-size pieces through one staging buffer, a CRC-32C trailer and an
   acknowledgement from ``dst``; commit records go last. A sender that cannot read an object
   sends its remaining pieces zeroed, ``SENDER_FAILED`` as the trailer and its error, so ``dst``
   stops at once naming it. ``dst`` writes the pieces straight into
   its own root under the sender's prefix, so both sides hold one staging buffer whatever the
   payload. Every send and receive waits at most ``transfer_timeout`` seconds.
5. ``dst`` runs the normal merge.

Any failure on ``dst`` sets ``abort`` so every waiting rank raises instead of hanging; a rank
whose writer failed sets ``failed/A/R`` for its A-th writer session of the run
(``_dist.store.publish_failure``). The store's keys and waits are ``_dist.store``'s; this module is the
wire (:class:`_Link`) and the shard protocol (:func:`transfer_shards`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import posixpath
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._errors import (
    ConfigError,
    CoordinationError,
    CorruptSpillError,
    RankFailedError,
    SpillMergeError,
    SpillValueError,
)
from .._format import crc as _crc
from .._format import spill as FS
from .._merge.report import MergeReport
from .._spill.barrier import WaitNotices, assess, commit_looks, raise_for_state
from .._spill.root import list_segments, scan
from .._storage import Storage
from .._util import poll as _poll
from .store import Coord

TRANSPORTS = ("auto", "storage", "nccl", "gloo")
DEFAULT_TRANSFER_CHUNK_BYTES = 64 << 20
DEFAULT_TRANSFER_TIMEOUT = 300.0
VISIBILITY_GRACE = 5.0
"""Seconds ``dst`` keeps re-checking a commit record it cannot see before moving it over the
network (a shared filesystem's directory cache can hide a new file for a moment)."""
_MAX_MANIFEST = 64 << 20
_MAX_RECORD = 1 << 20
_MAX_ERROR = 4000
SENDER_FAILED = -1
"""The trailer in place of an object's CRC-32C (never negative) when its sender could not read it."""


# -------------------------------------------------------------------------------- transport
class _Link:
    """A process group, the device its tensors live on, and the staging buffer: ``chunk`` bytes
    (on the device for NCCL, plus pinned host memory of the same size), used as two slots of
    ``piece = chunk // 2`` bytes so the receiver writes one piece while the next arrives."""

    def __init__(self, group: Any, device: torch.device, chunk: int, timeout: float) -> None:
        self.group, self.device, self.timeout = group, device, timeout
        cuda = device.type == "cuda"
        self.host = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
        self.dev = torch.empty(chunk, dtype=torch.uint8, device=device) if cuda else self.host
        self.piece = chunk // 2

    def _wait(self, post: Callable[[], Any], what: str, peer: int, me: int) -> None:
        """``post()`` (an isend / irecv) and its wait: a dead peer is a RuntimeError of either
        (gloo raises at the post when the peer's connection is already closed)."""
        try:
            post().wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise RankFailedError(
                f"rank {me}: {what} rank {peer} failed or timed out after {self.timeout:.0f} s: {exc}",
                failures={peer: str(exc)},
            ) from exc

    def send(self, t: torch.Tensor, peer: int, me: int, what: str) -> None:
        buf = t.to(self.device, non_blocking=False)
        self._wait(lambda: dist.isend(buf, peer, group=self.group), f"sending {what} to", peer, me)

    def recv(self, t: torch.Tensor, peer: int, me: int, what: str) -> torch.Tensor:
        buf = t if t.device == self.device else torch.empty_like(t, device=self.device)
        self._wait(lambda: dist.irecv(buf, peer, group=self.group), f"receiving {what} from", peer, me)
        return buf if buf is t else buf.to("cpu")

    def send_ints(self, values: list[int], peer: int, me: int, what: str) -> None:
        self.send(torch.tensor(values, dtype=torch.int64), peer, me, what)

    def recv_ints(self, n: int, peer: int, me: int, what: str) -> list[int]:
        return [int(v) for v in self.recv(torch.zeros(n, dtype=torch.int64), peer, me, what).tolist()]

    def send_bytes_piece(self, n: int, peer: int, me: int, what: str) -> None:
        """Send the first ``n`` bytes of the host staging buffer. With NCCL the copy to the device
        is blocking: waiting on a send does not block the CPU, and the caller refills the host
        buffer right after, so the copy must have read it first."""
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=False)
        self.send(self.dev[:n], peer, me, what)

    def send_blob(self, blob: bytes, peer: int, me: int, what: str) -> None:
        """Send ``blob`` in pieces through the staging buffer (no allocation of its size)."""
        host = self.host.numpy()
        for lo in range(0, len(blob), self.piece):
            n = min(self.piece, len(blob) - lo)
            host[:n] = np.frombuffer(blob, dtype=np.uint8, count=n, offset=lo)
            self.send_bytes_piece(n, peer, me, what)

    def recv_blob(self, size: int, peer: int, me: int, what: str) -> bytes:
        """Receive ``size`` bytes sent by :meth:`send_blob`."""
        out = bytearray()
        for lo in range(0, size, self.piece):
            out += self.recv_bytes_piece(min(self.piece, size - lo), peer, me, what).tobytes()
        return bytes(out)

    def recv_bytes_piece(self, n: int, peer: int, me: int, what: str, slot: int = 0) -> np.ndarray:
        """Receive ``n`` bytes into staging slot ``slot``; a view of them in host memory."""
        lo = slot * self.piece
        self.recv(self.dev[lo : lo + n], peer, me, what)
        if self.dev is not self.host:
            self.host[lo : lo + n].copy_(self.dev[lo : lo + n])
        return self.host.numpy()[lo : lo + n]


def choose_backend(transport: str) -> str:
    """``nccl`` or ``gloo`` for ``transport``, checked against the default process group."""
    default = str(dist.get_backend()).lower()
    has_nccl = "nccl" in default and torch.cuda.is_available()
    if transport == "auto":
        return "nccl" if has_nccl else "gloo"
    if transport == "nccl" and not has_nccl:
        raise ConfigError(
            f"transport='nccl' needs a default process group with the NCCL backend and a CUDA device "
            f"(this one is {default!r}); use transport='gloo'",
            key="transport",
        )
    return transport


def _group(backend: str, group_timeout: float) -> tuple[Any, torch.device]:
    """The process group and device for ``backend``. Every rank calls this (creating the gloo
    group is collective), participants or not. With gloo, a group of this transfer's own, never
    the cached one the drop-ins and the run id use: gloo closes a timed-out operation's
    connection for good, and only the two ranks of that connection know, so a shared group would
    make their later calls fail at once while the other ranks kept it. :func:`_release` ends it."""
    if backend == "nccl":
        return dist.group.WORLD, torch.device("cuda", torch.cuda.current_device())
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout)), torch.device("cpu")


def _release(group: Any) -> None:
    """This rank is done with the transfer's own gloo group (the default group stays)."""
    if group is not None and group is not dist.group.WORLD:
        with contextlib.suppress(Exception):  # its connections may be what failed
            dist.destroy_process_group(group)


# ------------------------------------------------------------------------------------ visibility
def _commit_rel(segment_rel: str) -> str:
    return f"{segment_rel}/{FS.COMMIT_NAME}"


def _invisible(storage: Storage, metas: dict[int, Any], grace: float) -> dict[int, str]:
    """Ranks whose current commit record ``storage`` cannot see, after ``grace`` seconds of
    re-checking."""
    pending = {r: m["segment"] for r, m in metas.items()}
    for waited in _poll.poll(grace, first=0.05, cap=1.0, factor=2.0):
        pending = {r: s for r, s in pending.items() if not storage.exists(_commit_rel(s))}
        if not pending or waited >= grace:
            break
    return pending


def _assign_senders(invisible: dict[int, str], sees: dict[int, list[int]], dst: int) -> dict[int, list[int]]:
    """One sender per group of ranks that share storage: for each invisible rank, the lowest rank
    that sees its commit record. ``dst`` never sends."""
    senders: dict[int, list[int]] = {}
    for q in sorted(invisible):
        candidates = sorted(r for r, seen in sees.items() if q in seen and r != dst)
        if not candidates:
            raise CoordinationError(
                f"rank {dst}: no rank can see rank {q}'s commit record {_commit_rel(invisible[q])} under its "
                f"spill root (not even rank {q} itself); its shards cannot be moved",
                rank=dst,
            )
        senders.setdefault(candidates[0], []).append(q)
    return senders


# ---------------------------------------------------------------------------------- the merge
@dataclass(frozen=True, slots=True)
class Session:
    """What the merge round and the shard transfer need from one rank's writer session
    (``SpillWriter.session()``)."""

    rank: int
    world_size: int
    run_id: str | None
    """Run id shared by the job's ranks (names the store keys); None without a launcher's id or
    torch.distributed (then nothing is coordinated)."""
    storage: Storage
    """This rank's spill root (node-local or shared)."""
    segment: str
    """This rank's segment, relative to the root (``rank-R/seg-...``)."""
    state: str
    """The writer's state: ``committed`` is the only one that may merge."""
    number: int = 0
    """Which writer session of the run this is on this rank (``_dist.store.next_session``)."""


def transfer_shards(
    session: Session,
    dst: int,
    transport: str,
    transfer_chunk_bytes: int,
    transfer_timeout: float,
    timeout: float,
    progress: bool | None = None,
    out: str | None = None,
) -> TransferInfo | None:
    """Every rank: coordinate through the process group's store and move the committed shards
    ``dst`` cannot see under its own root to it. Returns what moved on ``dst`` (which then merges
    from its root), ``None`` on the other ranks once they have sent what they had to. Unless
    ``progress`` is False, ``dst`` names on stderr the ranks it waits for (``WaitNotices``).
    ``out``: the output this rank merges into or waits for (None: a rank that does not wait);
    a rank whose ``dst`` or ``out`` is not the merging rank's is named on every rank."""
    assert session.run_id is not None  # the store's keys are named by it: round.coordinated() checked it
    coord = Coord(session.run_id, session.rank, session.world_size, dst, timeout, session.number)
    coord.diagnose = functools.partial(_failures_on_storage, session)
    me = session.rank
    coord.put(f"meta/{me}", {"segment": session.segment, "state": session.state, "dst": dst, "out": out})
    if me != dst:
        plan = coord.wait_one("plan", "waiting for the merging rank's plan")
        try:  # a rank arriving after dst compared the metas
            _check_alike({me: {"dst": dst, "out": out}}, plan["dst"], plan["out"], me)
        except CoordinationError as exc:
            coord.abort(exc)  # dst may be waiting for what this rank sees
            raise
        if not plan["invisible"]:
            return None
        invisible = {int(q): s for q, s in plan["invisible"].items()}
        coord.put(f"sees/{me}", [q for q, s in invisible.items() if session.storage.exists(_commit_rel(s))])
        group, device = _group(plan["backend"], timeout)
        try:
            senders = {int(s): qs for s, qs in coord.wait_one("senders", "waiting for the sender assignment").items()}
            if me in senders:
                link = _Link(group, device, int(plan["chunk"]), transfer_timeout)
                coord.wait_one(f"go/{me}", "waiting for the merging rank to receive")
                _send(session.storage, link, me, dst, senders[me], set(plan["have"]))
        finally:
            _release(group)
        return None
    info = TransferInfo()
    t0 = time.perf_counter()
    group = None
    try:
        # A rank that never calls merge() (e.g. `if rank == 0: w.merge(out)`) is fine when its
        # commit record is on storage dst can read: then dst stops waiting for it.
        watch = _commit_watch(session, coord, WaitNotices(session.storage, timeout, quiet=progress is False))
        metas = coord.collect("meta", "waiting for every rank to reach merge()", done=watch)
        _check_alike(metas, dst, out, me)
        not_committed = {r: m["state"] for r, m in metas.items() if m["state"] != "committed"}
        if not_committed:
            raise RankFailedError(
                f"rank(s) {sorted(not_committed)} called merge() without a committed SpillWriter "
                f"(writer states: {not_committed})",
                failures={r: f"writer state {st}" for r, st in not_committed.items()},
            )
        info.wait_seconds = time.perf_counter() - t0
        t_vis = time.perf_counter()
        everyone = len(metas) == session.world_size  # fewer: every commit record was on dst's storage
        invisible = _invisible(session.storage, metas, VISIBILITY_GRACE) if everyone else {}
        info.visibility_seconds = time.perf_counter() - t_vis
        backend = choose_backend(transport) if invisible else ""
        # segments of those ranks dst has committed already: not sent again
        have = sorted({s.rel for q in invisible for s in list_segments(session.storage, q) if s.commit is not None})
        plan = {
            "invisible": {str(q): s for q, s in invisible.items()},
            "backend": backend,
            "have": have,
            "chunk": transfer_chunk_bytes,  # the merging rank's staging size applies to every sender
            "dst": dst,
            "out": out,
        }
        coord.put("plan", plan)
        if invisible:
            t1 = time.perf_counter()
            coord.put(f"sees/{me}", [])
            group, device = _group(backend, timeout)
            link = _Link(group, device, transfer_chunk_bytes, transfer_timeout)
            sees = coord.collect("sees", "waiting for what each rank can see")
            info.senders = _assign_senders(invisible, sees, dst)
            coord.put("senders", {str(s): qs for s, qs in info.senders.items()})
            for s in sorted(info.senders):
                coord.put(f"go/{s}", True)
                info.received.update(_receive(session.storage, link, me, s, info.senders[s]))  # (one sender a rank)
            info.transfer_seconds = time.perf_counter() - t1
    except BaseException as exc:
        coord.abort(exc)
        raise
    finally:
        _release(group)
    return info


@dataclass
class TransferInfo:
    """What :func:`transfer_shards` did before the merge proper."""

    wait_seconds: float = 0.0
    """Waiting for every rank to reach ``merge()``."""
    visibility_seconds: float = 0.0
    """Checking which commit records the merging rank can see (with ``VISIBILITY_GRACE``)."""
    transfer_seconds: float = 0.0
    received: dict[int, int] = field(default_factory=dict)
    """Rank → shard bytes received."""
    senders: dict[int, list[int]] = field(default_factory=dict)
    """Sending rank → ranks whose shards it sent."""

    def add_to(self, report: MergeReport) -> MergeReport:
        """``report`` of the merge that followed, with this step's time and what moved."""
        phases = dict(report.phases)
        phases["wait"] = phases.get("wait", 0.0) + self.wait_seconds
        if self.received:
            phases = {"visibility": self.visibility_seconds, "transfer": self.transfer_seconds, **phases}
        return dataclasses.replace(
            report,
            wait_seconds=report.wait_seconds + self.wait_seconds,
            seconds=report.seconds + self.wait_seconds + self.visibility_seconds + self.transfer_seconds,
            transferred=self.received,
            transfer_senders=self.senders,
            phases=phases,
        )


def _check_alike(metas: dict[int, Any], dst: int, out: str | None, me: int) -> None:
    """Raise naming the ranks of ``metas`` that passed another ``dst`` than the merging rank's,
    or wait for another output than its ``out``: the collectives' rule, all ranks alike."""
    odd = {
        r: m
        for r, m in metas.items()
        if m["dst"] != dst or (m["out"] is not None and out is not None and m["out"] != out)
    }
    if odd:
        names = "; ".join(f"rank {r}: dst={m['dst']}, out={m['out']!r}" for r, m in sorted(odd.items()))
        raise CoordinationError(
            f"rank {me}: rank(s) {sorted(odd)} called merge() with another dst or out than the merging rank "
            f"{dst} (dst={dst}, out={out!r}); every rank must pass the same ({names})",
            rank=me,
        )


def _failures_on_storage(session: Session) -> dict[int, str]:
    """Ranks whose writer of this run left a failure record under this rank's spill root."""
    try:
        state = assess(session.storage, scan(session.storage), session.world_size, session.run_id)
    except SpillMergeError:
        return {}
    return {r: rec.summary() for r, rec in state.failed.items()}


def _commit_watch(session: Session, coord: Coord, notices: WaitNotices) -> Callable[[], bool]:
    """Called by ``dst`` now and then while it waits for ranks to reach merge(): True once every
    rank's commit record of this run is on ``dst``'s storage (fails fast on a failure record
    there). The ranks neither committed there nor at merge() are named on stderr."""
    looks = commit_looks(session.storage, session.world_size, session.run_id)

    def done() -> bool:
        state, segments = next(looks)
        if state.failed:
            raise_for_state(session.storage, state)
        if state.missing and notices.due():
            away = [r for r in state.missing if not coord.store.check([f"meta/{r}"])]
            notices(state, segments, session.run_id, away)
        return not state.missing

    return done


# ------------------------------------------------------------------------------------- sender
def _manifest(storage: Storage, ranks: list[int], have: set[str]) -> list[tuple[str, int]]:
    """Every object of every committed segment of ``ranks`` that ``dst`` lacks, each segment's
    commit record last."""
    objects: list[tuple[str, int]] = []
    for q in ranks:
        for seg in list_segments(storage, q):
            if seg.commit is None or seg.rel in have:
                continue
            files = [(rel, n) for rel, n in storage.find(seg.rel) if rel.rsplit("/", 1)[-1] != FS.FAILURE_NAME]
            objects += sorted(files, key=lambda f: f[0] == _commit_rel(seg.rel))  # stable: the commit last
    return objects


def _send(storage: Storage, link: _Link, me: int, dst: int, ranks: list[int], have: set[str]) -> None:
    objects = _manifest(storage, ranks, have)
    blob = json.dumps({"ranks": ranks, "objects": objects}).encode()
    link.send_ints([len(blob)], dst, me, "the manifest size")
    link.send_blob(blob, dst, me, "the manifest")
    host = link.host.numpy()
    for rel, size in objects:
        crc = 0
        failed: BaseException | None = None
        for start in range(0, size, link.piece):
            n = min(link.piece, size - start)
            try:
                if failed is None:
                    storage.read_into([(rel, start, start + n)], host.data[:n])
                    crc = _crc.extend(crc, host[:n])
            except Exception as exc:  # noqa: BLE001 - dst is told in-band just below, then it is raised
                failed = exc
            if failed is not None:
                host[:n] = 0  # dst expects every piece announced
            link.send_bytes_piece(n, dst, me, f"{storage.describe(rel)}")
        if failed is not None:
            why = f"rank {me} could not read {storage.describe(rel)}: {type(failed).__name__}: {failed}".encode()
            link.send_ints([SENDER_FAILED], dst, me, f"the checksum of {rel}")
            link.send_ints([len(why[:_MAX_ERROR])], dst, me, "its error's size")
            link.send_blob(why[:_MAX_ERROR], dst, me, "its error")
            raise failed
        link.send_ints([crc], dst, me, f"the checksum of {rel}")
        if link.recv_ints(1, dst, me, f"the acknowledgement of {rel}")[0] != 0:
            raise CorruptSpillError(
                f"rank {dst} received {storage.describe(rel)} from rank {me} with a bad checksum; transfer stopped",
                path=storage.describe(rel),
                rank=me,
            )
    storage.close()


# ----------------------------------------------------------------------------------- receiver
def _check_rel(rel: Any, ranks: list[int], sender: int) -> str:
    ok_prefixes = tuple(f"{FS.rank_dirname(q)}/" for q in ranks)
    if not isinstance(rel, str) or not rel.startswith(ok_prefixes) or posixpath.normpath(rel) != rel:
        raise CorruptSpillError(
            f"rank {sender} sent object {rel!r}, which is not below the prefixes of ranks {ranks}",
            rank=sender,
        )
    return rel


def _receive(storage: Storage, link: _Link, me: int, sender: int, ranks: list[int]) -> dict[int, int]:
    (size,) = link.recv_ints(1, sender, me, "the manifest size")
    if not 0 < size <= _MAX_MANIFEST:
        raise CorruptSpillError(f"rank {sender} announced a manifest of {size} bytes", rank=sender)
    raw = link.recv_blob(size, sender, me, "the manifest")
    try:
        manifest = json.loads(raw)
        objects = [(_check_rel(rel, ranks, sender), int(n)) for rel, n in manifest["objects"]]
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptSpillError(f"rank {sender} sent a malformed manifest: {exc}", rank=sender) from exc
    received: Counter[int] = Counter()
    for rel, n in objects:
        if n < 0 or (rel.endswith("/" + FS.COMMIT_NAME) and n > _MAX_RECORD):
            raise CorruptSpillError(f"rank {sender} announced {rel} with {n} bytes", rank=sender)
        _receive_object(storage, link, me, sender, rel, n)
        received[FS.parse_rank_dirname(rel.split("/", 1)[0]) or 0] += n
    return received


def _receive_object(storage: Storage, link: _Link, me: int, sender: int, rel: str, size: int) -> None:
    """Stream one object into ``storage``, checked against the CRC-32C its sender sends after it.
    Pieces alternate between the two staging slots: one is written to storage by a helper thread
    while the next arrives in the other. The check is made before the sink closes, so an object
    appears under its name only once verified: a half-received rank never looks committed."""
    storage.makedirs(posixpath.dirname(rel))
    crc = 0
    writes: list[Future[None] | None] = [None, None]
    target = storage.open_write(rel, durable=rel.endswith("/" + FS.COMMIT_NAME))  # a commit record: as put_atomic
    with ThreadPoolExecutor(1, thread_name_prefix="spillmerge-recv") as pool, target as sink:
        try:
            for k, start in enumerate(range(0, size, link.piece)):
                slot = k % 2
                if writes[slot] is not None:
                    writes[slot].result()  # type: ignore[union-attr] # the slot is free again
                n = min(link.piece, size - start)
                piece = link.recv_bytes_piece(n, sender, me, f"{rel} (bytes {start}-{start + n})", slot)
                crc = _crc.extend(crc, piece)
                writes[slot] = pool.submit(sink.write, piece)
        finally:
            for fut in writes:  # surface a write error; never leave a write running on a slot
                if fut is not None:
                    fut.result()
        (want,) = link.recv_ints(1, sender, me, f"the checksum of {rel}")
        if want == SENDER_FAILED:  # inside the sink: it drops the object
            (length,) = link.recv_ints(1, sender, me, "its error's size")
            if not 0 <= length <= _MAX_ERROR:
                raise CorruptSpillError(f"rank {sender} announced an error of {length} bytes", rank=sender)
            why = link.recv_blob(length, sender, me, "its error").decode(errors="replace")
            raise RankFailedError(f"rank {me}: rank {sender} stopped sending its shards: {why}", failures={sender: why})
        ok = crc == want
        link.send_ints([0 if ok else 1], sender, me, f"the acknowledgement of {rel}")
        if not ok:  # inside the sink: it drops the object
            raise CorruptSpillError(
                f"{storage.describe(rel)}: received from rank {sender} with CRC-32C {crc:08x}, "
                f"sent as {want:08x}; transfer stopped",
                path=storage.describe(rel),
                rank=sender,
            )


def check_options(transport: str, transfer_chunk_bytes: int, transfer_timeout: float) -> None:
    if transport not in TRANSPORTS:
        raise SpillValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if not isinstance(transfer_chunk_bytes, int) or transfer_chunk_bytes < 4096:
        raise SpillValueError(f"transfer_chunk_bytes must be an int >= 4096, got {transfer_chunk_bytes!r}")
    if not isinstance(transfer_timeout, (int, float)) or transfer_timeout <= 0:
        raise SpillValueError(f"transfer_timeout must be a positive number of seconds, got {transfer_timeout!r}")
