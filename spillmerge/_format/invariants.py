"""Invariants of a merged output (docs/FORMAT.md, *Invariants*) and bounded reads of its arrays,
shared by the reader and ``spillmerge verify``: its columns', its header's and its index's outside
``_read.index``'s row blocks; each check returns ``(path, what is wrong)`` pairs."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any

import numpy as np
import zarr

from .._errors import CorruptSpillError, SpillMergeError
from . import common as F
from . import output as FO
from . import spill as FS

Problem = tuple[str, str]
"""(path relative to the output, what is wrong): one broken invariant of an output."""

STRING_KINDS = frozenset({"str", "strlist"})


def read_array(arr: Any, sel: Any = None) -> np.ndarray:
    """``arr[sel]`` as numpy; a damaged chunk is a :class:`CorruptSpillError` naming the array.
    ``sel`` None: the whole array, a chunk row at a time: zarr allocates a selection's result
    before it fetches a chunk, so ``2**40`` declared rows read at once would allocate from metadata
    alone; chunk by chunk, memory grows only with chunks that exist, and an absent one ends it."""
    if sel is None:
        n = int(arr.shape[0]) if arr.ndim else 0
        k = int(arr.chunks[0]) if arr.ndim else 1
        if n > k:
            return np.concatenate([read_array(arr, slice(a, min(n, a + k))) for a in range(0, n, k)])
        sel = slice(None)
    try:
        return np.asarray(arr[sel])
    except SpillMergeError:
        raise
    except Exception as exc:  # noqa: BLE001 - zarr reports a damaged chunk as ValueError, codec errors ...
        raise CorruptSpillError(
            f"{arr.store_path}: a chunk is corrupt ({type(exc).__name__}: {exc})", path=str(arr.store_path)
        ) from exc


def read_rows(arr: Any, a: int, b: int, out: np.ndarray) -> None:
    """Rows ``a .. b-1`` of ``arr`` into ``out`` (``b - a`` rows), read one chunk row at a time on a
    local disk (zarr holds every chunk of a selection and its decoded copy until the selection is
    filled), four at a time on object stores, where requests in flight make reads fast."""
    k = int(arr.chunks[0]) * (1 if getattr(arr.store, "local", False) else 4)
    for pos, stop in itertools.pairwise([a, *range((a // k + 1) * k, b, k), b]):
        out[pos - a : stop - a] = read_array(arr, slice(pos, stop))


def index_node(group: Any, name: str, describe: Callable[[str], str]) -> Any:
    rel = f"index/{name}"
    path = describe(rel)
    node = group.get(rel)
    if node is None:
        raise CorruptSpillError(f"{path}: missing from the output's index", path=path)
    if not isinstance(node, zarr.Array) or node.ndim != 1:
        raise CorruptSpillError(f"{path}: expected a 1-d array", path=path)
    array_limits(node, path)  # its metadata within the format's chunk rules
    return node


_LIMITS: dict[int, tuple[Any, FO.ChunkLimits]] = {}
"""``array_limits``' results by ``id`` of the metadata object (kept with it: the id stays its own)."""


def array_limits(arr: Any, path: str) -> FO.ChunkLimits:
    """``_format.output.chunk_limits`` of the zarr array ``arr``'s metadata (``path`` names it in an
    error), once per metadata object: an open checks it where the array is looked up and where its
    chunks are read, and zarr's ``to_dict`` of it is most of the cost."""
    meta = arr.metadata
    hit = _LIMITS.get(id(meta))
    if hit is not None and hit[0] is meta:
        return hit[1]
    limits = FO.chunk_limits(meta.to_dict(), path=path)
    if len(_LIMITS) >= 1024:
        _LIMITS.clear()
    _LIMITS[id(meta)] = (meta, limits)
    return limits


def grid_problems(rel: str, arr: Any) -> list[Problem]:
    """What the array ``rel``'s metadata alone breaks of the format's chunk rules
    (``_format.output.chunk_limits``: chunk shape within the array's, known codecs, bounded chunk
    size, shapes without overflow), the limits that bound every chunk read (``NoFillStore``)."""
    try:
        array_limits(arr, rel)
    except CorruptSpillError as exc:
        return [(rel, exc.reason or str(exc))]
    return []


