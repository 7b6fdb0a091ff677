"""``spillmerge.gather_object`` / ``all_gather_object``: torch's signatures, and what torch's
object collectives return on the same inputs in the same 3-rank gloo group (type, content, dict
key order, tensors as tensors, numpy arrays as numpy arrays); back-to-back calls apart; nothing
left on storage; a failing rank named on every rank."""

from __future__ import annotations

import inspect

import pytest
from _dropin_workers import UNSHARED, WORLD, worker
from _procs import assert_timed_out, ranks_fixture

from spillmerge._dist.dropin import SHARED_WAIT

ranks = ranks_fixture(worker, WORLD, "dropin", timeout=400.0)


@pytest.mark.parametrize("name", ["gather_object", "all_gather_object"])
def test_signature_is_torchs_with_keyword_only_extras(name):
    import torch.distributed as dist

    import spillmerge

    ours = list(inspect.signature(getattr(spillmerge, name)).parameters.values())
    theirs = list(inspect.signature(getattr(dist, name)).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [(p.name, p.kind, p.default) for p in theirs]
    extras = ours[len(theirs) :]
    assert extras and all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extras)
    assert "allow_pickle" in [p.name for p in extras] and "root" in [p.name for p in extras]


def test_returns_what_torch_returns(ranks):
    _, results = ranks
    for r in range(WORLD):
        assert results[r]["same_as_torch"]["diffs"] == [], (r, results[r]["same_as_torch"]["diffs"])
        assert results[r]["torch_object_list"]["diffs"] == [], (r, results[r]["torch_object_list"]["diffs"])
        assert results[r]["pickled_types"]["diffs"] == [], (r, results[r]["pickled_types"]["diffs"])
        assert results[r]["containers_of_dicts"]["diffs"] == [], (r, results[r]["containers_of_dicts"]["diffs"])
        assert results[r]["records"]["diffs"] == [], (r, results[r]["records"]["diffs"])
        assert results[r]["odd_types"]["diffs"] == [], (r, results[r]["odd_types"]["diffs"])


def test_back_to_back_calls_apart_and_nothing_left(ranks):
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["back_to_back"]
        assert res["first"] == [["first", s] for s in range(WORLD)]
        assert res["second"] == [{"second": s} for s in range(WORLD)]
        assert res["third"] == ([["third", s] for s in range(WORLD)] if r == 0 else None)
        assert res["fourth"] == [[{"fourth": s, "ids": [s] * s}] for s in range(WORLD)]
        assert res["fifth"] == ([{"k": {"fifth": s}} for s in range(WORLD)] if r == 2 else None)
        assert res["via_env"] == [2 * s for s in range(WORLD)]
        assert res["new_in_default_root"] == [] and res["left_in_env_root"] == []
        assert res["long"] == [[{"long": s}] for s in range(WORLD)] and res["left_in_long_root"] == []


def test_a_failing_rank_is_named_on_every_rank(ranks):
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["failures"]
        assert res["unpicklable"] is not None and "rank 1" in res["unpicklable"]["msg"], (r, res["unpicklable"])
        assert res["long_error"] is not None and "rank 1" in res["long_error"]["msg"], (r, res["long_error"])
        assert "k" * 1500 in res["long_error"]["msg"], (r, res["long_error"])  # told whole, past a slot
        assert res["short_list"] is not None and "rank 0" in res["short_list"]["msg"], (r, res["short_list"])
        assert "rank 0: rank 0" not in res["short_list"]["msg"], (r, res["short_list"])  # named once
        recs = res["short_list_records"]
        assert recs is not None and "rank 0" in recs["msg"], (r, recs)
        assert res["list_off_dst"] is not None and "rank" in res["list_off_dst"]["msg"], (r, res["list_off_dst"])
        assert res["dst_and_group_dst"]["value_error"], res["dst_and_group_dst"]
        assert res["subgroup"] is not None and "group=" in res["subgroup"]["msg"], res["subgroup"]
        two = res["two_hosts"]
        assert two is not None and two["type"] == "ConfigError" and "SPILLMERGE_ROOT" in two["msg"], two
        for name in ("unshared_all", "unshared_records", "unshared_gather"):
            got = res[name]
            assert got is not None and got["type"] == "ConfigError" and "SPILLMERGE_ROOT" in got["msg"], (r, name, got)
            assert got["waited"] < SHARED_WAIT, (r, name, got)  # memory:// is each process's own: no wait
        assert res["left_unshared"] == [], (r, res["left_unshared"])
        assert res["shared"] is None and res["shared_value"] == [{"t": s} for s in range(WORLD)], (r, res["shared"])
        assert res["after"] == list(range(WORLD))
        assert res["left_after_failures"] == []
    assert results[0]["failures"]["short_list"]["value_error"]
    assert results[0]["failures"]["short_list_records"]["value_error"]


def test_a_rank_too_slow_fails_the_call_everywhere_and_its_folder_goes(ranks):
    _, results = ranks
    for r in range(WORLD):
        assert results[r]["slow_rank"]["error"] == "CoordinationError", (r, results[r]["slow_rank"])
        assert results[r]["slow_rank"]["left"] == [], (r, results[r]["slow_rank"])


def test_a_rank_that_never_calls_is_a_timeout_error_not_a_hang(ranks):
    from _dropin_workers import NEVER_TIMEOUT

    _, results = ranks
    assert_timed_out(results, "never_called", NEVER_TIMEOUT, range(WORLD - 1))


def test_a_call_after_a_timed_out_call_works(ranks):
    """A timeout leaves gloo's group broken (its connections closed): the next call of the same
    timeout builds a new group instead of failing on the old one."""
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["after_a_timeout"]
        assert res["late"] is not None and res["late"]["type"] == "CoordinationError", (r, res)
        assert res["again"] == list(range(WORLD)), (r, res)


def test_value_keeps_dict_key_order(tmp_path):
    import spillmerge

    with spillmerge.SpillWriter(tmp_path / "spill", rank=0, world_size=1) as w:
        w.write("a.jpg", 0, {"image_id": 1, "category_id": 2, "bbox": [1.0, 2.0], "score": 0.5})
    w.merge(str(tmp_path / "out.zarr"), progress=False)
    got = spillmerge.open(str(tmp_path / "out.zarr")).value("a.jpg")
    assert list(got) == ["image_id", "category_id", "bbox", "score"]


def test_a_root_each_rank_of_one_host_has_to_itself_is_refused_in_seconds(ranks):
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["unshared_on_one_host"]
        for name, root in UNSHARED.items():
            for kind in ("spill", "records"):
                got = res[f"{name}_{kind}"]
                err = got["error"]
                assert err is not None and err["type"] == "ConfigError", (r, name, kind, got)
                assert err["key"] == "SPILLMERGE_ROOT" and f"{root}/spillmerge-" in err["msg"], (r, name, kind, err)
                assert got["waited"] < SHARED_WAIT, (r, name, kind, got)  # one look, no wait, on one host
        assert res["left"] == [] and res["left_in_memory"] == [], (r, res)
