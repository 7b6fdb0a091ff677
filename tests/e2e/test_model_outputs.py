"""Issue 23: real model outputs (random weights, nothing downloaded) sent through
``spillmerge.all_gather`` / ``gather`` at 2 gloo ranks come back equal in type and content to
what ``all_gather_object`` / ``gather_object`` return in the same run: torchvision Mask R-CNN's
list of per-image dicts (images without detections among them) and a tiny random GPT-2's
``generate(output_scores=True, return_dict_in_generate=True)`` output (``scores``: a tuple of
tensors). One process group runs every round (tests/_model_workers.py).

torchvision and transformers are test extras (``make test`` installs them; torchvision outside
the venv's path, see tests/_torchvision_cpu.py); each test skips when its package is missing."""

from __future__ import annotations

import pytest
from _model_workers import WORLD, transformers_available, worker
from _procs import ranks_fixture
from _torchvision_cpu import available as torchvision_available

ranks = ranks_fixture(worker, WORLD, "models", timeout=600.0)

needs_torchvision = pytest.mark.skipif(not torchvision_available(), reason="torchvision is not installed")
needs_transformers = pytest.mark.skipif(not transformers_available(), reason="transformers is not installed")


def assert_every_rank_equal(results, name):
    """all_gather: every rank got a store equal to the collective's list."""
    for r in range(WORLD):
        res = results[r][name]
        assert res["got_store"] and res["diffs"] == [], (r, name, res["diffs"][:10])


def assert_dst_equal(results, name):
    """gather: rank 0 got a store equal to the collective's list, the others None."""
    assert results[0][name]["got_store"] and results[0][name]["diffs"] == [], results[0][name]["diffs"][:10]
    assert not any(results[r][name]["got_store"] for r in range(1, WORLD))


@needs_torchvision
def test_detections_all_gather_as_all_gather_object(ranks):
    _, results = ranks
    assert_every_rank_equal(results, "det_ag")
    n_boxes = results[0]["det_ag"]["n_boxes"]
    assert n_boxes[-1] == [0, 0] and all(n[-1] == 0 and n[0] > 0 for n in n_boxes[:-1]), n_boxes
    assert len(results[0]["det_ag"]["mask_shapes"]) > 1  # image sizes differ


@needs_torchvision
def test_detections_gather_on_dst_as_gather_object(ranks):
    _, results = ranks
    assert_dst_equal(results, "det_g")


@needs_transformers
def test_generate_sequences_and_scores_as_the_collectives(ranks):
    _, results = ranks
    assert_every_rank_equal(results, "gen_ag")
    assert results[0]["gen_ag"]["scores_type"] == "tuple"
    shapes = results[0]["gen_ag"]["shapes"]
    assert len({str(s) for s in shapes}) == WORLD, shapes  # batch, length and new tokens differ
    assert_dst_equal(results, "gen_g")


@needs_transformers
def test_generate_output_object_needs_allow_pickle_for_its_cache(ranks):
    _, results = ranks
    for r in range(WORLD):
        res = results[r]["gen_mo"]
        assert res["type"].startswith("Generate") and "cache" in res["keys"], res
        refused = res["refused"]
        assert refused is not None and refused["filename"] == f"gen-{r}" and refused["frame_idx"] == 0
        assert "'cache'" in refused["msg"] and "DynamicCache" in refused["msg"], refused["msg"]
        assert res["diffs"] == [], (r, res["diffs"])
