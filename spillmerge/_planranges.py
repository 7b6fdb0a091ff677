"""The parts of a merge plan a range of filenames each (docs/SCALE.md, *The plan in ranges*;
docs/FORMAT.md section 2.1): the out-of-core plan's phases (``_plan_disk._Builder.run``) meet
through small objects under ``OUT/spillmerge-parts/ranges/<key>/<n>/<r>/``.

Protocol (a merge in ``n`` parts whose plan is built out of core; every part holds its part lease
from before it plans):

1. Every part sorts the runs of its share of the segments (``si mod n``) and publishes them
   (``_planruns``), then takes the others' runs, sorting any not there yet itself.
2. Every part finds the same ``n - 1`` splitters (sampled from the runs' bytes) and plans range
   ``i`` = its part number: phase A (names, pass 1), then ``a.json``, its summary; it waits for
   every other range's ``a.json``; phase B (pass 2), ``b.json``; waits for every ``b.json``;
   phase C, its pieces of the plan's arrays (each one object, hard-linked from its work folder
   where the output's file system allows) and ``c.json`` last, which lists them with both
   summaries. It then maps every other range's pieces and copies its share of the output.
3. A part waits for another range's objects while that range's part holds its lease (or, with
   a ``timeout``, up to it); when the part is not at work (not started, failed, killed), the
   waiting process plans that range itself and publishes it, so nobody waits for a dead part.
   The plan is the same whoever planned each range.
4. The finalize maps every range's pieces (planning any that is missing) and removes the folder
   after the completion marker.

The objects are the merge's own, like the published plan: checked for what would make the plan
fail or read out of range (summaries' types, arrays' sizes and dtypes, offsets' ends agreeing
with every range's summaries), not against the spill root.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _format as F
from . import _lease, _parts, _poll
from ._errors import SpillMergeError
from ._fetched import Fetches, prefetch
from ._parts import PARTS_DIR
from ._plan_disk import PIECE_ARRAYS, DamagedRange, Pieces, RangeExchange, SummaryA, SummaryB, WorkFolder
from ._planshare import put_array, read_array
from ._storage import Storage

RANGES_DIR = f"{PARTS_DIR}/ranges"
SUMMARY_MAX_BYTES = 64 << 20
"""A summary or ``c.json`` holds per-column and per-layout counts, not per-row data."""
_KIND = "merge-plan-range"


def folder(key: str, n: int, r: int) -> str:
    """Range ``r`` of ``n``'s folder for the plan of source key ``key``."""
    return f"{RANGES_DIR}/{key}/{n:05d}/{r:05d}"


def published_ranges(output: Storage, key: str, n: int) -> bool:
    """Whether any range of the plan of ``key`` in ``n`` ranges was published."""
    try:
        return output.exists(f"{RANGES_DIR}/{key}/{n:05d}")
    except SpillMergeError:
        return False


def remove(output: Storage) -> None:
    """The finalize, after the completion marker: the ranges are no longer needed."""
    output.rm_tree(RANGES_DIR)


