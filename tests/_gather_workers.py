"""Rank bodies for tests/distributed/test_gather.py: ``SpillWriter.merge(wait=True)``, ``spillmerge.gather`` and
``spillmerge.all_gather`` in 4 gloo ranks. Spawned processes import this module on its own (no
pytest); every scenario runs in the same processes, results in ``base/results/rank-R.json``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _helpers import raw_bytes
from _mp_scenarios import _error, run_scenarios

WORLD = 4
TIMEOUT = 120.0


def preds_of(rank: int, tag: str) -> dict[str, dict[int, Any]]:
    """Rank ``rank``'s predictions: its own frames of three shared files, uneven, with dict values."""
    out: dict[str, dict[int, Any]] = {}
    for f in range(3):
        frames = [i for i in range(20 + 3 * f) if i % WORLD == rank]
        out[f"{tag} clip {f}.mp4"] = {
            i: {"logits": torch.full((7,), float(i + 100 * f), dtype=torch.bfloat16), "score": float(i) / 3}
            for i in frames
        }
    return out


def _digest(store: Any) -> dict[str, Any]:
    """Every file's frames and the raw bytes of every leaf (hex), for comparison across ranks."""
    out = {}
    for name in store.filenames:
        v = store[name]
        out[name] = {
            "frames": store.frames(name).tolist(),
            "logits": raw_bytes(v["logits"].to_torch()).hex(),
            "score": np.asarray(v["score"][:]).tobytes().hex(),
        }
    return out


def _expected(tag: str) -> dict[str, Any]:
    """What every rank's all_gather_object of the same predictions says, in the same digest form."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, preds_of(dist.get_rank(), tag))
    merged: dict[str, dict[int, Any]] = {}
    for p in gathered:
        for name, frames in p.items():
            merged.setdefault(name, {}).update(frames)
    out = {}
    for name in sorted(merged):
        frames = sorted(merged[name])
        out[name] = {
            "frames": frames,
            "logits": b"".join(raw_bytes(merged[name][i]["logits"]) for i in frames).hex(),
            "score": np.array([merged[name][i]["score"] for i in frames], dtype=np.float64).tobytes().hex(),
        }
    return out


def wait_then_read(rank: int, world: int, base: str) -> dict[str, Any]:
    """Every rank reads the output right after merge(wait=True) returns."""
    import spillmerge

    with spillmerge.SpillWriter(f"{base}/wait/spill") as w:
        w.update(preds_of(rank, "wait"))
    rep = w.merge(f"{base}/wait/out.zarr", wait=True, timeout=TIMEOUT, progress=False)
    store = spillmerge.open(f"{base}/wait/out.zarr")
    return {"report": rep is not None, "digest": _digest(store), "expected": _expected("wait")}


def dst_fails(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 1 damages one of its own data chunks after committing: rank 0's merge fails on the
    checksum, and every waiting rank raises naming rank 0, long before the timeout."""
    import torch.distributed as dist

    import spillmerge

    root = f"{base}/fails/spill"
    with spillmerge.SpillWriter(root, chunk_bytes=4096) as w:
        w.update(preds_of(rank, "fails"))
    if rank == 1:
        chunk = f"{w.segment_path}/data/c/0"
        with open(chunk, "r+b") as fh:
            b = fh.read(1)
            fh.seek(0)
            fh.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    try:
        w.merge(f"{base}/fails/out.zarr", wait=True, timeout=TIMEOUT, progress=False)
        return {"error": None}
    except spillmerge.SpillMergeError as exc:
        return {"error": _error(exc), "rank_attr": getattr(exc, "rank", None)}


def gather_one_call(rank: int, world: int, base: str) -> dict[str, Any]:
    import torch.distributed as dist

    import spillmerge

    out = f"{base}/gather/out.zarr"
    store = spillmerge.gather(preds_of(rank, "g"), out, progress=False)
    res: dict[str, Any] = {"got_store": store is not None, "expected": _expected("g")}
    if store is not None:
        res["digest"] = _digest(store)
    dist.barrier()  # every rank removed its own spill data
    res["spill_left"] = os.path.exists(spillmerge._dist.gather.default_root(out))
    return res


def all_gather_one_call(rank: int, world: int, base: str) -> dict[str, Any]:
    import spillmerge

    store = spillmerge.all_gather(preds_of(rank, "ag"), f"{base}/allgather/out.zarr", progress=False)
    return {"digest": _digest(store), "expected": _expected("ag")}


