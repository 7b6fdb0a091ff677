"""Worker functions for tests/distributed/test_failures.py (importable by spawned processes)."""

from __future__ import annotations

import json
import os
import time
import traceback

import torch


def frame(filename: str, i: int) -> torch.Tensor:
    return torch.full((1024,), float(i), dtype=torch.float32) + len(filename)


def raising_rank(rank: int, world: int, port: int, root: str, out: str, result: str) -> None:
    """4 gloo ranks; rank 2 raises inside its writer. Rank 0's merge must name it quickly."""
    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    info: dict = {"rank": rank}
    try:
        with spillmerge.SpillWriter(root, chunk_bytes=4096) as w:
            for i in range(rank, 40, world):
                if rank == 2 and i >= 20:
                    info["raised_at"] = time.time()
                    raise ValueError(f"model blew up on frame {i}")
                w.write("clip.mp4", i, frame("clip.mp4", i))
        if rank == 0:  # merges at once: rank 2's failure record is seen whenever it lands
            t0 = time.time()
            try:
                w.merge(out, timeout=120)
                info["error"] = None
            except spillmerge.SpillMergeError as exc:
                info.update(
                    error=type(exc).__name__,
                    message=str(exc),
                    failures=getattr(exc, "failures", None),
                    waited=time.time() - t0,
                    detected_at=time.time(),
                )
        else:
            # The merge is collective: the other ranks hear of rank 2's failure from rank 0.
            try:
                w.merge(out, timeout=120)
                info["error"] = None
            except spillmerge.SpillMergeError as exc:
                info.update(error=type(exc).__name__, message=str(exc), failures=getattr(exc, "failures", None))
    except ValueError as exc:
        info["raised"] = str(exc)
    except BaseException:
        info["crash"] = traceback.format_exc()
    finally:
        with open(f"{result}.{rank}", "w") as f:
            json.dump(info, f)
        # No barrier here: a failed rank must not hang the others, so nobody waits for anybody.


def slow_spiller(root: str, rank: int, world: int, n_frames: int, ready: str) -> None:
    """A SLURM-style task (no torch.distributed): spill, flag progress, then hang until killed."""
    import spillmerge

    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    w = spillmerge.SpillWriter(root, chunk_bytes=4096)
    with w:
        for i in range(n_frames):
            w.write(f"task{rank}.mp4", i, frame(f"task{rank}.mp4", i))
        if rank == 1:
            # Wait for the flush thread's own record of what is durable, not for a while: all
            # n_frames chunks uploaded and their journal entries written (the test counts them).
            flusher = w._staging.flusher
            deadline = time.time() + 60  # a hang guard only
            while time.time() < deadline and not (
                flusher.written == n_frames
                and len(flusher._journals) == n_frames
                and all(f.done() for f in flusher._journals)
            ):
                time.sleep(0.01)
            assert flusher.error is None and all(f.exception() is None for f in flusher._journals)
            w.write("only1.mp4", 0, torch.zeros(4))  # stays in the staging buffer: lost with the rank
            open(ready, "w").close()
            time.sleep(600)  # SIGKILLed here by the test


def enospc_spill(root: str, result: str) -> None:
    """Spill into a 1 MiB tmpfs: the error must reach the loop with the path and the cause."""
    import spillmerge

    info: dict = {}
    try:
        with spillmerge.SpillWriter(root, rank=1, world_size=2, chunk_bytes=64 << 10) as w:
            for i in range(100):  # 100 x 64 KiB = 6.4 MiB > 1 MiB
                w.write("big.mp4", i, torch.zeros(16 << 10))
        info["error"] = None
    except spillmerge.SpillMergeError as exc:
        info.update(error=type(exc).__name__, message=str(exc), path=getattr(exc, "path", None))
    with open(result, "w") as f:
        json.dump(info, f)


def stale_root_rank(rank: int, world: int, port: int, base: str) -> None:
    """2 gloo ranks on a spill root left by a 1-rank run: every rank fails at `with SpillWriter`,
    before writing anything, with the error naming the stale segment."""
    import torch.distributed as dist

    import spillmerge

    torch.set_num_threads(1)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    info: dict = {"rank": rank, "wrote": False}
    try:
        with spillmerge.SpillWriter(os.path.join(base, "spill")) as w:
            info["wrote"] = True
            w.write("clip.mp4", rank, frame("clip.mp4", rank))
    except spillmerge.SpillMergeError as exc:
        info.update(
            error=type(exc).__name__, message=str(exc), value_error=isinstance(exc, ValueError),
            stale=getattr(exc, "stale", None), world_size=getattr(exc, "world_size", None),
        )  # fmt: skip
    finally:
        dist.destroy_process_group()
        os.makedirs(os.path.join(base, "results"), exist_ok=True)
        with open(os.path.join(base, "results", f"rank-{rank}.json"), "w") as f:
            json.dump(info, f)
