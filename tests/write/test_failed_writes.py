"""A write that fails half way (disk full, an interrupt while its bytes are copied) never leaves
a segment that commits an index its bytes do not match: the writer fails, the journal is salvaged."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch

import spillmerge
from spillmerge._format import spill as FS


def _full_disk_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """``os.pwritev`` (a direct chunk's writes) fails with ENOSPC at its ``call``-th use."""
    real, calls = os.pwritev, []

    def pwritev(fd: int, buffers: list, offset: int) -> int:
        calls.append(offset)
        if len(calls) == call:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)


def _frame(i: int) -> torch.Tensor:
    return torch.full((20000,), float(i))  # 80 KB: host frames go straight into their chunk file


@pytest.mark.parametrize("how", ["write", "write_batch", "update"])
def test_a_write_failing_half_way_fails_the_writer_and_its_journal_is_salvaged(tmp_path, monkeypatch, how):
    root, out = str(tmp_path / "spill"), str(tmp_path / "out")
    _full_disk_at(monkeypatch, 3)
    w = spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=1 << 18)
    w.open()

    def put(i: int) -> None:
        if how == "write":
            w.write(f"f{i}", 0, _frame(i))
        elif how == "update":
            w.update({f"f{i}": (0, {"x": _frame(i)})})
        else:
            w.write_batch([f"f{i}"], _frame(i)[None])

    put(0)
    put(1)
    with pytest.raises(spillmerge.SpillStorageError, match="No space left on device"):
        put(2)
    # Its index rows were taken, its bytes not written: nothing of this segment may commit.
    with pytest.raises(spillmerge.WriterClosedError, match="failed"):
        put(3)
    with pytest.raises(spillmerge.WriterClosedError, match="failed"):
        w.close()
    assert w.state == "failed"
    failure = json.loads((tmp_path / "spill" / FS.rank_dirname(0) / str(w.segment) / FS.FAILURE_NAME).read_text())
    assert failure["error_type"] == "SpillStorageError"
    with pytest.raises(spillmerge.RankFailedError, match="No space left on device"):
        spillmerge.merge(root, out)
    report = spillmerge.merge(root, out, allow_partial=True)
    assert report.salvaged_frames == {0: 2}
    got = {name: value for name, _, value in spillmerge.open(out).iter_values()}
    assert sorted(got) == ["f0", "f1"]
    for i in range(2):
        value = got[f"f{i}"]["x"] if how == "update" else got[f"f{i}"]
        assert np.array_equal(value, _frame(i).numpy())


def test_a_failed_chunk_write_names_the_segment_once(tmp_path, monkeypatch):
    _full_disk_at(monkeypatch, 1)
    with pytest.raises(spillmerge.SpillStorageError) as err:
        with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
            w.write("f0", 0, _frame(0))
    where = str(tmp_path / "spill" / FS.rank_dirname(0) / str(w.segment))
    assert str(err.value) == f"cannot write {where}: No space left on device"
    assert err.value.path == where
