"""``spillmerge status``: a running job seen from storage alone, with reads per refresh bounded by
the number of ranks; nothing is written or locked, so the writers never wait on it."""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .._errors import ConfigError, NotASpillRootError, SpillMergeError
from .._format import output as FO
from .._format import spill as FS
from .._merge import lease as _lease
from .._merge import ownership as _ownership
from .._merge import parts as _parts
from .._spill.root import list_ranks, read_segment
from .._storage import Storage
from .._util.progress import iso_to_unix
from .._util.progress import read as read_progress
from .._util.units import duration_text as _duration
from .._util.units import size_text as _size
from .summary import one_line

RankState = Literal["writing", "committed", "failed", "missing", "unreadable"]
DEFAULT_STALL_AFTER = 120.0
LISTED_MISSING = 1000
"""Missing ranks listed one by one; beyond, ``JobStatus.missing`` counts them (a world size of
millions must not cost a row each)."""


@dataclass(frozen=True, slots=True)
class RankStatus:
    """One rank's newest segment."""

    rank: int
    state: RankState
    """``writing``, ``committed``, ``failed``, ``missing`` (no segment yet) or ``unreadable`` (its
    newest segment's records could not be read: ``message`` says why)."""
    frames: int = 0
    """Frames written so far, durable or still in the writer's staging memory (the commit
    record's count once committed)."""
    bytes: int = 0
    """Payload bytes of those frames."""
    last_write_age_s: float | None = None
    """Seconds since the rank last wrote (to the progress record's few seconds; commit or failure
    time once ended); None if unknown."""
    message: str | None = None
    """The failure (type: message) of a failed rank, or why its records are unreadable."""
    stalled: bool = False
    """Writing, and nothing written for longer than ``stall_after`` seconds."""
    rate_fps: float | None = None
    """Frames per second since the segment started."""
    segment: str | None = None
    run_id: str | None = None
    durable: int = 0
    """Frames durable so far (listed by the journal; whole chunks)."""


