"""Dict key order (docs/FORMAT.md, *Key order*): ``flatten`` notes each leaf's ``pos``, the merge
interns one order per file (``output_orders``, the header's ``key_orders``), the reader rebuilds
each dict in it (``KeyOrders``, ``ordered``)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
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


# --------------------------------------------------------------------------------------------
# merge


def _compress(spec: dict[Path, list[str]]) -> list[list[Any]]:
    """``[[dict path, [key segments in order]], ...]``: dicts of one list whose items all have
    one order are stored once under the list's ``ITEM`` path."""
    by_gen: dict[Path, list[tuple[Path, list[str]]]] = {}
    for path, keys in spec.items():
        by_gen.setdefault(F.general_path(path)[0], []).append((path, keys))
    out: list[list[Any]] = []
    for gen, entries in sorted(by_gen.items()):
        if gen != entries[0][0] and all(keys == entries[0][1] for _, keys in entries):
            out.append([list(gen), entries[0][1]])
        else:
            out.extend([list(p), k] for p, k in sorted(entries))
    return out


BLOCK = 1 << 18
"""Files, and index rows, per step of :func:`output_orders`' loops: a temporary is 2 MiB of int64
at most, whatever the number of files."""

Alloc = Callable[..., np.ndarray]
"""``new(name, shape, dtype)``: a new array of zeros (the plan's: a map of a file of its work
folder when large, so a per-file array is not anonymous memory)."""

Sig = tuple[Path, tuple[int, ...]]
"""A positioned layout: its leaf path and ``pos``."""


