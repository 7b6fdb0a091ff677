"""Process helpers shared by the multi-process tests (ports, spawned gloo ranks, bounded joins)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(worker: Callable[..., None], world: int, base: Path, timeout: float) -> dict[int, dict[str, Any]]:
    """Run ``worker(rank, world, port, base)`` in ``world`` spawned processes; a hang or a failing
    rank fails the test (with the worker's traceback). Returns ``base/results/rank-R.json``."""
    import torch.multiprocessing as tmp_mp

    ctx = tmp_mp.start_processes(
        worker, args=(world, free_port(), str(base)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        # join() raises ProcessRaisedException / ProcessExitedException, with the worker's
        # traceback, as soon as one rank fails, and terminates the others.
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish within {timeout:.0f} s (hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    results = {}
    for r in range(world):
        path = base / "results" / f"rank-{r}.json"
        assert path.exists(), f"rank {r} exited without writing its results"
        results[r] = json.loads(path.read_text(encoding="utf-8"))
    return results


def join_all(procs: list[Any], timeout: float) -> None:
    """Join plain ``multiprocessing`` processes within ``timeout`` in all; kill and fail on a hang."""
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.time()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"


def ranks_fixture(worker: Callable[..., None], world: int, name: str, timeout: float = 240.0) -> Any:
    """A module-scoped fixture that runs every scenario of ``worker`` once in ``world`` spawned
    gloo ranks (a hang fails the test after ``timeout`` seconds) and returns ``(base dir,
    results by rank)``. Use as ``ranks = ranks_fixture(worker, WORLD, "multirank")``."""

    @pytest.fixture(scope="module")
    def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
        base = tmp_path_factory.mktemp(name)
        return base, spawn_ranks(worker, world, base, timeout)

    return ranks
