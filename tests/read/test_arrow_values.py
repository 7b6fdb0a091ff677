"""Python values as Arrow types: a leaf of several variants is one dense union,
lists / tuples / lists of dicts are Arrow lists (of structs), dicts from the root stay flat
columns; every exported row equals ``res.value()`` of that row in Arrow's Python form, the
one-type case goes to Parquet that polars and DuckDB read, and a union refuses Parquet by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_value_model import VALUES

import spillmerge
from spillmerge._format.common import user_key

KEYS = ("filename", "frame_idx", "rank")


def arrowish(v: Any) -> Any:
    """A value as ``to_pylist()`` gives it: arrays as nested lists, tuples as lists."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind == "c":  # Arrow has no complex type: (real, imag) pairs
            return v.view(v.real.dtype).reshape(*v.shape, 2).tolist()
        if v.dtype.kind == "V" or not v.dtype.isnative or str(v.dtype) == "bfloat16":  # Arrow has the raw bits
            return v.view(f"u{v.dtype.itemsize}").tolist()
        return v.tolist()
    if isinstance(v, complex):
        return [v.real, v.imag]
    if isinstance(v, (list, tuple)):
        return [arrowish(x) for x in v]
    if isinstance(v, dict):
        return {k: arrowish(x) for k, x in v.items()}
    return v


def flat_row(v: Any) -> dict[str, Any]:
    """A row's value as exported columns: dicts from the root flattened to ``a/b`` (an empty dict
    is a column of its own), anything else at its path (``value`` for the root)."""
    out: dict[str, Any] = {}

    def walk(x: Any, path: str) -> None:
        if isinstance(x, dict) and x:
            for k, y in x.items():
                k = user_key(k)  # a flat column is named by the stored path
                walk(y, f"{path}/{k}" if path else k)
        else:
            out[path or "value"] = arrowish(x)

    walk(v, "")
    return out


def write_merge(tmp_path: Path, ranks: list[dict[tuple[str, int], Any]]) -> Any:
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    for rank, frames in enumerate(ranks):
        with spillmerge.SpillWriter(root, rank=rank, world_size=len(ranks)) as w:
            for (name, frame), v in frames.items():
                w.write(name, frame, v)
    spillmerge.merge(root, out)
    return spillmerge.open(out)


def py(s: Any) -> Any:
    """An Arrow scalar as Python, led by its type: a union's value as its child's, a tensor
    (``arrow.fixed_shape_tensor``, whose ``as_py`` is flat) as nested lists of its shape, from its
    storage (pyarrow makes no numpy array of a bool tensor)."""
    if not s.is_valid:
        return None
    t = s.type
    if pa.types.is_union(t):
        return py(s.value)
    if isinstance(t, pa.FixedShapeTensorType):
        flat = [py(x) for x in s.value.values]
        return np.array([*flat, None], dtype=object)[:-1].reshape(t.shape).tolist()
    if pa.types.is_large_list(t) or pa.types.is_list(t) or pa.types.is_fixed_size_list(t):
        return [py(x) for x in s.values]
    if pa.types.is_struct(t):
        return {k: py(v) for k, v in s.items()}
    return s.as_py()


