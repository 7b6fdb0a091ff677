"""Bounded polling with backoff: the one waiting loop every barrier uses (commit records, part
records, the process group's store, commit-record visibility)."""

from __future__ import annotations

import numbers
import time
from collections.abc import Iterator

from .._errors import ConfigError


def poll(timeout: float, *, first: float, cap: float, factor: float = 1.5) -> Iterator[float]:
    """Yield the seconds waited so far: at once, then after sleeps of ``first`` seconds growing by
    ``factor`` up to ``cap``, never sleeping past ``timeout``. The last value yielded is
    ``>= timeout``, so the caller checks once more after the deadline and then decides (raise,
    or give up). ``timeout <= 0``: one check. Usage::

        for waited in poll(timeout, first=0.05, cap=2.0):
            if ready():
                return
            if waited >= timeout:
                raise SomeTimeout(waited)
    """
    # NaN: no deadline is ever reached, and every sleep would be 0 s
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout != timeout:
        raise ConfigError(f"timeout must be a number of seconds (inf: no limit), got {timeout!r}", key="timeout")
    start = time.monotonic()
    delay = first
    while True:
        waited = time.monotonic() - start
        yield waited
        if waited >= timeout:
            return
        time.sleep(min(delay, max(0.0, timeout - waited)))
        delay = min(delay * factor, cap)
