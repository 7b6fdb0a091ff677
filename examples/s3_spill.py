"""Spill to an object store (s3://) and merge there: independent processes, no shared disk.

    # one process per rank, anywhere that can reach the bucket (RANK / WORLD_SIZE as torchrun sets them)
    RANK=0 WORLD_SIZE=2 python examples/s3_spill.py --root s3://bucket/run1/spill --out s3://bucket/run1/preds.zarr &
    RANK=1 WORLD_SIZE=2 python examples/s3_spill.py --root s3://bucket/run1/spill --out s3://bucket/run1/preds.zarr

Credentials and endpoints are fsspec/s3fs ``storage_options``: by default the usual AWS
environment variables or ``~/.aws``; a MinIO / Ceph / test server needs its endpoint::

    --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}, "key": "...", "secret": "..."}'

The same options serve the spill root and the output (same protocol); pass
``out_storage_options`` to ``merge`` when they differ. spillmerge configures botocore's
``standard`` retry mode (10 attempts) unless ``config_kwargs`` says otherwise. Each rank writes
only below ``rank-RRRRR/`` of the root, whole objects, once; rank 0 then waits on the bucket for
every rank's commit record (no torch.distributed) and merges into ``--out``. The same
``storage_options`` go to ``spillmerge merge s3://... --storage-option KEY=VALUE`` and
``spillmerge.open(out, storage_options)``. Needs s3fs: ``pip install 'spillmerge[s3]'``.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="spill root, e.g. s3://bucket/run1/spill")
    ap.add_argument("--out", required=True, help="merged store, e.g. s3://bucket/run1/preds.zarr")
    ap.add_argument("--storage-options", type=json.loads, default=None, help="fsspec/s3fs options as JSON")
    ap.add_argument("--run-id", help="id shared by the ranks of this run (default: the launcher's, if any)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds rank 0 waits for the other ranks")
    args = ap.parse_args()

    torch.set_num_threads(1)
    model = FakeSegmenter().eval()
    # rank / world size: env RANK / WORLD_SIZE here (or torch.distributed when initialised)
    with spillmerge.SpillWriter(args.root, storage_options=args.storage_options, run_id=args.run_id) as w:
        mine = dataset_keys()[w.rank :: w.world_size]
        with torch.no_grad():
            for name, frame in mine:
                out = model(frame_input(name, frame)[None])
                w.write(name, frame, {k: v[0] for k, v in out.items()})
    print(f"rank {w.rank}: spilled {len(mine)} frames to {w.segment_path}", flush=True)
    report = w.merge(args.out, timeout=args.timeout, overwrite=True, progress=False)
    if report is not None:
        print(report, flush=True)
        res = spillmerge.open(args.out, storage_options=args.storage_options)
        print(f"{args.out}: {len(res.filenames)} files, {res.header['n_frames']} frames", flush=True)


if __name__ == "__main__":
    main()
