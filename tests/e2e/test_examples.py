"""The examples of examples/ run as a user runs them, each on 2 CPU processes, with the merged
store checked bit for bit: Lightning's own ddp launcher, `accelerate launch`, a SLURM array (the
sbatch script with SLURM's environment, then `spillmerge merge`), and S3 (a moto server); and the
format-2 examples under a plain launcher (RANK / WORLD_SIZE / MASTER_PORT, gloo): detection boxes
and LLM generations (ragged values and strings), and the dataset all-gather (2 ranks, like the others: every rank reads what all ranks kept)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from _example_check import EXAMPLES, assert_every_prediction, example

import spillmerge
from spillmerge import cli

TIMEOUT = 300  # seconds per launch; a hang fails the test
BIN = Path(sys.executable).parent


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher's variables, so each example sees only its own."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    repo = str(EXAMPLES.parent)
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, env=_env(**env))
    assert p.returncode == 0, f"{shlex.join(cmd)} failed ({p.returncode})\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _needs(package: str) -> pytest.MarkDecorator:
    """Skip unless ``package`` is installed, without importing it here: only the launched
    processes use it (importing lightning costs this process seconds of CPU)."""
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


def _n_frames() -> int:
    return len(example().dataset_keys())


def _committed_ranks(root: Path) -> list[int]:
    return sorted(json.loads(c.read_text())["rank"] for c in root.glob("rank-*/seg-*/commit.json"))


@_needs("lightning")
def test_lightning_ddp_predict_merges_every_frame(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "preds.zarr"
    p = _run([sys.executable, str(EXAMPLES / "lightning_predict.py"), "--root", str(root), "--out", str(out),
              "--devices", "2"], tmp_path, MASTER_PORT=str(_free_port()))  # fmt: skip
    assert f"merged 7 files, {_n_frames()} frames" in p.stdout and "from 2 ranks" in p.stdout, p.stdout
    assert "rank 0: wrote" in p.stdout and "rank 1: wrote" in p.stdout, p.stdout
    assert _committed_ranks(root) == [0, 1]
    res = spillmerge.open(str(out))
    assert_every_prediction(res)
    ranks = {int(r) for name in res.filenames for r in res.frame_ranks(name)}
    assert ranks == {0, 1}  # both Lightning processes predicted, nothing was gathered


@_needs("accelerate")
def test_accelerate_launch_replaces_gather_object(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "preds.zarr"
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           str(EXAMPLES / "accelerate_infer.py"), "--cpu", "--root", str(root), "--out", str(out)]  # fmt: skip
    p = _run(cmd, tmp_path)
    assert "process 0/2: wrote" in p.stdout and "process 1/2: wrote" in p.stdout, p.stdout
    assert f"merged 7 files, {_n_frames()} frames" in p.stdout and "duplicate" not in p.stdout, p.stdout
    assert _committed_ranks(root) == [0, 1]
    assert_every_prediction(spillmerge.open(str(out)))


def test_slurm_array_then_cli_merge(tmp_path):
    """The sbatch script itself, run as SLURM runs each array task (its environment; both tasks
    at once, as an array's tasks run), with an `sbatch` on PATH that records the merge job and
    which task submitted it; then that merge command (through ``cli.main``: the installed console
    script has its own test in tests/cli)."""
    root, out = tmp_path / "spill", tmp_path / "preds.zarr"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    sbatch = fake_bin / "sbatch"
    record = shlex.quote(str(tmp_path)) + '/submitted-by-task-"$SLURM_ARRAY_TASK_ID".txt'
    sbatch.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {record}\n')
    sbatch.chmod(0o755)
    slurm = {"SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "0",
             "SLURM_SUBMIT_DIR": str(EXAMPLES.parent), "ROOT": str(root), "OUT": str(out), "PYTHON": sys.executable,
             "PATH": os.pathsep.join([str(fake_bin), str(BIN), os.environ.get("PATH", "")])}  # fmt: skip
    tasks = [  # the tasks never talk to each other: they run side by side
        subprocess.Popen(["bash", str(EXAMPLES / "slurm_array.sbatch")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env(SLURM_ARRAY_TASK_ID=str(task), **slurm))
        for task in (1, 0)
    ]  # fmt: skip
    for task, stdout in zip((1, 0), _wait(tasks), strict=True):
        assert f"task rank {task}/2: wrote" in stdout, stdout
    # only the first task submitted the merge
    assert sorted(p.name for p in tmp_path.glob("submitted-*")) == ["submitted-by-task-0.txt"]
    args = (tmp_path / "submitted-by-task-0.txt").read_text().splitlines()
    assert "--dependency=afterany:4242" in args
    merge_cmd = shlex.split(args[args.index("--wrap") + 1])  # as the job's shell splits it
    assert merge_cmd[:2] == ["spillmerge", "merge"], merge_cmd
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(merge_cmd[1:])
    assert code == 0, (merge_cmd, stdout.getvalue(), stderr.getvalue())
    assert f"merged 7 files, {_n_frames()} frames" in stdout.getvalue(), stdout.getvalue()
    assert "from 2 ranks" in stdout.getvalue(), stdout.getvalue()
    commits = [json.loads(c.read_text()) for c in root.glob("rank-*/seg-*/commit.json")]
    assert sorted(c["rank"] for c in commits) == [0, 1] and {c["run_id"] for c in commits} == {"slurm-4242"}
    assert_every_prediction(spillmerge.open(str(out)))


@pytest.mark.s3
def test_s3_example_spills_and_merges_on_the_object_store(s3, tmp_path):
    from _s3 import storage_options

    opts = json.dumps(storage_options(s3.endpoint))
    cmd = [sys.executable, str(EXAMPLES / "s3_spill.py"), "--root", "s3://test/run1/spill",
           "--out", "s3://test/run1/preds.zarr", "--storage-options", opts, "--run-id", "run1", "--timeout", "120"]  # fmt: skip
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=_env(RANK=str(r), WORLD_SIZE="2"),
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert f"merged 7 files, {_n_frames()} frames" in outs[0][0] and "from 2 ranks" in outs[0][0], outs[0][0]
    assert f"s3://test/run1/preds.zarr: 7 files, {_n_frames()} frames" in outs[0][0]
    assert "merged" not in outs[1][0]  # rank 1 returned at once
    res = spillmerge.open("s3://test/run1/preds.zarr", storage_options=storage_options(s3.endpoint))
    assert_every_prediction(res)


# ------------------------------------------------ format 2 examples: ragged values and strings
def _module(name: str) -> ModuleType:
    """An example script imported as a module (its helpers recompute the expected values)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch(script: str, args: list[str], world: int, cwd: Path) -> list[subprocess.Popen[str]]:
    """A plain launcher: ``world`` processes with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    (what torchrun sets, without its agent, to keep these tests fast)."""
    port = str(_free_port())
    cmd = [sys.executable, str(EXAMPLES / script), *args]
    return [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        )  # fmt: skip
        for r in range(world)
    ]


