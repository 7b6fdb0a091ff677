"""Nothing lost on the read side: `spillmerge.open` and `spillmerge verify` check the merged
output's index and its columns (docs/FORMAT.md, *Invariants of the index*) and never read an
absent chunk as zeros; `inspect` / coverage cost O(frames), not O(span of frame indices). Stores
are built with the public API and damaged on disk with plain zarr and file operations."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
import zarr
from _helpers import write_filenames
from test_cli import cli_run as run  # spillmerge ARGS in this process

import spillmerge
from spillmerge._inspect.coverage import coverage
from spillmerge._util.frames import first_missing, read_manifest

EXE = shutil.which("spillmerge", path=os.path.dirname(sys.executable)) or "spillmerge"
"""The console script: the memory-bounded runs below measure a process of its own."""


def _write(w: spillmerge.SpillWriter) -> None:
    for f in (0, 1, 2):
        w.write("a.mp4", f, torch.full((2,), float(f)))
        w.write("b.mp4", 10 + f, {"x": torch.full((2,), float(f)), "y": {"z": torch.tensor([f])}})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store ``out`` copies, merged once for the module."""
    base = tmp_path_factory.mktemp("nothing-lost-reader")
    root, dst = base / "spill", base / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        _write(w)
    spillmerge.merge(str(root), str(dst), chunk_bytes=8)
    return dst


@pytest.fixture
def out(pristine: Path, tmp_path: Path) -> Path:
    """A merged store, the test's own copy: a.mp4 (tensor, frames 0..2, column ``_value``, rows
    0..2) and b.mp4 (dict, frames 10..12, columns ``x`` and ``y/z``, rows 3..5). Every column lacks
    the other file's rows, so each has ``valid`` and ``offsets`` and its ``values`` hold only its
    file's 3 rows, one row per chunk: every ``values`` array has 3 chunks."""
    dst = tmp_path / "out.zarr"
    shutil.copytree(pristine, dst)
    return dst


def _col(path: Path | str, leaf: str) -> str:
    """``columns/<col>`` of the leaf ``leaf`` ("" for the plain tensor values), from the column
    headers: group names of nested leaves carry a hash (``y_z~...``)."""
    g = zarr.open_group(str(path), mode="r", use_consolidated=False)
    for name, node in g["columns"].members(max_depth=0):
        if node.attrs["spillmerge"]["leaf"] == (leaf.split("/") if leaf else []):
            return f"columns/{name}"
    raise AssertionError(f"no column of leaf {leaf!r} in {path}")


