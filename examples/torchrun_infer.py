"""Distributed inference with torchrun, gathering predictions with spillmerge.

    torchrun --standalone --nproc-per-node 4 examples/torchrun_infer.py --root /shared/spill --out /shared/preds.zarr

Every rank runs the model on its share of the frames and appends each prediction to its own
spill segment; `w.merge(out)` then merges on rank 0. The spill and the merge use no collective,
so on GPUs keep your usual backend (`--backend nccl`): predictions may be CUDA tensors, they are
copied to pinned host memory once, and no GPU memory is allocated for gathering.
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
import torch.distributed as dist

import spillmerge


def dataset(n_videos: int = 6, seed: int = 0) -> list[tuple[str, int]]:
    """(filename, frame_idx) for fake videos of uneven length."""
    keys = []
    for v in range(n_videos):
        n = 5 + (zlib.crc32(f"{seed}/{v}".encode()) % 20)
        keys.extend((f"videos/clip_{v:03d}.mp4", f) for f in range(n))
    return keys


def frame_input(filename: str, frame: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{filename}#{frame}".encode()))
    return torch.randn(3, 32, 32, generator=g)


class TinySegmenter(torch.nn.Module):
    """A stand-in model, deterministic so results can be checked."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 3, padding=1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.linspace(-1, 1, self.conv.weight.numel()).reshape(self.conv.weight.shape))
            self.conv.bias.zero_()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.conv(x)
        return {"mask": logits.softmax(dim=1)[:, 1].to(torch.bfloat16), "score": logits.mean(dim=(1, 2, 3))}


def predict(model: TinySegmenter, filename: str, frame: int) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(frame_input(filename, frame)[None])
    return {"mask": out["mask"][0], "score": out["score"][0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="spill root shared by all ranks")
    ap.add_argument("--out", required=True, help="merged Zarr store")
    ap.add_argument("--backend", default="gloo", help="process group backend (nccl on GPUs)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if args.backend == "nccl" else torch.device("cpu")
    )
    model = TinySegmenter().to(device).eval()

    # Like a DistributedSampler with shuffle=True: interleaved after a seeded shuffle.
    keys = dataset()
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(0)).tolist()
    mine = [keys[i] for i in order[rank::world]]

    with spillmerge.SpillWriter(args.root) as w:  # rank / world size from torch.distributed
        for filename, frame in mine:
            if w.is_committed(filename, frame):  # resuming after a crash: skip finished work
                continue
            w.write(filename, frame, predict(model, filename, frame))
    report = w.merge(args.out, overwrite=True, progress=False)
    if report is not None:
        print(report, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
