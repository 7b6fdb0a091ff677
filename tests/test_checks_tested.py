"""Checks an outside mutation audit found no test guarding: each test here shows the behaviour a
user relies on that one check protects (a value merged whole, a damaged spill root or output
refused), so deleting or weakening the check fails it (tests/mutation_check.py, "checks nothing
tested")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import value_diffs

import spillmerge


def _merged(root: Path, out: Path) -> Any:
    spillmerge.merge(str(root), str(out), progress=False)
    return spillmerge.open(str(out))


# ------------------------------------------------------------------ values merged whole


def test_a_dict_with_a_key_the_last_files_structure_lacks_is_merged_whole(tmp_path: Path) -> None:
    # write() stages a new file's value from the structure of the last one when it matches; a dict
    # with one key more is another structure, and that key is merged with the others.
    root = tmp_path / "spill"
    x = np.arange(4, dtype=np.float32)
    first = {"x": x}
    second = {"x": x + 1, "y": np.arange(3, dtype=np.int64)}
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a.jpg", 0, first)
        w.write("b.jpg", 0, second)
    res = _merged(root, tmp_path / "out.zarr")
    assert value_diffs(res.value("a.jpg"), first) == []
    assert value_diffs(res.value("b.jpg"), second) == []


@pytest.mark.parametrize("how", ["write", "write_batch"])
def test_a_big_endian_array_reads_back_as_its_values(tmp_path: Path, how: str) -> None:
    # The format stores little-endian bytes: a big-endian array is converted, never stored as is,
    # on the first batch and on the later ones of the same structure (write_batch's fast path).
    root = tmp_path / "spill"
    vals = np.array([[1.5, -2.0, 3.25], [4.0, 5.5, -6.75], [7.0, 8.5, 9.0], [-1.0, 0.5, 2.0]], dtype=">f4")
    names = [f"img{i}.jpg" for i in range(len(vals))]
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        if how == "write":
            for name, row in zip(names, vals, strict=True):
                w.write(name, 0, {"v": row.copy()})
        else:
            w.write_batch(names[:2], {"v": vals[:2]})
            w.write_batch(names[2:], {"v": vals[2:]})
    res = _merged(root, tmp_path / "out.zarr")
    for name, row in zip(names, vals, strict=True):
        got = res.value(name)["v"]
        assert np.array_equal(got, row.astype("<f4")), (name, got, row)
