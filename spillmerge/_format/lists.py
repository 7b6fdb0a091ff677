"""The output's list offsets (docs/FORMAT.md section 2, *Lists*): read, checked, and used to map
rows between a list path's items (``offsets[r] .. offsets[r+1]-1`` of row ``r`` of its domain)
and the output's rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from . import common as F
from .invariants import Problem, grid_problems, offsets_block_problems, read_array


@dataclass(frozen=True, slots=True)
class StoredList:
    """One ``lists/<name>`` group: the list path (ending in ``ITEM``) and its offsets array."""

    name: str
    path: tuple[str, ...]
    array: Any

    @property
    def parent(self) -> tuple[str, ...]:
        return F.list_domain(self.path[:-1])


def read_lists(group: Any) -> tuple[dict[tuple[str, ...], StoredList], list[Problem]]:
    """Every list group of an output (metadata only), and what is wrong with them."""
    out: dict[tuple[str, ...], StoredList] = {}
    problems: list[Problem] = []
    node = group.get("lists")
    if node is None:
        return out, problems
    if not isinstance(node, zarr.Group):
        return out, [("lists", "expected a group")]
    members: list[tuple[str, Any]] = sorted(node.members(max_depth=0), key=lambda kv: kv[0])
    for name, grp in members:
        rel = f"lists/{name}"
        attrs = grp.attrs.get("spillmerge") if isinstance(grp, zarr.Group) else None
        path = attrs.get("list") if isinstance(attrs, dict) else None
        if not F.str_list(path) or not path or path[-1] != F.ITEM:
            problems.append((rel, f"expected a list group whose header names a path ending in {F.ITEM!r}"))
            continue
        arr = dict(grp.members(max_depth=0)).get("offsets")
        if not isinstance(arr, zarr.Array):
            problems.append((f"{rel}/offsets", "missing from the list group"))
            continue
        bad = grid_problems(f"{rel}/offsets", arr)
        if not bad and (arr.dtype.kind not in "iu" or arr.ndim != 1):
            bad = [(f"{rel}/offsets", "expected a 1-d int64 array")]
        if bad:
            problems.extend(bad)
            continue
        key = tuple(path)
        if key in out:
            problems.append((rel, f"holds the list {path!r:.200} of lists/{out[key].name}"))
            continue
        out[key] = StoredList(name, key, arr)
    for stored in out.values():
        if stored.parent and stored.parent not in out:
            what = f"its lists are items of {list(stored.parent)!r:.200}, which has no list group"
            problems.append((f"lists/{stored.name}", what))
    return out, problems


def domains(
    lists: dict[tuple[str, ...], StoredList], n_rows: int
) -> tuple[dict[tuple[str, ...], np.ndarray], dict[tuple[str, ...], int], list[Problem]]:
    """Each list's offsets (read and checked: from 0, never decreasing, one entry per row of its
    parent domain, plus one) and each domain's number of rows (``()``: the output's rows)."""
    offs: dict[tuple[str, ...], np.ndarray] = {}
    sizes: dict[tuple[str, ...], int] = {(): n_rows}
    problems: list[Problem] = []
    for path in sorted(lists, key=lambda p: (p.count(F.ITEM), p)):
        lst = lists[path]
        if lst.parent not in sizes:
            continue  # its parent is missing or broken: said already
        rel = f"lists/{lst.name}/offsets"
        n_parent = sizes[lst.parent]
        if lst.array.shape[0] != n_parent + 1:
            problems.append(
                (rel, f"{lst.array.shape[0]} entries for the {n_parent} rows of its parent (must be {n_parent + 1})")
            )
            continue
        o = np.asarray(read_array(lst.array), dtype=np.int64)
        bad = offsets_block_problems(rel, o, 0, False, int(o[-1]), rel)  # (its length: checked above)
        if not bad and int(o[-1]) > F.MAX_LEAF_BYTES:
            bad = [(rel, f"ends at {int(o[-1])} items, more than a reader accepts")]
        if bad:
            problems.extend(bad)
            continue
        offs[path] = o
        sizes[path] = int(o[-1])
    return offs, sizes, problems


def chain(path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The lists from the output's rows down to domain ``path`` (outermost first)."""
    return [path[: k + 1] for k, seg in enumerate(path) if seg == F.ITEM]


