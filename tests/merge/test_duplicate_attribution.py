"""Which copy of a duplicated (filename, frame) a row comes from, and which rank it is attributed
to (docs/GUARANTEES.md, *Duplicates*): identical copies → the lowest rank's, then its earliest
segment; the same spill root merges byte-identically whatever order its segments were started or
are listed in."""

from __future__ import annotations

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import DistributedSampler

import spillmerge
from tests._mp_scenarios import output_tree, tree_diff


class ReversedListingFS(LocalFileSystem):
    """A local disk whose listings come back in reverse name order (as an object store's may come
    in any order): real files, only the order of ``ls`` differs."""

    protocol = "revfile"

    def ls(self, path, detail=False, **kwargs):
        return list(reversed(super().ls(path, detail=detail, **kwargs)))


def _spill_padded(root: str, order: list[int]) -> None:
    """DistributedSampler pads 7 items to 9 for 3 ranks: ranks 1 and 2 get items 0 and 1 again.
    The ranks start their segments in ``order`` (segment names carry the start time)."""
    data = list(range(7))
    for rank in order:
        sampler = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=False)
        with spillmerge.SpillWriter(root, rank=rank, world_size=3) as w:
            for i in sampler:
                w.write(f"img{i}.png", 0, {"x": torch.full((3,), float(i)), "tag": f"item {i}"})


def test_identical_duplicates_are_attributed_to_the_lowest_rank_whatever_started_first(tmp_path):
    # The padded copies land on the highest ranks; in the first order those start their segments
    # first, so "earliest segment" would name them: the rule names the lowest rank either way.
    for order in ([2, 1, 0], [0, 1, 2]):
        root, out = tmp_path / f"spill-{order[0]}", tmp_path / f"out-{order[0]}"
        _spill_padded(str(root), order)
        rep = spillmerge.merge(str(root), str(out))
        assert (rep.n_frames, rep.duplicates) == (7, 2)
        res = spillmerge.open(str(out))
        writers: dict[str, set[int]] = {}
        for rank in range(3):
            for i in list(DistributedSampler(list(range(7)), num_replicas=3, rank=rank, shuffle=False)):
                writers.setdefault(f"img{i}.png", set()).add(rank)
        for name, ranks in writers.items():
            assert res.frame_ranks(name).tolist() == [min(ranks)], (order, name, ranks)
            assert res.frame_copies(name).tolist() == [len(ranks)], (order, name)
    trees = [output_tree(str(tmp_path / f"out-{o}")) for o in (2, 0)]
    assert trees[0] == trees[1], tree_diff(*trees)


def test_a_reversed_storage_listing_merges_to_the_same_bytes(tmp_path):
    fsspec.register_implementation("revfile", ReversedListingFS, clobber=True)
    root = tmp_path / "spill"
    _spill_padded(str(root), [1, 2, 0])
    assert fsspec.filesystem("revfile").ls(str(root)) == fsspec.filesystem("file").ls(str(root))[::-1]
    spillmerge.merge(str(root), str(tmp_path / "plain"))
    spillmerge.merge(f"revfile://{root}", str(tmp_path / "reversed"))
    a, b = output_tree(str(tmp_path / "plain")), output_tree(str(tmp_path / "reversed"))
    assert a == b, tree_diff(a, b)
    assert spillmerge.open(str(tmp_path / "reversed")).frame_ranks("img0.png").tolist() == [0]


def test_different_content_follows_the_policy_in_write_order(tmp_path):
    root = tmp_path / "spill"
    for rank in (2, 0, 1):  # rank 2's segment starts first, rank 1's last
        with spillmerge.SpillWriter(str(root), rank=rank, world_size=3) as w:
            w.write("a.png", 0, torch.full((2,), float(rank)))
    for policy, rank in (("first", 2), ("last", 1)):
        spillmerge.merge(str(root), str(tmp_path / policy), on_duplicate=policy)
        res = spillmerge.open(str(tmp_path / policy))
        assert res.frame_ranks("a.png").tolist() == [rank], policy
        assert res["a.png"][0].tolist() == [float(rank)] * 2, policy


def test_copies_of_the_same_bytes_but_another_dtype_shape_or_kind_are_different_content(tmp_path):
    """Two ranks' copies of a frame are identical only when their leaves agree in dtype and shape
    as well as bytes: zeros of float32 and of float64, a (4,) and a (2, 2) array, a str and its
    bytes, None and [] are different content, refused under on_duplicate='error'; the same dict in
    another key order is the same content (``==`` holds), merged as one copy."""
    pairs = [
        ({"a": np.zeros(2, np.float32)}, {"a": np.zeros(1, np.float64)}),
        ({"a": np.zeros(4, np.uint8)}, {"a": np.zeros((2, 2), np.uint8)}),
        ({"a": "ab"}, {"a": b"ab"}),
        ({"a": None}, {"a": []}),
    ]
    for i, (first, second) in enumerate([*pairs, ({"a": 1, "b": "x"}, {"b": "x", "a": 1})]):
        root, out = str(tmp_path / f"s{i}"), str(tmp_path / f"o{i}")
        for rank, value in enumerate((first, second)):
            with spillmerge.SpillWriter(root, rank=rank, world_size=2) as w:
                w.write("f", 0, value)
        if i < len(pairs):
            with pytest.raises(spillmerge.DuplicateFrameError, match="frame 0 of 'f' was written with different"):
                spillmerge.merge(root, out, progress=False)
            rep = spillmerge.merge(root, out, on_duplicate="last", progress=False)
            assert rep.n_frames == 1 and repr(spillmerge.open(out).value("f", 0)) == repr(second)
        else:
            spillmerge.merge(root, out, progress=False)
            assert spillmerge.open(out).value("f", 0) == first