def _wait(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Every process's stdout, once all exited 0 (a hang fails after TIMEOUT)."""
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, (
                f"{shlex.join(p.args)} failed ({p.returncode})\nstdout:\n{stdout}\nstderr:\n{stderr}"
            )
            outs.append(stdout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def _same(got: Any, want: torch.Tensor) -> bool:
    got = np.asarray(got)
    return (
        got.dtype == want.numpy().dtype and got.shape == tuple(want.shape) and got.tobytes() == want.numpy().tobytes()
    )


def test_detection_and_llm_examples_store_ragged_values_and_text(tmp_path):
    """Both examples at once (2 ranks each): boxes of 0..5 per image and token ids of 1..48 per
    generation come back bit for bit, per file and through res.column, with their strings."""
    det, llm = _module("detection_infer"), _module("llm_generate")
    d_out, l_out = tmp_path / "dets.zarr", tmp_path / "gen.zarr"
    procs = _launch("detection_infer.py", ["--root", str(tmp_path / "dspill"), "--out", str(d_out)], 2, tmp_path)
    procs += _launch("llm_generate.py", ["--root", str(tmp_path / "lspill"), "--out", str(l_out)], 2, tmp_path)
    outs = _wait(procs)

    names = det.image_names()
    assert "rank 0: wrote 20 images" in outs[0] and "rank 1: wrote 20 images" in outs[1], outs
    assert f"merged {len(names)} files, {len(names)} frames" in outs[0], outs[0]
    res = spillmerge.open(str(d_out))
    assert res.filenames == sorted(names)
    want = {name: det.expected_prediction(name) for name in res.filenames}
    counts = [len(w["scores"]) for w in want.values()]
    assert min(counts) == 0 and max(counts) == det.MAX_BOXES  # ragged, empty rows included
    for name, w in want.items():
        value = res[name]
        for leaf in ("boxes", "scores", "labels"):
            assert _same(value[leaf][0], w[leaf]), (name, leaf)
        assert value["top_class"][0] == w["top_class"]
    boxes = res.column("boxes")
    assert len(boxes) == len(names)
    for row, w in enumerate(want.values()):
        assert _same(boxes[row], w["boxes"]), row
    assert f"{len(names)} images, {sum(counts)} boxes in all" in outs[0], outs[0]

    ids = llm.prompts()
    assert "rank 0: wrote 24 generations" in outs[2] and "rank 1: wrote 24 generations" in outs[3], outs
    assert f"merged {len(ids)} files, {2 * len(ids)} frames" in outs[2], outs[2]
    res = spillmerge.open(str(l_out))
    assert res.filenames == sorted(ids)
    rows = []
    for pid in res.filenames:
        assert res.frames(pid).tolist() == [0, 1]
        for sample in (0, 1):
            w = llm.expected_generation(pid, sample)
            rows.append(w)
            value = res[pid]
            assert _same(value["token_ids"][sample], w["token_ids"]), (pid, sample)
            assert value["text"][sample] == w["text"] and value["prompt"][sample] == w["prompt"]
    assert any("日本語" in w["text"] for w in rows) and len({len(w["token_ids"]) for w in rows}) > 10
    col = res.column("token_ids")
    for row, w in enumerate(rows):
        assert _same(col[row], w["token_ids"]), row
    assert list(res.column("text")[:]) == [w["text"] for w in rows]


def test_dataset_all_gather_example_matches_all_gather_object(tmp_path):
    """Gloo ranks tokenise, filter and all_gather; every rank reads the union and checks it bit
    for bit against all_gather_object of the same samples in the same run. Two ranks: each one
    reads a share it did not write, as at any world size (tests/distributed/test_gather.py runs
    all_gather itself at more ranks)."""
    world = 2
    ex = _module("dataset_all_gather")
    out = tmp_path / "tokens.zarr"
    outs = _wait(_launch("dataset_all_gather.py", ["--out", str(out), "--compare"], world, tmp_path))
    union = {k: v for r in range(world) for k, v in ex.my_samples(r, world).items()}
    assert 0 < len(union) < len(ex.documents())  # some samples were dropped by the filter
    assert all(ex.my_samples(r, world) for r in range(world))  # every rank kept some
    for r, stdout in enumerate(outs):
        assert f"rank {r}: kept {len(ex.my_samples(r, world))} samples" in stdout, stdout
        assert f"rank {r}: read {len(union)} samples" in stdout, stdout
        assert f"rank {r}: identical to all_gather_object ({len(union)} samples)" in stdout, stdout
    assert sorted(os.listdir(tmp_path)) == ["tokens.zarr"]  # the spill root was removed
    res = spillmerge.open(str(out))
    assert res.filenames == sorted(union)
    for doc_id, s in union.items():
        for leaf, t in s.items():
            assert _same(res[doc_id][leaf][0], t), (doc_id, leaf)
