"""The reader's edges: a dataset's pickle opt-in, a leaf named by no str, the cache's in-order hits,
the stack of no ragged rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import spillmerge


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x


def _merged(tmp_path: Path, rows: list[object], **kw: object) -> str:
    root, out = str(tmp_path / "spill"), str(tmp_path / "out.zarr")
    with spillmerge.SpillWriter(root, 0, 1, **kw) as w:  # type: ignore[arg-type]
        for i, value in enumerate(rows):
            w.write(f"f{i:05d}.mp4", 0, value)
    spillmerge.merge(root, out)
    return out


def test_a_dataset_unpickles_only_when_asked_and_its_error_names_its_own_keyword(tmp_path: Path) -> None:
    out = _merged(tmp_path, [{"obj": Opaque(1)}, {"obj": Opaque(2)}], allow_pickle=True)
    with pytest.raises(spillmerge.PickleNotAllowedError, match=r"OutputDataset\(path, allow_pickle=True\)"):
        spillmerge.OutputDataset(out)[0]
    ds = spillmerge.OutputDataset(out, allow_pickle=True)
    assert [ds[i]["obj"].x for i in range(len(ds))] == [1, 2]


@pytest.mark.parametrize("path", [3, 1.5, ("a", 3)])
def test_a_leaf_named_by_no_str_is_a_type_error_naming_the_argument(tmp_path: Path, path: object) -> None:
    res = spillmerge.open(_merged(tmp_path, [{"a": torch.zeros(2)}]))
    with pytest.raises(TypeError, match=r"column\(\) takes path as a str, .*, not "):
        res.column(path)  # type: ignore[arg-type]


def test_rows_read_in_order_from_a_held_chunk_count_as_cache_hits(tmp_path: Path) -> None:
    res = spillmerge.open(_merged(tmp_path, [{"emb": torch.rand(4)} for _ in range(2000)]))
    for f in res.filenames:
        res[f]["emb"][0]
    stats = res.cache_stats()
    assert stats.misses >= 1 and stats.hits > stats.misses


def test_no_rows_of_a_ragged_leaf_stack_to_the_shape_of_its_known_dimensions(tmp_path: Path) -> None:
    res = spillmerge.open(_merged(tmp_path, [{"boxes": torch.rand(i, 4), "m": torch.rand(i, i)} for i in (1, 2, 3)]))
    view = res.column("boxes")
    assert view[1:1].shape == (0, 0, 4) and view[1:1].dtype == np.float32
    assert view[0:1].shape == (1, 1, 4)
    assert res.column("m")[1:1].shape == (0, 0, 0)  # no dimension but the row count is known


def test_a_ragged_complex_leaf_exports_to_arrow_as_real_imag_pairs(tmp_path):
    """Arrow has no complex type: a ragged complex leaf exports as a fixed leaf does, (real, imag)
    pairs, whether only the first dimension varies or the whole shape does."""
    rows = [
        {"z": np.array([1 + 2j, 3 - 4j], np.complex64), "w": np.zeros((1, 2), np.complex128)},
        {"z": np.array([], np.complex64), "w": np.full((2, 1), 5j)},
        {"z": np.array(7j, np.complex64).reshape(1), "w": np.ones((0, 3), np.complex128)},
    ]
    table = spillmerge.open(_merged(tmp_path, rows)).to_arrow()
    assert table.column("z").to_pylist() == [[[1.0, 2.0], [3.0, -4.0]], [], [[0.0, 7.0]]]
    assert table.column("w").to_pylist() == [[[[0.0, 0.0], [0.0, 0.0]]], [[[0.0, 5.0]], [[0.0, 5.0]]], []]


def test_a_records_row_beside_a_dict_row_exports_without_a_leaked_column(tmp_path):
    """``[{"a": 1}]`` is stored as a ``pyrecords`` header and the column ``a``: beside a frame
    ``{"a": False}`` both hold leaf ``a``, and the records row must not show it as a column."""
    res = spillmerge.open(_merged(tmp_path, [[{"a": 1}], {"a": False}, {"x": [{"a": 2}]}, {"x": {"a": 3}}]))
    table = res.to_arrow()
    # (the lists of dicts have no key "x": the dicts' key "x" is no field of theirs)
    assert table.select(["value", "a", "x", "x/a"]).to_pylist() == [
        {"value": [{"a": 1}], "a": None, "x": None, "x/a": None},
        {"value": None, "a": False, "x": None, "x/a": None},
        {"value": None, "a": None, "x": [{"a": 2}], "x/a": None},
        {"value": None, "a": None, "x": None, "x/a": 3},
    ]
    assert all(b.schema == table.schema for b in res.iter_batches(batch_size=1))


def test_a_list_of_dicts_beside_an_empty_dict_in_lists_has_one_schema_in_every_batch(tmp_path):
    """Items that are a list of dicts in one row and an empty dict in another: whether the items'
    union has a dict child is decided from the whole output, not from the rows of a batch."""
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    rows = [("f", 0, np.array(True)), ("f", 1, [{}]), ("g/h", 0, (None, [{"a": None}]))]
    with spillmerge.SpillWriter(root, 0, 1) as w:
        for name, frame, value in rows:
            w.write(name, frame, value)
    spillmerge.merge(root, out)
    res = spillmerge.open(out)
    table = res.to_arrow()
    batches = list(res.iter_batches(batch_size=1))
    assert [b.schema for b in batches] == [table.schema] * 3
    assert pa.Table.from_batches(batches).equals(table)
    assert [res.value(name, frame) for name, frame, _ in rows[1:]] == [[{}], (None, [{"a": None}])]
    # value()'s rows as Arrow (a tuple as a list); "a" is a key of the list of dicts only
    assert table.column("value").to_pylist() == [True, [{}], [None, [{"a": None}]]]


def test_columns_name_leaves_whose_paths_read_alike_apart_and_each_name_reads_its_leaf(tmp_path):
    """A key holding ``/`` beside nested dicts of that path (legal: docs/FORMAT.md, *Value model*)
    and an empty key: ``columns`` lists each leaf once, by the name ``to_arrow`` gives it (the
    colliding path as JSON), and ``column(name)`` reads that leaf."""
    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        w.write("x.png", 0, {"a/b": 1, "a": {"b": 2}, "": 3, "k": {"": 4}})
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"), progress=False)
    res = spillmerge.open(str(tmp_path / "out.zarr"))
    assert res.columns == ["", '["a/b"]', "a/b", "k/"]
    assert {name: res.column(name)[0].item() for name in res.columns} == {"": 3, '["a/b"]': 1, "a/b": 2, "k/": 4}
    assert res.column(("a/b",))[0].item() == 1 and res.column(["a", "b"])[0].item() == 2
    with pytest.raises(spillmerge.UnknownColumnError) as info:
        res.column("nope")
    assert info.value.known == ["", '["a/b"]', "a/b", "k/"]
    pytest.importorskip("pyarrow")
    assert {'["a/b"]', "a/b", "k/"} <= set(res.to_arrow().column_names)


def test_an_empty_list_beside_lists_of_dicts_or_tensors_exports_as_an_empty_list(tmp_path):
    """``[]`` (stored as ``pyfloat (0,)``) in rows beside lists of dicts (COCO detections of an
    image with none) or lists of tensors: the same list type, no union, so Parquet takes it."""
    pq = pytest.importorskip("pyarrow.parquet")
    det = {"box": [1.0, 2.0], "score": 0.5}
    rows = [{"dets": [det], "t": [torch.ones(2)]}, {"dets": [], "t": []}, {"dets": [det, det], "t": []}]
    res = spillmerge.open(_merged(tmp_path, rows))
    table = res.to_arrow()
    assert pa.types.is_large_list(table.schema.field("dets").type)
    assert pa.types.is_struct(table.schema.field("dets").type.value_type)
    assert table.schema.field("t").type.value_type == pa.list_(pa.float32(), 2)
    assert table.column("dets").to_pylist() == [[det], [], [det, det]]
    assert table.column("t").to_pylist() == [[[1.0, 1.0]], [], []]
    assert all(b.schema == table.schema for b in res.iter_batches(batch_size=1))
    res.to_parquet(str(tmp_path / "x.parquet"))
    assert pq.read_table(str(tmp_path / "x.parquet")).column("dets").to_pylist() == [[det], [], [det, det]]


def test_a_column_beside_lists_of_dicts_has_no_union_child_only_their_rows_hold(tmp_path):
    """``[{"a": 1}]`` stores column ``a`` as ``[1]``: beside ``{"a": False}`` the column ``a``
    (and ``x/a``, and the items of ``y/b``) were unions whose list child was null in every row
    they show, so to_parquet refused them; each column keeps the types of the rows it shows."""
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        [{"a": 1}],
        {"a": False},
        {"x": [{"a": 2}], "y": [{"b": [torch.ones(2)]}]},
        {"x": {"a": 3}, "y": {"b": [torch.zeros(3), torch.zeros(1)]}},
    ]
    res = spillmerge.open(_merged(tmp_path, rows))
    table = res.to_arrow()
    types = {f.name: f.type for f in table.schema}
    assert (types["a"], types["x/a"]) == (pa.bool_(), pa.int64())
    assert types["y/b"] == pa.large_list(pa.large_list(pa.float32()))
    assert types["y"].value_type.field("b").type == pa.large_list(pa.list_(pa.float32(), 2))
    assert table.select(["value", "a", "x", "x/a", "y", "y/b"]).to_pylist() == [
        {"value": [{"a": 1}], "a": None, "x": None, "x/a": None, "y": None, "y/b": None},
        {"value": None, "a": False, "x": None, "x/a": None, "y": None, "y/b": None},
        {"value": None, "a": None, "x": [{"a": 2}], "x/a": None, "y": [{"b": [[1.0, 1.0]]}], "y/b": None},
        {"value": None, "a": None, "x": None, "x/a": 3, "y": None, "y/b": [[0.0] * 3, [0.0]]},
    ]
    for size in (1, 3):
        assert [b.schema for b in res.iter_batches(batch_size=size)] == [table.schema] * -(-4 // size)
    res.to_parquet(str(tmp_path / "x.parquet"))
    assert pq.read_table(str(tmp_path / "x.parquet")).drop(["filename", "frame_idx", "rank"]).to_pylist() == (
        table.drop(["filename", "frame_idx", "rank"]).to_pylist()
    )


def test_a_key_only_lists_of_dicts_hold_makes_no_flat_column_of_nulls(tmp_path):
    """``[{"a": 1}]`` stores key ``a`` as the column ``a`` = ``[1]``: beside ``{"a": {"b": 2}}`` (a
    dict there, so the path ``a`` is walked for ``a/b``) it was exported as a flat column ``a``
    null in every row (its only values are inside the list of dicts' column); a key that also
    holds a value outside them keeps its column."""
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [[{"a": 1, "k": 2}], {"a": {"b": 2}, "k": 3}, {"x": [{"a": 1}]}, {"x": {"a": {"b": 2}, "c": 1}}]
    res = spillmerge.open(_merged(tmp_path, rows))
    table = res.to_arrow().drop(["filename", "frame_idx", "rank"])
    assert table.column_names == ["value", "a/b", "k", "x", "x/a/b", "x/c"]
    assert table.to_pylist() == [
        {"value": [{"a": 1, "k": 2}], "a/b": None, "k": None, "x": None, "x/a/b": None, "x/c": None},
        {"value": None, "a/b": 2, "k": 3, "x": None, "x/a/b": None, "x/c": None},
        {"value": None, "a/b": None, "k": None, "x": [{"a": 1}], "x/a/b": None, "x/c": None},
        {"value": None, "a/b": None, "k": None, "x": None, "x/a/b": 2, "x/c": 1},
    ]
    assert all(b.schema == res.to_arrow().schema for b in res.iter_batches(batch_size=1))
    assert "a" in res.to_arrow(columns=["a"]).column_names  # the stored column, by its flat name
    res.to_parquet(str(tmp_path / "x.parquet"))
    assert pq.read_table(str(tmp_path / "x.parquet")).drop(["filename", "frame_idx", "rank"]).equals(table)


def test_an_empty_list_beside_lists_of_dicts_of_tensors_or_unions_exports(tmp_path):
    """``[]`` beside lists of dicts whose keys hold tensors (a mask per detection) or values of
    several kinds: its empty lists were made from Python lists, which pyarrow refuses for a tensor
    or a union (ArrowNotImplementedError from to_arrow)."""
    mask = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    rows = [
        {"dets": [{"mask": mask}], "kp": [{"p": [{"x": 1}]}]},
        {"dets": [], "kp": [{"p": []}]},
        {"dets": [{"mask": -mask}, {"mask": mask}], "kp": []},
    ]
    res = spillmerge.open(_merged(tmp_path, rows))
    table = res.to_arrow()
    got = [[d["mask"].to_numpy().tolist() for d in r.values] for r in table.column("dets")]
    assert got == [[mask.tolist()], [], [(-mask).tolist(), mask.tolist()]]
    assert [len(r.values) for r in table.column("kp")] == [1, 1, 0]
    assert all(b.schema == table.schema for b in res.iter_batches(batch_size=1))


def test_empty_nested_lists_beside_deeper_lists_of_dicts_or_tensors_export_as_their_list_type(tmp_path):
    """``[[]]`` and ``[[], []]`` (stored as ``pyfloat`` of shape ``(n, 0)``) beside lists of lists of
    dicts or of tensors: lists of empty lists of that type, no union, so Parquet takes them; a
    ``[[[]]]`` beside lists of dicts holds a list where they hold dicts, a union still."""
    pq = pytest.importorskip("pyarrow.parquet")
    det = {"box": [1.0, 2.0], "score": 0.5}
    rows = [
        {"dets": [[det]], "t": [[torch.ones(2)]], "deep": [[{"k": 1}]]},
        {"dets": [[]], "t": [[]], "deep": [[[]]]},
        {"dets": [[], []], "t": [[], [torch.zeros(2)]]},
        {"dets": [[det, det], []], "t": [[]]},
    ]
    res = spillmerge.open(_merged(tmp_path, rows))
    table = res.to_arrow()
    assert pa.types.is_struct(table.schema.field("dets").type.value_type.value_type)
    assert table.schema.field("t").type.value_type.value_type == pa.list_(pa.float32(), 2)
    assert table.column("dets").to_pylist() == [r["dets"] for r in rows]
    assert table.column("t").to_pylist() == [[[[1.0, 1.0]]], [[]], [[], [[0.0, 0.0]]], [[]]]
    assert pa.types.is_union(table.schema.field("deep").type.value_type)
    assert all(b.schema == table.schema for b in res.iter_batches(batch_size=1))
    assert table.column("deep").to_pylist() == [[[{"k": 1}]], [[[]]], None, None]
    res.to_parquet(str(tmp_path / "x.parquet"), columns=["dets", "t"])
    assert pq.read_table(str(tmp_path / "x.parquet")).column("dets").to_pylist() == [r["dets"] for r in rows]


def test_tensors_inside_lists_of_dicts_keep_their_shape_in_parquet(tmp_path):
    """A mask per detection (a list of dicts of 2-d tensors): Parquet got the tensor extension type
    nested in the struct, which polars and DuckDB read as flat values; it gets nested lists, as
    top-level tensor columns do (docs/READING.md)."""
    pq = pytest.importorskip("pyarrow.parquet")
    mask = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    rows = [{"dets": [{"box": torch.ones(4), "mask": mask}]}, {"dets": [{"box": torch.zeros(4), "mask": -mask}] * 2}]
    res = spillmerge.open(_merged(tmp_path, rows))
    res.to_parquet(str(tmp_path / "x.parquet"), batch_size=1)
    back = pq.read_table(str(tmp_path / "x.parquet"))
    assert back.schema.field("dets").type.value_type.field("mask").type == pa.list_(pa.list_(pa.float32(), 3), 2)
    m, neg = mask.tolist(), (-mask).tolist()
    assert back.column("dets").to_pylist() == [
        [{"box": [1.0] * 4, "mask": m}],
        [{"box": [0.0] * 4, "mask": neg}, {"box": [0.0] * 4, "mask": neg}],
    ]
