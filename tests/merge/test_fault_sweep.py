"""Storage faults swept over a whole merge: the k-th write, create or removal of the output (or of
the spill root, for ``remove_spill``) fails, for the first and last k of each kind of call (one
verb, one top folder, names equal but for their numbers). After each failure the spill root holds
every committed frame, the output is refused by ``open`` or complete, and the merge run again
gives every value written."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _helpers import value_diffs

import spillmerge
from spillmerge._merge import job as _job
from spillmerge._storage import FsspecStorage, LocalStorage, Storage

WORLD, FILES, FRAMES = 2, 2, 6
MERGE = {"chunk_bytes": 1024, "progress": False, "fsync": False}


def _value(f: int, frame: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(f * 101 + frame)
    return {"x": torch.randn(3 + frame % 3, 8, generator=g), "tag": f"f{f}/{frame}", "n": [frame, f]}


def _spill(url: str) -> dict[tuple[str, int], Any]:
    for r in range(WORLD):
        with spillmerge.SpillWriter(url, rank=r, world_size=WORLD, chunk_bytes=4096) as w:
            for f in range(FILES):
                for frame in range(r, FRAMES, WORLD):
                    w.write(f"clip {f}.mp4", frame, _value(f, frame))
    return {(f"clip {f}.mp4", k): _value(f, k) for f in range(FILES) for k in range(FRAMES)}


def _tree(url: str) -> dict[str, str]:
    s = Storage(url)
    return {rel: hashlib.sha256(s.get(rel, max_bytes=1 << 24)).hexdigest() for rel, _ in s.find("")}


def _assert_holds(out: str, expected: dict[tuple[str, int], Any]) -> None:
    res = spillmerge.open(out)
    assert sorted(res.filenames) == sorted({name for name, _ in expected})
    diffs = [d for (name, k), want in expected.items() for d in value_diffs(res.value(name, k), want, f"{name}[{k}]")]
    assert not diffs, diffs


class Faults:
    """The ``k``-th storage call that changes something below ``root`` raises, as the backend's own
    failure would (``SpillStorageError`` naming the object); ``k`` None counts the calls only."""

    VERBS = {"put": "write", "open_write": "write", "put_many": "write metadata under",
             "create": "create", "rm_tree": "remove"}  # fmt: skip

    def __init__(self, root: str, k: int | None) -> None:
        self.root, self.k, self.calls, self.hit = root, k, 0, None
        self.kinds: dict[tuple[str, ...], list[int]] = {}  # kind of call -> [first k, last k]
        self._lock = threading.Lock()

    def check(self, storage: Storage, verb: str, rel: str) -> None:
        if storage.path(rel) != self.root and not storage.path(rel).startswith(self.root + "/"):
            return
        with self._lock:
            self.calls += 1
            fire = self.calls == self.k
            kind = (verb, rel.split("/")[0], re.sub(r"\d+", "N", rel.split("/")[-1]))
            seen = self.kinds.setdefault(kind, [self.calls, self.calls])
            seen[1] = self.calls
        if fire:
            self.hit = f"{verb} {rel}"
            with storage.storage_errors(self.VERBS[verb], rel):
                raise OSError(errno.EIO, "injected fault")


@contextlib.contextmanager
def faults(root: str, k: int | None) -> Iterator[Faults]:
    f = Faults(Storage(root).root, k)
    with pytest.MonkeyPatch.context() as mp:
        for cls in (LocalStorage, FsspecStorage):
            for name in Faults.VERBS:
                real = cls.__dict__.get(name)
                if real is None or (cls is LocalStorage and name == "put_many"):  # a put each
                    continue

                def wrapped(self: Storage, rel: Any = "", *a: Any, _real: Any = real, _verb: str = name, **kw: Any):
                    for one in rel if isinstance(rel, dict) else [rel]:  # put_many: each object
                        f.check(self, _verb, one)
                    return _real(self, rel, *a, **kw)

                mp.setattr(cls, name, wrapped)
        yield f


def _refused_or_complete(out: str, expected: dict[tuple[str, int], Any]) -> bool:
    """The output after a failed merge: refused by ``open`` (True) or complete and right."""
    try:
        spillmerge.open(out)
    except (spillmerge.IncompleteOutputError, spillmerge.NotAnOutputError):
        return True
    _assert_holds(out, expected)
    return False


def _sweep(src: str, out: str, run: Any, expected: dict[tuple[str, int], Any]) -> None:
    """Fail the first and last change of each kind below ``out`` in ``run()``, then ``run()`` again."""
    spill = _tree(src)
    with faults(out, None) as count:
        run()
    ks = sorted({k for pair in count.kinds.values() for k in pair})
    assert len(ks) > 5, count.kinds
    Storage(out).rm_tree("")
    for k in ks:
        failed = True
        with faults(out, k) as f:
            try:
                run()
                failed = False  # a fault in a best-effort tidy after the marker (the lease's folder)
            except spillmerge.SpillStorageError as exc:
                assert f.hit and f.hit.split()[-1] in str(exc), (f.hit, exc)
        assert f.hit is not None
        assert _tree(src) == spill, f"the spill root changed after a fault at {f.hit}"
        if _refused_or_complete(out, expected):
            assert failed, f.hit
            run()
        _assert_holds(out, expected)
        Storage(out).rm_tree("")


def test_a_fault_at_each_kind_of_write_of_a_whole_merge_loses_nothing(backend_no_s3):
    src, out = backend_no_s3.url("spill"), backend_no_s3.url("out.zarr")
    expected = _spill(src)
    _sweep(src, out, lambda: spillmerge.merge(src, out, **MERGE), expected)


@pytest.mark.parametrize("backend_no_s3", ["memory"], indirect=True)  # local disks: the whole merge
def test_a_fault_at_each_kind_of_write_of_parts_and_finalize_loses_nothing(backend_no_s3):
    src, out = backend_no_s3.url("spill"), backend_no_s3.url("out.zarr")
    expected = _spill(src)

    def run() -> None:
        for i in range(2):
            spillmerge.merge(src, out, part=(i, 2), **MERGE)
        spillmerge.merge(src, out, finalize=True, **MERGE)

    _sweep(src, out, run, expected)


@pytest.mark.parametrize("backend_no_s3", ["memory"], indirect=True)  # local disks: the whole merge
def test_a_fault_at_each_kind_of_write_of_merge_parallel_loses_nothing(backend_no_s3):
    src, out = backend_no_s3.url("spill"), backend_no_s3.url("out.zarr")
    expected = _spill(src)

    def run() -> None:
        for rank in (1, 0):
            _job.merge_parallel(src, out, rank=rank, world_size=WORLD, dst=0, run_id=None, timeout=5, **MERGE)

    _sweep(src, out, run, expected)


def test_a_fault_at_each_removal_of_remove_spill_deletes_nothing_the_output_lacks(backend_no_s3):
    """The output is complete before anything is removed: a failed removal raises naming the object
    and leaves every segment it did not reach whole."""
    src, out, pristine = (backend_no_s3.url(n) for n in ("spill", "out.zarr", "pristine"))
    expected = _spill(pristine)
    copy = Storage(pristine)
    whole = {rel: copy.get(rel, max_bytes=1 << 24) for rel, _ in copy.find("")}
    with faults(pristine, None) as count:
        spillmerge.merge(pristine, out, remove_spill=True, **MERGE)
    assert count.calls >= WORLD, count.calls
    for k in range(1, count.calls + 1):
        Storage(out).rm_tree("")
        Storage(src).put_many(whole)
        with faults(src, k) as f, pytest.raises(spillmerge.SpillStorageError) as err:
            spillmerge.merge(src, out, remove_spill=True, **MERGE)
        assert f.hit and f.hit.split()[-1] in str(err.value), (f.hit, err.value)
        _assert_holds(out, expected)
        left = Storage(src)
        assert {rel: left.get(rel, max_bytes=1 << 24) for rel, _ in left.find("")}.items() <= whole.items()
