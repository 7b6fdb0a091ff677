"""docs/FORMAT.md's JSON examples say what spillmerge writes: every example (``json`` blocks, inline
``{...}`` code, the segment header's field table) is parsed and checked against the object a real
spill, merge, merge in parts, failing writer and lease write here — the same keys (nested objects
too) and the same ``format_version`` and ``kind`` — so the document cannot drift from the code.

Examples use a shorthand a strict JSON parser refuses (``"rank"`` alone for a field, ``N`` or
``<original>`` for a value); :func:`_parse` reads it: a key without a value, or a placeholder value.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import zarr

import spillmerge
from spillmerge._format import codecs as _codecs
from spillmerge._format import common as F
from spillmerge._format import output as FO
from spillmerge._format import spill as FS
from spillmerge._merge import lease as _lease
from spillmerge._storage import Storage
from spillmerge._util.progress import PROGRESS_NAME

DOC = Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md"

# Inline code that shows what a *value* becomes, not a record spillmerge writes.
NOT_RECORDS = {'[{"a": 1}, {"a": 2}]', '{"a": [1, 2]}'}


class Placeholder:
    """A value the document names instead of showing (``N``, ``[...]``, ``<dtype name>``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"<{self.text}>"


class _Shorthand:
    """Reads the JSON of FORMAT.md's examples: strict JSON, plus keys without a value (None
    stands for "some value") and bare placeholder values."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def value(self) -> Any:
        self._ws()
        c = self.s[self.i]
        if c == "{":
            return self._object()
        if c == "[":
            return self._array()
        if c == '"':
            return self._string()
        m = re.compile(r"-?\d+(\.\d+)?|true|false|null").match(self.s, self.i)
        if m and self.s[m.end() : m.end() + 1] in (",", "}", "]", " ", "\n", ""):
            self.i = m.end()
            return json.loads(m.group(0))
        start, depth = self.i, 0  # a placeholder: up to the next , } or ] at this level
        while self.i < len(self.s) and (depth or self.s[self.i] not in ",}]"):
            depth += {"<": 1, ">": -1}.get(self.s[self.i], 0)
            self.i += 1
        return Placeholder(self.s[start : self.i].strip())

    def _string(self) -> str:
        m = re.compile(r'"(?:[^"\\]|\\.)*"').match(self.s, self.i)
        assert m, f"unterminated string at {self.s[self.i : self.i + 40]!r}"
        self.i = m.end()
        return str(json.loads(m.group(0)))

    def _object(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.i += 1
        while True:
            self._ws()
            if self.s[self.i] == "}":
                self.i += 1
                return out
            key = self._string()
            self._ws()
            if self.s[self.i] == ":":
                self.i += 1
                out[key] = self.value()
            else:
                out[key] = None  # "rank" alone: the field exists, its value is not shown
            self._ws()
            if self.s[self.i] == ",":
                self.i += 1

    def _array(self) -> list[Any]:
        out: list[Any] = []
        self.i += 1
        while True:
            self._ws()
            if self.s[self.i] == "]":
                self.i += 1
                return out
            if self.s.startswith("...", self.i):
                self.i += 3
                out.append(Placeholder("..."))
            else:
                out.append(self.value())
            self._ws()
            if self.s[self.i] == ",":
                self.i += 1


def _parse(text: str) -> Any:
    p = _Shorthand(text)
    v = p.value()
    p._ws()
    assert p.i == len(p.s), f"trailing text after the example: {p.s[p.i :]!r}"
    return v


def _examples() -> list[tuple[int, str]]:
    """Every JSON example of FORMAT.md as (line, text)."""
    doc = DOC.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"```json\n(.*?)```", doc, re.S):
        out.append((doc.count("\n", 0, m.start()) + 1, m.group(1).strip()))
    # Inline code outside fenced blocks, from its first { (``attributes["spillmerge"] = {...}``).
    body = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), doc, flags=re.S)
    for m in re.finditer(r"`([^`]*)`", body):
        text = m.group(1)
        if '{"' in text:
            text = text[text.index(" = ") + 3 :] if " = " in text else text
            out.append((doc.count("\n", 0, m.start()) + 1, text))
    return out


def _segment_table() -> dict[str, str]:
    """The segment header's field table: field -> the value column."""
    doc = DOC.read_text(encoding="utf-8")
    section = doc[doc.index("### Segment header") :]
    section = section[: section.index("\n### ")]
    fields: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for name in cells[0].split(","):
                fields[name.strip().strip("`")] = cells[1]
    return fields


def _attrs(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8"))["attributes"]["spillmerge"])


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every record kind FORMAT.md shows, as spillmerge writes it (key -> parsed object)."""
    tmp = tmp_path_factory.mktemp("format-doc")
    root, out, parts = tmp / "spill", tmp / "out.zarr", tmp / "parts.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1, chunk_bytes=4096) as w:
        for f in range(8):  # boxes: a ragged float32 column with inner_shape [4], as in the doc
            w.write("video_001.mp4", f, {"boxes": torch.zeros(f + 1, 4), "caption": f"frame {f}"})
    with spillmerge.SpillWriter(str(tmp / "spill-variants"), rank=0, world_size=1) as w:
        w.write("bad.mp4", 0, {"result": torch.zeros(2)})  # result: two variants (version 3)
        w.write("bad.mp4", 1, {"result": "corrupt header"})
    spillmerge.merge(str(tmp / "spill-variants"), str(tmp / "variants.zarr"))
    spillmerge.merge(str(root), str(out))
    spillmerge.merge(str(root), str(parts), part=(0, 1))
    (seg,) = (root / "rank-00000").iterdir()
    journal = (seg / "journal" / "000000").read_bytes()
    (head_len,) = struct.unpack("<I", journal[4:8])
    catalog = json.loads(zarr.open_array(str(seg / FS.CATALOG_NAME), mode="r")[:].tobytes())

    failed_root = tmp / "failed"
    with pytest.raises(RuntimeError), spillmerge.SpillWriter(str(failed_root), rank=0, world_size=1) as w:
        w.write("x.mp4", 0, torch.zeros(2))
        raise RuntimeError("the user's loop failed")
    (failed_seg,) = (failed_root / "rank-00000").iterdir()

    with _lease.whole(Storage(str(tmp / "leased.zarr"))):
        holder = json.loads((tmp / "leased.zarr" / _lease.LEASE_DIR / "merge.lock").read_bytes())

    boxes = next(p for p in (out / "columns").iterdir() if p.is_dir() and _attrs(p / "zarr.json")["leaf"] == ["boxes"])
    variant = next(p for p in (tmp / "variants.zarr" / "columns").iterdir() if p.is_dir() and _attrs(p / "zarr.json").get("variant"))
    try:
        raise OSError("No space left on device")
    except OSError as exc:  # the record class SpillWriter.merge writes when the merge raises
        merge_failure = FS.MergeFailureRecord.of(exc, rank=0, run_id=None, session=0)
    return {
        "spill-segment": _attrs(seg / "zarr.json"),
        "spill-progress": json.loads((seg / PROGRESS_NAME).read_bytes()),
        "spill-commit": json.loads((seg / FS.COMMIT_NAME).read_bytes()),
        "spill-failure": json.loads((failed_seg / FS.FAILURE_NAME).read_bytes()),
        "merge-failure": json.loads(merge_failure.to_json()),
        "catalog": catalog,
        "journal": json.loads(journal[8 : 8 + head_len]),
        "merged": _attrs(out / "zarr.json"),
        "merge-complete": json.loads((out / FO.COMPLETE_NAME).read_bytes()),
        "merge-part": json.loads(next((parts / "spillmerge-parts").glob("part-*.json")).read_bytes()),
        "column": _attrs(boxes / "zarr.json"),
        "column-variant": _attrs(variant / "zarr.json"),
        "lease": holder,
        "codec:blosc": _codecs.compressor_doc("blosc-lz4", 4),
        "codec:zstd": _codecs.compressor_doc("zstd", 4),
    }


def _which(example: Any) -> str:
    """The record an example shows: by its ``kind``, else by the fields only it has."""
    kind = example.get("kind")
    if isinstance(kind, str) and kind in FO.COLUMN_KINDS:
        return "column-variant" if "variant" in example else "column"
    if isinstance(kind, str):
        return kind
    for key, record in (
        ("chunk", "journal"), ("layouts", "catalog"), ("owner", "lease"),
    ):  # fmt: skip
        if key in example:
            return record
    if "name" in example:
        return f"codec:{example['name']}"
    raise AssertionError(f"FORMAT.md example {example!r:.200} is no record this test knows: add it to `written`")


def _same_shape(doc: Any, real: Any, where: str) -> None:
    """The example has the real object's keys, at every level the example shows; its
    ``format_version`` and ``kind`` are the real ones."""
    if isinstance(doc, dict):
        assert isinstance(real, dict), f"{where}: the document shows an object, spillmerge writes {real!r:.100}"
        assert sorted(doc) == sorted(real), (
            f"{where}: the document's keys differ from what spillmerge writes: "
            f"only in the document {sorted(set(doc) - set(real))}, only written {sorted(set(real) - set(doc))}"
        )
        for key in ("format_version", "kind"):
            if key in doc and doc[key] is not None:
                assert doc[key] == real[key], (
                    f"{where}: the document says {key} {doc[key]!r}, spillmerge writes {real[key]!r}"
                )
        for key, value in doc.items():
            _same_shape(value, real[key], f"{where}.{key}")
    elif isinstance(doc, list) and doc and isinstance(doc[0], dict) and real:
        _same_shape(doc[0], real[0], f"{where}[0]")


def test_every_json_example_of_format_md_matches_what_spillmerge_writes(written: dict[str, Any]) -> None:
    examples = [(line, text) for line, text in _examples() if text not in NOT_RECORDS]
    seen = set()
    for line, text in examples:
        example = _parse(text)
        record = _which(example)
        _same_shape(example, written[record], f"docs/FORMAT.md:{line} ({record})")
        seen.add(record)
    # Every record kind written above is shown somewhere (the table covers the segment header).
    assert seen | {"spill-segment"} == set(written), sorted(set(written) - seen)


def test_the_segment_header_table_matches_what_spillmerge_writes(written: dict[str, Any]) -> None:
    table = _segment_table()
    real = written["spill-segment"]
    assert sorted(table) == sorted(real)
    assert table["format_version"] == f"`{real['format_version']}`" == f"`{F.SPILL_FORMAT_VERSION}`"
    assert table["kind"] == f'`"{real["kind"]}"`'


def test_the_column_header_reads_back_as_written(written: dict[str, Any]) -> None:
    header = FO.ColumnHeader.from_obj(written["column"], name="boxes", path="columns/boxes")
    assert header.to_obj() == written["column"]
    assert (header.kind, header.dtype, header.inner_shape, header.has_valid) == ("ragged", "float32", (4,), False)
    with pytest.raises(spillmerge.CorruptSpillError, match="unknown dtype 'float99'") as info:
        FO.ColumnHeader.from_obj({**written["column"], "dtype": "float99"}, name="boxes", path="columns/boxes")
    assert info.value.path == "columns/boxes" and info.value.reason is not None


def test_the_shorthand_reader_reads_keys_without_values_and_placeholders() -> None:
    got = _parse('{"format_version": 2, "kind": "x", "rank", "n": N, "l": [...], "d": <dtype name>}')
    assert list(got) == ["format_version", "kind", "rank", "n", "l", "d"]
    assert got["format_version"] == 2 and got["rank"] is None and isinstance(got["n"], Placeholder)
    assert isinstance(got["l"][0], Placeholder) and got["d"].text == "<dtype name>"
