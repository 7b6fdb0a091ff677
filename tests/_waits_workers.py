"""Rank bodies for tests/spill/test_waits.py's coordinated merge (spawned gloo ranks; importable on its
own): rank 1 writes for 4 s more, rank 0 (dst) reaches merge() first and says on stderr whom it
waits for."""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

import torch
from _mp_scenarios import run_scenarios

import spillmerge
from spillmerge._spill import barrier as _barrier

WORLD = 2


def late_rank(rank: int, world: int, base: str) -> dict[str, Any]:
    _barrier.WAIT_NOTICE_FIRST, _barrier.WAIT_NOTICE_EVERY = 0.1, 0.5
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        with spillmerge.SpillWriter(f"{base}/spill", chunk_bytes=4096) as w:
            w.write(f"r{rank}.mp4", 0, torch.full((8,), float(rank)))
            if rank == 1:
                time.sleep(4)  # still writing while dst waits
        report = w.merge(f"{base}/out.zarr", timeout=120)
    return {"stderr": err.getvalue(), "merged": report is not None and report.n_frames == world}


def worker(rank: int, world: int, port: int, base: str) -> None:
    run_scenarios(rank, world, port, base, {"late_rank": late_rank})
