"""The torchrun example through the real launcher."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

import spillmerge

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchrun_infer.py"


def _example():
    spec = importlib.util.spec_from_file_location("torchrun_infer", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_torchrun_example_merges_every_frame(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "preds.zarr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(EXAMPLE), "--root", str(root), "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "merged 6 files" in p.stdout and "from 3 ranks" in p.stdout
    ex = _example()
    model = ex.TinySegmenter().eval()
    res = spillmerge.open(str(out))
    keys = ex.dataset()
    assert sorted(res.filenames) == sorted({k[0] for k in keys})
    for name in res.filenames:
        frames = res.frames(name).tolist()
        assert frames == sorted(f for n, f in keys if n == name)
        mask, score = res[name]["mask"].to_torch(), res[name]["score"].to_torch()
        for row, f in enumerate(frames):
            want = ex.predict(model, name, f)
            assert torch.equal(mask[row], want["mask"]) and torch.equal(score[row], want["score"])
    # Running the job again on the same root skips every committed frame and still merges all.
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert spillmerge.open(str(out)).header["n_frames"] == len(keys)
