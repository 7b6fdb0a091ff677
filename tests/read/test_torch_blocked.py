"""Reading in this environment with ``import torch`` made to fail (a meta path hook in a fresh
process): ``open``, ``value``, ``iter_values``, ``iter_batches``, ``verify`` and the CLI's
``inspect`` work and import no torch; ``value(as_torch=True)`` and ``OutputDataset``'s rows say
torch is missing. (The ``slow`` test in test_no_torch.py does the same in an environment built
without torch.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import spillmerge

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import contextlib, io, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)

sys.meta_path.insert(0, NoTorch())
import spillmerge
from spillmerge import cli

out = sys.argv[1]
res = spillmerge.open(out)
v = res.value("b", 2)
assert v["s"] == "b2" and v["n"] is None and str(v["bf"].dtype) == "bfloat16" and v["bf"].tolist() == [2.0, 2.0], v
assert v["l"] == [2, "x"] and v["boxes"].shape == (2, 4), v
rows = list(res.iter_values())
assert [(f, i) for f, i, _ in rows] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)], rows
assert rows[5][2]["s"] == "b2"
assert sum(b.num_rows for b in res.iter_batches(columns=["s", "bf"], batch_size=4)) == 6
assert spillmerge.verify(out).problems == []
try:
    res.value("a", 0, as_torch=True)
except spillmerge.MissingDependencyError as exc:
    assert "pip install 'spillmerge[torch]'" in str(exc), exc
else:
    raise AssertionError("as_torch=True worked without torch")
ds = spillmerge.OutputDataset(out)  # built without torch; its rows need it
try:
    ds[0]
except spillmerge.MissingDependencyError as exc:
    assert "spillmerge.OutputDataset needs torch" in str(exc), exc
else:
    raise AssertionError("OutputDataset rows were read without torch")
for cmd in (["inspect", out], ["verify", out]):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(cmd) == 0, (cmd, printed.getvalue())
assert "torch" not in sys.modules
print("ok")
"""


def test_reading_needs_no_torch(tmp_path: Path) -> None:
    with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1) as w:
        for name in "ab":
            for f in range(3):
                w.write(name, f, {
                    "s": f"{name}{f}", "n": None if f == 2 else f, "bf": torch.full((2,), f, dtype=torch.bfloat16),
                    "l": [f, "x"], "boxes": torch.ones(f, 4),
                })  # fmt: skip
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"), progress=False)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = textwrap.dedent(SCRIPT)
    p = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "out.zarr")], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr
