"""Format 4's lists (docs/FORMAT.md section 2, *Lists*): a list's items are one child path with
list offsets, to any depth, whatever the items are; values read back as written, to_arrow gives
large_list, and damaged offsets are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

import spillmerge
from spillmerge import CorruptSpillError
from tests._helpers import value_diffs


def _merge(tmp_path: Path, rows: list[tuple[str, int, Any]], **merge: Any) -> Path:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for name, frame, value in rows:
            w.write(name, frame, value)
    spillmerge.merge(str(root), str(out), progress=False, **merge)
    return out


def _same(out: Path, rows: list[tuple[str, int, Any]]) -> spillmerge.MergedStore:
    res = spillmerge.open(str(out))
    for name, frame, value in rows:
        assert value_diffs(res.value(name, frame), value, f"{name}[{frame}]") == []
    assert spillmerge.verify(str(out)).ok
    return res


def _groups(out: Path, under: str) -> list[str]:
    return sorted(p.name for p in (out / under).iterdir() if p.is_dir()) if (out / under).exists() else []


def test_a_list_of_1000_tensors_of_different_shapes_makes_two_columns_and_one_list(tmp_path):
    """Format 3 made a column per item position (1,001 columns for 1,000 items); format 4 makes
    the header, one column of the items (ragged: their shapes differ) and one list offsets array,
    whatever the number of items."""
    g = torch.Generator().manual_seed(0)
    rows = [
        ("gen.txt", f, [torch.randn(k % 7 + 1, k % 3 + 1, generator=g) for k in range(1000 - 300 * f)])
        for f in range(3)
    ]
    out = _merge(tmp_path, rows)
    assert len(_groups(out, "columns")) == 2 and len(_groups(out, "lists")) == 1
    res = _same(out, rows)
    items = res.column(("\x1f*",))
    assert items.kind == "ragged" and len(items) == 1000 + 700 + 400
    assert [len(x) for x in res.to_arrow()["value"].to_pylist()] == [1000, 700, 400]


def test_lists_whose_length_varies_between_rows_and_files(tmp_path):
    rows = [
        (
            f"f{i % 3}.jpg",
            i,
            {
                "boxes": [torch.full((i % 4, 4), float(i)) for _ in range(i % 5)],
                "names": [f"n{i}"] * (i % 2) + [torch.tensor(i)],
            },
        )  # fmt: skip
        for i in range(20)
    ]
    out = _merge(tmp_path, rows)
    res = _same(out, rows)
    lens = [len(v) for v in res.to_arrow()["boxes"].to_pylist()]
    assert lens == [len(v["boxes"]) for _, _, v in sorted(rows, key=lambda r: (r[0], r[1]))]
    assert len(_groups(out, "lists")) == 2


def test_lists_of_lists_of_str_and_tuples_inside_lists(tmp_path):
    rows = [
        ("a", 0, {"ll": [["a", "b"], [], ["c"]], "pairs": [(1, "x"), (2.5, None), ()]}),
        ("a", 1, {"ll": [], "pairs": [((1, 2), [3, "y"])]}),
        ("b", 0, {"ll": [["é" * 3], ["d", "e", "f"], ["g"]], "pairs": []}),
    ]
    out = _merge(tmp_path, rows)
    res = _same(out, rows)
    t = res.to_arrow()
    assert t["ll"].to_pylist() == [[["a", "b"], [], ["c"]], [], [["é" * 3], ["d", "e", "f"], ["g"]]]
    assert json.loads(json.dumps(t["pairs"].to_pylist()[0])) == [[1, "x"], [2.5, None], []]


def test_lists_of_dicts_with_different_keys_per_item(tmp_path):
    rows = [
        ("d", 0, [{"a": torch.ones(2), "b": "x"}, {"a": torch.zeros(3)}, {"c": {"deep": [1, "two"]}}, {}]),
        ("d", 1, [{"b": "y"}, {"a": None}, {"a": None, "b": None, "c": None}]),  # None: by the dict's key count
        ("e", 0, [{"c": {"deep": []}}]),
    ]
    out = _merge(tmp_path, rows)
    res = _same(out, rows)
    got = res.to_arrow()["value"].to_pylist()[0]  # Arrow's struct: a key an item lacks is null
    assert [sorted(k for k, v in d.items() if v is not None) for d in got] == [["a", "b"], ["a"], ["c"], []]


@pytest.mark.parametrize("top", [False, True], ids=["under_a_key", "at_the_root"])
def test_a_list_of_dicts_in_one_frame_and_a_dict_of_dicts_in_another_at_the_same_path(tmp_path, top):
    """A nested key of one frame's dict is no column of another frame's list of dicts at that
    path, so the list's dicts gain no key ``a`` from it: every frame reads back as written."""
    frames = [
        [{"b": 1}, {"b": 2}],
        {"b": 3, "a": {"c": "s", "d": None}},
        [{"b": "s"}],
        {"b": None, "a": {"c": 2.5, "d": 1}},
    ]
    rows = [("f", i, v if top else {"x": v}) for i, v in enumerate(frames)]
    res = _same(_merge(tmp_path, rows), rows)
    assert [v for _, _, v in res.iter_values()] == [res.value("f", i) for i in range(len(frames))]


