"""Run by tests/distributed/test_torchrun.py through the real launcher (``python -m torch.distributed.run``):
the main multi-rank scenario of tests/_mp_scenarios.py (hostile filenames, every dtype, nested
values, compared bit-exactly with ``gather_object`` in the same run), with rank, world size and
run id coming from torchrun's environment. Writes ``BASE/torchrun-rank-R.json``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mp_scenarios import scenario_main  # noqa: E402 - after the path set-up


def main() -> None:
    base = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = scenario_main(rank, world, base)
        with open(f"{base}/torchrun-rank-{rank}.json", "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
