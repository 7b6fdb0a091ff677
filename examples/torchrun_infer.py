"""Distributed inference with torchrun, gathering predictions with spillmerge instead of gather_object.

CPU (gloo), as the tests run it:

    torchrun --standalone --nproc-per-node 4 examples/torchrun_infer.py --root /tmp/spill --out /tmp/preds.zarr

GPUs (one process per GPU, NCCL for your model's own collectives):

    torchrun --standalone --nproc-per-node 8 examples/torchrun_infer.py --backend nccl \\
        --root /shared/spill --out /shared/preds.zarr

Every rank runs the model on its share of the frames (a seeded shuffle dealt round-robin, like
DistributedSampler but without padding, so ranks get uneven shares and every video's frames are
spread over all ranks) and appends each prediction to its own spill segment under ``--root``.
After the ``with`` block every rank calls ``w.merge(out)``: rank 0 waits on storage for every
rank's commit record and merges everything into one Zarr store; the other ranks return once
every rank has committed (they do not wait for the merge).

What it means on GPUs:

- Predictions may stay CUDA tensors: ``w.write`` copies each one once into pinned host memory; no
  GPU memory is allocated for gathering and nothing is pickled.
- The spill and the merge use no NCCL collective. When torchrun is the launcher the ranks agree on
  a run id through ``TORCHELASTIC_RUN_ID``; otherwise ``SpillWriter`` asks rank 0 for one over a
  CPU-only gloo side group, never over NCCL.
- ``--root`` must be storage every rank and rank 0 can reach: a shared filesystem, or an object
  store URL such as ``s3://bucket/spill`` (credentials the usual fsspec way).
- Rank 0 merges after the other ranks have returned; do not follow ``w.merge`` with an NCCL
  ``barrier`` (it would time out on a long merge). Ranks that need the merged store can wait for
  its completion marker instead.
- A rerun after a crash skips every frame that a committed segment already holds
  (``w.is_committed``) and merges old and new segments together.

The fake model below is exact integer arithmetic, so a prediction depends only on
(filename, frame) and not on how frames were batched: ``tests/distributed/test_torchrun.py`` recomputes every
value and compares bit for bit. Replace ``FakeSegmenter`` and ``FrameDataset`` with your own.
With torch's own ``DistributedSampler`` (which pads by repeating samples) some frames run on two
ranks; spillmerge drops identical copies, but if your model is not bit-deterministic across batches
merge with ``w.merge(out, on_duplicate="first")``.
"""

from __future__ import annotations

import argparse
import os
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

import spillmerge


def dataset_keys(n_videos: int = 7, seed: int = 0) -> list[tuple[str, int]]:
    """(filename, frame_idx) of fake videos of uneven length (143 frames in all by default)."""
    keys: list[tuple[str, int]] = []
    for v in range(n_videos):
        n = 3 + (zlib.crc32(f"{seed}/{v}".encode()) % 25)
        keys.extend((f"videos/clip_{v:03d}.mp4", f) for f in range(n))
    return keys


def frame_input(filename: str, frame: int) -> torch.Tensor:
    """A fake decoded frame: uint8 (3, 32, 32), a function of (filename, frame) only."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{filename}#{frame}".encode()))
    return torch.randint(0, 256, (3, 32, 32), generator=g, dtype=torch.uint8)


class FrameDataset(Dataset):
    def __init__(self, keys: list[tuple[str, int]]) -> None:
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[str, int, torch.Tensor]:
        filename, frame = self.keys[i]
        return filename, frame, frame_input(filename, frame)


class ShardSampler(Sampler[int]):
    """DistributedSampler(shuffle=True) without padding: a seeded shuffle of all indices, every
    ``world``-th one from ``rank`` on. Shares differ by at most one; no sample runs twice."""

    def __init__(self, n: int, rank: int, world: int, seed: int = 0, skip: set[int] | None = None) -> None:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        self.indices = [i for i in order[rank::world] if i not in (skip or set())]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class FakeSegmenter(torch.nn.Module):
    """A stand-in for a real model: integer arithmetic only, so each output is exact and
    independent of the batch it ran in."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # x: uint8 (B, 3, H, W)
        s = x.to(torch.int32).sum(dim=1)  # exact
        mask = (s.to(torch.float32) / 765.0).to(torch.bfloat16)  # (B, H, W) bfloat16
        total = x.to(torch.int64).sum(dim=(1, 2, 3))  # exact
        score = (total.to(torch.float64) / x[0].numel()).to(torch.float32)  # (B,) float32
        label = total % 10  # (B,) int64
        boxes = torch.stack([s.amax(dim=(1, 2)), s.amin(dim=(1, 2)), s[:, 0, 0], s[:, -1, -1]], dim=1)
        return {"mask": mask, "score": score, "label": label, "boxes": boxes.to(torch.float16)}


def expected_prediction(filename: str, frame: int) -> dict[str, torch.Tensor]:
    """The prediction of one frame, computed alone (for checking a merged store)."""
    out = FakeSegmenter()(frame_input(filename, frame)[None])
    return {k: v[0] for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="spill root shared by all ranks (path or fsspec URL)")
    ap.add_argument("--out", required=True, help="merged Zarr store (path or fsspec URL)")
    ap.add_argument("--backend", default="gloo", help="process group backend: gloo on CPU, nccl on GPUs")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    model = FakeSegmenter().to(device).eval()
    data = FrameDataset(dataset_keys())

    with spillmerge.SpillWriter(args.root) as w:  # rank / world size come from torch.distributed
        # Resuming after a crash: skip frames a committed segment of an earlier run already holds.
        done = {i for i, (name, f) in enumerate(data.keys) if w.is_committed(name, f)}
        sampler = ShardSampler(len(data), rank, world, seed=0, skip=done)
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
        with torch.no_grad():
            for filenames, frames, x in loader:
                out = model(x.to(device, non_blocking=True))
                for j, (name, f) in enumerate(zip(filenames, frames.tolist(), strict=True)):
                    w.write(name, f, {k: v[j] for k, v in out.items()})
        print(f"rank {rank}: wrote {len(sampler)} frames ({len(done)} already committed)", flush=True)
    report = w.merge(args.out, overwrite=True, progress=False)  # merges on rank 0; None elsewhere
    if report is not None:
        print(report, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