def test_a_dict_that_lacks_keys_and_holds_none_reads_back_as_written(tmp_path):
    """A key a dict lacks is told from one holding None, inside a list (where the other items'
    dicts have it) and across the frames of a file (where other frames' dicts have it)."""
    rows = [
        ("d", 0, [{"a": 1, "b": 2, "c": 3}, {"c": None}, {}, {"x": None, "b": 1}]),
        ("e", 0, {"a": 1, "b": None}),
        ("e", 1, {"b": 2}),
        ("e", 2, {}),
        ("e", 3, {"a": None, "c": {"x": None}}),
        ("e", 4, {"c": {"y": 1}}),
    ]
    res = _same(_merge(tmp_path, rows), rows)
    assert [v for _, _, v in res.iter_values()] == [v for *_, v in rows]


def test_a_list_mixing_tensors_and_str_is_a_union_of_its_items(tmp_path):
    rows = [("m", f, [torch.arange(f + 1), "text", torch.ones(2, 2), None, 3][: f + 2]) for f in range(4)]
    out = _merge(tmp_path, rows)
    res = _same(out, rows)
    arr = res.to_arrow()["value"]
    import pyarrow as pa

    assert pa.types.is_large_list(arr.type) and pa.types.is_union(arr.type.value_type)
    assert arr.to_pylist()[1][1] == "text" and len(arr.to_pylist()[3]) == 5
    # one column per variant of the items, whatever the number of items
    variants = [n for n in _groups(out, "columns") if "." in n]
    assert len(variants) == 4  # int64 1-d, str, float32 2-d, pyint 0-d


def test_empty_lists_at_every_level(tmp_path):
    rows = [
        ("z", 0, {"a": [], "b": [[]], "c": [[], [[]]], "d": (), "e": [(), [()]], "f": [{}]}),
        ("z", 1, {"a": [[], []], "b": [], "c": [[[[]]]], "d": ((),), "e": [], "f": []}),
        ("y", 0, []),
        ("y", 1, [[]]),
        ("x", 0, ()),
    ]
    out = _merge(tmp_path, rows)
    res = _same(out, rows)
    assert res.to_arrow()["a"].to_pylist()[-1] == [[], []]


def test_leaf_views_show_a_files_items(tmp_path):
    rows = [("v", f, {"s": [f"s{f}.{k}" for k in range(f)] + [torch.tensor(f)]}) for f in range(3)]
    out = _merge(tmp_path, rows)
    res = _same(out, rows)
    view = res["v"]["s"]  # the header, and the items of the file's rows, flattened (one view per variant)
    assert sorted(view) == ["\x1f", "\x1f*.int64.0d", "\x1f*.str"]
    assert view["\x1f"].to_list() == [1, 2, 3]
    assert view["\x1f*.str"].to_list() == [None, "s1.0", None, "s2.0", "s2.1", None]
    ints = res.column(("s", "\x1f*"), dtype="int64").to_list()
    assert [None if x is None else int(x) for x in ints] == [0, None, 1, None, None, 2]
    # the items' flat column in Arrow: each row's items (of that variant) as a list
    flat = res.to_arrow(columns=["s/\x1f*:str"])["s/\x1f*:str"].to_pylist()
    assert flat == [[None], ["s1.0", None], ["s2.0", "s2.1", None]]


def _damage(out: Path, array: str, values: np.ndarray) -> None:
    """Rewrite a whole array through zarr (valid chunks and checksums: a damage only its meaning shows)."""
    arr = zarr.open_array(str(out / array), mode="r+")
    arr[:] = values


def _list_group(out: Path, path: tuple[str, ...]) -> str:
    for name in _groups(out, "lists"):
        attrs = json.loads((out / "lists" / name / "zarr.json").read_text())["attributes"]["spillmerge"]
        if tuple(attrs["list"]) == path:
            return name
    raise AssertionError(path)


@pytest.fixture(scope="module")
def lists_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, int, Any]]]:
    """Read only: each test damages a copy."""
    rows = [("a", f, {"l": [torch.full((f + 1,), float(f))] * (f + 1), "n": [[1, "x"]] * f}) for f in range(4)]
    return _merge(tmp_path_factory.mktemp("lists"), rows), rows


