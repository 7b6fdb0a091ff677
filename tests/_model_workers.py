"""Rank bodies for tests/e2e/test_model_outputs.py: real model outputs (random weights, nothing
downloaded) sent through ``spillmerge.all_gather`` / ``gather`` and through ``all_gather_object``
/ ``gather_object`` in the same 2-rank gloo group, compared in type and content.

- Detection: torchvision's Mask R-CNN (a one-convolution backbone) in eval mode returns, for a batch of images, a list of
  per-image dicts (``boxes`` float32 (N, 4), ``labels`` int64 (N,), ``scores`` float32 (N,),
  ``masks`` float32 (N, 1, H, W)). Every rank's list has an image with no detection (its box score
  threshold above 1) and the last rank's has only such images; image sizes differ between ranks.
- Generation: a tiny random GPT-2's ``generate(output_scores=True, return_dict_in_generate=True)``:
  ``sequences`` (int64) and ``scores`` (a tuple of float32 (batch, vocab) tensors, one per new
  token); batch, prompt length and number of new tokens differ between ranks.

Each rank sends its outputs as one value (``gather_object``'s unit) and, for detection, each image
as a file of its own. Which scenarios run depends on what is installed (the same on every rank)."""

from __future__ import annotations

import functools
from typing import Any

from _helpers import value_diffs
from _mp_scenarios import run_scenarios
from _torchvision_cpu import available as torchvision_available
from _torchvision_cpu import import_torchvision

WORLD = 2
TIMEOUT = 120.0


def transformers_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def _setup() -> None:
    """torchvision first (where installed): transformers imports it when it is there, and on this
    machine it imports only through ``import_torchvision``'s workaround."""
    if torchvision_available():
        import_torchvision()


@functools.cache  # one forward per rank serves every round (the values are only read)
def detections(rank: int) -> list[dict[str, Any]]:
    """torchvision's Mask R-CNN (random weights, 3 classes: random logits clear a score threshold
    of 0) on images of a size that depends on the rank, plus images no box clears a threshold of
    1.01 for. Its backbone is one convolution: the output (boxes, labels, scores, masks per
    image) is what the detection heads make, and a ResNet-50 cost each rank seconds to build."""
    import torch

    _setup()
    from torchvision.models.detection import MaskRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(rank)
    backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4, padding=1), torch.nn.ReLU())
    backbone.out_channels = 8
    model = MaskRCNN(
        backbone, num_classes=3, min_size=64, max_size=96,
        rpn_anchor_generator=AnchorGenerator(((8, 16),), ((0.5, 1.0, 2.0),)),
        box_roi_pool=MultiScaleRoIAlign(["0"], 7, 2), mask_roi_pool=MultiScaleRoIAlign(["0"], 14, 2),
        rpn_pre_nms_top_n_test=100, rpn_post_nms_top_n_test=20, box_detections_per_img=4 + rank,
        box_score_thresh=0.0,
    ).eval()  # fmt: skip
    images = [torch.rand(3, 40 + 8 * rank, 56 - 4 * i) for i in range(2)]
    with torch.no_grad():
        last = rank == WORLD - 1
        out: list[dict[str, Any]] = [] if last else model(images)
        model.roi_heads.score_thresh = 1.01  # no box scores above 1: no detection at all
        out += model(images if last else images[:1])
    return out


@functools.cache
def generations(rank: int) -> Any:
    """A 1-layer random GPT-2's ``generate`` output (a ModelOutput: an OrderedDict subclass)."""
    import torch

    _setup()
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(100 + rank)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=32, vocab_size=100, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(3, 100, (1 + rank % 2, 3 + rank))
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=2 + rank, min_new_tokens=2 + rank,
            do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=2,
        )  # fmt: skip


def _object_diffs(got: Any, want: Any, where: str) -> list[str]:
    """Where two unpickled objects differ: type, then attributes (``vars``) and items, tensors
    by dtype, shape and values. Pickling is not byte-stable (tensor storages), so the objects
    themselves are compared."""
    import torch

    if type(got) is not type(want):
        return [f"{where}: {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, type):
        return [] if got is want else [f"{where}: {got!r} != {want!r}"]
    if isinstance(want, torch.Tensor):
        same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        return [] if same else [f"{where}: tensors differ"]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [d for i, (a, b) in enumerate(zip(got, want, strict=True)) for d in _object_diffs(a, b, f"{where}[{i}]")]
    if isinstance(want, dict) or hasattr(want, "__dict__"):
        a, b = (got, want) if isinstance(want, dict) else (vars(got), vars(want))
        if sorted(a) != sorted(b):
            return [f"{where}: attributes {sorted(a)} != {sorted(b)}"]
        return [d for k in b for d in _object_diffs(a[k], b[k], f"{where}.{k}")]
    return [] if got == want else [f"{where}: {got!r:.60} != {want!r:.60}"]


def _collect(rank: int, world: int, out: str, preds: dict[str, Any], obj: Any, every_rank: bool, **kw: Any) -> Any:
    """(spillmerge's result, the collective's list) for ``preds`` and ``obj`` in the same run."""
    import torch.distributed as dist

    import spillmerge

    if every_rank:
        store = spillmerge.all_gather(preds, out, progress=False, timeout=TIMEOUT, **kw)
        want: list[Any] = [None] * world
        dist.all_gather_object(want, obj)
        return store, want
    store = spillmerge.gather(preds, out, progress=False, timeout=TIMEOUT, **kw)
    got: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, got, dst=0)
    return store, got


