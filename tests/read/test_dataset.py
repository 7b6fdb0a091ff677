"""spillmerge.OutputDataset: a map-style torch Dataset over a merged output, read through a real
DataLoader in the main process and in worker processes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import spillmerge

N = 23


def _value(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {
        "logits": torch.randn(10, generator=g).half(),
        "emb": torch.randn(4, generator=g).bfloat16(),
        "label": torch.tensor(i % 5),
        "caption": f"image {i} ü",
        "boxes": torch.rand(i % 3, 4, generator=g),
    }


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("dataset")
    names = [f"img/{i:03d}.jpg" for i in range(N)]
    with spillmerge.SpillWriter(str(tmp / "spill"), 0, 1) as w:
        for name, i in zip(names, range(N), strict=True):
            w.write(name, 0, _value(i))
    w.merge(str(tmp / "out.zarr"))
    return str(tmp / "out.zarr")


def _rows(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


def test_a_row_is_a_dict_of_tensors_of_the_real_dtypes(output: str) -> None:
    ds = spillmerge.OutputDataset(output)
    assert len(ds) == N and ds.columns == ["boxes", "caption", "emb", "label", "logits"]
    for i in (0, 7, N - 1, -1):
        row, want = ds[i], _value(i % N)
        assert row["filename"] == f"img/{i % N:03d}.jpg" and row["frame_idx"] == 0
        for k in ("logits", "emb", "label", "boxes"):
            assert row[k].dtype == want[k].dtype and torch.equal(row[k], want[k]), (i, k)
        assert row["caption"] == want["caption"]
    with pytest.raises(IndexError, match="out of range"):
        ds[N]
    with pytest.raises(spillmerge.UnknownColumnError):
        spillmerge.OutputDataset(output, columns=["nope"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_reads_every_row_once_in_the_main_process_and_in_workers(output: str, workers: int) -> None:
    ds = spillmerge.OutputDataset(output, columns=["logits", "emb", "label", "caption"])
    loader = DataLoader(ds, batch_size=4, num_workers=workers)
    seen = []
    for batch in loader:  # the default collate: tensors stacked, strings listed
        assert batch["logits"].dtype == torch.float16 and batch["emb"].dtype == torch.bfloat16
        for j, name in enumerate(batch["filename"]):
            i = int(name[4:7])
            want = _value(i)
            assert torch.equal(batch["logits"][j], want["logits"]) and torch.equal(batch["emb"][j], want["emb"])
            assert int(batch["label"][j]) == i % 5 and batch["caption"][j] == want["caption"]
            seen.append(i)
    assert sorted(seen) == list(range(N))
    # ragged leaves: a collate that keeps the rows, with shuffling across two workers
    loader = DataLoader(spillmerge.OutputDataset(output), batch_size=5, shuffle=True, num_workers=workers, collate_fn=_rows)
    got = {row["filename"]: row["boxes"] for batch in loader for row in batch}
    assert len(got) == N
    for name, boxes in got.items():
        assert np.array_equal(boxes.numpy(), _value(int(name[4:7]))["boxes"].numpy())


def test_a_list_column_gives_each_row_its_own_items(tmp_path: Any) -> None:
    # A list of tensors is a header column ("l/\x1f") and one column of every row's items
    # ("l/\x1f*"): row i's entry of the items column is the list of row i's items, not item i.
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root, fsync=False) as w:
        w.write("a", 0, {"l": [np.full(2, 1.0), np.full(3, 2.0)], "x": 1})
        w.write("b", 0, {"l": [np.full(1, 3.0)], "x": 2})
        w.write("c", 0, {"x": 3})
    spillmerge.merge(root, out, progress=False, fsync=False)
    ds = spillmerge.OutputDataset(out)
    assert ds.columns == ["l/\x1f", "l/\x1f*", "x"]
    got = [[t.tolist() for t in ds[i]["l/\x1f*"]] for i in range(3)]
    assert got == [[[1.0, 1.0], [2.0, 2.0, 2.0]], [[3.0]], []]
    assert ds[2]["l/\x1f"] is None and [int(ds[i]["l/\x1f"]) for i in range(2)] == [2, 1]
    nested = spillmerge.OutputDataset(out, columns=["l/\x1f*"])
    assert [len(nested[i]["l/\x1f*"]) for i in range(3)] == [2, 1, 0]


def test_every_column_by_default_includes_a_leaf_whose_kind_differs_between_files(tmp_path: Any) -> None:
    # A leaf that holds an int in one file and a str in another is two stored columns: each row
    # gets the value of the one holding it, by default and when the leaf is named.
    root, out = str(tmp_path / "s"), str(tmp_path / "o")
    with spillmerge.SpillWriter(root, fsync=False) as w:
        w.write("a", 0, {"x": 1})
        w.write("b", 0, {"x": "one"})
    spillmerge.merge(root, out, progress=False, fsync=False)
    for ds in (spillmerge.OutputDataset(out), spillmerge.OutputDataset(out, columns=["x"])):
        assert ds.columns == ["x"]
        rows = [ds[i] for i in range(len(ds))]
        assert [r["filename"] for r in rows] == ["a", "b"]
        assert int(rows[0]["x"]) == 1 and rows[1]["x"] == "one"


def test_leaves_whose_paths_read_alike_are_each_a_column(tmp_path: Any) -> None:
    # an empty key, and a key holding "/" beside nested dicts of the same path: the dataset failed
    # to open (no leaf ''), and the "a/b" key's leaf was dropped
    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        w.write("x.png", 0, {"a/b": 1, "a": {"b": 2}, "": 3, "k": {"": 4}})
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"))
    ds = spillmerge.OutputDataset(str(tmp_path / "out.zarr"))
    assert ds.columns == ["", '["a/b"]', "a/b", "k/"]
    row = ds[0]
    assert {k: int(v) for k, v in row.items() if k not in ("filename", "frame_idx")} == {
        "": 3, '["a/b"]': 1, "a/b": 2, "k/": 4
    }  # fmt: skip
    assert spillmerge.OutputDataset(str(tmp_path / "out.zarr"), columns=['["a/b"]'])[0]['["a/b"]'] == 1
