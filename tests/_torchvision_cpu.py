"""Import torchvision on a CPU-only torch whose torchvision wheel cannot load its compiled ops.

The torchvision wheels on PyPI for Linux are built against the CUDA build of torch: their
``_C.so`` links ``libtorch_cuda.so`` / ``libc10_cuda.so``, which the CPU build of torch (what
``make setup`` installs) does not ship. torchvision then imports without its ops, except that
``_meta_registrations`` registers fake kernels for ``torchvision::nms`` / ``qnms`` unconditionally,
so ``import torchvision`` itself fails ("operator torchvision::nms does not exist").

Of those ops, detection models in eval mode need only ``nms``: ``roi_align`` (Mask R-CNN's
``MultiScaleRoIAlign``) falls back to torchvision's own pure-torch ``_roi_align`` when the ops are
missing, and mask pasting is pure torch. So, only when ``_C.so`` does not load, this module
defines ``torchvision::nms`` / ``qnms`` with the schemas torchvision's C++ code registers, gives
``nms`` a pure-torch CPU kernel (greedy NMS in score order, like torchvision's CPU kernel) and
lets ``torchvision.ops.boxes`` call it. With a torchvision whose ops load (a CPU wheel from
PyTorch's index), nothing is changed. Used by tests only (tests/e2e/test_model_outputs.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

_LIB: torch.library.Library | None = None  # kept alive: the definitions live as long as it does


def _nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy NMS: boxes by descending score (stable, as torchvision's CPU kernel sorts), each kept
    box suppresses the later ones whose IoU with it is above ``iou_threshold``."""
    if dets.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=dets.device)
    x1, y1, x2, y2 = dets.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    order = scores.sort(stable=True, descending=True).indices
    suppressed = torch.zeros(dets.shape[0], dtype=torch.bool)
    keep = []
    for i in order.tolist():
        if suppressed[i]:
            continue
        keep.append(i)
        w = (torch.minimum(x2[i], x2) - torch.maximum(x1[i], x1)).clamp(min=0)
        h = (torch.minimum(y2[i], y2) - torch.maximum(y1[i], y1)).clamp(min=0)
        inter = w * h
        suppressed |= inter / (areas[i] + areas - inter) > iou_threshold
    return torch.tensor(keep, dtype=torch.int64, device=dets.device)


ISOLATED = Path(sys.prefix) / "torchvision-cpu"
"""Where ``make setup`` installs torchvision (``pip install --target``), off the venv's path: a
torchvision whose ops do not load breaks ``import torchmetrics`` / ``lightning`` (they import it
when it is installed), so it is importable only in processes that call :func:`import_torchvision`."""


def available() -> bool:
    """Whether :func:`import_torchvision` can import a torchvision, without importing it."""
    return importlib.util.find_spec("torchvision") is not None or (ISOLATED / "torchvision").is_dir()


def _ops_load() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    try:
        torch.ops.load_library(str(Path(spec.origin).parent / "_C.so"))
    except (OSError, RuntimeError):
        return False
    return True


def import_torchvision() -> ModuleType:
    """``import torchvision``, with the pure-torch ``nms`` where the compiled ops do not load."""
    global _LIB
    if importlib.util.find_spec("torchvision") is None and str(ISOLATED) not in sys.path:
        sys.path.insert(0, str(ISOLATED))
    if _LIB is None and not _ops_load():
        _LIB = torch.library.Library("torchvision", "DEF")
        _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.impl("nms", _nms, "CPU")
    import torchvision
    import torchvision.ops.boxes

    if _LIB is not None:
        # boxes.nms asks torchvision.extension whether _C loaded before calling the op; the op
        # exists now (defined above), the other compiled ops still do not.
        torchvision.ops.boxes._assert_has_ops = lambda: None
        # Without the ops, roi_align runs torchvision's pure-torch _roi_align, wrapped to be
        # torch.compile'd on its first call: minutes of compiling on a CPU (130 s measured here)
        # for a few small images. The function it wraps runs eagerly in well under a second.
        roi_align = importlib.import_module("torchvision.ops.roi_align")
        roi_align._roi_align = getattr(roi_align._roi_align, "__wrapped__", roi_align._roi_align)
    return torchvision
