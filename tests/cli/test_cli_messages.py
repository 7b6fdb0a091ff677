"""The CLI's edges stay one line: torch missing for the demo, a reader of stdout that goes away,
a positional output; sizes are printed in the unit that fits them, the same everywhere."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spillmerge
from spillmerge import cli
from spillmerge._util.units import size_text

EXE = shutil.which("spillmerge", path=os.path.dirname(sys.executable)) or "spillmerge"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def _spill(root: Path, files: int = 3) -> None:
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for f in range(files):
            w.write(f"clip {f}.mp4", 0, {"mask": torch.full((4, 4), float(f)), "score": f / 10})


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_demo_without_torch_names_the_install_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError, as when not installed
    assert cli.main(["demo", "--out", str(tmp_path / "d")]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("spillmerge demo: error: ") and "pip install 'spillmerge[torch]'" in line, line
    assert not (tmp_path / "d").exists()


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    root = tmp_path / "spill"
    _spill(root)
    p = subprocess.Popen([EXE, "inspect", str(root)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # `| head` that exited: the command's first write finds no reader
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err  # 128 + SIGPIPE, as other tools in a pipeline
    assert err == ""


def test_a_positional_output_asks_for_out(tmp_path, capsys):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    assert cli.main(["merge", str(root), str(out)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == f"spillmerge merge: error: merge takes one path, the spill root; did you mean --out {out}?", line
    assert not out.exists()


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (8_300_000, "7.9 MiB"), (3 << 30, "3.0 GiB"), (5 << 40, "5.0 TiB")],
)
def test_sizes_take_the_unit_that_fits(n, text):
    assert size_text(n) == text


def test_merge_report_and_verify_print_sizes_in_the_unit_that_fits(tmp_path, capsys):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    assert cli.main(["merge", str(root), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = spillmerge.merge(str(root), str(tmp_path / "again.zarr"))
    assert f"3 frames, {size_text(report.nbytes)} from 1 ranks" in str(report) and report.nbytes < 1024
    assert "GiB" not in str(report) and f"{size_text(report.nbytes)} from" in printed
    assert cli.main(["verify", str(out)]) == 0
    assert re.search(r"objects, \d+ B of payload verified$", capsys.readouterr().out.strip())
