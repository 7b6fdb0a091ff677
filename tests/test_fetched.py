"""``_fetched.Fetched``: an object-store array read where it is used (the runs and ranges a merge
in parts shares, issue 24), against memory:// storage: every read gives numpy's answer, and only
the granules it touches are fetched, once."""

from __future__ import annotations

import tempfile
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillmerge import _fetched
from spillmerge._concat import Concat, concat_offsets
from spillmerge._fetched import Fetches, fetched
from spillmerge._storage import Storage


def _stored(a: np.ndarray, stats: Fetches, folder: str) -> _fetched.Fetched:
    st_ = Storage(f"memory://fetched-{uuid.uuid4().hex}")
    st_.put("a", a.tobytes())
    return fetched(st_, "a", a.dtype, a.shape, f"{folder}/{uuid.uuid4().hex}", stats)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 300), st.integers(0, 2), st.sampled_from([8, 24, 64]), st.data())
def test_a_fetched_array_reads_as_the_stored_one(n, tail, granule, data):
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fetched, "GRANULE", granule)
        whole = np.arange(n * 2**tail, dtype=np.int64).reshape(n, *(2,) * tail) * 3 - 50
        stats = Fetches()
        f = _stored(whole, stats, folder)
        assert len(f) == n and f.shape == whole.shape and f.dtype == whole.dtype and f.nbytes == whole.nbytes
        assert stats.bytes == 0 and stats.size == whole.nbytes  # nothing read yet
        a, b = data.draw(st.integers(-n - 2, n + 2)), data.draw(st.integers(-n - 2, n + 2))
        step = data.draw(st.sampled_from([None, 1, 2, 5]))
        np.testing.assert_array_equal(f[a:b:step], whole[a:b:step])
        if n:
            i = data.draw(st.integers(-n, n - 1))
            np.testing.assert_array_equal(f[i], whole[i])
            idx = np.array(data.draw(st.lists(st.integers(-n, n - 1), max_size=8)), dtype=np.int64)
            np.testing.assert_array_equal(f[idx], whole[idx])
            if tail:
                np.testing.assert_array_equal(f[i, 1], whole[i, 1])
            w0, w1 = sorted((data.draw(st.integers(0, n)), data.draw(st.integers(0, n))))
            np.testing.assert_array_equal(np.asarray(f.window(w0, w1)), whole[w0:w1])
            with pytest.raises(IndexError):
                f[n]
        assert stats.bytes <= whole.nbytes + granule  # never a granule twice
        np.testing.assert_array_equal(np.asarray(f), whole)
        assert stats.bytes == whole.nbytes
        np.testing.assert_array_equal(list(f), list(whole))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-5, 40), max_size=200), st.lists(st.integers(-7, 45), max_size=6),
       st.sampled_from(["left", "right"]))  # fmt: skip
def test_searchsorted_of_a_fetched_array_is_numpys_and_reads_a_few_granules(values, probes, side):
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fetched, "GRANULE", 16)
        whole = np.sort(np.array(values, dtype=np.int64))
        stats = Fetches()
        f = _stored(whole, stats, folder)
        np.testing.assert_array_equal(np.searchsorted(f, probes, side=side), np.searchsorted(whole, probes, side=side))
        if probes:
            assert np.searchsorted(f, probes[0], side=side) == np.searchsorted(whole, probes[0], side=side)
        # a binary search per probe: a granule per step, not the whole array
        steps = len(probes) * (int(np.log2(max(1, len(whole)))) + 2)
        assert stats.bytes <= min(whole.nbytes, steps * 16)


def test_offsets_of_fetched_ranges_read_as_one_without_fetching_them(tmp_path, monkeypatch):
    # ``concat_offsets`` drops each piece's last entry as a window: joining the pieces of a
    # published plan must not read them.
    monkeypatch.setattr(_fetched, "GRANULE", 64)
    a, b = np.arange(0, 101, dtype=np.int64), np.arange(100, 301, dtype=np.int64)
    stats = Fetches()
    c = concat_offsets([_stored(a, stats, str(tmp_path)), _stored(b, stats, str(tmp_path))])
    assert isinstance(c, Concat) and stats.bytes == 0
    np.testing.assert_array_equal(c[95:105], np.arange(95, 105))
    assert np.searchsorted(c, 150) == 150 and int(c[-1]) == 300
    assert stats.bytes <= 64 * 12
    np.testing.assert_array_equal(np.asarray(c), np.arange(301))


def test_threads_reading_one_fetched_array_at_once_fetch_each_granule_once(tmp_path, monkeypatch):
    # The index writer's and the copy's threads read one array at once: a granule another thread
    # is fetching is waited for, not fetched again, and nobody reads it half-written.
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(_fetched, "GRANULE", 64)
    whole = np.arange(20_000, dtype=np.int64) * 7
    stats = Fetches()
    f = _stored(whole, stats, str(tmp_path))
    rng = np.random.default_rng(0)
    spans = [(int(a), int(a) + int(n)) for a, n in zip(rng.integers(0, 20_000, 400), rng.integers(1, 300, 400), strict=True)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda s: np.array(f[s[0] : s[1]]), spans))
    for (a, b), g in zip(spans, got, strict=True):
        np.testing.assert_array_equal(g, whole[a:b])
    np.testing.assert_array_equal(np.asarray(f), whole)
    assert stats.bytes == whole.nbytes  # every granule fetched once, whoever fetched it


def test_prefetch_reads_spans_of_several_arrays_in_one_read(tmp_path, monkeypatch):
    # The copy's gathers of a chunk's rows from four arrays of the plan: one read_into, so an
    # object store fetches them at once; what it fetched is not fetched again.
    monkeypatch.setattr(_fetched, "GRANULE", 64)
    st_ = Storage(f"memory://prefetch-{uuid.uuid4().hex}")
    arrays, wholes = [], []
    stats = Fetches()
    for k in range(4):
        whole = np.arange(1000, dtype=np.int64) + 1000 * k
        st_.put(f"a{k}", whole.tobytes())
        arrays.append(fetched(st_, f"a{k}", whole.dtype, whole.shape, str(tmp_path / f"a{k}"), stats))
        wholes.append(whole)
    calls = []
    read_into = type(st_).read_into
    monkeypatch.setattr(type(st_), "read_into", lambda self, p, out: (calls.append(len(p)), read_into(self, p, out)))
    two = Concat([arrays[2], arrays[3]])  # a Concat of fetched pieces: its pieces' spans
    _fetched.prefetch([(arrays[0], 100, 200), (arrays[1], -5, 50), (two, 990, 1010), (np.zeros(3), 0, 3)])
    assert len(calls) == 1 and calls[0] >= 4
    fetched_bytes = stats.bytes
    np.testing.assert_array_equal(arrays[0][100:200], wholes[0][100:200])
    np.testing.assert_array_equal(arrays[1][0:50], wholes[1][0:50])
    np.testing.assert_array_equal(two[990:1010], np.concatenate([wholes[2][990:], wholes[3][:10]]))
    assert len(calls) == 1 and stats.bytes == fetched_bytes  # nothing fetched twice