class _States:
    """Files walked in row order: a file's state is its spec so far (a key's first position wins),
    numbered from 1 (0: no positioned row yet); each (state, layout) step is built once."""

    def __init__(self, sigs: list[Sig]) -> None:
        self.sigs = sigs
        self.specs: list[Spec] = [{}]
        self._ids: dict[Any, int] = {(): 0}
        self._moves: dict[tuple[int, int], int] = {}
        self._entry: dict[int, int] = {}
        self.entries: list[list[list[Any]]] = []
        """The distinct entries (one file's orders, as written), numbered as met."""
        self._entry_ids: dict[str, int] = {}

    def move(self, s: int, sg: int) -> int:
        """The state after state ``s`` meets layout ``sg``."""
        got = self._moves.get((s, sg))
        if got is None:
            spec = {path: dict(keys) for path, keys in self.specs[s].items()}
            leaf, pos = self.sigs[sg]
            for j, (seg, p) in enumerate(zip(leaf, pos, strict=True)):
                if p >= 0:
                    spec.setdefault(leaf[:j], {}).setdefault(seg, p)
            key = tuple(sorted((path, tuple(sorted(keys.items()))) for path, keys in spec.items()))
            got = self._moves[(s, sg)] = self._ids.setdefault(key, len(self.specs))
            if got == len(self.specs):
                self.specs.append(spec)
        return got

    def walk(self, state: np.ndarray, g: np.ndarray, sg: np.ndarray) -> None:
        """``state`` (per file) after rows of files ``g`` and layouts ``sg``, in merge order: the
        k-th distinct layout of a file in these rows goes in step k (one per file a step)."""
        n = len(self.sigs)
        _, first = np.unique(g * n + sg, return_index=True)  # each (file, layout)'s first row
        first.sort()
        pg, ps = g[first], sg[first]
        by_file = np.argsort(pg, kind="stable")
        fs = pg[by_file]
        head = np.flatnonzero(np.concatenate(([True], fs[1:] != fs[:-1])))
        kth = np.empty(len(pg), dtype=np.int64)
        kth[by_file] = np.arange(len(pg)) - np.repeat(head, np.diff(np.append(head, len(pg))))
        by_k = np.argsort(kth, kind="stable")
        ends = np.searchsorted(kth[by_k], np.arange(int(kth.max()) + 1), side="right")
        for a, b in zip(np.concatenate(([0], ends[:-1])).tolist(), ends.tolist(), strict=True):
            f, sgk = pg[by_k[a:b]], ps[by_k[a:b]]
            u, inv = np.unique(np.asarray(state[f]) * n + sgk, return_inverse=True)
            nxt = [self.move(c // n, c % n) for c in u.tolist()]
            state[f] = np.array(nxt, dtype=np.int64)[inv]

    def entry_ids(self, st: np.ndarray) -> np.ndarray:
        """The entry id of each state of ``st`` (none 0)."""
        v = np.sort(st)  # the distinct states, sorted (by a sort: numpy 2's hashing np.unique is slower)
        u = v[np.concatenate(([True], v[1:] != v[:-1]))] if len(v) > 1 else v
        for s in u.tolist():
            if s not in self._entry:
                entry = _compress({path: _in_order(keys) for path, keys in self.specs[s].items()})
                self._entry[s] = self._entry_ids.setdefault(repr(entry), len(self.entries))
                if self._entry[s] == len(self.entries):
                    self.entries.append(entry)
        return np.array([self._entry[s] for s in u.tolist()], dtype=np.int64)[np.searchsorted(u, st)]


def _number_layouts(segments: Sequence[Any]) -> tuple[list[Sig], list[np.ndarray]]:
    """Every positioned layout numbered, in segment order; per segment, each layout's number (-1
    when it has no ``pos``)."""
    sig_id: dict[Sig, int] = {}
    lay_sigs = []
    for s in segments:
        lay_sig = np.full(len(s.layouts), -1, dtype=np.int64)
        for i, lay in enumerate(s.layouts):
            pos = getattr(lay, "pos", None)
            if pos is not None:
                lay_sig[i] = sig_id.setdefault((tuple(lay.leaf), tuple(pos)), len(sig_id))
        lay_sigs.append(lay_sig)
    return list(sig_id), lay_sigs


def _rows(
    segments: Sequence[Any], lay_sigs: list[np.ndarray], file_ids: Sequence[np.ndarray], step: int,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """The index rows of positioned layouts and known files in merge order (segment by segment,
    then row order), ``step`` rows at a time: their files (``file_ids``) and layout numbers."""
    for s, lay_sig, ids in zip(segments, lay_sigs, file_ids, strict=True):
        if not (lay_sig >= 0).any() or not s.n_rows:
            continue  # no dict out of sorted order here: its index is not read
        fmap = np.asarray(ids, dtype=np.int64)
        ib: Any = None
        for ib in map(np.asarray, _index_blocks(s, step)):
            sig, g = lay_sig[ib[:, 2]], fmap[ib[:, 0]]  # COL_LAYOUT, COL_FILE
            ok = (sig >= 0) & (g >= 0)
            if ok.all():  # the common case: no copies (a copy of the block costs a fifth of the walk's np.unique)
                yield g, sig
            elif ok.any():
                yield g[ok], sig[ok]
        del ib  # before the next segment is read: one segment's index at a time


def _index_blocks(s: Any, step: int) -> Iterator[np.ndarray]:
    """Segment ``s``'s index ``step`` rows at a time: read again a block at a time when the plan
    read it so (``_spill.stream``), else slices of the whole index, which a segment read when
    used (``_spill.lazy.LazySegment``) lets go at once (these slices hold it until done)."""
    if getattr(s, "stream", None) is not None:
        yield from s.rows(step)
        return
    idx = s.index
    s.release()
    for a in range(0, len(idx), step):
        yield idx[a : a + step]


def output_orders(
    filenames: Sequence[str], segments: Sequence[Any], file_ids: Sequence[np.ndarray],
    *, new: Alloc,
) -> dict[str, Any] | None:  # fmt: skip
    """The output header's ``key_orders`` for a merge of ``segments`` into files ``filenames``
    (sorted): ``{"orders": [spec, ...], "runs": [[first file, end file, order id], ...]}``;
    None when no layout carries a position (every dict was in sorted order). ``file_ids``: per
    segment, the position in ``filenames`` of each of its filenames (-1: none). Each file's layouts
    are walked in row order (:class:`_States`), a key's first position winning, :data:`BLOCK`
    rows and files at a time, into arrays from ``new``."""
    n_files = len(filenames)
    sigs, lay_sigs = _number_layouts(segments)
    if not sigs or not n_files:
        return None
    walker = _States(sigs)
    states = new("key_states", n_files, np.int64)
    for g, sg in _rows(segments, lay_sigs, file_ids, BLOCK):
        walker.walk(states, g, sg)
    runs: list[list[int]] = []
    for a in range(0, n_files, BLOCK):
        st = np.asarray(states[a : a + BLOCK])
        files = np.flatnonzero(st)
        if not len(files):
            continue
        fe = walker.entry_ids(st[files])
        files += a
        brk = np.ones(len(files), dtype=bool)
        brk[1:] = (files[1:] != files[:-1] + 1) | (fe[1:] != fe[:-1])
        first = np.flatnonzero(brk)
        last = np.append(first[1:], len(files)) - 1
        for f0, f1, e in zip(files[first].tolist(), (files[last] + 1).tolist(), fe[first].tolist(), strict=True):
            if runs and runs[-1][1] == f0 and runs[-1][2] == e:  # a run goes on across the block's edge
                runs[-1][1] = f1
            else:
                runs.append([f0, f1, e])
    if not runs:
        return None
    oid: dict[int, int] = {}  # orders numbered as the files meet them
    for r in runs:
        r[2] = oid.setdefault(r[2], len(oid))
    return {"orders": [walker.entries[e] for e in sorted(oid, key=oid.__getitem__)], "runs": runs}


def _in_order(keys: dict[str, int]) -> list[str]:
    return sorted(keys, key=lambda k: (keys[k], k))


# --------------------------------------------------------------------------------------------
# reader


class KeyOrders:
    """The output header's ``key_orders``, checked at open: a file's spec by binary search of
    the runs."""

    __slots__ = ("_runs", "_specs", "_starts")

    def __init__(self, obj: Any, n_files: int, where: str) -> None:
        self._runs: list[list[int]] = []  # [first file, end file, order id], ascending, disjoint
        self._specs: list[Spec] = []
        self._starts: list[int] = []
        if obj is None:
            return
        bad = f"{where}: key_orders is malformed"
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), list) for k in ("orders", "runs")):
            raise CorruptSpillError(bad, path=where)
        for entry in obj["orders"]:  # [[dict path, [keys in order]], ...]
            ok = isinstance(entry, list) and all(
                isinstance(item, list) and len(item) == 2 and all(F.str_list(x) for x in item) for item in entry
            )
            if not ok:
                raise CorruptSpillError(bad, path=where)
            self._specs.append({tuple(path): {k: i for i, k in enumerate(keys)} for path, keys in entry})
        end = 0
        for run in obj["runs"]:
            if (
                not F.int_list(run)
                or len(run) != 3
                or not end <= run[0] < run[1] <= n_files
                or not 0 <= run[2] < len(self._specs)
            ):
                raise CorruptSpillError(f"{bad} (run {run!r:.100})", path=where)
            end = run[1]
        self._runs = obj["runs"]
        self._starts = [run[0] for run in self._runs]

    def overall(self) -> Spec | None:
        """One order per dict path (list items as ``ITEM``) for a whole-output schema (Arrow's
        struct fields and flat columns): a key's first position over the files' orders in file
        order; None when every dict is in sorted order."""
        if not self._specs:
            return None
        out: dict[Path, dict[str, int]] = {}
        for _, _, oid in self._runs:
            for path, keys in self._specs[oid].items():
                gen = F.general_path(path)[0]
                out[gen] = keys | out.get(gen, {})  # a key's first position wins
        return {path: {k: i for i, k in enumerate(_in_order(keys))} for path, keys in out.items()}

    def of_file(self, i: int) -> Spec | None:
        """File ``i``'s key orders; None when its dicts are in sorted order."""
        k = bisect.bisect_right(self._starts, i) - 1
        if k < 0 or i >= self._runs[k][1]:
            return None
        return self._specs[self._runs[k][2]]

    def of_files(self, i0: int, i1: int) -> list[Spec | None]:
        """``of_file(i)`` for each file ``i0 .. i1-1``, a run at a time."""
        out: list[Spec | None] = [None] * (i1 - i0)
        for start, end, oid in self._runs[max(bisect.bisect_right(self._starts, i0) - 1, 0) :]:
            if start >= i1:
                break
            lo, hi = max(start, i0), min(end, i1)
            if lo < hi:
                out[lo - i0 : hi - i0] = [self._specs[oid]] * (hi - lo)
        return out


def ordered(kids: dict[str, Any], path: Path, spec: Spec | None) -> list[tuple[str, Any]]:
    """A dict node's (segment, child) pairs in the key order ``spec`` gives the dict at
    ``path`` (its exact path, else its list's ``ITEM`` path); sorted when it gives none."""
    rank = None if spec is None else spec.get(path) or spec.get(F.general_path(path)[0])
    if rank:  # (an empty order sorts as sorted order does)
        far = len(rank)
        return sorted(kids.items(), key=lambda kv: (rank.get(kv[0], far), kv[0]))
    return sorted(kids.items())
