"""``spillmerge status``: a running job seen from storage alone.

Reads per refresh are bounded by the number of ranks, not by what they wrote: one listing of the
root, one of each rank folder, then per rank only the newest segment's small records (header,
``commit.json``, ``failed.json``, ``progress.json``), and under an output only
``spillmerge-parts/`` and the completion marker. Nothing is written and nothing is locked, so the
writers never wait on it (docs/GUARANTEES.md, *Watching a running job*)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from . import _format_output as FO
from . import _format_spill as FS
from . import _parts
from ._progress import iso_to_unix
from ._progress import read as read_progress
from ._spillroot import list_ranks, read_segment
from ._storage import Storage
from ._units import size_text as _size

RankState = Literal["writing", "committed", "failed", "missing"]
DEFAULT_STALL_AFTER = 120.0


@dataclass(frozen=True, slots=True)
class RankStatus:
    """One rank's newest segment."""

    rank: int
    state: RankState
    """``writing``, ``committed``, ``failed`` or ``missing`` (no segment yet)."""
    frames: int
    """Frames durable so far (the commit record's count once committed)."""
    bytes: int
    """Payload bytes durable so far."""
    last_write_age_s: float | None
    """Seconds since the last durable write (commit or failure time once ended); None if unknown."""
    message: str | None
    """The failure (type: message) of a failed rank."""
    stalled: bool
    """Writing, and nothing durable for longer than ``stall_after`` seconds."""
    rate_fps: float | None
    """Frames per second since the segment started."""
    segment: str | None
    run_id: str | None


@dataclass(frozen=True, slots=True)
class MergeStatus:
    """The merge into ``out``, when an output was named."""

    out: str
    state: Literal["not-started", "running", "complete", "failed"]
    parts_done: int
    parts_failed: int
    parts: int | None
    """Parts of a merge written in parts (None: not known yet or a single merge)."""
    message: str | None


