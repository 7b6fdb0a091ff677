"""The reader's edges: a dataset's pickle opt-in, a leaf named by no str, the cache's in-order hits,
the stack of no ragged rows."""

from __future__ import annotations

from pathlib import Path

import pytest

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
