"""A spill root left by a run with another world size: named as stale (not corrupt), with the
way out, on every rank at `with SpillWriter(...)` before any compute, and by the merge."""

from __future__ import annotations

import os

import pytest
import torch
from test_cli import assert_one_line_error
from test_cli import cli_run as run

import spillmerge
from tests._failure_workers import stale_root_rank
from tests._procs import spawn_ranks


def _one_rank_run(root) -> None:
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("clip.mp4", 0, torch.ones(4))


def _check(exc: spillmerge.StaleSpillError, root, world_size: int) -> None:
    stale = os.path.join(str(root), "rank-00000")
    assert isinstance(exc, ValueError) and not isinstance(exc, spillmerge.CorruptSpillError)
    assert exc.world_size == world_size and exc.path == str(root)
    assert list(exc.stale.values()) == [1] and next(iter(exc.stale)).startswith(stale), exc.stale
    msg = str(exc)
    assert "earlier run with world_size 1" in msg and f"this run has world_size {world_size}" in msg, msg
    assert "Nothing is corrupt" in msg and "remove the spill root" in msg and "another root" in msg, msg


def test_a_writer_of_another_world_size_fails_at_open_before_writing(tmp_path):
    root = tmp_path / "spill"
    _one_rank_run(root)
    for rank in (0, 1):  # rank 1's own folder is empty: it still sees rank 0's stale commit
        w = spillmerge.SpillWriter(str(root), rank=rank, world_size=2)
        with pytest.raises(spillmerge.StaleSpillError) as ei:
            w.__enter__()
        _check(ei.value, root, 2)
        assert w.state == "new"
    assert sorted(os.listdir(root)) == ["rank-00000"] and len(os.listdir(root / "rank-00000")) == 1
    # the same world size resumes as before
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("clip.mp4", 1, torch.ones(4))
    assert spillmerge.merge(str(root), str(tmp_path / "out")).n_frames == 2


def test_a_bigger_earlier_run_is_stale_too(tmp_path):
    root = tmp_path / "spill"
    for r in range(3):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=3) as w:
            w.write("clip.mp4", r, torch.ones(4))
    w = spillmerge.SpillWriter(str(root), rank=1, world_size=2)
    with pytest.raises(spillmerge.StaleSpillError, match="world_size 3, but this run has world_size 2") as ei:
        w.__enter__()
    assert set(ei.value.stale.values()) == {3} and len(ei.value.stale) == 3  # ranks 0, 1 and 2


def test_every_rank_fails_at_open_under_gloo(tmp_path):
    _one_rank_run(tmp_path / "spill")
    results = spawn_ranks(stale_root_rank, 2, tmp_path, timeout=180)
    for r in (0, 1):
        res = results[r]
        assert res["error"] == "StaleSpillError" and res["value_error"] and not res["wrote"], res
        assert res["world_size"] == 2 and list(res["stale"].values()) == [1], res


def test_merging_a_mixed_root_names_the_stale_segments(tmp_path):
    # A root holding a 2-rank run and a 1-rank run's segment (as an older spillmerge, without the
    # writer's check, left it): the 1-rank segment is moved in under its own name.
    root, other = tmp_path / "spill", tmp_path / "other"
    for r in range(2):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=2) as w:
            w.write("b.mp4", r, torch.ones(4))
    _one_rank_run(other)
    (seg,) = os.listdir(other / "rank-00000")
    os.rename(other / "rank-00000" / seg, root / "rank-00000" / seg)
    with pytest.raises(spillmerge.StaleSpillError) as ei:
        spillmerge.merge(str(root), str(tmp_path / "out"), world_size=2)
    _check(ei.value, root, 2)
    p = run("merge", str(root), "--out", str(tmp_path / "o"), "--world-size", "2")
    assert_one_line_error(p, "earlier run with world_size 1", "Nothing is corrupt", seg)
    # without --world-size the newest run is the one to merge: the 2-rank run is named stale
    p = run("merge", str(root), "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "earlier run with world_size 2, but this run has world_size 1")
