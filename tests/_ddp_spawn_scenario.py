"""Lightning ``ddp_spawn`` on 2 CPU ranks (run as a script by tests/e2e/test_integrations.py): the
launching process runs no hook itself, yet reads the merging rank's report from
``writer.report``; a new callback on the same paths reads none. Prints one JSON line."""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch

import spillmerge
from spillmerge.integrations.lightning import SpillPredictionWriter


class Model(pl.LightningModule):
    def predict_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return {"y": batch["x"] * 2}


class Frames(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 7  # odd: Lightning's predict sampler splits it 4 + 3, without padding

    def __getitem__(self, i: int) -> dict:  # type: ignore[type-arg]
        return {"filename": "clip.mp4", "frame_idx": i, "x": torch.full((2,), float(i))}


def main(root: str, out: str) -> None:
    torch.set_num_threads(1)
    writer = SpillPredictionWriter(root, out)
    before = writer.report
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[writer], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.predict(Model(), dataloaders=torch.utils.data.DataLoader(Frames(), batch_size=2), return_predictions=False)
    rep = writer.report
    # a later callback (another run) on the same paths does not take this run's report for its own
    later = SpillPredictionWriter(root, out).report
    print(json.dumps({
        "before": before is None,
        "type": type(rep).__name__,
        "n_frames": getattr(rep, "n_frames", None),
        "ranks": getattr(rep, "ranks", None),
        "dropped": getattr(rep, "dropped_duplicates", None),
        "frames": spillmerge.open(out).frames("clip.mp4").tolist(),
        "later": later is None,
    }))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
