"""Reading rows fast: the decoded-chunk cache (each chunk decoded once, never a chunk that failed
its checksum, bounded under threads), small string chunks for random access, streamed Arrow
batches with column selection, Parquet read by polars / DuckDB / Hugging Face datasets, and
``spillmerge export`` through the console script."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_cli import cli_run

import spillmerge

N_FILES = 120
WORDS = ["person", "car", "dog", "traffic light", "", "zebra crossing"]


def _value(i: int, f: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 * i + f)
    k = (i + f) % 5
    v: dict[str, object] = {
        "boxes": torch.rand(k, 4, generator=g),  # ragged, inner shape (4,)
        "scores": torch.rand(k, generator=g),
        "cls": WORDS[(i + f) % len(WORDS)] + str(i),
        "emb": torch.randn(16, generator=g).to(torch.float16),  # fixed
        "blob": bytes([i % 251]) * (i % 7),
        "tokens": [WORDS[(i * j) % len(WORDS)] for j in range(k)],
        "mask": torch.ones(k % 3 + 1, k % 2 + 1, dtype=torch.uint8),  # ragged, every dimension varies
    }
    if i % 3 == 0:
        v["maybe"] = torch.full((2,), float(i))  # absent from two files in three
    return v


def _frames(i: int) -> list[int]:
    return [0, 2, 5] if i % 10 == 0 else [0]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A detection-like output of every leaf kind, in small chunks (many chunks per column)."""
    base = tmp_path_factory.mktemp("reading")
    root, o = base / "spill", base / "out.zarr"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(N_FILES):
            for f in _frames(i):
                w.write(f"img_{i:04d}.jpg", f, _value(i, f))
    spillmerge.merge(str(root), str(o), chunk_bytes=1024, progress=False)
    return str(o)


def _same(got: object, want: object) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, np.ndarray) and got.shape == tuple(want.shape)
        assert got.tobytes() == want.numpy().tobytes()
    else:
        assert got == want


def _read_all(store: spillmerge.MergedStore) -> None:
    """Every row of every leaf through ``store[f][leaf][j]``, checked against what was written."""
    for i in range(N_FILES):
        v = store[f"img_{i:04d}.jpg"]
        for j, f in enumerate(_frames(i)):
            want = _value(i, f)
            for leaf in ("boxes", "scores", "cls", "emb", "blob", "tokens", "mask", "maybe"):
                if leaf in v:
                    got = v[leaf][j]
                    if leaf in want:
                        _same(got, want[leaf])
                    else:
                        assert got is None


