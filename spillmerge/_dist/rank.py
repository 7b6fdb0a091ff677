"""Rank, world size and run id resolution. Never uses a GPU collective."""

from __future__ import annotations

import contextlib
import datetime
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .._errors import CoordinationError, SpillMergeError, SpillValueError
from .store import dist_initialized, next_session, publish_failure


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SpillValueError(f"environment variable {name}={raw!r} is not an integer") from None


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit arguments, else torch.distributed when initialised, else env RANK/WORLD_SIZE,
    else 0 and 1."""
    if rank is None:
        rank = dist.get_rank() if dist_initialized() else _env_int("RANK", 0)
    if world_size is None:
        world_size = dist.get_world_size() if dist_initialized() else _env_int("WORLD_SIZE", 1)
    for name, v in (("rank", rank), ("world_size", world_size)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise SpillValueError(f"{name} must be an int, got {v!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise SpillValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return rank, world_size


def launcher_run_id(run_id: str | None) -> str | None:
    """The run id known without asking the other ranks: the explicit argument, else the
    launcher's (torchrun's TORCHELASTIC_RUN_ID, SLURM's job id), else None."""
    if run_id is not None:
        return str(run_id)
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return f"torchelastic-{elastic}"
    slurm = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    return f"slurm-{slurm}" if slurm else None


def resolve_run_id(run_id: str | None, timeout: float = 300.0) -> str | None:
    """The id shared by all ranks of one job run.

    :func:`launcher_run_id`, else, when torch.distributed is initialised, rank 0's fresh id
    broadcast over a gloo group (CPU only), else None (the merge then waits on each rank's
    newest segment).
    """
    known = launcher_run_id(run_id)
    if known is not None:
        return known
    if dist_initialized():
        try:
            group = gloo_group(timeout)
            obj = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(obj, src=0, group=group)
        except RuntimeError as exc:  # gloo reports timeouts and dead peers as RuntimeError
            _drop_gloo_group(timeout)
            raise CoordinationError(
                f"rank {dist.get_rank()}: agreeing on a run id with the other ranks failed within "
                f"{timeout:.0f} s ({exc}); every rank must create its SpillWriter, or pass run_id=...",
                rank=dist.get_rank(),
            ) from exc
        return str(obj[0])
    return None


_GLOO_GROUPS: dict[tuple[int, float], object] = {}


def gloo_group(timeout: float):  # type: ignore[no-untyped-def]
    """A CPU-only process group over all ranks (never NCCL) whose waits end after ``timeout``
    seconds: one per default process group and timeout, so a call's own timeout bounds its waits
    whatever an earlier call passed. Every rank passes the same timeout, as with any collective's
    arguments: creating a group is itself a collective of all ranks."""
    key = (id(dist.group.WORLD), float(timeout))
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    return _GLOO_GROUPS[key]


def _drop_gloo_group(timeout: float) -> None:
    """Forget the group of ``timeout`` after a collective on it failed: gloo closes the
    connections of a timed-out operation for good, so the next call builds a new group (every
    rank of a failed collective fails too, and drops its own)."""
    _GLOO_GROUPS.pop((id(dist.group.WORLD), float(timeout)), None)


def on_gloo(rank: int, timeout: float, what: str, collective: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
    """``collective(*args, group=gloo_group(timeout), **kwargs)``; a timeout or a dead peer (gloo
    raises RuntimeError) as a :class:`CoordinationError` saying not every rank ``what``."""
    try:
        collective(*args, group=gloo_group(timeout), **kwargs)
    except RuntimeError as exc:
        _drop_gloo_group(timeout)
        raise CoordinationError(
            f"rank {rank}: not every rank {what} within {timeout:.0f} s ({exc})", rank=rank
        ) from exc


def refused(run_id: str | None, rank: int | None, world_size: int | None, exc: Exception) -> None:
    """This rank's writer could not be created: count its session as the other ranks' writers do
    (a later writer keeps one number on every rank) and tell them at once."""
    session = next_session(run_id)
    with contextlib.suppress(SpillMergeError):  # its rank may be what is wrong: then only the count
        publish_failure(run_id, resolve_rank(rank, world_size)[0], f"{type(exc).__name__}: {exc}", session=session)
