"""Durability on a local disk: every object a commit record (or the merge's root document)
vouches for, and each folder holding one, is fsynced before that record is renamed into place;
the filesystem as a whole is never flushed (syncfs would also wait for other jobs' writes)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import spillmerge


class _Recorder:
    """Observes ``os.fsync`` / ``os.replace`` in order (the real calls still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(src: str, dst: str, **kw: object) -> None:
            real_replace(src, dst, **kw)  # type: ignore[arg-type]
            self.events.append(("replace", os.path.realpath(dst)))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def before(self, name: str) -> set[str]:
        """Paths fsynced before ``name`` was last renamed into place."""
        last = max((i for i, ev in enumerate(self.events) if ev == ("replace", name)), default=None)
        assert last is not None, f"{name} was never renamed into place: {self.events}"
        return {path for kind, path in self.events[:last] if kind == "fsync"}


def _files_and_dirs(top: str, skip: set[str]) -> set[str]:
    out: set[str] = set()
    for dirpath, _dirs, files in os.walk(top):
        out.add(os.path.realpath(dirpath))
        out.update(os.path.realpath(os.path.join(dirpath, f)) for f in files if f not in skip)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name an fd's file")
def test_commit_and_merge_fsync_exactly_what_they_vouch_for(tmp_path, monkeypatch):
    root, out = str(tmp_path / "spill"), str(tmp_path / "out")
    os.makedirs(root)
    rec = _Recorder(monkeypatch)
    with spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=4096) as w:
        for i in range(40):
            w.write(f"k{i % 4}", i, {"x": np.full(300, i, dtype=np.float32)})

    commits = [p for p in _files_and_dirs(root, set()) if p.endswith("/commit.json")]
    assert len(commits) == 1, commits
    commit = commits[0]
    segment = os.path.dirname(commit)
    chunks = os.listdir(os.path.join(segment, "data", "c"))
    assert len(chunks) > 2, chunks  # several data chunks, each one must be durable
    before = rec.before(commit)
    need = _files_and_dirs(segment, {"commit.json"} | {f for f in os.listdir(segment) if f.startswith("journal")})
    assert need - before == set(), sorted(need - before)
    # the record itself, then its folder, after the rename
    after = rec.events[rec.events.index(("replace", commit)) :]
    assert ("fsync", segment) in after

    rec.events.clear()
    spillmerge.merge(root, out)
    before = rec.before(os.path.realpath(os.path.join(out, "zarr.json")))
    need = _files_and_dirs(out, {"zarr.json"})
    need = {p for p in need if "/c/" in p or os.path.isdir(p)}  # every output chunk and folder
    assert any("/c/" in p for p in need)
    assert need - before == set(), sorted(need - before)
    assert rec.events.count(("fsync", os.path.realpath(out))) >= 1
