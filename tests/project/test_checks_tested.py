"""Checks an outside mutation audit found no test guarding: each test here shows the behaviour a
user relies on that one check protects (a value merged whole, a damaged spill root or output
refused), so deleting or weakening the check fails it (tests/mutation_check.py, "checks nothing
tested")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
import torch
from _helpers import value_diffs

import spillmerge
from spillmerge._format import spill as FS


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


# ------------------------------------------------------------------ damaged spill roots
# A write_batch of 64 files at 4 KiB chunks: one block checksum per leaf and data chunk (the
# int64 "a" rows, then the float32 "v" rows). Damage rewrites an array of the segment with its
# chunk's CRC-32C fixed (and the commit record's, where said), so only the check under test can
# catch it.


@pytest.fixture(scope="module")
def batch_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batch") / "spill"
    g = torch.Generator().manual_seed(0)
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1, chunk_bytes=4096) as w:
        w.write_batch([f"i{i:02d}" for i in range(64)], {"a": torch.arange(64), "v": torch.randn(64, 100, generator=g)})
    return root


def _copy(batch_root: Path, tmp: Path) -> tuple[Path, Path]:
    root = tmp / "spill"
    shutil.copytree(batch_root, root)
    return root, next(root.glob("rank-00000/seg-*"))


def _array(seg: Path, name: str, cols: int) -> np.ndarray:
    """A segment's index or checks (one chunk: its bytes, then their CRC-32C), as a copy."""
    return np.frombuffer((seg / name / "c/0/0").read_bytes()[:-4], dtype="<i8").reshape(-1, cols).copy()


def _store(seg: Path, name: str, arr: np.ndarray, commit_field: str | None) -> None:
    raw = arr.astype("<i8").tobytes()
    (seg / name / "c/0/0").write_bytes(raw + google_crc32c.value(raw).to_bytes(4, "little"))
    if commit_field is not None:
        commit = json.loads((seg / FS.COMMIT_NAME).read_text())
        commit[commit_field] = google_crc32c.value(raw)
        (seg / FS.COMMIT_NAME).write_text(json.dumps(commit))


def _data(seg: Path) -> bytearray:
    """A segment's data, its chunks back to back (4 KiB each but the last)."""
    n = len(list((seg / "data/c").iterdir()))
    return bytearray(b"".join((seg / f"data/c/{c}").read_bytes() for c in range(n)))


def _refused(root: Path, tmp: Path, match: str) -> None:
    with pytest.raises(spillmerge.CorruptSpillError, match=match):
        spillmerge.merge(str(root), str(tmp / "out.zarr"), progress=False)
    assert not (tmp / "out.zarr").exists()
    assert not spillmerge.verify(str(root)).ok


def test_an_index_row_reaching_past_its_block_is_refused(tmp_path: Path, batch_root: Path) -> None:
    # Row i09 of "a" (bytes 72..80, the end of block 0) moved 4 bytes on: its tail lies in bytes
    # no checksum covers, so the merge would copy them unchecked.
    root, seg = _copy(batch_root, tmp_path)
    index = _array(seg, FS.INDEX_NAME, FS.INDEX_COLUMNS)
    (r,) = np.flatnonzero((index[:, FS.COL_OFFSET] == 72) & (index[:, FS.COL_CRC] == -1))
    index[r, FS.COL_OFFSET] = 76
    _store(seg, FS.INDEX_NAME, index, "index_crc32c")
    _refused(root, tmp_path, "index row lies outside the block checksum it points at")


def test_block_checksums_the_commit_record_does_not_vouch_for_are_refused(tmp_path: Path, batch_root: Path) -> None:
    # A byte of block 1 changed together with that block's checksum: only the commit record's
    # checksum of the checks array can tell.
    root, seg = _copy(batch_root, tmp_path)
    checks = _array(seg, FS.CHECKS_NAME, FS.CHECK_COLUMNS)
    data = _data(seg)
    data[100] ^= 0x10
    (seg / "data/c/0").write_bytes(bytes(data[:4096]))
    off, nb, _ = checks[1].tolist()
    checks[1, 2] = google_crc32c.value(bytes(data[off : off + nb]))
    _store(seg, FS.CHECKS_NAME, checks, None)
    _refused(root, tmp_path, "checks do not match the commit record")


def test_a_block_checksum_spanning_two_data_chunks_is_refused(tmp_path: Path, batch_root: Path) -> None:
    # Block 1 (bytes 80..4080 of chunk 0) stretched to 4100, into chunk 1, its checksum that of
    # those bytes: a block lies in one data chunk (the copy verifies it as one view of it).
    root, seg = _copy(batch_root, tmp_path)
    checks = _array(seg, FS.CHECKS_NAME, FS.CHECK_COLUMNS)
    assert checks[1, :2].tolist() == [80, 4000]
    data = _data(seg)
    checks[1, 1:] = [4020, google_crc32c.value(bytes(data[80:4100]))]
    _store(seg, FS.CHECKS_NAME, checks, "checks_crc32c")
    _refused(root, tmp_path, "a block checksum covers bytes outside one data chunk")


