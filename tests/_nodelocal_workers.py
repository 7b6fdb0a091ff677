"""Rank bodies for tests/distributed/test_nodelocal.py: spill roots that only some ranks can see (simulated
node-local disks: one directory per simulated host), merged with ``SpillWriter.merge``, which
moves the shards the merging rank cannot see over gloo.

Spawned processes import this module on its own (no pytest). Every scenario of ``SCENARIOS`` runs
in the same four processes; results land in ``base/results/rank-R.json``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import numpy as np
import torch
from _mp_scenarios import (
    _error,
    assignment,
    compare_merged,
    file_rows,
    kinds_assignment,
    kinds_value,
    run_scenarios,
    value_for,
)
from _mp_scenarios import _report as _mp_report

WORLD = 4
TIMEOUT = 90.0
WRITER_CHUNK = 16384  # objects span several transfer pieces ...
PIECE = 4096  # ... of this size (the smallest allowed)


def simple(name: str, i: int) -> torch.Tensor:
    return torch.arange(1000, dtype=torch.float32) * (i + 1) + len(name)


def _spill(root: str, keys: list[tuple[str, int]], value: Any = value_for) -> Any:
    import spillmerge

    with spillmerge.SpillWriter(root, chunk_bytes=WRITER_CHUNK) as w:
        for name, f in keys:
            w.write(name, f, value(name, f))
    return w


def _report(rep: Any) -> dict[str, Any] | None:
    out = _mp_report(rep)
    if out is not None:
        out["transferred"] = {str(k): v for k, v in rep.transferred.items()}
        out["senders"] = {str(k): v for k, v in rep.transfer_senders.items()}
        out["phases"] = rep.phases
    return out


def same_output(a: str, b: str) -> list[str]:
    """Differences between two merged outputs: filenames, frame indices, every leaf's rows (kind,
    dtype, shape, raw bytes; None where absent)."""
    import spillmerge

    ra, rb = spillmerge.open(a), spillmerge.open(b)
    if ra.filenames != rb.filenames:
        return [f"filenames differ: {len(ra.filenames)} vs {len(rb.filenames)}"]
    problems = []
    for name in ra.filenames:
        if not np.array_equal(ra.frames(name), rb.frames(name)):
            problems.append(f"{name!r}: frames differ")
            continue
        la, lb = file_rows(ra, name), file_rows(rb, name)
        if la.keys() != lb.keys():
            problems.append(f"{name!r}: leaves differ")
            continue
        for path in la:
            for x, y in zip(la[path], lb[path], strict=True):
                if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                    same = x.dtype == y.dtype and x.shape == y.shape and _raw(x) == _raw(y)
                else:
                    same = type(x) is type(y) and x == y
                if not same:
                    problems.append(f"{name!r} leaf {path}: rows differ")
                    break
    return problems


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _expected() -> dict[tuple[str, int], Any]:
    return {k: value_for(*k) for keys in assignment(WORLD).values() for k in keys}


# --------------------------------------------------------------------------------- scenarios
def scenario_two_hosts(rank: int, world: int, base: str) -> dict[str, Any]:
    """Ranks 0-1 share disk A, ranks 2-3 disk B: rank 2 alone sends both of B's shards; the
    output is bit-exact against the shared-root run of the same inputs."""
    mine = assignment(world)[rank]
    host = "A" if rank < 2 else "B"
    w = _spill(f"{base}/two/host{host}", mine)
    rep = w.merge(f"{base}/two/out", timeout=TIMEOUT, transfer_chunk_bytes=PIECE, progress=False)
    shared = _spill(f"{base}/two/shared", mine)
    rep_shared = shared.merge(f"{base}/two/out_shared", timeout=TIMEOUT, transport="storage", progress=False)
    result: dict[str, Any] = {"report": _report(rep), "shared_report": _report(rep_shared)}
    if rank == 0:
        import spillmerge

        result["vs_shared"] = same_output(f"{base}/two/out", f"{base}/two/out_shared")
        result["vs_expected"] = compare_merged(spillmerge.open(f"{base}/two/out"), _expected())[2]
    return result


def scenario_private_disks_and_resume(rank: int, world: int, base: str) -> dict[str, Any]:
    """Every rank has its own disk, and rank 1's disk also holds a committed segment of an earlier
    session: every committed segment the merging rank lacks is moved, older ones included."""
    root = f"{base}/private/rank{rank}"
    keys = [(f"r{rank}.mp4", i) for i in range(3 + rank)]
    if rank == 1:
        import spillmerge

        with spillmerge.SpillWriter(root, run_id="earlier-session", chunk_bytes=WRITER_CHUNK) as old:
            for i in range(100, 104):
                old.write("r1.mp4", i, simple("r1.mp4", i))
    w = _spill(root, keys, simple)
    rep = w.merge(f"{base}/private/out", timeout=TIMEOUT, transfer_chunk_bytes=PIECE, progress=False)
    result: dict[str, Any] = {"report": _report(rep)}
    if rank == 0:
        import spillmerge

        res = spillmerge.open(f"{base}/private/out")
        result["frames"] = {name: res.frames(name).tolist() for name in res.filenames}
    return result


def scenario_forced_gloo_on_shared_root(rank: int, world: int, base: str) -> dict[str, Any]:
    """transport='gloo' with a root everybody sees: nothing needs to move."""
    w = _spill(f"{base}/forced/shared", [(f"s{rank}.mp4", 0)], simple)
    rep = w.merge(f"{base}/forced/out", timeout=TIMEOUT, transport="gloo", progress=False)
    return {"report": _report(rep)}


def scenario_only_dst_calls_merge(rank: int, world: int, base: str) -> dict[str, Any]:
    """`if rank == 0: w.merge(out)` on shared storage: rank 0 need not wait for the others."""
    w = _spill(f"{base}/dstonly/shared", [(f"d{rank}.mp4", 0)], simple)
    if rank != 0:
        return {"report": None}
    t0 = time.perf_counter()
    rep = w.merge(f"{base}/dstonly/out", timeout=TIMEOUT, progress=False)
    return {"report": _report(rep), "merge_seconds": time.perf_counter() - t0}


def scenario_corrupted_piece(rank: int, world: int, base: str) -> dict[str, Any]:
    """A piece flipped in flight on rank 2: the merging rank refuses it, names rank 2 and the
    object, and rank 2's segment never looks committed on the merging rank's disk."""
    from spillmerge._dist import transfer as _transfer

    host = "A" if rank < 2 else "B"
    w = _spill(f"{base}/corrupt/host{host}", [(f"c{rank}.mp4", i) for i in range(8)], simple)
    original = _transfer._Link.send_bytes_piece
    if rank == 2:

        def flip(self: Any, n: int, peer: int, me: int, what: str) -> None:
            # the second piece of an object (the manifest, sent first, grew past one piece when
            # segments gained progress and block-checksum objects: flipping it tested the JSON parser)
            flip.calls += "manifest" not in what  # type: ignore[attr-defined]
            if flip.calls == 2 and "manifest" not in what:  # type: ignore[attr-defined]
                self.host[0] ^= 0xFF
            original(self, n, peer, me, what)

        flip.calls = 0  # type: ignore[attr-defined]
        _transfer._Link.send_bytes_piece = flip  # type: ignore[method-assign]
    try:
        w.merge(f"{base}/corrupt/out", timeout=TIMEOUT, transfer_chunk_bytes=PIECE, progress=False)
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        return {"error": _error(exc), "path": getattr(exc, "path", None), "rank": getattr(exc, "rank", None)}
    finally:
        _transfer._Link.send_bytes_piece = original  # type: ignore[method-assign]


def scenario_kinds_private_disks(rank: int, world: int, base: str) -> dict[str, Any]:
    """Every value kind (ragged, token lists, str, lists of str, bytes, None, absent leaves), each
    rank on its own disk: the shards move over gloo and the output holds exactly the values."""
    import spillmerge

    mine = kinds_assignment(world)[rank]
    w = _spill(f"{base}/kinds/rank{rank}", mine, kinds_value)
    rep = w.merge(f"{base}/kinds/out", timeout=TIMEOUT, transfer_chunk_bytes=PIECE, progress=False)
    result: dict[str, Any] = {"report": _report(rep), "n_mine": len(mine)}
    if rank == 0:
        expected = {k: kinds_value(*k) for keys in kinds_assignment(world).values() for k in keys}
        n_frames, n_leaves, problems = compare_merged(spillmerge.open(f"{base}/kinds/out"), expected)
        result.update(frames_checked=n_frames, leaves_checked=n_leaves, problems=problems)
    return result


SCENARIOS = {
    "two_hosts": scenario_two_hosts,
    "private": scenario_private_disks_and_resume,
    "forced": scenario_forced_gloo_on_shared_root,
    "dst_only": scenario_only_dst_calls_merge,
    "corrupt": scenario_corrupted_piece,
    "kinds": scenario_kinds_private_disks,
}


def worker(rank: int, world: int, port: int, base: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes``."""
    from spillmerge._dist import transfer as _transfer

    _transfer.VISIBILITY_GRACE = 0.2
    run_scenarios(rank, world, port, base, SCENARIOS, barrier_between=True)