def _consolidate(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr warns that consolidated metadata is not in the v3 spec
        zarr.consolidate_metadata(str(path))


def _set_index(path: Path, name: str, values: list) -> None:
    """Overwrite ``index/NAME`` in place (same length) with plain zarr."""
    zarr.open_array(str(path / "index" / name), mode="r+")[:] = values


def _replace_index(path: Path, name: str, values: list) -> None:
    """Replace ``index/NAME`` by an array of another length, keeping the consolidated root in step."""
    if name == "filenames":  # bytes + offsets + heads (format 3)
        write_filenames(path, values)
        return
    g = zarr.open_group(str(path), mode="r+", use_consolidated=False)
    old = g["index"][name]
    new = g["index"].create_array(name, shape=(len(values),), dtype=old.dtype, chunks=(max(len(values), 1),),
                                  overwrite=True, config={"write_empty_chunks": True})  # fmt: skip
    new[:] = np.array(values, dtype=object if old.dtype.kind == "T" else old.dtype)
    _consolidate(path)


def _set_attr(path: Path, node: str, **changes: object) -> None:
    """Change ``attributes["spillmerge"]`` of the group or array ``node`` ("" for the root header)."""
    g = zarr.open_group(str(path), mode="r+", use_consolidated=False)
    obj = g[node] if node else g
    obj.update_attributes({"spillmerge": {**obj.attrs["spillmerge"], **changes}})
    _consolidate(path)


# ------------------------------------------------------------------------------------- reader


def test_undamaged_store_reads_and_verifies(out):
    res = spillmerge.open(str(out))
    assert res.frames("a.mp4").tolist() == [0, 1, 2] and res.frames("b.mp4").tolist() == [10, 11, 12]
    assert res["a.mp4"].to_torch()[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert res["b.mp4"]["y"]["z"].numpy()[:, 0].tolist() == [0, 1, 2]
    assert res.frame_ranks("b.mp4").tolist() == [0, 0, 0] and spillmerge.verify(str(out)).ok
    # The layout the damage below relies on: compact fixed columns, one row of values per chunk.
    g = zarr.open_group(str(out), mode="r")
    assert g["columns/_value/offsets"][:].tolist() == [0, 1, 2, 3, 3, 3, 3]
    assert g["columns/_value/valid"][:].tolist() == [True] * 3 + [False] * 3
    assert g["columns/_value/values"].shape == (3, 2) and g["columns/_value/values"].chunks == (1, 2)
    assert g[_col(out, "y/z") + "/values"].cdata_shape == (3, 1)
    assert g["index/file_layout"][:].tolist() == [0, 1]
    assert g.attrs["spillmerge"]["file_layouts"] == [["_value"], ["x", _col(out, "y/z").split("/")[1]]]


@pytest.mark.parametrize(
    "offsets, needle",
    [
        ([0, 100, 6], "decreases from 100 to 6"),  # once: frames() gave 6 frames for a 3-row array
        ([1, 3, 6], "starts at 1, not 0"),
        ([0, 3, 5], "ends at 5, but index/frame_idx has 6 rows"),
    ],
)
def test_frame_offsets_are_checked_at_open(out, offsets, needle):
    _set_index(out, "frame_offsets", offsets)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle) as ei:
        spillmerge.open(str(out))
    assert ei.value.path == str(out / "index" / "frame_offsets") and str(out) in str(ei.value)


@pytest.mark.parametrize(
    "node, values, needle",
    [
        # a.mp4's values hold 2 rows, but columns/_value/offsets gives a.mp4 3
        (
            "columns/_value/values",
            np.zeros((2, 2), np.float32),
            r"columns/_value/offsets: ends at 3, but columns/_value/values has 2 rows",
        ),
        (
            "columns/x/offsets",
            [0, 0, 0, 0, 1, 2],
            r"columns/x/offsets: 6 entries, but index/frame_idx has 6 rows \(must be 7\)",
        ),
        ("columns/x/valid", [False] * 3 + [True] * 4, r"columns/x/valid: 7 entries, but index/frame_idx has 6 rows"),
        ("columns/x/offsets", [0, 0, 0, 0, 2, 2, 3], r"columns/x/offsets: row 3 spans 2 rows of a fixed column"),
    ],
    ids=["values-rows", "offsets-length", "valid-length", "offsets-step"],
)
def test_a_columns_rows_must_match_the_index(out, node, values, needle):
    """Version 1 checked each file's array against ``frame_offsets``; in version 2 the files share
    columns, so each column's ``values`` / ``offsets`` / ``valid`` are checked against the rows of
    the index and against each other, at open."""
    g = zarr.open_group(str(out), mode="r+", use_consolidated=False)
    old = g[node]
    parent, _, name = node.rpartition("/")
    arr = np.asarray(values, dtype=old.dtype)
    new = g[parent].create_array(name, shape=arr.shape, dtype=old.dtype, chunks=(max(len(arr), 1), *arr.shape[1:]),
                                 overwrite=True, attributes=dict(old.attrs), config={"write_empty_chunks": True})  # fmt: skip
    new[...] = arr
    _consolidate(out)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle) as ei:
        spillmerge.open(str(out))
    assert ei.value.path.startswith(str(out / "columns")) and node.split("/")[1] in ei.value.path
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any(node.rpartition("/")[0] in p for p in rep.problems), rep.problems


def test_moved_file_boundary_is_refused(out):
    """frame_offsets [0, 2, 6]: monotone and ends right, but a.mp4 has 3 rows. Read anyway, a.mp4
    would lose frame 2 and b.mp4 gain a row 'frame 2' whose leaves are all None."""
    _set_index(out, "frame_offsets", [0, 2, 6])
    with pytest.raises(spillmerge.CorruptSpillError, match=r"index/frame_offsets|columns/_value"):
        res = spillmerge.open(str(out))
        res.frames("b.mp4"), res["b.mp4"]["x"].to_list()  # noqa: B018 - the reads that misread
    assert not spillmerge.verify(str(out)).ok