def offsets_block_problems(rel: str, o: np.ndarray, first: int, last: bool, n: int, of: str) -> list[Problem]:
    """What entries ``first ..`` of the offsets array ``rel`` into ``of`` (``n`` rows) break: from 0
    when ``first`` is 0, never decreasing, within ``0 .. n``, ending at ``n`` when ``last``."""
    if not len(o):
        return []
    if first == 0 and int(o[0]) != 0:
        return [(rel, f"starts at {int(o[0])}, not 0")]
    step = np.diff(o)
    if np.any(step < 0):
        j = int(np.flatnonzero(step < 0)[0])
        return [(rel, f"decreases from {int(o[j])} to {int(o[j + 1])} at entry {first + j + 1}")]
    if last and int(o[-1]) != n:
        return [(rel, f"ends at {int(o[-1])}, but {of} has {n} rows")]
    if int(o[0]) < 0 or int(o[-1]) > n:
        j = 0 if int(o[0]) < 0 else len(o) - 1
        return [(rel, f"entry {first + j} is {int(o[j])}, outside 0..{n} ({of} has {n} rows)")]
    return []


@dataclass(frozen=True, slots=True)
class StoredColumn(FO.ColumnHeader):
    """One column group ``columns/<name>`` of an output as stored, from its metadata alone: its
    header and its arrays (the reader wraps it in ``_read.column.OpenColumn``; the merge plans it as
    ``_merge.plan.PlannedColumn``)."""

    _: KW_ONLY
    name: str
    """Group name under ``columns/``."""
    arrays: dict[str, Any]
    """``values`` / ``offsets`` / ``shapes`` / ``valid`` -> ``zarr.Array`` (those present)."""

    @property
    def path(self) -> str:
        """The column's leaf path as users name it (``"a/b"``; ``""`` for plain tensor values)."""
        return "/".join(self.leaf)


def read_columns(group: Any) -> tuple[dict[str, StoredColumn], list[Problem]]:
    """Every column group's header and arrays (metadata only: consolidated, no chunk read), and
    what they break of the invariants that need no data."""
    out: dict[str, StoredColumn] = {}
    problems: list[Problem] = []
    cols = group.get("columns")
    if cols is None:
        return out, [("columns", "missing from the output")]
    if not isinstance(cols, zarr.Group):
        return out, [("columns", "expected a group")]
    for name, node in sorted(cols.members(max_depth=0), key=lambda kv: kv[0]):
        rel = f"columns/{name}"
        if not isinstance(node, zarr.Group):
            problems.append((rel, "expected a column group"))
            continue
        try:
            h = FO.ColumnHeader.from_obj(node.attrs.get("spillmerge"), name=name, path=rel)
        except CorruptSpillError as exc:
            problems.append((rel, exc.reason or str(exc)))
            continue
        arrays = {k: a for k, a in node.members(max_depth=0) if isinstance(a, zarr.Array)}
        info = StoredColumn(**{f.name: getattr(h, f.name) for f in fields(h)}, name=name, arrays=arrays)
        bad = _column_meta_problems(info)
        if bad:
            problems.extend(bad)
            continue
        out[name] = info
    # A leaf may have one column per variant, never two of one variant.
    paths: dict[tuple[tuple[str, ...], str], str] = {}
    for c in out.values():
        key = (c.leaf, c.variant or c.dtype)  # (the dtype of a column not numeric is its kind)
        if key in paths:
            problems.append((f"columns/{c.name}", f"holds the leaf {list(c.leaf)!r:.200} of columns/{paths[key]}"))
        paths[key] = c.name
    return out, problems


