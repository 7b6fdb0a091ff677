"""``remove_spill``: the spill root goes after a complete merge that misses nothing, and only
then; nothing outside the root is touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spillmerge

HERE = Path(__file__).parent
EXE = os.path.join(os.path.dirname(sys.executable), "spillmerge")
ENV = {**os.environ, "PYTHONPATH": str(HERE.parent)}


def _spill(root: Path, ranks: list[int], world_size: int = 2) -> None:
    for rank in ranks:
        with spillmerge.SpillWriter(root, rank=rank, world_size=world_size, chunk_bytes=4096) as w:
            for i in range(6):
                w.write("a.mp4", rank * 6 + i, torch.full((64,), float(i)))


def _neighbours(tmp_path: Path) -> list[Path]:
    """Files next to the spill root and inside the output's parent that must survive."""
    (tmp_path / "keep.txt").write_text("mine")
    (tmp_path / "spill-notes").mkdir()
    (tmp_path / "spill-notes" / "x").write_text("mine too")
    return [tmp_path / "keep.txt", tmp_path / "spill-notes" / "x"]


def test_complete_merge_removes_the_root_and_nothing_else(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0, 1])
    keep = _neighbours(tmp_path)
    rep = spillmerge.merge(str(root), str(out), remove_spill=True)
    assert not root.exists() and any("removed" in n for n in rep.notes)
    assert all(p.exists() for p in keep)
    assert spillmerge.open(str(out))["a.mp4"].shape[0] == 12


def test_a_file_of_the_user_inside_the_root_keeps_the_root(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0, 1])
    (root / "README").write_text("user's")
    spillmerge.merge(str(root), str(out), remove_spill=True)
    assert sorted(os.listdir(root)) == ["README"]


def test_partial_merge_keeps_the_root(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0])  # rank 1 of 2 never wrote
    rep = spillmerge.merge(str(root), str(out), allow_partial=True, remove_spill=True)
    assert rep.missing_ranks == [1]
    assert (root / "rank-00000").is_dir() and any("kept" in n and "missing" in n for n in rep.notes)


def test_frames_missing_against_expected_keep_the_root(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0, 1])
    rep = spillmerge.merge(str(root), str(out), expected={"a.mp4": 20}, remove_spill=True)
    assert rep.frame_gaps and (root / "rank-00001").is_dir()


def test_failed_merge_keeps_the_root(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0, 1])
    chunk = next((root / "rank-00001").glob("seg-*/data/c/0"))
    blob = bytearray(chunk.read_bytes())
    blob[10] ^= 0xFF  # a frame whose checksum no longer matches: the merge fails while copying
    chunk.write_bytes(bytes(blob))
    with pytest.raises(spillmerge.CorruptSpillError):
        spillmerge.merge(str(root), str(out), remove_spill=True)
    assert (root / "rank-00000").is_dir() and (root / "rank-00001").is_dir()


def _ctrl_c_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_cli_remove_spill_and_an_interrupted_merge_keeps_it(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0])
    # Interrupted: the merge waits for rank 1's commit record and gets Ctrl-C. The child gets
    # SIGINT's default action back first: a shell started in the background (as CI runs may be)
    # ignores SIGINT, children inherit that, and Python then never raises KeyboardInterrupt.
    p = subprocess.Popen([EXE, "merge", str(root), "--out", str(out), "--timeout", "120", "--remove-spill"],
                         env={**ENV, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=_ctrl_c_as_in_a_terminal)  # fmt: skip
    assert p.stderr is not None
    notice = p.stderr.readline()  # after 2 s of waiting the merge says so, naming the rank
    assert notice.startswith("spillmerge merge: waiting for 1 of 2 rank(s) to commit") and "rank 1 (" in notice, notice
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # then SIGABRT makes it print every thread's stack
        p.send_signal(signal.SIGABRT)
        _, err = p.communicate(timeout=30)
        pytest.fail(f"the merge was still running 60 s after Ctrl-C; its threads:\n{err}")
    assert p.returncode != 0 and (root / "rank-00000").is_dir(), err
    # Completed: rank 1 commits, the same command removes the root.
    _spill(root, [1])
    keep = _neighbours(tmp_path)
    p2 = subprocess.run([EXE, "merge", str(root), "--out", str(out), "--remove-spill", "--overwrite"],
                        env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p2.returncode == 0, p2.stderr
    assert not root.exists() and all(x.exists() for x in keep)
    assert "removed" in p2.stdout


def test_writer_merge_remove_spill(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        w.write("a.mp4", 0, torch.ones(4))
    rep = w.merge(str(out), remove_spill=True)
    assert rep is not None and not root.exists()
    assert spillmerge.open(str(out))["a.mp4"].shape[0] == 1


def test_parts_keep_the_root_and_finalize_removes_it(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0, 1])
    for i in range(2):
        spillmerge.merge(str(root), str(out), part=(i, 2), remove_spill=True)
        assert (root / "rank-00000").is_dir()
    rep = spillmerge.merge(str(root), str(out), finalize=True, remove_spill=True)
    assert not root.exists() and rep.n_frames == 12
