"""Option combinations of one-process ``spillmerge.merge``: values read back as written, or a
``SpillMergeError`` naming the option."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spillmerge


@pytest.mark.parametrize("world_size", ["2", 2.0, np.int64(2), True])
def test_a_world_size_that_is_no_int_is_refused_naming_the_option(tmp_path, world_size):
    root = tmp_path / "spill"
    for rank in range(2):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2) as w:
            w.write("a.png", rank, torch.ones(2))
    with pytest.raises(spillmerge.SpillMergeError, match=r"world_size must be a positive int, got "):
        spillmerge.merge(str(root), str(tmp_path / "out"), world_size=world_size, progress=False)
    assert not (tmp_path / "out").exists()
    rep = spillmerge.merge(str(root), str(tmp_path / "out"), world_size=2, progress=False)
    assert (rep.n_frames, rep.missing_ranks) == (2, [])


@pytest.mark.parametrize("option", ["chunk_bytes", "threads"])
def test_true_is_no_count_of_bytes_or_threads(tmp_path, option):
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(root) as w:
        w.write("a.png", 0, torch.ones(2))
    with pytest.raises(spillmerge.SpillMergeError, match=rf"^{option} must be .*, got True$"):
        spillmerge.merge(str(root), str(tmp_path / "out"), progress=False, **{option: True})


def test_a_partial_merge_with_remove_spill_lists_the_salvaged_segment_as_kept(tmp_path):
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(root, rank=0, world_size=2) as w:
        w.write("a.png", 0, torch.zeros(3))
    with pytest.raises(RuntimeError), spillmerge.SpillWriter(root, rank=1, world_size=2, chunk_bytes=4096) as w:
        w.write("a.png", 1, torch.ones(4))
        w.write("b.png", 0, torch.ones(5))
        raise RuntimeError("rank 1 died")
    rep = spillmerge.merge(
        str(root), str(tmp_path / "out"), allow_partial=True, expected={"a.png": 3}, remove_spill=True, progress=False
    )
    assert (rep.n_frames, rep.salvaged_frames, rep.missing_ranks, rep.frame_gaps) == (3, {1: 2}, [1], {"a.png": [2]})
    segments = sorted(str(s) for s in root.glob("rank-*/seg-*"))
    assert len(segments) == 2 and not rep.removed_segments
    assert sorted(rep.kept_segments) == segments and set(rep.kept_segments.values()) == {"ranks [1] are missing"}
    store = spillmerge.open(str(tmp_path / "out"))
    assert store.value("a.png", 1).tolist() == [1.0] * 4 and store.value("b.png", 0).tolist() == [1.0] * 5


@pytest.mark.parametrize("budget", [None, "256MiB", True])
@pytest.mark.parametrize("option", ["memory_budget", "plan_budget"])
def test_a_budget_that_is_no_number_is_refused_naming_the_option(tmp_path, option, budget):
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(root) as w:
        for i in range(3):
            w.write(f"f{i}.png", 0, torch.ones(2))
    with pytest.raises(spillmerge.ConfigError, match=rf"^{option} \(--.*\) must be a number of bytes >= 0, got "):
        spillmerge.merge(str(root), str(tmp_path / "out"), chunk_bytes=8, progress=False, **{option: budget})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("timeout", [None, "10", True])
def test_a_timeout_that_is_no_number_is_refused_naming_the_option(tmp_path, timeout):
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(root, rank=0, world_size=2) as w:
        w.write("a.png", 0, torch.ones(2))
    with pytest.raises(spillmerge.ConfigError, match=r"^timeout must be a number of seconds \(inf: no limit\), got "):
        spillmerge.merge(str(root), str(tmp_path / "out"), timeout=timeout, progress=False)
    rep = spillmerge.merge(str(root), str(tmp_path / "out"), timeout=np.float64(0), allow_partial=True, progress=False)
    assert (rep.n_frames, rep.missing_ranks) == (1, [1])
