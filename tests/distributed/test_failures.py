"""Failure modes with real processes: raising ranks, SIGKILLed ranks, killed merges, full disks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _failure_workers import enospc_spill, frame, raising_rank, slow_spiller
from _procs import free_port, join_all, rank_context

import spillmerge
from spillmerge import cli
from spillmerge._format import output as FO

CTX = rank_context()
EXE = shutil.which("spillmerge", path=os.path.dirname(sys.executable)) or "spillmerge"


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``spillmerge ARGS`` through ``cli.main`` in this process: exit status, stdout, stderr."""
    capsys.readouterr()
    rc = cli.main(list(args))
    printed = capsys.readouterr()
    return rc, printed.out, printed.err


def test_a_raising_rank_is_named_within_seconds_on_every_merge_path(tmp_path, capsys):
    root, out, result = str(tmp_path / "spill"), str(tmp_path / "out"), str(tmp_path / "res")
    port = free_port()
    procs = [CTX.Process(target=raising_rank, args=(r, 4, port, root, out, result)) for r in range(4)]
    for p in procs:
        p.start()
    join_all(procs, timeout=120)
    infos = {r: json.loads(Path(f"{result}.{r}").read_text()) for r in range(4)}
    assert not any("crash" in i for i in infos.values()), infos
    assert infos[2]["raised"] == "model blew up on frame 22"
    r0 = infos[0]
    assert r0["error"] == "RankFailedError", r0
    assert r0["failures"] == {"2": "ValueError: model blew up on frame 22"}
    assert "rank 2: ValueError: model blew up on frame 22" in r0["message"]
    assert r0["detected_at"] - infos[2]["raised_at"] < 10
    for r in (1, 3):  # every rank's merge() ends with the same news, none hangs
        assert infos[r]["error"] == "RankFailedError" and infos[r]["failures"] == {
            "2": "ValueError: model blew up on frame 22"
        }
        assert "rank 2: ValueError: model blew up on frame 22" in infos[r]["message"], infos[r]
    # The failure record holds the traceback; the CLI names the rank at once.
    record = next(Path(root).glob("rank-00002/seg-*/failed.json"))
    assert "model blew up" in json.loads(record.read_text())["traceback"]
    t0 = time.time()
    rc, _, err = _cli(capsys, "merge", root, "--out", out, "--timeout", "60")
    assert rc == 1 and "rank 2: ValueError: model blew up on frame 22" in err
    assert time.time() - t0 < 30


def test_sigkilled_rank_times_out_by_name_and_partial_merge_salvages(tmp_path, capsys):
    root, ready = str(tmp_path / "spill"), str(tmp_path / "ready")
    procs = {r: CTX.Process(target=slow_spiller, args=(root, r, 3, 12 if r != 1 else 9, ready)) for r in range(3)}
    for p in procs.values():
        p.start()
    deadline = time.time() + 120
    while not os.path.exists(ready) and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(ready), "rank 1 never reached its kill point"
    os.kill(procs[1].pid, signal.SIGKILL)
    join_all(list(procs.values()), timeout=120)
    assert procs[1].exitcode == -signal.SIGKILL and procs[0].exitcode == 0 and procs[2].exitcode == 0
    t0 = time.time()
    with pytest.raises(spillmerge.CommitTimeout) as info:
        spillmerge.merge(root, str(tmp_path / "out"), timeout=2)
    assert 2 <= time.time() - t0 < 10
    assert info.value.missing == [1]
    assert "rank 1 (uncommitted segment" in str(info.value) and "9 chunk(s) flushed" in str(info.value)
    rep = spillmerge.merge(root, str(tmp_path / "out"), allow_partial=True)
    assert rep.missing_ranks == [1] and rep.salvaged_frames == {1: 9}
    res = spillmerge.open(str(tmp_path / "out"))
    assert res.frames("task1.mp4").tolist() == list(range(9))
    assert torch.equal(res["task1.mp4"].to_torch()[8], frame("task1.mp4", 8))
    assert res.frames("task0.mp4").tolist() == list(range(12))
    # Without a manifest nothing can say what rank 1 never flushed; the report says so.
    assert rep.frame_gaps == {} and "--expected" in str(rep)
    # With one, every missing frame is listed by file, the never-flushed file included.
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("filename,n_frames\n" + "".join(f"task{r}.mp4,12\n" for r in range(3)) + "only1.mp4,1\n")
    rc, printed, err = _cli(
        capsys, "merge", root, "--out", str(tmp_path / "out2"), "--allow-partial", "--expected", str(manifest)
    )
    assert rc == 1, err
    assert "PARTIAL: ranks [1] missing" in printed
    assert "4 frame(s) missing in 2 file(s) against the expected counts" in printed, printed
    assert "'task1.mp4': frames 9..11" in printed and "'only1.mp4': frames 0" in printed
    assert spillmerge.open(str(tmp_path / "out2")).frames("task1.mp4").tolist() == list(range(9))


def _spill_many(root: str, n_files: int) -> None:
    with spillmerge.SpillWriter(root, chunk_bytes=1 << 20) as w:
        for i in range(n_files):
            for f in range(4):
                w.write(f"file{i:04d}.mp4", f, torch.full((64,), float(i * 10 + f)))


