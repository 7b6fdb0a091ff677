"""Every rank can read the result: ``SpillWriter.merge(wait=True)``, ``spillmerge.gather`` and
``spillmerge.all_gather`` in 4 real gloo ranks (checked against ``all_gather_object`` of the same
predictions in the same run), and without torch.distributed in independent processes."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _gather_workers import WORLD, preds_of, worker
from _procs import assert_timed_out, ranks_fixture

import spillmerge
import spillmerge._dist.gather

ranks = ranks_fixture(worker, WORLD, "gather")


def test_wait_true_every_rank_reads_the_output_right_after_merge(ranks):
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["wait"]
        assert res["report"] is (r == 0)
        assert res["digest"] == res["expected"]  # bit-exact against all_gather_object


def test_a_failing_merge_on_dst_raises_on_every_waiting_rank_naming_dst(ranks):
    _, results = ranks
    assert results[0]["fails"]["error"]["type"] == "CorruptSpillError"
    for r in range(1, WORLD):
        err = results[r]["fails"]["error"]
        # MergeFailedError (not MergeTimeout): told by dst, long before the 120 s timeout.
        assert err["type"] == "MergeFailedError" and err["is_spillmerge_error"], err
        assert results[r]["fails"]["rank_attr"] == 0
        assert "failed on rank 0" in err["msg"] and "checksum mismatch" in err["msg"]


def test_gather_returns_the_store_on_dst_only_and_leaves_no_spill(ranks):
    _, results = ranks
    assert results[0]["gather"]["got_store"] and results[0]["gather"]["digest"] == results[0]["gather"]["expected"]
    for r in range(1, WORLD):
        assert not results[r]["gather"]["got_store"]
    assert not any(results[r]["gather"]["spill_left"] for r in range(WORLD))


def test_all_gather_gives_every_rank_the_same_bits_as_all_gather_object(ranks):
    _, results = ranks
    for r in range(WORLD):
        assert results[r]["all_gather"]["digest"] == results[r]["all_gather"]["expected"]


def test_a_crashed_round_names_the_cause_on_every_rank_and_the_rerun_succeeds(ranks):
    _, results = ranks
    first = {r: results[r]["rerun"]["first"]["error"] for r in range(WORLD)}
    assert first[2]["type"] == "SpillValueError"  # the rank whose value could not be stored
    for r in (0, 1, 3):
        assert first[r] is not None and first[r]["is_spillmerge_error"], first[r]
        assert "rank(s) [2]" in first[r]["msg"] or "rank 2" in first[r]["msg"], first[r]["msg"]
    for r in range(WORLD):
        res = results[r]["rerun"]
        assert res["digest"] == res["expected"] and not res["spill_left"]


def _spawn_plain(target: Any, world: int, base: Path, *, timeout: float) -> None:
    """Run ``target(rank, world, port, base)`` in ``world`` new processes (a hang fails)."""
    from _procs import free_port, join_all, rank_context

    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, str(base))) for r in range(world)]
    for p in procs:
        p.start()
    join_all(procs, timeout=timeout)


# ------------------------------------------------------------------- without torch.distributed
def _no_dist(fn: str, rank: int, world: int, out: str, q: Any) -> None:
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        os.environ.pop(var, None)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    try:
        call = spillmerge.gather if fn == "gather" else spillmerge.all_gather
        store = call(preds_of(rank, "nd"), out, progress=False, timeout=60)
        got = None if store is None else {n: store.frames(n).tolist() for n in store.filenames}
        q.put((rank, got, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        q.put((rank, None, f"{type(exc).__name__}: {exc}"))


def test_a_call_s_timeout_bounds_its_waits_after_calls_with_longer_ones(ranks):
    from _gather_workers import SHORT_TIMEOUT

    _, results = ranks
    assert_timed_out(results, "short_timeout", SHORT_TIMEOUT, range(WORLD - 1))


@pytest.mark.parametrize("fn", ["gather", "all_gather"])
def test_without_torch_distributed_rank_and_world_size_come_from_the_environment(tmp_path: Path, fn: str):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    out = str(tmp_path / "out.zarr")
    procs = [ctx.Process(target=_no_dist, args=(fn, r, 2, out, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (store, err)) for r, store, err in (q.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    assert got[0][1] is None and got[1][1] is None, got
    frames = {name: sorted(fr for r in range(2) for fr in preds_of(r, "nd")[name]) for name in preds_of(0, "nd")}
    assert got[0][0] == frames
    assert got[1][0] == (frames if fn == "all_gather" else None)
    assert not os.path.exists(spillmerge._dist.gather.default_root(out))  # nothing left behind


def test_gather_in_one_process_and_the_spill_root_option(tmp_path: Path):
    root = tmp_path / "keep.spill"
    store = spillmerge.gather({"a.mp4": {0: torch.ones(3), 1: torch.zeros(3)}}, tmp_path / "o.zarr", root=root,
                              keep_spill=True, rank=0, world_size=1, progress=False)  # fmt: skip
    assert store is not None and store.frames("a.mp4").tolist() == [0, 1]
    assert root.is_dir() and any(root.iterdir())  # kept on request
    again = spillmerge.all_gather({"b.mp4": (5, torch.ones(2))}, tmp_path / "o.zarr", rank=0, world_size=1)
    assert again.filenames == ["b.mp4"]  # the output is replaced, like the call it stands for
    assert not (tmp_path / "o.zarr.spill").exists()


def test_gather_gives_back_flat_records_as_written(tmp_path: Path):
    """LLM outputs (flat dicts of Python values, keys not in sorted order, a key that is None in
    some), more than a batch of them, and a batch holding a dict of another kind: every value
    comes back as written, its keys in order."""
    preds: dict[str, Any] = {
        f"p{i:05d}": {"text": "é" * (i % 7), "token_ids": list(range(i % 5 + 1)), "logprob": -i / 3,
                      "finish_reason": None if i % 4 else "stop"}
        for i in range(1500)
    }  # fmt: skip
    preds["p01400"] = {"text": "x", "nested": {"a": [1.5]}}
    store = spillmerge.gather({k: (0, v) for k, v in preds.items()}, tmp_path / "o.zarr", rank=0, world_size=1,
                              progress=False)  # fmt: skip
    assert store is not None
    got = {name: v for name, _, v in store.iter_values()}
    assert list(got) == list(preds)
    for name, want in preds.items():
        assert got[name] == want and list(got[name]) == list(want), name


def test_every_rank_names_the_root_cause_when_the_store_host_exits(tmp_path: Path):
    """Measured on an older release: ranks 1 and 3 raised 'lost the process group's store ...
    Connection reset by peer', which did not mention rank 2, whose failure record was on storage."""
    import json

    from _gather_workers import store_host_exits

    _spawn_plain(store_host_exits, WORLD, tmp_path, timeout=150)
    res = {r: json.loads((tmp_path / f"res-{r}.json").read_text()) for r in range(WORLD)}
    assert res[2]["error"]["type"] == "ValueError"
    for r in (0, 1, 3):
        err = res[r]["error"]
        assert err is not None and err["type"] == "RankFailedError", (r, err)
        assert "rank 2" in err["msg"] and "blew up" in err["msg"], (r, err["msg"])
        assert list(res[r]["failures"]) == ["2"]


