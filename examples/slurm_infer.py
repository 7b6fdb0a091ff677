"""One task of a SLURM array job: no torch.distributed, the rank comes from the array index.

Run by ``examples/slurm_array.sbatch`` (``sbatch examples/slurm_array.sbatch``). Each array task
predicts every ``SLURM_ARRAY_TASK_COUNT``-th frame starting at its own index and spills them to
``--root``; the merge runs afterwards, once, with the CLI::

    spillmerge merge ROOT --out OUT

The rank is ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` and the world size
``SLURM_ARRAY_TASK_COUNT``; all tasks share the run id ``slurm-<SLURM_ARRAY_JOB_ID>`` (spillmerge
reads it from the environment), so the merge waits for exactly this job's segments. A task
requeued after a crash skips the frames its earlier attempt committed. Outside SLURM, pass
``--rank`` and ``--world-size``.

The fake model and data are those of ``torchrun_infer.py``, so the tests check every value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling example's model and data
from torchrun_infer import FakeSegmenter, dataset_keys, frame_input  # noqa: E402

import spillmerge  # noqa: E402


def slurm_rank() -> tuple[int, int]:
    """(rank, world size) of this array task."""
    try:
        task = int(os.environ["SLURM_ARRAY_TASK_ID"])
        count = int(os.environ["SLURM_ARRAY_TASK_COUNT"])
    except KeyError as exc:
        sys.exit(f"not a SLURM array task ({exc.args[0]} is not set); pass --rank and --world-size")
    first = int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
    step = int(os.environ.get("SLURM_ARRAY_TASK_STEP", "1"))
    return (task - first) // step, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="spill root shared by all tasks (path or fsspec URL)")
    ap.add_argument("--rank", type=int, help="default: from the SLURM array index")
    ap.add_argument("--world-size", type=int, help="default: SLURM_ARRAY_TASK_COUNT")
    ap.add_argument("--storage-options", type=json.loads, default=None, help="fsspec options as JSON")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    torch.set_num_threads(1)
    rank, world = (args.rank, args.world_size) if args.rank is not None else slurm_rank()
    model = FakeSegmenter().eval()
    with spillmerge.SpillWriter(args.root, rank=rank, world_size=world, storage_options=args.storage_options) as w:
        mine = [k for k in dataset_keys()[rank::world] if not w.is_committed(*k)]
        with torch.no_grad():
            for i in range(0, len(mine), args.batch_size):
                batch = mine[i : i + args.batch_size]
                out = model(torch.stack([frame_input(name, frame) for name, frame in batch]))
                for j, (name, frame) in enumerate(batch):
                    w.write(name, frame, {k: v[j] for k, v in out.items()})
    print(f"task rank {rank}/{world}: wrote {len(mine)} frames to {w.segment_path}", flush=True)


if __name__ == "__main__":
    main()
