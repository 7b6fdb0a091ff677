"""Parallel merge coordination through storage: part records under ``OUT/spillmerge-parts/``,
each written once, whole, last, after its chunks are flushed; the finalize waits for all ``n`` of
its plan (docs/FORMAT.md section 2, docs/GUARANTEES.md)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

from .._errors import CorruptSpillError, MissingPartsError, PartFailedError, PartsTimeout, PlanMismatchError
from .._format import common as F
from .._format import output as FO
from .._format.codecs import CODECS
from .._storage import Storage
from .._util import poll as _poll

PARTS_DIR = "spillmerge-parts"
RUN_EVERY_PART = "run every part first: merge(root, out, part=(i, n)) (--part I/N), then finalize=True (--finalize)"
"""What a finalize without parts tells its caller, in the Python call and the CLI flag."""
_NAME_RE = re.compile(r"part-(\d{5,})-of-(\d{5,})(\.failed)?\.json")


def record_name(part: int, parts: int, *, failed: bool = False) -> str:
    return f"{PARTS_DIR}/part-{part:05d}-of-{parts:05d}{'.failed' if failed else ''}.json"


def describe(part: int, parts: int, rank: int | None = None) -> str:
    return f"part {part}/{parts}" + (f" (rank {rank})" if rank is not None else "")


Record = FO.PartDoneRecord | FO.PartFailureRecord
"""A part's completion record, or its failure record, as read."""


def put(output: Storage, rec: FO.PartDoneRecord | FO.PartFailureRecord) -> None:
    """Write a part's completion or failure record, whole."""
    output.makedirs(PARTS_DIR)
    output.put_atomic(record_name(rec.part, rec.parts, failed=isinstance(rec, FO.PartFailureRecord)), rec.to_json())


def write_failure(
    output: Storage, part: int, parts: int, plan: str, rank: int | None, run_id: str | None, exc: BaseException
) -> None:
    """Best effort: a part that cannot write its failure record is found missing at the timeout."""
    with contextlib.suppress(Exception):  # the original error matters more than this one
        put(output, FO.PartFailureRecord.of(exc, part=part, parts=parts, plan=plan, rank=rank, run_id=run_id))


def _parse(output: Storage, name: str, raw: bytes) -> Record:
    where = output.describe(f"{PARTS_DIR}/{name}")
    m = _NAME_RE.fullmatch(name)
    assert m is not None
    part, parts = int(m.group(1)), int(m.group(2))
    if m.group(3) is not None:
        return FO.PartFailureRecord.from_json(raw, path=where, part=part, parts=parts)
    done = FO.PartDoneRecord.from_json(raw, path=where, part=part, parts=parts)
    if done.codec not in CODECS:
        raise CorruptSpillError(f"{where}: bad codec {done.codec!r} or chunk_bytes {done.chunk_bytes!r}", path=where)
    return done


def read_records(output: Storage, cache: dict[str, Record] | None = None) -> list[Record]:
    """Every part record of the output, in name order (unreadable ones raise, naming the path).

    Records are immutable once written, so a ``cache`` kept across polls saves reading each
    again; the listing stays the truth (a record that disappeared is dropped)."""
    cache = {} if cache is None else cache
    out = []
    for name in output.listdir(PARTS_DIR):
        if not _NAME_RE.fullmatch(name):
            continue  # temporaries of an atomic write in progress
        if name not in cache:
            limit = F.FAILURE_MAX_BYTES if name.endswith(".failed.json") else F.RECORD_MAX_BYTES
            raw = output.get_or_none(f"{PARTS_DIR}/{name}", max_bytes=limit)
            if raw is None:
                continue
            cache[name] = _parse(output, name, raw)
        out.append(cache[name])
    return out


def foreign(records: list[Record], parts: int, plan: str) -> list[FO.PartDoneRecord]:
    """Completion records that belong to another plan or another part count."""
    return [r for r in records if isinstance(r, FO.PartDoneRecord) and (r.parts != parts or r.plan != plan)]


