"""Lightning ``Trainer.predict`` on several processes, gathered by ``SpillPredictionWriter``.

CPU (2 processes, gloo), as the tests run it:

    python examples/lightning_predict.py --root /tmp/spill --out /tmp/preds.zarr --devices 2

GPUs:

    python examples/lightning_predict.py --accelerator gpu --devices 8 \\
        --root /shared/spill --out /shared/preds.zarr

Lightning's ``ddp`` strategy starts the other processes itself (it re-runs this script). Each rank
predicts its share of the frames; ``SpillPredictionWriter`` appends every sample of every batch
to the rank's spill segment as the batch ends, and when the predict epoch ends global rank 0
merges all segments into ``--out`` (the other ranks return once every rank has committed, without waiting for the merge). Nothing is gathered
through torch.distributed and ``return_predictions=False`` keeps Lightning from holding them too.

The Dataset returns dicts with ``filename`` and ``frame_idx`` entries, the keys the callback reads
by default; with other batch shapes pass ``key_fn=`` (see ``SpillPredictionWriter``). The fake
model and data are those of ``torchrun_infer.py`` (exact integer arithmetic), so a test can check
every merged value bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling example's model and data
from torchrun_infer import FakeSegmenter, dataset_keys, frame_input  # noqa: E402

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]

if pl.__name__ == "lightning.pytorch":
    from spillmerge.integrations.lightning import SpillPredictionWriter
else:
    from spillmerge.integrations.pytorch_lightning import SpillPredictionWriter  # type: ignore[assignment]


class FrameDicts(torch.utils.data.Dataset):
    """One sample per (filename, frame): a dict, so the default key mapping applies."""

    def __init__(self) -> None:
        self.keys = dataset_keys()

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> dict[str, object]:
        filename, frame = self.keys[i]
        return {"filename": filename, "frame_idx": frame, "frames": frame_input(filename, frame)}


class Segmenter(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = FakeSegmenter()

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return self.model(batch["frames"])  # a dict of (B, ...) tensors: row j is sample j


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="spill root shared by all ranks (path or fsspec URL)")
    ap.add_argument("--out", required=True, help="merged Zarr store (path or fsspec URL)")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    torch.set_num_threads(1)
    writer = SpillPredictionWriter(args.root, args.out, merge_options={"overwrite": True, "progress": False})
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        callbacks=[writer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    loader = torch.utils.data.DataLoader(FrameDicts(), batch_size=args.batch_size)
    trainer.predict(Segmenter(), dataloaders=loader, return_predictions=False)
    print(f"rank {trainer.global_rank}: wrote {writer.writer.stats()['frames']} frames", flush=True)
    if writer.report is not None:  # global rank 0
        print(writer.report, flush=True)


if __name__ == "__main__":
    main()