def no_nulls(x: Any) -> Any:
    """Dicts without their ``None`` keys: a struct has every key of every row of its column, a
    row lacking one null there (as ``res.value()`` reads a key the file's other frames have)."""
    if isinstance(x, dict):
        return {k: no_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [no_nulls(v) for v in x]
    return x


def check_rows(res: Any, table: Any) -> None:
    """Every row of ``table`` equals ``res.value()`` of that row in Arrow's Python form."""
    names = [n for n in table.column_names if n not in KEYS]
    for i, row in enumerate(table.select(list(KEYS)).to_pylist()):
        want = flat_row(res.value(row["filename"], row["frame_idx"]))
        got = {n: py(table.column(n)[i]) for n in names}
        assert no_nulls(got) == no_nulls({n: want.get(n) for n in names}), row["filename"]
        assert set(want) <= set(names), (row["filename"], set(want) - set(names))


MIXED = [
    {
        ("a.jpg", 0): {
            "result": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "items": [torch.arange(3), torch.ones(2, 2)],
            "pair": (1, "one"),
            "recs": [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}],
            "score": 0.5,
            "flag": True,
            "nested": {"deep": {"x": 1}, "lst": [{"k": 1}, {"k": "two"}]},
        },
        ("a.jpg", 1): {
            "result": "a string",
            "items": ["x", 1, None, [2, 3]],
            "pair": (2, "two"),
            "recs": [{"a": 3, "b": "z"}],
            "score": 1.5,
            "flag": False,
            "nested": {"deep": {"x": 2}, "lst": [{"k": 3}]},
        },
    },
    {
        ("b.jpg", 0): {
            "result": None,
            "items": [],
            "pair": (3, "three"),
            "recs": [{"a": 4, "b": "w"}],
            "score": 2.5,
            "flag": True,
            "nested": {"deep": {"x": 3}, "lst": [{"k": 4}, {"k": 5}]},
        },
        ("c.jpg", 0): {
            "result": torch.tensor([1.0, 2.0]),
            "items": ("t", 2.5),
            "pair": (4, "four"),
            "recs": [{"a": 5, "b": "v"}, {"a": 6, "b": "u"}, {"a": 7, "b": "t"}],
            "score": 3.5,
            "flag": False,
            "nested": {"deep": {"x": 4}, "lst": [{"k": "six"}]},
        },
    },
]


def test_mixed_values_map_onto_unions_lists_and_structs(tmp_path):
    res = write_merge(tmp_path, MIXED)
    table = res.to_arrow()
    schema = table.schema
    # a leaf of several variants across files: one dense union, a child per variant
    result = schema.field("result").type
    assert pa.types.is_union(result) and result.mode == "dense"
    assert sorted(result.field(i).name for i in range(result.num_fields)) == ["float32.1d", "float32.2d", "str"]
    # a tensor of one shape in every row of its column: Arrow's canonical tensor extension type
    tensor = result.field([result.field(i).name for i in range(3)].index("float32.2d")).type
    assert isinstance(tensor, pa.FixedShapeTensorType) and tensor.shape == [2, 3]
    # a list in some rows, a tuple in others: a union of a list and a tuple, items a union
    items = schema.field("items").type
    assert pa.types.is_union(items) and {items.field(i).name for i in range(items.num_fields)} >= {"list", "tuple"}
    # tuples of one shape: a list whose items are a union of int and string, marked as tuples
    pair = schema.field("pair")
    assert pa.types.is_large_list(pair.type) and pa.types.is_union(pair.type.value_type)
    assert pair.metadata == {b"spillmerge.container": b"tuple"}
    # a list of dicts of the same keys: list<struct>
    recs = schema.field("recs").type
    assert recs == pa.large_list(pa.struct([("a", pa.int64()), ("b", pa.large_string())]))
    # Python scalars: plain Arrow scalars; dicts from the root stay flat columns
    assert schema.field("score").type == pa.float64() and schema.field("flag").type == pa.bool_()
    assert schema.field("nested/deep/x").type == pa.int64()
    lst = schema.field("nested/lst").type
    assert pa.types.is_large_list(lst) and pa.types.is_struct(lst.value_type)
    check_rows(res, table)


def test_batches_have_one_schema_and_the_rows_of_the_table(tmp_path):
    res = write_merge(tmp_path, MIXED)
    table = res.to_arrow()
    batches = list(res.iter_batches(batch_size=1))
    assert len(batches) == 4 and all(b.schema == table.schema for b in batches)
    assert pa.Table.from_batches(batches).to_pylist() == table.to_pylist()


def test_a_union_refuses_parquet_by_name_and_its_variants_export_flat(tmp_path):
    res = write_merge(tmp_path, MIXED)
    target = tmp_path / "x.parquet"
    with pytest.raises(spillmerge.ArrowUnionInParquetError, match="'result'") as info:
        res.to_parquet(target)
    assert isinstance(info.value, spillmerge.SpillMergeError) and "columns=" in str(info.value)
    assert "result" in info.value.columns and not target.exists()
    assert not list(tmp_path.glob("x.parquet.tmp-*"))
    # one variant of the union (its flat name) and one-type columns go to Parquet
    assert res.to_parquet(target, columns=["result:float32.2d", "score", "recs"]) == 4
    import pyarrow.parquet as pq

    back = pq.read_table(target).to_pylist()
    assert [r["result:float32.2d"] for r in back] == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], None, None, None]
    assert [r["recs"] for r in back][0] == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]


