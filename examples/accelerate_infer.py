"""accelerate inference without ``accelerator.gather_object``: spill per process, merge once.

CPU (2 processes), as the tests run it:

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_infer.py --cpu \\
        --root /tmp/spill --out /tmp/preds.zarr

(``accelerate launch --cpu`` starts one process unless MPI is set up; ``--multi_gpu`` starts
them through torchrun, and ``--cpu`` below makes ``PartialState`` use gloo on CPUs.)

GPUs: ``accelerate launch --num_processes 8 examples/accelerate_infer.py ...`` (or your
``accelerate config``).

The usual accelerate pattern gathers every process's results onto every process::

    results = []
    with state.split_between_processes(keys) as mine:
        for batch in batches(mine):
            results.extend(zip(names, frames, model(x)))
    results = gather_object(results)          # pickles everything, every process gets everything

With spillmerge each process appends its predictions to its own spill segment, and the main
process merges them into one Zarr store; nothing goes through torch.distributed::

    with spillmerge.SpillWriter(root) as w:   # rank / world size from the process group accelerate set up
        with state.split_between_processes(keys) as mine:
            for batch in batches(mine):
                w.write_batch(names, model(x), frame_idx=frames)   # row j of each output is item j
    report = w.merge(out)                     # main process: a MergeReport; the others: None

``SpillWriter`` takes ``rank = state.process_index`` and ``world_size = state.num_processes``
from torch.distributed, which ``PartialState`` / ``Accelerator`` initialise, so no helper is
needed; pass them explicitly when you use accelerate without a process group. Do not call
``state.wait_for_everyone()`` right after ``merge`` with NCCL: the main process may be merging for
a long time. Processes that need the result can wait for ``OUT/spillmerge-complete.json``.

The fake model and data are those of ``torchrun_infer.py``, so the tests check every value.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import PartialState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling example's model and data
from torchrun_infer import FakeSegmenter, dataset_keys, frame_input  # noqa: E402

import spillmerge  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="spill root shared by all processes (path or fsspec URL)")
    ap.add_argument("--out", required=True, help="merged Zarr store (path or fsspec URL)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even if GPUs are visible")
    args = ap.parse_args()

    torch.set_num_threads(1)
    # On a machine without GPUs accelerate treats N launched processes as one unless told to use CPUs.
    state = PartialState(cpu=args.cpu or not torch.cuda.is_available())
    model = FakeSegmenter().to(state.device).eval()
    keys = dataset_keys()

    with spillmerge.SpillWriter(args.root) as w, state.split_between_processes(keys) as mine, torch.no_grad():
        for i in range(0, len(mine), args.batch_size):
            batch = mine[i : i + args.batch_size]
            x = torch.stack([frame_input(name, frame) for name, frame in batch]).to(state.device)
            # one call per batch: row j of every output belongs to (name j, frame j)
            w.write_batch([name for name, _ in batch], model(x), frame_idx=[frame for _, frame in batch])
    print(f"process {state.process_index}/{state.num_processes}: wrote {len(mine)} frames", flush=True)
    report = w.merge(args.out, overwrite=True, progress=False)
    if report is not None:
        print(report, flush=True)


if __name__ == "__main__":
    main()
