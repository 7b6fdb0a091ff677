"""Object stores end to end: real rank processes spilling to S3, merges in every direction,
and a fault-injecting proxy in front of the S3 server."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zarr
from _helpers import zarr_filenames
from _procs import rank_context
from _s3 import FaultyProxy, storage_options

import spillmerge

pytestmark = pytest.mark.s3
CTX = rank_context()


def expected(rank: int, frame: int) -> torch.Tensor:
    return torch.arange(3 * 32 * 32, dtype=torch.float32).reshape(3, 32, 32) * (frame + 1) + rank


def s3_rank(root: str, opts: dict, rank: int, world: int) -> None:
    with spillmerge.SpillWriter(root, rank, world, storage_options=opts, chunk_bytes=64 << 10) as w:
        for f in range(rank, 30, world):
            w.write(f"vid{f % 3}.mp4", f, {"x": expected(rank, f), "rank": rank})


def env_rank(root: str, opts: dict, rank: int, world: int) -> None:
    """A separate process that learns its rank from the environment, as under SLURM."""
    import os

    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    with spillmerge.SpillWriter(root, storage_options=opts, chunk_bytes=64 << 10) as w:
        assert (w.rank, w.world_size) == (rank, world)
        for f in range(rank, 30, world):
            w.write(f"vid{f % 3}.mp4", f, {"x": expected(rank, f), "rank": rank})


def _check(res) -> None:
    assert res.filenames == ["vid0.mp4", "vid1.mp4", "vid2.mp4"]
    for name in res.filenames:
        frames = res.frames(name).tolist()
        assert frames == [f for f in range(30) if f % 3 == int(name[3])]
        x, ranks = res[name]["x"].to_torch(), res[name]["rank"][:]
        for row, f in enumerate(frames):
            assert torch.equal(x[row], expected(int(ranks[row]), f)) and ranks[row] == f % 3


def test_rank_processes_spill_to_s3_and_merge_every_direction(s3, tmp_path):
    opts = storage_options(s3.endpoint)
    procs = [CTX.Process(target=env_rank, args=("s3://test/spill", opts, r, 3)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    # s3 -> s3
    rep = spillmerge.merge("s3://test/spill", "s3://test/out.zarr", storage_options=opts)
    assert rep.n_frames == 30 and rep.ranks == [0, 1, 2]
    _check(spillmerge.open("s3://test/out.zarr", storage_options=opts))
    g = zarr.open_group("s3://test/out.zarr", mode="r", storage_options=opts)  # plain zarr + s3fs
    assert sorted(zarr_filenames(g)) == ["vid0.mp4", "vid1.mp4", "vid2.mp4"]
    # s3 -> local
    spillmerge.merge("s3://test/spill", str(tmp_path / "local.zarr"), storage_options=opts)
    _check(spillmerge.open(str(tmp_path / "local.zarr")))
    # local -> s3
    for r in range(3):
        s3_rank(str(tmp_path / "spill"), {}, r, 3)
    spillmerge.merge(str(tmp_path / "spill"), "s3://test/from-local.zarr", out_storage_options=opts)
    _check(spillmerge.open("s3://test/from-local.zarr", storage_options=opts))
    # Opening uses consolidated metadata: the columns' metadata comes with the root's zarr.json, no
    # Zarr v2 names are probed, and one row of a column is one GET. Requests are counted through a
    # loopback proxy that forwards every request (no faults).
    counter = FaultyProxy(s3.endpoint, rate=0.0)
    try:
        res = spillmerge.open("s3://test/from-local.zarr", storage_options=storage_options(counter.endpoint))
        opened = list(counter.forwarded)
        assert not [r for r in opened if "/columns/" in r or ".zgroup" in r or ".zmetadata" in r], opened
        assert len(opened) <= 20, opened  # the completion marker, the root, the index's first chunks
        res["vid1.mp4"]["x"][0]
        assert [r.split("/")[0] for r in counter.forwarded[len(opened) :]] == ["GET "], counter.forwarded
    finally:
        counter.stop()


def test_transient_faults_are_retried_and_total_failure_is_a_clear_error(s3, tmp_path, monkeypatch):
    # One request in ten fails: ~20 of the ~165 fail (both kinds). botocore retries each after a
    # random backoff, up to a second for a SlowDown (its throttling scale): the same retries here
    # wait a twentieth of it, which is what its other errors wait, so the test spends seconds
    # retrying rather than sleeping. A higher rate buys time, not coverage.
    from botocore.retries.standard import ExponentialBackoff

    real_delay = ExponentialBackoff.delay_amount
    delays: list[float] = []

    def short_delay(self, context):
        delays.append(real_delay(self, context) / 20)
        return delays[-1]

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", short_delay)
    proxy = FaultyProxy(s3.endpoint, rate=0.1, seed=1)
    try:
        opts = storage_options(proxy.endpoint)
        root = "s3://test/flaky"
        for r in range(2):
            s3_rank(root, opts, r, 2)
        spillmerge.merge(root, "s3://test/flaky.zarr", storage_options=opts)
        assert proxy.counts["503"] > 0 and proxy.counts["dropped"] > 0
        assert delays  # the client's own retries carried the merge through the failures
        proxy.rate = 0.0
        res = spillmerge.open("s3://test/flaky.zarr", storage_options=opts)
        for name in res.filenames:
            for row, f in enumerate(res.frames(name).tolist()):
                assert torch.equal(res[name]["x"].to_torch()[row], expected(f % 2, f))
        # Every request fails: a clear error naming the object, quickly, and nothing committed lost.
        proxy.rate = 1.0
        fast = storage_options(proxy.endpoint, config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}})
        t0 = time.perf_counter()
        with pytest.raises(spillmerge.SpillStorageError) as info:
            with spillmerge.SpillWriter(root, rank=0, world_size=2, storage_options=fast) as w:
                w.write("vid0.mp4", 99, {"x": expected(0, 99), "rank": 0})
        assert time.perf_counter() - t0 < 60
        assert "s3://test/flaky/rank-00000" in str(info.value)
        proxy.rate = 0.0
        rep = spillmerge.merge(root, "s3://test/flaky2.zarr", storage_options=opts)
        assert rep.n_frames == 30  # the committed segments are intact; the failed session never started
        np.testing.assert_array_equal(
            spillmerge.open("s3://test/flaky2.zarr", storage_options=opts)["vid0.mp4"]["rank"][:], [0, 1] * 5
        )
    finally:
        proxy.stop()


def test_a_merge_from_s3_reads_nearby_rows_in_one_request(s3, tmp_path):
    """Rows dealt round-robin over ranks (a DistributedSampler's order) make runs of one row in a
    segment; the merge reads the nearby rows of a data chunk in one ranged GET, not one each
    (before: 12,677 requests to merge 20,000 small keys from moto), and reads them right."""
    proxy = FaultyProxy(s3.endpoint, rate=0.0)
    try:
        opts = storage_options(proxy.endpoint)
        root, n = "s3://test/dealt", 4000
        for r in range(2):
            keys = list(range(r, n, 2))
            with spillmerge.SpillWriter(root, rank=r, world_size=2, storage_options=opts) as w:
                w.write_batch(
                    [f"img_{i:05d}.jpg" for i in keys],
                    {"emb": torch.tensor(keys, dtype=torch.float32)[:, None].repeat(1, 8),
                     "caption": [f"caption {i}" for i in keys]},
                )  # fmt: skip
        before = proxy.counts["forwarded"]
        spillmerge.merge(root, str(tmp_path / "out.zarr"), storage_options=opts, progress=False)
        requests = proxy.counts["forwarded"] - before
        assert requests < 150, requests
        res = spillmerge.open(str(tmp_path / "out.zarr"))
        emb, caption = res.column("emb"), res.column("caption")
        assert caption.to_list() == [f"caption {i}" for i in range(n)]
        np.testing.assert_array_equal(emb[:], np.repeat(np.arange(n, dtype=np.float32)[:, None], 8, axis=1))
    finally:
        proxy.stop()


@pytest.mark.parametrize("attack", ["folder", "oversized"])
def test_a_commit_record_that_is_a_folder_or_oversized_is_refused_by_name(s3, attack):
    """Object stores read each object with one ranged GET bounded by its format's size limit: a
    prefix with objects below it in place of the commit record, or a record larger than the limit,
    is a CorruptSpillError naming the object, and the spill root is left as it was."""
    import s3fs

    opts = storage_options(s3.endpoint)
    root = f"s3://test/attack-{attack}/spill"
    with spillmerge.SpillWriter(root, 0, 1, storage_options=opts) as w:
        w.write("a.mp4", 0, {"x": torch.zeros(2)})
    fs = s3fs.S3FileSystem(**opts)
    (commit,) = [p for p in fs.find(root) if p.endswith("/commit.json")]
    if attack == "folder":
        fs.rm(commit)
        fs.pipe(f"{commit}/inside", b"{}")
    else:
        fs.pipe(commit, b" " * (64 << 20))
    before = sorted(fs.find(root))
    with pytest.raises(spillmerge.CorruptSpillError) as err:
        spillmerge.merge(root, f"s3://test/attack-{attack}/out.zarr", storage_options=opts)
    assert "commit.json" in str(err.value), err.value
    assert ("not a regular file" if attack == "folder" else "more than the") in str(err.value), err.value
    fs.invalidate_cache()
    assert sorted(fs.find(root)) == before