def test_one_type_outputs_read_as_before_in_polars_and_duckdb(tmp_path):
    polars = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    frames = {
        (f"f{i}.jpg", 0): {
            "emb": torch.full((2, 2), float(i)),
            "label": f"class-{i}",
            "n": i,
            "probs": [0.25 * i, 0.5],
            "meta": {"w": 10 + i},
        }
        for i in range(5)
    }
    res = write_merge(tmp_path, [frames])
    table = res.to_arrow()
    assert not any(pa.types.is_union(f.type) for f in table.schema)
    assert table.schema.field("emb").type == pa.fixed_shape_tensor(pa.float32(), [2, 2])
    assert table.column("emb").combine_chunks().to_numpy_ndarray()[3].tolist() == [[3.0, 3.0], [3.0, 3.0]]
    assert table.column_names == ["filename", "frame_idx", "rank", "emb", "label", "meta/w", "n", "probs"]
    check_rows(res, table)
    target = tmp_path / "one.parquet"
    assert res.to_parquet(target) == 5
    pl = polars.read_parquet(target)
    assert pl["n"].to_list() == list(range(5)) and pl["meta/w"].to_list() == [10, 11, 12, 13, 14]
    assert pl["emb"].to_list()[3] == [[3.0, 3.0], [3.0, 3.0]]
    got = duckdb.sql(f"SELECT label, probs FROM read_parquet('{target}') ORDER BY label").fetchall()
    assert got[2] == ("class-2", [0.5, 0.5])


def test_a_plain_value_of_several_kinds_is_one_value_column(tmp_path):
    res = write_merge(tmp_path, [{("a", 0): torch.ones(3), ("b", 0): "text", ("c", 0): [1, "x"], ("d", 0): None}])
    table = res.to_arrow()
    assert table.column_names == [*KEYS, "value"] and pa.types.is_union(table.schema.field("value").type)
    assert table.column("value").to_pylist() == [[1.0, 1.0, 1.0], "text", [1, "x"], None]
    check_rows(res, table)


def test_every_kind_of_value_in_one_output_reads_back_row_by_row(tmp_path):
    """test_value_model's values, each in a file of its own under one key: one column ``v`` of
    the union of them all, every row equal to ``res.value()``; and each alone, as its own output."""
    res = write_merge(tmp_path, [{(name, 0): {"v": v} for name, v in VALUES.items()}])
    table = res.to_arrow()
    assert pa.types.is_union(table.schema.field("v").type)
    check_rows(res, table)
    for i, (name, v) in enumerate(VALUES.items()):
        one = write_merge(tmp_path / str(i), [{(name, 0): v}])
        check_rows(one, one.to_arrow())


def test_only_a_leaf_that_is_a_tuple_in_every_row_is_marked_as_tuples(tmp_path):
    # The field metadata says a column's lists were tuples: never for lists, nor for lists in
    # some rows and tuples in others, in the table and in each batch.
    tuple_mark = {b"spillmerge.container": b"tuple"}
    res = write_merge(
        tmp_path,
        [
            {
                ("a.jpg", 0): {"pair": (1, "x"), "lst": [1, "a"], "mixed": [1, 2]},
                ("b.jpg", 0): {"pair": (2, "y"), "lst": [2, "b"], "mixed": (3, 4)},
                ("c.jpg", 0): {"other": 1},
            }
        ],
    )
    schema = res.to_arrow().schema
    assert schema.field("pair").metadata == tuple_mark
    assert schema.field("lst").metadata is None and schema.field("mixed").metadata is None
    batches = list(res.iter_batches(batch_size=1))
    assert [b.schema.field("pair").metadata for b in batches[:2]] == [tuple_mark, tuple_mark]
    assert all(b.schema.field(k).metadata is None for b in batches for k in ("lst", "mixed"))