@pytest.mark.parametrize(
    "frame_idx, needle",
    [
        ([2, 1, 0, 10, 11, 12], r"not strictly ascending within a file: row 1 \(file 0, 'a.mp4'\) holds 1 after 2"),
        ([0, 1, 2, 10, 12, 12], r"row 5 \(file 1, 'b.mp4'\) holds 12 after 12"),
        ([-1, 1, 2, 10, 11, 12], r"row 0 \(file 0, 'a.mp4'\) holds frame index -1 < 0"),
    ],
)
def test_frame_indices_must_be_non_negative_and_ascend_within_each_file(out, frame_idx, needle):
    _set_index(out, "frame_idx", frame_idx)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle) as ei:  # version 2: at open
        spillmerge.open(str(out))
    assert ei.value.path == str(out / "index" / "frame_idx")


def test_frame_indices_may_restart_at_a_file_boundary(out):
    _set_index(out, "frame_idx", [5, 6, 7, 0, 1, 2])
    res = spillmerge.open(str(out))
    assert res.frames("a.mp4").tolist() == [5, 6, 7] and res.frames("b.mp4").tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "name, values, needle",
    [
        ("file_layout", [0], r"index/file_layout: 1 entries for 2 files in index/filenames"),
        ("filenames", ["a.mp4", "b.mp4", "c.mp4"], r"index/file_layout: 2 entries for 3 files in index/filenames"),
        ("frame_rank", [0, 0, 0, 0, 0], r"index/frame_rank: 5 rows, but index/frame_idx has 6"),
        ("frame_copies", [1] * 7, r"index/frame_copies: 7 rows, but index/frame_idx has 6"),
        ("filenames", ["a.mp4", "a.mp4"], r"index/filenames: 'a.mp4' is listed more than once"),
        ("filenames", ["b.mp4", "a.mp4"], r"index/filenames: not sorted: entry 1 'a.mp4' follows 'b.mp4'"),
        ("file_layout", [0, 2], r"index/file_layout: entry 1 \('b.mp4'\) is 2, not a position in the header's 2"),
        ("file_layout", [-1, 1], r"index/file_layout: entry 0 \('a.mp4'\) is -1"),
    ],
)
def test_index_lengths_order_and_layouts_are_checked_at_open(out, name, values, needle):
    """Version 1's ``index/keys`` checks (as long as filenames, distinct) became checks of the
    order of ``index/filenames`` (sorted, so distinct: a file is found by binary search) and of
    ``index/file_layout``."""
    _replace_index(out, name, values)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle) as ei:
        spillmerge.open(str(out))
    assert ei.value.path == str(out / "index" / needle.split(":")[0].split("/")[1])


@pytest.mark.parametrize(
    "layouts, needle",
    [
        ([["_value"], ["x", "../index"]], r"zarr.json: file_layouts\[1\] names '../index', which is not a column"),
        ([["_value"]], r"index/file_layout: entry 1 \('b.mp4'\) is 1, not a position in the header's 1"),
        ("x", r"zarr.json: the header's file_layouts 'x' is not a list of column-name lists"),
    ],
)
def test_file_layouts_must_name_columns(out, layouts, needle):
    """Version 1 refused a key that is not a node name; version 2 names nodes only in the header's
    ``file_layouts``, each of whose names must be a column group under ``columns/``."""
    _set_attr(out, "", file_layouts=layouts)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle):
        spillmerge.open(str(out))


@pytest.mark.parametrize(
    "leaf, dtype, needle, at",
    [
        ("", "bfloat16", r"dtype 'bfloat16' is stored as uint16, but the array holds float32", "values"),
        ("", "int32", r"dtype 'int32' is stored as int32, but the array holds float32", "values"),
        ("", "float99", r"unknown dtype 'float99'", ""),
        (
            "y/z",
            "float8_e4m3fn",
            r"y_z~[0-9a-f]{16}/values: dtype 'float8_e4m3fn' is stored as uint8, but .* int64",
            "values",
        ),
    ],
)
def test_dtype_attribute_must_be_known_and_match_the_storage(out, leaf, dtype, needle, at):
    col = _col(out, leaf)
    _set_attr(out, col, dtype=dtype)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle) as ei:  # version 2: at open
        spillmerge.open(str(out))
    assert ei.value.path == str(out / col / at).rstrip("/")


