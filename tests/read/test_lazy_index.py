"""Opening reads a bounded part of the index; the rest is read a chunk at a time and checked block
by block before it is served (issue 24, ``_lazyindex``). The outputs here are merged with index
chunks and check blocks of 8 rows (the format takes any chunking from the metadata), so a few
hundred rows make many blocks: a damaged later block opens, reads the files before it, and is
refused, naming the array, when a row of it is read; ``verify`` lists it as before."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import spillmerge
from spillmerge._merge import documents as _zarrmeta
from spillmerge._read import index as _lazyindex

SMALL = 8


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_zarrmeta, "INDEX_ROWS_PER_CHUNK", SMALL)
    monkeypatch.setattr(_lazyindex, "ROW_BLOCK", SMALL)


def _name(i: int) -> str:
    return f"img_{i:04d}.jpg"


def _value(i: int, f: int) -> dict[str, object]:
    return {
        "emb": torch.full((4,), float(i)),
        "caption": f"file {i} frame {f}",
        "boxes": torch.ones(i % 3, 4) * f,  # ragged: offsets
        "mask": torch.ones(i % 2 + 1, f + 1, dtype=torch.uint8),  # every dimension varies: shapes
        "maybe": None if (i + f) % 5 == 0 else 1.5,  # rows without a value: valid; holding None: none
    }


def _merge(tmp_path: Path, n_files: int, frames: int = 3) -> Path:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(n_files):
            for f in range(frames):
                w.write(_name(i), f, _value(i, f))
    spillmerge.merge(str(root), str(out), progress=False)
    return out


def _set(out: Path, node: str, at: int | tuple[int, int], value: int) -> None:
    """One element of an index array rewritten in place (zarr recomputes the chunk's CRC-32C)."""
    arr = zarr.open_group(str(out), mode="r+", use_consolidated=False)[node]
    arr[at] = value


LATE = 40  # a file whose rows lie in a late block (3 rows per file, blocks of 8 rows)
CASES = [
    ("index/frame_idx", 3 * LATE + 1, -4, r"index/frame_idx: row 121 .* < 0"),
    ("index/frame_idx", 3 * LATE + 2, 0, r"index/frame_idx: frame indices are not strictly ascending"),
    ("index/frame_copies", 3 * LATE, 0, r"index/frame_copies: row 120 holds 0 < 1"),
    ("index/frame_rank", 3 * LATE, -1, r"index/frame_rank: row 120 holds -1 < 0"),
    ("index/frame_offsets", LATE + 1, 3 * LATE - 1, r"index/frame_offsets: decreases"),
    ("index/file_layout", LATE, 9, r"index/file_layout: entry 40 .* is 9"),
    ("columns/caption/offsets", 3 * LATE + 1, 0, r"columns/caption/offsets: decreases"),
    ("columns/mask/shapes", (3 * LATE, 1), 9, r"columns/mask/shapes: row 120 has shape"),
    ("columns/maybe/valid", 3 * LATE, 1, r"columns/maybe/(valid|offsets|none): row 120"),
    ("columns/maybe/none", 3 * LATE + 1, 1, r"columns/maybe/none: row 121 holds None and a value"),
]


@pytest.fixture(scope="module")
def merged_60(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Read only: an output of 60 files merged with the small blocks; each damage case copies it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_zarrmeta, "INDEX_ROWS_PER_CHUNK", SMALL)
        mp.setattr(_lazyindex, "ROW_BLOCK", SMALL)
        return _merge(tmp_path_factory.mktemp("lazy-index"), 60)


@pytest.mark.parametrize("node, at, value, needle", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_damaged_late_block_opens_and_is_refused_when_read(
    merged_60, small_blocks, tmp_path, node, at, value, needle
):
    out = tmp_path / "out.zarr"
    shutil.copytree(merged_60, out)
    _set(out, node, at, value)
    res = spillmerge.open(str(out))  # bounded: the damage lies beyond the first block
    assert len(res) == 60 and res.filenames[59] == _name(59)
    assert res[_name(1)]["caption"][2] == "file 1 frame 2"  # files in checked blocks still read
    with pytest.raises(spillmerge.CorruptSpillError, match=needle) as ei:
        v = res[_name(LATE)]
        for leaf in ("caption", "boxes", "mask", "maybe"):
            v[leaf].to_list()
    assert str(out) in str(ei.value)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle):  # every row, in order, meets it too
        spillmerge.open(str(out)).to_arrow()
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any(re.search(needle.split(":")[0], p) for p in rep.problems), rep.problems


def test_open_reads_the_same_few_chunks_at_any_size(small_blocks, tmp_path):
    """What open reads does not grow with the output: the same chunks at 20 and 200 files."""
    read = []
    for n in (20, 200):
        res = spillmerge.open(str(_merge(tmp_path / str(n), n)))
        read.append(res.cache_stats().misses)
        assert len(res.filenames) == n
    assert read[0] == read[1], read


def test_every_row_reads_back_across_blocks(small_blocks, tmp_path):
    out = _merge(tmp_path, 30)
    res = spillmerge.open(str(out))
    for i in (0, 7, 13, 29):
        v = res[_name(i)]
        assert res.frames(_name(i)).tolist() == [0, 1, 2]
        assert v["caption"].to_list() == [f"file {i} frame {f}" for f in range(3)]
        assert [x.shape for x in v["boxes"].to_list()] == [(i % 3, 4)] * 3
        assert [x.shape for x in v["mask"].to_list()] == [(i % 2 + 1, f + 1) for f in range(3)]
        assert v["maybe"].to_list() == [None if (i + f) % 5 == 0 else 1.5 for f in range(3)]
    table = res.to_arrow()
    assert table.num_rows == 90 and table.column("caption")[89].as_py() == "file 29 frame 2"
    names, offsets, frame_idx, rank, copies = res.index_arrays()
    assert np.array_equal(offsets, np.arange(0, 91, 3)) and frame_idx.tolist() == [0, 1, 2] * 30


def test_a_file_across_two_blocks_is_read_only_after_both_are_checked(small_blocks, tmp_path):
    # File 2 holds rows 6..8: the end of block 0 and the start of block 1. Block 0 is checked when
    # file 0 is read; reading file 2 then checks block 1 too, where row 8 is damaged, even for a
    # leaf whose rows are read from its values alone ("emb": no offsets, nothing else checks).
    out = _merge(tmp_path, 6)
    _set(out, "index/frame_idx", 8, -4)
    res = spillmerge.open(str(out))
    assert res[_name(0)]["caption"].to_list() == [f"file 0 frame {f}" for f in range(3)]
    with pytest.raises(spillmerge.CorruptSpillError, match=r"index/frame_idx: row 8 .* < 0"):
        res[_name(2)]["emb"][:]


def test_a_row_with_a_value_in_two_variants_of_a_leaf_is_refused(small_blocks, tmp_path):
    # "u" is a float in even frames and a string in odd ones: two variant columns, each row valid
    # in exactly one. Row 0 (a float) also marked valid as a string would read as either.
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(4):
            for f in range(3):
                w.write(_name(i), f, {"u": 1.5 if f % 2 == 0 else f"s{f}"})
    spillmerge.merge(str(root), str(out), progress=False)
    res = spillmerge.open(str(out))
    assert [res.value(_name(0), f)["u"] for f in range(3)] == [1.5, "s1", 1.5]
    _set(out, "columns/u.str/valid", 0, 1)
    with pytest.raises(
        spillmerge.CorruptSpillError, match=r"row 0 has a value in more than one variant of leaf \['u'\]"
    ):
        spillmerge.open(str(out)).value(_name(0), 0)
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any("more than one variant" in p for p in rep.problems), rep.problems


def test_iter_values_names_frame_offsets_decreasing_across_chunks(small_blocks, tmp_path):
    # frame_offsets entry 16 (the first of its chunk, each chunk in order) set below entry 15:
    # iter_values checks each window of files' entries before reading their rows, so the error
    # names the array that is damaged, not the rows it misattributes.
    out = _merge(tmp_path, 20)
    _set(out, "index/frame_offsets", 16, 40)
    with pytest.raises(spillmerge.CorruptSpillError, match=r"^\S*index/frame_offsets: entries \d+\.\.\d+ decrease"):
        list(spillmerge.open(str(out)).iter_values())


def test_frames_descending_across_a_row_blocks_edge_are_refused(small_blocks, tmp_path):
    # frame_offsets entry 8 moved from 24 to 25: file 7 then holds rows 21..24, frames 0, 1, 2
    # (block 2) and 0 (block 3). Each block alone ascends: the check spans the edge between them.
    out = _merge(tmp_path, 12)
    _set(out, "index/frame_offsets", 8, 25)
    res = spillmerge.open(str(out))
    with pytest.raises(
        spillmerge.CorruptSpillError, match=r"not strictly ascending within a file: row 24 .* holds 0 after 2"
    ):
        res.frames(_name(7))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"not strictly ascending"):
        list(spillmerge.open(str(out)).iter_values())
