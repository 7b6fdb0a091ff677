"""The cyclic garbage collector paused while a step builds many new, acyclic objects."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any


def gc_paused(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the cyclic garbage collector paused, restarted only when it was running.

    For bounded steps that build only new, acyclic objects (parsed JSON, values read back): a
    full collection meanwhile traverses every object of the process and finds nothing."""
    if not gc.isenabled():
        return fn(*args)
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()
