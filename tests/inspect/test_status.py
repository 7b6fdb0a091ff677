"""``spillmerge status`` / ``spillmerge.status`` against a live job: real processes (env RANK /
WORLD_SIZE), on a local disk and on the moto S3 server, with one rank stalled, one failed, one
committed and one that never started."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import _status_workers
import pytest
from _procs import join_all, rank_context

import spillmerge
from spillmerge import cli


def _poll(root: str, options: dict[str, Any], ok: Any, timeout: float = 90) -> spillmerge.JobStatus:
    deadline = time.monotonic() + timeout
    while True:
        try:
            js = spillmerge.status(root, stall_after=3.0, storage_options=options or None)
        except spillmerge.NotASpillRootError:  # no rank has opened its writer yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
            continue
        if ok(js) or time.monotonic() > deadline:
            return js
        time.sleep(0.3)


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_status_of_a_live_job_with_a_stalled_a_failed_and_a_missing_rank(where, tmp_path, request, capsys, monkeypatch):
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
    ctx = rank_context()
    procs = {
        r: ctx.Process(target=_status_workers.run, args=(root, options, role, go, r, 4)) for r, role in roles.items()
    }
    for proc in procs.values():
        proc.start()
    try:
        js = _poll(root, options, lambda js: [r.state for r in js.ranks] == ["committed", "writing", "failed", "missing"]
                   and js.ranks[1].stalled and js.ranks[1].durable == 28)  # fmt: skip
        states = [r.state for r in js.ranks]
        assert states == ["committed", "writing", "failed", "missing"], js
        assert js.world_size == 4 and js.expected == 200 and not js.done
        r0, r1, r2, r3 = js.ranks
        assert (r0.frames, r0.bytes) == (40, 40 * 1024)
        # Rank 1 wrote 30 KiB in 4 KiB chunks: all but the last partial chunk is durable.
        # (The threshold is above the progress record's 2 s interval: a rank that writes is never
        # flagged between two rewrites.)
        assert (r1.frames, r1.bytes, r1.durable) == (30, 30 * 1024, 28) and r1.stalled
        assert r1.last_write_age_s is not None and r1.last_write_age_s > 3.0
        assert "RuntimeError: boom on rank 2" in (r2.message or "")
        assert r2.frames == 20  # its last progress record is written before its failure record
        assert (r3.frames, r3.last_write_age_s, r3.segment) == (0, None, None)

        # The same through the CLI, as the one JSON object the docs promise; on S3 the endpoint
        # comes from the environment, as a user's would.
        for name, value in so_env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        rc = cli.main(["status", root, "--json", "--stall-after", "3", *cli_opts])
        printed = capsys.readouterr()
        assert rc == 1, printed.err  # a rank failed
        doc = json.loads(printed.out)
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
        cli.main(["status", root, "--stall-after", "3", *cli_opts])
        text = capsys.readouterr().out
        assert "STALLED" in text and "missing" in text and "boom on rank 2" in text, text
        assert "of 200 expected" in text

        Path(go).touch()  # rank 1 goes on and commits
        join_all(list(procs.values()), timeout=120)
        assert {r: proc.exitcode == 0 for r, proc in procs.items()} == {0: True, 1: True, 2: False}
        js = spillmerge.status(root, storage_options=options or None)
        assert [r.state for r in js.ranks] == ["committed", "committed", "failed", "missing"]
        assert js.ranks[1].frames == 30 and not js.ranks[1].stalled
    finally:
        Path(go).touch()
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(30)


def test_watch_ends_when_every_rank_has_ended_and_shows_the_merge(tmp_path, capsys):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    for rank in range(2):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
            for i in range(5):
                w.write("a.mp4", rank * 5 + i, __import__("torch").ones(8))
    capsys.readouterr()
    rc = cli.main(["status", str(root), "--watch", "--interval", "0.1", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "merge into" in printed.out and "not-started" in printed.out and "2 committed" in printed.out
    spillmerge.merge(str(root), str(out))
    js = spillmerge.status(str(root), out=str(out))
    assert js.done and js.merge is not None and js.merge.state == "complete" and js.frames == 10


def test_watch_ends_when_the_ranks_left_have_unreadable_records(tmp_path, capsys, monkeypatch):
    """A rank whose commit record cannot be read never mends by waiting: ``--watch`` ends once
    every other rank has ended, naming it, with exit status 1 (not a redraw forever)."""
    root = tmp_path / "spill"
    for rank in range(2):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
            w.write("a.mp4", rank, __import__("torch").ones(8))
    (_seg(root, 1) / "commit.json").write_bytes(b"not a record")
    redraws = []

    def sleep(seconds: float) -> None:
        redraws.append(seconds)
        assert len(redraws) < 5, "status --watch keeps redrawing a job that has ended"

    monkeypatch.setattr(time, "sleep", sleep)
    capsys.readouterr()
    rc = cli.main(["status", str(root), "--watch", "--interval", "0.1"])
    printed = capsys.readouterr()
    assert rc == 1 and redraws == [], printed
    assert "unreadable" in printed.out and "commit.json" in printed.out, printed.out


# --- bounded reads, a bad advisory record, what is written before a chunk fills -------------------


def _seg(root: Path, rank: int) -> Path:
    (seg,) = (root / f"rank-{rank:05d}").glob("seg-*")
    return seg


def _claim(root: Path, rank: int, world_size: int) -> None:
    """Rank ``rank``'s newest segment header says ``world_size``."""
    p = _seg(root, rank) / "zarr.json"
    doc = json.loads(p.read_text())
    doc["attributes"]["spillmerge"]["world_size"] = world_size
    p.write_text(json.dumps(doc))


