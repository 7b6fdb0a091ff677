"""A damaged spill root (a byte flipped, an object truncated or gone) is refused naming the damaged
object, and ``remove_spill`` never deletes a segment whose damage hides what it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import spillmerge


def _value(k: int) -> dict[str, object]:
    return {"x": torch.full((200,), float(k)), "s": f"frame {k}"}


def _segments(root: Path, rank: int) -> list[Path]:
    return sorted((root / f"rank-{rank:05d}").glob("seg-*"))


def _failed_session(root: Path) -> tuple[Path, list[Path]]:
    """A session of rank 0 (of 1) that wrote 10 frames and failed: its segment and journal entries."""
    with pytest.raises(RuntimeError), spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=4096) as w:
        for k in range(10):
            w.write("a.mp4", k, _value(k))
        raise RuntimeError("the job died")
    (failed,) = _segments(root, 0)
    return failed, sorted((failed / "journal").iterdir())


def _damage(obj: Path, how: str) -> None:
    raw = obj.read_bytes()
    if how == "flipped":
        obj.write_bytes(raw[:8] + bytes([raw[8] ^ 0x40]) + raw[9:])
    elif how == "truncated":
        obj.write_bytes(raw[: len(raw) // 2])
    else:
        obj.unlink()


@pytest.mark.parametrize("how", ["flipped", "truncated", "deleted"])
def test_remove_spill_keeps_an_ended_segment_whose_journal_is_damaged(tmp_path, how):
    """A failed session's frames stay while the output lacks them; its first journal entry
    damaged, the frames its later entries and data chunks hold must not be deleted either."""
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    failed, journal = _failed_session(root)
    assert len(journal) >= 2, journal
    with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=4096) as w:  # the job run again
        w.write("b.mp4", 0, _value(0))
    _damage(journal[0], how)
    rep = spillmerge.merge(str(root), str(out), remove_spill=True, progress=False)
    assert failed.is_dir() and (failed / "journal" / journal[-1].name).is_file()
    why = rep.kept_segments[str(failed)]
    assert "journal" in why and "000000" in why, why


def _commit_world_size(seg: Path, world_size: int) -> None:
    """The commit record of ``seg`` with its world size changed (a flipped digit: the record
    carries no checksum of its own)."""
    record = json.loads((seg / "commit.json").read_text())
    record["world_size"] = world_size
    (seg / "commit.json").write_text(json.dumps(record, sort_keys=True))


@pytest.mark.parametrize("damaged", [0, 1])
def test_a_commit_record_contradicting_its_header_is_named_as_corrupt(tmp_path, damaged):
    """Not ``StaleSpillError`` naming the other rank's intact segment ("nothing is corrupt ...
    remove those segments"): the damaged record is named, and no removal is advised."""
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    for rank in range(2):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
            w.write(f"r{rank}.mp4", 0, _value(rank))
    (seg,) = _segments(root, damaged)
    _commit_world_size(seg, 3)
    for call in (
        lambda: spillmerge.merge(str(root), str(out), progress=False),
        lambda: spillmerge.SpillWriter(root, rank=damaged, world_size=2).open(),
    ):
        with pytest.raises(spillmerge.CorruptSpillError) as err:
            call()
        assert str(seg / "commit.json") in str(err.value) and "remove" not in str(err.value), err.value
    assert not out.exists()


def test_a_salvage_names_a_missing_journal_entry_before_later_ones(tmp_path):
    """Entries land in chunk order: one missing before later ones is damage the report names, not
    the journal's end; a planted name that is no entry (``²`` is a digit to ``str.isdigit``) is not
    one."""
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    failed, journal = _failed_session(root)
    journal[0].unlink()
    (failed / "journal" / "\u00b2").write_bytes(b"planted")
    rep = spillmerge.merge(str(root), str(out), allow_partial=True, progress=False)
    assert rep.salvaged_frames == {} and rep.missing_ranks == [0]
    assert any(f"{journal[0]}: journal entry missing, but {len(journal) - 1} later" in n for n in rep.notes), rep.notes
