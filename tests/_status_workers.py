"""A rank of a live job for tests/inspect/test_status.py, run as a plain process with env RANK and
WORLD_SIZE: ``python _status_workers.py ROOT OPTIONS_JSON ROLE GO_FILE``.

Roles: ``commit`` writes and commits; ``stall`` writes, then waits (no durable write) until
GO_FILE exists, then commits; ``fail`` writes, then raises inside the ``with`` block."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import spillmerge


def main() -> None:
    root, options, role, go = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    frames = {"commit": 40, "stall": 30, "fail": 20}[role]
    with spillmerge.SpillWriter(root, storage_options=options or None, chunk_bytes=4096, expected=200) as w:
        rank = w.rank
        for i in range(frames):
            w.write(f"video-{rank}.mp4", i, torch.full((256,), float(i)))  # 1 KiB a frame
        if role == "fail":
            raise RuntimeError(f"boom on rank {rank}")
        if role == "stall":
            deadline = time.monotonic() + 120
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.1)


if __name__ == "__main__":
    main()