@dataclass(frozen=True, slots=True)
class MergeStatus:
    """The merge into ``out``, when an output was named."""

    out: str
    state: Literal["not-started", "running", "interrupted", "complete", "failed", "not-an-output"]
    """``interrupted``: written in part, no completion marker, and no process holds its lease;
    ``not-an-output``: a file, a spill root or a folder of other files (``message`` says which)."""
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
    """The world size the commit records, else the segment headers, agree on (None: none yet, or
    they disagree: ``notes`` says so)."""
    ranks: list[RankStatus]
    frames: int
    bytes: int
    expected: int | None
    """Frames the job will write, from ``--expected`` or the writers' ``expected=``."""
    eta_s: float | None
    """Seconds to the end at the current rate, when ``expected`` is known."""
    merge: MergeStatus | None
    done: bool
    """Every rank of the world size committed or failed."""
    missing: int = 0
    """Ranks of the world size with no segment (the first :data:`LISTED_MISSING` are in ``ranks``)."""
    notes: list[str] = field(default_factory=list)
    """What the root holds that is not one run of ``world_size`` ranks (rank folders outside it,
    records that disagree on it), one line each."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"merge": asdict(self.merge) if self.merge is not None else {}}


def status(
    root: str,
    *,
    out: str | None = None,
    expected: int | None = None,
    stall_after: float = DEFAULT_STALL_AFTER,
    storage_options: dict[str, Any] | None = None,
) -> JobStatus:
    """The job writing to spill root ``root``, as storage shows it now; ``out``: the merge's progress
    into it too; ``expected``: frames the job writes (default: what the writers recorded). Raises
    ``NotASpillRootError`` when ``root`` does not exist or holds no rank folders."""
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, int) or expected < 0):
        raise ConfigError(f"expected must be a number of frames >= 0, got {expected!r}", key="expected")
    if not stall_after >= 0:  # NaN too
        raise ConfigError(f"stall_after must be a number of seconds >= 0, got {stall_after!r}", key="stall_after")
    storage = Storage(root, storage_options)
    now = time.time()
    found = list_ranks(storage)
    if not found:
        raise _not_a_spill_root(storage)
    segs: dict[int, Any] = {}
    broken: dict[int, str] = {}
    claims: list[tuple[int, int, bool]] = []  # (rank, world size, from a commit record)
    limit = FS.MAX_WORLD_SIZE  # rank folders above are not read
    for r in found:
        # Ranks ascend: a folder at or above every world size read so far is outside the run
        # (a planted rank-1000000000000 is never read, nor allocated for, whatever its number).
        if r >= limit:
            break
        try:
            names = [n for n in storage.listdir(FS.rank_dirname(r)) if FS.is_segment_name(n)]
            if not names:
                continue
            seg = read_segment(storage, r, max(names, key=FS.segment_sort_key))
        except SpillMergeError as exc:  # one rank's damaged records cost that rank, not the view
            broken[r] = str(exc)
            continue
        segs[r] = seg
        ws = seg.world_size
        if ws is not None and 1 <= ws <= FS.MAX_WORLD_SIZE:
            claims.append((r, ws, seg.commit is not None))
            limit = ws if len(claims) == 1 else max(limit, ws)  # the largest claim so far
    world_size, notes = _agreed_world_size(claims)
    top = world_size if world_size is not None else limit
    outside = [r for r in found if r >= top]
    inside = found[: len(found) - len(outside)]
    if outside:
        shown = ", ".join(FS.rank_dirname(r) for r in outside[:3]) + (", ..." if len(outside) > 3 else "")
        of = f"world size {world_size}" if world_size is not None else "every world size recorded"
        notes.append(f"{len(outside)} rank folder(s) outside {of}, not read: {shown}")
    # (a rank folder without a segment is missing)
    ranks = {r: RankStatus(r, "unreadable", message=broken[r]) for r in inside if r in broken}
    ranks |= {r: _rank_status(storage, segs[r], now, stall_after) for r in inside if r in segs}
    heads = [segs[r].header or {} for r in inside if r in segs]
    recorded = [e for h in heads if type(e := h.get("expected")) is int]
    rows = [ranks[r] for r in sorted(ranks)]
    missing = 0
    if world_size is not None:
        absent = (r for r in range(world_size) if r not in ranks)
        missing = world_size - len(ranks)
        rows += [RankStatus(r, "missing") for r in itertools.islice(absent, LISTED_MISSING)]
        rows.sort(key=lambda x: x.rank)
        if missing > LISTED_MISSING:
            notes.append(f"{missing} ranks missing, the first {LISTED_MISSING} listed")
    frames = sum(x.frames for x in rows)
    nbytes = sum(x.bytes for x in rows)
    exp = expected if expected is not None else max(0, *recorded) if recorded else None
    rate = sum(x.rate_fps or 0.0 for x in rows if x.state == "writing")
    eta = max(0.0, (exp - frames) / rate) if exp is not None and rate > 0 else None
    # (a missing rank is a row: the first of them is always listed)
    done = world_size is not None and all(x.state in ("committed", "failed") for x in rows)
    merge = _merge_status(out, storage_options) if out is not None else None
    return JobStatus(storage.url, world_size, rows, frames, nbytes, exp, eta, merge, done, missing, notes)


def _agreed_world_size(claims: list[tuple[int, int, bool]]) -> tuple[int | None, list[str]]:
    """The world size the commit records agree on, else the other records (headers, failure
    records); with a note when they disagree (the commit records' largest wins; headers that
    disagree give none: no rank count is taken from one record alone against the others)."""
    committed = sorted({ws for _, ws, c in claims if c})
    others = sorted({ws for _, ws, c in claims if not c})
    if committed:
        ws = committed[-1]
        notes = [] if len(committed) == 1 else [f"commit records disagree on the world size: {committed} (a stale run?)"]
        odd = [(r, w) for r, w, c in claims if not c and w != ws]
        if odd:
            shown = ", ".join(f"rank {r} says {w}" for r, w in odd[:3]) + (", ..." if len(odd) > 3 else "")
            notes.append(f"{len(odd)} writing segment(s) disagree with world size {ws}: {shown}")
        return ws, notes
    if len(others) == 1:
        return others[0], []
    if not others:
        return None, ["no segment header gives the world size"]
    shown = ", ".join(f"rank {r} says {w}" for r, w, _ in claims[:4]) + (", ..." if len(claims) > 4 else "")
    return None, [f"segment headers disagree on the world size ({shown}): only the ranks found are shown"]


def _not_a_spill_root(storage: Storage) -> NotASpillRootError:
    where = storage.describe()
    kind = FO.what_is(storage)
    if kind == "other" and FO.header(storage) is not None:
        kind = "output"
    why = {
        "missing": f"{where} does not exist (a mistyped path, or no rank has opened its writer yet)",
        "file": f"{where} is a file, not a spill root",
        "output": f"{where} is a merged output, not a spill root: status reads the spill root the ranks write to "
        f"(`spillmerge inspect {where}` shows an output)",
        "other": f"{where} holds no rank-NNNNN folders: not a spill root, or no rank has opened its writer yet",
        "spill": f"{where} holds no readable rank folders",
    }[kind]
    return NotASpillRootError(why, path=where, kind=kind)


def _rank_status(storage: Storage, seg: Any, now: float, stall_after: float) -> RankStatus:
    started = iso_to_unix((seg.header or {}).get("started"))
    if seg.commit is not None:
        c = seg.commit
        end = iso_to_unix(c.finished)
        rate = c.n_frames / (end - started) if end and started and end > started else None
        return RankStatus(seg.rank, "committed", c.n_frames, c.nbytes, _age(now, end), None, False, rate,
                          seg.name, seg.run_id, c.n_frames)  # fmt: skip
    note = None
    try:
        prog = read_progress(storage, seg.rel)
    except SpillMergeError as exc:  # advisory: a bad record only costs this rank's counts
        prog, note = None, f"no counts: {exc}"
    frames, nbytes, durable = (prog.staged_frames, prog.staged_bytes, prog.frames) if prog is not None else (0, 0, 0)
    if seg.failure is not None:
        end = iso_to_unix(seg.failure.time)
        return RankStatus(seg.rank, "failed", frames, nbytes, _age(now, end), seg.failure.summary(), False, None,
                          seg.name, seg.run_id, durable)  # fmt: skip
    last = max(prog.staged_updated, prog.updated) if prog is not None else None if note else started
    age = _age(now, last)
    rate = frames / (last - started) if prog is not None and started and last and last > started else None
    stalled = age is not None and age > stall_after
    return RankStatus(seg.rank, "writing", frames, nbytes, age, note, stalled, rate, seg.name, seg.run_id, durable)


def _age(now: float, t: float | None) -> float | None:
    return None if t is None else round(max(0.0, now - t), 3)


def _merge_status(out: str, storage_options: dict[str, Any] | None) -> MergeStatus:
    output = Storage(out, storage_options)
    kind = FO.what_is(output)
    if kind == "missing" or kind == "other" and not output.listdir(""):
        return MergeStatus(output.url, "not-started", 0, 0, None, None)
    if kind != "other" or not _ownership.is_ours(output):
        what = {"file": "a file", "spill": "a spill root"}.get(kind, "a folder spillmerge did not write")
        return MergeStatus(output.url, "not-an-output", 0, 0, None, f"{output.describe()} is {what}, no merge output")
    if output.exists(FO.COMPLETE_NAME):
        return MergeStatus(output.url, "complete", 0, 0, None, None)
    try:
        records = _parts.read_records(output)
    except Exception as exc:  # noqa: BLE001 - a status view shows what it cannot read
        return MergeStatus(output.url, "running", 0, 0, None, f"part records unreadable: {exc}")
    failed = [r for r in records if isinstance(r, FO.PartFailureRecord)]
    done = [r for r in records if isinstance(r, FO.PartDoneRecord)]
    parts = max((r.parts for r in records), default=None)
    state: Any = "running"
    msg = None
    if failed:
        state = "failed"
        msg = "; ".join(f"{_parts.describe(r.part, r.parts, r.rank)}: {r.summary()}" for r in failed)
    elif not _lease.any_held(output):
        if output.exists(FO.COMPLETE_NAME):  # finished since we looked
            return MergeStatus(output.url, "complete", 0, 0, None, None)
        state = "interrupted"
        msg = "no process holds its lease: run the merge again (in parts: the parts not done, then finalize=True (--finalize))"
    return MergeStatus(output.url, state, len(done), len(failed), parts, msg)


def format_status(js: JobStatus) -> str:
    """The text table of ``spillmerge status``."""
    lines = [f"spill root {js.root}: world size {js.world_size if js.world_size is not None else '?'}"]
    lines.append(f"{'rank':>5}  {'state':<10}  {'frames':>9}  {'durable':>9}  {'bytes':>10}  {'rate/s':>8}  "
                 f"{'last write':>10}  note")  # fmt: skip
    for r in js.ranks:
        note = " ".join(x for x in ("STALLED" if r.stalled else "", one_line(r.message or "")) if x)
        rate = f"{r.rate_fps:.1f}" if r.rate_fps is not None else "-"
        age = _duration(r.last_write_age_s) + " ago" if r.last_write_age_s is not None else "-"
        lines.append(f"{r.rank:>5}  {r.state:<10}  {r.frames:>9}  {r.durable:>9}  {_size(r.bytes):>10}  {rate:>8}  "
                     f"{age:>10}  {note}")  # fmt: skip
    states = ("writing", "committed", "failed", "unreadable")
    counts = {s: sum(1 for r in js.ranks if r.state == s) for s in states} | {"missing": js.missing}
    total = f"{js.frames} frames, {_size(js.bytes)}"
    if js.expected:
        total += f" of {js.expected} expected ({100 * js.frames / js.expected:.1f}%)"
        if js.eta_s is not None and not js.done:
            total += f", about {_duration(js.eta_s)} left"
    stalled = sum(1 for r in js.ranks if r.stalled)
    counted = ", ".join(f"{v} {k}" for k, v in counts.items() if v) + (f", {stalled} stalled" if stalled else "")
    lines.append(f"total: {total}; {counted}")
    if js.merge is not None:
        m = js.merge
        parts = f", parts {m.parts_done}/{m.parts}" if m.parts else ""
        lines.append(f"merge into {m.out}: {m.state}{parts}" + (f" — {one_line(m.message)}" if m.message else ""))
    lines += [f"note: {n}" for n in js.notes]
    return "\n".join(lines)
