"""Property test: random values of every kind (every dtype and memory layout, 0-d and empty
arrays, NaN / -0.0 / inf, ints at the int64 limits, NUL and non-ASCII text), written by two
ranks through ``write()``, ``write_batch()`` and ``update()``, read back alike by every reader:
``value()``, ``iter_values()``, the leaf views, ``to_arrow()``, ``iter_batches()``, ``to_parquet()``
read by pyarrow, the CLI's ``export``, and the same values from a merge in parts (``merge(part=)``
and ``finalize``, or ``merge_parallel``).

Forms the readers document: arrays come back as numpy arrays of the dtype's name, little-endian
(a big-endian array reads back native); a leaf view gives a Python scalar as its numpy scalar;
Arrow gives tuples as lists, complex as (real, imag), raw-bit dtypes as their unsigned bits, a
leaf whose numeric dtype differs between files as one column per dtype (``a:pyint``), null for a
key holding None as for a key the row lacks, and an empty dict beside dicts with keys as no
column (docs/READING.md, ``_read/arrow.py``)."""

from __future__ import annotations

import math
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_arrow_values import py

import spillmerge
from spillmerge import cli
from spillmerge._format.common import MARK, RAW_BITS, user_key
from spillmerge._merge.job import merge_parallel

INF, NAN = float("inf"), float("nan")
TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=4),  # lone surrogates are refused
    st.sampled_from(["", "\x00", "a\x00b", "é😀\U0010ffff"]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([-(2**63), 2**63 - 1, -(2**63) + 1, 2**53 + 1]),
    st.floats(),
    st.sampled_from([NAN, -NAN, -0.0, INF, -INF, 5e-324]),
    st.complex_numbers(),
    TEXT,
    st.binary(max_size=4),
)
NUMPY_DTYPES = [
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
]  # fmt: skip
SHAPES = [(), (0,), (3,), (2, 0), (2, 3), (1, 2, 2)]
LAYOUTS = ["C", "F", "strided", "big-endian", "torch"]


def _array(dtype: Any, shape: tuple[int, ...], raw: bytes, layout: str) -> Any:
    """An array of any bits of ``dtype`` (NaN payloads, signed zeros) in ``layout``."""
    dt = np.dtype(dtype)
    n = math.prod(shape)
    bits = np.frombuffer(raw.ljust(n * dt.itemsize, b"\x01")[: n * dt.itemsize], np.uint8)
    arr = (bits % 2).astype(bool) if dt == np.bool_ else bits.view(dt)
    arr = arr.reshape(shape)
    if layout == "F":
        return np.asfortranarray(arr)
    if layout == "strided" and arr.ndim:
        wide = np.repeat(arr, 2, axis=-1)
        return wide[..., ::2]
    if layout == "big-endian" and dt.kind in "iufc" and dt.name not in RAW_BITS:
        return arr.astype(dt.newbyteorder(">"))
    if layout == "torch" and dt.name != "uint32" and dt.name != "uint64":
        if dt.name == "bfloat16":
            return torch.from_numpy(arr.view(np.uint16).copy()).view(torch.bfloat16)
        if dt.name in RAW_BITS:
            return torch.from_numpy(arr.view(np.uint8).copy()).view(getattr(torch, dt.name))
        return torch.from_numpy(arr.copy())
    return arr


ARRAYS = st.builds(
    _array, st.sampled_from(NUMPY_DTYPES), st.sampled_from(SHAPES), st.binary(max_size=96), st.sampled_from(LAYOUTS)
)
KEYS = st.sampled_from(["a", "b", "é", "x y", "\x1f", "\x1fk", "zarr.json", "..", "a/b"])
VALUES = st.recursive(
    st.one_of(SCALARS, ARRAYS),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner), st.dictionaries(KEYS, inner, max_size=3)
    ),
    max_leaves=8,
)
HOW = st.sampled_from(["write", "write_batch", "update"])
ROWS = st.lists(
    st.tuples(st.sampled_from(["f", "g/h", "é", "z\x00"]), st.integers(0, 3), ARRAYS | VALUES, HOW),
    min_size=1,
    max_size=6,
)


