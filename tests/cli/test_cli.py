"""The CLI through ``cli.main`` in this process (output captured), and the installed console
script once, in a subprocess."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import spillmerge
from spillmerge import cli

EXE = shutil.which("spillmerge", path=os.path.dirname(sys.executable)) or "spillmerge"


@dataclass
class Ran:
    """What a command returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def cli_run(*args: str) -> Ran:
    """``spillmerge ARGS`` in this process, its output captured (for the tests of other files,
    which have no ``run`` fixture): the exit status argparse gives included."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Ran(code, out.getvalue(), err.getvalue())


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Callable[..., Ran]:
    """Runs ``spillmerge ARGS`` as the console script does (``sys.exit(cli.main(argv))``), in
    this process: the exit status argparse gives for ``--help`` or a bad flag included."""

    def run(*args: str) -> Ran:
        capsys.readouterr()
        try:
            code = cli.main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        cap = capsys.readouterr()
        return Ran(code, cap.out, cap.err)

    return run


def assert_one_line_error(p: Ran | subprocess.CompletedProcess[str], *needles: str) -> None:
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _spill(root: Path, world_size: int = 2, ranks=None) -> None:
    for r in ranks if ranks is not None else range(world_size):
        with spillmerge.SpillWriter(str(root), rank=r, world_size=world_size) as w:
            for f in range(r, 6, world_size):
                w.write("clip a.mp4", f, {"mask": torch.full((4, 4), float(f)), "score": f / 10})


def test_every_command_has_help_with_an_example(run):
    for cmd in ([], ["merge"], ["inspect"], ["verify"], ["status"], ["export"], ["demo"]):
        p = run(*cmd, "--help")
        assert p.returncode == 0 and "Example:" in p.stdout, cmd
        if cmd == ["inspect"]:  # the coverage flags: an example, and the manifest's format
            assert "--expected manifest.csv --plot coverage.png" in p.stdout and "filename,n_frames" in p.stdout


def test_merge_inspect_verify(tmp_path, run):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    p = run("merge", str(root), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "merged 1 files, 6 frames" in p.stdout
    assert spillmerge.open(str(out)).frames("clip a.mp4").tolist() == list(range(6))
    p = run("inspect", str(root))
    assert p.returncode == 0 and "world size 2" in p.stdout and "committed" in p.stdout and "float32" in p.stdout
    p = run("inspect", str(out), "--json")
    info = json.loads(p.stdout)
    assert info["kind"] == "merged" and info["frames"] == 6 and info["files"][0]["filename"] == "clip a.mp4"
    for path in (root, out):
        p = run("verify", str(path))
        assert p.returncode == 0 and "OK" in p.stdout, p.stdout
    p = run("merge", str(root), "--out", str(out))
    assert_one_line_error(p, "already holds a complete merge", "--overwrite")


def test_user_errors_are_one_line(tmp_path, run):
    assert_one_line_error(run("merge", str(tmp_path / "nope"), "--out", str(tmp_path / "o")), "does not exist", "nope")
    assert_one_line_error(run("inspect", str(tmp_path / "nope")), "does not exist")
    assert_one_line_error(run("merge", "--out", str(tmp_path / "o")), "spill root")
    assert_one_line_error(run("merge", "--config", str(tmp_path / "missing.toml")), "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[merge]\ntimeot = 3\n")
    assert_one_line_error(run("merge", "--config", str(bad)), "merge.timeot")
    root = tmp_path / "spill"
    _spill(root)
    p = run("merge", str(root), "--out", str(tmp_path / "o"), "--expected", str(tmp_path / "no.csv"))
    assert_one_line_error(p, "manifest", "no.csv")
    assert not (tmp_path / "o").exists()
    assert_one_line_error(run("demo", "--frame-shape", "0", "--out", str(tmp_path / "d")), "frame_shape", "(0,)")
    (tmp_path / "a-file").write_text("")
    assert_one_line_error(run("demo", "--out", str(tmp_path / "a-file" / "d")), "a-file")



def test_a_mistyped_flag_or_command_is_argparses_usage_error_exit_2(tmp_path, run):
    """README: errors exit 1, a usage error exits 2 with argparse's message."""
    for args in (["merge", str(tmp_path), "--out", str(tmp_path / "o"), "--bogus"], ["bogus"], ["export", "x"]):
        p = run(*args)
        assert p.returncode == 2 and p.stderr.startswith("usage: spillmerge"), (args, p.stderr)
        assert "error:" in p.stderr.splitlines()[-1]


