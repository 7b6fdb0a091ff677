"""Dicts come back with their keys in the order the user's dict had them (docs/FORMAT.md, *Key
order*): through ``value()``, ``iter_values()`` and a merge, stored once per layout."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
import torch

import spillmerge
from spillmerge._format import common as F
from spillmerge._format.keyorder import KeyOrders
from spillmerge._spill import root as R
from spillmerge._storage import Storage


def _round_trip(tmp_path: Any, items: list[tuple[str, int, Any]], **merge_kw: Any) -> Any:
    with spillmerge.SpillWriter(tmp_path / "spill", rank=0, world_size=1) as w:
        for name, frame, value in items:
            w.write(name, frame, value)
    w.merge(str(tmp_path / "out.zarr"), progress=False, **merge_kw)
    return spillmerge.open(str(tmp_path / "out.zarr"))


def _same(got: Any, want: Any) -> bool:
    """Equal, and every dict's keys in the same order (repr shows order and types)."""
    return repr(got) == repr(want)


NESTED = {
    "z": 1,
    "a": {"y": [1.0, 2.0], "b": "s", "inner": {"q": None, "c": (1, 2)}},
    "m": [{"q": 1, "c": 2.5}, {"q": 3, "c": 4.5}],  # a list of dicts of one key order: records
    "t": ({"k": 1, "d": 2},),
    "empty": {},
}


@pytest.mark.parametrize(
    "value",
    [
        {"image_id": 1, "category_id": 2, "bbox": [1.0, 2.0, 3.0, 4.0], "score": 0.5},
        NESTED,
        [{"x": 1, "b": 2}, {"b": 1, "x": 2}],  # dicts of one list, each in its own order
        [{"b": {"y": 1, "x": 2}}, {"b": {"x": 1, "y": 2}}],  # dicts in the columns of records
        {"b": {}, "a": None},
        {"logits": torch.ones(3), "emb": torch.zeros(2)},  # the write() fast path
    ],
)
def test_value_and_iter_values_keep_key_order(tmp_path, value):
    res = _round_trip(tmp_path, [("f", 0, value)])
    assert _same(res.value("f", 0, as_torch=True), value)
    ((name, frame, got),) = list(res.iter_values(as_torch=True))
    assert (name, frame) == ("f", 0) and _same(got, value)


def test_sorted_dicts_store_nothing(tmp_path):
    res = _round_trip(tmp_path, [("f", 0, {"a": 1, "b": {"c": 2, "d": [{"e": 1}]}})])
    assert "key_orders" not in res.header
    assert list(res.value("f", 0)) == ["a", "b"]


def test_many_files_of_one_order_store_it_once(tmp_path):
    items = [(f"img{i:03d}.jpg", 0, {"score": float(i), "label": i, "box": [1.0, 2.0]}) for i in range(50)]
    items.append(("zzz.jpg", 0, {"box": [1.0], "label": 1, "score": 2.0}))
    res = _round_trip(tmp_path, items)
    orders = res.header["key_orders"]
    assert orders["orders"] == [[[[], ["score", "label", "box"]]]]  # the sorted file's order is no entry
    assert orders["runs"] == [[0, 50, 0]]
    for name, _, value in items:
        assert list(res.value(name, 0)) == list(value)


def test_two_frames_of_one_file_with_different_orders(tmp_path):
    """The rule: a file's dict at one path comes back in the order of the first frame written
    that has it out of sorted order (docs/FORMAT.md, *Key order*); each file keeps its own."""
    res = _round_trip(
        tmp_path,
        [
            ("a", 0, {"z": 1, "y": 2}),
            ("a", 1, {"y": 3, "z": 4}),
            ("b", 0, {"y": 3, "z": 4}),
            ("b", 1, {"z": 5, "y": 6}),
        ],
    )
    assert [list(res.value("a", i)) for i in (0, 1)] == [["z", "y"], ["z", "y"]]
    assert [list(res.value("b", i)) for i in (0, 1)] == [["z", "y"], ["z", "y"]]
    assert [list(v) for _, _, v in res.iter_values()] == [["z", "y"]] * 4


def test_frames_written_in_sorted_order_carry_no_order(tmp_path):
    res = _round_trip(tmp_path, [("a", 0, {"y": 1, "z": 2}), ("a", 1, {"z": 3, "y": 4})])
    assert [list(res.value("a", i)) for i in (0, 1)] == [["z", "y"], ["z", "y"]]


def test_key_order_across_a_duplicate(tmp_path):
    """Two ranks write the same frame with the same content in other key orders: one frame
    (equal bytes), read back in the order of the first segment's copy."""
    spill = tmp_path / "spill"
    for rank, value in enumerate([{"b": 1, "a": [1.0, 2.0]}, {"a": [1.0, 2.0], "b": 1}]):
        with spillmerge.SpillWriter(spill, rank=rank, world_size=2) as w:
            w.write("f", 0, value)
    report = spillmerge.merge(str(spill), str(tmp_path / "out.zarr"))
    assert report.duplicates == 1
    got = spillmerge.open(str(tmp_path / "out.zarr")).value("f", 0)
    assert _same(got, {"b": 1, "a": [1.0, 2.0]})