def test_merge_killed_halfway_is_recognised_and_rebuilt(tmp_path, capsys):
    root, out = str(tmp_path / "spill"), tmp_path / "out"
    _spill_many(root, 1000)
    # Output chunks of one row (256 bytes) and 1 thread make the merge slow enough to kill in the middle.
    proc = subprocess.Popen(
        [EXE, "merge", root, "--out", str(out), "--chunk-bytes", "256", "--threads", "1", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # Kill it once an eighth of the 4000 chunks of the one column (one 64-value row each) are written,
    # long before the index and the marker.
    chunks = out / "columns" / "_value" / "values" / "c"
    deadline = time.time() + 120
    while time.time() < deadline:
        if chunks.exists() and len(os.listdir(chunks)) >= 500:
            break
        time.sleep(0.02)
    proc.kill()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the merge finished before it could be killed"
    assert not (out / FO.COMPLETE_NAME).exists()
    with pytest.raises(spillmerge.IncompleteOutputError, match="did not finish"):
        spillmerge.open(str(out))
    rc, printed, _ = _cli(capsys, "verify", str(out))
    assert rc == 1 and "merge did not finish" in printed
    rc, _, err = _cli(capsys, "merge", root, "--out", str(out))
    assert rc == 0, err
    res = spillmerge.open(str(out))
    assert len(res.filenames) == 1000
    assert res["file0999.mp4"][3, 0] == 9993.0


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_reaches_the_loop_and_keeps_committed_data(tmp_path, tiny_tmpfs):
    root = str(tiny_tmpfs / "spill")
    with spillmerge.SpillWriter(root, rank=0, world_size=2, chunk_bytes=64 << 10) as w:
        w.write("small.mp4", 0, torch.ones(100))
    result = str(tmp_path / "enospc.json")
    p = CTX.Process(target=enospc_spill, args=(root, result))
    p.start()
    join_all([p], timeout=120)
    info = json.loads(Path(result).read_text())
    assert info["error"] == "SpillStorageError"
    assert "No space left on device" in info["message"] and root in info["message"]
    # Rank 0's committed segment is intact and merges; rank 1 is named as failed or missing.
    with pytest.raises((spillmerge.RankFailedError, spillmerge.IncompleteSpillError), match="rank"):
        spillmerge.merge(root, str(tmp_path / "out"))
    rep = spillmerge.merge(root, str(tmp_path / "out"), allow_partial=True)
    assert rep.missing_ranks == [1]
    assert spillmerge.open(str(tmp_path / "out"))["small.mp4"][0][0] == 1.0  # row 0, value 0 (any leaf kind)


def test_read_only_root_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        with pytest.raises(spillmerge.SpillStorageError, match="Read-only file system") as info:
            spillmerge.SpillWriter(str(ro / "spill")).__enter__()
        assert str(ro) in str(info.value)
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


_PERMISSION_CHILD = r"""
import json, os, sys, numpy, spillmerge
denied, own = sys.argv[1], sys.argv[2]
out = {}
try:  # A: a rank folder cannot be created under a root we may not write
    with spillmerge.SpillWriter(denied, rank=1, world_size=2) as w:
        w.write("b.mp4", 0, numpy.ones(4, numpy.float32))
except spillmerge.SpillMergeError as e:
    out["open"] = [type(e).__name__, str(e)]
try:  # B: permission taken away while spilling: the flush thread's error reaches the loop
    with spillmerge.SpillWriter(own, rank=0, world_size=1, chunk_bytes=4096, staging_bytes=8192) as w:
        w.write("c.mp4", 0, numpy.zeros(1024, numpy.float32))
        for d, _, _ in os.walk(own):
            os.chmod(d, 0o555)
        for i in range(1, 50):
            w.write("c.mp4", i, numpy.full(1024, i, numpy.float32))
except spillmerge.SpillMergeError as e:
    out["spill"] = [type(e).__name__, str(e), i]
print(json.dumps(out))
"""


def test_permission_denied_reaches_the_loop_with_the_path_and_keeps_committed_data(tmp_path):
    cmd = [sys.executable, "-c", _PERMISSION_CHILD]
    if os.geteuid() == 0:  # root ignores permissions: run the writer without that capability
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    denied, own = tmp_path / "denied", tmp_path / "own"
    with spillmerge.SpillWriter(str(denied), rank=0, world_size=2) as w:
        w.write("a.mp4", 0, torch.ones(4))
    os.chmod(denied, 0o555)  # no rank folder can be added now
    try:
        p = subprocess.run([*cmd, str(denied), str(own)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        info = json.loads(p.stdout.strip().splitlines()[-1])
        assert info["open"][0] == "SpillStorageError", info
        assert "Permission denied" in info["open"][1] and str(denied) in info["open"][1], info
        kind, message, at = info["spill"]
        assert kind == "SpillStorageError" and "Permission denied" in message and str(own) in message, info
        assert at < 49  # raised in the loop, not only at exit
        # What rank 0 committed before is intact and merges; rank 1 is named.
        rep = spillmerge.merge(str(denied), str(tmp_path / "out"), allow_partial=True)
        assert rep.missing_ranks == [1]
        assert spillmerge.open(str(tmp_path / "out"))["a.mp4"][0, 0] == 1.0
    finally:
        for d, _, _ in os.walk(tmp_path):
            os.chmod(d, 0o755)