def test_a_corrupt_block_on_an_object_store_fails_the_merge(tmp_path: Path) -> None:
    # The range-GET path of the copy checks a block of write_batch rows as the local one does.
    import fsspec

    root = "memory://checks-tested-block/spill"
    fs = fsspec.filesystem("memory")
    try:
        with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=4096) as w:
            w.write_batch(
                [f"i{i:02d}" for i in range(8)], {"v": torch.arange(800, dtype=torch.float32).reshape(8, 100)}
            )
        (key,) = [p for p in fs.find("/checks-tested-block/spill") if p.endswith("/data/c/0")]
        raw = bytearray(fs.cat_file(key))
        raw[1000] ^= 0x04  # row 2 of the one block
        fs.pipe_file(key, bytes(raw))
        with pytest.raises(spillmerge.CorruptSpillError, match=r"checksum mismatch"):
            spillmerge.merge(root, str(tmp_path / "out"), progress=False)
    finally:
        fs.rm("/checks-tested-block", recursive=True)


def test_write_batch_refuses_a_multibyte_filename_over_the_limit(tmp_path: Path) -> None:
    # 40,000 two-byte characters: fewer characters than the byte limit, more bytes than it. The
    # batch is refused at the call, naming the item, before anything is staged.
    long = "é" * 40_000
    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        with pytest.raises(spillmerge.SpillValueError, match=r"item 1 .*bytes"):
            w.write_batch(["a.jpg", long], {"v": torch.zeros(2, 3)})
        w.write_batch(["a.jpg", "b.jpg"], {"v": torch.ones(2, 3)})
    res = _merged(tmp_path / "spill", tmp_path / "out.zarr")
    assert sorted(res) == ["a.jpg", "b.jpg"]


# ------------------------------------------------------------------ damaged outputs


def test_a_filename_block_that_does_not_start_with_its_head_is_refused(tmp_path: Path) -> None:
    # Each block of NAME_BLOCK filenames has its first name in index/filename_heads, the table a
    # lookup bisects. Head 1 changed to a name between block 1's first two (same bytes, chunk
    # checksum fixed by zarr): the file that starts block 1 would be listed yet never found.
    import zarr

    from spillmerge._merge.documents import NAME_BLOCK

    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    names = [f"f{i:06d}.jpg" for i in range(NAME_BLOCK + 5)]
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write_batch(names, {"n": torch.arange(len(names))})
    spillmerge.merge(str(root), str(out), progress=False)
    heads = zarr.open_array(str(out / "index" / "filename_heads"), mode="r+")
    second = len(names[0])  # head 1 starts after head 0's bytes
    assert bytes(heads[second : second + len(names[NAME_BLOCK])]) == names[NAME_BLOCK].encode()
    heads[second + len(names[NAME_BLOCK]) - 1] = ord("h")  # 'f001024.jpg' -> 'f001024.jph'
    with pytest.raises(
        spillmerge.CorruptSpillError,
        match=r"index/filename_heads.*entry 1 is 'f001024.jph', but block 1 starts with 'f001024.jpg'",
    ):
        list(spillmerge.open(str(out)))
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any("index/filename_heads" in p for p in rep.problems), rep.problems


def test_arrays_a_reader_returns_cannot_change_what_it_reads_next(tmp_path: Path) -> None:
    # Decoded chunks are cached and shared by every read: an array a read returns is read-only
    # or the caller's own, so writing into it never changes what the next read returns.
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(3):
            for f in range(2):
                w.write(f"f{i}.jpg", f, {"x": np.full(4, 10 * i + f, dtype=np.float32), "r": np.ones(i + 1)})
    res = _merged(root, tmp_path / "out.zarr")
    reads = {
        "view rows": lambda: res["f1.jpg"]["x"][:],
        "view row": lambda: res["f1.jpg"]["x"][0],
        "column": lambda: res.column("x")[:],
        "ragged row": lambda: res["f2.jpg"]["r"][1],
        "value": lambda: res.value("f1.jpg", 1)["x"],
        "frames": lambda: res.frames("f1.jpg"),
        "ranks": lambda: res.frame_ranks("f1.jpg"),
        "copies": lambda: res.frame_copies("f1.jpg"),
        **{f"index_arrays()[{i}]": (lambda i=i: res.index_arrays()[i]) for i in range(1, 5)},
    }
    for what, read in reads.items():
        first = read()
        want = np.array(first, copy=True)
        if first.flags.writeable:
            first[...] = -1
        assert np.array_equal(read(), want), what
