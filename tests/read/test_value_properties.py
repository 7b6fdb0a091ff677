"""Property test: any mix of the value model's kinds, written by two ranks as frames of a few
files, reads back as written through ``value()`` and ``iter_values()``: None told from a key a
dict lacks, an empty list from an empty array, every array's dtype, and (one frame a file) the
dicts' key order."""

from __future__ import annotations

import numpy as np
import torch
from _helpers import value_diffs
from hypothesis import given
from hypothesis import strategies as st

import spillmerge

KEYS = st.sampled_from(["a", "b", "z", "é", "\x1f", "\x1f0", "x y", "zarr.json", ".."])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=4)
)
ARRAYS = st.one_of(
    st.builds(lambda n, d: np.arange(n).astype(d), st.integers(0, 3), st.sampled_from(["int8", "float32", "bool"])),
    st.builds(lambda n: torch.arange(n).to(torch.float16), st.integers(0, 3)),
    st.builds(lambda n: np.zeros((n, 2), np.float64), st.integers(0, 2)),
)
VALUES = st.recursive(
    st.one_of(SCALARS, ARRAYS),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=10,
)
ROWS = st.lists(st.tuples(st.sampled_from(["f", "g/h", "é"]), st.integers(0, 3), VALUES), min_size=1, max_size=6)


def _key_order(got, want) -> bool:
    if isinstance(want, dict):
        return list(got) == list(want) and all(_key_order(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return all(_key_order(a, b) for a, b in zip(got, want, strict=True))
    return True


@given(ROWS)  # examples: tests/conftest.py's profile (12; HYPOTHESIS_PROFILE=ci: 100)
def test_values_of_every_kind_read_back_as_written(tmp_path_factory, rows):
    base = tmp_path_factory.mktemp("values")
    want: dict[tuple[str, int], object] = {}
    for rank in range(2):
        with spillmerge.SpillWriter(str(base / "s"), rank, 2) as w:
            for i, (name, frame, value) in enumerate(rows):
                if i % 2 == rank and (name, frame) not in want:
                    w.write(name, frame, value)
                    want[(name, frame)] = value
    spillmerge.merge(str(base / "s"), str(base / "o"), progress=False)
    res = spillmerge.open(str(base / "o"))
    seen = {(name, frame): value for name, frame, value in res.iter_values()}
    assert sorted(seen) == sorted(want)
    one_frame = {name for name, _ in want if sum(n == name for n, _ in want) == 1}
    for key, value in want.items():
        got = res.value(*key)
        assert value_diffs(got, value) == [] and value_diffs(seen[key], value) == [], (key, value, got)
        if key[0] in one_frame:  # a file's frames that order a dict differently keep the first's order
            assert _key_order(got, value) and _key_order(seen[key], value), (key, value, got)
