"""Reading without torch: in a real virtual environment holding only the package's declared
dependencies (``[project] dependencies`` plus the ``arrow`` extra, from pyproject.toml) and no
torch, ``import spillmerge``, ``open``, ``column``, rows, ``iter_batches``, ``to_parquet`` and
the CLI's ``inspect`` / ``verify`` / ``export`` work on an output written here; writing and
``to_torch`` raise ``MissingDependencyError`` with the install hint.

The environment is built once per pyproject.toml (``python -m venv`` + pip, ~20 s) and kept
under the temporary directory, keyed by the file's hash, so reruns take seconds."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

import spillmerge

REPO = Path(__file__).resolve().parents[2]


def _venv() -> Path:
    pyproject = (REPO / "pyproject.toml").read_bytes()
    meta = tomllib.loads(pyproject.decode())["project"]
    deps = [*meta["dependencies"], *meta["optional-dependencies"]["arrow"]]
    assert not [d for d in deps if d.lower().startswith("torch")], deps  # reading must not pull torch
    key = hashlib.sha256(pyproject + sys.version.encode()).hexdigest()[:16]
    home = Path(tempfile.gettempdir()) / f"spillmerge-notorch-{key}"
    python = home / "bin" / "python"
    with open(f"{home}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test session may be building the same one
        if not (home / ".ready").exists():
            # Built where it lives (its scripts record their path), marked ready last.
            shutil.rmtree(home, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(home)], check=True, timeout=300)
            pip = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *deps],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if pip.returncode != 0:
                pytest.fail(f"pip could not install the reading dependencies {deps}: {pip.stderr[-2000:]}")
            (home / ".ready").write_text(json.dumps(deps))
    return python


@pytest.fixture(scope="module")
def python() -> Path:
    return _venv()


def test_reading_works_without_torch(python, tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(50):
            w.write(f"img_{i:03d}.jpg", 0, {
                "boxes": torch.full((i % 4, 4), float(i)), "cls": f"class {i % 5}",
                "emb": torch.full((8,), i, dtype=torch.bfloat16), "tokens": ["a"] * (i % 3),
            })  # fmt: skip
    spillmerge.merge(str(root), str(out), progress=False)
    want = spillmerge.open(str(out)).to_arrow()

    script = textwrap.dedent(f"""
        import contextlib, importlib.util, io, sys
        assert importlib.util.find_spec("torch") is None, "this environment must not have torch"
        import pyarrow.parquet as pq
        import spillmerge
        out = {str(out)!r}
        res = spillmerge.open(out)
        assert res["img_007.jpg"]["boxes"][0].tolist() == [[7.0] * 4] * 3
        assert res["img_007.jpg"]["cls"][0] == "class 2"
        assert str(res["img_007.jpg"]["emb"][0].dtype) == "bfloat16"
        assert res.column("tokens")[5] == ["a", "a"]
        batches = list(res.iter_batches(columns=["boxes", "cls"], batch_size=16))
        assert [b.num_rows for b in batches] == [16, 16, 16, 2]
        assert res.to_parquet({str(tmp_path / "a.parquet")!r}) == 50
        assert pq.read_table({str(tmp_path / "a.parquet")!r}).equals(res.to_arrow())
        assert "torch" not in sys.modules, "reading imported torch"
        assert "duckdb" not in sys.modules, "reading imported duckdb (a dependency of merging only)"
        for name, call in (("SpillWriter", lambda: spillmerge.SpillWriter),
                           ("to_torch", lambda: res.column("emb").to_torch())):
            try:
                call()
            except spillmerge.MissingDependencyError as exc:
                assert "pip install 'spillmerge[torch]'" in str(exc), exc
            else:
                raise AssertionError(name + " worked without torch")
        from spillmerge import cli
        for cmd in (["inspect", out], ["verify", out], ["export", out, "--parquet", {str(tmp_path / "b.parquet")!r}]):
            printed, errors = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
                rc = cli.main(cmd)
            assert rc == 0, (cmd, printed.getvalue(), errors.getvalue())
        assert "torch" not in sys.modules, "the CLI imported torch"
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "b.parquet").equals(want)  # the export, read back where torch is