@pytest.mark.parametrize("damage", ["decrease", "past the items", "not from 0", "header disagrees"])
def test_damaged_list_offsets_are_refused_naming_the_array(tmp_path, lists_out, damage):
    base, rows = lists_out
    out = tmp_path / "out.zarr"
    shutil.copytree(base, out)
    name = _list_group(out, ("l", "\x1f*"))
    rel = f"lists/{name}/offsets"
    o = np.asarray(zarr.open_array(str(out / rel), mode="r")[:])  # [0, 1, 3, 6, 10]
    bad = {
        "decrease": np.array([0, 3, 1, 6, 10]),
        "past the items": o * 2,
        "not from 0": o + 1,
        "header disagrees": np.array([0, 2, 3, 6, 10]),  # row 0's header says 1 item
    }[damage]
    _damage(out, rel, bad)
    if damage == "header disagrees":
        res = spillmerge.open(str(out))  # the offsets alone are sound: the rows that read them refuse
        with pytest.raises(CorruptSpillError, match=r"columns/l__~[0-9a-f]+: row 0 .* 1 items; its list offsets say 2"):
            res.value("a", 0)
        with pytest.raises(CorruptSpillError, match="row 0 has 1 items by its header, 2 by its list offsets"):
            res.to_arrow()
    else:
        with pytest.raises(CorruptSpillError, match=rel.replace("~", ".")):
            spillmerge.open(str(out))
    report = spillmerge.verify(str(out))
    assert not report.ok and any(rel in p for p in report.problems), report.problems


def test_a_header_whose_list_group_is_missing_is_refused(tmp_path, lists_out):
    base, _ = lists_out
    out = tmp_path / "out.zarr"
    shutil.copytree(base, out)
    name = _list_group(out, ("n", "\x1f*", "\x1f*"))  # the inner lists: their header is under n/*
    shutil.rmtree(out / "lists" / name)
    root = json.loads((out / "zarr.json").read_text())
    meta = root["consolidated_metadata"]["metadata"]
    for key in [k for k in meta if k.startswith(f"lists/{name}")]:
        del meta[key]
    (out / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(
        CorruptSpillError, match=r"columns/n_____~[0-9a-f]+: a list header whose items' list .* is missing"
    ):
        spillmerge.open(str(out))
    report = spillmerge.verify(str(out))
    assert not report.ok and any("a list header whose items' list" in p for p in report.problems), report.problems


def test_spill_roots_written_before_format_4_merge_to_lists(tmp_path):
    """Spill roots hold the same catalogs (item positions) as before format 4's lists (version 4
    added only the key order), so what such a writer spilled merges to lists."""
    rows = [("p", f, {"x": [torch.ones(f), "a"][: f + 1]}) for f in range(3)]
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for name, frame, value in rows:
            w.write(name, frame, value)
    header = json.loads(next(root.glob("rank-00000/seg-*/zarr.json")).read_text())
    assert header["attributes"]["spillmerge"]["format_version"] == 4
    spillmerge.merge(str(root), str(tmp_path / "out"), progress=False)
    res = _same(tmp_path / "out", rows)
    assert res.format_version == 7 == spillmerge.FORMAT_VERSION


def _plant_list_group(out: Path, like: str, name: str, path: tuple[str, ...]) -> None:
    """A copy of the list group ``like`` as ``lists/<name>`` naming the list ``path`` (in the
    consolidated root too): a group the merge never wrote."""
    shutil.copytree(out / "lists" / like, out / "lists" / name)
    doc = out / "lists" / name / "zarr.json"
    meta = json.loads(doc.read_text())
    meta["attributes"]["spillmerge"]["list"] = list(path)
    doc.write_text(json.dumps(meta))
    root = json.loads((out / "zarr.json").read_text())
    docs = root["consolidated_metadata"]["metadata"]
    for key in [k for k in docs if k == f"lists/{like}" or k.startswith(f"lists/{like}/")]:
        docs[f"lists/{name}" + key[len(f"lists/{like}") :]] = json.loads(json.dumps(docs[key]))
    docs[f"lists/{name}"]["attributes"]["spillmerge"]["list"] = list(path)
    (out / "zarr.json").write_text(json.dumps(root))


@pytest.mark.parametrize("planted", ["second group of a list", "list inside no list"])
def test_a_list_group_the_lists_do_not_account_for_is_refused(tmp_path, lists_out, planted):
    # Each list path has one group, and a nested list's group has its parent's: a second group
    # of "l" (whichever the reader took, its items could be the other's), or a group of items
    # of a list with none, is damage that open and verify name.
    base, rows = lists_out
    out = tmp_path / "out.zarr"
    shutil.copytree(base, out)
    like = _list_group(out, ("l", "\x1f*"))
    if planted == "second group of a list":
        path, needle = ("l", "\x1f*"), rf"lists/zz~0123456789abcdef: holds the list .* of lists/{like}"
    else:
        path, needle = (
            ("zz", "\x1f*", "\x1f*"),
            r"lists/zz~0123456789abcdef: its lists are items of \['zz', '\\x1f\*'\], which has no list group",
        )
    _plant_list_group(out, like, "zz~0123456789abcdef", path)
    with pytest.raises(CorruptSpillError, match=needle):
        spillmerge.open(str(out))
    report = spillmerge.verify(str(out))
    assert not report.ok and any("lists/zz~0123456789abcdef" in p for p in report.problems), report.problems
