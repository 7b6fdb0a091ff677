"""The cyclic garbage collector paused while a step builds many new, acyclic objects."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any


def gc_paused(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the cyclic garbage collector paused, restarted only when it was running.

    For steps that build only new, acyclic dicts, lists and strings (parsed JSON, values read
    back): each full collection meanwhile traverses every object of the process, the caller's
    data included, and finds nothing here. Beside 20k generated LLM outputs a full pass takes
    about 0.2 s; the merge and ``iter_values`` of them spent a third of their CPU in such passes
    (benchmarks/RESULTS.md). Only bounded steps are paused, never a generator across a yield."""
    if not gc.isenabled():
        return fn(*args)
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()