def rows_of(offs: dict[tuple[str, ...], np.ndarray], domain: tuple[str, ...], a: int, b: int) -> tuple[int, int]:
    """The rows of ``domain`` that output rows ``a .. b-1`` hold."""
    for lst in chain(domain):
        o = offs[lst]
        a, b = int(o[a]), int(o[b])
    return a, b


def expand(offs: dict[tuple[str, ...], np.ndarray], domain: tuple[str, ...], per_row: np.ndarray) -> np.ndarray:
    """A per-output-row array as one entry per row of ``domain`` (each item takes its row's)."""
    for lst in chain(domain):
        per_row = np.repeat(per_row, np.diff(offs[lst]))
    return per_row


def top_row(offs: dict[tuple[str, ...], np.ndarray], domain: tuple[str, ...], d: int) -> int:
    """The output row whose value holds row ``d`` of ``domain``."""
    for lst in reversed(chain(domain)):
        d = int(offs[lst].searchsorted(d, side="right")) - 1  # (a stored plan's: one block read)
    return d


def positions(
    offs: dict[tuple[str, ...], np.ndarray], domain: tuple[str, ...], r: int
) -> tuple[int, list[tuple[int, ...]]]:
    """Where the rows of ``domain`` that output row ``r`` holds sit: their first row, and per
    row its item position in each enclosing list (outermost first); in Python ints, as one row's
    lists are short."""
    lo, hi = r, r + 1
    items: list[tuple[int, ...]] = [()]
    for lst in chain(domain):
        o = offs[lst]
        bounds = o[lo : hi + 1].tolist()
        items = [(*p, i) for p, a, b in zip(items, bounds, bounds[1:], strict=False) for i in range(b - a)]
        lo, hi = bounds[0], bounds[-1]
    return lo, items


def header_problems(
    lists: dict[tuple[str, ...], StoredList], offs: dict[tuple[str, ...], np.ndarray], heads: list[Any]
) -> list[Problem]:
    """Every ``pylist`` / ``pytuple`` header column (``StoredColumn``) has its list group (a
    header whose items are missing is damage), and (``heads`` with values read: (column, valid,
    lengths)) each row's length equals its list's offsets step; a row no header holds has none."""
    out: list[Problem] = []
    by_list: dict[tuple[str, ...], list[tuple[Any, Any, Any]]] = {}
    for c, valid, n in heads:
        lpath = (*c.leaf[:-1], F.ITEM)
        if lpath not in lists:
            what = f"a {c.dtype[2:]} header whose items' list lists/{F.leaf_text(lpath)!r:.200} is missing"
            out.append((f"columns/{c.name}", what))
            continue
        by_list.setdefault(lpath, []).append((c, valid, n))
    for lpath, hs in by_list.items():
        o = offs.get(lpath)
        if o is None or any(n is None for _, _, n in hs):
            continue
        steps = np.diff(o)
        said = np.zeros(len(steps), dtype=np.int64)
        for _, valid, n in hs:
            n = np.asarray(n, dtype=np.int64).reshape(-1)
            if valid is None:
                said[:] += n if len(n) == len(said) else 0
            else:
                said[np.asarray(valid, bool)] += n
        bad = np.flatnonzero(said != steps)
        if len(bad):
            r = int(bad[0])
            out.append((f"lists/{lists[lpath].name}/offsets", f"row {r} spans {int(steps[r])} items, but its header says "
                        f"{int(said[r])} ({len(bad)} such rows)"))  # fmt: skip
    return out


def item_offsets(offs: dict[tuple[str, ...], np.ndarray], domain: tuple[str, ...], a: int, b: int) -> np.ndarray:
    """Offsets (from 0) of the rows of ``domain`` that each output row ``a .. b-1`` holds."""
    o = np.arange(a, b + 1, dtype=np.int64)
    for lst in chain(domain):
        o = offs[lst][o]
    return o - o[0]


def any_per_row(
    offs: dict[tuple[str, ...], np.ndarray], domain: tuple[str, ...], mask: np.ndarray, to: tuple[str, ...] = ()
) -> np.ndarray:
    """Per row of domain ``to`` (``()``: the output's rows; ``domain`` or one it lies in): whether
    any of its rows of ``domain`` is set in ``mask``."""
    for lst in reversed(chain(domain)[len(chain(to)) :]):
        o = offs[lst]
        parent = np.repeat(np.arange(len(o) - 1, dtype=np.int64), np.diff(o))
        out = np.zeros(len(o) - 1, dtype=bool)
        out[parent[mask]] = True
        mask = out
    return mask