@pytest.mark.parametrize(
    "leaf, claims, needle",
    [
        ("", ["x"], r"columns/_value: column '_value' holds leaf \['x'\]"),
        ("x", [], r"columns/x: column 'x' holds leaf \[\]"),
        ("x", ["y", "z"], r"columns/(x|y_z~[0-9a-f]{16})\b"),  # another leaf, of another dtype
    ],
)
def test_column_of_another_leaf_is_refused(out, leaf, claims, needle):
    """Version 1 refused an array whose header named another file; in version 2 a column's header
    names its leaf, and a group holding another column's leaf (or the plain values' group holding
    a dict leaf, or a dict leaf's group the plain values) is refused, by open and by verify."""
    _set_attr(out, _col(out, leaf), leaf=claims)
    with pytest.raises(spillmerge.CorruptSpillError, match=needle):
        spillmerge.open(str(out))
    assert not spillmerge.verify(str(out)).ok


def test_missing_chunk_raises_and_never_reads_as_zeros(backend_no_s3):
    backend = backend_no_s3
    root, out = backend.url("spill"), backend.url("out.zarr")
    with spillmerge.SpillWriter(root, rank=0, world_size=1, storage_options=backend.options) as w:
        _write(w)
    spillmerge.merge(root, out, storage_options=backend.options, chunk_bytes=8)
    fs, base = fsspec.core.url_to_fs(out, **backend.options)
    yz = next(k for k in fs.ls(f"{base}/columns", detail=False) if k.rsplit("/", 1)[1].startswith("y_z~"))
    yz = "columns/" + yz.rsplit("/", 1)[1]
    for key in ("columns/_value/values/c/1/0", f"{yz}/values/c/2/0"):
        fs.rm(f"{base}/{key}")
    res = spillmerge.open(out, storage_options=backend.options)
    a = res["a.mp4"]
    assert a[0].tolist() == [0.0, 0.0] and a[2].tolist() == [2.0, 2.0]  # the chunks that are there
    for read in (lambda: np.asarray(a), lambda: a[1], lambda: a.to_torch(slice(0, 2)), lambda: a.to_list()):
        with pytest.raises(
            spillmerge.CorruptSpillError, match=r"chunk 1, 0 of columns/_value/values is missing"
        ) as ei:
            read()
        assert ei.value.path == f"{out}/columns/_value/values/c/1/0"
    with pytest.raises(spillmerge.CorruptSpillError, match=rf"{yz}/values/c/2/0: chunk 2, 0 .* is missing"):
        res["b.mp4"]["y"]["z"].numpy()
    assert res["b.mp4"]["y"]["z"][1].tolist() == [1]
    assert res.frames("a.mp4").tolist() == [0, 1, 2] and res.frame_ranks("a.mp4").tolist() == [0, 0, 0]
    # Offsets, valid and the index are read whole at open (valid is checked against the files'
    # layouts): an absent chunk of one refuses the open, so nothing of x is guessed.
    for key in ("index/frame_rank/c/0", "columns/x/offsets/c/0", "columns/x/valid/c/0", "index/file_layout/c/0"):
        kept = fs.cat_file(f"{base}/{key}")
        fs.rm(f"{base}/{key}")
        with pytest.raises(spillmerge.CorruptSpillError, match=rf"{key}: chunk 0 of {key.rsplit('/c/', 1)[0]}") as ei:
            spillmerge.open(out, storage_options=backend.options)
        assert ei.value.path == f"{out}/{key}"
        fs.pipe_file(f"{base}/{key}", kept)  # back, so that the next key is the only one absent


