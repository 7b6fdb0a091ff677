"""Nobody waits out a timeout for a failure already known, across 3 real gloo ranks: a rank whose
part of ``merge(parallel=True)`` fails before it opens is named by ``dst`` at once, and a rank
whose ``SpillWriter`` is refused under a launcher's run id is named at once and keeps counting
its writer sessions with the others (its next round pairs with theirs)."""

from __future__ import annotations

from _procs import ranks_fixture
from _round_waits_workers import WORLD, worker
from _round_workers import TIMEOUT

ranks = ranks_fixture(worker, WORLD, "round_waits", timeout=180.0)


def test_a_part_failing_before_it_opens_is_named_at_once_and_the_next_call_merges(ranks):
    _, results = ranks
    res = {r: results[r]["part_fails_before_it_opens"] for r in range(WORLD)}
    assert res[1]["failed"]["error"]["type"] == "SpillValueError" and "threads" in res[1]["failed"]["error"]["msg"]
    dst = res[0]["failed"]
    assert dst["error"] is not None and dst["error"]["type"] == "PartFailedError", dst
    assert list(dst["error"]["failures"]) == ["1"] and "part 1/3 (rank 1)" in dst["error"]["msg"], dst
    assert "threads" in dst["error"]["msg"], dst
    told = res[2]["failed"]
    assert told["error"] is not None and told["error"]["type"] == "MergeFailedError" and told["rank_attr"] == 0, told
    assert "part 1/3 (rank 1)" in told["error"]["msg"], told
    for r in range(WORLD):
        assert res[r]["failed"]["seconds"] < TIMEOUT / 2, (r, res[r]["failed"])
        assert res[r]["after"]["error"] is None, (r, res[r]["after"])
    assert res[0]["after"]["got"] == {f"par-r{r}.mp4": [0, 1, 2, 3] for r in range(WORLD)}


def test_a_direct_writer_refused_under_a_launcher_run_id_is_named_at_once_and_the_next_round_merges(ranks):
    _, results = ranks
    res = {r: results[r]["direct_writer_refused"] for r in range(WORLD)}
    assert res[1]["refused"]["error"]["type"] == "SpillValueError", res[1]
    for r in (0, 2):
        err = res[r]["refused"]["error"]
        assert err is not None and err["type"] == "RankFailedError" and list(err["failures"]) == ["1"], (r, err)
        assert "rank 1" in err["msg"] and "on_duplicate" in err["msg"], (r, err)
        assert res[r]["refused"]["seconds"] < TIMEOUT / 2, (r, res[r]["refused"])
    for r in range(WORLD):
        assert res[r]["after"]["error"] is None, (r, res[r]["after"])
    assert res[0]["after"]["got"] == {f"two-r{r}.mp4": [0, 1, 2, 3] for r in range(WORLD)}
