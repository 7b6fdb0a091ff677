"""Node-local spill roots: real gloo ranks whose roots only some ranks can see. The merging rank
gets the other shards over torch.distributed, one sender per simulated host, and the output is
bit-exact against the shared-root run of the same inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _mp_scenarios import kinds_keys
from _nodelocal_workers import WORLD, killed_sender, stalled_sender, worker
from _procs import free_port, join_all, rank_context, ranks_fixture

import spillmerge

SPAWN_TIMEOUT = 240.0


ranks = ranks_fixture(worker, WORLD, "nodelocal", SPAWN_TIMEOUT)


def test_two_hosts_one_sender_each_bit_exact_against_shared_root(ranks):
    base, results = ranks
    r0 = results[0]["two_hosts"]
    assert r0["vs_shared"] == [] and r0["vs_expected"] == []
    rep = r0["report"]
    # Host A (ranks 0, 1) is the merging rank's own disk; host B's shards came from rank 2 alone.
    assert rep["senders"] == {"2": [2, 3]}
    assert sorted(rep["transferred"]) == ["2", "3"] and all(n > 0 for n in rep["transferred"].values())
    assert rep["ranks"] == [0, 1, 2, 3] and rep["phases"]["transfer"] > 0
    assert r0["shared_report"]["transferred"] == {}  # transport="storage": nothing moved
    for r in range(1, WORLD):
        assert results[r]["two_hosts"]["report"] is None
    # Rank 2 and 3's shards now also live on disk A, byte for byte, with their commit records.
    for r in (2, 3):
        on_b = sorted(
            p.relative_to(base / "two" / "hostB")
            for p in (base / "two" / "hostB" / f"rank-0000{r}").rglob("*")
            if p.is_file()
        )
        for rel in on_b:
            assert (base / "two" / "hostA" / rel).read_bytes() == (base / "two" / "hostB" / rel).read_bytes(), rel
    assert not [p for pattern in ("*.tmp-*", "*.part-*") for p in (base / "two" / "hostA").rglob(pattern)]
    assert spillmerge.verify(str(base / "two" / "out")).ok


def test_private_disks_move_every_committed_segment(ranks):
    _, results = ranks
    r0 = results[0]["private"]
    assert r0["report"]["senders"] == {"1": [1], "2": [2], "3": [3]}
    assert r0["report"]["segments"] == WORLD + 1  # rank 1's earlier session came along
    assert r0["frames"] == {
        "r0.mp4": [0, 1, 2],
        "r1.mp4": [0, 1, 2, 3, 100, 101, 102, 103],
        "r2.mp4": [0, 1, 2, 3, 4],
        "r3.mp4": [0, 1, 2, 3, 4, 5],
    }


def test_forced_network_transport_moves_nothing_when_everything_is_visible(ranks):
    _, results = ranks
    rep = results[0]["forced"]["report"]
    assert rep["n_frames"] == WORLD and rep["transferred"] == {} and rep["senders"] == {}


def test_a_merge_called_on_dst_only_does_not_wait_for_the_others(ranks):
    _, results = ranks
    r0 = results[0]["dst_only"]
    assert r0["report"]["n_frames"] == WORLD and r0["report"]["ranks"] == [0, 1, 2, 3]
    assert r0["merge_seconds"] < 20  # their commit records are on storage: no 90 s timeout


def test_every_value_kind_moves_between_private_disks_bit_exact(ranks):
    _, results = ranks
    r0 = results[0]["kinds"]
    n_keys = len(kinds_keys())
    assert r0["problems"] == [], "\n".join(r0["problems"])
    assert r0["frames_checked"] == n_keys and r0["leaves_checked"] == 7 * n_keys
    rep = r0["report"]
    assert rep["n_frames"] == n_keys and rep["ranks"] == [0, 1, 2, 3]
    assert rep["senders"] == {"1": [1], "2": [2], "3": [3]}
    assert sorted(rep["transferred"]) == ["1", "2", "3"] and all(n > 0 for n in rep["transferred"].values())
    assert sum(results[r]["kinds"]["n_mine"] for r in range(WORLD)) == n_keys
    for r in range(1, WORLD):
        assert results[r]["kinds"]["report"] is None


def test_a_piece_corrupted_in_flight_is_refused_by_name(ranks):
    base, results = ranks
    err = results[0]["corrupt"]["error"]
    assert err["type"] == "CorruptSpillError" and err["is_spillmerge_error"], err
    assert "received from rank 2" in err["msg"] and "rank-00002/" in err["msg"]
    assert results[0]["corrupt"]["rank"] == 2
    # The sender hears it too; the other ranks were not part of the transfer.
    assert results[2]["corrupt"]["error"]["type"] == "CorruptSpillError"
    assert results[1]["corrupt"]["error"] is None and results[3]["corrupt"]["error"] is None
    # Nothing of rank 2 looks committed on the merging rank's disk, and no output was written.
    assert not list((base / "corrupt" / "hostA").glob("rank-00002/*/commit.json"))
    assert not (base / "corrupt" / "out" / "spillmerge-complete.json").exists()


@pytest.mark.parametrize("late", [False, True], ids=["receiving", "posting-after-death"])
def test_a_sender_killed_mid_transfer_is_named_within_the_timeout(tmp_path, late):
    ctx = rank_context()
    port, result = free_port(), str(tmp_path / "res")
    procs = [ctx.Process(target=killed_sender, args=(r, 2, port, str(tmp_path), result, late)) for r in range(2)]
    for p in procs:
        p.start()
    join_all(procs, timeout=150)
    killed_at = float(Path(f"{result}.killed").read_text())
    r0 = json.loads(Path(f"{result}.0").read_text())
    assert r0["type"] == "RankFailedError" and r0["failures"] and list(r0["failures"]) == ["1"], r0
    assert "rank 1" in r0["msg"]
    assert r0["at"] - killed_at < 30  # the transfer timeout is 20 s; a dead peer is usually seen at once
    # Nothing of rank 1 looks committed on rank 0's disk, and rank 1's own commit is intact.
    assert not list((tmp_path / "disk0").glob("rank-00001/*/commit.json"))
    assert len(list((tmp_path / "disk1").glob("rank-00001/*/commit.json"))) == 1
    assert not (tmp_path / "out" / "spillmerge-complete.json").exists()


def test_network_transport_without_a_process_group_is_refused_and_loses_nothing(tmp_path):
    with spillmerge.SpillWriter(str(tmp_path / "s"), rank=0, world_size=1) as w:
        w.write("a.mp4", 0, torch.ones(4))
    with pytest.raises(spillmerge.ConfigError, match="transport='gloo' needs torch.distributed") as info:
        w.merge(str(tmp_path / "out"), transport="gloo")
    assert info.value.key == "transport"
    with pytest.raises(spillmerge.SpillValueError, match="transport must be one of"):
        w.merge(str(tmp_path / "out"), transport="infiniband")
    assert w.merge(str(tmp_path / "out")).n_frames == 1  # the committed segment is untouched


def test_a_transfer_that_timed_out_leaves_later_collectives_working(tmp_path):
    ctx = rank_context()
    port, result = free_port(), str(tmp_path / "res")
    procs = [ctx.Process(target=stalled_sender, args=(r, 2, port, str(tmp_path), result)) for r in range(2)]
    for p in procs:
        p.start()
    join_all(procs, timeout=150)
    for r in range(2):
        res = json.loads(Path(f"{result}.{r}").read_text())
        assert res["merge_error"] is not None and res["merge_error"]["type"] == "RankFailedError", res
        assert res.get("gather_error") is None, res
        assert res["gathered"] == [{"rank": 0}, {"rank": 1}], res
    assert not (tmp_path / "out" / "spillmerge-complete.json").exists()
