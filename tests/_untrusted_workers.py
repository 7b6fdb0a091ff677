"""Child process of tests/storage/test_untrusted_storage.py: runs every reader on attacked copies of a
spill root or a merged output and reports, per case, what each reader did (as JSON).

A child, so that a hang or a runaway allocation cannot take the test session with it: each case
runs under ``SIGALRM`` (a blocked ``open()`` is interrupted), the address space is capped
(``RLIMIT_AS``) so an unbounded read ends in ``MemoryError`` within the cap, and an audit hook
records every ``open`` that would follow a symbolic link or block on a FIFO.

    python _untrusted_workers.py CASES.json RESULT.json

or ``main(CASES, RESULT, headroom)`` in a process forked from tests/_procs.py's forkserver (torch
and spillmerge already imported there: no interpreter start and no torch import per child).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import stat
import sys
import time
import traceback
from typing import Any

CASE_SECONDS = int(os.environ.get("UNTRUSTED_CASE_SECONDS", "20"))
MEMORY_HEADROOM = int(os.environ.get("UNTRUSTED_MEMORY_HEADROOM", 3 << 30))
"""Address space a case may add (the reference data is a few KiB; a bounded read is < 64 MiB).
The metadata attacks run with less, so that a bomb declaring 1 GiB cannot pass unnoticed."""

_followed: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISLNK(mode) and not flags & os.O_NOFOLLOW:
        _followed.append(f"followed the link {path}")
    elif stat.S_ISFIFO(mode) and not flags & os.O_NONBLOCK:
        _followed.append(f"opened the FIFO {path} blocking")


class _Hang(BaseException):
    """Raised by SIGALRM: not an Exception, so no reader's ``except Exception`` swallows it."""


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang(f"still running after {CASE_SECONDS} s")


def _plain(x: Any) -> Any:
    """A row as JSON: arrays as nested lists, bytes as lists of ints; str and None as they are."""
    import numpy as np

    if isinstance(x, (np.ndarray, np.generic)):
        return x.tolist()
    if isinstance(x, (bytes, bytearray)):
        return list(x)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """(leaf path joined by ".", leaf view) of a file's value (``""`` for plain tensor values)."""
    if not isinstance(value, dict):
        return [(path, value)]
    return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}.{k}" if path else k)]


def _data(store: Any) -> dict[str, Any]:
    """Every leaf of every file, row by row as lists (comparable to the reference): read through
    each leaf view's ``to_list()`` (every kind of column: fixed, ragged, str, absent rows), and
    every value through ``value()`` and ``iter_values()``."""
    import numpy as np

    out: dict[str, Any] = {}
    in_order: dict[str, list[Any]] = {}  # every row read in bulk (iter_values), by file
    for name, _, value in store.iter_values():
        in_order.setdefault(name, []).append(_plain(value))
    for name in store.filenames:
        frames = np.asarray(store.frames(name)).tolist()
        for leaf, view in _leaves(store[name]):
            if "\x1f*" in leaf:  # a list's items (format 4), not one per row: read by value() below
                continue
            out[f"{name}/{leaf}"] = [_plain(row) for row in view.to_list()]
        out[f"{name}/value()"] = [_plain(store.value(name, f)) for f in frames]
        out[f"{name}/iter_values()"] = in_order.get(name, [])
        out[f"{name}/frames"] = frames
    return out


