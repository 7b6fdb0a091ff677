"""The CLI says what a thing is: an interrupted merge, an ``--out`` that is no output, a URL
without a bucket, an unfinished segment (not corruption); it refuses a negative budget, a watch
interval ``time.sleep`` cannot take, a plot of an interrupted merge and an existing ``--parquet``
or ``--plot`` it was not told to replace; a quoted ``--storage-option`` value stays a string;
a manifest named in a config file is read beside it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import spillmerge
from spillmerge import cli
from spillmerge._merge import lease as _lease
from spillmerge._storage import Storage


def _spill(root: Path) -> None:
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for f in range(3):
            w.write(f"clip {f}.mp4", 0, torch.full((4,), float(f)))


@pytest.fixture
def merged(tmp_path: Path) -> tuple[Path, Path]:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    spillmerge.merge(str(root), str(out), progress=False)
    return root, out


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_status_names_an_interrupted_merge_and_an_out_that_is_no_output(merged, tmp_path):
    root, out = merged
    (out / "spillmerge-complete.json").unlink()  # the merge died before its marker
    js = spillmerge.status(str(root), out=str(out))
    assert js.merge is not None and js.merge.state == "interrupted", js.merge
    assert "run the merge again" in (js.merge.message or "")
    with _lease.whole(Storage(str(out))):  # a live merge holds the lease: running
        assert spillmerge.status(str(root), out=str(out)).merge.state == "running"  # type: ignore[union-attr]
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for where, what in [(root, "a spill root"), (tmp_path / "file", "a file"), (tmp_path / "other", "a folder")]:
        m = spillmerge.status(str(root), out=str(where)).merge
        assert m is not None and m.state == "not-an-output" and f"{where} is {what}" in (m.message or ""), m
    m = spillmerge.status(str(root), out=str(tmp_path / "new.zarr")).merge
    assert m is not None and m.state == "not-started"


@pytest.mark.parametrize("url", ["s3://", "s3:///"])
def test_an_object_store_url_without_a_bucket_is_named_as_typed(url, capsys):
    for cmd in ("inspect", "status", "verify"):
        line = _error(capsys, [cmd, url, "--storage-option", "anon=true"])
        assert f"{url!r} names no bucket: give s3://BUCKET/PATH" in line, line
    assert Storage("memory://").describe("zarr.json") == "memory://zarr.json"


@pytest.mark.parametrize(
    "cmd, flag, needs, magic",
    [("export", "--parquet", "pyarrow", b"PAR1"), ("inspect", "--plot", "matplotlib", b"\x89PNG\r\n\x1a\n")],
)
def test_an_existing_parquet_or_plot_is_replaced_only_with_overwrite(merged, tmp_path, capsys, cmd, flag, needs, magic):
    pytest.importorskip(needs)
    _, out = merged
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    line = _error(capsys, [cmd, str(out), flag, str(target)])
    assert f"{flag} {target} exists; pass --overwrite to replace it" in line, line
    assert target.read_bytes() == b"keep me"
    assert cli.main([cmd, str(out), flag, str(target), "--overwrite"]) == 0
    assert target.read_bytes()[: len(magic)] == magic


def test_export_refuses_a_parquet_inside_the_spill_root_the_output_came_from(merged, capsys):
    pytest.importorskip("pyarrow")
    root, out = merged
    line = _error(capsys, ["export", str(out), "--parquet", str(root / "preds.parquet")])
    assert f"would write into the spill root {root} the output {out} was merged from" in line, line
    assert not (root / "preds.parquet").exists()


def test_storage_option_values_are_json_where_json_and_a_quoted_secret_stays_a_string():
    got = cli._storage_options(
        ['secret="123456"', "default_block_size=5242880", "anon=true", "token=null", 'client_kwargs={"region_name": "x"}',
         "key=AKIA1", "k=a=b"]
    )  # fmt: skip
    assert got == {"secret": "123456", "default_block_size": 5242880, "anon": True, "token": None,
                   "client_kwargs": {"region_name": "x"}, "key": "AKIA1", "k": "a=b"}  # fmt: skip


def test_verify_says_unfinished_not_corrupt_for_a_live_rank_and_an_unfinished_merge(merged, tmp_path, capsys):
    root, out = merged
    with spillmerge.SpillWriter(str(tmp_path / "live"), rank=0, world_size=1) as live:
        live.write("a.mp4", 0, torch.ones(4))
        assert cli.main(["verify", str(tmp_path / "live")]) == 1  # the documented exit status stays
        printed = capsys.readouterr().out
        assert "UNFINISHED " in printed and "incomplete segment (no commit record)" in printed, printed
        assert "CORRUPT" not in printed
    torn = tmp_path / "torn.zarr"
    shutil.copytree(out, torn)
    (torn / "spillmerge-complete.json").unlink()
    assert cli.main(["verify", str(torn)]) == 1
    printed = capsys.readouterr().out
    assert f"UNFINISHED {torn}: no spillmerge-complete.json; the merge did not finish" in printed, printed
    assert "CORRUPT" not in printed
    rep = spillmerge.verify(str(torn))
    assert rep.unfinished == rep.problems and not rep.ok
    with pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    assert "(UNFINISHED); exits 1 if there is any" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("flag", ["--memory-budget", "--plan-budget"])
def test_a_negative_budget_is_a_config_error_naming_the_option(merged, tmp_path, capsys, flag):
    root, _ = merged
    line = _error(capsys, ["merge", str(root), "--out", str(tmp_path / "o.zarr"), flag, "-1"])
    assert f"({flag}) must be a number of bytes >= 0, got -1" in line, line
    assert not (tmp_path / "o.zarr").exists()
    name = flag[2:].replace("-", "_")
    with pytest.raises(spillmerge.ConfigError) as info:
        spillmerge.merge(str(root), str(tmp_path / "o.zarr"), **{name: -5})
    assert info.value.key == name


@pytest.mark.parametrize("interval", ["inf", "1e10"])
def test_a_watch_interval_time_sleep_cannot_take_is_a_config_error(merged, capsys, interval):
    root, _ = merged
    line = _error(capsys, ["status", str(root), "--watch", "--interval", interval])
    assert f"--interval must be a number of seconds above 0, at most 86400 (a day), got {float(interval)}" in line


def test_a_short_manifest_row_names_the_expected_option(tmp_path):
    from spillmerge._util.frames import read_manifest

    (tmp_path / "m.csv").write_text("filename,n_frames\na.mp4\n")
    with pytest.raises(spillmerge.ConfigError, match="line 2: expected filename,n_frames") as info:
        read_manifest(str(tmp_path / "m.csv"))
    assert info.value.key == "expected"


def test_a_plot_of_an_interrupted_merge_is_refused_not_skipped(merged, tmp_path, capsys):
    _, out = merged
    (out / "spillmerge-complete.json").unlink()
    line = _error(capsys, ["inspect", str(out), "--plot", str(tmp_path / "p.png")])
    assert f"{out} is an interrupted merge; --plot needs a complete output" in line, line


def test_a_relative_manifest_in_a_config_file_is_found_next_to_it(merged, tmp_path, monkeypatch, capsys):
    """``expected = "manifest.csv"`` in a config file names the file beside the config, wherever
    the command runs; ``--expected`` on the command line stays relative to the working folder."""
    root, _ = merged
    cfg = tmp_path / "job" / "merge.toml"
    cfg.parent.mkdir()
    (cfg.parent / "manifest.csv").write_text("filename,n_frames\nclip 0.mp4,1\nclip 1.mp4,1\nclip 2.mp4,3\n")
    cfg.write_text(f'[merge]\nroot = "{root}"\nout = "{tmp_path / "o.zarr"}"\nexpected = "manifest.csv"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["merge", "--config", str(cfg), "--no-progress"]) == 1  # clip 2.mp4 lacks frames 1 and 2
    captured = capsys.readouterr()
    assert "clip 2.mp4" in captured.out and "error" not in captured.err, captured
    line = _error(capsys, ["merge", "--config", str(cfg), "--overwrite", "--expected", "manifest.csv"])
    assert "manifest manifest.csv: cannot read it" in line, line


def test_a_plot_is_never_written_through_a_link_or_into_a_pipe(merged, tmp_path, capsys):
    """``--plot`` at a link, a folder or a pipe is refused even with ``--overwrite`` (as export's
    ``--parquet`` is): the file a link points at keeps its bytes, and a pipe blocks nothing."""
    pytest.importorskip("matplotlib")
    _, out = merged
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    (tmp_path / "link.png").symlink_to(mine)
    (tmp_path / "folder.png").mkdir()
    os.mkfifo(tmp_path / "pipe.png")
    for name in ("link.png", "folder.png", "pipe.png"):
        target = tmp_path / name
        line = _error(capsys, ["inspect", str(out), "--plot", str(target), "--overwrite"])
        assert f"cannot write the plot to {target}: it exists and is no regular file" in line, line
    assert mine.read_text() == "keep me" and (tmp_path / "link.png").is_symlink()
    names = ["folder.png", "link.png", "notes.txt", "out.zarr", "pipe.png", "spill"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no temporary file left


def test_a_config_value_of_the_wrong_type_names_the_type_it_needs(merged, tmp_path, capsys):
    root, _ = merged
    cfg = tmp_path / "merge.toml"
    cfg.write_text(f'[merge]\nroot = "{root}"\nout = "{tmp_path / "o.zarr"}"\nmemory_budget = "1GiB"\n')
    line = _error(capsys, ["merge", "--config", str(cfg)])
    assert f"{cfg}: merge.memory_budget must be an int, got '1GiB'" in line, line
