"""One SpillWriter shared by threads: calls take turns, every key of every thread merges exactly,
and a thread that writes after another committed gets a clear error, not a damaged segment."""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import time
import weakref
from collections.abc import Mapping

import pytest
import torch

import spillmerge


def _value(t: int, i: int, j: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((24,), float(t * 100000 + i * 10 + j)), "k": torch.tensor([t, i, j])}


def _work(w: spillmerge.SpillWriter, t: int, n: int, errors: list[BaseException]) -> None:
    try:
        for i in range(n):
            if i % 2:  # one frame at a time, new files and frames of a file already written
                w.write(f"t{t}_{i}.mp4", 0, _value(t, i, 0))
                w.write(f"t{t}_0_0.mp4", i, _value(t, i, 1))
            else:  # a flat dict batch of new files: the vectorised paths
                names = [f"t{t}_{i}_{j}.mp4" for j in range(4)]
                w.write_batch(names, {k: torch.stack([_value(t, i, j)[k] for j in range(4)]) for k in ("x", "k")})
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


@pytest.fixture
def switch_often():
    """Thread switches every microsecond: the interleavings a busy host makes, in every run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_a_writer_shared_by_four_threads_merges_every_key_exactly(tmp_path, switch_often):
    root, out, threads, n = str(tmp_path / "spill"), str(tmp_path / "out"), 4, 120
    errors: list[BaseException] = []
    w = spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=8192, staging_bytes=4 * 8192)
    w.open()
    workers = [threading.Thread(target=_work, args=(w, t, n, errors), daemon=True) for t in range(threads)]
    for th in workers:
        th.start()
    for th in workers:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in workers), "a writing thread hangs (staging buffers lost?)"
    assert errors == []
    w.close()
    spillmerge.merge(root, out)
    res = spillmerge.open(out)
    want: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for t in range(threads):
        want[(f"t{t}_0_0.mp4", 0)] = _value(t, 0, 0)
        for i in range(n):
            if i % 2:
                want[(f"t{t}_{i}.mp4", 0)] = _value(t, i, 0)
                want[(f"t{t}_0_0.mp4", i)] = _value(t, i, 1)
            else:
                want.update({(f"t{t}_{i}_{j}.mp4", 0): _value(t, i, j) for j in range(4)})
    got = {(name, frame): value for name, frame, value in res.iter_values()}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(torch.as_tensor(got[key]["x"]), value["x"]), key
        assert torch.equal(torch.as_tensor(got[key]["k"]), value["k"]), key


def test_a_thread_writing_after_another_committed_is_told_and_the_commit_stays_whole(tmp_path, switch_often):
    root, out = str(tmp_path / "spill"), str(tmp_path / "out")
    w = spillmerge.SpillWriter(root, rank=0, world_size=1, chunk_bytes=8192)
    w.open()
    errors: list[BaseException] = []

    def late() -> None:
        try:
            for i in range(100000):
                w.write("late.mp4", i, torch.full((64,), float(i)))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    th = threading.Thread(target=late, daemon=True)
    th.start()
    while w.stats()["frames"] < 200 and th.is_alive():  # commit while the other thread writes
        time.sleep(0.001)
    w.close()
    th.join(timeout=60)
    assert not th.is_alive(), "the writing thread hangs"
    assert len(errors) == 1 and isinstance(errors[0], spillmerge.WriterClosedError), errors
    assert "committed" in str(errors[0])
    spillmerge.merge(root, out)
    frames = spillmerge.open(out)["late.mp4"]
    n = len(frames)
    assert n == w.stats()["frames"] > 0  # what the commit vouches for is what was written before it
    assert all(float(frames[i][0]) == i for i in range(n))


def test_an_update_is_one_call_that_other_threads_wait_for(tmp_path):
    root, out = str(tmp_path / "spill"), str(tmp_path / "out")
    w = spillmerge.SpillWriter(root, rank=0, world_size=1, on_duplicate="last")
    w.open()
    started, gate = threading.Event(), threading.Event()

    class Frames(Mapping):  # {0: value}, pausing while update() goes through it
        def __iter__(self):
            started.set()
            gate.wait(10)
            yield 0

        def __len__(self) -> int:
            return 1

        def __getitem__(self, frame: int) -> torch.Tensor:
            return torch.tensor([1.0])

    first = threading.Thread(target=w.update, args=({"a.mp4": (0, torch.tensor([1.0])), "b.mp4": Frames()},))
    first.start()
    assert started.wait(10)
    second = threading.Thread(
        target=w.update, args=({"a.mp4": (0, torch.tensor([2.0])), "b.mp4": (0, torch.tensor([2.0]))},)
    )
    second.start()
    second.join(0.3)
    waited = second.is_alive()  # for the first update, a call of the writer as a whole
    gate.set()
    first.join(10)
    second.join(10)
    w.close()
    spillmerge.merge(root, out)
    res = spillmerge.open(out)
    assert {name: float(res.value(name)[0]) for name in ("a.mp4", "b.mp4")} == {"a.mp4": 2.0, "b.mp4": 2.0}
    assert waited


@pytest.mark.parametrize("policy", ["error", "first", "last"])
def test_threads_writing_the_same_keys_every_way_keep_each_key_once_whole(tmp_path, switch_often, policy):
    """write, update and both write_batch paths of shared keys from four threads: each key merges
    once, whole, with a value one of its writers wrote (under "error" all write the same
    content), and every other copy is counted as a rewrite."""
    root, out = str(tmp_path / "spill"), str(tmp_path / "out")
    w = spillmerge.SpillWriter(
        root, rank=0, world_size=1, chunk_bytes=4096, staging_bytes=3 * 4096, on_duplicate=policy
    )
    w.open()
    written: list[tuple[tuple[str, int], int]] = []
    errors: list[BaseException] = []

    def value(key: tuple[str, int], t: int) -> dict[str, torch.Tensor]:
        v = (0 if policy == "error" else 1000 * t) + 7 * int(key[0][1:]) + key[1]
        return {"x": torch.full((50,), float(v)), "n": torch.tensor([v])}

    def work(t: int) -> None:
        rnd = random.Random(t)
        try:
            for i in range(40):
                keys = list(
                    dict.fromkeys((f"f{rnd.randrange(12)}", rnd.randrange(3)) for _ in range(rnd.randrange(1, 5)))
                )
                vals = [value(k, t) for k in keys]
                if i % 4 == 0:
                    for k, v in zip(keys, vals, strict=True):
                        w.write(k[0], k[1], v)
                elif i % 4 == 1:
                    mapping = {k[0]: (k[1], v) for k, v in zip(keys, vals, strict=True)}
                    keys = [(name, frame) for name, (frame, _) in mapping.items()]
                    w.update(mapping)
                elif i % 4 == 2:
                    dense = {leaf: torch.stack([v[leaf] for v in vals]) for leaf in ("x", "n")}
                    w.write_batch([k[0] for k in keys], dense, [k[1] for k in keys])
                else:
                    w.write_batch([k[0] for k in keys], vals, [k[1] for k in keys])
                written.extend((k, t) for k in keys)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(4)]
    for th in workers:
        th.start()
    for th in workers:
        th.join(timeout=60)
    assert errors == []
    w.close()
    report = spillmerge.merge(root, out)
    got = {(name, frame): v for name, frame, v in spillmerge.open(out).iter_values()}
    writers: dict[tuple[str, int], set[int]] = {}
    for key, t in written:
        writers.setdefault(key, set()).add(t)
    assert got.keys() == writers.keys()
    for key, v in got.items():
        n = int(v["n"][0])
        assert (v["x"] == n).all(), key
        assert n in {int(value(key, t)["n"][0]) for t in writers[key]}, key
    assert report.rewrites == w.stats()["rewrites"] == len(written) - len(writers)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("frame_bytes", [1200, 1 << 16], ids=["staged", "direct"])
def test_a_writer_dropped_while_open_ends_its_threads_and_commits_nothing(tmp_path, frame_bytes):
    """An open writer garbage-collected without close() lets its flush thread, upload and journal
    workers, staging buffers and chunk file go (a ResourceWarning says so); its segment stays
    uncommitted, as a killed writer's: no commit record, no failure record."""
    root = tmp_path / "spill"
    before, fds = set(threading.enumerate()), _fds()

    def new_threads() -> list[threading.Thread]:  # the writer's (not another test's, nor the shared fsync pool)
        return [t for t in threading.enumerate() if t not in before and not t.name.startswith("spillmerge-fsync")]

    w = spillmerge.SpillWriter(str(root), rank=0, world_size=1, chunk_bytes=1 << 17)
    w.open()
    for i in range(9):  # chunks handed to the flush thread, and one left open
        w.write(f"f{i}.mp4", 0, torch.full((frame_bytes // 4,), float(i)))
    assert new_threads()
    staging = weakref.ref(w._staging)  # the staging buffers' owner
    with pytest.warns(ResourceWarning, match="rank 0 was never closed"):
        del w
        gc.collect()
    deadline = time.monotonic() + 60  # a loaded machine: the flush thread ends after its queued chunks
    while (left := new_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, [t.name for t in left]
    assert _fds() <= fds
    gc.collect()
    assert staging() is None
    (segment,) = (root / "rank-00000").iterdir()
    assert not (segment / "commit.json").exists() and not (segment / "failed.json").exists()