# ------------------------------------------------------------------------------ CLI: verify


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda o: _set_index(o, "frame_offsets", [0, 100, 6]), "index/frame_offsets: decreases from 100 to 6"),
        (lambda o: _set_index(o, "frame_idx", [0, 2, 1, 10, 11, 12]), "index/frame_idx: frame indices are not"),
        (
            lambda o: _set_attr(o, "columns/_value", dtype="bfloat16"),
            "columns/_value/values: dtype 'bfloat16' is stored as uint16",
        ),
        (lambda o: _replace_index(o, "frame_copies", [1, 1]), "index/frame_copies: 2 rows"),
        (lambda o: _set_index(o, "frame_copies", [1, 1, 0, 1, 1, 1]), "index/frame_copies: row 2 holds 0 < 1"),
        (
            lambda o: shutil.rmtree(o / "columns" / "_value") or _consolidate(o),
            "zarr.json: file_layouts[0] names '_value', which is not a column",
        ),
        (
            # without offsets, a fixed column must hold every row
            lambda o: shutil.rmtree(o / "columns" / "x" / "offsets") or _consolidate(o),
            "columns/x/values: 3 rows, but index/frame_idx has 6",
        ),
        (lambda o: _replace_index(o, "file_layout", [0]), "index/file_layout: 1 entries for 2 files"),
        (lambda o: _set_index(o, "file_layout", [0, 5]), "index/file_layout: entry 1 ('b.mp4') is 5"),
        (lambda o: _replace_index(o, "filenames", ["b.mp4", "a.mp4"]), "index/filenames: not sorted"),
    ],
    ids=[
        "offsets",
        "frame_idx",
        "dtype",
        "copies-length",
        "copies-value",
        "node",
        "column-offsets",
        "layout-length",
        "layout-value",
        "filenames-order",
    ],
)
def test_verify_checks_the_index_invariants(out, damage, needle):
    damage(out)
    p = run("verify", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"CORRUPT {out}/{needle}" in p.stdout, p.stdout


def test_verify_lists_every_broken_index_invariant_of_one_block(out):
    _set_index(out, "frame_idx", [0, -1, 2, 10, 11, 12])
    _set_index(out, "frame_copies", [1, 1, 0, 1, 1, 1])
    problems = spillmerge.verify(str(out)).problems
    for needle in (
        "index/frame_idx: row 1 (file 0, 'a.mp4') holds frame index -1 < 0",
        "index/frame_idx: frame indices are not strictly ascending",
        "index/frame_copies: row 2 holds 0 < 1",
    ):
        assert any(needle in p for p in problems), (needle, problems)


def test_verify_lists_every_missing_chunk(out):
    yz = _col(out, "y/z")
    gone = [
        "columns/_value/values/c/1/0",
        f"{yz}/values/c/2/0",
        "columns/x/offsets/c/0",
        "columns/x/valid/c/0",
        "index/frame_rank/c/0",
        "index/frame_idx/c/0",
    ]
    for key in gone:
        (out / key).unlink()
    p = run("verify", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    for key in gone:
        assert f"CORRUPT {out}/{key}: chunk" in p.stdout and "is missing" in p.stdout, p.stdout
    assert f"{len(gone)} problem(s)" in p.stdout  # frame_idx unreadable: no invariant echoes it


def test_inspect_of_a_damaged_output_is_a_one_line_error(out):
    _set_index(out, "frame_offsets", [0, 100, 6])
    p = run("inspect", str(out))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "index/frame_offsets: decreases" in p.stderr


def test_a_whole_array_read_ends_at_its_first_absent_chunk(tmp_path):
    """An array whose metadata declares 2**48 rows, of which one chunk exists, is read whole chunk
    by chunk: the first absent chunk ends the read, nothing is allocated from the declared shape."""
    from spillmerge._format.invariants import read_array
    from spillmerge._read.outputstore import NoFillStore
    from spillmerge._storage import Storage

    zarr.create_array(store=str(tmp_path / "a"), shape=(1 << 48,), chunks=(1 << 16,), dtype="int64")[: 1 << 16] = 1
    st = Storage(str(tmp_path))
    arr = zarr.open_array(NoFillStore(st.zarr_store(), st), path="a", mode="r")
    with pytest.raises(spillmerge.CorruptSpillError, match="chunk 1 of a is missing"):
        read_array(arr)


# ---------------------------------------------------- coverage bounded by frames, not the span

GIB = 1 << 30


def _bounded(*args: str, timeout: float = 120) -> tuple[int, str, str, int]:
    """Run the CLI with at most 4 GiB of data segment (so a regression fails fast instead of
    swapping a shared machine) and return (exit status, stdout, stderr, peak RSS in bytes)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (4 * GIB, 4 * GIB))

    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        p = subprocess.Popen([EXE, *args], stdout=o, stderr=e, preexec_fn=limit)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)  # the child's own rusage, not the test process's
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        o.seek(0), e.seek(0)
        return p.returncode, o.read().decode(), e.read().decode(), usage.ru_maxrss * 1024


def _two_frames(base: Path, hi: int, count: int = 10**10) -> tuple[Path, Path, Path]:
    """Spill root and merged store holding frames {0, hi} of clip.mp4, and a manifest expecting
    ``count`` frames of it and of a file never written."""
    root, out = base / "spill", base / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for f in (0, hi):
            w.write("clip.mp4", f, torch.full((2,), float(f)))
    spillmerge.merge(str(root), str(out))
    manifest = base / "manifest.csv"
    manifest.write_text(f"filename,n_frames\nclip.mp4,{count}\nnever.mp4,{count}\n")
    return root, out, manifest


needs_rusage = pytest.mark.skipif(
    not hasattr(os, "wait4") or not hasattr(resource, "RLIMIT_DATA"), reason="needs os.wait4 and RLIMIT_DATA"
)


@pytest.fixture(scope="module")
def baseline_rss(tmp_path_factory: pytest.TempPathFactory) -> int:
    """Peak RSS of the same inspect on frames {0, 1} of 3: imports (torch, zarr, matplotlib) included."""
    _, out, manifest = _two_frames(tmp_path_factory.mktemp("small"), 1, count=3)
    rc, stdout, stderr, rss = _bounded("inspect", str(out), "--json", "--expected", str(manifest), "--plot",
                                       str(out.parent / "p.png"))  # fmt: skip
    assert rc == 1 and json.loads(stdout)["coverage"]["missing_frames"] == 4, stderr
    return rss


@needs_rusage
@pytest.mark.parametrize("hi", [400_000_000, 5_000_000_000])
def test_inspect_costs_frames_not_the_span_of_frame_indices(tmp_path, baseline_rss, hi):
    """Frames {0, 4e8} once took 82 s and 10.9 GB (an arange over the span); {0, 5e9} a
    MemoryError traceback. Now both cost what frames {0, 1} cost, within 256 MiB."""
    pytest.importorskip("matplotlib")
    root, out, manifest = _two_frames(tmp_path, hi)
    png = tmp_path / "coverage.png"
    rc, stdout, stderr, rss = _bounded("inspect", str(out), "--json", "--expected", str(manifest), "--plot", str(png))
    assert rc == 1 and "Traceback" not in stderr, stderr  # 1: frames are missing against the manifest
    cov = json.loads(stdout)["coverage"]
    files = {f["filename"]: f for f in cov["files"]}
    assert files["clip.mp4"]["missing"] == [[1, hi - 1], [hi + 1, 10**10 - 1]]
    assert files["never.mp4"]["missing"] == [[0, 10**10 - 1]] and cov["missing_files"] == ["never.mp4"]
    assert cov["missing_frames"] == 2 * 10**10 - 2 and png.read_bytes()[:4] == b"\x89PNG"
    assert rss < baseline_rss + 256 * (1 << 20), (rss, baseline_rss)
    # The spill root, as text, without a manifest: gaps below the highest frame.
    rc, stdout, stderr, rss = _bounded("inspect", str(root))
    assert rc == 0 and "Traceback" not in stderr, stderr
    assert f"'clip.mp4': missing 1..{hi - 1}\n" in stdout and f"2 frames present, {hi - 1} missing" in stdout
    assert rss < baseline_rss + 256 * (1 << 20), (rss, baseline_rss)


def test_coverage_at_the_edge_of_int64(tmp_path):
    """Frame 2**63 - 1 and a manifest of 2**63 frames: runs in int64 without wrapping."""
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for f in (0, 2**63 - 1):
            w.write("clip.mp4", f, torch.zeros(1))
    spillmerge.merge(str(root), str(tmp_path / "out"))
    for path in (root, tmp_path / "out"):
        for expected in (None, {"clip.mp4": 2**63}):
            cov = coverage(str(path), expected=expected)
            j = cov.to_json()
            assert j["files"][0]["missing"] == [[1, 2**63 - 2]] and j["missing_frames"] == 2**63 - 2
            assert first_missing(cov.files[0].frames, cov.files[0].span, 3) == [1, 2, 3]  # a capped list
    m = tmp_path / "m.csv"
    m.write_text(f"filename,n_frames\nclip.mp4,{2**63 + 1}\n")
    with pytest.raises(spillmerge.ConfigError, match=r"line 2: n_frames '9223372036854775809' .* \[0, 2\*\*63\]"):
        read_manifest(str(m))
