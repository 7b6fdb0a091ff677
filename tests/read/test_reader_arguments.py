"""The reader's API with unusual arguments: a frame index that is no integer, a ``dtype=`` no
column of the leaf has and an unknown leaf raise the documented error naming what was asked and
what there is (each leaf once), not a bare numpy ``TypeError`` or a message saying the leaf is missing."""

from __future__ import annotations

import os
import re
import stat
import threading
from pathlib import Path

import pytest
import torch

import spillmerge


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("args")
    with spillmerge.SpillWriter(str(tmp / "spill"), rank=0, world_size=1) as w:
        for f in range(3):
            w.write("a.mp4", f, {"logits": torch.full((2,), float(f)), "caption": f"c{f}"})
        w.write("b.mp4", 7, {"logits": torch.zeros(2), "caption": "only"})  # a file of one frame
    spillmerge.merge(str(tmp / "spill"), str(tmp / "out.zarr"))
    return str(Path(tmp / "out.zarr"))


@pytest.mark.parametrize("filename", ["a.mp4", "b.mp4"])
@pytest.mark.parametrize(("frame", "shown"), [(None, "no frame None "), ("2", "no frame '2' "), ([2], "no frame [2] ")])
def test_a_frame_index_that_is_no_integer_is_an_unknown_frame(
    out: str, filename: str, frame: object, shown: str
) -> None:
    res = spillmerge.open(out)
    with pytest.raises(spillmerge.UnknownFileError, match=re.escape(shown)) as err:
        res.value(filename, frame)  # type: ignore[arg-type]
    assert isinstance(err.value, KeyError) and err.value.filename == filename
    with pytest.raises(spillmerge.UnknownFileError, match=re.escape("no frame [7] (its frames: 7)")):
        res.value("b.mp4", [7])  # type: ignore[arg-type]  # (a file of one frame: its row was returned)


def test_numpy_and_negative_frame_indices(out: str) -> None:
    np = pytest.importorskip("numpy")
    res = spillmerge.open(out)
    assert res.value("a.mp4", np.int32(2))["caption"] == "c2" and res.value("b.mp4", np.int64(7))["caption"] == "only"
    with pytest.raises(spillmerge.UnknownFileError, match=r"has no frame -1 \(its frames: 0, 1, 2\)"):
        res.value("a.mp4", -1)


def test_a_dtype_the_leaf_lacks_names_the_leaf_and_its_dtypes(out: str) -> None:
    res = spillmerge.open(out)
    with pytest.raises(spillmerge.UnknownColumnError, match="leaf 'logits' has no column of dtype 'int8'") as err:
        res.column("logits", dtype="int8")
    assert err.value.known == ["float32"] and err.value.column == "logits" and isinstance(err.value, KeyError)
    with pytest.raises(spillmerge.UnknownColumnError, match="has no leaf column 'nope'"):
        res.column("nope", dtype="float32")  # no such leaf at all: the message as before
    assert res.column("logits", dtype="float32")[3].tolist() == [0.0, 0.0]


def test_an_unknown_leaf_lists_a_leaf_split_by_dtype_once(tmp_path: Path) -> None:
    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        for i, dtype in enumerate((torch.float16, torch.float32, torch.int64)):
            w.write(f"f{i}", 0, {"x": torch.ones(2, dtype=dtype), "y": i})
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"))
    res = spillmerge.open(str(tmp_path / "out.zarr"))
    with pytest.raises(spillmerge.UnknownColumnError, match=r"its columns: 'x', 'y'$") as err:
        res.column("nope")
    assert err.value.known == ["x", "y"]
    with pytest.raises(spillmerge.UnknownColumnError, match=r"its columns: 'x', 'y'$"):
        spillmerge.OutputDataset(str(tmp_path / "out.zarr"), columns=["nope"])


@pytest.mark.parametrize("cache_bytes", [-1, None, "64MiB"])
def test_a_cache_bound_that_is_no_byte_count_is_a_config_error(out: str, cache_bytes: object) -> None:
    with pytest.raises(
        spillmerge.ConfigError, match=re.escape(f"cache_bytes must be >= 0 (bytes), got {cache_bytes!r}")
    ):
        spillmerge.open(out, cache_bytes=cache_bytes)  # type: ignore[arg-type]


@pytest.mark.parametrize("cache_bytes", [0, 1, 1000])
def test_no_cache_and_a_tiny_one_read_the_same_under_threads(out: str, cache_bytes: int) -> None:
    res = spillmerge.open(out, cache_bytes=cache_bytes)
    want = [(f, i, v["caption"]) for f, i, v in spillmerge.open(out).iter_values()]
    got: list[object] = []

    def read() -> None:
        got.append([(f, i, res.value(f, i)["caption"]) for f, i in zip(*_rows(res), strict=True)])

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 3 and res.cache_stats().nbytes <= cache_bytes


def _rows(res: spillmerge.MergedStore) -> tuple[list[str], list[int]]:
    names = [f for f in res.filenames for _ in res.frames(f)]
    return names, [int(i) for f in res.filenames for i in res.frames(f)]