def test_timeout_covers_the_process_group_setup(tmp_path: Path):
    """``all_gather(timeout=3)`` with a rank that exited right after ``init_process_group``: a
    ``CoordinationError`` after about 3 s, not after ``dist.new_group``'s 300 s."""
    import json

    from _gather_workers import rank_exits_after_init

    _spawn_plain(rank_exits_after_init, 2, tmp_path, timeout=150)
    res = json.loads((tmp_path / "res-0.json").read_text())
    assert res["error"] is not None and res["error"]["type"] == "CoordinationError", res
    assert " 3 s" in res["error"]["msg"], res
    assert res["seconds"] < 60, res  # the 3 s timeout plus gloo's and the spawn's slack, not 300 s


def test_rank_failed_error_names_every_failed_rank(tmp_path: Path):
    """Ranks 1 and 2 both fail; once both failure records exist, the merge on ranks 0 and 3
    raises ``RankFailedError`` naming both (it once named only rank 2: issue 23)."""
    import json

    from _gather_workers import two_ranks_fail

    _spawn_plain(two_ranks_fail, WORLD, tmp_path, timeout=150)
    res = {r: json.loads((tmp_path / f"res-{r}.json").read_text()) for r in range(WORLD)}
    for r in (0, 3):
        err = res[r]["error"]
        assert err is not None and err["type"] == "RankFailedError", (r, err)
        assert sorted(res[r]["failures"]) == ["1", "2"], (r, res[r])
        assert "rank 1" in err["msg"] and "rank 2" in err["msg"], (r, err["msg"])


def test_all_gather_called_back_to_back_with_the_same_out_always_works(tmp_path: Path):
    """Two gloo ranks call ``all_gather(preds, out)`` three times in a row with the same ``out``.
    The merging rank once removed whole rank folders while the other rank had already started the
    next call in the same ``OUT.spill`` (a lost segment file, or "no rank can see rank 1's commit
    record", in about half the runs). Every call must give every rank exactly its own
    predictions, and nothing may be left of the spill when the last call returns, on any rank."""
    import json

    from _gather_workers import CALLS, calls_back_to_back

    _spawn_plain(calls_back_to_back, 2, tmp_path, timeout=240)
    res = {r: json.loads((tmp_path / f"res-{r}.json").read_text()) for r in range(2)}
    for k in range(CALLS):
        want = {
            f"call{k} {name}": sorted(i + k for r in range(2) for i in preds_of(r, "b")[name])
            for name in preds_of(0, "b")
        }
        for r in range(2):
            assert res[r]["calls"][k] == want, (k, r, res[r]["calls"][k])
    for r in range(2):
        assert not res[r]["spill_at_return"] and not res[r]["spill_exists"] and not res[r]["left"], res[r]


def test_all_gather_to_an_output_only_dst_sees_says_so_on_the_other_ranks(tmp_path: Path):
    """memory:// is each process's own: dst merges what the other ranks sent it over gloo, and the
    others, which cannot see that output, raise ConfigError saying so (their spill stays)."""
    import json

    from _gather_workers import all_gather_to_each_process_s_memory

    _spawn_plain(all_gather_to_each_process_s_memory, WORLD, tmp_path, timeout=240)
    res = {r: json.loads((tmp_path / f"res-{r}.json").read_text()) for r in range(WORLD)}
    assert res[0]["digest"] == res[0]["expected"]
    for r in range(1, WORLD):
        assert res[r]["error"] == "ConfigError", res[r]
        assert f"rank {r}: rank 0 completed the output, but this rank does not see it" in res[r]["message"]
        assert "memory:// is each process's own" in res[r]["message"]
