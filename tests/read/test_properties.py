"""Property tests: filename encoding round-trips and can never escape its root."""

from __future__ import annotations

import os
import posixpath

import pytest
import torch
from _helpers import is_safe_node_name
from hypothesis import given
from hypothesis import strategies as st

import spillmerge
from spillmerge._format import common as F
from spillmerge._storage import Storage

names = st.text(min_size=0, max_size=120)
hostile = st.sampled_from(
    [
        "..",
        ".",
        "../..",
        "/etc/passwd",
        "a/../../b",
        "__zarr",
        ".zattrs",
        "zarr.json",
        "c",
        "~",
        "%2F",
        "A",
        "a",
        "x" * 300,
        "\x00",
        "con",
        "abc\n",
    ]
)


@given(st.lists(st.one_of(names, hostile), min_size=1, max_size=30, unique=True))
def test_node_names_are_safe_unique_and_contained(filenames):
    mapping = F.node_names(filenames)
    assert set(mapping) == set(filenames)
    keys = list(mapping.values())
    assert len({k.lower() for k in keys}) == len(keys)  # unique even on case-insensitive disks
    for k in keys:
        assert is_safe_node_name(k), k
        assert "/" not in k and k not in (".", "..") and not k.startswith((".", "__"))
        assert len(k.encode()) <= 100
    storage = Storage("/tmp/spillmerge-root")
    for k in keys:
        p = storage.path(f"files/{k}")
        assert posixpath.commonpath([p, "/tmp/spillmerge-root"]) == "/tmp/spillmerge-root"


def test_a_key_ending_in_a_newline_gets_a_hashed_node_name_and_reads_back(tmp_path):
    with spillmerge.SpillWriter(str(tmp_path / "spill"), 0, 1, fsync=False) as w:
        w.write("img.jpg", 0, {"score\n": 0.5, "label": "cat"})
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out"), progress=False, fsync=False)
    names = os.listdir(tmp_path / "out" / "columns")
    assert all(is_safe_node_name(n) for n in names) and "label" in names, names
    assert spillmerge.open(str(tmp_path / "out")).value("img.jpg", 0) == {"score\n": 0.5, "label": "cat"}


@given(st.text(max_size=60))
def test_storage_paths_never_escape(rel):
    storage = Storage("/tmp/spillmerge-root")
    try:
        p = storage.path(rel)
    except spillmerge.UnsafePathError:
        return
    assert p == "/tmp/spillmerge-root" or p.startswith("/tmp/spillmerge-root/")
    assert ".." not in p.split("/")


@given(st.lists(st.one_of(names, hostile), min_size=1, max_size=6, unique=True))
def test_filenames_round_trip_through_spill_and_merge(tmp_path_factory, filenames):
    base = tmp_path_factory.mktemp("rt")
    root, out = str(base / "s"), str(base / "o")
    with spillmerge.SpillWriter(root, chunk_bytes=4096) as w:
        for i, name in enumerate(filenames):
            w.write(name, i, torch.tensor([i], dtype=torch.int32))
    spillmerge.merge(root, out)
    res = spillmerge.open(out)
    assert res.filenames == sorted(filenames)
    for i, name in enumerate(filenames):
        assert res.frames(name).tolist() == [i]
        assert res[name][0, 0] == i
    assert sorted(os.listdir(base)) == ["o", "s"]  # nothing created beside them


@pytest.mark.parametrize("bad", ["\ud800", "a\udcff"])
def test_unencodable_filenames_are_refused(tmp_path, bad):
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        with pytest.raises(spillmerge.SpillValueError, match="not valid Unicode"):
            w.write(bad, 0, 1.0)