@pytest.mark.parametrize("batch_size", ["x", [4], {"rows": 4}])
def test_a_batch_size_that_is_no_number_is_a_config_error(out: str, batch_size: object) -> None:
    res = spillmerge.open(out)
    with pytest.raises(
        spillmerge.ConfigError, match=re.escape(f"batch_size must be a positive number of rows, got {batch_size!r}")
    ):
        next(res.iter_batches(batch_size=batch_size))  # type: ignore[arg-type]
    assert [b.num_rows for b in res.iter_batches(batch_size=3)] == [3, 1]


@pytest.fixture(scope="module")
def sparse(tmp_path_factory: pytest.TempPathFactory) -> str:
    """File ``a``: ``x`` in frames 0, 3, 6 of 8 (a fixed column holding only those rows: it has
    offsets) and ``y`` in every frame (a plain fixed column)."""
    tmp = tmp_path_factory.mktemp("sparse")
    with spillmerge.SpillWriter(str(tmp / "spill"), rank=0, world_size=1) as w:
        for f in range(8):
            w.write(
                "a", f, {"y": torch.full((2,), float(f))} | ({"x": torch.full((2,), float(f))} if f % 3 == 0 else {})
            )
    spillmerge.merge(str(tmp / "spill"), str(tmp / "out.zarr"))
    return str(tmp / "out.zarr")


@pytest.mark.parametrize("leaf", ["x", "y"])
def test_fancy_indices_of_a_fixed_leaf_are_checked_as_numpy_checks_them(sparse: str, leaf: str) -> None:
    np = pytest.importorskip("numpy")
    view = spillmerge.open(sparse)["a"][leaf]
    want = np.asarray(view)
    assert (view[[7, -8, 3]] == want[[7, -8, 3]]).all() and view[[]].shape == (0, 2)
    mask = np.arange(8) % 2 == 0
    assert (view[mask] == want[mask]).all() and (view[::-3] == want[::-3]).all()
    with pytest.raises(IndexError, match="row 8 out of range for 8 rows"):
        view[[0, 8]]
    with pytest.raises(IndexError, match=re.escape("a boolean mask of shape (2,) does not select among 8 rows")):
        view[np.array([True, False])]  # was: row 0 alone, silently
    with pytest.raises(IndexError, match="rows are selected by integers, a slice or a boolean mask, not float64"):
        view[[0.5]]  # was: row 0, silently


def test_filenames_are_indexed_by_position_only(out: str) -> None:
    names = spillmerge.open(out).filenames
    assert (names[-1], names[1:], names[::-1], names.index("b.mp4")) == ("b.mp4", ["b.mp4"], ["b.mp4", "a.mp4"], 1)
    with pytest.raises(IndexError, match="filename -3 of 2"):
        names[-3]
    for bad in ("1", 1.5, [0, 1]):  # a str that int() reads was a position: "1" gave "b.mp4"
        with pytest.raises(
            TypeError, match=re.escape(f"filenames are indexed by an int or a slice, not {type(bad).__name__}")
        ):
            names[bad]  # type: ignore[index]


def test_a_ragged_row_is_numbered_by_an_integer(tmp_path: Path) -> None:
    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        for f in range(3):
            w.write("a", f, {"boxes": torch.full((f, 4), float(f))})
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"))
    boxes = spillmerge.open(str(tmp_path / "out.zarr"))["a"]["boxes"]
    assert boxes.to_torch(-1).shape == (2, 4) and boxes.to_torch(pytest.importorskip("numpy").int64(1)).shape == (1, 4)
    for bad in (1.5, slice(0, 2)):  # 1.5 was row 1
        with pytest.raises(TypeError, match=f"RaggedView rows are numbered by an int, not {type(bad).__name__}"):
            boxes.to_torch(bad)  # type: ignore[arg-type]


def test_to_parquet_replaces_no_link_pipe_or_folder(out: str, tmp_path: Path) -> None:
    # (a device such as /dev/null, as root, was replaced by the finished file too)
    res = spillmerge.open(out)
    (tmp_path / "real.parquet").write_bytes(b"keep")
    (tmp_path / "link.parquet").symlink_to(tmp_path / "real.parquet")
    os.mkfifo(tmp_path / "pipe.parquet")
    (tmp_path / "folder.parquet").mkdir()
    for name in ("link.parquet", "pipe.parquet", "folder.parquet"):
        with pytest.raises(spillmerge.SpillStorageError, match="it exists and is no regular file") as err:
            res.to_parquet(tmp_path / name)
        assert err.value.path == str(tmp_path / name)
    assert (tmp_path / "link.parquet").is_symlink() and (tmp_path / "real.parquet").read_bytes() == b"keep"
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe.parquet").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "folder.parquet",
        "link.parquet",
        "pipe.parquet",
        "real.parquet",
    ]
    assert res.to_parquet(tmp_path / "real.parquet") == 4  # a file is replaced


def test_an_empty_key_is_not_listed_as_the_plain_values(tmp_path: Path) -> None:
    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        w.write("a", 0, {"": 1, "x": 2})
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"))
    res = spillmerge.open(str(tmp_path / "out.zarr"))
    with pytest.raises(
        spillmerge.UnknownColumnError, match=r"no leaf column 'None \(the plain tensor values\)'"
    ) as err:
        res.column(None)  # the output has a key "", not plain values
    assert err.value.known == ["", "x"] and res.column(("",))[0] == 1