def _cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    from spillmerge.cli import main

    capsys.readouterr()
    t = time.monotonic()
    rc = main(argv)
    seconds = time.monotonic() - t
    got = capsys.readouterr()
    assert seconds < 5, f"status took {seconds:.1f} s"
    return rc, got.out, got.err


def _open_writer(root: Path, rank: int, world: int, frames: int = 1) -> spillmerge.SpillWriter:
    import torch

    w = spillmerge.SpillWriter(root, rank=rank, world_size=world, chunk_bytes=1 << 20)
    w.__enter__()
    for i in range(frames):
        w.write(f"r{rank}.mp4", i, torch.ones(8))
    return w


def test_status_reads_rank_folders_within_the_world_size_only(tmp_path, capsys):
    """A planted ``rank-1000000000000/<seg>/zarr.json`` and a header claiming world size 2**24:
    answered at once (one line for the folder outside), where status allocated by rank number."""
    import tracemalloc

    root = tmp_path / "spill"
    with spillmerge.SpillWriter(root, rank=0, world_size=2) as w:
        w.write("a.mp4", 0, __import__("torch").ones(8))
    w1 = _open_writer(root, 1, 2)
    try:
        planted = root / "rank-1000000000000" / _seg(root, 1).name
        planted.mkdir(parents=True)
        (planted / "zarr.json").write_bytes((_seg(root, 1) / "zarr.json").read_bytes())
        _claim(root, 1, 1 << 24)  # the writing segment's header lies; rank 0's commit says 2
        tracemalloc.start()
        rc, out, _ = _cli(["status", str(root), "--json"], capsys)
        assert tracemalloc.get_traced_memory()[1] < 32 << 20
        tracemalloc.stop()
        doc = json.loads(out)
        assert rc == 0 and doc["world_size"] == 2 and [r["state"] for r in doc["ranks"]] == ["committed", "writing"]
        assert not doc["done"] and doc["missing"] == 0
        assert any("outside world size 2" in n and "rank-1000000000000" in n for n in doc["notes"]), doc["notes"]
        assert any("rank 1 says 16777216" in n for n in doc["notes"]), doc["notes"]
        rc, out, _ = _cli(["status", str(root)], capsys)
        assert rc == 0 and "world size 2" in out and out.count("rank-1000000000000") == 1, out

        # Writing segments only, whose headers disagree: no world size is taken from either.
        _claim(root, 0, 1 << 24)
        (_seg(root, 0) / "commit.json").unlink()
        _claim(root, 0, 2)
        js = spillmerge.status(str(root))
        assert js.world_size is None and [r.rank for r in js.ranks] == [0, 1] and not js.done
        assert any("disagree" in n for n in js.notes), js.notes
        # One header alone claiming 2**24 is agreed on: the missing ranks are counted, not listed.
        _claim(root, 1, 1 << 24)
        _claim(root, 0, 1 << 24)
        t = time.monotonic()
        js = spillmerge.status(str(root))
        assert time.monotonic() - t < 5
        assert js.world_size == 1 << 24 and js.missing == (1 << 24) - 2 and len(js.ranks) == 2 + 1000
        assert not js.done and any("first 1000 listed" in n for n in js.notes)
    finally:
        w1.__exit__(None, None, None)


