"""Distributed object detection: a different number of boxes per image, gathered with spillmerge.

A detection model (torchvision's Faster R-CNN, DETR, YOLO ...) returns, per image, a dict of
``boxes`` (k, 4), ``scores`` (k,) and ``labels`` (k,) where k differs from image to image (0 when
nothing is found). ``gather_object`` is the usual way to collect such outputs; spillmerge stores
them as ragged columns (values + offsets, no pickle) next to a string per image.

CPU (gloo), with torchrun:

    torchrun --standalone --nproc-per-node 4 examples/detection_infer.py --root /tmp/spill --out /tmp/dets.zarr

or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (SLURM's srun with a
wrapper, a plain ``for r in 0 1; do RANK=$r ... python examples/detection_infer.py ...; done``).
On GPUs pass ``--backend nccl``: predictions may stay CUDA tensors, ``w.write_batch`` copies each one
once to host memory, and the merge uses no NCCL collective.

Each rank runs the detector on its share of the images and writes one frame (frame 0) per image:
``{"boxes": float32 (k, 4), "scores": float32 (k,), "labels": int64 (k,), "top_class": str}``.
Rank 0 merges, then reads the result back two ways:

- per image: ``res["images/img_0007.jpg"]["boxes"][0]`` is that image's (k, 4) array;
- the whole dataset: ``res.column("boxes")`` is one ragged leaf over every image, in filename
  order (what an evaluation over a million images wants, without opening per-image objects).

``FakeDetector`` is exact integer arithmetic, so a prediction depends only on the image:
``tests/e2e/test_examples.py`` recomputes every value and compares bit for bit. Replace it and
``ImageDataset`` with your own.
"""

from __future__ import annotations

import argparse
import os
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import spillmerge

CLASSES = ["person", "bicycle", "car", "dog", "cat", "traffic light"]
MAX_BOXES = 5


def image_names(n: int = 40) -> list[str]:
    return [f"images/img_{i:04d}.jpg" for i in range(n)]


def image_input(filename: str) -> torch.Tensor:
    """A fake decoded image: uint8 (3, 32, 32), a function of the filename only."""
    g = torch.Generator().manual_seed(zlib.crc32(filename.encode()))
    return torch.randint(0, 256, (3, 32, 32), generator=g, dtype=torch.uint8)


class ImageDataset(Dataset):
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> tuple[str, torch.Tensor]:
        return self.names[i], image_input(self.names[i])


class FakeDetector(torch.nn.Module):
    """A stand-in for a detection model: 0..MAX_BOXES boxes per image, computed with exact
    integer arithmetic so each output is independent of the batch it ran in."""

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:  # x: uint8 (B, 3, H, W)
        out = []
        for img in x:
            s = img.to(torch.int64).sum(dim=0)  # (H, W), exact
            k = int(s.sum()) % (MAX_BOXES + 1)  # 0 boxes for some images
            j = torch.arange(k)
            x0, y0 = s[j, 0] % 16, s[0, j] % 16
            boxes = torch.stack([x0, y0, x0 + 1 + s[j, j] % 16, y0 + 1 + s[j, -1] % 16], dim=1).to(torch.float32)
            scores = ((s[-1, j] % 1000).to(torch.float32) / 1000).reshape(k)
            labels = (s[j, 1] % len(CLASSES)).reshape(k)
            out.append({"boxes": boxes.reshape(k, 4), "scores": scores, "labels": labels})
        return out


def top_class(det: dict[str, torch.Tensor]) -> str:
    """The class name of the best box, "background" when there is none."""
    if len(det["scores"]) == 0:
        return "background"
    return CLASSES[int(det["labels"][int(det["scores"].argmax())])]


def expected_prediction(filename: str) -> dict[str, Any]:
    """The value written for one image, computed alone (for checking a merged store)."""
    det = FakeDetector()(image_input(filename)[None])[0]
    return {**det, "top_class": top_class(det)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="spill root shared by all ranks (path or fsspec URL)")
    ap.add_argument("--out", required=True, help="merged Zarr store (path or fsspec URL)")
    ap.add_argument("--backend", default="gloo", help="process group backend: gloo on CPU, nccl on GPUs")
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)  # env:// (torchrun or any launcher that sets RANK ... MASTER_PORT)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    model = FakeDetector().to(device).eval()
    names = image_names(args.images)
    mine = ImageDataset(names[rank::world])  # each rank its share of the images, none twice

    with spillmerge.SpillWriter(args.root) as w:  # rank / world size come from torch.distributed
        with torch.no_grad():
            for batch_names, x in DataLoader(mine, batch_size=args.batch_size):
                dets = [{**det, "top_class": top_class(det)} for det in model(x.to(device))]
                # one per-image dict per image, k boxes each (0 included): stored ragged, no padding,
                # no pickle; an image needs no frame index (frame 0)
                w.write_batch(list(batch_names), dets)
        print(f"rank {rank}: wrote {len(mine)} images", flush=True)
    report = w.merge(args.out, overwrite=True, progress=False)  # merges on rank 0; None elsewhere
    if report is not None:
        print(report, flush=True)
        res = spillmerge.open(args.out)
        first = res.filenames[0]
        print(f"{first}: {len(res[first]['boxes'][0])} boxes, top class {res[first]['top_class'][0]!r}", flush=True)
        boxes = res.column("boxes")  # every image's boxes, in filename order
        n_boxes = sum(len(b) for b in boxes.to_list())
        print(f"{len(boxes)} images, {n_boxes} boxes in all", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