def crash_then_rerun(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 2's predictions hold a value spillmerge cannot store: its writer records the failure,
    the merge on rank 0 fails naming rank 2, and every other rank raises naming rank 0 and the
    cause. The same call again with good values succeeds and leaves no spill behind."""
    import torch.distributed as dist

    import spillmerge

    out = f"{base}/rerun/out.zarr"
    preds: dict[str, Any] = preds_of(rank, "r")
    if rank == 2:
        preds = {**preds, "bad.mp4": (0, object())}
    first: dict[str, Any]
    try:
        spillmerge.all_gather(preds, out, progress=False, timeout=TIMEOUT)
        first = {"error": None}
    except spillmerge.SpillMergeError as exc:
        first = {"error": _error(exc), "rank_attr": getattr(exc, "rank", None)}
    dist.barrier()
    store = spillmerge.all_gather(preds_of(rank, "r"), out, progress=False, timeout=TIMEOUT)
    dist.barrier()
    return {
        "first": first,
        "digest": _digest(store),
        "expected": _expected("r"),
        "spill_left": os.path.exists(spillmerge._dist.gather.default_root(out)),
    }


SHORT_TIMEOUT = 3.0


def short_timeout_after_long_calls(rank: int, world: int, base: str) -> dict[str, Any]:
    """The last rank never calls ``all_gather(timeout=SHORT_TIMEOUT)``: the others raise naming
    the wait within that timeout, though every earlier call in these processes waited up to
    minutes (each wait is bounded by its own call's timeout). Last: the group is not used after."""
    import time

    import spillmerge

    if rank == world - 1:
        return {}
    t0 = time.perf_counter()
    try:
        spillmerge.all_gather(preds_of(rank, "short"), f"{base}/short/out.zarr", progress=False, timeout=SHORT_TIMEOUT)
        return {"error": None}
    except spillmerge.SpillMergeError as exc:
        return {"error": _error(exc), "waited": time.perf_counter() - t0}


SCENARIOS = {
    "wait": wait_then_read,
    "fails": dst_fails,
    "gather": gather_one_call,
    "all_gather": all_gather_one_call,
    "rerun": crash_then_rerun,
    "short_timeout": short_timeout_after_long_calls,
}


def worker(rank: int, world: int, port: int, base: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes``."""
    run_scenarios(rank, world, port, base, SCENARIOS, barrier_between=True)


def _store_listens(port: int) -> bool:
    """Whether something still accepts connections on the process group's store port."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def store_host_exits(rank: int, world: int, port: int, base: str) -> None:
    """Rank 2 raises inside its ``with`` block and exits; rank 0 (which hosts the process group's
    store) raises naming it and exits too, taking the store with it; ranks 1 and 3 call merge()
    only after rank 0 is gone. Each rank writes what it raised to ``base/res-R.json``."""
    import json
    import time

    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {"rank": rank}
    try:
        with spillmerge.SpillWriter(f"{base}/spill") as w:
            w.update(preds_of(rank, "host"))
            if rank == 2:
                raise ValueError("rank 2's model blew up")
        if rank in (1, 3):  # synchronise on rank 0's exit (a file), not on a sleep
            deadline = time.monotonic() + 60
            while not os.path.exists(f"{base}/res-0.json") and time.monotonic() < deadline:
                time.sleep(0.05)
            # Rank 0 writes its result, then exits: its store stops listening on `port` when the
            # process is gone (os._exit closes the socket even before the parent reaps it).
            while _store_listens(port) and time.monotonic() < deadline:
                time.sleep(0.05)
        w.merge(f"{base}/out.zarr", timeout=60, progress=False)
        result["error"] = None
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        result["error"] = {"type": type(exc).__name__, "msg": str(exc), "failures": getattr(exc, "failures", None)}
        result["failures"] = {str(k): v for k, v in (getattr(exc, "failures", None) or {}).items()}
    with open(f"{base}/res-{rank}.json.tmp", "w", encoding="utf-8") as fh:
        json.dump(result, fh, default=str)
    os.replace(f"{base}/res-{rank}.json.tmp", f"{base}/res-{rank}.json")
    os._exit(0)  # no teardown: rank 0's exit takes the store down, as a crashing job's would


def rank_exits_after_init(rank: int, world: int, port: int, base: str) -> None:
    """Rank 1 exits right after ``init_process_group``; rank 0 calls ``all_gather(timeout=3)``
    and records what it raised and how long it took (``base/res-0.json``)."""
    import json
    import time

    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank != 0:
        os._exit(0)
    t = time.monotonic()
    result: dict[str, Any] = {"error": None}
    try:
        spillmerge.all_gather(preds_of(rank, "exit"), f"{base}/out.zarr", timeout=3, progress=False)
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        result["error"] = {"type": type(exc).__name__, "msg": str(exc)}
    result["seconds"] = time.monotonic() - t
    with open(f"{base}/res-0.json", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os._exit(0)


def two_ranks_fail(rank: int, world: int, port: int, base: str) -> None:
    """Ranks 1 and 2 raise inside their ``with`` block; ranks 0 and 3 call merge() once both
    failure records are on storage (synchronised on the files, not on a sleep). Each rank
    records what it raised (``base/res-R.json``)."""
    import glob
    import json
    import time

    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {"rank": rank, "error": None, "failures": {}}
    try:
        with spillmerge.SpillWriter(f"{base}/spill") as w:
            w.update(preds_of(rank, "two"))
            if rank in (1, 2):
                raise ValueError(f"rank {rank}'s model blew up")
        deadline = time.monotonic() + 60
        while len(glob.glob(f"{base}/spill/rank-*/seg-*/failed.json")) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        w.merge(f"{base}/out.zarr", timeout=60, progress=False)
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        result["error"] = {"type": type(exc).__name__, "msg": str(exc)}
        result["failures"] = {str(k): v for k, v in (getattr(exc, "failures", None) or {}).items()}
    with open(f"{base}/res-{rank}.json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, default=str)
    if rank == 0:  # rank 0 hosts the store: let the others read it before it goes
        while len(glob.glob(f"{base}/res-*.json")) < world and time.monotonic() < deadline + 60:
            time.sleep(0.02)
    os._exit(0)


CALLS = 3


def calls_back_to_back(rank: int, world: int, port: int, base: str) -> None:
    """``all_gather`` called ``CALLS`` times in a row with the same ``out`` (no barrier between the
    calls: a rank starts the next call as soon as the previous one returns). Each call's
    predictions are its own (its tag in the filenames, frames shifted by the call number), so an
    output holding another call's data, or missing some, shows. Records per call what came back
    or what was raised, whether the spill root still existed when the last call returned, and,
    after a barrier, what is left of it (``base/res-R.json``)."""
    import json

    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    os.environ["TORCHELASTIC_RUN_ID"] = "b2b"  # as under torchrun: every call has the same run id, agreed on by none
    if rank == 0:  # the merging rank's deletes are slow (a busy shared file system): 0.3 s each
        import time

        from spillmerge._storage import LocalStorage

        real_rm_tree = LocalStorage.rm_tree

        def slow_rm_tree(self: Any, rel: str = "") -> None:
            time.sleep(0.3)
            real_rm_tree(self, rel)

        LocalStorage.rm_tree = slow_rm_tree  # type: ignore[method-assign]
    out = f"{base}/o.zarr"
    calls: list[Any] = []
    for k in range(CALLS):
        preds = {f"call{k} {name}": {i + k: v for i, v in frames.items()} for name, frames in preds_of(rank, "b").items()}
        try:
            store = spillmerge.all_gather(preds, out, progress=False, timeout=TIMEOUT)
            calls.append({n: store.frames(n).tolist() for n in store.filenames})
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            calls.append({"error": _error(exc)})
    spill = spillmerge._dist.gather.default_root(out)
    at_return = os.path.exists(spill)  # the last call returned: nothing of it may be left, on any rank
    dist.barrier()
    left = sorted(os.path.relpath(os.path.join(d, f), spill) for d, _, fs in os.walk(spill) for f in fs)
    result = {"calls": calls, "spill_at_return": at_return, "spill_exists": os.path.exists(spill), "left": left}
    with open(f"{base}/res-{rank}.json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, default=str)
    dist.barrier()
    dist.destroy_process_group()


def all_gather_to_each_process_s_memory(rank: int, world: int, port: int, base: str) -> None:
    """``all_gather`` into memory:// (each process's own): dst merges what the other ranks sent it;
    they cannot see that output. Records what came back or was raised (``base/res-R.json``)."""
    import json

    import torch.distributed as dist

    import spillmerge

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    expected = _expected("mem")  # a collective: every rank, before the call
    try:
        store = spillmerge.all_gather(preds_of(rank, "mem"), "memory://gather-workers/out.zarr", progress=False)
        res: dict[str, Any] = {"digest": _digest(store), "expected": expected}
    except spillmerge.SpillMergeError as exc:
        res = {"error": type(exc).__name__, "message": str(exc)}
    Path(base, f"res-{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()
