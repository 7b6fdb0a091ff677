"""One count of every dropped duplicate: across ranks (``report.duplicates``) and within a rank
(``report.rewrites``, from the writers' commit records), summed in ``report.dropped_duplicates``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DistributedSampler

import spillmerge


def test_padding_and_rewrites_are_counted_once_in_the_report(tmp_path):
    root = tmp_path / "spill"
    # DistributedSampler pads 5 items to 6 for 2 ranks: rank 1 gets item 0 again.
    data = list(range(5))
    for rank in range(2):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
        with spillmerge.SpillWriter(str(root), rank=rank, world_size=2) as w:
            for i in sampler:
                w.write(f"img{i}.png", 0, torch.full((3,), float(i)))
            if rank == 0:  # a retry inside one rank writes item 2 again, with the same bytes
                w.write("img2.png", 0, torch.full((3,), 2.0))
        assert w.stats()["rewrites"] == (1 if rank == 0 else 0)
    rep = spillmerge.merge(str(root), str(tmp_path / "out"))
    assert (rep.n_frames, rep.duplicates, rep.rewrites, rep.dropped_duplicates) == (5, 1, 1, 2)
    assert "2 duplicate frame copies dropped" in str(rep)
    commits = [json.loads((root / d / s / "commit.json").read_text()) for d in sorted(os.listdir(root))
               for s in os.listdir(root / d)]  # fmt: skip
    assert [c["rewrites"] for c in commits] == [1, 0]


def test_a_commit_record_without_rewrites_is_refused(tmp_path):
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root)) as w:
        w.write("a.png", 0, torch.ones(1))
    (seg,) = (root / "rank-00000").iterdir()
    rec = json.loads((seg / "commit.json").read_text())
    del rec["rewrites"]  # every writer of this (unreleased) spill format writes it
    (seg / "commit.json").write_text(json.dumps(rec))
    with pytest.raises(spillmerge.CorruptSpillError, match=r"commit.json: field 'rewrites' must be an integer"):
        spillmerge.merge(str(root), str(tmp_path / "out"))


def test_a_refused_rewrite_is_not_counted_and_policies_count_what_they_drop(tmp_path):
    w = spillmerge.SpillWriter(str(tmp_path / "a"))
    with w:
        w.write("a.png", 0, torch.ones(1))
        with pytest.raises(spillmerge.DuplicateFrameError):
            w.write("a.png", 0, torch.zeros(1))  # different bytes: refused, nothing dropped
    assert w.stats()["rewrites"] == 0
    for policy in ("first", "last"):
        with spillmerge.SpillWriter(str(tmp_path / policy), on_duplicate=policy) as w:
            w.write("a.png", 0, torch.ones(1))
            w.write("a.png", 0, torch.zeros(1))
        rep = spillmerge.merge(str(tmp_path / policy), str(tmp_path / f"{policy}.zarr"))
        assert (w.stats()["rewrites"], rep.rewrites, rep.dropped_duplicates) == (1, 1, 1), policy
