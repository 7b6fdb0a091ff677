"""Invariants of a merged output's index and header (docs/FORMAT.md, *Invariants*) that ``open``
(and so ``spillmerge verify``) checks outside the row blocks of ``_read.index``: filenames sorted,
file layouts, the header's counts, the index arrays' lengths; ``(path, what is wrong)`` pairs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import common as F
from .invariants import Problem, StoredColumn, column_problems, index_node

PROVENANCE = ("frame_rank", "frame_copies")
"""Per-row provenance arrays under ``index/``: the rank a row came from, and its copies."""


def sorted_problems(filenames: np.ndarray, rel: str = "index/filenames") -> list[Problem]:
    """``index/filenames`` strictly ascending in code point order (so distinct); ``filenames``
    is an object array of ``str``."""
    bad = np.flatnonzero(~(filenames[1:] > filenames[:-1]))
    if not len(bad):
        return []
    i = int(bad[0])
    a, b = filenames[i], filenames[i + 1]
    if a == b:
        return [(rel, f"{a!r:.200} is listed more than once")]
    return [(rel, f"not sorted: entry {i + 1} {b!r:.200} follows {a!r:.200}")]


def layout_problems(file_layout: np.ndarray, n_layouts: int, filenames: Any, first: int = 0) -> list[Problem]:
    """The first entry of ``file_layout`` (entries ``first ..`` of the index's) that names no
    position in the header's ``n_layouts`` file layouts."""
    bad = np.flatnonzero((file_layout < 0) | (file_layout >= n_layouts))
    if not len(bad):
        return []
    i = first + int(bad[0])
    shown = str(filenames[i]) if i < len(filenames) else "?"
    what = f"entry {i} ({shown!r:.200}) is {int(file_layout[bad[0]])}, not a position in the header's {n_layouts} file_layouts"
    return [("index/file_layout", what)]


def meta_problems(
    filenames: Any,
    n_offsets: int,
    n_layout: int,
    lengths: dict[str, int],
    header: dict[str, Any],
    columns: dict[str, StoredColumn],
    lists: Any = None,
) -> list[Problem]:
    """What the header and the index arrays' lengths break, from metadata alone (``open``; the
    contents are checked block by block as they are read, ``_read.index``). ``lists``: (list
    groups, domain sizes) from ``_format.lists``, for the lengths of columns of a list's items."""
    out: list[Problem] = []
    n, rows = len(filenames), lengths["frame_idx"]
    if n_layout != n:
        out.append(("index/file_layout", f"{n_layout} entries for {n} files in index/filenames"))
    layouts = header.get("file_layouts")
    if not isinstance(layouts, list) or not all(F.str_list(lay) for lay in layouts):
        out.append(("zarr.json", f"the header's file_layouts {layouts!r:.200} is not a list of column-name lists"))
    else:
        for j, lay in enumerate(layouts):
            gone = [c for c in lay if c not in columns]
            if gone:
                out.append(("zarr.json", f"file_layouts[{j}] names {gone[0]!r:.200}, which is not a column"))
                break
    if n_offsets != n + 1:
        out.append(("index/frame_offsets", f"{n_offsets} entries for {n} files (must be {n + 1})"))
    for name in PROVENANCE:
        if name not in lengths:
            out.append((f"index/{name}", "missing from the output's index"))
        elif lengths[name] != rows:
            out.append((f"index/{name}", f"{lengths[name]} rows, but index/frame_idx has {rows}"))
    for field, want in (("n_files", n), ("n_frames", rows)):
        if header.get(field) != want:
            out.append(("zarr.json", f"the header's {field} is {header.get(field)!r}, but the index holds {want}"))
    groups, sizes = lists if lists is not None else ({}, {})
    for c in columns.values():
        domain = F.list_domain(c.leaf)
        if not domain:
            out.extend(column_problems(c, rows))
        elif domain in sizes:
            out.extend(column_problems(c, sizes[domain], f"lists/{groups[domain].name}/offsets"))
        elif domain not in groups:
            out.append((f"columns/{c.name}", f"its rows are the items of the list {list(domain)!r:.200}, "
                        "which has no list group (lists/)"))  # fmt: skip
    return out


def index_lengths(group: Any, describe: Callable[[str], str]) -> dict[str, int]:
    """Rows of ``frame_idx`` and of the provenance arrays present, from their metadata alone."""
    out = {"frame_idx": index_node(group, "frame_idx", describe).shape[0]}
    idx: Any = group["index"]
    for name in PROVENANCE:
        if name in idx:
            out[name] = index_node(group, name, describe).shape[0]
    return out


def layout_rows(
    frame_offsets: np.ndarray, file_layout: np.ndarray, layouts: list[list[str]]
) -> Callable[[str], np.ndarray]:
    """``in_layout(column)``: per row, whether its file's ``file_layouts`` entry lists the column
    (offsets and file_layout already checked)."""
    file_of_row = np.repeat(np.arange(len(file_layout), dtype=np.int64), np.diff(frame_offsets))
    layout_of_row = file_layout[file_of_row]

    def in_layout(name: str) -> np.ndarray:
        listed = np.array([name in lay for lay in layouts], dtype=bool)
        return listed[layout_of_row] if len(listed) else np.zeros(len(layout_of_row), dtype=bool)

    return in_layout
