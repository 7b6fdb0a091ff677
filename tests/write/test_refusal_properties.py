"""Property test: a value the writer refuses, at any depth of a frame among good ones, through
``write()``, ``update()`` or ``write_batch()`` (a list of items, or a dict of columns), raises a
``SpillValueError`` naming its filename (message and ``.filename``) and loses nothing: every frame
written before it, and after it in the same writer, reads back after the merge; of a refused
batch or update nothing is written."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from test_reader_agreement import VALUES, _np, canon

import spillmerge


def _cycle() -> list[Any]:
    v: list[Any] = [1]
    v.append(v)
    return v


def _deep() -> Any:
    v: Any = 1
    for _ in range(40):
        v = {"d": v}
    return v


BAD = st.sampled_from([
    lambda: 2**63, lambda: -(2**63) - 1, lambda: [1, 2**64], lambda: (0.5, -(2**70)), lambda: object(),
    lambda: {1, 2}, lambda: "a\ud800", lambda: ["ok", "\udfff"], lambda: {1: "int key"}, lambda: {"k": {None: 1}},
    lambda: np.array([1, None], dtype=object), lambda: np.array(["s"]), lambda: _cycle(), lambda: _deep(),
    lambda: [{"a": 1}, {"a": 2**63}], lambda: np.datetime64("2026-01-01"),
])  # fmt: skip
WRAPS = st.sampled_from([
    lambda b: b, lambda b: {"a": b}, lambda b: [1, b], lambda b: (b, "x"), lambda b: {"a": [{"k": b}, {"k": 1}]},
    lambda b: {"x": {"y": (None, b)}},
])  # fmt: skip
HOW = st.sampled_from(["write", "update", "write_batch", "write_batch-columns"])


@given(st.lists(VALUES, min_size=1, max_size=4), BAD, WRAPS, st.integers(0, 4), HOW, st.lists(VALUES, max_size=2))
def test_a_refused_value_names_its_file_and_loses_nothing(tmp_path_factory, good, bad, wrap, at, how, after):
    base = tmp_path_factory.mktemp("refuse")
    root, out = str(base / "s"), str(base / "o")
    items = [(f"ok-{i}", v) for i, v in enumerate(good)]
    at = min(at, len(items))
    items.insert(at, ("BAD\x00é", wrap(bad())))
    want: dict[str, Any] = {}
    with spillmerge.SpillWriter(root, fsync=False, chunk_bytes=4096) as w:
        w.write("first", 0, good[0])
        want["first"] = good[0]
        try:
            if how == "write":
                for name, v in items:
                    w.write(name, 0, v)
                    want[name] = v
            elif how == "update":
                w.update({name: (0, v) for name, v in items})
            elif how == "write_batch":
                w.write_batch([n for n, _ in items], [v for _, v in items])
            else:
                w.write_batch([n for n, _ in items], {"col": [v for _, v in items]})
        except spillmerge.SpillValueError as e:
            assert e.filename == "BAD\x00é" and repr("BAD\x00é") in str(e), e
        else:
            raise AssertionError(f"{how} took a bad value: {items[at][1]!r:.200}")
        for i, v in enumerate(after):  # the writer goes on
            w.write(f"after-{i}", 0, v)
            want[f"after-{i}"] = v
    spillmerge.merge(root, out, progress=False, fsync=False)
    res = spillmerge.open(out)
    assert sorted(res.filenames) == sorted(want)
    assert {n: canon(v) for n, _, v in res.iter_values()} == {n: canon(_np(v)) for n, v in want.items()}
