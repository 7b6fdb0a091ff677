"""Readers of an output bound what they allocate by what is stored: a list-of-dicts header that
claims 2**40 items (8 bytes of the output, its chunk's CRC-32C fixed so the checksum passes) is
refused by ``to_arrow`` / ``iter_batches`` / ``to_parquet`` naming the column and row, before
anything is sized by it, and ``verify`` lists it (as ``value()`` refuses it)."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import google_crc32c
import pytest

import spillmerge
from spillmerge.cli import main

pytest.importorskip("pyarrow")

DETS = [{"box": [1.0, 2.0], "score": 0.5}, {"box": [3.0, 4.0], "score": 0.7}]


def _records_output(tmp_path: Path) -> Path:
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        for i in range(3):
            w.write(f"img_{i}.jpg", 0, {"dets": DETS, "n": i})
    spillmerge.merge(str(root), str(out))
    return out


def _set_header(out: Path, row: int, n: int) -> str:
    """Row ``row`` of the ``pyrecords`` header column says ``n``; the chunk's CRC-32C is fixed."""
    (head,) = [p for p in (out / "columns").iterdir() if p.name.startswith("dets_")
               and '"pyrecords"' in (p / "zarr.json").read_text()]  # fmt: skip
    chunk = head / "values" / "c" / "0"
    raw = bytearray(chunk.read_bytes()[:-4])
    raw[8 * row : 8 * row + 8] = struct.pack("<q", n)
    chunk.write_bytes(bytes(raw) + google_crc32c.value(bytes(raw)).to_bytes(4, "little"))
    return f"columns/{head.name}"


@pytest.mark.parametrize("n", [1 << 40, 3, -1])
def test_a_list_of_dicts_header_that_lies_is_refused_by_every_reader(tmp_path, n, capsys):
    out = _records_output(tmp_path)
    assert spillmerge.open(str(out)).to_arrow().column("dets").to_pylist()[1] == DETS
    col = _set_header(out, 1, n)
    store = spillmerge.open(str(out))
    with pytest.raises(spillmerge.CorruptSpillError, match="dicts"):
        store.value("img_1.jpg", 0)
    tracemalloc.start()
    try:
        for read in (store.to_arrow, lambda: list(store.iter_batches()),
                     lambda: store.to_parquet(str(tmp_path / "x.parquet"))):  # fmt: skip
            with pytest.raises(spillmerge.CorruptSpillError) as err:
                read()
            assert col in str(err.value) and "row 1" in str(err.value) and str(n) in str(err.value)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20  # refused before sizing anything by it
    finally:
        tracemalloc.stop()
    assert not (tmp_path / "x.parquet").exists()
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any(col in p and "row 1" in p for p in rep.problems), rep.problems
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    assert col in capsys.readouterr().out
    assert main(["export", str(out), "--parquet", str(tmp_path / "y.parquet")]) == 1
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and col in err_lines[0], err_lines


def test_verify_finds_no_problem_in_valid_lists_of_dicts(tmp_path):
    """The check has no false alarm on lists of dicts of every stored form (numbers, strings,
    string lists, tensors, nested lists of dicts, empty dicts, keys absent in other rows)."""
    import torch

    values = [
        {"d": [{"a": 1, "b": "x"}, {"a": 2, "b": "yy"}]},
        {"d": [{"a": 1.5, "b": "x", "c": [1, 2]}]},
        {"d": [{"a": [1, 2], "b": None}, {"a": [3], "b": "z"}]},
        {"d": {"a": 3}},
        {"d": [[{"q": 1}], [{"q": 2}, {"q": 3}]]},
        {"d": [{"t": torch.ones(2)}, {"t": torch.zeros(3)}]},
        {"d": [{"s": ["a", "b"]}, {"s": ["c"]}]},
        {"d": [{"r": [{"z": 1}]}, {"r": [{"z": 2}, {"z": 3}]}]},
        {"d": [{"e": {}}, {"e": {}}]},
    ]
    root, out = tmp_path / "spill", tmp_path / "out.zarr"
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        for i, v in enumerate(values):
            w.write(f"f{i}.jpg", 0, v)
    spillmerge.merge(str(root), str(out))
    assert spillmerge.verify(str(out)).problems == []
    assert spillmerge.open(str(out)).to_arrow().num_rows == len(values)

