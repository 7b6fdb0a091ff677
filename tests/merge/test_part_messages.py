"""A merge in parts called from Python is told what to do in Python (``part=(i, n)``,
``finalize=True``, ``overwrite=True``), with the CLI's flag in parentheses, as every other merge
message does (``out= (--out)``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spillmerge

OPTS = {"chunk_bytes": 8192, "progress": False}


def _spill(root: Path) -> None:
    for r in range(2):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=2) as w:
            for f in range(4):
                w.write(f"clip{r}.mp4", f, torch.full((3,), float(f)))


def test_a_finalize_without_parts_names_the_python_call_and_the_flag(tmp_path):
    root = tmp_path / "spill"
    _spill(root)
    with pytest.raises(spillmerge.MissingPartsError) as info:
        spillmerge.merge(str(root), str(tmp_path / "nothing"), finalize=True, timeout=0)
    msg = str(info.value)
    assert "part=(i, n)) (--part I/N)" in msg and "finalize=True (--finalize)" in msg, msg
    assert "spillmerge merge ROOT" not in msg


def test_a_missing_part_names_the_python_call_and_the_flag(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out"
    _spill(root)
    spillmerge.merge(str(root), str(out), part=(0, 2), **OPTS)  # type: ignore[arg-type]
    with pytest.raises(spillmerge.MissingPartsError, match="part 1/2") as info:
        spillmerge.merge(str(root), str(out), finalize=True, timeout=0, **OPTS)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "part=(i, 2)) (--part I/2)" in msg and "timeout= (--timeout)" in msg, msg
    assert "spillmerge merge ROOT" not in msg
    merge = spillmerge.status(str(root), out=str(out)).merge
    assert merge is not None and merge.state == "interrupted", merge
    assert "finalize=True (--finalize)" in str(merge.message), merge


def test_parts_of_another_plan_name_overwrite_and_its_flag(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out"
    _spill(root)
    for i in range(2):
        spillmerge.merge(str(root), str(out), part=(i, 2), **OPTS)  # type: ignore[arg-type]
    with spillmerge.SpillWriter(str(root), rank=1, world_size=2) as w:  # the root changes before the finalize
        w.write("late.mp4", 0, torch.ones(3))
    with pytest.raises(spillmerge.PlanMismatchError) as info:
        spillmerge.merge(str(root), str(out), finalize=True, **OPTS)  # type: ignore[arg-type]
    assert "rerun those parts with overwrite=True (--overwrite)" in str(info.value), info.value
