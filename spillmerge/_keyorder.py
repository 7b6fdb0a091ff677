"""Dict key order: what a value's dicts held their keys in, stored once per layout, not per row.

A value is flattened into leaves in sorted-key order (every reader relies on it); the order the
user's dicts had is kept beside it (docs/FORMAT.md, *Key order*):

  (writer)  ``flatten`` notes each dict whose keys are not in sorted order; each leaf's spill
            layout then carries ``pos``: per path segment, the key's position in its dict
            (-1 for a dict in sorted order and for list items). A value of sorted dicts carries
            nothing.
  (merge)   ``output_orders`` gathers, per output file, the positions of the layouts its rows
            use into one order per dict path, interns the distinct orders and writes them with
            runs of file ids in the output header (``key_orders``).
  (reader)  ``KeyOrders`` gives a file's orders; ``_rowvalue`` builds each dict in them.

The rule when one file's frames held a dict in different orders: a key's position is the one of
the first frame written (in merge order: segment by segment, then row order) that has the key
at that path; keys of the dict with no recorded position follow, sorted.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _format as F
from ._errors import CorruptSpillError

Path = tuple[str, ...]
Spec = dict[Path, dict[str, int]]
"""A file's key orders: dict path (list items as ``MARK`` + position, or ``ITEM`` for every item
of a list) -> key segment -> its position."""


def positions(path: Path, orders: dict[Path, dict[str, int]]) -> tuple[int, ...] | None:
    """A leaf's ``pos`` from the orders ``flatten`` noted (dict path -> segment -> position);
    None when no dict along the path is out of sorted order."""
    out = []
    hit = False
    for j, seg in enumerate(path):
        o = orders.get(path[:j])
        p = -1 if o is None else o.get(seg, -1)
        hit = hit or p >= 0
        out.append(p)
    return tuple(out) if hit else None


def check_pos(pos: Any, leaf: Path, where: str) -> tuple[int, ...] | None:
    """A catalog layout's ``pos`` as stored, checked: one int >= -1 per leaf segment."""
    if pos is None:
        return None
    if (
        not isinstance(pos, list)
        or len(pos) != len(leaf)
        or not all(type(p) is int and -1 <= p < (1 << 31) for p in pos)
    ):
        raise CorruptSpillError(f"{where}: layout pos must be one int >= -1 per leaf segment, got {pos!r:.200}",
                                path=where)  # fmt: skip
    return tuple(pos)


# --------------------------------------------------------------------------------------------
# merge


def _general(path: Path) -> Path:
    return tuple(F.ITEM if F.item_index(s) is not None else s for s in path)


def _compress(spec: dict[Path, list[str]]) -> list[list[Any]]:
    """``[[dict path, [key segments in order]], ...]``: dicts of one list whose items all have
    one order are stored once under the list's ``ITEM`` path."""
    by_gen: dict[Path, list[tuple[Path, list[str]]]] = {}
    for path, keys in spec.items():
        by_gen.setdefault(_general(path), []).append((path, keys))
    out: list[list[Any]] = []
    for gen, entries in sorted(by_gen.items()):
        if gen != entries[0][0] and all(keys == entries[0][1] for _, keys in entries):
            out.append([list(gen), entries[0][1]])
        else:
            out.extend([list(p), k] for p, k in sorted(entries))
    return out


