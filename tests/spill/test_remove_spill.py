"""``remove_spill``: the spill root goes after a complete merge that misses nothing, and only
then; nothing outside the root is touched."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import spillmerge
from spillmerge._merge import job as _merge

HERE = Path(__file__).parents[1]  # tests/
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


# ------------------------------------------------------------- only what the output was merged from
def _segment(path: str | Path) -> str:
    """``rank-R/seg-...`` of a segment path."""
    p = Path(path)
    return f"{p.parent.name}/{p.name}"


def _kept(rep: spillmerge.MergeReport) -> dict[str, str]:
    return {_segment(k): v for k, v in rep.kept_segments.items()}


def _late_session(root: Path, late: dict[str, Any]) -> Any:
    """A hook run once the output is complete, before the removal: a later session of rank 0
    commits a frame, and one of rank 1 opens and writes (still being written)."""
    real = _merge._merge_whole

    def merge_then_late_sessions(job: Any) -> spillmerge.MergeReport:
        report = real(job)
        with spillmerge.SpillWriter(root, rank=0, world_size=2, chunk_bytes=4096) as w:
            w.write("late.mp4", 0, torch.ones(8))
        live = spillmerge.SpillWriter(root, rank=1, world_size=2, chunk_bytes=4096)
        live.open()
        live.write("live.mp4", 0, torch.zeros(8))
        late.update(committed=_segment(w.segment_path), live=live)
        return report

    return merge_then_late_sessions


def test_a_segment_committed_or_opened_while_the_merge_ran_stays(tmp_path, monkeypatch):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0, 1])
    late: dict[str, Any] = {}
    monkeypatch.setattr(_merge, "_merge_whole", _late_session(root, late))
    rep = spillmerge.merge(str(root), str(out), remove_spill=True)
    assert len(rep.merged_segments) == 2 and sorted(rep.removed_segments) == sorted(rep.merged_segments)
    assert not any((root / _segment(p)).exists() for p in rep.merged_segments)
    kept = _kept(rep)
    assert set(kept) == {late["committed"], _segment(late["live"].segment_path)}, kept
    assert "committed after the merge's plan" in kept[late["committed"]]
    assert "still being written" in kept[_segment(late["live"].segment_path)]
    assert (root / late["committed"] / "commit.json").is_file()
    # The live writer is intact: it commits, and a second merge takes both late sessions.
    late["live"].close()
    monkeypatch.undo()
    again = spillmerge.merge(str(root), str(out), remove_spill=True, overwrite=True)
    store = spillmerge.open(str(out))
    assert sorted(store.filenames) == ["late.mp4", "live.mp4"] and not again.kept_segments
    assert not root.exists()


def test_cli_remove_spill_names_the_segment_it_kept(tmp_path, monkeypatch, capsys):
    from spillmerge.cli import main

    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0, 1])
    late: dict[str, Any] = {}
    monkeypatch.setattr(_merge, "_merge_whole", _late_session(root, late))
    assert main(["merge", str(root), "--out", str(out), "--remove-spill"]) == 0
    printed = capsys.readouterr().out
    assert "2 merged segment(s) removed, 2 kept" in printed, printed
    assert f"kept {root / late['committed']}: committed but not merged" in printed, printed
    late["live"].abort(RuntimeError("test over"))


def _killed_rank_1(root: Path, frames: int, journal_entry: int) -> None:
    """Rank 1 write_batches ``frames`` frames of ``clip`` and is SIGKILLed right after journal
    entry ``journal_entry`` landed (no commit, no failure record)."""
    from _nothing_lost_workers import spill_batches_killed_at

    p = mp.get_context("fork").Process(
        target=spill_batches_killed_at, args=(str(root), 1, 2, frames, f"journal-{journal_entry}")
    )
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL


def _commit(root: Path, rank: int, frames: list[int]) -> None:
    from _nothing_lost_workers import small_value

    with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
        for f in frames:
            w.write("clip", f, small_value(f))


def test_a_killed_segment_whose_frames_the_output_lacks_is_kept_with_them(tmp_path):
    from spillmerge._spill.root import load_flushed, read_segment
    from spillmerge._storage import Storage

    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _killed_rank_1(root, 500, 80)  # frames 1, 3, 5, ...: about 400 of them journaled
    (killed,) = (root / "rank-00001").iterdir()
    storage = Storage(str(root))

    def journaled() -> int:
        """Frames (not rows: a frame has one row per leaf) the killed segment's journal holds."""
        index = load_flushed(storage, read_segment(storage, 1, killed.name))[0].index
        return len({(int(f), int(i)) for f, i in index[:, :2]})

    before = journaled()
    assert before >= 350, before
    _commit(root, 0, [0, 2])
    _commit(root, 1, [1])  # a later session of rank 1 commits one frame
    rep = spillmerge.merge(str(root), str(out), remove_spill=True)
    assert [_segment(p) for p in rep.abandoned_segments] == [_segment(killed)]
    why = _kept(rep)[_segment(killed)]
    assert f"{before - 1} of the frames its journal holds are not in the output" in why, why
    assert killed.is_dir() and journaled() == before  # every journaled frame is still there
    assert len(rep.removed_segments) == 2 and not any((root / _segment(p)).exists() for p in rep.removed_segments)
    assert not (root / "rank-00000").exists()
    back = spillmerge.MergeReport.from_json(rep.to_json())
    assert (back.merged_segments, back.removed_segments, back.kept_segments) == (
        rep.merged_segments, rep.removed_segments, rep.kept_segments,
    )  # fmt: skip
    assert f"kept {killed}: uncommitted (abandoned)" in str(rep)


def test_a_killed_segment_whose_every_frame_the_output_holds_goes(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _killed_rank_1(root, 40, 2)
    _commit(root, 0, [0])
    _commit(root, 1, list(range(1, 80, 2)))  # the later session writes every frame again
    rep = spillmerge.merge(str(root), str(out), remove_spill=True)
    assert len(rep.abandoned_segments) == 1 and len(rep.removed_segments) == 3 and not rep.kept_segments
    assert not root.exists()


# ----------------------------------------------------------------------- SpillWriter.remove_spill
def _two_writers(root: Path) -> list[spillmerge.SpillWriter]:
    ws = []
    for rank in (0, 1):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
            w.write(f"r{rank}.mp4", 0, torch.full((16,), float(rank)))
        ws.append(w)
    return ws


def test_writer_remove_spill_refuses_before_commit_and_before_merge(tmp_path):
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        w.write("a.mp4", 0, torch.ones(4))
        with pytest.raises(spillmerge.WriterClosedError, match="only a committed spill is removed"):
            w.remove_spill()
        assert Path(w.segment_path).is_dir()
    assert (Path(w.segment_path) / "commit.json").is_file()  # the refused call changed nothing
    with pytest.raises(spillmerge.WriterClosedError, match="call merge"):
        w.remove_spill()
    assert Path(w.segment_path).is_dir()


def test_writer_remove_spill_removes_only_its_own_merged_segment(tmp_path):
    root, out = tmp_path / "spill", str(tmp_path / "out.zarr")
    w0, w1 = _two_writers(root)
    assert w1.merge(out, dst=0) is None  # not the merging rank: returns at once
    # In a job every rank's writer has the same session number; here both are in one process.
    assert w0.merge(out, progress=False, session=w1.session().number) is not None
    w1.remove_spill()  # the output is complete with its round
    assert not Path(w1.segment_path).exists() and not (root / "rank-00001").exists()
    assert Path(w0.segment_path).is_dir()  # another rank's segment stays
    w0.remove_spill()
    assert not root.exists()


def test_writer_remove_spill_everything_takes_only_what_the_output_holds(tmp_path):
    root, out = tmp_path / "spill", str(tmp_path / "out.zarr")
    w0, w1 = _two_writers(root)
    assert w0.merge(out, progress=False) is not None
    with spillmerge.SpillWriter(root, rank=1, world_size=2, chunk_bytes=4096) as late:
        late.write("late.mp4", 0, torch.ones(16))  # committed after the merge
    late.merge(out, dst=0)  # not the merging rank: returns at once, merges nothing
    with pytest.raises(spillmerge.IncompleteOutputError, match="holds no completed merge of this writer's round"):
        late.remove_spill()
    w0.remove_spill(everything=True)
    assert not Path(w0.segment_path).exists() and not Path(w1.segment_path).exists()
    assert (Path(late.segment_path) / "commit.json").is_file()
    with pytest.raises(spillmerge.WriterClosedError, match="for the rank that merged"):
        late.remove_spill(everything=True)


def test_a_removal_that_fails_says_the_output_is_complete(tmp_path, monkeypatch):
    """Storage that refuses deletes (a read-only credential): the merge raises a storage error
    saying the output is complete, which it is; the spill stays whole."""
    from spillmerge._storage.local import LocalStorage

    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root, [0, 1])

    def refuse(self: Any, rel: str) -> None:
        raise spillmerge.SpillStorageError(f"cannot remove {self.describe(rel)}: Access Denied")

    monkeypatch.setattr(LocalStorage, "rm_tree", refuse)
    with pytest.raises(spillmerge.SpillStorageError, match=r"is complete, but removing the spill .* Access Denied"):
        spillmerge.merge(str(root), str(out), remove_spill=True, progress=False)
    assert spillmerge.open(str(out)).frames("a.mp4").tolist() == list(range(12))
    assert len(list(root.glob("rank-*/*"))) == 2