def _detection_round(rank: int, world: int, base: str, name: str, every_rank: bool) -> dict[str, Any]:
    outs = detections(rank)
    preds: dict[str, Any] = {f"batch-{rank}": (0, outs)}
    preds.update({f"image-{rank}-{i}": (0, d) for i, d in enumerate(outs)})
    store, want = _collect(rank, world, f"{base}/{name}/out.zarr", preds, outs, every_rank)
    if store is None:
        return {"got_store": False, "diffs": []}
    diffs = []
    for s in range(world):
        diffs += value_diffs(store.value(f"batch-{s}"), want[s], f"batch-{s}")
        diffs += [d for i, img in enumerate(want[s]) for d in value_diffs(store.value(f"image-{s}-{i}"), img, f"image-{s}-{i}")]
    return {
        "got_store": True,
        "diffs": diffs,
        "n_boxes": [[len(img["boxes"]) for img in want[s]] for s in range(world)],
        "mask_shapes": sorted({tuple(img["masks"].shape[1:]) for s in range(world) for img in want[s]}),
    }


def detection_all_gather(rank: int, world: int, base: str) -> dict[str, Any]:
    return _detection_round(rank, world, base, "det_ag", every_rank=True)


def detection_gather(rank: int, world: int, base: str) -> dict[str, Any]:
    return _detection_round(rank, world, base, "det_g", every_rank=False)


def _generation_round(rank: int, world: int, base: str, name: str, every_rank: bool) -> dict[str, Any]:
    """What a user keeps of ``generate``'s output: ``{"sequences", "scores"}``, without pickle."""
    gen = generations(rank)
    obj = {"sequences": gen.sequences, "scores": gen.scores}
    store, want = _collect(rank, world, f"{base}/{name}/out.zarr", {f"gen-{rank}": (0, obj)}, obj, every_rank)
    if store is None:
        return {"got_store": False, "diffs": []}
    diffs = [d for s in range(world) for d in value_diffs(store.value(f"gen-{s}"), want[s], f"gen-{s}")]
    shapes = [[list(want[s]["sequences"].shape), len(want[s]["scores"])] for s in range(world)]
    return {"got_store": True, "diffs": diffs, "shapes": shapes, "scores_type": type(want[0]["scores"]).__name__}


def generation_all_gather(rank: int, world: int, base: str) -> dict[str, Any]:
    return _generation_round(rank, world, base, "gen_ag", every_rank=True)


def generation_gather(rank: int, world: int, base: str) -> dict[str, Any]:
    return _generation_round(rank, world, base, "gen_g", every_rank=False)


def generation_model_output(rank: int, world: int, base: str) -> dict[str, Any]:
    """``generate``'s output object itself, as ``all_gather_object`` takes it. It holds the
    key/value cache (a ``DynamicCache``, no kind spillmerge stores): refused without
    ``allow_pickle``, naming the leaf; with it the cache is pickled. The ModelOutput (an
    OrderedDict subclass) comes back as a dict of its keys (mappings are stored as their items:
    docs/FORMAT.md, *Value model*), its tensors and tuple equal to the collective's."""
    import spillmerge

    gen = generations(rank)
    out = f"{base}/gen_mo"
    result: dict[str, Any] = {"keys": list(gen.keys()), "type": type(gen).__name__}
    try:
        spillmerge.all_gather({f"gen-{rank}": (0, gen)}, f"{out}/refused.zarr", progress=False, timeout=TIMEOUT)
        result["refused"] = None
    except spillmerge.SpillValueError as exc:
        result["refused"] = {"msg": str(exc), "filename": exc.filename, "frame_idx": exc.frame_idx}
    preds = {f"gen-{rank}": (0, gen)}
    store, want = _collect(rank, world, f"{out}/pickled.zarr", preds, gen, True, allow_pickle=True)
    diffs: list[str] = []
    for s in range(world):
        got = store.value(f"gen-{s}")
        if type(got) is not dict or sorted(got) != sorted(want[s].keys()):
            diffs.append(f"gen-{s}: {type(got).__name__} {sorted(got)} != keys {sorted(want[s].keys())}")
            continue
        for key in want[s]:
            if key in ("sequences", "scores"):
                diffs += value_diffs(got[key], want[s][key], f"gen-{s}/{key}")
            else:  # the pickled cache: unpickled by both, compared attribute by attribute
                diffs += _object_diffs(got[key], want[s][key], f"gen-{s}/{key}")
    result["diffs"] = diffs
    return result


def scenarios() -> dict[str, Any]:
    """The rounds that what is installed allows (the same on every rank)."""
    out: dict[str, Any] = {}
    if torchvision_available():
        out.update({"det_ag": detection_all_gather, "det_g": detection_gather})
    if transformers_available():
        out.update({"gen_ag": generation_all_gather, "gen_g": generation_gather, "gen_mo": generation_model_output})
    return out


def worker(rank: int, world: int, port: int, base: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes`` (the rank comes first)."""
    run_scenarios(rank, world, port, base, scenarios(), barrier_between=True)
