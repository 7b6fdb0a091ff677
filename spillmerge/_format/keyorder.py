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
  (reader)  ``KeyOrders`` gives a file's orders; ``_read.rowvalue`` builds each dict in them.

The rule when one file's frames held a dict in different orders: a key's position is the one of
the first frame written (in merge order: segment by segment, then row order) that has the key
at that path; keys of the dict with no recorded position follow, sorted.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import CorruptSpillError
from . import common as F

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


def output_orders(
    filenames: Sequence[str], segments: Sequence[Any], file_ids: Sequence[np.ndarray] | None = None
) -> dict[str, Any] | None:
    """The output header's ``key_orders`` for a merge of ``segments`` into files ``filenames``
    (sorted): ``{"orders": [spec, ...], "runs": [[first file, end file, order id], ...]}``;
    None when no layout carries a position (every dict was in sorted order). ``file_ids``: per
    segment, the position in ``filenames`` of each of its filenames (-1: none), when the caller
    knows them (the plan does); else they are looked up.

    A file's orders follow from the distinct positioned layouts its rows use. Where those never
    give one key two positions, the order of the rows does not matter: each file's set of
    layouts is a bit mask (numpy, no sort), and a spec is built in Python once per run of files
    with one mask. Only files whose layouts disagree on a position are walked in row order
    (segment by segment, then row order: the first row decides)."""
    sig_id: dict[tuple[Path, tuple[int, ...]], int] = {}
    sigs: list[tuple[Path, tuple[int, ...]]] = []
    lookup: dict[str, int] | None = None
    n_files = len(filenames)

    def rows(si: int, s: Any) -> tuple[np.ndarray, np.ndarray]:
        """Segment ``s``'s rows of positioned layouts, in row order: their files and layouts."""
        nonlocal lookup
        lay_sig = np.full(len(s.layouts), -1, dtype=np.int64)
        for i, lay in enumerate(s.layouts):
            pos = getattr(lay, "pos", None)
            if pos is not None:
                sk = (tuple(lay.leaf), tuple(pos))
                if sk not in sig_id:
                    sig_id[sk] = len(sigs)
                    sigs.append(sk)
                lay_sig[i] = sig_id[sk]
        empty = np.zeros(0, np.int64)
        if not (lay_sig >= 0).any():
            return empty, empty  # no dict out of sorted order here: its index is not read
        idx = np.asarray(s.index)
        release = getattr(s, "release", None)
        if release is not None:
            release()  # a lazily read segment: one segment's index at a time (idx holds it)
        if not len(idx):
            return empty, empty
        sig = lay_sig[idx[:, 2]]  # COL_LAYOUT
        sel = np.flatnonzero(sig >= 0)
        if not len(sel):
            return empty, empty
        if file_ids is not None:
            fmap = np.asarray(file_ids[si], dtype=np.int64)
        else:
            if lookup is None:
                lookup = {name: k for k, name in enumerate(filenames)}
            fmap = np.fromiter((lookup.get(n, -1) for n in s.filenames), dtype=np.int64, count=len(s.filenames))
        g = fmap[idx[sel, 0]]  # COL_FILE
        ok = g >= 0
        return g[ok], sig[sel][ok]

    def spec_of(seq: Sequence[int]) -> tuple[list[list[Any]], bool]:
        """The entry of a file whose layouts are ``seq`` (in row order), and whether two of them
        give one key different positions (the first one then decides)."""
        spec: dict[Path, dict[str, int]] = {}
        clash = False
        for sg in seq:
            leaf, pos = sigs[sg]
            for j, (seg, p) in enumerate(zip(leaf, pos, strict=True)):
                if p >= 0:
                    clash |= spec.setdefault(leaf[:j], {}).setdefault(seg, p) != p
        return _compress({path: _in_order(keys) for path, keys in spec.items()}), clash

    def per_segment() -> Any:
        """Each segment's :func:`rows`, one segment's at a time (all of them at once would be two
        int64 arrays of every index row)."""
        return (rows(si, s) for si, s in enumerate(segments)) if n_files else iter(())

    for s in segments:  # every positioned layout numbered first, in segment order, as rows() does
        for lay in s.layouts:
            pos = getattr(lay, "pos", None)
            if pos is not None and (tuple(lay.leaf), tuple(pos)) not in sig_id:
                sig_id[(tuple(lay.leaf), tuple(pos))] = len(sigs)
                sigs.append((tuple(lay.leaf), tuple(pos)))
    if not sigs or not n_files:
        return None
    wide = len(sigs) > 62
    # each file's layouts: a bit mask (up to 62 distinct layouts), else their sorted ids
    masks = np.zeros(n_files if not wide else 0, dtype=np.int64)
    sets: dict[int, set[int]] = {}
    any_rows = False
    for g, sig in per_segment():
        any_rows = any_rows or bool(len(g))
        if not wide:
            np.bitwise_or.at(masks, g, np.left_shift(np.int64(1), sig))
        elif len(g):  # each distinct (file, layout) pair once (by a sort), then per pair
            u = np.sort(g * len(sigs) + sig)
            u = u[np.concatenate(([True], u[1:] != u[:-1]))]
            for f, sg in zip((u // len(sigs)).tolist(), (u % len(sigs)).tolist(), strict=True):
                sets.setdefault(f, set()).add(sg)
    if not any_rows:
        return None
    if not wide:
        files = np.flatnonzero(masks)
        fmask = masks[files]
        change = np.ones(len(files), dtype=bool)
        change[1:] = fmask[1:] != fmask[:-1]
        keys: dict[int, Any] = {
            int(f): int(m) for f, m in zip(files[change].tolist(), fmask[change].tolist(), strict=True)
        }
        members = {m: [b for b in range(len(sigs)) if (m >> b) & 1] for m in set(keys.values())}
    else:
        files = np.array(sorted(sets), dtype=np.int64)
        change = np.ones(len(files), dtype=bool)
        members = {}
        keys = {}
        for f in files.tolist():
            k = tuple(sorted(sets[f]))
            keys[f] = k
            members[k] = list(k)
    # the key of each change point (a file whose layouts differ from the file's before it)
    cp_key = [keys[f] for f in files[change].tolist()]
    entries: dict[Any, list[list[Any]]] = {}
    clashing: set[Any] = set()
    for k, seq in members.items():
        entries[k], clash = spec_of(seq)
        if clash:
            clashing.add(k)
    ordered: dict[int, list[int]] = {}
    if clashing:  # files whose layouts clash are walked in row order, each its own change point
        walk = np.zeros(n_files, dtype=bool)
        in_clash = np.array([k in clashing for k in cp_key], dtype=bool)
        walk[files[in_clash[np.cumsum(change) - 1]]] = True
        # their rows in merge order; each (file, layout)'s first row; per file, by that row
        pairs = [(g[walk[g]], sig[walk[g]]) for g, sig in per_segment()]
        wf = np.concatenate([g for g, _ in pairs])
        ws = np.concatenate([sig for _, sig in pairs])
        _, at = np.unique(wf * len(sigs) + ws, return_index=True)
        at = at[np.lexsort((at, wf[at]))]
        for f, sg in zip(wf[at].tolist(), ws[at].tolist(), strict=True):
            ordered.setdefault(f, []).append(sg)
        change = change | walk[files]
        keys = {**keys, **{f: None for f in ordered}}
    orders: list[list[list[Any]]] = []
    ids: dict[str, int] = {}
    cp_oid = []
    for f in files[change].tolist():
        entry = spec_of(ordered[f])[0] if f in ordered else entries[keys[f]]
        key = repr(entry)
        got = ids.get(key)
        if got is None:
            got = ids[key] = len(orders)
            orders.append(entry)
        cp_oid.append(got)
    oid = np.array(cp_oid, dtype=np.int64)[np.cumsum(change) - 1]
    brk = np.ones(len(files), dtype=bool)
    brk[1:] = (files[1:] != files[:-1] + 1) | (oid[1:] != oid[:-1])
    first = np.flatnonzero(brk)
    last = np.append(first[1:], len(files)) - 1
    runs = [
        [a, b + 1, o] for a, b, o in zip(files[first].tolist(), files[last].tolist(), oid[first].tolist(), strict=True)
    ]
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
