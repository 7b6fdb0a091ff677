"""``spillmerge demo``: N CPU ranks on gloo run a fake inference loop, spill and merge."""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ._errors import ConfigError, SpillMergeError
from ._format import output as FO
from ._format import spill as FS
from ._read.store import open as open_output
from ._spill.root import committed_keys


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the demo job."""

    ranks: int = 4
    files: int = 8
    frames_per_file: int = 40
    """Mean frames per video (each video gets between half and 1.5 times this)."""
    frame_shape: tuple[int, ...] = (3, 64, 64)
    """Shape of the fake per-frame mask prediction."""
    out: str = "spillmerge-demo"
    """Directory for the spill root (``spill/``) and merged output (``merged.zarr``)."""
    seed: int = 0


def workload(cfg: DemoConfig) -> dict[int, list[tuple[str, int]]]:
    """Uneven, shuffled assignment of (filename, frame) to ranks."""
    rng = random.Random(cfg.seed)
    keys: list[tuple[str, int]] = []
    for i in range(cfg.files):
        n = rng.randint(max(1, cfg.frames_per_file // 2), max(1, cfg.frames_per_file * 3 // 2))
        name = f"videos/clip {i:03d}.mp4" if i % 3 else f"video_{i:03d}.mp4"
        keys.extend((name, f) for f in range(n))
    rng.shuffle(keys)
    weights = [rng.uniform(0.5, 1.5) for _ in range(cfg.ranks)]
    out: dict[int, list[tuple[str, int]]] = {r: [] for r in range(cfg.ranks)}
    for key in keys:
        out[rng.choices(range(cfg.ranks), weights)[0]].append(key)
    return out


def predict(cfg: DemoConfig, filename: str, frame: int) -> dict[str, Any]:
    """The fake model: deterministic in (filename, frame), so rank 0 can check the merge."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}/{filename}/{frame}".encode()))
    x = torch.randn(cfg.frame_shape, generator=g)
    return {
        "mask": torch.sigmoid(x).to(torch.bfloat16),
        "embedding": x.mean(dim=(-1, -2)).to(torch.float16),
        "score": float(x.abs().mean()),
        "label": int(x.sum() > 0),
    }


def _rank_main(rank: int, cfg: DemoConfig, rendezvous: str, result_path: str) -> None:
    import spillmerge

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=cfg.ranks)
    try:
        out = Path(cfg.out)
        mine = workload(cfg)[rank]
        with spillmerge.SpillWriter(out / "spill") as w:  # rank / world size from torch.distributed
            for filename, frame in mine:
                w.write(filename, frame, predict(cfg, filename, frame))
        report = w.merge(str(out / "merged.zarr"), overwrite=True, progress=False)
        if rank == 0:
            res = spillmerge.open(str(out / "merged.zarr"))
            checked = 0
            for name in res.filenames:
                value = res[name]
                mask = value["mask"].to_torch()
                for row, frame in enumerate(res.frames(name).tolist()):
                    want = predict(cfg, name, frame)
                    if not torch.equal(mask[row].view(torch.int16), want["mask"].view(torch.int16)):
                        raise SpillMergeError(f"demo: {name!r} frame {frame} differs after the merge")
                    checked += 1
            Path(result_path).write_text(f"{report}\nverified {checked} frames bit-exact against the model\n")
    finally:
        dist.destroy_process_group()


_DEMO_FILENAME = re.compile(r"(videos/clip |video_)\d{3,}\.mp4")
"""The filenames :func:`workload` writes."""


def _refuse_foreign(path: Path, filenames: Iterable[str]) -> None:
    """Refuse to replace a spill root or an output holding a file the demo does not write."""
    other = next((f for f in filenames if not _DEMO_FILENAME.fullmatch(f)), None)
    if other is not None:
        raise ConfigError(
            f"{path} holds {other!r}, which the demo does not write: it is not the demo's to replace; "
            "choose another --out",
            key="out",
        )


def run(cfg: DemoConfig) -> str:
    """Run the demo; returns the text report."""
    out = Path(cfg.out)
    spill = out / "spill"
    # Start from a clean spill root, but only delete what is recognisably ours.
    if spill.exists():
        names = os.listdir(spill)
        if names and not all(FS.parse_rank_dirname(n) is not None for n in names):
            raise ConfigError(f"{spill} exists and is not a spill root; choose another --out", key="out")
        _refuse_foreign(spill, committed_keys(str(spill)))
    merged = out / "merged.zarr"
    if (merged / FO.COMPLETE_NAME).exists():  # the demo's merge replaces it (an interrupted one is rebuilt)
        _refuse_foreign(merged, open_output(str(merged)).filenames)
    if spill.exists():
        shutil.rmtree(spill)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.txt")
        # A file rendezvous: no free port to pick that another process could take first.
        rendezvous = os.path.join(tmp, "rendezvous")
        try:
            mp.spawn(_rank_main, args=(cfg, rendezvous, result), nprocs=cfg.ranks, join=True)
        except mp.ProcessRaisedException as exc:  # one line for the CLI: the rank's own error last
            last = [ln for ln in str(exc).strip().splitlines() if ln.strip()][-1]
            raise SpillMergeError(f"demo rank {exc.error_index} failed: {last.strip()}") from exc
        except mp.ProcessExitedException as exc:
            raise SpillMergeError(f"demo rank {exc.error_index} died (exit code {exc.exit_code})") from exc
        text = Path(result).read_text()
    return text + f"demo wall time {time.perf_counter() - t0:.1f} s (including process start-up)\n"
