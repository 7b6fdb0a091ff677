"""An output stores strings as UTF-8 bytes + int64 offsets (docs/FORMAT.md section 2): the
filenames are read block by block (open reads the first name of each block, a lookup one block),
and damaged text or order is refused naming the object."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from _helpers import write_filenames

import spillmerge
from spillmerge._merge.documents import NAME_BLOCK


def _many(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    names = [f"f{i:06d}.jpg" for i in range(n)]
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for a in range(0, n, 1000):
            batch = names[a : a + 1000]
            w.write_batch(
                batch, {"caption": [f"caption of {x} ✓" for x in batch], "n": torch.arange(a, a + len(batch))}
            )
    spillmerge.merge(str(root), str(out), progress=False)
    return out, names


def test_filenames_span_blocks_and_are_found_by_one_block_read(tmp_path):
    n = 2 * NAME_BLOCK + 5
    out, names = _many(tmp_path, n)
    res = spillmerge.open(str(out))
    assert len(res.filenames) == n and res.filenames[-1] == names[-1] and res.filenames[NAME_BLOCK] == names[NAME_BLOCK]
    assert res.filenames[NAME_BLOCK - 2 : NAME_BLOCK + 2] == names[NAME_BLOCK - 2 : NAME_BLOCK + 2]
    at_open = res.cache_stats().misses
    f = names[2 * NAME_BLOCK + 3]  # in the last block
    assert f in res.filenames and res[f]["n"][0] == 2 * NAME_BLOCK + 3 and res[f]["caption"][0] == f"caption of {f} ✓"
    # that block (offsets chunk + bytes), then one chunk of each column: no other block was read
    assert res.cache_stats().misses - at_open <= 5
    assert "f999999.jpg" not in res.filenames and "a.jpg" not in res.filenames
    with pytest.raises(spillmerge.UnknownFileError, match=r"did you mean 'f000100.jpg'"):
        res["f000100.jpq"]
    assert list(res.filenames) == names and list(res) == names


def test_filenames_out_of_order_across_blocks_are_refused(tmp_path):
    out, names = _many(tmp_path, NAME_BLOCK + 3)
    swapped = names[: NAME_BLOCK - 1] + [names[NAME_BLOCK], names[NAME_BLOCK - 1]] + names[NAME_BLOCK + 1 :]
    write_filenames(out, swapped)  # each block sorted, its head right: only the boundary is wrong
    with pytest.raises(spillmerge.CorruptSpillError, match=r"index/filenames: not sorted") as ei:
        spillmerge.open(str(out))
    assert ei.value.path == str(out / "index" / "filenames")
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any("index/filenames: not sorted" in p for p in rep.problems), rep.problems


def test_a_filename_that_is_not_utf8_is_refused(tmp_path):
    out, _ = _many(tmp_path, 10)
    arr = zarr.open_array(str(out / "index" / "filenames"), mode="r+")
    arr[1] = 0xFF  # a valid chunk (zarr writes its checksum) holding bytes that are not text
    with pytest.raises(spillmerge.CorruptSpillError, match=r"index/filenames: a filename is not valid UTF-8"):
        spillmerge.open(str(out))
    assert any("not valid UTF-8" in p for p in spillmerge.verify(str(out)).problems)


@pytest.mark.parametrize("leaf", ["caption", "tags"])
def test_a_string_that_is_not_utf8_is_refused_when_read_and_by_verify(tmp_path, leaf):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(3):
            w.write(f"d{i}", 0, {"caption": f"é{i}", "tags": ["xy", f"é{i}"]})
    spillmerge.merge(str(root), str(out), progress=False)
    values = zarr.open_array(str(out / "columns" / leaf / "values"), mode="r+")
    o = zarr.open_array(str(out / "columns" / leaf / "offsets"))[:]
    raw = values[:]
    pos = int(o[1]) + (0 if leaf == "caption" else 4 * 2 + 2)  # row 1's "é" (after the list's lengths and "xy")
    assert raw[pos] == 0xC3
    values[pos + 1] = 0x41  # "é" becomes an invalid lead byte followed by "A"
    res = spillmerge.open(str(out))
    assert res["d0"][leaf][0] is not None  # the other rows read
    with pytest.raises(spillmerge.CorruptSpillError, match=r"not valid UTF-8") as ei:
        res["d1"][leaf][0]
    assert f"columns/{leaf}/values" in ei.value.path
    with pytest.raises(spillmerge.CorruptSpillError, match=r"row 1 is not valid UTF-8"):
        list(res.iter_values())  # (rows decoded together name the row too)
    problems = spillmerge.verify(str(out)).problems
    assert any(f"columns/{leaf}/values" in p and "not valid UTF-8" in p for p in problems), problems


def test_strings_are_uint8_bytes_with_int64_offsets(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a", 0, {"s": "héllo", "l": ["x", "", "✓"]})
        w.write("b", 0, {"s": "", "l": []})
        w.write("c", 0, {"n": 1})  # no string leaves: absent rows store no bytes
    spillmerge.merge(str(root), str(out), progress=False)
    g = zarr.open_group(str(out), mode="r")
    for rel in ("index/filenames", "columns/s/values", "columns/l/values", "index/filename_heads"):
        assert g[rel].dtype == np.uint8, rel
    assert g["columns/s/offsets"][:].tolist() == [0, 6, 6, 6] and g["columns/s/values"][:].tobytes() == "héllo".encode()
    assert g["columns/l/shapes"][:].tolist() == [[3], [0], [0]]  # strings per row open its bytes
    res = spillmerge.open(str(out))
    assert res.column("s").to_list() == ["héllo", "", None] and res.column("l").to_list() == [["x", "", "✓"], [], None]
    assert res.column("s").to_arrow().to_pylist() == ["héllo", "", None]
    assert res.to_arrow(columns=["l"]).column("l").to_pylist() == [["x", "", "✓"], [], None]
