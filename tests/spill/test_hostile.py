"""A spill root is untrusted input: corrupted or malicious indexes, catalogs and records must give
a SpillMergeError, never a crash, a huge allocation or a write outside the output."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import spillmerge
from spillmerge._format import common as F
from spillmerge._format import spill as FS


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1, chunk_bytes=4096) as w:
        for i in range(6):
            w.write(f"f{i % 2}.mp4", i, {"x": torch.full((300,), float(i)), "s": i})
    return root


def _segment(root: Path) -> Path:
    return next(root.glob("rank-00000/seg-*"))


def _rewrite_array(seg: Path, name: str, raw: bytes, shape: list[int]) -> None:
    meta = json.loads((seg / name / "zarr.json").read_text())
    meta["shape"] = shape
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [max(d, 1) for d in shape]
    (seg / name / "zarr.json").write_text(json.dumps(meta))
    key = seg / name / "c" / "/".join("0" * len(shape))
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_bytes(raw + google_crc32c.value(raw).to_bytes(4, "little"))


def _recommit(seg: Path, **changes) -> None:
    commit = json.loads((seg / "commit.json").read_text())
    commit.update(changes)
    (seg / "commit.json").write_text(json.dumps(commit))


def _merge_must_fail_cleanly_or_succeed(tmp: Path, root: Path) -> None:
    out = tmp / "out"
    try:
        spillmerge.merge(str(root), str(out))
    except spillmerge.SpillMergeError:
        merged = False
    else:
        merged = True
    try:
        root_ok: bool | None = spillmerge.verify(str(root)).ok
    except spillmerge.SpillMergeError:
        root_ok = None
    if merged:
        # A mutation the merge accepted is consistently checksummed data: the output holds exactly
        # the keys the root says it committed, every row of every leaf reads back, the output
        # verifies, and verify ROOT agrees with the merge that the root is sound.
        res = spillmerge.open(str(out))
        keys = {f: sorted(res.frames(f).tolist()) for f in res}
        assert keys == {f: sorted(v) for f, v in spillmerge.committed_keys(str(root)).items()}
        for f in res:
            for view in res[f].values():
                assert len(view.to_list()) == len(keys[f])
        assert spillmerge.verify(str(out)).ok
        assert root_ok is True, "verify ROOT reports a problem in a root that merged"
    assert sorted(os.listdir(tmp)) in (["spill"], ["out", "spill"])


interesting = st.one_of(
    st.sampled_from([-1, 0, 1, 2, 5, 299, 300, 1200, 4096, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, -(2**63)]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)


@given(
    cells=st.lists(
        st.tuples(st.integers(0, 1000), st.integers(0, FS.INDEX_COLUMNS - 1), interesting), min_size=1, max_size=4
    )
)
def test_corrupted_index_rows(tmp_path_factory, pristine, cells):
    tmp = tmp_path_factory.mktemp("idx")
    root = tmp / "spill"
    shutil.copytree(pristine, root)
    seg = _segment(root)
    commit = json.loads((seg / "commit.json").read_text())
    index = np.frombuffer((seg / "index/c/0/0").read_bytes()[:-4], dtype="<i8").reshape(-1, 6).copy()
    for row, col, value in cells:
        index[row % len(index), col] = value
    raw = index.tobytes()
    _rewrite_array(seg, "index", raw, [len(index), 6])
    _recommit(seg, index_crc32c=google_crc32c.value(raw))
    assert commit["n_rows"] == len(index)
    _merge_must_fail_cleanly_or_succeed(tmp, root)


catalogs = st.one_of(
    st.just(b"not json"),
    st.just(b"[" * 100000),
    st.just(b'{"filenames": "x", "layouts": []}'),
    st.builds(
        lambda files, layouts: json.dumps({"filenames": files, "layouts": layouts}).encode(),
        st.lists(st.one_of(st.text(max_size=5), st.sampled_from(["../../etc/passwd", "f0.mp4", "f1.mp4"])), max_size=4),
        st.lists(
            st.fixed_dictionaries(
                {
                    "leaf": st.one_of(st.lists(st.text(max_size=3), max_size=2), st.just("x")),
                    "dtype": st.sampled_from(["float32", "int64", "bfloat16", "object", "<f4", "uint8"]),
                    "shape": st.one_of(
                        st.lists(st.integers(-2, 2**41), max_size=3), st.just([300]), st.just([]), st.just("big")
                    ),
                }
            ),
            max_size=4,
        ),
    ),
)


@given(catalog=catalogs)
def test_corrupted_catalogs(tmp_path_factory, pristine, catalog):
    tmp = tmp_path_factory.mktemp("cat")
    root = tmp / "spill"
    shutil.copytree(pristine, root)
    seg = _segment(root)
    _rewrite_array(seg, "catalog", catalog, [len(catalog)])
    _recommit(seg, catalog_crc32c=google_crc32c.value(catalog))
    _merge_must_fail_cleanly_or_succeed(tmp, root)


@given(
    field=st.sampled_from(
        [
            "format_version",
            "kind",
            "rank",
            "world_size",
            "segment",
            "n_rows",
            "nbytes",
            "n_chunks",
            "chunk_bytes",
            "run_id",
        ]
    ),
    value=st.one_of(interesting, st.text(max_size=8), st.none(), st.just(2), st.just("../../x"), st.just([1])),
)
def test_corrupted_commit_records(tmp_path_factory, pristine, field, value):
    tmp = tmp_path_factory.mktemp("commit")
    root = tmp / "spill"
    shutil.copytree(pristine, root)
    _recommit(_segment(root), **{field: value})
    _merge_must_fail_cleanly_or_succeed(tmp, root)


def test_hostile_index_shape_is_refused_before_reading(tmp_path, pristine):
    root = tmp_path / "spill"
    shutil.copytree(pristine, root)
    seg = _segment(root)
    meta = json.loads((seg / "index/zarr.json").read_text())
    meta["shape"] = [2**40, 6]
    (seg / "index/zarr.json").write_text(json.dumps(meta))
    with pytest.raises(spillmerge.CorruptSpillError, match="does not match the commit record"):
        spillmerge.merge(str(root), str(tmp_path / "out"))


def test_missing_data_chunk_and_future_format_are_named(tmp_path, pristine):
    root = tmp_path / "spill"
    shutil.copytree(pristine, root)
    seg = _segment(root)
    (seg / "data/c/1").unlink()
    with pytest.raises(spillmerge.CorruptSpillError, match=r"data chunk 1 is missing"):
        spillmerge.merge(str(root), str(tmp_path / "out"))
    _recommit(seg, format_version=99)
    said = f"a spill root of format version 99; this spillmerge reads spill root format version {F.SPILL_FORMAT_VERSION} only"
    with pytest.raises(spillmerge.FormatVersionError, match=said):
        spillmerge.merge(str(root), str(tmp_path / "out"))


def test_foreign_folders_in_the_root_are_ignored_and_rank_names_validated(tmp_path, pristine):
    root = tmp_path / "spill"
    shutil.copytree(pristine, root)
    (root / "notes").mkdir()
    (root / "rank-0000x").mkdir()
    (root / "rank-00000" / "seg-bogus").mkdir()
    rep = spillmerge.merge(str(root), str(tmp_path / "out"))
    assert rep.n_frames == 6
    (root / "rank-00007").mkdir()
    with pytest.raises(spillmerge.CorruptSpillError, match="outside world_size 1"):
        spillmerge.merge(str(root), str(tmp_path / "out2"))


# --------------------------------------------------------------------------------------------
# issue 26: sizes computed from an output's metadata, limits the writer must enforce first


def _ragged_output(tmp: Path) -> Path:
    """An output whose ragged column ``m`` has an empty row (row 0: shape ``[0, 2]``, offsets
    step 0), so a ``shapes`` row of product 0 is consistent with the offsets."""
    root, out = tmp / "spill", tmp / "out"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a.mp4", 0, {"m": torch.empty(0, 2)})
        w.write("a.mp4", 1, {"m": torch.ones(2, 3)})
        w.write("b.mp4", 0, {"m": torch.ones(1, 1)})
    spillmerge.merge(str(root), str(out))
    return out


@pytest.mark.parametrize("row", [[2**32, 2**32], [2**27, 0], [2**31, 2**33]])
def test_shapes_row_of_product_zero_is_refused(tmp_path: Path, row: list[int]) -> None:
    """``[2**32, 2**32]`` wraps to 0 elements in int64, ``[2**27, 0]`` has none but 2**27 list
    entries: both agree with an offsets step of 0, and both are refused by ``open`` and
    ``verify`` (``to_arrow`` would allocate gigabytes, reading the row raise a raw ValueError)."""
    out = _ragged_output(tmp_path)
    shapes_chunk = out / "columns/m/shapes/c/0/0"
    shapes = np.frombuffer(shapes_chunk.read_bytes()[:-4], dtype="<i8").reshape(3, 2).copy()
    assert shapes[0].tolist() == [0, 2]
    shapes[0] = row
    raw = shapes.tobytes()
    shapes_chunk.write_bytes(raw + google_crc32c.value(raw).to_bytes(4, "little"))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"columns/m/shapes: row 0's shape"):
        spillmerge.open(str(out))
    rep = spillmerge.verify(str(out))
    assert any("columns/m/shapes: row 0's shape" in p for p in rep.problems), rep.problems


def test_writer_refuses_what_readers_refuse(tmp_path: Path) -> None:
    """A filename longer than the format allows, or an empty value with 2**27 entries before its
    zero, is a ``SpillValueError`` naming the filename at ``write()`` and ``write_batch()``: a
    merge of it would succeed and leave an output ``open`` refuses. Nothing is written."""
    long = "f" * (1 << 20)
    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        with pytest.raises(spillmerge.SpillValueError, match="more than the 65536 a filename") as e:
            w.write(long, 0, torch.ones(2))
        assert e.value.filename == long
        with pytest.raises(spillmerge.SpillValueError, match="more than the 65536 a filename"):
            w.write_batch([long], torch.ones(1, 2), [0])
        for value in (torch.empty(2**27, 0), {"x": np.empty((2**20, 0, 3))}):
            with pytest.raises(spillmerge.SpillValueError, match="entries before a zero dimension") as e:
                w.write("a.mp4", 0, value)
            assert e.value.filename == "a.mp4"
        w.write("a.mp4", 0, torch.empty(65536, 0))  # at the bound: accepted
        w.write("f" * (1 << 16), 0, torch.ones(1, 1))
    out = tmp_path / "out"
    spillmerge.merge(str(tmp_path / "spill"), str(out))
    res = spillmerge.open(str(out))
    assert sorted(res) == ["a.mp4", "f" * (1 << 16)]
    assert res["a.mp4"][0].shape == (65536, 0)
    assert spillmerge.verify(str(out)).ok


def test_merge_refuses_a_catalog_filename_past_the_limit(tmp_path: Path) -> None:
    """A spill root written by a writer without the limit (checksums fixed up): the merge
    refuses it by name instead of writing an output no reader opens, and ``verify`` says so."""
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a.mp4", 0, torch.ones(2))
    seg = _segment(root)
    text = (seg / "catalog/c/0").read_bytes()[:-4].replace(b'"a.mp4"', b'"' + b"a" * (1 << 20) + b'"')
    meta = json.loads((seg / "catalog/zarr.json").read_text())
    meta["shape"] = meta["chunk_grid"]["configuration"]["chunk_shape"] = [len(text)]
    (seg / "catalog/zarr.json").write_text(json.dumps(meta))
    (seg / "catalog/c/0").write_bytes(text + google_crc32c.value(text).to_bytes(4, "little"))
    _recommit(seg, catalog_crc32c=google_crc32c.value(text))
    with pytest.raises(spillmerge.CorruptSpillError, match="more than the 65536 bytes a filename"):
        spillmerge.merge(str(root), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    rep = spillmerge.verify(str(root))
    assert any("65536 bytes a filename" in p for p in rep.problems), rep.problems


def test_merge_chunk_bytes_is_bounded(tmp_path: Path, pristine: Path) -> None:
    with pytest.raises(spillmerge.SpillValueError, match="chunk_bytes must be an int in"):
        spillmerge.merge(str(pristine), str(tmp_path / "out"), chunk_bytes=(256 << 20) + 1)


def _string_root(root: Path) -> Path:
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a.mp4", 0, {"t": "héllo", "l": ["ab", "c"]})
    return _segment(root)


def _rewrite_catalog_text(seg: Path, old: bytes, new: bytes) -> None:
    text = (seg / "catalog/c/0").read_bytes()[:-4]
    assert old in text
    text = text.replace(old, new)
    meta = json.loads((seg / "catalog/zarr.json").read_text())
    meta["shape"] = meta["chunk_grid"]["configuration"]["chunk_shape"] = [len(text)]
    (seg / "catalog/zarr.json").write_text(json.dumps(meta))
    (seg / "catalog/c/0").write_bytes(text + google_crc32c.value(text).to_bytes(4, "little"))
    _recommit(seg, catalog_crc32c=google_crc32c.value(text))


@pytest.mark.parametrize(
    ("edit", "said"),
    [({"shape": [2.0]}, "shape must be a list"), ({"pos": [True]}, "pos must be one int"),
     ({"pos": [1.0]}, "pos must be one int")],
)  # fmt: skip
def test_a_layout_equal_to_a_checked_one_but_for_json_types_is_refused(
    tmp_path: Path, edit: dict[str, Any], said: str
) -> None:
    """Layouts already checked are not checked again: a catalog whose layouts repeat a sound one
    with a float or a boolean where it has an int (equal in Python) is refused all the same."""
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a.mp4", 0, {"z": 0, "a": [1, 2]})  # the dict's key order kept: positions stored
    seg = _segment(root)
    cat = json.loads((seg / "catalog/c/0").read_bytes()[:-4])
    (lay,) = (lay for lay in cat["layouts"] if lay["leaf"] == ["a"])
    assert lay["shape"] == [2] and lay["pos"] == [1]
    cat["layouts"].append({**lay, **edit})  # after the sound one, in the same catalog
    raw = json.dumps(cat).encode()
    _rewrite_array(seg, "catalog", raw, [len(raw)])
    _recommit(seg, catalog_crc32c=google_crc32c.value(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=said):
        spillmerge.merge(str(root), str(tmp_path / "out"))


def test_strlist_layout_claiming_more_strings_than_bytes(tmp_path: Path) -> None:
    """A catalog layout claiming 2**31 strings in 12 bytes (checksums fixed up): the merge
    raises a CorruptSpillError naming the catalog (it raised a raw ``ValueError: buffer is
    smaller than requested size`` in the copy) and ``verify ROOT`` reports it."""
    root = tmp_path / "spill"
    seg = _string_root(root)
    _rewrite_catalog_text(seg, b'"shape": [2, 11]', b'"shape": [2147483648, 11]')
    with pytest.raises(spillmerge.CorruptSpillError, match="2147483648 strings cannot fit in 11 bytes"):
        spillmerge.merge(str(root), str(tmp_path / "out"))
    rep = spillmerge.verify(str(root))
    assert any("2147483648 strings cannot fit" in p for p in rep.problems), rep.problems


@pytest.mark.parametrize("leaf", ["t", "l"])
def test_verify_finds_text_the_merge_refuses(tmp_path: Path, leaf: str) -> None:
    """A string leaf whose bytes are edited to invalid UTF-8 with its checksum fixed up: the merge's
    copy refuses it, so ``verify ROOT`` must report it too."""
    root = tmp_path / "spill"
    seg = _string_root(root)
    index = np.frombuffer((seg / "index/c/0/0").read_bytes()[:-4], dtype="<i8").reshape(-1, 6).copy()
    chunk = seg / "data/c/0"
    data = bytearray(chunk.read_bytes())
    cat = json.loads((seg / "catalog/c/0").read_bytes()[:-4])
    row = next(r for r in index if cat["layouts"][r[2]]["leaf"] == [leaf])
    off, nb = int(row[3]), int(row[4])
    data[off + nb - 1] = 0xFF  # the last byte of the last string: invalid UTF-8
    chunk.write_bytes(bytes(data))
    row[5] = google_crc32c.value(bytes(data[off : off + nb]))
    index[[i for i, r in enumerate(index) if r[3] == off][0]] = row
    raw = index.tobytes()
    _rewrite_array(seg, "index", raw, list(index.shape))
    _recommit(seg, index_crc32c=google_crc32c.value(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match="not valid UTF-8"):
        spillmerge.merge(str(root), str(tmp_path / "out"))
    rep = spillmerge.verify(str(root))
    assert any("not valid UTF-8" in p and "the merge would refuse it" in p for p in rep.problems), rep.problems


def test_a_character_split_between_two_strings_is_refused(tmp_path: Path) -> None:
    """Two string rows edited so a character's bytes are split between them (each row invalid
    UTF-8, the two back to back valid; the rows' checksums fixed up): the copy, which checks a
    batch of strings in one decode, still refuses it and names the first row."""
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a.mp4", 0, {"t": "xxé"})
        w.write("b.mp4", 0, {"t": "éyy"})
    seg = _segment(root)
    index = np.frombuffer((seg / "index/c/0/0").read_bytes()[:-4], dtype="<i8").reshape(-1, 6).copy()
    chunk = seg / "data/c/0"
    data = bytearray(chunk.read_bytes())
    edits = {"xxé".encode(): b"xxx\xc3", "éyy".encode(): b"\xa9yyy"}
    for row in index:
        off, nb = int(row[3]), int(row[4])
        data[off : off + nb] = edits[bytes(data[off : off + nb])]
        row[5] = google_crc32c.value(bytes(data[off : off + nb]))
    chunk.write_bytes(bytes(data))
    raw = index.tobytes()
    _rewrite_array(seg, "index", raw, list(index.shape))
    _recommit(seg, index_crc32c=google_crc32c.value(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"'a\.mp4' frame 0 leaf 't'.*not valid UTF-8"):
        spillmerge.merge(str(root), str(tmp_path / "out"))


def test_a_string_row_cut_by_output_chunks_is_checked_whole(tmp_path: Path) -> None:
    """Output chunks smaller than a string row: every row is cut by a chunk's edge, so no chunk
    holds a whole row; the copy still checks each row whole and refuses the one that is not
    valid UTF-8 (its checksum fixed up), naming it."""
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for name in ("a.mp4", "b.mp4", "c.mp4"):
            w.write(name, 0, {"t": "xxxxxxxé"})
    seg = _segment(root)
    index = np.frombuffer((seg / "index/c/0/0").read_bytes()[:-4], dtype="<i8").reshape(-1, 6).copy()
    chunk = seg / "data/c/0"
    data = bytearray(chunk.read_bytes())
    off, nb = int(index[1][3]), int(index[1][4])  # b.mp4's row: "é" made two bytes no character starts with
    data[off + nb - 2 : off + nb] = b"\xa9\xa9"
    index[1][5] = google_crc32c.value(bytes(data[off : off + nb]))
    chunk.write_bytes(bytes(data))
    raw = index.tobytes()
    _rewrite_array(seg, "index", raw, list(index.shape))
    _recommit(seg, index_crc32c=google_crc32c.value(raw))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"'b\.mp4' frame 0 leaf 't'.*not valid UTF-8"):
        spillmerge.merge(str(root), str(tmp_path / "out"), chunk_bytes=4)


def _x_output(tmp: Path) -> Path:
    root, out = tmp / "spill", tmp / "out"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(10):
            w.write("a.mp4", i, {"x": torch.full((300,), float(i))})
    spillmerge.merge(str(root), str(out), codec="zstd")
    return out


def _set_x_meta(out: Path, **edit: Any) -> None:
    for doc, get in ((out / "columns/x/values/zarr.json", lambda d: d),
                     (out / "zarr.json", lambda d: d["consolidated_metadata"]["metadata"]["columns/x/values"])):  # fmt: skip
        d = json.loads(doc.read_text())
        m = get(d)
        if "chunk_rows" in edit:
            m["chunk_grid"]["configuration"]["chunk_shape"][0] = edit["chunk_rows"]
        doc.write_text(json.dumps(d))


def test_chunk_shape_larger_than_its_array_is_refused(tmp_path: Path) -> None:
    """A 10-row column re-declared with chunks of 65,536 rows (78 MiB: under the chunk bound, so
    only the comparison with the array's shape catches it) and a zstd chunk of that size: ``open``
    and ``verify`` refuse the metadata before decoding anything."""
    out = _x_output(tmp_path)
    _set_x_meta(out, chunk_rows=1 << 16)
    body = numcodecs_zstd().encode(bytes((1 << 16) * 1200))
    (out / "columns/x/values/c/0/0").write_bytes(body + google_crc32c.value(body).to_bytes(4, "little"))
    with pytest.raises(spillmerge.CorruptSpillError, match="larger than the array's shape"):
        spillmerge.open(str(out))
    rep = spillmerge.verify(str(out))
    assert any("larger than the array's shape" in p for p in rep.problems), rep.problems


def test_zstd_frame_without_content_size_is_refused_unread(tmp_path: Path) -> None:
    """A zstd frame that does not declare its content size would be decoded by a growing buffer:
    reading the chunk refuses it by its header, naming it."""
    from test_untrusted_storage import _zstd_rle_bomb

    out = _x_output(tmp_path)
    body = _zstd_rle_bomb(1 << 20, declare=False)
    (out / "columns/x/values/c/0/0").write_bytes(body + google_crc32c.value(body).to_bytes(4, "little"))
    res = spillmerge.open(str(out))
    with pytest.raises(spillmerge.CorruptSpillError, match="does not declare its content size"):
        res["a.mp4"]["x"][0]


def numcodecs_zstd() -> Any:
    from numcodecs import Zstd

    return Zstd(level=3)
