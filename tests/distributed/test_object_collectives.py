"""Issue 23: torch's own object-collective test list (``create_collectives_object_test_list``,
read from the installed torch, never copied into the tree), sent with torch's pattern (rank r
sends item r % 5, and shifted by one so that item 4 is sent too) through ``spillmerge.all_gather``
/ ``gather`` at 4 gloo ranks, comes back equal in type and content to what ``all_gather_object``
/ ``gather_object`` return in the same run. One process group runs every round."""

from __future__ import annotations

from _collective_workers import WORLD, worker
from _procs import ranks_fixture

ranks = ranks_fixture(worker, WORLD, "collectives", timeout=400.0)


def test_all_gather_returns_what_all_gather_object_returns(ranks):
    _, results = ranks
    for r in range(WORLD):
        for name in ("ag0", "ag1"):
            res = results[r][name]
            assert res["got_store"] and res["diffs"] == [], (r, name, res["diffs"])
    assert sorted(set(results[0]["ag0"]["items"]) | set(results[0]["ag1"]["items"])) == [0, 1, 2, 3, 4]


def test_gather_returns_on_dst_what_gather_object_returns(ranks):
    _, results = ranks
    assert results[0]["g0"]["got_store"] and results[0]["g0"]["diffs"] == []
    assert not any(results[r]["g0"]["got_store"] for r in range(1, WORLD))


def test_the_whole_list_as_one_value_and_each_item_as_a_frame_of_one_file(ranks):
    _, results = ranks
    for r in range(WORLD):
        assert results[r]["whole"]["diffs"] == [], (r, results[r]["whole"]["diffs"])
