"""A rank of a live job for tests/inspect/test_status.py: ``run(ROOT, OPTIONS, ROLE, GO_FILE, RANK,
WORLD_SIZE)`` in a process forked from tests/_procs.py's forkserver (torch and spillmerge imported
once, not per rank), which finds its rank and world size in env RANK and WORLD_SIZE as a
launcher's rank does.

Roles: ``commit`` writes and commits; ``stall`` writes, then waits (no durable write) until
GO_FILE exists, then commits; ``fail`` writes, then raises inside the ``with`` block."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import spillmerge


def run(root: str, options: dict[str, Any], role: str, go: str, rank: int, world: int) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    frames = {"commit": 40, "stall": 30, "fail": 20}[role]
    with spillmerge.SpillWriter(root, storage_options=options or None, chunk_bytes=4096, expected=200) as w:
        assert w.rank == rank
        for i in range(frames):
            w.write(f"video-{rank}.mp4", i, torch.full((256,), float(i)))  # 1 KiB a frame
        if role == "fail":
            raise RuntimeError(f"boom on rank {rank}")
        if role == "stall":
            deadline = time.monotonic() + 120
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.1)
