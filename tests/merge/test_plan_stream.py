"""The plan's sort reads a large segment a block at a time (``_spill.stream``): the same plan as
a segment read whole, and the same error for a damaged one, the checks of a whole segment made
on the sorted rows. The thresholds are lowered so that a small root takes that path."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
import torch

import spillmerge
from spillmerge._errors import CorruptSpillError
from spillmerge._merge import plan as P
from spillmerge._merge import plansql
from spillmerge._spill import lazy, stream
from spillmerge._spill import root as R
from spillmerge._storage import Storage

NAMES = ["a\nb.mp4", 'q"uote.mp4', "back\\slash.mp4", "\u00e9t\u00e9.mp4", "plain.mp4", '\\"x']


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream") / "spill"
    _write(str(root))
    return root


def _write(root: str, opts: dict[str, Any] | None = None) -> None:
    for rank in range(2):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096, storage_options=opts) as w:
            for i, name in enumerate(NAMES):
                for frame in range(3):  # rank 1 writes the same keys: identical copies
                    w.write(name, frame, {"z": torch.full((5,), float(i + frame)), "a": f"{name}-{frame}"})
            w.write(f"only-{rank}.mp4", 0, {"z": torch.zeros(5), "a": "x"})


def _plan(
    root: Path | str, monkeypatch: pytest.MonkeyPatch, *, streamed: bool, opts: dict[str, Any] | None = None
) -> tuple[str, list[bool]]:
    monkeypatch.setattr(plansql, "in_memory", lambda n, limit: False)  # DuckDB's sort whatever the rows
    monkeypatch.setattr(lazy, "STREAM_BYTES", 0 if streamed else 1 << 40)
    storage = Storage(str(root), opts)
    segs = [s for ss in R.scan(storage).values() for s in ss if s.commit is not None]
    loaded = lazy.load_all(storage, segs)
    p = P.build(loaded, "first", same_bytes=lambda a, b: R.same_bytes(storage, a, b))
    return P.fingerprint(p), [getattr(s, "stream", None) is not None for s in loaded]


def test_a_segment_read_a_block_at_a_time_gives_the_same_plan(pristine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "BLOCK", 7)  # many blocks: elements and escapes cut between them
    whole, how = _plan(pristine, monkeypatch, streamed=False)
    assert how == [False, False]
    blocks, how = _plan(pristine, monkeypatch, streamed=True)
    assert how == [True, True]
    assert blocks == whole


def test_a_segment_on_an_object_store_is_read_a_block_at_a_time_to_the_same_plan(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from _s3 import storage_options

    opts = storage_options(s3.endpoint)
    _write("s3://test/spill", opts)
    monkeypatch.setattr(stream, "BLOCK", 64)  # several ranged reads of each catalog
    whole, _ = _plan("s3://test/spill", monkeypatch, streamed=False, opts=opts)
    blocks, how = _plan("s3://test/spill", monkeypatch, streamed=True, opts=opts)
    assert how == [True, True]
    assert blocks == whole


def _seg(root: Path, rank: int = 0) -> Path:
    return next(root.glob(f"rank-0000{rank}/seg-*"))


def _rewrite(seg: Path, name: str, raw: bytes, commit_field: str | None) -> None:
    """Object ``name`` of ``seg`` with bytes ``raw`` and a matching chunk checksum (and commit
    record field, when given): damage only the checks of a whole segment can find."""
    meta = json.loads((seg / name / "zarr.json").read_text())
    shape = [len(raw)] if name == "catalog" else [len(raw) // 48, 6]
    meta["shape"] = shape
    meta["chunk_grid"]["configuration"]["chunk_shape"] = shape
    (seg / name / "zarr.json").write_text(json.dumps(meta))
    key = seg / name / "c" / "/".join("0" * len(shape))
    key.write_bytes(raw + google_crc32c.value(raw).to_bytes(4, "little"))
    if commit_field is not None:
        commit = json.loads((seg / "commit.json").read_text())
        commit[commit_field] = google_crc32c.value(raw)
        (seg / "commit.json").write_text(json.dumps(commit))


def _index(seg: Path) -> np.ndarray:
    return np.frombuffer((seg / "index/c/0/0").read_bytes()[:-4], dtype="<i8").reshape(-1, 6).copy()


def _catalog(seg: Path) -> dict[str, Any]:
    return json.loads((seg / "catalog/c/0").read_bytes()[:-4])


def _frame_twice(seg: Path) -> None:
    idx = _index(seg)
    idx[1] = idx[0]
    _rewrite(seg, "index", idx.tobytes(), "index_crc32c")


def _name_twice(seg: Path) -> None:  # the second name, which holds rows, is the first again
    cat = _catalog(seg)
    cat["filenames"][1] = cat["filenames"][0]
    _rewrite(seg, "catalog", spillmerge._format.common.dumps(cat), "catalog_crc32c")


def _unused_name_twice(seg: Path) -> None:  # a name more, holding no row, equal to another
    cat = _catalog(seg)
    cat["filenames"].append(cat["filenames"][2])
    _rewrite(seg, "catalog", spillmerge._format.common.dumps(cat), "catalog_crc32c")


def _name_twice_other_frames(seg: Path) -> None:  # name 1's rows keep their frames, now of name 0
    idx = _index(seg)
    idx[idx[:, 0] == 1, 1] += 100
    _rewrite(seg, "index", idx.tobytes(), "index_crc32c")
    _name_twice(seg)


def _flipped_index_byte(seg: Path) -> None:
    key = seg / "index/c/0/0"
    raw = bytearray(key.read_bytes())
    raw[10] ^= 1
    key.write_bytes(bytes(raw))


def _unknown_file(seg: Path) -> None:
    idx = _index(seg)
    idx[-1, 0] = 1000
    _rewrite(seg, "index", idx.tobytes(), "index_crc32c")


def _catalog_crc_differs(seg: Path) -> None:
    raw = (seg / "catalog/c/0").read_bytes()[:-4].replace(b"plain", b"plane")
    _rewrite(seg, "catalog", raw, None)


def _index_crc_differs(seg: Path) -> None:
    idx = _index(seg)
    idx[0, 1] += 7
    _rewrite(seg, "index", idx.tobytes(), None)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "frame-twice": _frame_twice,
    "name-twice": _name_twice,
    "unused-name-twice": _unused_name_twice,
    "name-twice-other-frames": _name_twice_other_frames,
    "flipped-index-byte": _flipped_index_byte,
    "unknown-file": _unknown_file,
    "catalog-checksum": _catalog_crc_differs,
    "index-checksum": _index_crc_differs,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_segment_read_a_block_at_a_time_raises_what_a_whole_read_does(
    tmp_path: Path, pristine: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    root = tmp_path / "spill"
    shutil.copytree(pristine, root)
    seg = _seg(root, 1)
    DAMAGE[damage](seg)
    storage = Storage(str(root))
    with pytest.raises(CorruptSpillError) as whole:  # the error of the segment read whole
        R.load_segment(storage, R.read_segment(storage, 1, seg.name))
    with pytest.raises(CorruptSpillError) as blocks:
        _plan(root, monkeypatch, streamed=True)
    assert str(blocks.value) == str(whole.value)
    assert blocks.value.path == whole.value.path


def test_a_catalog_written_another_way_is_read_whole(
    tmp_path: Path, pristine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "spill"
    shutil.copytree(pristine, root)
    seg = _seg(root, 1)
    _rewrite(seg, "catalog", json.dumps(_catalog(seg), indent=1).encode(), "catalog_crc32c")
    want, _ = _plan(pristine, monkeypatch, streamed=True)
    got, how = _plan(root, monkeypatch, streamed=True)
    assert how == [True, False]
    assert got == want


def test_an_index_damaged_between_the_plans_passes_raises_what_a_whole_read_does(
    tmp_path: Path, pristine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key-order pass (the dicts' keys were written out of sorted order) reads a segment's
    index again, block by block: a byte flipped after the sort is found then."""
    root = tmp_path / "spill"
    shutil.copytree(pristine, root)
    seg = _seg(root, 1)
    collect = plansql._collect

    def then_damage(*args: Any) -> Any:
        out = collect(*args)
        _flipped_index_byte(seg)
        return out

    monkeypatch.setattr(plansql, "_collect", then_damage)
    with pytest.raises(CorruptSpillError) as blocks:
        _plan(root, monkeypatch, streamed=True)
    storage = Storage(str(root))
    with pytest.raises(CorruptSpillError) as whole:
        R.load_segment(storage, R.read_segment(storage, 1, seg.name))
    assert str(blocks.value) == str(whole.value)
