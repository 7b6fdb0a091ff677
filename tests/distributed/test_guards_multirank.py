"""Each of the collective merge's two failure mechanisms alone names a failed rank (two spawned
gloo ranks; rank 1 raises inside its writer). See tests/_guard_workers.py."""

from __future__ import annotations

import os

from _guard_workers import WORLD, worker
from _procs import ranks_fixture

ranks = ranks_fixture(worker, WORLD, "guards", timeout=180.0)


def _named_failure(result: dict, run_id: str) -> dict:
    err = result["error"]
    assert err["type"] == "RankFailedError", err  # not CommitTimeout: it did not wait for the timeout
    assert err["failures"] == {"1": f"ValueError: rank 1 blew up in {run_id}"}, err
    return err


def test_failure_key_alone_names_the_rank(ranks):
    base, results = ranks
    assert results[1]["store_only"]["raised"] == "rank 1 blew up in store-only"
    err = _named_failure(results[0]["store_only"], "store-only")
    assert "failed before the merge" in err["msg"], err  # heard through the store
    # dst's root never held rank 1's failure record: storage could not have told it.
    assert sorted(os.listdir(base / "store_only" / "node-0")) == ["rank-00000"]


def test_failure_record_alone_names_the_rank(ranks):
    base, results = ranks
    assert results[1]["storage_only"]["raised"] == "rank 1 blew up in storage-only"
    err = _named_failure(results[0]["storage_only"], "storage-only")
    assert "failed while spilling to" in err["msg"], err  # read from rank 1's failed.json
    assert list((base / "storage_only" / "spill").glob("rank-00001/seg-*/failed.json"))
    assert not (base / "storage_only" / "out").exists()
