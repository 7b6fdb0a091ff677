"""The merge checks each spill byte once, as it copies: a row's CRC-32C serves both its check
(alone, or combined with the other rows of its block) and the output chunk's CRC-32C."""

from __future__ import annotations

import random
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch

import spillmerge
from spillmerge._format import crc as _crc
from spillmerge._format import spill as FS
from spillmerge._spill import root as R
from spillmerge._storage import Storage

SHAPE = (3, 64, 64)  # fp16: 24 KiB a frame, copied straight from the page cache


def test_crc32c_combine_matches_the_crc_of_the_joined_bytes():
    rng = random.Random(7)
    for la, lb in [(0, 0), (0, 5), (1, 1), (7, 1000), (4096, 393216), (3, 0), (12345, 1 << 20 | 3)]:
        a, b = rng.randbytes(la), rng.randbytes(lb)
        assert _crc.combine(google_crc32c.value(a), google_crc32c.value(b), lb) == google_crc32c.value(a + b)


def frame(f: int, i: int) -> torch.Tensor:
    return (torch.arange(int(np.prod(SHAPE)), dtype=torch.float32).reshape(SHAPE) * 0.001 + f * 10 + i).half()


def spill(root: Path, n: int = 60, **kw: object) -> None:
    # Frames of 3 files interleaved: the rows of one block checksum (1 MiB of consecutive frames)
    # land in many output chunks of several files.
    with spillmerge.SpillWriter(str(root), 0, 1, **kw) as w:
        for i in range(n):
            w.write(f"f{i % 3}.mp4", i // 3, frame(i % 3, i // 3))


def _chunk0(root: Path) -> Path:
    return next(root.glob("rank-00000/seg-*/data/c/0"))


def test_a_merge_of_blocks_spread_over_output_chunks_writes_chunks_zarr_accepts(tmp_path):
    spill(tmp_path / "root")
    spillmerge.merge(str(tmp_path / "root"), str(tmp_path / "out"), chunk_bytes=64 << 10, progress=False)
    res = spillmerge.open(str(tmp_path / "out"))  # zarr checks each chunk's CRC-32C as it reads
    for f in range(3):
        got = np.asarray(res[f"f{f}.mp4"][:])
        assert np.array_equal(got, np.stack([frame(f, i).numpy() for i in range(20)]))
    assert spillmerge.verify(str(tmp_path / "out")).ok


# The first frame of a spill is checked alone; later ones by blocks of whole frames.
@pytest.mark.parametrize(("where", "how"), [(100, ""), (300_000, ".*checked as one")], ids=["first-row", "block"])
def test_a_flipped_byte_in_a_block_spread_over_output_chunks_fails_the_merge(tmp_path, where, how):
    spill(tmp_path / "root")
    chunk = _chunk0(tmp_path / "root")
    raw = bytearray(chunk.read_bytes())
    raw[where] ^= 0x04
    chunk.write_bytes(bytes(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"checksum mismatch for 'f\d.mp4' frame \d+" + how):
        spillmerge.merge(str(tmp_path / "root"), str(tmp_path / "out"), chunk_bytes=64 << 10, progress=False)


def test_a_flipped_byte_in_a_block_whose_rows_are_not_all_merged_fails_the_merge(tmp_path):
    # f1.mp4 frame 0 (the spill's second frame, in its first block) is written again with other
    # bytes (policy "last"): that block is never whole in the merge, so it is read and checked on
    # its own once the copy is done.
    root = tmp_path / "root"
    with spillmerge.SpillWriter(str(root), 0, 1, on_duplicate="last") as w:
        for i in range(60):
            w.write(f"f{i % 3}.mp4", i // 3, frame(i % 3, i // 3))
        w.write("f1.mp4", 0, frame(1, 0) + 1)
    chunk = _chunk0(root)
    raw = bytearray(chunk.read_bytes())
    raw[50_000] ^= 0x10  # in the spill's third frame (f2.mp4 frame 0), same block
    chunk.write_bytes(bytes(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"in the block at bytes 24576\.\.\d+, checked as one"):
        spillmerge.merge(str(root), str(tmp_path / "out"), chunk_bytes=64 << 10, progress=False)


def test_a_flipped_byte_in_a_list_item_names_its_frame_and_the_merge_leaves_nothing(tmp_path):
    root = tmp_path / "root"
    with spillmerge.SpillWriter(str(root), 0, 1, chunk_bytes=4096) as w:
        for i in range(6):
            w.write("f0", i, {"xs": [np.full(300, i, np.float64), np.full(200 + i, i, np.float64)]})
    chunk = next(root.glob("rank-00000/seg-*/data/c/2"))
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0x01  # in frame 2's first item
    chunk.write_bytes(bytes(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"for 'f0' frame 2 leaf 'xs/\[\*\]'"):
        spillmerge.merge(str(root), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()  # lists/ too: a rerun may claim the folder


def test_rows_back_to_back_in_a_spill_land_where_the_output_order_puts_them(tmp_path):
    """Two ranks' single-leaf values whose names interleave: each rank's rows lie back to back in
    its data chunk, and go to every other place of the output."""
    root = str(tmp_path / "spill")
    want = {}
    for rank in (0, 1):
        with spillmerge.SpillWriter(root, rank, 2) as w:
            for i in range(rank, 40, 2):
                name = f"f{i:03d}"
                want[name] = [i] * (i % 7) if i % 3 else f"text {i} " * (i % 5)
                w.write(name, 0, want[name])
    spillmerge.merge(root, str(tmp_path / "out.zarr"), progress=False)
    got = {name: value for name, _, value in spillmerge.open(str(tmp_path / "out.zarr")).iter_values()}
    assert got == dict(sorted(want.items()))


def test_small_rows_across_data_chunks_come_back_and_a_flipped_byte_in_one_is_named(tmp_path):
    """Generation-output-like rows, a few of which cross data chunk objects among many that do
    not: every value comes back; a flipped byte in a crossing row names that row's file."""
    root = tmp_path / "root"
    want = {f"p{i:03d}": {"text": "ab é" * (i % 50 + 1), "ids": list(range(i % 40 + 1))} for i in range(300)}
    with spillmerge.SpillWriter(str(root), 0, 1, chunk_bytes=4096) as w:
        w.write_batch(list(want), list(want.values()))
    spillmerge.merge(str(root), str(tmp_path / "out"), progress=False)
    assert dict((n, v) for n, _, v in spillmerge.open(str(tmp_path / "out")).iter_values()) == want

    st = Storage(str(root))
    (seg,) = R.scan(st)[0]
    loaded = R.load_segment(st, seg)
    idx = loaded.index
    off, nb = idx[:, FS.COL_OFFSET], idx[:, FS.COL_NBYTES]
    across = np.flatnonzero((nb > 0) & ((off + nb - 1) // 4096 != off // 4096))
    assert len(across) > 1  # (and most rows do not cross)
    r = int(across[len(across) // 2])
    name = loaded.filenames[int(idx[r, FS.COL_FILE])]
    chunk = next(root.glob(f"rank-00000/seg-*/data/c/{int(off[r]) // 4096}"))
    raw = bytearray(chunk.read_bytes())
    raw[int(off[r]) % 4096] ^= 0x01
    chunk.write_bytes(bytes(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=rf"for '{name}' frame 0"):
        spillmerge.merge(str(root), str(tmp_path / "out2"), progress=False)
