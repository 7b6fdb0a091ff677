"""Storage URLs as users give them (a real S3 server, moto, where it matters): nothing lands
outside the root, and a URL that would is refused by name."""

from __future__ import annotations

import pytest
import torch
from _s3 import storage_options

import spillmerge
from spillmerge import UnsafePathError
from spillmerge._storage import Storage

pytest.importorskip("s3fs")


def test_an_s3_root_with_a_version_query_is_refused_by_name():
    for url in ("s3://test/sp?versionId=1", "s3://test/a/?versionId=2/b"):
        with pytest.raises(UnsafePathError, match="versionId"):
            Storage(url, {"key": "k", "secret": "s"})
    assert Storage("s3://test/sp?x=1", {"key": "k", "secret": "s"}).path("a") == "test/sp?x=1/a"


def test_a_version_query_never_overwrites_the_object_it_names(s3):
    so = storage_options(s3.endpoint)
    fs = Storage("s3://test", so).fs
    fs.pipe("test/sp", b"precious")
    with pytest.raises(UnsafePathError, match="versionId"):
        with spillmerge.SpillWriter("s3://test/sp?versionId=1", rank=0, world_size=1, storage_options=so) as w:
            w.write("a", 0, torch.ones(3))
    root = "s3://test/spill"
    with spillmerge.SpillWriter(root, rank=0, world_size=1, storage_options=so) as w:
        w.write("a", 0, torch.ones(3))
    with pytest.raises(UnsafePathError, match="versionId"):
        spillmerge.merge(root, "s3://test/sp?versionId=1", storage_options=so, progress=False)
    fs.invalidate_cache()
    assert fs.cat("test/sp") == b"precious"
    assert not [p for p in fs.find("test/") if p.startswith("test/sp?")]
