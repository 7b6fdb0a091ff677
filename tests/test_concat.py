"""``_concat.Concat``: slices back to back read as one array (the plan in ranges, issue 24)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillmerge._concat import Concat, concat, concat_offsets


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(0, 2), st.data())
def test_concat_reads_as_the_joined_array(lengths, tail, data):
    shape_tail = (3,) * tail
    pieces = [np.arange(n * 3**tail, dtype=np.int64).reshape(n, *shape_tail) + 100 * k for k, n in enumerate(lengths)]
    whole = np.concatenate(pieces)
    c = Concat(pieces)
    assert len(c) == len(whole) and c.shape == whole.shape and c.dtype == whole.dtype and c.ndim == whole.ndim
    assert c.nbytes == whole.nbytes
    np.testing.assert_array_equal(np.asarray(c), whole)
    n = len(whole)
    a = data.draw(st.integers(-n - 2, n + 2))
    b = data.draw(st.integers(-n - 2, n + 2))
    step = data.draw(st.sampled_from([None, 1, 2, 3]))
    np.testing.assert_array_equal(c[a:b:step], whole[a:b:step])
    if n:
        i = data.draw(st.integers(-n, n - 1))
        np.testing.assert_array_equal(c[i], whole[i])
        idx = np.array(data.draw(st.lists(st.integers(-n, n - 1), max_size=8)), dtype=np.int64)
        np.testing.assert_array_equal(c[idx], whole[idx])
        if tail:
            np.testing.assert_array_equal(c[i, 0], whole[i, 0])
            np.testing.assert_array_equal(c[idx, 1], whole[idx, 1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), max_size=5), min_size=1, max_size=4), st.lists(st.integers(-1, 11)),
       st.sampled_from(["left", "right"]))  # fmt: skip
def test_searchsorted_of_sorted_pieces_is_that_of_the_joined_array(values, probes, side):
    whole = np.sort(np.array([x for v in values for x in v], dtype=np.int64))
    cuts = np.cumsum([len(v) for v in values])[:-1]
    c = Concat(np.split(whole, cuts))
    assert np.searchsorted(c, probes, side=side).tolist() == np.searchsorted(whole, probes, side=side).tolist()
    for p in probes[:3]:
        assert int(np.searchsorted(c, p, side=side)) == int(np.searchsorted(whole, p, side=side))


def test_concat_refuses_what_an_array_refuses():
    c = Concat([np.arange(3), np.arange(2)])
    with pytest.raises(IndexError):
        c[5]
    with pytest.raises(IndexError):
        c[np.array([0, 5])]
    with pytest.raises(TypeError):
        c[np.array([True, False, True, False, True])]
    with pytest.raises(ValueError, match="unlike"):
        Concat([np.arange(3), np.arange(3.0)])


def test_one_piece_is_itself_and_offsets_share_their_boundaries():
    a = np.arange(4)
    assert concat([a]) is a
    off = concat_offsets([np.array([0, 2, 5]), np.array([5, 5, 9]), np.array([9, 10])])
    assert np.asarray(off).tolist() == [0, 2, 5, 5, 9, 10]