def readers(kind: str, root: str, out: str, scratch: str) -> dict[str, Any]:
    """name -> a callable returning what the reader produced (compared with the reference)."""
    import spillmerge
    from spillmerge._inspect import coverage as _coverage
    from spillmerge._inspect import summary as _inspect

    def merge_and_read() -> Any:
        spillmerge.merge(root, scratch, allow_partial=True, overwrite=True)
        return _data(spillmerge.open(scratch))

    def open_and_read() -> Any:
        return _data(spillmerge.open(out))

    def finalize() -> Any:  # the parts barrier reads every part record again
        spillmerge.merge(root, out, allow_partial=True, finalize=True, overwrite=True)
        return _data(spillmerge.open(out))

    def parts_then_finalize() -> Any:  # part 1 reads the stored plan (or rebuilds it), then the finalize
        spillmerge.merge(root, out, part=(1, 2), timeout=5.0, progress=False)
        spillmerge.merge(root, out, finalize=True, timeout=5.0, progress=False)
        return _data(spillmerge.open(out))

    def verify(path: str) -> Any:
        return spillmerge.verify(path).ok

    def wait_for_dst() -> Any:  # a rank waiting for dst's output reads dst's merge failure record
        from spillmerge._dist import round as _round
        from spillmerge._storage import Storage

        _round.wait_complete(Storage(out), Storage(root), run_id="run-x", session=0, dst=0, timeout=1.0)

    def status() -> Any:  # reads every rank's progress.json (advisory: a bad one is no count)
        from spillmerge._inspect import status as _status

        return _status.format_status(_status.status(root)) is not None

    def callback_report() -> Any:  # a ddp_spawn launcher reads the merging rank's report file
        from spillmerge.integrations._prediction_writer import SpillPredictionWriterMixin

        class Base:  # Lightning's BasePredictionWriter, whose import costs seconds: the callback's
            def __init__(self, write_interval: str) -> None:  # report is read by the mixin alone
                pass

        class Callback(SpillPredictionWriterMixin, Base):
            pass

        cb = Callback(root, out)
        cb._created = 0.0  # the file was written before this callback: read it anyway
        rep = cb.report
        return None if rep is None else rep.n_frames

    if kind == "parts":  # an output between the parts of a merge: part 0 of 2 stored the plan
        return {"parts": parts_then_finalize}
    if kind == "spill":
        return {
            "status": status,
            "report": callback_report,
            "wait": wait_for_dst,
            "merge": merge_and_read,
            "verify": lambda: verify(root),
            "inspect": lambda: (_inspect.summarize(root)["kind"], _coverage.coverage(root).kind),
            "committed_keys": lambda: {k: sorted(v) for k, v in spillmerge.committed_keys(root).items()},
        }
    return {
        "open": open_and_read,
        "verify": lambda: verify(out),
        "inspect": lambda: (_inspect.summarize(out)["kind"], _coverage.coverage(out).kind),
        "finalize": finalize,
    }


def _hit_the_cap(exc: BaseException) -> bool:
    """Whether a ``MemoryError`` (the address-space cap) is anywhere in ``exc``'s chain."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 50:
        if isinstance(cur, MemoryError) or "Unable to allocate" in str(cur):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    import spillmerge

    results: dict[str, Any] = {}
    for name, fn in readers(case["target"], case["root"], case["out"], case["scratch"]).items():
        del _followed[:]
        t = time.perf_counter()
        signal.alarm(CASE_SECONDS)
        try:
            value = fn()
            outcome: dict[str, Any] = {"ok": True, "value": value}
        except spillmerge.SpillMergeError as exc:
            outcome = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500]}
            if _hit_the_cap(exc):  # a refusal that came from running out of memory is no bound
                outcome["error"] = f"ESCAPED MemoryError inside {type(exc).__name__}"
        except _Hang as exc:
            outcome = {"ok": False, "error": "HANG", "message": str(exc)}
        except BaseException as exc:  # noqa: BLE001 - exactly what the test is looking for
            outcome = {"ok": False, "error": f"ESCAPED {type(exc).__name__}", "message": traceback.format_exc()[-1500:]}
        finally:
            signal.alarm(0)
        outcome["seconds"] = round(time.perf_counter() - t, 3)
        outcome["followed"] = list(_followed)
        results[name] = outcome
    return results


def _warm_up() -> None:
    """One small write, merge and read before the address space is capped: every shared library
    they load (the planner's DuckDB and pyarrow among them) is loaded and its thread-local data
    set up here; a library first loaded under the cap can abort the process ("cannot allocate
    memory for thread-local data") instead of raising MemoryError."""
    import shutil
    import tempfile

    import numpy as np

    import spillmerge

    tmp = tempfile.mkdtemp(prefix="untrusted-warm-up-")
    try:
        with spillmerge.SpillWriter(f"{tmp}/spill", rank=0, world_size=1) as w:
            for i in range(4):
                w.write(f"f{i % 2}.bin", i, {"a": np.ones(3), "s": "x", "l": [1, {"k": 2.0}]})
        spillmerge.merge(f"{tmp}/spill", f"{tmp}/out", progress=False)
        res = spillmerge.open(f"{tmp}/out")
        list(res.iter_values())
        spillmerge.verify(f"{tmp}/out")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(cases_path: str, result_path: str, headroom: int = MEMORY_HEADROOM) -> None:
    import torch

    import spillmerge  # noqa: F401 - imported before the address space is capped

    torch.set_num_threads(1)
    with open(cases_path) as f:
        cases = json.load(f)
    # Every library a reader or a merge may load, before the cap: a shared library loaded under it
    # can abort the process ("cannot allocate memory for thread-local data").
    import spillmerge.integrations._prediction_writer  # noqa: F401 - the callback's report reader

    _warm_up()
    # Everything imported and warmed up stays for the child's life: out of the collector's sight,
    # so a full collection scans what the cases allocate, not torch's and zarr's objects (~0.1 s each).
    gc.freeze()
    signal.signal(signal.SIGALRM, _alarm)
    sys.addaudithook(_audit)
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))
    report = {case["id"]: run_case(case) for case in cases}
    with open(result_path, "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # a reader thread blocked in open() must not keep the process alive


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
