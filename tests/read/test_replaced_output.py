"""A store opened before ``merge(..., overwrite=True)`` replaced its output: reads must give the old
output or the new one whole, or refuse; never rows that mix the two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import spillmerge
import spillmerge._read.store


def _merge(
    tmp: Path, name: str, k: int, files: int, frames: int, overwrite: bool = False, out: str | None = None, **kw: Any
) -> str:
    out = out or str(tmp / "out.zarr")
    with spillmerge.SpillWriter(str(tmp / name), rank=0, world_size=1) as w:
        for i in range(files):
            for f in range(frames):
                w.write(f"f{i}", f, {"a": torch.full((2,), float(100 * k + 10 * i + f)), "s": f"k{k}-{i}-{f}"})
    spillmerge.merge(str(tmp / name), out, overwrite=overwrite, out_storage_options=kw or None)
    return out


def _one_output(value: dict[str, object]) -> bool:
    return str(value["s"]).startswith(f"k{int(value['a'][0]) // 100}-")  # type: ignore[index]


def test_an_uncached_store_reads_the_replacement_whole(tmp_path: Path) -> None:
    res = spillmerge.open(_merge(tmp_path, "one", 1, 4, 3), cache_bytes=0)
    assert res.value("f0", 0)["s"] == "k1-0-0"
    _merge(tmp_path, "two", 2, 4, 3, overwrite=True)
    assert [_one_output(v) for _, _, v in res.iter_values()] == [True] * 12


def test_a_replacement_of_other_rows_is_refused_as_a_replacement_not_damage(tmp_path: Path) -> None:
    out = _merge(tmp_path, "one", 1, 4, 3)
    res = spillmerge.open(out, cache_bytes=0)
    _merge(tmp_path, "two", 2, 3, 2, overwrite=True)
    with pytest.raises(spillmerge.SpillMergeError, match="was replaced by another merge") as ei:
        res.value("f1", 1)
    assert ei.value.path == out and "damaged" not in str(ei.value)
    assert isinstance(ei.value.__context__, spillmerge.CorruptSpillError)  # what the read found, kept


def test_an_output_being_replaced_is_named_as_such(tmp_path: Path) -> None:
    """What an overwrite leaves while it runs: the old marker gone first, then the old chunks."""
    out = _merge(tmp_path, "one", 1, 4, 3)
    res = spillmerge.open(out, cache_bytes=0)
    (Path(out) / "spillmerge-complete.json").unlink()
    for chunk in (Path(out) / "columns").rglob("c/*"):
        if chunk.is_file():
            chunk.unlink()
    with pytest.raises(spillmerge.SpillMergeError, match="is being replaced") as ei:
        res.value("f1", 1)
    assert ei.value.path == out and "damaged" not in str(ei.value)
    # Damage with the marker in place is still damage.
    res = spillmerge.open(_merge(tmp_path, "two", 2, 4, 3, out=str(tmp_path / "other.zarr")), cache_bytes=0)
    for chunk in (tmp_path / "other.zarr" / "columns").rglob("c/*"):
        if chunk.is_file():
            chunk.unlink()
    with pytest.raises(spillmerge.CorruptSpillError, match="damaged"):
        res.value("f1", 1)


def test_a_cached_chunk_is_not_mixed_with_the_replacement(tmp_path: Path, backend_no_s3, monkeypatch) -> None:
    out = backend_no_s3.url("out.zarr")
    res = spillmerge.open(_merge(tmp_path, "one", 1, 4, 3, out=out, **backend_no_s3.options))
    assert res["f0"]["a"][0].tolist() == [100.0, 100.0]  # column a's chunk now cached, s's not
    _merge(tmp_path, "two", 2, 4, 3, overwrite=True, out=out, **backend_no_s3.options)
    monkeypatch.setattr(spillmerge._read.store, "REMOTE_LOOK_S", 0.0)  # an object store: a look a second
    with pytest.raises(spillmerge.SpillMergeError, match="was replaced by another merge") as ei:
        res.value("f1", 1)
    assert ei.value.path == out
    assert _one_output(spillmerge.open(out).value("f1", 1))
