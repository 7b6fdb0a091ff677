"""An output of format version 3 (one column per list item position) still opens and reads as it
did: tests/fixtures/make_v3.py wrote it, and its ``to_arrow()`` table, with format 3's code."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

import spillmerge
from tests._helpers import value_diffs

FIXTURES = Path(__file__).parent / "fixtures"


def _written() -> list[tuple[str, int, object]]:
    spec = importlib.util.spec_from_file_location("make_v3", FIXTURES / "make_v3.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # only defines values(): the writing is under __main__
    return mod.values()


@pytest.fixture
def v3(tmp_path: Path) -> Path:
    out = tmp_path / "v3.zarr"
    shutil.copytree(FIXTURES / "v3-output.zarr", out)
    return out


def test_every_value_of_a_format_3_output_reads_back(v3):
    res = spillmerge.open(str(v3))
    assert res.format_version == 3
    written = _written()
    assert res.filenames == sorted({f for f, _, _ in written})
    for filename, frame, value in written:
        assert value_diffs(res.value(filename, frame), value, f"{filename}[{frame}]") == []
    # every row in order, read in bulk: the same rows and values (format 3's item columns)
    in_order = list(res.iter_values())
    assert [(f, i) for f, i, _ in in_order] == sorted((f, i) for f, i, _ in written)
    by_key = {(f, i): v for f, i, v in written}
    for filename, frame, got in in_order:
        assert value_diffs(got, by_key[(filename, frame)], f"iter_values {filename}[{frame}]") == []
    assert spillmerge.verify(str(v3)).ok


def test_leaf_views_of_a_format_3_output_show_one_column_per_item_position(v3):
    res = spillmerge.open(str(v3))
    a = res["a.jpg"]
    assert a["recs"]["a"][0].tolist() == [1, 2] and a["recs"]["b"][1] == ["z"]  # records: a column per key
    first = "\x1f0"
    assert [t.shape for t in a["scores"][first].to_list()] == [(3,), (3,)]  # every row's first tensor
    items = res.column(("ll", first))  # a whole column: rows of a.jpg (2), b.jpg, c.txt (2)
    assert items.to_list()[:3] == [["a", "b"], None, ["d"]]
    np.testing.assert_array_equal(res.column(("nested", first)).to_list()[0], [1, 2])


def test_to_arrow_of_a_format_3_output_is_what_format_3_exported(v3):
    pa = pytest.importorskip("pyarrow")
    with pa.memory_map(str(FIXTURES / "v3-arrow.arrow")) as f:
        want = pa.ipc.open_file(f).read_all()
    got = spillmerge.open(str(v3)).to_arrow()
    assert got.schema == want.schema
    assert got.to_pylist() == want.to_pylist()


def test_a_list_header_longer_than_its_item_columns_is_refused(v3):
    # Format 3 stores a list's items in one column per position ("ll" has 3): a header saying 5
    # would read as the 3 items and two None, not as the list written. Rewritten with zarr (which
    # fixes the chunk's checksum), so only the header's bound can tell.
    import zarr

    (header,) = (v3 / "columns").glob("ll__~*")
    values = zarr.open_array(str(header / "values"), mode="r+")
    assert values[0] == 3  # a.jpg frame 0: [["a", "b"], [], ["c"]]
    values[0] = 5
    res = spillmerge.open(str(v3))
    with pytest.raises(
        spillmerge.CorruptSpillError, match=r"says its list has 5 items; the file columns hold at most 3"
    ):
        res.value("a.jpg", 0)
    with pytest.raises(spillmerge.CorruptSpillError, match=r"has 5 items"):
        list(res.iter_values())


def test_a_format_3_list_header_beyond_its_item_columns_is_refused_by_to_arrow(v3):
    """Format 3 bounds a list's length by its highest item column: a header of 2**40 (its chunk's
    CRC-32C fixed) is refused by ``to_arrow`` naming the list, as by ``value()``, before anything
    is sized by it."""
    import struct

    import google_crc32c

    chunk = v3 / "columns" / "dets__~517d9ec5da13c8a2.pylist" / "values" / "c" / "0"
    raw = bytearray(chunk.read_bytes()[:-4])
    raw[0:8] = struct.pack("<q", 1 << 40)
    chunk.write_bytes(bytes(raw) + google_crc32c.value(bytes(raw)).to_bytes(4, "little"))
    with pytest.raises(spillmerge.CorruptSpillError, match="1099511627776 items by its header"):
        spillmerge.open(str(v3)).to_arrow()
