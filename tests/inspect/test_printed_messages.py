"""What ``status`` and ``inspect`` print from storage stays in its place: a failure message is one
line without control characters; an interrupted output's header cannot say it is complete or
elsewhere."""

from __future__ import annotations

import json

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


def test_an_interrupted_outputs_header_cannot_say_it_is_complete_or_elsewhere(tmp_path, capsys):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a.mp4", 0, torch.ones(2))
    spillmerge.merge(str(root), str(out), progress=False)
    (out / "spillmerge-complete.json").unlink()
    doc = json.loads((out / "zarr.json").read_text())
    doc["attributes"]["spillmerge"].update(complete=True, path="/elsewhere", kind="merged")
    (out / "zarr.json").write_text(json.dumps(doc))
    assert cli.main(["inspect", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["complete"], got["path"], got["n_frames"]) == (False, str(out), 1)
    assert cli.main(["inspect", str(out)]) == 0
    assert f"merged output {out}  INCOMPLETE" in capsys.readouterr().out
