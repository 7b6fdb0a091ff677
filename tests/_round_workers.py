"""Rank bodies for tests/distributed/test_round_failures.py: the merge round (``SpillWriter.merge``,
``gather`` / ``all_gather``, the drop-ins) when a rank fails mid-transfer or passes arguments the
others do not, in 3 gloo ranks; every scenario runs in the same processes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from _mp_scenarios import _error, run_scenarios

WORLD = 3
TIMEOUT = 20.0
"""Each call's timeout: a rank that waits it out instead of being told fails its test's bound."""
PIECE = 4096  # the smallest transfer staging buffer: every shard is larger


def preds(rank: int, tag: str) -> dict[str, Any]:
    """Rank ``rank``'s frames of its own file, each larger than a transfer piece."""
    return {
        f"{tag}-r{rank}.mp4": {i: {"x": torch.arange(2000, dtype=torch.float32) + 100 * rank + i} for i in range(4)}
    }


def frames(store: Any) -> dict[str, list[int]] | None:
    return None if store is None else {n: store.frames(n).tolist() for n in store.filenames}


def attempt(fn: Any) -> dict[str, Any]:
    """What ``fn()`` returned or raised, and how long it took."""
    t0 = time.perf_counter()
    try:
        return {"error": None, "got": fn(), "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        return {"error": _error(exc), "rank_attr": getattr(exc, "rank", None), "seconds": time.perf_counter() - t0}


def all_gather(rank: int, tag: str, base: str, **kw: Any) -> dict[str, Any]:
    import spillmerge

    kw = {"root": f"{base}/{tag}/disk{rank}", "timeout": TIMEOUT, "progress": False, **kw}
    out = kw.pop("out", f"{base}/{tag}/out")
    return attempt(lambda: frames(spillmerge.all_gather(preds(rank, tag), out, transfer_chunk_bytes=PIECE, **kw)))


def transfer_fails_on_dst(rank: int, world: int, base: str) -> dict[str, Any]:
    """Every rank on its own disk; a piece rank 2 sends is flipped in flight, so rank 0's transfer
    fails. Rank 1, whose shards had moved already, waits for the output: it must be told at once,
    naming rank 0 and the cause, not wait out its timeout. Then the same call succeeds."""
    from spillmerge._dist import transfer as _transfer

    original = _transfer._Link.send_bytes_piece
    if rank == 2:

        def flip(self: Any, n: int, peer: int, me: int, what: str) -> None:
            if "manifest" not in what:
                self.host[0] ^= 0xFF
            original(self, n, peer, me, what)

        _transfer._Link.send_bytes_piece = flip  # type: ignore[method-assign]
    try:
        failed = all_gather(rank, "corrupt", base)
    finally:
        _transfer._Link.send_bytes_piece = original  # type: ignore[method-assign]
    return {"failed": failed, "after": all_gather(rank, "corrupt_again", base)}


def sender_cannot_read(rank: int, world: int, base: str) -> dict[str, Any]:
    """Every rank on its own disk; rank 2 cannot read its second piece of a shard while sending
    it: rank 2 raises its error, rank 0 names rank 2 and the cause at once (not after the
    transfer timeout), rank 1 hears it from rank 0. Then the same call succeeds."""
    from spillmerge._storage import LocalStorage

    original = LocalStorage.read_into
    if rank == 2:
        calls = [0]

        def fail(self: Any, pieces: Any, out: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise OSError("rank 2's disk went away")
            original(self, pieces, out)

        LocalStorage.read_into = fail  # type: ignore[method-assign]
    try:
        failed = all_gather(rank, "unread", base, transfer_timeout=TIMEOUT)
    finally:
        LocalStorage.read_into = original  # type: ignore[method-assign]
    return {"failed": failed, "after": all_gather(rank, "unread_again", base)}


def writer_refused_under_a_launcher_run_id(rank: int, world: int, base: str) -> dict[str, Any]:
    """Under a launcher (one run id for every call, as torchrun gives), rank 1's writer of a call
    is refused (a bad option) before it opens: the others name rank 1 at once, and the next
    call on every rank merges (the ranks still count the run's writer sessions alike)."""
    os.environ["TORCHELASTIC_RUN_ID"] = "refused"
    try:
        refused = all_gather(rank, "refused", base, writer_options={"chunk_bytes": "bad"} if rank == 1 else None)
        after = all_gather(rank, "refused_again", base)
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]
    return {"refused": refused, "after": after}


def other_out(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 1 passes another output path: every rank raises naming it, none returns a store that
    lacks its data or a path that holds no output."""
    out = f"{base}/out_args/elsewhere" if rank == 1 else f"{base}/out_args/out"
    return {"result": all_gather(rank, "out_args", base, out=out), "after": all_gather(rank, "out_args_again", base)}


def other_dst(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 2 passes dst=2, the others dst=0: every rank raises naming rank 2's dst."""
    got = all_gather(rank, "dst_args", base, dst=2 if rank == 2 else 0)
    return {"result": got, "after": all_gather(rank, "dst_args_again", base)}


def second_round_over_gloo(rank: int, world: int, base: str) -> dict[str, Any]:
    """A writer's second merge with ``transport="gloo"`` (its shards already moved by the first)
    merges like the first, with no error about torch.distributed."""
    import spillmerge

    with spillmerge.SpillWriter(f"{base}/again/disk{rank}") as w:
        w.update(preds(rank, "again"))
    kw: dict[str, Any] = {"transport": "gloo", "timeout": TIMEOUT, "progress": False, "wait": True}
    first = attempt(lambda: w.merge(Path(base, "again", "one"), **kw) and None)  # a path object, as often
    second = attempt(lambda: w.merge(f"{base}/again/two", **kw) and None)
    if rank == 0 and second["error"] is None:
        second["frames"] = frames(spillmerge.open(f"{base}/again/two"))
    return {"first": first, "second": second}


def second_round_into_the_same_output(rank: int, world: int, base: str) -> dict[str, Any]:
    """A writer's second round into the output of its first (``overwrite=True``): a waiting rank
    returns once this round's merge is done, not on the first round's completion marker."""
    import spillmerge

    with spillmerge.SpillWriter(f"{base}/same/spill") as w:
        w.update(preds(rank, "same"))
    kw: dict[str, Any] = {"timeout": TIMEOUT, "progress": False, "wait": True}
    first = attempt(lambda: w.merge(f"{base}/same/out", **kw) and None)
    if rank == 0:
        time.sleep(1.5)  # the others wait in the second round meanwhile, the first round's marker in sight
    started = time.time()
    second = attempt(lambda: w.merge(f"{base}/same/out", overwrite=True, **kw) and None)
    return {"first": first, "second": second, "started": started, "returned": time.time()}


def dropin_other_dst(rank: int, world: int, base: str) -> dict[str, Any]:
    """``gather_object`` where rank 2 passes dst=2 (and its list), the others dst=0."""
    import spillmerge

    dst = 2 if rank == 2 else 0
    got: list[Any] | None = [None] * world if rank == dst else None
    return attempt(lambda: spillmerge.gather_object({"r": rank}, got, dst=dst, timeout=TIMEOUT))


SHORT = 3.0


def dropin_other_root(rank: int, world: int, base: str) -> dict[str, Any]:
    """``all_gather_object`` with ``root=`` naming another folder on every rank: each rank raises
    naming the roots at once (not at the timeout) and nothing is left in any of them. Last: a
    wait that times out can leave the group's gloo pairs unusable."""
    import torch.distributed as dist

    import spillmerge

    root = f"{base}/roots/rank{rank}"
    os.makedirs(root, exist_ok=True)
    records = attempt(lambda: spillmerge.all_gather_object([None] * world, [{"a": rank}], root=root, timeout=SHORT))
    general = attempt(lambda: spillmerge.all_gather_object([None] * world, {"k": (rank,)}, root=root, timeout=SHORT))
    dist.barrier()
    return {"records": records, "general": general, "left": os.listdir(root)}


def dropin_read_fails(rank: int, world: int, base: str) -> dict[str, Any]:
    """``all_gather_object`` where rank 1 cannot read the others' objects back (a fault injected
    into its reading step, records and the general way): every rank raises naming rank 1 at once,
    nothing is left, and the next call works."""
    import torch.distributed as dist

    import spillmerge
    from spillmerge._dist import dropin

    def broken(*args: Any) -> None:
        raise spillmerge.CorruptSpillError("disk read back garbage")

    root = f"{base}/readfail"
    os.makedirs(root, exist_ok=True)
    saved = dropin._get_records, dropin._read
    if rank == 1:
        dropin._get_records = dropin._read = broken
    try:
        records = attempt(
            lambda: spillmerge.all_gather_object([None] * world, [{"a": rank}], root=root, timeout=TIMEOUT)
        )
        general = attempt(
            lambda: spillmerge.all_gather_object([None] * world, {"k": (rank,)}, root=root, timeout=TIMEOUT)
        )
    finally:
        dropin._get_records, dropin._read = saved
    got: list[Any] = [None] * world
    after = attempt(lambda: spillmerge.all_gather_object(got, {"k": (rank,)}, root=root, timeout=TIMEOUT))
    after["exact"] = [(type(g), type(g["k"]), g["k"]) for g in got] == [(dict, tuple, (q,)) for q in range(world)]
    dist.barrier()  # dst removes the call's folder once every rank has read: after its return here
    return {"records": records, "general": general, "after": after, "left": os.listdir(root)}


SCENARIOS = {
    "transfer_fails_on_dst": transfer_fails_on_dst,
    "sender_cannot_read": sender_cannot_read,
    "writer_refused_under_a_launcher_run_id": writer_refused_under_a_launcher_run_id,
    "other_out": other_out,
    "other_dst": other_dst,
    "second_round_over_gloo": second_round_over_gloo,
    "second_round_into_the_same_output": second_round_into_the_same_output,
    "dropin_other_dst": dropin_other_dst,
    "dropin_other_root": dropin_other_root,
    "dropin_read_fails": dropin_read_fails,
}


def worker(rank: int, world: int, port: int, base: str) -> None:
    """Entry point for ``torch.multiprocessing.start_processes`` (the rank comes first)."""
    from spillmerge._dist import transfer as _transfer

    _transfer.VISIBILITY_GRACE = 0.2  # private disks: dst stops looking for their commit records soon
    run_scenarios(rank, world, port, base, SCENARIOS, barrier_between=True)
