"""The merge round across 3 real gloo ranks when one goes wrong: a transfer that fails on the
merging rank, a sender that cannot read its shard or a rank whose writer is refused is told to
every waiting rank at once; a rank passing another output or ``dst`` is named on every rank
instead of returning what it did not ask for; a writer's second round over gloo merges; a call
after each failure works."""

from __future__ import annotations

import pytest
from _procs import ranks_fixture
from _round_workers import SHORT, TIMEOUT, WORLD, worker

ranks = ranks_fixture(worker, WORLD, "round_failures", timeout=240.0)


def _all(tag: str) -> dict[str, list[int]]:
    return {f"{tag}-r{r}.mp4": [0, 1, 2, 3] for r in range(WORLD)}


def test_a_transfer_failing_on_dst_is_told_at_once_to_every_waiting_rank(ranks):
    _, results = ranks
    res = {r: results[r]["transfer_fails_on_dst"] for r in range(WORLD)}
    assert res[0]["failed"]["error"]["type"] == "CorruptSpillError", res[0]
    assert res[2]["failed"]["error"]["type"] == "CorruptSpillError", res[2]  # the sender, told by the ack
    told = res[1]["failed"]  # its shards had moved: it waits for the output
    assert told["error"] is not None and told["error"]["type"] == "MergeFailedError", told
    assert told["rank_attr"] == 0 and "failed on rank 0" in told["error"]["msg"], told
    assert "CorruptSpillError" in told["error"]["msg"] and told["seconds"] < TIMEOUT / 2, told
    for r in range(WORLD):
        assert res[r]["after"]["error"] is None and res[r]["after"]["got"] == _all("corrupt_again"), res[r]


def test_a_sender_that_cannot_read_its_shard_is_named_at_once_on_every_rank(ranks):
    _, results = ranks
    res = {r: results[r]["sender_cannot_read"] for r in range(WORLD)}
    assert res[2]["failed"]["error"] is not None and "disk went away" in res[2]["failed"]["error"]["msg"], res[2]
    dst = res[0]["failed"]
    assert dst["error"] is not None and dst["error"]["type"] == "RankFailedError", dst
    assert list(dst["error"]["failures"]) == ["2"] and "rank 2 could not read" in dst["error"]["msg"], dst
    told = res[1]["failed"]
    assert told["error"] is not None and told["error"]["type"] == "MergeFailedError" and told["rank_attr"] == 0, told
    assert "rank 2 could not read" in told["error"]["msg"], told
    for r in range(WORLD):
        assert res[r]["failed"]["seconds"] < TIMEOUT / 2, (r, res[r]["failed"])
        assert res[r]["after"]["error"] is None and res[r]["after"]["got"] == _all("unread_again"), res[r]


def test_a_rank_whose_writer_is_refused_is_named_at_once_and_the_next_call_merges(ranks):
    _, results = ranks
    res = {r: results[r]["writer_refused_under_a_launcher_run_id"] for r in range(WORLD)}
    assert res[1]["refused"]["error"]["type"] == "SpillValueError", res[1]
    for r in (0, 2):
        err = res[r]["refused"]["error"]
        assert err is not None and err["type"] == "RankFailedError" and err["failures"] == {"1": err["failures"]["1"]}
        assert "rank 1" in err["msg"] and "chunk_bytes" in err["msg"], (r, err)
        assert res[r]["refused"]["seconds"] < TIMEOUT / 2, (r, res[r]["refused"])
    for r in range(WORLD):
        assert res[r]["after"]["error"] is None and res[r]["after"]["got"] == _all("refused_again"), (r, res[r])


@pytest.mark.parametrize(("scenario", "culprit", "what"), [("other_out", 1, "out"), ("other_dst", 2, "dst")])
def test_a_rank_passing_other_arguments_is_named_on_every_rank(ranks, scenario, culprit, what):
    _, results = ranks
    for r in range(WORLD):
        res = results[r][scenario]
        err = res["result"]["error"]
        assert err is not None and err["is_spillmerge_error"], (r, res["result"])
        assert f"rank {culprit}" in err["msg"] and what in err["msg"], (r, err)
        assert res["result"]["seconds"] < TIMEOUT / 2, (r, res["result"])
        tag = "out_args_again" if scenario == "other_out" else "dst_args_again"
        assert res["after"]["error"] is None and res["after"]["got"] == _all(tag), (r, res["after"])


def test_a_writers_second_round_over_gloo_merges_like_the_first(ranks):
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["second_round_over_gloo"]
        assert res["first"]["error"] is None and res["second"]["error"] is None, (r, res)
    assert results[0]["second_round_over_gloo"]["second"]["frames"] == _all("again")


def test_dropin_a_rank_passing_another_dst_is_named_on_every_rank(ranks):
    _, results = ranks
    for r in range(WORLD):
        err = results[r]["dropin_other_dst"]["error"]
        assert err is not None and "rank 2" in err["msg"] and "dst" in err["msg"], (r, err)


def test_dropin_roots_that_differ_are_named_at_once_and_nothing_is_left(ranks):
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["dropin_other_root"]
        for step in ("records", "general"):
            err = res[step]["error"]
            assert err is not None and "root" in err["msg"] and res[step]["seconds"] < SHORT, (r, step, res[step])
        assert res["left"] == [], (r, res["left"])


def test_dropin_a_rank_failing_to_read_back_is_named_on_every_rank(ranks):
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["dropin_read_fails"]
        for step in ("records", "general"):
            err = res[step]["error"]
            assert err is not None and err["is_spillmerge_error"], (r, step, res[step])
            assert "rank 1" in err["msg"] and "disk read back garbage" in err["msg"], (r, step, err)
            assert res[step]["seconds"] < TIMEOUT / 2, (r, step, res[step])
        assert res["after"]["error"] is None and res["after"]["exact"], (r, res["after"])
        assert res["left"] == [], (r, res["left"])


def test_a_second_round_into_the_same_output_waits_for_its_own_merge(ranks):
    _, results = ranks
    res = {r: results[r]["second_round_into_the_same_output"] for r in range(WORLD)}
    for r in range(WORLD):
        assert res[r]["first"]["error"] is None and res[r]["second"]["error"] is None, (r, res[r])
    for r in range(1, WORLD):  # not on the first round's marker, before dst even began the second
        assert res[r]["returned"] > res[0]["started"], (r, res[r], res[0])
