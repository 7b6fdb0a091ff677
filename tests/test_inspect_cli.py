"""``spillmerge inspect`` / ``verify`` through the entry point: frames (not leaf rows) counted,
bounded listings, and a progress bar on a terminal only."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import torch

import spillmerge

HERE = Path(__file__).parent
EXE = os.path.join(os.path.dirname(sys.executable), "spillmerge")
ENV = {**os.environ, "PYTHONPATH": str(HERE.parent)}


def _spill(root: Path, n_files: int = 5) -> None:
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        for i in range(n_files):  # one frame per file, five leaves per frame
            w.write(f"f{i}.mp4", 0, {k: torch.ones(2) for k in "abcde"})


def test_inspect_counts_frames_not_leaf_rows(tmp_path):
    root = tmp_path / "spill"
    _spill(root, n_files=1)
    p = subprocess.run([EXE, "inspect", str(root)], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "'f0.mp4': 1 frame\n" in p.stdout + "\n" and "rows" not in p.stdout, p.stdout
    j = json.loads(subprocess.run([EXE, "inspect", str(root), "--json"], capture_output=True, text=True,
                                  env=ENV, timeout=120).stdout)  # fmt: skip
    assert j["files"] == [{"filename": "f0.mp4", "frames": 1}] and j["frames"] == 1


def test_json_lists_at_most_max_files_and_counts_all(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    spillmerge.merge(str(root), str(out))
    for path in (root, out):
        p = subprocess.run([EXE, "inspect", str(path), "--json", "--files", "2"], capture_output=True, text=True,
                           env=ENV, timeout=120)  # fmt: skip
        j = json.loads(p.stdout)
        assert len(j["files"]) == 2 and len(j["coverage"]["files"]) == 2
        assert j["n_files"] == 5 and j["coverage"]["n_files"] == 5 and j["coverage"]["present_frames"] == 5


def _on_a_terminal(args: list[str]) -> str:
    """Run the entry point with stdout and stderr on a pseudo-terminal; everything it printed."""
    master, slave = pty.openpty()
    # A fresh pseudo-terminal is 0 columns wide, where tqdm draws nothing: size it as a terminal.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    p = subprocess.Popen(args, stdout=slave, stderr=slave, env=ENV)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    p.wait(timeout=120)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_and_none_when_piped(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    spillmerge.merge(str(root), str(out))
    for cmd in (["verify", str(root)], ["verify", str(out)], ["inspect", str(root)]):
        tty = _on_a_terminal([EXE, *cmd])
        assert f"\r{cmd[0]}:" in tty and "%|" in tty, (cmd, tty)  # the bar is drawn (and cleared at the end)
        piped = subprocess.run([EXE, *cmd], capture_output=True, text=True, env=ENV, timeout=120)
        assert piped.returncode == 0, piped.stderr
        assert "%|" not in piped.stdout + piped.stderr and "\r" not in piped.stderr, (cmd, piped.stderr)
