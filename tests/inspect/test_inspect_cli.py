"""``spillmerge inspect`` / ``verify`` through ``cli.main``: frames (not leaf rows) counted,
bounded listings, and a progress bar on a terminal only."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import termios
import threading
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

import spillmerge
import spillmerge.cli
from spillmerge._storage import LocalStorage


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = spillmerge.cli.main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _spill(root: Path, n_files: int = 5) -> None:
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        for i in range(n_files):  # one frame per file, five leaves per frame
            w.write(f"f{i}.mp4", 0, {k: torch.ones(2) for k in "abcde"})


def test_inspect_counts_frames_not_leaf_rows(tmp_path, capsys):
    root = tmp_path / "spill"
    _spill(root, n_files=1)
    rc, out, err = _cli(capsys, "inspect", str(root))
    assert rc == 0, err
    assert "'f0.mp4': 1 frame\n" in out + "\n" and "rows" not in out, out
    j = json.loads(_cli(capsys, "inspect", str(root), "--json")[1])
    assert j["files"] == [{"filename": "f0.mp4", "frames": 1}] and j["frames"] == 1


def test_json_lists_at_most_max_files_and_counts_all(tmp_path, capsys):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    spillmerge.merge(str(root), str(out))
    for path in (root, out):
        j = json.loads(_cli(capsys, "inspect", str(path), "--json", "--files", "2")[1])
        assert len(j["files"]) == 2 and len(j["coverage"]["files"]) == 2
        assert j["n_files"] == 5 and j["coverage"]["n_files"] == 5 and j["coverage"]["present_frames"] == 5


def test_inspect_reads_each_object_once(tmp_path, capsys, monkeypatch):
    """The summary and the coverage come from one pass: each segment's commit record, catalog and
    index (checked against their CRCs) are read once, and the output is opened once."""
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    for rank in (0, 1):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2) as w:
            w.write(f"f{rank}.mp4", 0, torch.ones(2))
    spillmerge.merge(str(root), str(out))
    reads: Counter[str] = Counter()
    real_get = LocalStorage.get

    def get(self: LocalStorage, rel: str, **kw: int) -> bytes:
        reads[rel] += 1
        return real_get(self, rel, **kw)

    monkeypatch.setattr(LocalStorage, "get", get)
    # (an output's root document is read to tell what the path is, then by open)
    for path, index, n, twice in ((root, "/index/c/0/0", 2, {}), (out, "index/frame_rank/c/0", 1, {"zarr.json": 2})):
        reads.clear()
        assert _cli(capsys, "inspect", str(path))[0] == 0
        assert sum(rel.endswith(index) for rel in reads) == n  # a spill root's two segments; the output
        assert {rel: k for rel, k in reads.items() if k > 1} == twice, path


def _on_a_terminal(args: list[str]) -> str:
    """Run the command with stdout and stderr on a pseudo-terminal; everything it printed."""
    master, slave = pty.openpty()
    # A fresh pseudo-terminal is 0 columns wide, where tqdm draws nothing: size it as a terminal.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:  # read as it is written: a full terminal buffer would block the command
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal was closed
                break
            if not data:
                break
            chunks.append(data)

    reader = threading.Thread(target=drain, name="pty-reader")
    reader.start()
    try:
        with open(slave, "w", buffering=1) as term, redirect_stdout(term), redirect_stderr(term):
            assert spillmerge.cli.main(args) == 0
    finally:
        reader.join(timeout=60)
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_and_none_when_piped(tmp_path, capsys):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    _spill(root)
    spillmerge.merge(str(root), str(out))
    for cmd in (["verify", str(root)], ["verify", str(out)], ["inspect", str(root)]):
        tty = _on_a_terminal(cmd)
        assert f"\r{cmd[0]}:" in tty and "%|" in tty, (cmd, tty)  # the bar is drawn (and cleared at the end)
        rc, piped_out, piped_err = _cli(capsys, *cmd)  # captured: not a terminal
        assert rc == 0, piped_err
        assert "%|" not in piped_out + piped_err and "\r" not in piped_err, (cmd, piped_err)


# -- every valid output: variants, lists, plain values of several dtypes, dicts --------------------

_PY_NAMES = r"\bpy(int|float|bool|complex|list|tuple|dict|records)\b"


def _mixed(tmp_path: Path) -> tuple[Path, Path]:
    """A spill and its merged output in which the plain value is a tensor in one file, an error
    string in another (the README's pattern), a bfloat16 tensor, a list of ints and an int in
    others; a dict leaf is a tensor in one file and a string in another; lists of tensors and
    strings, lists of lists and a list of dicts."""
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        w.write("a.jpg", 0, torch.ones(2, 3))
        w.write("b.jpg", 0, "broken file: cannot decode")
        w.write("c.jpg", 0, torch.ones(4, dtype=torch.bfloat16))
        w.write("d.jpg", 0, [1, 2, 3])
        w.write("e.jpg", 0, {"x": torch.ones(2), "y": "s", "z": [1.5, 2.5], "r": [{"a": 1}, {"a": 2}]})
        w.write("f.jpg", 0, {"x": "err", "y": 3, "z": [[1, 2], [3]]})
        w.write("g.jpg", 0, 7)
        w.write("h.jpg", 0, [torch.ones(2), "q", None])
    spillmerge.merge(str(root), str(out), progress=False)
    return root, out


def test_inspect_and_verify_read_an_output_whose_leaves_have_several_kinds(tmp_path, capsys):
    root, out = _mixed(tmp_path)
    assert spillmerge.cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if line.startswith("    '")}
    assert "dtypes: bfloat16, float32, int, list, list[dict], list[float], list[int], str" in text, text
    assert lines["'a.jpg'"].endswith("<value>: float32[2, 3]") and lines["'b.jpg'"].endswith("<value>: str")
    assert lines["'c.jpg'"].endswith("<value>: bfloat16[4]") and lines["'d.jpg'"].endswith("<value>: list[int]")
    assert lines["'g.jpg'"].endswith("<value>: int")
    assert "r: list[dict]; r/a: list[int]; x: float32[2]; y: str; z: list[float]" in lines["'e.jpg'"]
    assert "x: str; y: int; z/[*]: list[int]; z: list" in lines["'f.jpg'"]
    assert lines["'h.jpg'"].endswith("[*]: float32[2]; [*]: str; <value>: list")
    assert not re.search(_PY_NAMES, text) and "\x1f" not in text, text
    assert spillmerge.cli.main(["inspect", str(out), "--json"]) == 0
    raw = capsys.readouterr().out
    j = json.loads(raw)
    assert j["n_files"] == 8 and "list[int]" in j["dtypes"] and not re.search(_PY_NAMES, raw)
    h = next(f for f in j["files"] if f["filename"] == "h.jpg")
    assert h["leaves"] == [
        {"leaf": "[*]", "dtype": "float32", "shape": [2]},
        {"leaf": "[*]", "dtype": "str", "shape": []},
        {"leaf": "<value>", "dtype": "list", "shape": []},
    ]
    assert spillmerge.cli.main(["inspect", str(root)]) == 0  # the spill root: the same dtype names
    text = capsys.readouterr().out
    assert "dtypes: bfloat16, float32, int, list, list[dict], list[float], list[int], none, str" in text, text
    assert spillmerge.cli.main(["verify", str(out)]) == 0
    # column(): the plain values' columns are named as inspect shows them, and chosen so
    res = spillmerge.open(str(out))
    with pytest.raises(spillmerge.UnknownColumnError, match=r"\(bfloat16.1d, float32.2d, int, list\[int\], str:") as ei:
        res.column(None)
    assert not re.search(_PY_NAMES, str(ei.value)), ei.value
    ints = res.column(None, dtype="list[int]")
    assert ints[3].tolist() == [1, 2, 3] and ints[0] is None and "dtype=list[int])" in repr(ints)
    assert res.column(None, dtype="int")[6] == 7 and res.column(None, dtype="bfloat16").dtype_name == "bfloat16"


def test_no_node_name_of_an_output_starts_with_two_underscores(tmp_path):
    """Zarr v3 reserves node names starting with ``__``: the plain values' column is ``_value``
    (docs/FORMAT.md, *Node names*), in every kind of output: variants, lists, dicts, plain values
    split by dtype."""
    _, out = _mixed(tmp_path)
    root2, out2 = tmp_path / "spill2", tmp_path / "out2.zarr"
    with spillmerge.SpillWriter(root2, rank=0, world_size=1) as w:  # plain values of two dtypes
        w.write("a.mp4", 0, torch.ones(2, dtype=torch.float16))
        w.write("b.mp4", 0, torch.ones(2, dtype=torch.float32))
        w.write("c.mp4", 0, {"__value__": torch.ones(1), "_value": torch.ones(1)})  # user keys like it
    spillmerge.merge(str(root2), str(out2), progress=False)
    for o, want in ((out, "_value.str"), (out2, "_value.float16")):
        names = [n for _, dirs, files in os.walk(o) for n in dirs + files]
        assert want in names and not [n for n in names if n.startswith("__")], names
        meta = json.loads((o / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
        assert not [k for k in meta if any(seg.startswith("__") for seg in k.split("/"))]
    res = spillmerge.open(str(out2))
    assert res["c.mp4"]["__value__"][0].tolist() == [1.0] and res.value("c.mp4")["_value"].tolist() == [1.0]
    assert res["a.mp4"].dtype_name == "float16" and res.value("b.mp4").tolist() == [1.0, 1.0]


def test_a_mistyped_filename_suggests_only_names_a_typo_away(tmp_path):
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        for i in range(100):
            w.write(f"img_{i:05d}.jpg", 0, i)
    spillmerge.merge(str(root), str(out), progress=False)
    res = spillmerge.open(str(out))
    with pytest.raises(spillmerge.UnknownFileError) as ei:
        res["img_0.jpg"]  # shares a prefix with every name: none is a typo away
    assert "did you mean" not in str(ei.value) and "'img_0.jpg' is not a filename of" in str(ei.value)
    for typo, meant in (("img_00039.jgp", "'img_00039.jpg'?"), ("img_00039.jpeg", "'img_00039.jpg'?"),
                        ("img_00039.jpg ", "'img_00039.jpg'?")):  # fmt: skip
        with pytest.raises(spillmerge.UnknownFileError) as ei:
            res[typo]
        assert str(ei.value).endswith(f"did you mean {meant}"), ei.value


@pytest.mark.parametrize("attributes", ["5", "[]", '{"spillmerge": 5}'])
def test_a_root_document_whose_attributes_are_no_object_is_no_output(tmp_path, capsys, attributes):
    """A ``zarr.json`` whose attributes (or their ``spillmerge`` entry) are no JSON object is no
    output: ``verify`` and ``inspect`` say so (no ``AttributeError``)."""
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "zarr.json").write_text(f'{{"zarr_format": 3, "node_type": "group", "attributes": {attributes}}}')
    with pytest.raises(spillmerge.NotAnOutputError, match="is not a spillmerge output"):
        spillmerge.verify(str(tmp_path / "o"))
    rc, _, err = _cli(capsys, "inspect", str(tmp_path / "o"))
    assert rc != 0 and "is not a spillmerge output" in err, err