def output_orders(filenames: Sequence[str], segments: Sequence[Any]) -> dict[str, Any] | None:
    """The output header's ``key_orders`` for a merge of ``segments`` into files ``filenames``
    (sorted): ``{"orders": [spec, ...], "runs": [[first file, end file, order id], ...]}``;
    None when no layout carries a position (every dict was in sorted order)."""
    per_file: dict[int, list[tuple[int, int]]] = {}  # file -> (segment, layout) in merge order
    lookup: dict[str, int] | None = None
    for si, s in enumerate(segments):
        with_pos = [i for i, lay in enumerate(s.layouts) if getattr(lay, "pos", None) is not None]
        if not with_pos:
            continue
        if lookup is None:
            lookup = {}
        idx = np.asarray(s.index)
        sel = np.isin(idx[:, 2], np.array(with_pos, dtype=np.int64))  # COL_LAYOUT
        pairs = idx[sel][:, [0, 2]]  # (COL_FILE, COL_LAYOUT), in row order
        if not len(pairs):
            continue
        _, first = np.unique(pairs, axis=0, return_index=True)
        for fid, lid in pairs[np.sort(first)].tolist():
            name = s.filenames[fid]
            g = lookup.get(name)
            if g is None:
                k = bisect.bisect_left(filenames, name)
                if k >= len(filenames) or filenames[k] != name:
                    continue
                g = lookup[name] = k
            per_file.setdefault(g, []).append((si, lid))
    if not per_file:
        return None
    orders: list[list[list[Any]]] = []
    ids: dict[str, int] = {}
    runs: list[list[int]] = []
    known: dict[tuple[tuple[int, int], ...], int] = {}  # files of the same layouts: one order, made once
    for g in sorted(per_file):
        used = tuple(per_file[g])
        oid = known.get(used)
        if oid is None:
            spec: dict[Path, dict[str, int]] = {}
            for si, lid in used:
                lay = segments[si].layouts[lid]
                for j, (seg, p) in enumerate(zip(lay.leaf, lay.pos, strict=True)):
                    if p >= 0:
                        spec.setdefault(lay.leaf[:j], {}).setdefault(seg, p)
            entry = _compress({path: _in_order(keys) for path, keys in spec.items()})
            key = repr(entry)
            oid = ids.get(key)
            if oid is None:
                oid = ids[key] = len(orders)
                orders.append(entry)
            known[used] = oid
        if runs and runs[-1][1] == g and runs[-1][2] == oid:
            runs[-1][1] = g + 1
        else:
            runs.append([g, g + 1, oid])
    return {"orders": orders, "runs": runs}


def _in_order(keys: dict[str, int]) -> list[str]:
    return sorted(keys, key=lambda k: (keys[k], k))


# --------------------------------------------------------------------------------------------
# reader


class KeyOrders:
    """The output header's ``key_orders``, checked at open: a file's spec by binary search of
    the runs."""

    __slots__ = ("_ends", "_ids", "_specs", "_starts")

    def __init__(self, obj: Any, n_files: int, where: str) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._ids: list[int] = []
        self._specs: list[Spec] = []
        if obj is None:
            return
        bad = f"{where}: key_orders is malformed"
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("orders"), list)
            or not isinstance(obj.get("runs"), list)
        ):
            raise CorruptSpillError(bad, path=where)
        for entry in obj["orders"]:
            spec: Spec = {}
            if not isinstance(entry, list):
                raise CorruptSpillError(bad, path=where)
            for item in entry:
                if (
                    not isinstance(item, list)
                    or len(item) != 2
                    or not all(isinstance(x, list) and all(isinstance(s, str) for s in x) for x in item)
                ):
                    raise CorruptSpillError(bad, path=where)
                spec[tuple(item[0])] = {k: i for i, k in enumerate(item[1])}
            self._specs.append(spec)
        end = 0
        for run in obj["runs"]:
            if (
                not isinstance(run, list)
                or len(run) != 3
                or not all(type(v) is int for v in run)
                or not end <= run[0] < run[1] <= n_files
                or not 0 <= run[2] < len(self._specs)
            ):
                raise CorruptSpillError(f"{bad} (run {run!r:.100})", path=where)
            end = run[1]
            self._starts.append(run[0])
            self._ends.append(run[1])
            self._ids.append(run[2])

    def overall(self) -> Spec | None:
        """One order per dict path (list items as ``ITEM``) for a whole-output schema (Arrow's
        struct fields and flat columns): a key's first position over the files' orders in file
        order; None when every dict is in sorted order."""
        if not self._specs:
            return None
        out: dict[Path, dict[str, int]] = {}
        for oid in self._ids:
            for path, keys in self._specs[oid].items():
                got = out.setdefault(_general(path), {})
                for k, i in keys.items():
                    got.setdefault(k, i)
        return {path: {k: i for i, k in enumerate(_in_order(keys))} for path, keys in out.items()}

    def of_file(self, i: int) -> Spec | None:
        """File ``i``'s key orders; None when its dicts are in sorted order."""
        if not self._starts:
            return None
        k = bisect.bisect_right(self._starts, i) - 1
        if k < 0 or i >= self._ends[k]:
            return None
        return self._specs[self._ids[k]]


def ordered(kids: dict[str, Any], path: Path, spec: Spec | None) -> list[tuple[str, Any]]:
    """A dict node's (segment, child) pairs in the key order ``spec`` gives the dict at
    ``path`` (its exact path, else its list's ``ITEM`` path); sorted when it gives none."""
    if spec is not None:
        rank = spec.get(path)
        if rank is None:
            gen = _general(path)
            if gen != path:
                rank = spec.get(gen)
        if rank is not None:
            far = len(rank)
            return sorted(kids.items(), key=lambda kv: (rank.get(kv[0], far), kv[0]))
    return sorted(kids.items())