@dataclass(frozen=True, slots=True)
class JobStatus:
    """What ``spillmerge status ROOT`` shows."""

    root: str
    world_size: int | None
    ranks: list[RankStatus]
    frames: int
    bytes: int
    expected: int | None
    """Frames the job will write, from ``--expected`` or the writers' ``expected=``."""
    eta_s: float | None
    """Seconds to the end at the current rate, when ``expected`` is known."""
    merge: MergeStatus | None
    done: bool
    """Every rank committed or failed."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["merge"] = asdict(self.merge) if self.merge is not None else {}
        return d


def status(
    root: str,
    *,
    out: str | None = None,
    expected: int | None = None,
    stall_after: float = DEFAULT_STALL_AFTER,
    storage_options: dict[str, Any] | None = None,
) -> JobStatus:
    """The job writing to spill root ``root``, as storage shows it now (see the module doc for
    what it reads). ``out``: also the merge's progress into that output. ``expected``: frames the
    whole job writes (default: what the writers recorded)."""
    storage = Storage(root, storage_options)
    now = time.time()
    ranks: dict[int, RankStatus] = {}
    world_size: int | None = None
    recorded_expected: int | None = None
    for r in list_ranks(storage):
        names = [n for n in storage.listdir(FS.rank_dirname(r)) if FS.is_segment_name(n)]
        if not names:
            continue
        seg = read_segment(storage, r, max(names, key=FS.segment_sort_key))
        world_size = max(world_size or 0, seg.world_size or 0) or world_size
        h = seg.header or {}
        e = h.get("expected")
        if isinstance(e, int) and not isinstance(e, bool):
            recorded_expected = max(recorded_expected or 0, e)
        started = iso_to_unix(h.get("started"))
        ranks[r] = _rank_status(storage, seg, now, started, stall_after)
    n = max([world_size or 0, *(r + 1 for r in ranks)])
    rows = [ranks.get(r) or RankStatus(r, "missing", 0, 0, None, None, False, None, None, None) for r in range(n)]
    frames = sum(x.frames for x in rows)
    nbytes = sum(x.bytes for x in rows)
    exp = expected if expected is not None else recorded_expected
    rate = sum(x.rate_fps or 0.0 for x in rows if x.state == "writing")
    eta = None
    if exp is not None and rate > 0:
        eta = max(0.0, (exp - frames) / rate)
    done = bool(rows) and all(x.state in ("committed", "failed") for x in rows)
    merge = _merge_status(out, storage_options) if out is not None else None
    return JobStatus(storage.url, world_size, rows, frames, nbytes, exp, eta, merge, done)


def _rank_status(storage: Storage, seg: Any, now: float, started: float | None, stall_after: float) -> RankStatus:
    if seg.commit is not None:
        c = seg.commit
        end = iso_to_unix(c.finished)
        rate = c.n_frames / (end - started) if end and started and end > started else None
        return RankStatus(seg.rank, "committed", c.n_frames, c.nbytes, _age(now, end), None, False, rate,
                          seg.name, seg.run_id)  # fmt: skip
    prog = read_progress(storage, seg.rel)
    frames, nbytes = (prog.frames, prog.nbytes) if prog is not None else (0, 0)
    last = prog.updated if prog is not None and prog.chunks else started
    if seg.failure is not None:
        end = iso_to_unix(seg.failure.time)
        return RankStatus(seg.rank, "failed", frames, nbytes, _age(now, end), seg.failure.summary(), False, None,
                          seg.name, seg.run_id)  # fmt: skip
    age = _age(now, last)
    rate = frames / (last - started) if prog is not None and started and last and last > started else None
    stalled = age is not None and age > stall_after
    return RankStatus(seg.rank, "writing", frames, nbytes, age, None, stalled, rate, seg.name, seg.run_id)


def _age(now: float, t: float | None) -> float | None:
    return None if t is None else round(max(0.0, now - t), 3)


def _merge_status(out: str, storage_options: dict[str, Any] | None) -> MergeStatus:
    output = Storage(out, storage_options)
    if output.exists(FO.COMPLETE_NAME):
        return MergeStatus(output.url, "complete", 0, 0, None, None)
    try:
        records = _parts.read_records(output)
    except Exception as exc:  # noqa: BLE001 - a status view shows what it cannot read
        return MergeStatus(output.url, "running", 0, 0, None, f"part records unreadable: {exc}")
    done = [r for r in records if not r.failed]
    failed = [r for r in records if r.failed]
    parts = max((r.parts for r in records), default=None)
    if failed:
        state: Any = "failed"
        msg = "; ".join(f"{_parts.describe(r.part, r.parts, r.rank)}: {r.message}" for r in failed)
    else:
        state = "running" if records or output.exists("zarr.json") else "not-started"
        msg = None
    return MergeStatus(output.url, state, len(done), len(failed), parts, msg)


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def format_status(js: JobStatus) -> str:
    """The text table of ``spillmerge status``."""
    lines = [f"spill root {js.root}: world size {js.world_size if js.world_size is not None else '?'}"]
    lines.append(f"{'rank':>5}  {'state':<9}  {'frames':>9}  {'bytes':>10}  {'rate/s':>8}  {'last write':>10}  note")
    for r in js.ranks:
        note = "STALLED" if r.stalled else (r.message or "")
        rate = f"{r.rate_fps:.1f}" if r.rate_fps is not None else "-"
        age = _dur(r.last_write_age_s) + " ago" if r.last_write_age_s is not None else "-"
        lines.append(f"{r.rank:>5}  {r.state:<9}  {r.frames:>9}  {_size(r.bytes):>10}  {rate:>8}  {age:>10}  {note}")
    counts = {s: sum(1 for r in js.ranks if r.state == s) for s in ("writing", "committed", "failed", "missing")}
    total = f"{js.frames} frames, {_size(js.bytes)}"
    if js.expected:
        total += f" of {js.expected} expected ({100 * js.frames / js.expected:.1f}%)"
        if js.eta_s is not None and not js.done:
            total += f", about {_dur(js.eta_s)} left"
    stalled = sum(1 for r in js.ranks if r.stalled)
    lines.append(
        "total: "
        + total
        + "; "
        + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        + (f", {stalled} stalled" if stalled else "")
    )
    if js.merge is not None:
        m = js.merge
        parts = f", parts {m.parts_done}/{m.parts}" if m.parts else ""
        lines.append(f"merge into {m.out}: {m.state}{parts}" + (f" — {m.message}" if m.message else ""))
    return "\n".join(lines)