def test_a_bad_progress_record_costs_only_its_ranks_counts(tmp_path, capsys):
    """A writing rank's ``progress.json`` that is a FIFO or over 64 KiB: that rank shows no counts
    (and says why), the others theirs, exit 0; a commit record that cannot be read: that rank is
    ``unreadable``, the others shown, exit 1."""
    root = tmp_path / "spill"
    writers = [_open_writer(root, r, 3, frames=3) for r in range(3)]
    try:
        # Once their counts are written, the idle writers rewrite nothing over the plants below.
        js = _poll(str(root), {}, lambda js: [r.frames for r in js.ranks] == [3, 3, 3], timeout=30)
        assert [r.frames for r in js.ranks] == [3, 3, 3]
        fifo, big = _seg(root, 0) / "progress.json", _seg(root, 1) / "progress.json"
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
        big.write_bytes(b" " * (65 << 10))
        rc, out, _ = _cli(["status", str(root), "--json"], capsys)
        doc = json.loads(out)
        assert rc == 0 and [r["state"] for r in doc["ranks"]] == ["writing"] * 3
        r0, r1, r2 = doc["ranks"]
        assert r0["frames"] == 0 and "FIFO" in r0["message"] and "progress.json" in r0["message"]
        assert r1["frames"] == 0 and "65536" in r1["message"]
        assert r2["frames"] == 3 and r2["message"] is None and not (r0["stalled"] or r1["stalled"])
        os.mkfifo(_seg(root, 2) / "commit.json")
        rc, out, _ = _cli(["status", str(root), "--json"], capsys)
        doc = json.loads(out)
        assert rc == 1 and [r["state"] for r in doc["ranks"]] == ["writing", "writing", "unreadable"]
        assert "commit.json" in doc["ranks"][2]["message"]
        fifo.unlink()
        (_seg(root, 2) / "commit.json").unlink()
    finally:
        for w in writers:
            w.__exit__(None, None, None)


def test_status_shows_frames_written_before_a_chunk_fills_and_stalls_only_idle_ranks(tmp_path, capsys):
    """Frames of 96 B fill a 16 MiB chunk only after ~175,000 frames: status shows them as they are
    written, does not flag the rank while it writes, and flags it once it has written nothing for
    the stall time; a missing rank keeps the job from being done."""
    import torch

    root = tmp_path / "spill"
    w = spillmerge.SpillWriter(root, rank=0, world_size=2)  # 16 MiB chunks
    w.__enter__()
    try:
        x, n, seen = torch.ones(24), 0, []
        end = time.monotonic() + 7
        while time.monotonic() < end:
            w.write(f"img_{n}.jpg", 0, x)
            n += 1
            if n % 100 == 0:
                time.sleep(0.05)
                # progress.json is rewritten every 2 s: 5 s leaves the flush thread 3 s of slack
                # on a loaded machine before a rank that writes looks stalled
                js = spillmerge.status(str(root), stall_after=5.0)
                seen.append((js.ranks[0].frames, js.ranks[0].stalled))
        assert n * 96 < 16 << 20 and not any(stalled for _, stalled in seen), seen
        assert seen[-1][0] > 0 and seen[-1][0] <= n and seen[-1][0] > seen[len(seen) // 3][0], seen
        js = _poll(str(root), {}, lambda js: js.ranks[0].frames == n)
        r0, r1 = js.ranks
        assert (r0.state, r0.frames, r0.bytes, r0.durable) == ("writing", n, n * 96, 0)
        assert r1.state == "missing" and not js.done
        js = _poll(str(root), {}, lambda js: js.ranks[0].stalled, timeout=15)
        assert js.ranks[0].stalled and js.ranks[0].last_write_age_s > 3.0
        rc, out, _ = _cli(["status", str(root), "--json", "--stall-after", "3"], capsys)
        doc = json.loads(out)
        assert doc["ranks"][0]["stalled"] and doc["ranks"][1]["state"] == "missing" and doc["done"] is False
    finally:
        w.__exit__(None, None, None)
    js = spillmerge.status(str(root))
    assert js.ranks[0].state == "committed" and js.ranks[0].frames == n and not js.done and js.missing == 1


@pytest.mark.parametrize("what", ["missing", "output", "empty", "file"])
def test_status_of_a_path_that_is_no_spill_root_is_a_one_line_error(what, tmp_path, capsys):
    path = tmp_path / "x"
    if what == "output":
        root = tmp_path / "spill"
        with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
            w.write("a.mp4", 0, __import__("torch").ones(2))
        spillmerge.merge(str(root), str(path))
    elif what == "empty":
        path.mkdir()
    elif what == "file":
        path.write_text("x")
    rc, out, err = _cli(["status", str(path)], capsys)
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and "world size" not in err
    want = {"missing": "does not exist", "output": "merged output, not a spill root", "empty": "no rank-NNNNN",
            "file": "is a file"}[what]  # fmt: skip
    assert want in err
    with pytest.raises(spillmerge.NotASpillRootError) as e:
        spillmerge.status(str(path))
    assert e.value.kind == {"empty": "other"}.get(what, what)
