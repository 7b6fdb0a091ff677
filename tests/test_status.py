"""``spillmerge status`` / ``spillmerge.status`` against a live job: real processes (env RANK /
WORLD_SIZE), on a local disk and on the moto S3 server, with one rank stalled, one failed, one
committed and one that never started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import spillmerge

HERE = Path(__file__).parent
EXE = os.path.join(os.path.dirname(sys.executable), "spillmerge")


def _env(rank: int, world: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    return env


def _poll(root: str, options: dict[str, Any], ok: Any, timeout: float = 90) -> spillmerge.JobStatus:
    deadline = time.monotonic() + timeout
    while True:
        js = spillmerge.status(root, stall_after=3.0, storage_options=options or None)
        if ok(js) or time.monotonic() > deadline:
            return js
        time.sleep(0.3)


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_status_of_a_live_job_with_a_stalled_a_failed_and_a_missing_rank(where, tmp_path, request):
    if where == "s3":
        from _s3 import storage_options

        server = request.getfixturevalue("s3")
        root, options = "s3://test/live/spill", storage_options(server.endpoint)
        cli_opts = ["--storage-option=key=test", "--storage-option=secret=test"]
        so_env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
    else:
        root, options, cli_opts, so_env = str(tmp_path / "spill"), {}, [], {}
    go = str(tmp_path / "go")
    roles = {0: "commit", 1: "stall", 2: "fail"}  # rank 3 of 4 never starts
    procs = {
        r: subprocess.Popen(
            [sys.executable, str(HERE / "_status_workers.py"), root, json.dumps(options), role, go],
            env=_env(r, 4),
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r, role in roles.items()
    }
    try:
        js = _poll(root, options, lambda js: [r.state for r in js.ranks] == ["committed", "writing", "failed", "missing"]
                   and js.ranks[1].stalled and js.ranks[1].frames == 28)  # fmt: skip
        states = [r.state for r in js.ranks]
        assert states == ["committed", "writing", "failed", "missing"], js
        assert js.world_size == 4 and js.expected == 200 and not js.done
        r0, r1, r2, r3 = js.ranks
        assert (r0.frames, r0.bytes) == (40, 40 * 1024)
        # Rank 1's 30 KiB went out in 4 KiB chunks: all but the last partial chunk is durable.
        # (The threshold is above the progress record's 2 s interval: a rank that writes is never
        # flagged between two rewrites.)
        assert (r1.frames, r1.bytes) == (28, 28 * 1024) and r1.stalled
        assert r1.last_write_age_s is not None and r1.last_write_age_s > 3.0
        assert "RuntimeError: boom on rank 2" in (r2.message or "")
        assert r2.frames == 20  # its last progress record is written before its failure record
        assert (r3.frames, r3.last_write_age_s, r3.segment) == (0, None, None)

        # The same through the entry point, as the one JSON object the docs promise.
        env = {**os.environ, **so_env, "PYTHONPATH": str(HERE.parent)}
        p = subprocess.run([EXE, "status", root, "--json", "--stall-after", "3", *cli_opts],
                           capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert p.returncode == 1, p.stderr  # a rank failed
        doc = json.loads(p.stdout)
        assert [(r["rank"], r["state"]) for r in doc["ranks"]] == [
            (0, "committed"),
            (1, "writing"),
            (2, "failed"),
            (3, "missing"),
        ]
        assert doc["ranks"][1]["stalled"] and doc["ranks"][1]["frames"] > 0
        assert doc["ranks"][0]["frames"] == 40 and "boom on rank 2" in doc["ranks"][2]["message"]
        assert set(doc["ranks"][0]) >= {"rank", "state", "frames", "bytes", "last_write_age_s", "message"}
        assert doc["merge"] == {}
        p = subprocess.run([EXE, "status", root, "--stall-after", "3", *cli_opts],
                           capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert "STALLED" in p.stdout and "missing" in p.stdout and "boom on rank 2" in p.stdout, p.stdout
        assert "of 200 expected" in p.stdout

        Path(go).touch()  # rank 1 goes on and commits
        for r, proc in procs.items():
            proc.wait(timeout=120)
            assert (proc.returncode == 0) == (r != 2), proc.stderr.read()
        js = spillmerge.status(root, storage_options=options or None)
        assert [r.state for r in js.ranks] == ["committed", "committed", "failed", "missing"]
        assert js.ranks[1].frames == 30 and not js.ranks[1].stalled
    finally:
        Path(go).touch()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            proc.stderr.close()


def test_watch_ends_when_every_rank_has_ended_and_shows_the_merge(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    for rank in range(2):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
            for i in range(5):
                w.write("a.mp4", rank * 5 + i, __import__("torch").ones(8))
    p = subprocess.run([EXE, "status", str(root), "--watch", "--interval", "0.1", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(HERE.parent)})  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "merge into" in p.stdout and "not-started" in p.stdout and "2 committed" in p.stdout
    spillmerge.merge(str(root), str(out))
    js = spillmerge.status(str(root), out=str(out))
    assert js.done and js.merge is not None and js.merge.state == "complete" and js.frames == 10
