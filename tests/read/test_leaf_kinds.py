"""Reading outputs: every leaf kind through spillmerge.merge + open, ``column()``, ``to_arrow()``,
real dtypes, the index invariants, plain zarr and xarray."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from _helpers import write_filenames, zarr_filenames

import spillmerge


def _merge(tmp_path: Path, frames: dict[str, dict[int, object]], **writer: object) -> Path:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1, **writer) as w:  # type: ignore[arg-type]
        for name, rows in frames.items():
            for f, value in rows.items():
                w.write(name, f, value)
    spillmerge.merge(str(root), str(out), progress=False)
    return out


def _det(f: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(f)
    return {
        "boxes": torch.rand(f, 4, generator=g),  # ragged, first dimension varies
        "mask": torch.ones(f + 1, f + 2, dtype=torch.uint8),  # ragged, every dimension varies
        "logits": torch.randn(5, generator=g).to(torch.bfloat16),  # fixed, raw-bit dtype
        "n": f,  # fixed 0-d
        "blob": b"\x00x" * f,
        "maybe": None if f == 1 else torch.full((2,), float(f)),
    }


@pytest.fixture(scope="module")
def det(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[int, dict[str, object]]]]:
    """Read only: the tests that damage it damage a copy (``_copy``)."""
    frames = {"b.jpg": {f: _det(f) for f in (0, 1, 2)}, "a.jpg": {7: _det(3)}}
    return _merge(tmp_path_factory.mktemp("det"), frames), frames  # type: ignore[arg-type]


def _same(got: object, want: object) -> None:
    if want is None:
        assert got is None
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, np.ndarray) and got.shape == tuple(want.shape)
        t = torch.from_numpy(np.ascontiguousarray(got).view(f"u{got.dtype.itemsize}") if want.dtype == torch.bfloat16
                             else np.ascontiguousarray(got))  # fmt: skip
        if want.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        assert torch.equal(t, want)
    elif isinstance(want, int):
        assert np.asarray(got).item() == want
    else:
        assert got == want


def test_every_kind_round_trips(det):
    out, frames = det
    res = spillmerge.open(str(out))
    assert res.filenames == ["a.jpg", "b.jpg"] and len(res) == 2 and "a.jpg" in res and "c.jpg" not in res
    for name, rows in frames.items():
        value = res[name]
        assert res.frames(name).tolist() == sorted(rows)
        assert res.frame_ranks(name).tolist() == [0] * len(rows) and res.frame_copies(name).tolist() == [1] * len(rows)
        for i, f in enumerate(sorted(rows)):
            for leaf, want in rows[f].items():
                _same(value[leaf][i], want)
    b = res["b.jpg"]
    assert b["logits"].dtype == np.dtype("bfloat16") and b["logits"][:].shape == (3, 5)
    assert b["logits"].to_torch().dtype == torch.bfloat16
    assert torch.equal(b["logits"].to_torch()[2], frames["b.jpg"][2]["logits"])  # bit-exact
    assert b["maybe"].valid.tolist() == [True, False, True] and b["maybe"][1] is None
    assert b["boxes"].offsets.tolist() == [0, 0, 1, 3] and b["boxes"].values.shape == (3, 4)
    assert b["mask"].shapes.tolist() == [[1, 2], [2, 3], [3, 4]]
    assert [x.shape for x in b["mask"].to_list()] == [(1, 2), (2, 3), (3, 4)]
    with pytest.raises(spillmerge.RaggedShapeError, match=r"to_list\(\)"):
        b["boxes"][0:3]
    assert b["boxes"][1:2].shape == (1, 1, 4)  # rows of one shape stack
    assert b["blob"][0:3] == [b"", b"\x00x", b"\x00x\x00x"]
    with pytest.raises(spillmerge.UnknownFileError):
        res["c.jpg"]


def test_a_row_of_a_0d_leaf_as_a_tensor_is_0d_as_the_row_and_the_value_are(tmp_path):
    frames = {f: {"x": torch.tensor(f + 0.5).to(torch.bfloat16), "y": torch.tensor(float(f))} for f in range(2)}
    out = _merge(tmp_path, {"a.mp4": frames})  # type: ignore[dict-item]
    res = spillmerge.open(str(out))
    for key in ("x", "y"):
        t = res["a.mp4"][key].to_torch(1)
        assert t.shape == () == res["a.mp4"][key][1].shape == res.value("a.mp4", 1, as_torch=True)[key].shape
        assert torch.equal(t, frames[1][key])


def test_plain_tensor_values_and_bfloat16_equal_torch(tmp_path):
    vals = {f: torch.randn(2, 3).to(torch.bfloat16) for f in range(4)}
    out = _merge(tmp_path, {"v.mp4": vals})  # type: ignore[dict-item]
    leaf = spillmerge.open(str(out))["v.mp4"]
    assert leaf.shape == (4, 2, 3) and leaf.ndim == 3 and len(leaf) == 4 and leaf.dtype == np.dtype("bfloat16")
    want = torch.stack([vals[f] for f in range(4)])
    assert torch.equal(leaf.to_torch(), want)
    assert np.array_equal(np.asarray(leaf), want.float().numpy().astype(np.dtype("bfloat16")))
    assert np.array_equal(leaf[1:3].astype(np.float32), want[1:3].float().numpy())


def test_pickle_needs_opt_in_on_both_sides(tmp_path):
    out = _merge(tmp_path, {"p": {0: {"obj": {1, 2}}, 1: {"obj": {3}}}}, allow_pickle=True)
    leaf = spillmerge.open(str(out))["p"]["obj"]
    with pytest.raises(spillmerge.PickleNotAllowedError, match="allow_pickle=True"):
        leaf[0]
    assert len(leaf.values) > 0  # the pickled bytes stay readable, never unpickled
    assert spillmerge.open(str(out), allow_pickle=True)["p"]["obj"].to_list() == [{1, 2}, {3}]


def test_column_reads_one_leaf_over_every_file(det):
    out, frames = det
    res = spillmerge.open(str(out))
    logits = res.column("logits")
    assert logits[:].shape == (4, 5) and logits.dtype == np.dtype("bfloat16")
    want = [frames["a.jpg"][7]["logits"]] + [frames["b.jpg"][f]["logits"] for f in (0, 1, 2)]
    assert torch.equal(logits.to_torch(), torch.stack(want))  # (filename, frame) order
    assert res.column(("boxes",)).offsets.tolist() == [0, 3, 3, 4, 6]
    assert res.column("maybe").valid.tolist() == [True, True, False, True]
    with pytest.raises(spillmerge.UnknownColumnError, match=r"'nope'.*'boxes'") as ei:
        res.column("nope")
    assert isinstance(ei.value, KeyError) and "logits" in ei.value.known


def test_to_arrow(det):
    pa = pytest.importorskip("pyarrow")
    out, frames = det
    t = spillmerge.open(str(out)).to_arrow()
    assert t.column_names[:3] == ["filename", "frame_idx", "rank"]
    assert t["filename"].to_pylist() == ["a.jpg", "b.jpg", "b.jpg", "b.jpg"]
    assert t["frame_idx"].to_pylist() == [7, 0, 1, 2] and t["rank"].type == pa.int32()
    assert t["n"].to_pylist() == [3, 0, 1, 2]
    assert t["maybe"].to_pylist()[2] is None and t["maybe"].to_pylist()[3] == [2.0, 2.0]
    assert t["blob"].to_pylist()[1:] == [b"", b"\x00x", b"\x00x\x00x"]
    assert t["boxes"].to_pylist()[1] == [] and len(t["boxes"].to_pylist()[3]) == 2
    assert t["mask"].to_pylist()[1] == [[1, 1]]
    assert t["logits"].type == pa.list_(pa.uint16(), 5)  # bfloat16 as its raw bits
    raw = np.array(t["logits"].to_pylist()[1], dtype=np.uint16)
    assert torch.equal(torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16), frames["b.jpg"][0]["logits"])


def test_strings_round_trip_and_plain_zarr_reads_them(tmp_path):
    frames = {
        "video_001.mp4": {
            f: {
                "logits": torch.full((1000,), float(f)),
                "boxes": torch.ones(f + 1, 4) * f,
                "caption": f"cap {f}\x00é",
                "tags": ["a", "b" * f],
                "scores": tuple(torch.full((k + 1,), float(f)) for k in range(f)),
            }  # fmt: skip
            for f in range(3)
        }
    }
    out = _merge(tmp_path, frames)  # type: ignore[arg-type]
    res = spillmerge.open(str(out))
    v = res["video_001.mp4"]
    assert v["caption"].to_list() == ["cap 0\x00é", "cap 1\x00é", "cap 2\x00é"] and v["caption"][1] == "cap 1\x00é"
    assert v["tags"][2] == ["a", "bb"]
    # Exactly the lines of docs/FORMAT.md, "Reading file i with plain zarr".
    out = str(out)
    g = zarr.open_group(out, mode="r")
    raw = g["index/filenames"][:].tobytes()  # UTF-8 bytes + int64 offsets (Arrow's large_string)
    fo = g["index/filename_offsets"][:]
    names = [raw[fo[i] : fo[i + 1]].decode() for i in range(len(fo) - 1)]
    i = names.index("video_001.mp4")
    off = g["index/frame_offsets"][:]
    a, b = int(off[i]), int(off[i + 1])
    frames_ = g["index/frame_idx"][a:b]  # frame indices of the file's rows
    logits = g["columns/logits/values"][a:b]  # a fixed leaf: (b - a, 1000)
    o = g["columns/boxes/offsets"][a : b + 1]  # a ragged leaf: row a + j is
    boxes = [g["columns/boxes/values"][o[j] : o[j + 1]] for j in range(b - a)]
    co = g["columns/caption/offsets"][a : b + 1]  # a str leaf: UTF-8 bytes + offsets too
    cb = g["columns/caption/values"][co[0] : co[-1]].tobytes()
    captions = [cb[co[j] - co[0] : co[j + 1] - co[0]].decode() for j in range(b - a)]
    # version 4: a list (or tuple) of tensors, "scores": list offsets, then its items' column
    lists = {tuple(v.attrs["spillmerge"]["list"]): k for k, v in g["lists"].groups()}  # list path -> group
    cols = {tuple(v.attrs["spillmerge"]["leaf"]): k for k, v in g["columns"].groups()}  # leaf path -> group
    item = ("scores", "\x1f*")  # the child path: every item of every list
    lo = g[f"lists/{lists[item]}/offsets"][a : b + 1]  # row a + j's items are items lo[j] .. lo[j+1]-1
    so = g[f"columns/{cols[item]}/offsets"][lo[0] : lo[-1] + 1]  # the items: here a ragged column
    sv = g[f"columns/{cols[item]}/values"][so[0] : so[-1]]
    scores = [[sv[so[k] - so[0] : so[k + 1] - so[0]] for k in range(lo[j] - lo[0], lo[j + 1] - lo[0])] for j in range(b - a)]
    assert [[x.tolist() for x in row] for row in scores] == [[], [[1.0]], [[2.0], [2.0, 2.0]]]
    assert frames_.tolist() == [0, 1, 2] and logits.shape == (3, 1000) and logits[2, 0] == 2.0
    assert [x.shape for x in boxes] == [(1, 4), (2, 4), (3, 4)] and captions[1] == "cap 1\x00é"
    assert names == zarr_filenames(g)


def test_xarray_opens_an_output(det):
    xr = pytest.importorskip("xarray")
    out, _ = det
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = xr.open_datatree(str(out), engine="zarr")
    assert tree["index"]["frame_idx"].values.tolist() == [7, 0, 1, 2]
    assert tree["columns"]["logits"]["values"].shape == (4, 5)


# ---------------------------------------------------------------- invariants, refused by name


def _copy(out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "damaged.zarr"
    shutil.copytree(out, dst)
    return dst


def _replace(path: Path, node: str, values: object) -> None:
    """Replace the array ``node`` by ``values`` (any length), keeping the consolidated root in step."""
    if node == "index/filenames":  # bytes + offsets + heads (format 3)
        write_filenames(path, values)
        return
    g = zarr.open_group(str(path), mode="r+", use_consolidated=False)
    parent, _, name = node.rpartition("/")
    old = g[node]
    arr = np.asarray(values, dtype=object if old.dtype.kind == "T" else old.dtype)
    new = g[parent].create_array(name, shape=arr.shape, dtype=old.dtype, chunks=(max(len(arr), 1), *arr.shape[1:]),
                                 overwrite=True, attributes=dict(old.attrs))  # fmt: skip
    new[...] = arr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))


@pytest.mark.parametrize(
    "node, values, needle",
    [
        ("index/filenames", ["b.jpg", "a.jpg"], r"index/filenames: not sorted"),
        ("index/filenames", ["a.jpg", "a.jpg"], r"index/filenames: 'a.jpg' is listed more than once"),
        ("index/frame_offsets", [0, 3, 2], r"index/frame_offsets: decreases from 3 to 2"),
        ("index/frame_offsets", [1, 1, 4], r"index/frame_offsets: starts at 1, not 0"),
        ("index/file_layout", [0, 7], r"index/file_layout: entry 1 .* is 7"),
        ("index/file_layout", [1], r"index/file_layout: 1 entries for 2 files"),
        ("index/frame_idx", [7, 0, 2, 1], r"index/frame_idx: frame indices are not strictly ascending"),
        ("index/frame_idx", [-1, 0, 1, 2], r"index/frame_idx: row 0 .* < 0"),
        ("index/frame_rank", [0, 0, 0], r"index/frame_rank: 3 rows, but index/frame_idx has 4"),
        ("index/frame_copies", [1, 0, 1, 1], r"index/frame_copies: row 1 holds 0 < 1"),
        ("columns/boxes/offsets", [0, 3, 2, 4, 6], r"columns/boxes/offsets: decreases from 3 to 2"),
        ("columns/boxes/offsets", [0, 3, 3, 4, 5], r"columns/boxes/offsets: ends at 5"),
        ("columns/mask/shapes", [[4, 5], [1, 2], [2, 3], [3, 3]], r"columns/mask/shapes: row 3 has shape \[3, 3\]"),
        ("columns/logits/values", np.zeros((3, 5), np.uint16), r"columns/logits/values: 3 rows, but .* has 4"),
    ],
)
def test_broken_invariants_are_refused_naming_the_object(det, tmp_path, node, values, needle):
    out = _copy(det[0], tmp_path)
    _replace(out, node, values)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle) as ei:
        spillmerge.open(str(out))
    assert ei.value.path == str(out / node.split("/")[0] / node.split("/")[1]) or node in ei.value.path
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any(node in p for p in rep.problems), rep.problems


def test_column_header_must_name_a_known_kind_and_dtype(det, tmp_path):
    out = _copy(det[0], tmp_path)
    g = zarr.open_group(str(out / "columns" / "boxes"), mode="r+")
    g.update_attributes({"spillmerge": {**g.attrs["spillmerge"], "dtype": "float99"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(out))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"columns/boxes: unknown dtype 'float99'"):
        spillmerge.open(str(out))


def test_absent_column_chunk_is_refused_never_zeros(det, tmp_path):
    out = _copy(det[0], tmp_path)
    for c in (out / "columns" / "logits" / "values" / "c").rglob("*"):
        if c.is_file():
            c.unlink()
    res = spillmerge.open(str(out))  # metadata is whole: open succeeds
    with pytest.raises(spillmerge.CorruptSpillError, match=r"columns/logits/values.*is missing"):
        res.column("logits")[:]
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any("columns/logits/values" in p and "missing" in p for p in rep.problems)


def test_a_ragged_rows_tensor_in_order_is_empty_where_the_row_has_no_value(tmp_path):
    """``to_torch(i)`` of every row in order (read a block at a time): a row without a value is an
    empty tensor, as when it is read alone."""
    out = _merge(tmp_path, {"a": {f: {"b": None if f == 1 else torch.ones(f, 2)} for f in range(4)}})
    view = spillmerge.open(str(out)).column("b")
    got = [view.to_torch(i) for i in range(4)]
    assert [tuple(t.shape) for t in got] == [(0, 2), (0, 2), (2, 2), (3, 2)]
    assert tuple(spillmerge.open(str(out)).column("b").to_torch(1).shape) == (0, 2)