def _chunks(store: spillmerge.MergedStore) -> int:
    n = 0
    for c in store.columns:
        z = store.column(c).zarr
        n += -(-z.shape[0] // z.chunks[0])
    return n


def test_rows_read_in_order_decode_each_chunk_once(out):
    store = spillmerge.open(out)
    assert _chunks(store) > 3 * len(store.columns)  # small chunks: many per column
    at_open = store.cache_stats().misses  # the first block of filenames, checked at open
    _read_all(store)
    stats = store.cache_stats()
    assert stats.misses - at_open == _chunks(store), stats  # every chunk decoded exactly once
    assert stats.nbytes <= stats.max_bytes


@pytest.mark.parametrize("cache_bytes", [0, 600])
def test_no_cache_and_a_tiny_cache_read_the_same(out, cache_bytes):
    store = spillmerge.open(out, cache_bytes=cache_bytes)
    _read_all(store)
    stats = store.cache_stats()
    assert stats.nbytes <= cache_bytes and stats.max_bytes == cache_bytes
    assert stats.misses > _chunks(store)  # chunks evicted (or never kept) are decoded again
    assert store.column("emb").to_arrow().equals(spillmerge.open(out).column("emb").to_arrow())


def test_rows_returned_are_the_callers_to_change(out):
    store = spillmerge.open(out)
    row = store["img_0001.jpg"]["emb"][0]
    boxes = store["img_0001.jpg"]["boxes"][0]
    want = row.copy()
    row[:] = 0  # writable, and the cached chunk is not this array
    boxes += 1
    _same(store["img_0001.jpg"]["emb"][0], torch.from_numpy(want.view(np.float16)))
    _same(store["img_0001.jpg"]["boxes"][0], _value(1, 0)["boxes"])


def test_a_corrupt_chunk_is_never_served_from_the_cache(tmp_path, out):
    import shutil

    bad = tmp_path / "bad.zarr"
    shutil.copytree(out, bad)
    store = spillmerge.open(str(bad))
    emb = store.column("emb")
    k = emb.zarr.chunks[0]
    assert emb[0] is not None and emb[k] is not None  # chunks 0 and 1 read (cached) while intact
    chunk = bad / "columns" / "emb" / "values" / "c" / "2" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[3] ^= 0x40
    chunk.write_bytes(bytes(raw))
    before = store.cache_stats()
    errors: list[BaseException] = []
    served: list[object] = []

    def read() -> None:
        try:
            served.append(store.column("emb")[2 * k])
        except BaseException as exc:  # noqa: BLE001 - collected and checked below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read()  # and once more after every thread failed: still not cached
    assert not served
    assert len(errors) == 5 and all(isinstance(e, spillmerge.CorruptSpillError) for e in errors), errors
    assert "columns/emb/values" in str(errors[0])
    after = store.cache_stats()
    assert after.chunks == before.chunks and after.nbytes == before.nbytes  # nothing of it was kept
    _same(emb[k], _value_for_row(store, k, "emb"))  # verified chunks stay served


def _value_for_row(store: spillmerge.MergedStore, row: int, leaf: str) -> object:
    table = store.to_arrow(columns=[])
    name, frame = table["filename"][row].as_py(), table["frame_idx"][row].as_py()
    return _value(int(name[4:8]), frame)[leaf]


def test_memory_stays_bounded_under_concurrent_readers(out):
    cache = 3000
    store = spillmerge.open(out, cache_bytes=cache)
    peak = [0]
    stop = threading.Event()
    failures: list[BaseException] = []

    def watch() -> None:
        while not stop.wait(0.0005):
            peak[0] = max(peak[0], store.cache_stats().nbytes)

    def reader(seed: int) -> None:
        try:
            order = np.random.default_rng(seed).permutation(N_FILES)
            for i in order[:60]:
                v = store[f"img_{i:04d}.jpg"]
                for j, f in enumerate(_frames(int(i))):
                    want = _value(int(i), f)
                    for leaf in ("boxes", "cls", "emb", "tokens"):
                        _same(v[leaf][j], want[leaf])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    readers = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    watcher.join()
    assert not failures, failures[0]
    assert 0 < peak[0] <= cache
    assert store.cache_stats().misses > 0


def test_a_str_row_decodes_a_small_chunk(tmp_path):
    root, o = tmp_path / "spill", tmp_path / "out.zarr"
    n = 6000
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        for i in range(n):
            w.write(f"doc_{i:05d}", 0, {"caption": f"a short caption {i}", "tokens": ["a", "b", str(i)]})
    spillmerge.merge(str(root), str(o), progress=False)
    store = spillmerge.open(str(o))
    for leaf in ("caption", "tokens"):
        z = store.column(leaf).zarr
        assert (
            z.dtype == np.uint8 and z.chunks[0] <= 1 << 20
        )  # UTF-8 bytes: a chunk read is a copy, no per-string decode
    at_open = store.cache_stats().misses
    assert store["doc_04321"]["caption"][0] == "a short caption 4321"
    assert store["doc_04321"]["tokens"][0] == ["a", "b", "4321"]
    assert store.cache_stats().misses - at_open == 3  # the filename's block of names, one chunk of each column


@pytest.mark.parametrize("batch_size", [1, 7, 64, None])
def test_iter_batches_streams_what_to_arrow_holds(out, batch_size):
    store = spillmerge.open(out)
    whole = store.to_arrow()
    batches = list(store.iter_batches(batch_size=batch_size))
    assert all(isinstance(b, pa.RecordBatch) for b in batches)
    if batch_size is not None:
        assert all(b.num_rows <= batch_size for b in batches) and len(batches) == -(-whole.num_rows // batch_size)
    assert pa.Table.from_batches(batches).equals(whole)
    assert whole.column_names[:3] == ["filename", "frame_idx", "rank"]
    assert whole.num_rows == sum(len(_frames(i)) for i in range(N_FILES))


def test_columns_select_leaves_and_unknown_ones_are_named(out):
    store = spillmerge.open(out)
    whole = store.to_arrow()
    some = store.to_arrow(columns=["tokens", "emb"])
    assert some.column_names == ["filename", "frame_idx", "rank", "tokens", "emb"]
    for name in some.column_names:
        assert some[name].equals(whole[name])
    batch = next(store.iter_batches(columns="cls", batch_size=5))
    assert batch.schema.names == ["filename", "frame_idx", "rank", "cls"]
    with pytest.raises(spillmerge.UnknownColumnError, match="no column 'score'") as err:
        store.to_arrow(columns=["score"])
    assert "boxes" in err.value.known


def test_parquet_reads_the_same_in_polars_duckdb_and_datasets(out, tmp_path):
    import datasets
    import duckdb
    import polars as pl

    store = spillmerge.open(out)
    path = tmp_path / "preds.parquet"
    rows = store.to_parquet(path, batch_size=50)
    table = store.to_arrow()
    assert rows == table.num_rows
    assert not [p for p in tmp_path.iterdir() if p.name != "preds.parquet"]  # no temporary left
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == -(-rows // 50)  # written batch by batch
    assert pq.read_table(path).equals(table)

    lazy = pl.scan_parquet(path).filter(pl.col("frame_idx") > 0).select("filename", "frame_idx", "cls", "emb")
    got = lazy.collect()
    want = pl.from_arrow(table).filter(pl.col("frame_idx") > 0).select("filename", "frame_idx", "cls", "emb")
    assert got.height == sum(len(_frames(i)) - 1 for i in range(N_FILES)) and got.equals(want)

    expect = table.to_pylist()
    names = ", ".join(f'"{c}"' for c in table.column_names)
    con = duckdb.connect()
    duck = con.sql(f"SELECT {names} FROM read_parquet('{path}') ORDER BY filename, frame_idx").fetchall()
    assert [tuple(r.values()) for r in expect] == duck
    con.close()

    ds = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == rows and ds.column_names == table.column_names
    assert ds.to_list() == expect


def test_export_through_the_cli(out, tmp_path):
    path = tmp_path / "boxes.parquet"
    p = cli_run("export", out, "--parquet", str(path), "--columns", "boxes,cls", "--compression", "zstd")
    assert p.returncode == 0, p.stderr
    assert f"{rows_of(out)} rows" in p.stdout
    assert pq.read_table(path).equals(spillmerge.open(out).to_arrow(columns=["boxes", "cls"]))
    bad = cli_run("export", out, "--parquet", str(tmp_path / "x.parquet"), "--columns", "nope")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "no column 'nope'" in bad.stderr
    assert not (tmp_path / "x.parquet").exists()


def rows_of(out: str) -> int:
    return spillmerge.open(out).to_arrow(columns=[]).num_rows


def test_reading_a_path_object_and_an_empty_selection(out, tmp_path):
    store = spillmerge.open(out)
    keys = store.to_arrow(columns=[])
    assert keys.column_names == ["filename", "frame_idx", "rank"]
    assert store.to_parquet(Path(tmp_path) / "keys.parquet", columns=[]) == keys.num_rows


def test_rows_of_a_compact_column_one_by_one_equal_the_whole_read(out):
    """A fixed leaf most rows lack keeps only the rows with a value (offsets steps 0 or 1): a row
    read by itself (an int, a negative int, a numpy int; ``value()`` reads rows so) is that row of
    the whole read, and a row without a value is None, or zeros through ``to_torch``."""
    store = spillmerge.open(out)
    col = store.column("maybe")
    assert col._col.offsets is not None  # the compact layout under test
    whole, valid = col[:], col.valid
    assert valid is not None and 0 < valid.sum() < len(col)
    for i in range(len(col)):
        for sel in (i, i - len(col), np.int64(i)):
            got = col[sel]
            assert (got is None) if not valid[i] else (got.dtype == whole.dtype and np.array_equal(got, whole[i]))
        t = col.to_torch(i)
        assert tuple(t.shape) == (2,) and (t.tolist() == whole[i].tolist() if valid[i] else t.tolist() == [0.0, 0.0])
    rows = [j for j in range(len(col)) if valid[j]]
    assert all(float(col[j][0]) % 3 == 0 for j in rows)  # the files i % 3 == 0 wrote full((2,), i)


def test_iter_values_gives_what_value_gives_in_key_order_whatever_the_layouts(tmp_path):
    """Files of one structure read by one tree per layout, files that lack a key or hold None
    there, records, nested dicts and tensors: each value as value() gives it, keys in order."""
    values = {
        "a": {"z": 1, "a": "x", "m": {"q": [1.5, 2.5], "b": None}},
        "b": {"z": 2, "a": "y", "m": {"q": [3.5], "b": None}},
        "c": {"a": "only a"},
        "d": {"z": 3, "a": None, "m": {"q": [], "b": 4}},
        "e": {"recs": [{"k": 1, "box": [1.0, 2.0], "s": "u"}, {"k": 2, "box": [3.0, 4.0], "s": "v"}], "z": 7},
        "f": {"recs": [{"k": 3, "box": [5.0, 6.0], "s": "w"}], "z": 8},
        "g": {"t": torch.arange(3), "z": 9},
        "h": "a str at the root",
    }
    with spillmerge.SpillWriter(str(tmp_path / "spill"), 0, 1) as w:
        for name, value in values.items():
            w.write(name, 0, value)
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"), progress=False)
    store = spillmerge.open(str(tmp_path / "out.zarr"))
    got = {name: value for name, _, value in store.iter_values(as_torch=True)}
    assert list(got) == list(values)
    for name, want in values.items():
        one = store.value(name, as_torch=True)
        if isinstance(want, dict) and "t" in want:
            assert list(got[name]) == list(one) == list(want) and torch.equal(got[name]["t"], want["t"])
            continue
        assert got[name] == one == want, name
        if isinstance(want, dict):
            assert list(got[name]) == list(one) == list(want), name
            for k, v in want.items():
                if isinstance(v, dict):
                    assert list(got[name][k]) == list(v), (name, k)
                if isinstance(v, list) and v and isinstance(v[0], dict):
                    assert [list(d) for d in got[name][k]] == [list(d) for d in v], (name, k)


def test_iter_values_of_frames_holding_a_dict_or_none_at_a_key_is_what_value_gives(tmp_path):
    """A file whose frames hold an empty dict, or a list of dicts, at a key in one frame and None
    in another: rows without a value in a header column of the file's layout, each value as
    value() gives it."""
    frames = {"k": [{"e": {}, "y": 1}, {"e": None, "y": 2}], "l": [{"r": [{"a": 1}], "y": 1}, {"r": None, "y": 2}]}
    with spillmerge.SpillWriter(str(tmp_path / "spill"), 0, 1) as w:
        for name, values in frames.items():
            for f, value in enumerate(values):
                w.write(name, f, value)
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"), progress=False)
    store = spillmerge.open(str(tmp_path / "out.zarr"))
    got = list(store.iter_values())
    assert got == [(name, f, v) for name, values in frames.items() for f, v in enumerate(values)]
    assert all(store.value(name, f) == v for name, f, v in got)


@pytest.mark.parametrize("by_row", [False, True])
def test_iter_values_of_lists_of_dicts_in_runs_is_what_value_gives(tmp_path, monkeypatch, by_row):
    """Detections (a COCO evaluator's output: a list of dicts an image) read a run of rows at a
    time across a block of rows: images without detections, files whose second frame lacks the
    key or holds None or an empty list there (rows without a value in some of the file's
    columns), a nested dict;
    with ``by_row`` a column of the run read row by row (its rows too large to decode together).
    Every value as written and as value() gives it, keys in order."""
    from spillmerge._read import values as _values

    if by_row:
        monkeypatch.setattr(_values, "BLOCK_BYTES", 64)
    values: dict[tuple[str, int], Any] = {}
    for i in range(_values.BLOCK_ROWS + 300):
        k = i % 4
        dets = [{"id": i, "bbox": [i + 0.5, 1.0, 2.0, float(j)], "score": j / 3, "cat": {"n": j}} for j in range(k)]
        values[(f"{i:05d}", 0)] = {"image_id": i, "instances": dets}
        if i % 7 == 1:
            second = {"image_id": -i} if i % 3 else {"image_id": -i, "instances": None if i % 2 else []}
            values[(f"{i:05d}", 1)] = second
    got = _iter_values_are_what_value_gives(tmp_path, values)
    for v in got.values():  # (key order inside lists too)
        assert all(list(d) == ["id", "bbox", "score", "cat"] for d in v.get("instances") or [])


@pytest.mark.parametrize("gaps", [False, True])
def test_iter_values_of_flat_dicts_in_runs_is_what_value_gives(tmp_path, gaps):
    """Flat dicts (an LLM output a file) read a run of rows at a time: files of several frames,
    a key order that changes from file to file, runs that cross a block of rows, and (``gaps``)
    a row lacking a key or holding None, and files whose value is a str (the drop-ins' headers:
    every flat column then has rows without a value); every (filename, frame, value) as value()
    gives it, keys in order."""
    values: dict[tuple[str, int], Any] = {}
    for i in range(2600):
        name = f"p{i:05d}"
        for fr in range(1 + (i % 3 == 0)):
            v: dict[str, Any] = {"text": f"t{i}-{fr}", "ids": list(range(i % 4 + 1)), "lp": -i / 7, "why": "stop"}
            if i % 500 == 17:
                v = dict(reversed(list(v.items())))  # another key order for this file
            if gaps and i == 1234:
                v["lp"] = None
            if gaps and i == 1500:
                del v["why"]
            values[(name, fr)] = v
        if gaps and i % 1000 == 999:
            values[(f"{name}.h", 0)] = f"header {i}"
    _iter_values_are_what_value_gives(tmp_path, values)


def _iter_values_are_what_value_gives(tmp_path: Path, values: dict[tuple[str, int], Any]) -> dict[Any, Any]:
    """Writes ``values`` ((filename, frame) -> value) and merges them; checks that iter_values
    gives each, in order, as value() does (type and key order too); what it gave."""
    with spillmerge.SpillWriter(str(tmp_path / "spill"), 0, 1) as w:
        for (name, fr), v in values.items():
            w.write(name, fr, v)
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out.zarr"), progress=False)
    store = spillmerge.open(str(tmp_path / "out.zarr"))
    got = {(name, fr): v for name, fr, v in store.iter_values()}
    assert list(got) == list(values)
    for key, want in values.items():
        assert got[key] == want == store.value(*key), key
        assert type(got[key]) is type(want) and list(got[key]) == list(want) == list(store.value(*key)), key
    return got