def _two_disks(rank: int, world: int, port: int, base: str) -> Any:
    """This rank's process group, and its committed writer of 40 frames on a disk of its own."""
    import torch.distributed as dist

    from spillmerge._dist import transfer as _transfer

    torch.set_num_threads(1)
    _transfer.VISIBILITY_GRACE = 0.2
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return _spill(f"{base}/disk{rank}", [(f"k{rank}.mp4", i) for i in range(40)], simple)


def _before_third_piece(action: Any) -> None:
    """This rank runs ``action`` just before it sends its third piece of shard bytes."""
    from spillmerge._dist import transfer as _transfer

    original = _transfer._Link.send_bytes_piece
    calls = [0]

    def send(self: Any, n: int, peer: int, me: int, what: str) -> None:
        calls[0] += 1
        if calls[0] == 3:
            action()
        original(self, n, peer, me, what)

    _transfer._Link.send_bytes_piece = send  # type: ignore[method-assign]


def killed_sender(rank: int, world: int, port: int, base: str, result: str, late: bool = False) -> None:
    """Two ranks on two disks; rank 1 SIGKILLs itself after sending two pieces. Rank 0 must name
    it within the transfer timeout. ``late``: rank 0 posts its next receive only once rank 1 is
    dead (gloo then raises at the post, not at the wait)."""
    import spillmerge
    from spillmerge._dist import transfer as _transfer

    info: dict[str, Any] = {"rank": rank}
    try:
        w = _two_disks(rank, world, port, base)
        if rank == 1:

            def die() -> None:
                with open(f"{result}.killed", "w") as fh:
                    fh.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

            _before_third_piece(die)
        elif late:
            receive = _transfer._Link.recv_bytes_piece

            def after_death(self: Any, *args: Any) -> Any:
                after_death.calls += 1  # type: ignore[attr-defined]
                if after_death.calls == 3:  # type: ignore[attr-defined]
                    while not os.path.exists(f"{result}.killed"):
                        time.sleep(0.05)
                    time.sleep(1.0)  # the kill has landed and the connection is closed
                return receive(self, *args)

            after_death.calls = 0  # type: ignore[attr-defined]
            _transfer._Link.recv_bytes_piece = after_death  # type: ignore[method-assign]
        t0 = time.time()
        try:
            w.merge(f"{base}/out", timeout=TIMEOUT, transfer_chunk_bytes=PIECE, transfer_timeout=20.0, progress=False)
            info["error"] = None
        except spillmerge.SpillMergeError as exc:
            info.update(_error(exc), failures=getattr(exc, "failures", None), at=time.time(), waited=time.time() - t0)
    finally:
        with open(f"{result}.{rank}", "w") as fh:
            json.dump(info, fh)


def stalled_sender(rank: int, world: int, port: int, base: str, result: str) -> None:
    """Two ranks on two disks; rank 1 stalls before its third piece until rank 0's receive has timed
    out (the transfer timeout, 3 s), so the transfer fails on both ranks. Then both call ``all_gather_object`` with the merge's
    timeout: a failed transfer must leave no broken group behind for later calls."""
    import spillmerge
    from spillmerge._dist import transfer as _transfer

    info: dict[str, Any] = {"rank": rank}
    timed_out = f"{result}.timed-out"
    try:
        w = _two_disks(rank, world, port, base)
        if rank == 1:  # stalls until rank 0's receive has timed out (3 s), 30 s at most

            def stall() -> None:
                deadline = time.monotonic() + 30.0
                while not os.path.exists(timed_out) and time.monotonic() < deadline:
                    time.sleep(0.05)

            _before_third_piece(stall)
        else:
            wait = _transfer._Link._wait

            def told(self: Any, *args: Any) -> None:
                try:
                    wait(self, *args)
                except spillmerge.SpillMergeError:
                    open(timed_out, "w").close()
                    raise

            _transfer._Link._wait = told  # type: ignore[method-assign]
        try:
            w.merge(f"{base}/out", timeout=TIMEOUT, transfer_chunk_bytes=PIECE, transfer_timeout=3.0, progress=False)
            info["merge_error"] = None
        except spillmerge.SpillMergeError as exc:
            info["merge_error"] = _error(exc)
        got: list[Any] = [None] * world
        t0 = time.time()
        try:
            spillmerge.all_gather_object(got, {"rank": rank}, root=f"{base}/calls", timeout=TIMEOUT)
            info["gathered"] = got
        except spillmerge.SpillMergeError as exc:
            info["gather_error"] = _error(exc)
        info["gather_seconds"] = time.time() - t0
    finally:
        with open(f"{result}.{rank}", "w") as fh:
            json.dump(info, fh)
