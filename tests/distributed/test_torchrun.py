"""examples/torchrun_infer.py through the real launcher (torch.distributed.run, 2 gloo ranks)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from _example_check import EXAMPLES, assert_every_prediction, example
from _mp_scenarios import HOSTILE, all_keys, check_with_plain_zarr

import spillmerge

EXAMPLE = EXAMPLES / "torchrun_infer.py"
NPROC = 2
TIMEOUT = 300  # seconds per launch; a hang fails the test


def _launch(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return _torchrun(str(EXAMPLE), "--root", str(root), "--out", str(out), cwd=root.parent)


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=cwd)
    assert p.returncode == 0, f"torchrun failed ({p.returncode})\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def _commits(root: Path) -> list[dict]:
    return [json.loads(c.read_text()) for c in sorted(root.glob("rank-*/seg-*/commit.json"))]


def test_torchrun_example_merges_every_frame(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "preds.zarr"
    ex = example()
    keys = ex.dataset_keys()
    names = sorted({name for name, _ in keys})

    p = _launch(root, out)
    assert f"merged {len(names)} files, {len(keys)} frames" in p.stdout, p.stdout
    assert f"from {NPROC} ranks ({NPROC} segments)" in p.stdout, p.stdout
    # Both ranks worked, on uneven shares that together cover every frame once.
    commits = _commits(root)
    assert sorted(c["rank"] for c in commits) == list(range(NPROC))
    shares = [c["n_frames"] for c in sorted(commits, key=lambda c: c["rank"])]
    assert sum(shares) == len(keys) and min(shares) > 0 and len(set(shares)) > 1, shares
    assert len({c["run_id"] for c in commits}) == 1 and commits[0]["run_id"].startswith("torchelastic-")

    assert_every_prediction(spillmerge.open(str(out)))
    assert sorted(os.listdir(tmp_path)) == ["preds.zarr", "spill"]

    # Running the job again on the same root skips every committed frame and still merges all.
    p = _launch(root, out)
    assert len(re.findall(r"rank \d+: wrote 0 frames", p.stdout)) == NPROC, p.stdout
    assert f"merged {len(names)} files, {len(keys)} frames" in p.stdout, p.stdout
    assert f"({2 * NPROC} segments)" in p.stdout, p.stdout
    assert len({c["run_id"] for c in _commits(root)}) == 2
    again = spillmerge.open(str(out))
    assert again.header["n_frames"] == len(keys) and again.filenames == names
    assert sorted(os.listdir(tmp_path)) == ["preds.zarr", "spill"]


def test_torchrun_hostile_names_match_gather_object_and_plain_zarr(tmp_path):
    """The multi-rank main scenario under the real launcher: every hostile filename and dtype,
    bit-exact against gather_object of the same run, and readable without spillmerge."""
    _torchrun(str(Path(__file__).parents[1] / "_torchrun_scenario.py"), str(tmp_path), cwd=tmp_path)
    r0 = json.loads((tmp_path / "torchrun-rank-0.json").read_text())
    assert r0["problems"] == [], "\n".join(r0["problems"])
    keys = all_keys()
    assert r0["gathered_frames"] == r0["frames_checked"] == len(keys) and r0["gathered_overlap"] == 0
    assert r0["report"]["n_files"] == len(HOSTILE) and r0["report"]["nbytes"] == r0["gathered_nbytes"]
    commits = _commits(tmp_path / "main" / "spill")
    assert len(commits) == NPROC and {c["run_id"] for c in commits} == {commits[0]["run_id"]}
    assert commits[0]["run_id"].startswith("torchelastic-")  # the launcher's run id, no collective needed
    check_with_plain_zarr(str(tmp_path / "main" / "out"), keys)