def test_dataclass_fields_come_back_in_field_order(tmp_path):
    @dataclasses.dataclass
    class Det:
        score: float
        label: int

    res = _round_trip(tmp_path, [("f", 0, Det(0.5, 3))])
    assert _same(res.value("f", 0), {"score": 0.5, "label": 3})


def test_write_batch_keeps_the_batch_key_order(tmp_path):
    with spillmerge.SpillWriter(tmp_path / "spill", rank=0, world_size=1) as w:
        w.write_batch(["a", "b"], {"logits": np.ones((2, 3), np.float32), "emb": np.zeros((2, 2), np.float32)})
        w.write_batch(["c", "d"], [{"s": 1, "a": 2}, {"s": 3, "a": 4}])
    w.merge(str(tmp_path / "out.zarr"), progress=False)
    res = spillmerge.open(str(tmp_path / "out.zarr"))
    assert [list(res.value(n)) for n in "abcd"] == [["logits", "emb"]] * 2 + [["s", "a"]] * 2


def test_spill_layouts_carry_pos_and_catalog_version(tmp_path):
    with spillmerge.SpillWriter(tmp_path / "spill", rank=0, world_size=1) as w:
        w.write("f", 0, {"b": 1, "a": {"d": 1, "c": 2}})
    st = Storage(str(tmp_path / "spill"))
    (seg,) = R.scan(st)[0]
    loaded = R.load_segment(st, seg)
    assert seg.header["format_version"] == F.SPILL_FORMAT_VERSION == 4 and F.FORMAT_VERSION == 7
    assert {lay.leaf: lay.pos for lay in loaded.layouts} == {("a", "c"): (1, 1), ("a", "d"): (1, 0), ("b",): (0,)}


def test_a_damaged_key_order_table_is_refused(tmp_path):
    res = _round_trip(tmp_path, [("f", 0, {"b": 1, "a": 2})])
    root = tmp_path / "out.zarr" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["spillmerge"]["key_orders"]["runs"] = [[0, 5, 0]]  # beyond the one file
    root.write_text(json.dumps(doc))
    assert res is not None
    with pytest.raises(spillmerge.SpillMergeError, match="key_orders"):
        spillmerge.open(str(tmp_path / "out.zarr")).value("f", 0)


def test_the_orders_of_a_range_of_files_are_each_files_order():
    """A reader looks up the orders of a block of files at once: for any range (starting before,
    inside or between the runs, ending past them) each file's is what the file's own lookup gives."""
    orders = {"orders": [[[[], ["b", "a"]]], [[[], ["z", "y"]]]], "runs": [[2, 5, 0], [5, 6, 1], [8, 11, 0]]}
    ko = KeyOrders(orders, 13, "zarr.json")
    for i0 in range(13):
        for i1 in range(i0, 14):
            got = ko.of_files(i0, i1)
            assert len(got) == i1 - i0 and all(g is ko.of_file(i) for i, g in zip(range(i0, i1), got, strict=True))
    assert ko.of_files(0, 13)[4] == {(): {"b": 0, "a": 1}} and KeyOrders(None, 3, "x").of_files(0, 3) == [None] * 3


def test_arrow_export_follows_the_key_order(tmp_path):
    pytest.importorskip("pyarrow")
    dets = [{"image_id": 1, "bbox": [1.0, 2.0], "score": 0.5}]
    res = _round_trip(
        tmp_path,
        [("a", 0, {"score": 1.0, "label": 2, "dets": dets}), ("b", 0, {"score": 2.0, "label": 3, "dets": dets * 2})],
    )
    table = res.to_arrow()
    assert table.column_names == ["filename", "frame_idx", "rank", "dets", "label", "score"]  # flat: by name
    assert [f.name for f in table.schema.field("dets").type.value_type] == ["image_id", "bbox", "score"]
    assert table.column("dets").to_pylist()[1] == dets * 2


def test_dicts_of_tensors_of_one_structure_keep_each_order(tmp_path):
    """``write()``'s template for files of one structure applies only to dicts of its key order."""
    t = torch.ones(4)
    items = [(f"f{i}", 0, {"logits": t, "emb": t}) for i in range(3)]
    items += [("g0", 0, {"emb": t, "logits": t}), ("g1", 0, {"logits": t, "emb": t})]
    res = _round_trip(tmp_path, items)
    assert [list(res.value(name, 0)) for name, _, _ in items] == [["logits", "emb"]] * 3 + [
        ["emb", "logits"],
        ["logits", "emb"],
    ]
