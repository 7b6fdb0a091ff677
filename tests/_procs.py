"""Process helpers shared by the multi-process tests (ports, gloo rank processes, bounded joins)."""

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


PRELOAD = ["torch", "torch.distributed", "spillmerge"]
"""What the forkserver imports once, before it forks any rank: a spawned rank spent about 3 s of
CPU importing torch; a rank forked from the server starts in milliseconds, as a fresh process
that has run nothing else (the server forks before any test code runs in it)."""


def rank_context() -> Any:
    """The ``multiprocessing`` context rank processes start from: the forkserver, with ``PRELOAD``
    (set before this process starts its server; later calls change nothing). A rank gets the
    parent's ``sys.path`` but the environment the server started with: pass what a rank needs
    as arguments, not through ``os.environ`` changes made by the test."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spawn_ranks(
    worker: Callable[..., None], world: int, base: Path, timeout: float, start_method: str = "forkserver"
) -> dict[int, dict[str, Any]]:
    """Run ``worker(rank, world, port, base)`` in ``world`` new processes (forked from a
    forkserver that has imported ``PRELOAD``; ``start_method="spawn"`` for a bare interpreter);
    a hang or a failing rank fails the test (with the worker's traceback). Returns
    ``base/results/rank-R.json``."""
    import torch.multiprocessing as tmp_mp

    if start_method == "forkserver":
        rank_context()
    ctx = tmp_mp.start_processes(
        worker, args=(world, free_port(), str(base)), nprocs=world, join=False, start_method=start_method
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
    """A module-scoped fixture that runs every scenario of ``worker`` once in ``world`` new
    gloo ranks (a hang fails the test after ``timeout`` seconds) and returns ``(base dir,
    results by rank)``. Use as ``ranks = ranks_fixture(worker, WORLD, "multirank")``."""

    @pytest.fixture(scope="module")
    def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
        base = tmp_path_factory.mktemp(name)
        return base, spawn_ranks(worker, world, base, timeout)

    return ranks


def assert_timed_out(results: dict[int, dict[str, Any]], scenario: str, timeout: float, ranks: Any) -> None:
    """Each rank in ``ranks`` raised ``CoordinationError`` in ``scenario`` after waiting about
    ``timeout`` seconds, and its message says so: a rank that waits on a call another rank never
    makes ends in a timeout, not a hang. ``results[r][scenario]`` holds ``error`` (``type``,
    ``msg``) and ``waited`` (seconds); the 30 s slack over ``timeout`` is a loaded machine's."""
    for r in ranks:
        res = results[r][scenario]
        assert res["error"] is not None and res["error"]["type"] == "CoordinationError", (r, res)
        assert f"within {timeout:.0f} s" in res["error"]["msg"], (r, res)
        assert timeout * 0.9 <= res["waited"] <= timeout + 30, (r, res)