def test_incomplete_spill_names_the_rank(tmp_path, run):
    root = tmp_path / "spill"
    _spill(root, world_size=3, ranks=[0, 2])
    p = run("merge", str(root), "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "rank 1 (no segment)", "1 of 3")
    # A rank that crashed mid-spill leaves an uncommitted segment: name it.
    code = textwrap.dedent(
        f"""
        import os, numpy, spillmerge
        w = spillmerge.SpillWriter({str(root)!r}, rank=1, world_size=3)
        w.open()
        w.write("clip a.mp4", 1, {{"mask": numpy.zeros((4, 4), numpy.float32), "score": 0.0}})
        os._exit(0)  # killed: no commit record, no failure record
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    p = run("merge", str(root), "--out", str(tmp_path / "o"), "--timeout", "0.5")
    assert_one_line_error(p, "rank 1 (uncommitted segment", "after waiting")
    p = run("merge", str(root), "--out", str(tmp_path / "o"), "--allow-partial")
    assert p.returncode == 0 and "PARTIAL: ranks [1] missing" in p.stdout


def test_verify_names_corrupt_and_truncated_chunks(tmp_path, run):
    root = tmp_path / "spill"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1, chunk_bytes=4096) as w:
        for i in range(6):
            w.write("f", i, torch.full((1024,), float(i)))
    flipped = next(root.glob("rank-00000/seg-*/data/c/1"))
    raw = bytearray(flipped.read_bytes())
    raw[7] ^= 0x80
    flipped.write_bytes(bytes(raw))
    truncated = next(root.glob("rank-00000/seg-*/data/c/4"))
    truncated.write_bytes(truncated.read_bytes()[:100])
    p = run("verify", str(root))
    assert p.returncode == 1
    assert f"CORRUPT {flipped}: checksum mismatch" in p.stdout
    assert f"CORRUPT {truncated}: short read" in p.stdout
    assert "2 problem(s)" in p.stdout


def test_config_file_and_flag_override(tmp_path, run):
    root = tmp_path / "spill"
    _spill(root)
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'[merge]\nroot = "{root}"\nout = "{tmp_path / "from-config"}"\nchunk_bytes = 4096\n')
    p = run("merge", "--config", str(cfg), "--out", str(tmp_path / "from-flag"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "from-flag" / "spillmerge-complete.json").exists()
    assert not (tmp_path / "from-config").exists()


def test_demo_runs_end_to_end_with_config(tmp_path, run):
    cfg = Path(__file__).parents[2] / "configs" / "demo.toml"
    p = run("demo", "--config", str(cfg), "--ranks", "2", "--files", "3", "--frames-per-file", "6",
            "--out", str(tmp_path / "d"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "verified" in p.stdout and "bit-exact" in p.stdout
    assert f"output: {tmp_path / 'd' / 'merged.zarr'}" in p.stdout
    assert len(spillmerge.open(str(tmp_path / "d" / "merged.zarr")).filenames) == 3


def test_config_is_valid_for_both_commands():
    import tomllib

    from spillmerge.cli import _DEMO_KEYS, _MERGE_KEYS

    data = tomllib.loads((Path(__file__).parents[2] / "configs" / "demo.toml").read_text())
    assert set(data["demo"]) <= set(_DEMO_KEYS) and set(data["merge"]) <= set(_MERGE_KEYS)


@pytest.mark.parametrize("size, want", [("16MiB", 16 << 20), ("256M", 256 << 20), ("4096", 4096), ("1g", 1 << 30)])
def test_size_parser(size, want):
    from spillmerge._merge.options import parse_size

    assert parse_size(size) == want


def test_merge_options_are_declared_once():
    """merge()'s keyword parameters (names and defaults), the CLI's merge flags and the config
    file's [merge] keys all come from MergeOptions: an option added there reaches all three."""
    import dataclasses
    import inspect

    from spillmerge._merge.options import MergeOptions, config_keys, flags
    from spillmerge.cli import _MERGE_KEYS, build_parser

    declared = {f.name: f.default for f in dataclasses.fields(MergeOptions)}
    params = inspect.signature(spillmerge.merge).parameters
    keyword = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keyword == declared and list(params)[:2] == ["root", "out"]

    merge_parser = build_parser()._subparsers._group_actions[0].choices["merge"]
    cli = {a.dest: a.option_strings for a in merge_parser._actions if a.dest not in ("help", "config")}
    assert cli == {"root": [], "out": ["--out"], **{name: [f.name] for name, f in flags().items()}}
    assert set(flags()) <= set(declared) and set(config_keys()) <= set(declared)
    assert _MERGE_KEYS == {"root": str, "out": str, **config_keys()}
    # The flags and keys users already rely on stay as they were.
    assert sorted(cli) == sorted([
        "root", "out", "timeout", "allow_partial", "expected", "on_duplicate", "overwrite", "codec", "part",
        "finalize", "world_size", "chunk_bytes", "memory_budget", "plan_budget", "plan_dir", "threads",
        "storage_options", "out_storage_options", "progress", "remove_spill",
    ])  # fmt: skip
    assert sorted(_MERGE_KEYS) == sorted([
        "root", "out", "timeout", "allow_partial", "on_duplicate", "overwrite", "chunk_bytes", "memory_budget",
        "plan_budget", "plan_dir", "threads", "world_size", "storage_options", "out_storage_options", "codec",
        "expected", "remove_spill",
    ])  # fmt: skip


@pytest.mark.s3
def test_cli_merge_between_s3_and_local_with_storage_options(s3, tmp_path, run):
    opts = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": s3.endpoint, "region_name": "us-east-1"}}
    for r in range(2):
        with spillmerge.SpillWriter("s3://test/spill", rank=r, world_size=2, storage_options=opts) as w:
            w.write("clip.mp4", r, torch.full((4,), float(r)))
    flags = ["--storage-option", "key=test", "--storage-option", "secret=test",
             "--storage-option", json.dumps({"endpoint_url": s3.endpoint, "region_name": "us-east-1"}).join(["client_kwargs=", ""])]  # fmt: skip
    p = run("merge", "s3://test/spill", "--out", str(tmp_path / "local.zarr"), *flags, "--no-progress")
    assert p.returncode == 0, p.stderr
    assert spillmerge.open(str(tmp_path / "local.zarr"))["clip.mp4"][1, 0] == 1.0
    cfg = tmp_path / "s3.toml"
    cfg.write_text(
        f'[merge]\nroot = "s3://test/spill"\nout = "s3://test/out.zarr"\n'
        f'[merge.storage_options]\nkey = "test"\nsecret = "test"\n'
        f'[merge.storage_options.client_kwargs]\nendpoint_url = "{s3.endpoint}"\nregion_name = "us-east-1"\n'
    )
    p = run("merge", "--config", str(cfg))
    assert p.returncode == 0, p.stderr
    p = run("inspect", "s3://test/out.zarr", *flags, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["frames"] == 2
    p = run("verify", "s3://test/spill", *flags)
    assert p.returncode == 0 and "OK" in p.stdout


def test_missing_backend_gives_an_install_hint(tmp_path, run):
    pytest.importorskip("torch")
    if __import__("importlib").util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    p = run("merge", "gs://bucket/spill", "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "pip install 'spillmerge[gcs]'")


def test_console_script_is_installed_and_runs_a_merge(tmp_path):
    """The one run through the installed entry point (the tests above call ``cli.main``): it
    starts, merges and exits 0."""
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    p = subprocess.run([EXE, "merge", str(root), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "merged 1 files, 6 frames" in p.stdout, p.stderr
    assert spillmerge.open(str(out)).frames("clip a.mp4").tolist() == list(range(6))