def differing(mine: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    """The plan options on which two calls disagree, as ``name: here vs there`` (empty: none known)."""
    if mine is None or theirs is None:
        return ""
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    return ", ".join(f"{k}={mine.get(k)!r} here, {theirs.get(k)!r} there" for k in keys)


def mismatch_error(
    output: Storage, bad: list[FO.PartDoneRecord], parts: int, plan: str, *, hint: str,
    options: dict[str, Any] | None = None,
) -> PlanMismatchError:  # fmt: skip
    def one(r: FO.PartDoneRecord) -> str:
        diff = differing(options, r.options)
        count = f"{r.parts} parts there, {parts} here" if r.parts != parts else ""
        why = "; ".join(x for x in (diff, count) if x) or "same options: the spill root changed"
        at = output.describe(record_name(r.part, r.parts))
        return f"{describe(r.part, r.parts, r.rank)} at {at} (plan {r.plan[:12]}; {why})"

    shown = "; ".join(one(r) for r in bad[:8])
    return PlanMismatchError(
        f"{output.describe()} holds parts written from a different merge plan than this one "
        f"({parts} part(s), plan {plan[:12]}): {shown}{' ...' if len(bad) > 8 else ''}; the spill root, "
        f"the part count or the merge options (codec, chunk size, duplicate policy) changed between parts; {hint}",
        path=output.describe(),
        parts=sorted({r.part for r in bad}),
    )


def infer_parts(output: Storage, records: list[Record]) -> int:
    counts = sorted({r.parts for r in records})
    if not counts:
        raise MissingPartsError(
            f"{output.describe()}: no part records under {PARTS_DIR}/; {RUN_EVERY_PART}",
            path=output.describe(),
            missing=[],
            parts=0,
        )
    if len(counts) > 1:
        raise PlanMismatchError(
            f"{output.describe()} holds parts of merges with different part counts ({counts}); rerun every part "
            "of one of them with overwrite=True (--overwrite)",
            path=output.describe(),
            parts=sorted({r.part for r in records}),
        )
    return counts[0]


def wait(
    output: Storage,
    parts: int,
    plan: str,
    *,
    timeout: float,
    collective: bool = False,
    run_id: str | None = None,
    options: dict[str, Any] | None = None,
    told: Callable[[list[int]], dict[int, str]] | None = None,
) -> list[FO.PartDoneRecord]:
    """The finalizer's barrier: every part's completion record with this plan, else a clear error
    naming the parts (failed at once, missing after ``timeout`` seconds, other plans at once).
    ``collective``: part ``i`` is rank ``i`` (``SpillWriter.merge(parallel=True)``), and messages say
    so. Failure records count only for this plan (and ``run_id`` when given): an earlier attempt's
    stays on storage until its part runs again, and must not fail this one. ``told(parts)``: the
    failures of those parts known elsewhere (the process group's store), as "Type: message"."""
    cache: dict[str, Record] = {}
    for waited in _poll.poll(timeout, first=0.05, cap=2.0):
        records = read_records(output, cache)
        bad = foreign(records, parts, plan)
        if bad:
            raise mismatch_error(output, bad, parts, plan, hint="rerun those parts with overwrite=True (--overwrite)", options=options)
        done = {r.part: r for r in records if isinstance(r, FO.PartDoneRecord)}
        failed = {
            r.part: r
            for r in records
            if isinstance(r, FO.PartFailureRecord) and r.parts == parts and r.plan == plan and r.part not in done
            and (run_id is None or r.run_id == run_id)
        }  # fmt: skip
        missing = [p for p in range(parts) if p not in done]
        failures = {p: r.summary() for p, r in sorted(failed.items())}
        if not failures and missing and told is not None:  # collective: part p is rank p
            failures = told(missing)
        if failures:
            rank = {p: p if collective else failed[p].rank for p in failures}
            detail = "; ".join(f"{describe(p, parts, rank[p])}: {why}" for p, why in failures.items())
            raise PartFailedError(
                f"{len(failures)} of {parts} part(s) of the merge into {output.describe()} failed: {detail}; "
                f"rerun them (records under {output.describe(PARTS_DIR)})",
                failures=failures,
                path=output.describe(),
            )
        if not missing:
            return [done[p] for p in range(parts)]
        if waited >= timeout:
            names = ", ".join(describe(p, parts, p if collective else None) for p in missing[:20])
            names += " ..." if len(missing) > 20 else ""
            msg = (
                f"{output.describe()}: {len(missing)} of {parts} part(s) have no completion record: {names} "
                f"(expected {output.describe(record_name(missing[0], parts))})"
            )
            fields = {"path": output.describe(), "missing": missing, "parts": parts}
            if timeout > 0:
                why = f"after waiting {waited:.1f} s; check those processes' logs and rerun the parts"
                raise PartsTimeout(f"{msg} {why}", waited_s=waited, **fields)
            why = f"run them: merge(root, out, part=(i, {parts})) (--part I/{parts}), or wait: timeout= (--timeout)"
            raise MissingPartsError(f"{msg}; {why}", **fields)
    raise AssertionError("unreachable: poll() ends only after a check at the deadline")  # pragma: no cover
