"""Sizes and durations as people read them: the one formatter of byte counts in every message,
report and summary (``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB``, chosen by size), and of seconds."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def size_text(n: float) -> str:
    """``512`` → ``"512 B"``, ``8_300_000`` → ``"7.9 MiB"``: the largest unit that keeps the number
    at 1 or more, one decimal (whole bytes below 1 KiB)."""
    x = float(n)
    for unit in _UNITS:
        if abs(x) < 1024 or unit == _UNITS[-1]:
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def duration_text(seconds: float) -> str:
    """``5`` → ``"5s"``, ``185`` → ``"3m05s"``, ``3720`` → ``"1h02m"``."""
    s = max(0, int(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