class Exchange(RangeExchange):
    """The ranges of the plan of ``key`` in ``n`` parts, on ``output``; this process is part
    ``part`` (None: the finalize, which plans no range of its own). ``timeout``: how long to wait
    for a range whose part is not at work (0: not at all)."""

    def __init__(
        self, output: Storage, key: str, n: int, part: int | None, *, timeout: float, work_dir: str | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.output, self.key, self.n, self.part, self.timeout = output, key, n, part, timeout
        self.work = None if output.local else WorkFolder(work_dir)
        """Pieces fetched from an object store (removed by :meth:`close`)."""
        self.fetches = Fetches()
        """What was fetched of the other ranges' pieces (object stores: what the part reads)."""
        self.linked = 0
        """Arrays published as hard links to this process's work files (one file system)."""

    def close(self) -> None:
        if self.work is not None:
            self.work.close()

    def mine(self, r: int) -> bool:
        return r == self.part

    def where(self, r: int) -> str:
        return self.output.describe(folder(self.key, self.n, r))

    # -- publishing ---------------------------------------------------------------------------

    def _doc(self, r: int, **body: Any) -> bytes:
        head = {"kind": _KIND, "format_version": F.FORMAT_VERSION, "key": self.key, "ranges": self.n, "range": r}
        return F.dumps({**head, **body})

    def publish_a(self, r: int, s: SummaryA) -> None:
        self._note(r)
        rel = folder(self.key, self.n, r)
        self.output.makedirs(rel)
        self.output.put_atomic(f"{rel}/a.json", self._doc(r, summary=s.to_obj()))

    def publish_b(self, r: int, s: SummaryB) -> None:
        self._note(r)
        self.output.put_atomic(f"{folder(self.key, self.n, r)}/b.json", self._doc(r, summary=s.to_obj()))

    def publish_pieces(self, r: int, p: Pieces) -> None:
        """Every piece one object (written whole under its name: two processes publishing the
        same range write the same bytes), then ``c.json``."""
        self._note(r)
        rel = folder(self.key, self.n, r)
        arrays: dict[str, dict[str, Any]] = {}

        def put(name: str, a: Any) -> str | None:
            if a is None:
                return None
            arrays[name], linked = put_array(self.output, f"{rel}/{name}", a)
            self.linked += linked
            return name

        for name in PIECE_ARRAYS:
            put(name, p.arrays[name])
        columns = [
            {"src": put(f"c{g}.src", p.src[g]), "counts": put(f"c{g}.counts", p.counts[g]),
             "shapes": put(f"c{g}.shapes", p.shapes[g]), "offsets": put(f"c{g}.offsets", p.offs[g])}
            for g in range(len(p.src))
        ]  # fmt: skip
        self.output.put_atomic(
            f"{rel}/c.json",
            self._doc(r, a=p.a.to_obj(), b=p.b.to_obj(), arrays=arrays, columns=columns, digest=p.digest()),
        )

    def _note(self, r: int) -> None:
        if r != self.part and r not in self.planned:
            self.planned.append(r)

    # -- finding ------------------------------------------------------------------------------

    def summary_a(self, r: int) -> SummaryA | None:
        doc = self._wait(r, "a.json", wait=True)
        return None if doc is None else self._parse(r, "a.json", lambda: SummaryA.from_obj(doc["summary"]))

    def summary_b(self, r: int) -> SummaryB | None:
        doc = self._wait(r, "b.json", wait=True)
        return None if doc is None else self._parse(r, "b.json", lambda: SummaryB.from_obj(doc["summary"]))

    def pieces(self, r: int, *, wait: bool) -> Pieces | None:
        doc = self._wait(r, "c.json", wait=wait)
        if doc is None:
            return None
        got: Pieces = self._parse(r, "c.json", lambda: self._map(r, doc))
        self.mapped.append(r)
        return got

    def _map(self, r: int, doc: dict[str, Any]) -> Pieces:
        rel = folder(self.key, self.n, r)
        sizes = dict(self.output.find(rel))
        specs = doc["arrays"]

        got: dict[str, Any] = {}

        def arr(name: str | None) -> Any:
            if name is None:
                return None
            if isinstance(name, str) and name in got:  # named twice: one array (one local copy)
                return got[name]
            if not isinstance(name, str) or name not in specs or "/" in name:
                raise ValueError(f"no array {name!r:.80}")
            spec = specs[name]
            shape = tuple(int(x) for x in spec["shape"])
            obj = f"{rel}/{name}"
            got[name] = read_array(
                self.output, obj, np.dtype(spec["dtype"]), shape, sizes.get(obj), self.work, self._bad(r), self.fetches
            )
            return got[name]

        arrays = {name: arr(name) for name in PIECE_ARRAYS}
        cols = doc["columns"]
        if not isinstance(cols, list) or not all(isinstance(c, dict) for c in cols):
            raise ValueError("columns is not a list of objects")
        src = [arr(c["src"]) for c in cols]
        if any(a is None for a in [*arrays.values(), *src]):
            raise ValueError("an array is missing")
        # The ends of its offsets (what ``Pieces.problem`` reads), in one round trip.
        ends = [arrays["name_offsets"], arrays["file_offsets"], arrays["head_offsets"]]
        offs = [arr(c["offsets"]) for c in cols]
        ends += [a for a in offs if a is not None]
        prefetch([(a, i, i + 1) for a in ends for i in (0, len(a) - 1)])
        digest = doc["digest"]
        if not isinstance(digest, str) or len(digest) != 32 or any(ch not in "0123456789abcdef" for ch in digest):
            raise ValueError(f"digest {digest!r:.80} is not 32 hex digits")
        return Pieces(
            SummaryA.from_obj(doc["a"]), SummaryB.from_obj(doc["b"]), arrays,  # type: ignore[arg-type]
            src, [arr(c["counts"]) for c in cols], [arr(c["shapes"]) for c in cols],  # type: ignore[arg-type]
            offs, digest,
        )  # fmt: skip

    def _bad(self, r: int) -> Callable[[str], DamagedRange]:
        where = self.where(r)
        return lambda why: DamagedRange(f"{where}: {why}", path=where)

    def _parse(self, r: int, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except DamagedRange:
            raise
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, OSError, SpillMergeError) as exc:
            raise self._bad(r)(f"{name} is malformed ({type(exc).__name__}: {exc})") from exc

    def _wait(self, r: int, name: str, *, wait: bool) -> dict[str, Any] | None:
        """Range ``r``'s ``name`` (checked to be of this plan), waiting for it while ``wait`` and
        its part is at work (or up to ``timeout``); None: not there."""
        rel = f"{folder(self.key, self.n, r)}/{name}"
        for waited in _poll.poll(float("inf") if wait else 0.0, first=0.05, cap=1.0):
            try:
                raw = self.output.get_or_none(rel, max_bytes=SUMMARY_MAX_BYTES)
                doc = None if raw is None else F.loads(raw, path=self.output.describe(rel))
            except SpillMergeError as exc:  # not a file, a link, too large, not JSON
                raise self._bad(r)(f"{name} is unreadable ({type(exc).__name__}: {exc})") from exc
            if raw is not None:
                head = {"kind": _KIND, "format_version": F.FORMAT_VERSION, "key": self.key, "ranges": self.n,
                        "range": r}  # fmt: skip
                if not isinstance(doc, dict) or any(doc.get(k) != v for k, v in head.items()):
                    raise self._bad(r)(f"{name} is not range {r} of {self.n} of this plan")
                return doc
            if not wait or self._gone(r, waited):
                return None
        return None  # pragma: no cover - the poll has no deadline

    def _gone(self, r: int, waited: float) -> bool:
        """Whether range ``r``'s part is not at work: its lease free (after ``timeout``) or a
        failure record of it."""
        try:
            records = _parts.read_records(self.output)
        except SpillMergeError:
            records = []
        if any(rec.part == r and rec.parts == self.n and rec.failed for rec in records):
            return True
        return waited >= self.timeout and not _lease.held(self.output, _lease.part_name(r, self.n))
