"""A store opened before ``merge(..., overwrite=True)`` replaced its output: reads must give the old
output or the new one whole, or refuse; never rows that mix the two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spillmerge


def _merge(tmp: Path, name: str, k: int, files: int, frames: int, overwrite: bool = False) -> str:
    with spillmerge.SpillWriter(str(tmp / name), rank=0, world_size=1) as w:
        for i in range(files):
            for f in range(frames):
                w.write(f"f{i}", f, {"a": torch.full((2,), float(100 * k + 10 * i + f)), "s": f"k{k}-{i}-{f}"})
    spillmerge.merge(str(tmp / name), str(tmp / "out.zarr"), overwrite=overwrite)
    return str(tmp / "out.zarr")


def _one_output(value: dict[str, object]) -> bool:
    return str(value["s"]).startswith(f"k{int(value['a'][0]) // 100}-")  # type: ignore[index]


def test_an_uncached_store_reads_the_replacement_whole(tmp_path: Path) -> None:
    res = spillmerge.open(_merge(tmp_path, "one", 1, 4, 3), cache_bytes=0)
    assert res.value("f0", 0)["s"] == "k1-0-0"
    _merge(tmp_path, "two", 2, 4, 3, overwrite=True)
    assert [_one_output(v) for _, _, v in res.iter_values()] == [True] * 12


def test_a_replacement_of_other_rows_is_refused(tmp_path: Path) -> None:
    res = spillmerge.open(_merge(tmp_path, "one", 1, 4, 3), cache_bytes=0)
    _merge(tmp_path, "two", 2, 3, 2, overwrite=True)
    with pytest.raises(spillmerge.CorruptSpillError):
        res.value("f1", 1)


@pytest.mark.xfail(strict=True, reason="a chunk cached before the overwrite is served beside new chunks")
def test_a_cached_chunk_is_not_mixed_with_the_replacement(tmp_path: Path) -> None:
    res = spillmerge.open(_merge(tmp_path, "one", 1, 4, 3))
    assert res["f0"]["a"][0].tolist() == [100.0, 100.0]  # column a's chunk now cached, s's not
    _merge(tmp_path, "two", 2, 4, 3, overwrite=True)
    try:
        value = res.value("f1", 1)
    except spillmerge.SpillMergeError:
        return  # refused: allowed
    assert _one_output(value), value  # today: a from the old output, s from the new