def _column_meta_problems(c: StoredColumn) -> list[Problem]:
    """Storage types and array presence of one column (lengths are checked against ``n_rows`` by
    :func:`column_problems`)."""
    rel, a = f"columns/{c.name}", c.arrays
    # every kind but fixed has offsets (of bytes for strings); strlist and flat ragged, shapes
    need = ["values"] + (["offsets"] if c.kind != "fixed" else [])
    if (c.kind == "ragged" and c.inner_shape is None) or c.kind == "strlist":
        need.append("shapes")
    need += ["valid"] if c.has_valid else []
    need += ["none"] if c.has_none else []
    out: list[Problem] = [(f"{rel}/{k}", f"missing from the {c.kind} column") for k in need if k not in a]
    if out:
        return out
    for k, said in (("valid", c.has_valid), ("none", c.has_none)):
        if k in a and not said:
            out.append((f"{rel}/{k}", f"present, but the column header's has_{k} is false"))
    for k, arr in sorted(a.items()):
        out.extend(grid_problems(f"{rel}/{k}", arr))
    if out:
        return out
    v = a["values"]
    if c.kind not in FO.NUMERIC_KINDS:
        if v.dtype != np.uint8:
            text = " (UTF-8 bytes)" if c.kind in STRING_KINDS else ""
            out.append((f"{rel}/values", f"a {c.kind} column's values must be uint8{text}, not {v.dtype}"))
    else:
        storage = np.dtype(F.DTYPES[c.dtype].storage)
        if v.dtype != storage:
            out.append((f"{rel}/values", f"dtype {c.dtype!r} is stored as {storage}, but the array holds {v.dtype}"))
    if c.kind != "fixed" and v.ndim != 1 and not (c.kind == "ragged" and c.inner_shape is not None):
        out.append((f"{rel}/values", f"expected a 1-d array, got {v.ndim} dimensions"))
    if c.kind == "ragged" and c.inner_shape is not None and tuple(v.shape[1:]) != c.inner_shape:
        out.append((f"{rel}/values", f"shape {tuple(v.shape)} does not end in inner_shape {list(c.inner_shape)}"))
    if c.kind == "fixed" and v.ndim < 1:
        out.append((f"{rel}/values", "a fixed column's values need a row dimension"))
    for k, kinds, ndim in (("offsets", "iu", 1), ("shapes", "iu", 2), ("valid", "b", 1), ("none", "b", 1)):
        if k in a and (a[k].dtype.kind not in kinds or a[k].ndim != ndim):
            out.append((f"{rel}/{k}", f"expected a {ndim}-d {'bool' if kinds == 'b' else 'int64'} array"))
    if "shapes" in a and a["shapes"].ndim == 2 and c.ndim is not None and a["shapes"].shape[1] != c.ndim:
        out.append((f"{rel}/shapes", f"{a['shapes'].shape[1]} dimensions per row, but the header's ndim is {c.ndim}"))
    return out


def column_problems(c: StoredColumn, n_rows: int, of: str = "index/frame_idx") -> list[Problem]:
    """Lengths of one column's arrays against ``n_rows``, the rows of its domain (``of``: the
    output's rows, or the items of a list) (metadata only)."""
    rel = f"columns/{c.name}"
    out: list[Problem] = []
    a = c.arrays
    # (only a fixed column may lack offsets, read_columns checks: then it holds a value per row)
    if "offsets" not in a and a["values"].shape[0] != n_rows:
        out.append((f"{rel}/values", f"{a['values'].shape[0]} rows, but {of} has {n_rows}"))
    for k, want in (("offsets", n_rows + 1), ("shapes", n_rows), ("valid", n_rows), ("none", n_rows)):
        if k in a and a[k].shape[0] != want:
            out.append((f"{rel}/{k}", f"{a[k].shape[0]} entries, but {of} has {n_rows} rows (must be {want})"))
    return out