def _np(v: Any) -> Any:
    """A written value as ``value()`` gives it back: tensors as numpy arrays (ml_dtypes for
    bfloat16 and float8), arrays little-endian."""
    if isinstance(v, torch.Tensor):
        name = str(v.dtype).removeprefix("torch.")
        if name not in RAW_BITS:
            return v.numpy()
        bits = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[v.element_size()]  # a view of any shape
        return v.view(bits).numpy().view(getattr(ml_dtypes, name))
    if isinstance(v, np.ndarray):
        return v.astype(v.dtype.newbyteorder("<"))
    if isinstance(v, dict):
        return {k: _np(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_np(x) for x in v)
    return v


def canon(v: Any) -> Any:
    """A value comparable with ``==``: types kept (``1``, ``1.0`` and ``True`` differ), floats by
    their bits (NaN equal to NaN, -0.0 not to 0.0), arrays by dtype name, shape and bytes, dicts
    by their items whatever their order."""
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.name, v.shape, np.ascontiguousarray(v).tobytes())
    if isinstance(v, (bool, np.bool_)):
        return ("bool", bool(v))
    if isinstance(v, (int, np.integer)):
        return ("int", int(v))
    if isinstance(v, (float, np.floating)):
        return ("float", "nan" if math.isnan(v) else struct.pack("<d", float(v)))
    if isinstance(v, (complex, np.complexfloating)):
        return ("complex", canon(v.real), canon(v.imag))
    if isinstance(v, dict):
        return ("dict", sorted((k, canon(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [canon(x) for x in v])
    return v


def _arrow_form(v: Any) -> Any:
    """A value as Arrow holds it (``to_pylist``): tuples as lists, complex as (real, imag), raw-bit
    dtypes as their unsigned bits, None keys dropped (a null, as a key the row lacks)."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind == "c":
            v = np.stack([v.real, v.imag], axis=-1)
        if v.dtype.name in RAW_BITS:
            v = v.view(f"u{v.dtype.itemsize}")
        return [_arrow_form(x) for x in v] if v.ndim else v.item()
    if isinstance(v, complex):
        return [v.real, v.imag]
    if isinstance(v, (list, tuple)):
        return [_arrow_form(x) for x in v]
    if isinstance(v, dict):
        return {k: _arrow_form(x) for k, x in v.items() if x is not None}
    return v


def _flat_leaves(v: Any, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The dict paths (escaped keys) of a value's flat columns."""
    if isinstance(v, dict) and v:
        return set().union(*(_flat_leaves(y, (*path, user_key(k))) for k, y in v.items()))
    return {path}


def _dict_paths(v: Any, path: str = "") -> set[str]:
    """The paths at which a value holds a dict with keys, from the root down."""
    if not (isinstance(v, dict) and v):
        return set()
    return {path}.union(*(_dict_paths(y, f"{path}/{user_key(k)}" if path else user_key(k)) for k, y in v.items()))


def _flat(v: Any, dict_paths: set[str], columns: set[str]) -> dict[str, Any]:
    """A row as exported columns: dicts from the root flattened to ``a/b`` (escaped keys), the
    rest at its path (``value`` for the root). An empty dict where other rows have a dict with
    keys makes no column by itself (its keys' columns are null in its row), and is ``{}`` in a
    column of its path made for other reasons (``columns``: ``_read/arrow.py``, ``Node.structured``)."""
    out: dict[str, Any] = {}

    def walk(x: Any, path: str) -> None:
        if isinstance(x, dict) and (x or (path in dict_paths and (path or "value") not in columns)):
            for k, y in x.items():
                walk(y, f"{path}/{user_key(k)}" if path else user_key(k))
        elif x is not None:
            out[path or "value"] = canon(_arrow_form(x))

    walk(v, "")
    return out


def _table_rows(table: Any) -> list[tuple[str, int, dict[str, Any]]]:
    """Each row of an exported table: its key and its non-null columns in canonical form, a leaf
    split by numeric dtype between files (``a:pyint``, ``a:pybool``) under its path (``a``)."""
    names = [n for n in table.column_names if n not in ("filename", "frame_idx", "rank")]
    cols = {n: table.column(n) for n in names}
    keys = table.select(["filename", "frame_idx"]).to_pylist()
    rows = []
    for i, key in enumerate(keys):
        row: dict[str, Any] = {}
        for n, c in cols.items():
            x = _arrow_form(py(c[i]))
            if x is not None:
                path = n.rpartition(":")[0] or n
                assert path not in row, (key, n, row)  # a row has a value in one dtype's column only
                row[path] = canon(x)
        rows.append((key["filename"], key["frame_idx"], row))
    return rows


def _holds_empty_dicts(t: Any) -> bool:
    """A column type with ``struct<>`` for an empty dict: itself, or one child of its union."""
    if pa.types.is_union(t):
        return any(_holds_empty_dicts(t.field(i).type) for i in range(t.num_fields))
    return pa.types.is_struct(t) and t.num_fields == 0


def _has_union(t: Any) -> bool:
    return pa.types.is_union(t) or any(_has_union(t.field(i).type) for i in range(t.num_fields))


def _no_parquet_type(t: Any) -> bool:
    """A union, or a struct without fields (an empty dict): types Parquet lacks."""
    if pa.types.is_union(t) or (pa.types.is_struct(t) and t.num_fields == 0):
        return True
    return any(_no_parquet_type(t.field(i).type) for i in range(t.num_fields))


def _terminals(v: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """The leaves a file's view shows at a dict path: values that are no dict, list or tuple."""
    if isinstance(v, dict) and v:
        return [t for k, x in v.items() for t in _terminals(x, (*path, k))]
    if isinstance(v, (dict, list, tuple)):
        return []
    return [(path, v)]


def _view_candidates(node: Any, path: tuple[str, ...]) -> list[Any] | None:
    """The views of a leaf path in a file (one per variant, ``<key>.<tag>``), None when the
    path's keys are ambiguous with a variant's name or a header."""
    views = [node]
    for k in path:
        if "." in k or k.startswith(MARK):
            return None
        nxt = []
        for d in views:
            if not isinstance(d, dict):
                return None
            nxt += [x for name, x in d.items() if name == k or name.startswith(k + ".")]
        views = nxt
    if len(views) == 1 and isinstance(views[0], dict):
        views = [x for name, x in views[0].items() if not name.startswith(MARK)]  # a plain value's variants
    return views if views and not any(isinstance(x, dict) for x in views) else None


def _check_views(res: Any, want: dict[tuple[str, int], Any]) -> None:
    """Every terminal leaf of every row, read through ``res[filename][key]...[row]``."""
    for name in res.filenames:
        frames = sorted(f for n, f in want if n == name)
        kinds: dict[tuple[str, ...], set[str]] = {}
        for f in frames:  # a path that is a terminal in one frame and a container in another: not a view
            for path, _ in _terminals(want[(name, f)]):
                for i in range(len(path)):
                    kinds.setdefault(path[:i], set()).add("dict")
                kinds.setdefault(path, set()).add("leaf")
        node = res[name]
        for row, f in enumerate(frames):
            for path, leaf in _terminals(want[(name, f)]):
                if kinds[path] != {"leaf"} or any(kinds.get(path[:i]) != {"dict"} for i in range(len(path))):
                    continue
                views = _view_candidates(node, path)
                if views is None:
                    continue
                got = [v[row] for v in views]
                present = [g for g in got if g is not None]
                if leaf is None:
                    assert present == [], (name, f, path, got)
                    continue
                assert len(present) == 1, (name, f, path, got)
                g = present[0]
                if isinstance(leaf, (bool, int, float, complex)):  # a Python scalar: its numpy scalar
                    assert isinstance(g, np.generic), (name, f, path, g)
                    g = g.item()
                elif isinstance(g, np.generic):  # a 0-d array: its numpy scalar
                    g = np.asarray(g)
                assert canon(g) == canon(_np(leaf)), (name, f, path, g, leaf)


def _write(root: str, rows: list[tuple[str, int, Any, str]]) -> dict[tuple[str, int], Any]:
    want: dict[tuple[str, int], Any] = {}
    for rank in range(2):
        with spillmerge.SpillWriter(root, rank, 2, fsync=False, chunk_bytes=4096) as w:
            batch: list[tuple[str, int, Any]] = []
            for i, (name, frame, value, how) in enumerate(rows):
                if i % 2 != rank or (name, frame) in want:
                    continue
                want[(name, frame)] = value
                if how == "write":
                    w.write(name, frame, value)
                elif how == "update":
                    w.update({name: {frame: value}} if i % 4 < 2 else {name: (frame, value)})
                else:
                    batch.append((name, frame, value))
            for group in _batches(batch):
                names, frames, items = zip(*group, strict=True)
                w.write_batch(list(names), _stacked(list(items), len(want)), list(frames))
    return want


def _batches(batch: list[tuple[str, int, Any]]) -> list[list[tuple[str, int, Any]]]:
    """A rank's ``write_batch`` items: arrays of one type, dtype and shape together (one batched
    array each), the other items as one list."""
    groups: dict[Any, list[tuple[str, int, Any]]] = {}
    for item in batch:
        v = item[2]
        key = (type(v), str(v.dtype), tuple(v.shape)) if isinstance(v, (np.ndarray, torch.Tensor)) else None
        groups.setdefault(key, []).append(item)
    return list(groups.values())


def _stacked(items: list[Any], seed: int) -> Any:
    """Items of one array type, dtype and shape as one batched array (C order, Fortran order or
    strided); any other items as the list."""
    if isinstance(items[0], torch.Tensor):
        batch = torch.stack(items)
        return batch if seed % 2 else batch.repeat_interleave(2, dim=0)[::2]
    if isinstance(items[0], np.ndarray):
        batch = np.stack(items)
        return [batch, np.asfortranarray(batch), np.repeat(batch, 2, axis=0)[::2]][seed % 3]
    return items


@given(ROWS, st.integers(1, 3), st.integers(2, 3))
def test_every_reader_gives_the_values_written(tmp_path_factory, rows, batch_size, parts):
    base = tmp_path_factory.mktemp("agree")
    root, out, split = str(base / "s"), str(base / "o"), str(base / "p")
    want = _write(root, rows)
    opts: dict[str, Any] = {"progress": False, "fsync": False, "chunk_bytes": 512}
    spillmerge.merge(root, out, **opts)
    if parts == 2:  # SpillWriter.merge(parallel=True)'s steps: a part per rank, then dst finalizes
        for rank in range(2):
            merge_parallel(root, split, rank=rank, world_size=2, dst=1, run_id=None, timeout=5, **opts)
    else:
        for i in range(parts):
            spillmerge.merge(root, split, part=(i, parts), **opts)
        spillmerge.merge(root, split, finalize=True, **opts)
    res = spillmerge.open(out)
    expect = {key: canon(_np(v)) for key, v in want.items()}

    # value() and iter_values(), of the one-process merge and of the merge in parts
    assert {(n, f): canon(res.value(n, f)) for n, f in want} == expect
    assert {(n, f): canon(_np(res.value(n, f, as_torch=True))) for n, f in want} == expect
    assert [k for k in ((n, f) for n, f, _ in res.iter_values())] == sorted(want)
    assert {(n, f): canon(v) for n, f, v in res.iter_values()} == expect
    assert {(n, f): canon(v) for n, f, v in spillmerge.open(split).iter_values()} == expect

    # the leaf views
    _check_views(res, want)

    # Arrow: the table, its batches, Parquet (to_parquet and the CLI) read back by pyarrow
    table = res.to_arrow()
    leaves = set().union(*(_flat_leaves(v) for v in want.values()))
    if len({"/".join(p) for p in leaves}) < len(leaves):
        return  # {"a/b": 1} beside {"a": {"b": 2}}: test_keys_naming_one_column_export_as_distinct_columns
    dict_paths = set().union(*(_dict_paths(v) for v in want.values()))
    columns = {f.name for f in table.schema if _holds_empty_dicts(f.type)}
    arrow_want = [(n, f, _flat(_np(want[(n, f)]), dict_paths, columns)) for n, f in sorted(want)]
    assert _table_rows(table) == arrow_want
    batches = list(res.iter_batches(batch_size=batch_size))
    assert all(b.schema == table.schema for b in batches) and sum(b.num_rows for b in batches) == len(want)
    assert _table_rows(pa.Table.from_batches(batches, table.schema)) == arrow_want
    if any(_has_union(f.type) for f in table.schema):
        with pytest.raises(spillmerge.ArrowUnionInParquetError):
            res.to_parquet(base / "t.parquet")
        return
    if any(_no_parquet_type(f.type) for f in table.schema):  # an empty dict where no row has keys
        with pytest.raises(spillmerge.ParquetTypeError):
            res.to_parquet(base / "t.parquet")
        return
    res.to_parquet(base / "t.parquet")
    assert cli.main(["export", out, "--parquet", str(base / "c.parquet")]) == 0
    for target in ("t.parquet", "c.parquet"):
        back = pq.read_table(base / target)
        assert back.column_names == table.column_names
        assert _table_rows(back) == arrow_want, target


LEAVES = st.one_of(
    st.sampled_from([0, 7, 2**63 - 1, 1.5, NAN, True, "", "é", None, b"", [1, 2], [2.5], [True], ["x", ""]]),
    st.builds(np.full, st.sampled_from([(3,), (2, 2)]), st.integers(0, 9), st.sampled_from(["float32", "int8"])),
    st.builds(torch.full, st.sampled_from([(3,), ()]), st.floats(-9, 9), dtype=st.sampled_from([torch.bfloat16])),
    SCALARS,
    ARRAYS,
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
    st.lists(st.floats(), max_size=3),
    st.lists(st.booleans(), max_size=3),
    st.lists(TEXT, max_size=3),
)
RECORD = st.fixed_dictionaries({"a": LEAVES, "b": LEAVES, "c": LEAVES})
RECORDS = st.tuples(
    RECORD,
    st.lists(st.tuples(st.dictionaries(st.sampled_from("abc"), LEAVES, max_size=1), HOW), min_size=1, max_size=10),
)


@given(RECORDS)
def test_frames_of_one_structure_read_back_as_written(tmp_path_factory, records):
    """New files of one dict structure (a first one, each next one with at most one leaf of
    another value) take the writers' templates and the batches' column-wise path until a leaf's
    kind, dtype, shape or layout differs: each reads back as written."""
    base = tmp_path_factory.mktemp("same")
    root, out = str(base / "s"), str(base / "o")
    first, changes = records
    rows = [(f"file-{i:02d}", 0, {**first, **change}, how) for i, (change, how) in enumerate(changes)]
    want = _write(root, rows)
    spillmerge.merge(root, out, progress=False, fsync=False)
    res = spillmerge.open(out)
    expect = {key: canon(_np(v)) for key, v in want.items()}
    assert {(n, f): canon(v) for n, f, v in res.iter_values()} == expect
    assert {(n, f): canon(res.value(n, f)) for n, f in want} == expect


def test_to_parquet_of_an_empty_dict_is_refused_by_name(tmp_path):
    # An empty dict at a path no row has keys at is an Arrow struct<>, which Parquet cannot
    # store: to_parquet (and the CLI's export) refuse it as they refuse a union, naming the
    # column, before writing.
    root, out, target = str(tmp_path / "s"), str(tmp_path / "o"), tmp_path / "t.parquet"
    with spillmerge.SpillWriter(root, fsync=False) as w:
        w.write("a.jpg", 0, {"x": 1, "extra": {}})
        w.write("b.jpg", 0, {"x": 2})
    spillmerge.merge(root, out, progress=False, fsync=False)
    res = spillmerge.open(out)
    assert res.to_arrow().schema.field("extra").type == pa.struct([])
    with pytest.raises(spillmerge.ParquetTypeError, match="'extra'") as info:
        res.to_parquet(target)
    assert info.value.columns == ["extra"] and not target.exists() and not list(tmp_path.glob("t.parquet.tmp-*"))
    assert cli.main(["export", out, "--parquet", str(target)]) == 1 and not target.exists()


@pytest.mark.parametrize(
    ("values", "plain"),
    [
        ([{"a/b": 1}, {"a": {"b": 2}}], "a/b"),
        ([{"value": 1}, 5], "value"),
        ([{"": 1}, 5], "value"),
        ([{"x": {"a/b": [1, "s"]}}, {"x": {"a": {"b": 2.5}}}], "x/a/b"),
    ],
    ids=["slash-key", "value-key", "empty-key", "structured"],
)
def test_keys_naming_one_column_export_as_distinct_columns(tmp_path, values, plain):
    # Arrow names a flat column by its keys joined with "/" ("value" at the root): a key holding
    # "/", an empty key or a key "value" beside other rows' nested dicts or plain values names
    # the same column as they do. The nested path (the plain value) keeps the name, the other
    # is named by its path as JSON; none is lost.
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root, fsync=False) as w:
        for i, v in enumerate(values):
            w.write(f"f{i}", 0, v)
    spillmerge.merge(root, out, progress=False, fsync=False)
    res = spillmerge.open(out)
    table = res.to_arrow()
    names = table.column_names
    assert len(set(names)) == len(names) == 3 + len(values) and plain in names, names
    rows = table.drop(["filename", "frame_idx", "rank"]).to_pylist()
    cells = [[k for k, x in row.items() if x is not None] for row in rows]
    assert cells[1] == [plain] and len(cells[0]) == 1 and cells[0][0].startswith("["), cells
    assert pa.Table.from_batches(list(res.iter_batches(batch_size=1))).equals(table)
    if not any(_has_union(f.type) for f in table.schema):
        res.to_parquet(tmp_path / "t.parquet")
        assert pq.read_table(tmp_path / "t.parquet").column_names == names
