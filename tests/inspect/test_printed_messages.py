"""A failure message read from storage prints as one line without control characters: it cannot
break the table of ``status`` or ``inspect``, nor send escape sequences to the terminal."""

from __future__ import annotations

import pytest
import torch

import spillmerge
from spillmerge import cli


def test_a_failure_message_prints_as_one_escaped_line(tmp_path, capsys):
    root = tmp_path / "spill"
    with pytest.raises(RuntimeError):
        with spillmerge.SpillWriter(str(root), rank=0, world_size=2) as w:
            w.write("a.mp4", 0, torch.ones(2))
            raise RuntimeError("line one\nline two \x1b[31mred")
    with spillmerge.SpillWriter(str(root), rank=1, world_size=2) as w:
        w.write("b.mp4", 0, torch.ones(2))
    for argv in (["status", str(root)], ["inspect", str(root)]):
        cli.main(argv)
        out = capsys.readouterr().out
        assert "\x1b" not in out, out
        (row,) = [ln for ln in out.splitlines() if "RuntimeError" in ln]
        assert "line one\\nline two \\x1b[31mred" in row, row