def shape_products(shapes: np.ndarray, rel: str, base: int = 0) -> tuple[np.ndarray, list[Problem]]:
    """Elements per row of a non-negative ``(rows, ndim)`` shapes array, saturating at
    ``F.SHAPE_ELEMS_MAX`` (``[2**32, 2**32]`` is not 0 elements), and the rows that break
    ``F.shape_problem`` (too many elements, or entries before a zero dimension). Vectorised."""
    rows = shapes.shape[0]
    lead = np.ones(rows, dtype=np.int64)  # product of the dimensions before the first zero
    zero = np.zeros(rows, dtype=bool)
    over = np.zeros(rows, dtype=bool)
    for j in range(shapes.shape[1]):
        d = shapes[:, j]
        zero_now = zero | (d == 0)
        grow = ~zero_now
        big = grow & (lead > F.SHAPE_ELEMS_MAX // np.maximum(d, 1))
        over |= big
        lead = np.where(grow & ~big, lead * np.where(grow, d, 1), lead)
        zero = zero_now
    elems = np.where(zero, 0, lead)
    bad = np.flatnonzero(over | (zero & (lead > F.EMPTY_EXTENT_MAX)))
    if not len(bad):
        return elems, []
    r = int(bad[0])
    what = F.shape_problem(shapes[r].tolist()) or "is out of bounds"
    return elems, [(rel, f"row {base + r}'s {what} ({len(bad)} such rows)")]


def text_problems(c: StoredColumn, values: np.ndarray, offsets: np.ndarray, shapes: np.ndarray | None) -> list[Problem]:
    """Every string of a ``str`` / list-of-``str`` column valid UTF-8, and a list row's ``n``
    uint32 lengths adding up to its bytes (``_format.spill.text_problem``; offsets already checked)."""
    rel = f"columns/{c.name}/values"
    if c.kind == "strlist":  # a row at a time, as the merge's copy checks it
        assert shapes is not None
        for r, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
            bad = FS.text_problem("strlist", int(shapes[r, 0]), values[a:b])
            if bad is not None:
                return [(rel, f"row {r} holds {bad}")]
        return []
    starts = offsets[:-1][np.diff(offsets) > 0]
    try:
        values.tobytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        return [(rel, f"a string is not valid UTF-8 ({exc.reason} at byte {exc.start})")]
    inside = starts[(values[starts] & 0xC0) == 0x80]
    if len(inside):
        r = int(np.searchsorted(offsets, inside[0], side="right")) - 1
        return [(rel, f"row {r} is not valid UTF-8 (starts inside a character)")]
    return []


def _whole_ints(arr: Any) -> np.ndarray:
    return np.asarray(read_array(arr), dtype=np.int64)


def _has_value(c: StoredColumn, n: int) -> np.ndarray:
    return np.asarray(read_array(c.arrays["valid"]), bool) if "valid" in c.arrays else np.ones(n, bool)


def list_lengths(c: StoredColumn) -> np.ndarray:
    """Each row's length as a list (-1 where a row's value is not a list): a list header's
    value, a numeric column's first dimension, a string list's count."""
    a = c.arrays
    n = int(a["valid"].shape[0]) if "valid" in a else None
    if c.leaf and c.leaf[-1] == F.MARK:  # a container header: its value
        return header_values(c)
    if "shapes" in a and (c.kind == "strlist" or (c.kind == "ragged" and c.inner_shape is None)):
        return _whole_ints(a["shapes"]).reshape(int(a["shapes"].shape[0]), -1)[:, 0]
    if c.kind in ("strlist", "ragged"):
        return np.diff(_whole_ints(a["offsets"]))
    rows = int(a["offsets"].shape[0]) - 1 if "offsets" in a else int(a["values"].shape[0])
    width = int(a["values"].shape[1]) if c.kind == "fixed" and len(a["values"].shape) > 1 else -1
    return np.full(n if n is not None else rows, width, dtype=np.int64)


def header_values(c: StoredColumn) -> np.ndarray:
    """A container header's value per row (0 where a compact column holds none)."""
    values = _whole_ints(c.arrays["values"]).reshape(-1)
    if "offsets" not in c.arrays:
        return values
    steps = np.diff(_whole_ints(c.arrays["offsets"]))
    out = np.zeros(len(steps), dtype=np.int64)
    out[steps > 0] = values[: int(np.count_nonzero(steps > 0))]
    return out


def records_problems(cols: dict[str, StoredColumn]) -> list[Problem]:
    """Every row of a ``pyrecords`` header (a list of dicts) holds a list of that length under
    each key it has, and under at least one: what ``value()`` and ``to_arrow()`` check before
    sizing anything by the header (arrays read whole)."""
    out: list[Problem] = []
    heads = [c for c in cols.values() if c.dtype == "pyrecords" and c.leaf and c.leaf[-1] == F.MARK]
    for h in heads:
        p = h.leaf[:-1]
        keys = [
            c for c in cols.values()
            if c.leaf[: len(p)] == p and (
                (len(c.leaf) == len(p) + 1 and not F.is_marker(c.leaf[-1]))
                or (len(c.leaf) == len(p) + 2 and c.leaf[-1] == F.MARK and not F.is_marker(c.leaf[-2]))
            )
        ]  # fmt: skip
        n = header_values(h)
        has = _has_value(h, len(n))
        held = np.zeros(len(n), bool)
        problem = None
        for k in keys:
            got = list_lengths(k)
            v = _has_value(k, len(got))
            if len(got) != len(n) or len(v) != len(n):
                continue  # lengths against the rows: column_problems
            bad = np.flatnonzero(has & v & (got != n))
            if len(bad) and problem is None:
                row = int(bad[0])
                problem = f"key {F.path_text((k.leaf[len(p)],))!r} holds {int(got[row])}"
            held |= v
        if problem is None and np.any(has & ~held):
            row = int(np.flatnonzero(has & ~held)[0])
            problem = "no key holds a list there"
        if problem is not None:
            out.append((f"columns/{h.name}", f"row {row} says its list of dicts at {F.path_text(p)!r} has {int(n[row])} "
                        f"items, but {problem}"))  # fmt: skip
    return out


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
    what = f"{a!r:.200} is listed more than once" if a == b else f"not sorted: entry {i + 1} {b!r:.200} follows {a!r:.200}"
    return [(rel, what)]


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
    lists: tuple[dict[tuple[str, ...], Any], dict[tuple[str, ...], int]],
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
    else:  # the first column a file layout names that is not one
        gone = [(j, c) for j, lay in enumerate(layouts) for c in lay if c not in columns][:1]
        for j, c in gone:
            out.append(("zarr.json", f"file_layouts[{j}] names {c!r:.200}, which is not a column"))
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
    groups, sizes = lists
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
