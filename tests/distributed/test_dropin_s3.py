"""The drop-ins with their root on an object store (a moto S3 server on 127.0.0.1): what torch's
collectives return, whichever way the objects travel, and nothing left in the bucket."""

from __future__ import annotations

import json

import pytest
from _dropin_workers import s3_worker
from _procs import spawn_ranks

pytestmark = [pytest.mark.s3, pytest.mark.multiprocess]


def test_dropins_through_an_object_store_return_what_torch_returns_and_leave_nothing(s3, tmp_path):
    import s3fs
    from _s3 import storage_options

    (tmp_path / "s3.json").write_text(json.dumps({"endpoint": s3.endpoint}))
    results = spawn_ranks(s3_worker, 2, tmp_path, timeout=300.0)
    assert [results[r]["diffs"] for r in range(2)] == [[], []]
    fs = s3fs.S3FileSystem(**storage_options(s3.endpoint))
    assert fs.find("test/calls") == []
