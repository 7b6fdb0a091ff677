"""A merge waiting for ranks says so on stderr, naming each missing rank and what it is doing;
``progress=False`` keeps it quiet."""

from __future__ import annotations

import time

import pytest
import torch
from _procs import spawn_ranks
from _waits_workers import WORLD, worker

import spillmerge
from spillmerge._spill import barrier as _barrier
from spillmerge._util.progress import PROGRESS_NAME


@pytest.fixture
def spill_root(tmp_path, monkeypatch):
    """Rank 0 committed, rank 1 writing with flushed chunks, rank 2 writing with nothing flushed,
    rank 3 never started (world size 4); notices every 0.2 s instead of 30."""
    monkeypatch.setattr(_barrier, "WAIT_NOTICE_FIRST", 0.05)
    monkeypatch.setattr(_barrier, "WAIT_NOTICE_EVERY", 0.2)
    root = str(tmp_path / "spill")
    with spillmerge.SpillWriter(root, rank=0, world_size=4) as w0:
        w0.write("a.mp4", 0, torch.ones(4))
    w1 = spillmerge.SpillWriter(root, rank=1, world_size=4, chunk_bytes=4096)
    w1.open()
    for i in range(40):
        w1.write("b.mp4", i, torch.full((256,), float(i)))
    w2 = spillmerge.SpillWriter(root, rank=2, world_size=4)
    w2.open()
    progress = next((tmp_path / "spill" / "rank-00001").glob(f"seg-*/{PROGRESS_NAME}"), None)
    deadline = time.monotonic() + 30
    while progress is None and time.monotonic() < deadline:  # the flush thread writes it within seconds
        time.sleep(0.05)
        progress = next((tmp_path / "spill" / "rank-00001").glob(f"seg-*/{PROGRESS_NAME}"), None)
    assert progress is not None
    yield root
    for w in (w1, w2):
        w.abort(RuntimeError("test over"))


def test_a_waiting_merge_names_each_missing_rank_and_what_it_does_on_stderr(spill_root, tmp_path, capfd):
    with pytest.raises(spillmerge.SpillMergeError, match="rank"):
        spillmerge.merge(spill_root, str(tmp_path / "out"), timeout=1.0)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "waiting for" in ln]
    assert len(lines) >= 2, lines  # again and again, not once
    line = lines[-1]
    assert line.startswith(f"spillmerge merge: waiting for 3 of 4 rank(s) to commit to {spill_root} ("), line
    assert "rank 1 (writing, " in line and " frames flushed, last write " in line, line
    assert "rank 2 (writing for " in line and "nothing flushed yet)" in line, line
    assert "rank 3 (no segment yet" in line and "rank 0" not in line, line


def test_progress_false_waits_in_silence(spill_root, tmp_path, capfd):
    with pytest.raises(spillmerge.SpillMergeError, match="rank"):
        spillmerge.merge(spill_root, str(tmp_path / "out"), timeout=1.0, progress=False)
    assert "waiting for" not in capfd.readouterr().err


def test_a_coordinated_merge_names_the_rank_still_writing(tmp_path):
    """Under torch.distributed dst waits for the ranks in the process group's store: it names a
    rank that has neither reached merge() nor committed, and says nothing of the others."""
    results = spawn_ranks(worker, WORLD, tmp_path, timeout=300)
    assert results[0]["late_rank"]["merged"], results
    lines = [ln for ln in results[0]["late_rank"]["stderr"].splitlines() if "waiting for" in ln]
    assert lines and lines[0].startswith("spillmerge merge: waiting for 1 of 2 rank(s) to commit to "), lines
    assert "rank 1 (writing for " in lines[0] and "rank 0" not in lines[0], lines
    assert "waiting for" not in results[1]["late_rank"]["stderr"]
