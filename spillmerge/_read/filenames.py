"""The filenames of an open output as a sequence (``MergedStore.filenames``): opening reads the
block heads only, a lookup bisects them and reads one block through the chunk cache, and a block is
checked (offsets, UTF-8, strictly ascending, bounded by its heads) when it is first read."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._format import invariants as V
from .._storage import Storage
from .cache import ChunkCache, Chunks
from .index import LazyArray, Raise


def decode_names(raw: np.ndarray, offsets: np.ndarray, rel: str) -> tuple[np.ndarray, list[V.Problem]]:
    """Names from UTF-8 bytes ``raw`` and their offsets (relative to ``raw``, already checked to
    rise within it): an object array, and what breaks the text rules (each valid UTF-8)."""
    data = raw.tobytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return np.empty(0, dtype=object), [(rel, f"a filename is not valid UTF-8 ({exc.reason} at byte {exc.start})")]
    starts = offsets[:-1][np.diff(offsets) > 0]
    # The whole is valid UTF-8; each name is too when none starts inside a character.
    if len(starts) and np.any((raw[starts] & 0xC0) == 0x80):
        return np.empty(0, dtype=object), [(rel, "a filename is not valid UTF-8 (starts inside a character)")]
    bounds = offsets.tolist()
    names = np.empty(len(bounds) - 1, dtype=object)
    names[:] = [data[a:b].decode("utf-8") for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return names, []


class Names(Sequence[str]):
    """Sorted, distinct filenames, read block by block on demand (module docstring): ``len``,
    ``names[i]``, ``names[a:b]`` (a list), iteration in order, ``in``, and :meth:`find` (a
    position or None). Equal to any sequence of the same names."""

    def __init__(self, group: Any, cache: ChunkCache, raise_: Raise, storage: Storage) -> None:
        describe = storage.describe
        self._raise = raise_
        self._bytes = V.index_node(group, "filenames", describe)
        self._off = V.index_node(group, "filename_offsets", describe)
        for rel, node, dt in (
            ("index/filenames", self._bytes, np.uint8),
            ("index/filename_offsets", self._off, np.int64),
        ):
            if node.dtype != dt:
                raise_([(rel, f"expected {np.dtype(dt)}, got {node.dtype}")])
        n_off = int(self._off.shape[0])
        if n_off < 1:
            raise_([("index/filename_offsets", "empty (must have n_files + 1 entries)")])
        self._n = n_off - 1
        self._nbytes = int(self._bytes.shape[0])
        # read a chunk at a time through the cache (no row checks: a block's own checks are below)
        self._offs = LazyArray(self._off, cache, storage)
        self._raw = LazyArray(self._bytes, cache, storage, dtype=np.uint8)
        heads_node = V.index_node(group, "filename_heads", describe)
        attrs = heads_node.attrs.get("spillmerge")
        k: Any = attrs.get("names_per_head") if isinstance(attrs, dict) else None  # names a block
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 1 << 20:
            raise_([("index/filename_heads", f"names_per_head {k!r:.50} is not an int from 1 to 2**20")])
        self._k: int = k
        heads_raw = LazyArray(heads_node, cache, storage, dtype=np.uint8).whole()
        rel = "index/filename_head_offsets"
        hoff = LazyArray(V.index_node(group, "filename_head_offsets", describe), cache, storage).whole()
        n_blocks = -(-self._n // self._k)
        if len(hoff) != n_blocks + 1:
            raise_([(rel, f"{len(hoff)} entries for {n_blocks} blocks of filenames (must be {n_blocks + 1})")])
        raise_(V.offsets_block_problems(rel, hoff, 0, True, len(heads_raw), "index/filename_heads"))
        heads, problems = decode_names(heads_raw, hoff, "index/filename_heads")
        raise_(problems)
        raise_(V.sorted_problems(heads, "index/filename_heads"))
        self._heads: list[str] = heads.tolist()
        self._next = 0
        # block(j): the names of block j (files j*K .. (j+1)*K - 1), checked on first read, cached
        self.block = Chunks(cache, "filenames", self._load)
        self._in_order: tuple[int, list[str]] = (-1, [])
        """(block, its names as str) of the block files are being read in order from (``find``'s
        hint hit): comparing and returning a Python str costs less than a numpy element."""
        if self._n:  # one block, so a small output is checked whole at open (a large one as read)
            self.block(0)

    def __len__(self) -> int:
        return self._n

    def _load(self, j: int) -> np.ndarray:
        k, n = self._k, self._n
        a, b = j * k, min((j + 1) * k, n)
        offs = self._offs.span(a, b + 1)
        self._raise(V.offsets_block_problems("index/filename_offsets", offs, a, b == n, self._nbytes, "index/filenames"))
        lo, hi = int(offs[0]), int(offs[-1])
        raw = self._raw.span(lo, hi)
        names, problems = decode_names(raw, offs - lo, "index/filenames")
        self._raise(problems)
        self._raise(V.sorted_problems(names, "index/filenames"))
        if len(names) and names[0] != self._heads[j]:
            what = f"entry {j} is {self._heads[j]!r:.200}, but block {j} starts with {names[0]!r:.200}"
            self._raise([("index/filename_heads", what)])
        if len(names) and j + 1 < len(self._heads) and not names[-1] < self._heads[j + 1]:
            what = f"not sorted: {names[-1]!r:.200} (entry {b - 1}) is not below the next block's first name"
            self._raise([("index/filenames", what)])
        names.setflags(write=False)
        return names

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(self._n)
            if step != 1:
                return [self[x] for x in range(a, b, step)]
            k = self._k
            blocks = range(a // k, (b - 1) // k + 1 if b > a else a // k)
            return [x for j in blocks for x in self.block(j)[max(a - j * k, 0) : b - j * k].tolist()]
        try:
            at = operator.index(i)
        except TypeError:
            raise TypeError(
                f"filenames are indexed by an int or a slice, not {type(i).__name__} {i!r} (find a filename's "
                "position with .index(name), or test it with `name in filenames`)"
            ) from None
        if at < 0:
            at += self._n
        if not 0 <= at < self._n:
            raise IndexError(f"filename {i} of {self._n}")
        j, r = divmod(at, self._k)
        hot = self._in_order
        return hot[1][r] if hot[0] == j else str(self.block(j)[r])

    def __iter__(self) -> Iterator[str]:
        for j in range(len(self._heads)):
            yield from self.block(j).tolist()

    def find(self, name: object) -> int | None:
        if not isinstance(name, str):
            return None
        k = self._k
        i = self._next  # files are most often read in order
        if i < self._n:
            j, r = divmod(i, k)
            hot = self._in_order
            if hot[0] == j:
                if hot[1][r] == name:
                    self._next = i + 1
                    return i
            elif self.block(j)[r] == name:  # in order into a new block: its names as str, once
                self._in_order = (j, self.block(j).tolist())
                self._next = i + 1
                return i
        j = bisect.bisect_right(self._heads, name) - 1
        if j < 0:
            return None
        names = self.block(j)
        p = int(np.searchsorted(names, name))
        if p < len(names) and names[p] == name:
            self._next = j * k + p + 1
            return j * k + p
        return None

    def __contains__(self, name: object) -> bool:
        return self.find(name) is not None

    def index(self, name: Any, start: int = 0, stop: int | None = None) -> int:
        i = self.find(name)
        if i is None or i < start or (stop is not None and i >= stop):
            raise ValueError(f"{name!r} is not a filename")
        return i

    def count(self, name: Any) -> int:
        return int(self.find(name) is not None)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Sequence, np.ndarray)) and not isinstance(other, str):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(repr(x) for x in self[: min(n, 3)])
        return f"[{head}{', ...' if n > 3 else ''}] ({n} filenames)"


def close_matches(names: Names, name: object) -> list[str]:
    """At most 3 filenames a mistyped ``name`` was likely meant as, among its neighbours in sort
    order: the fewest typos away, if that is few (one edit per 20 characters plus one, at most 3;
    a swap of two neighbouring characters is one edit). A name that only shares a prefix
    (``img_0.jpg`` and ``img_00039.jpg``) is not one; names over 256 characters get none."""
    if not isinstance(name, str) or not len(names) or len(name) > 256:
        return []
    block = names.block(max(bisect.bisect_right(names._heads, name) - 1, 0))
    p = int(np.searchsorted(block, name))
    near = block[max(0, p - 50) : p + 50].tolist()
    limit = min(3, 1 + len(name) // 20)
    scored = sorted((d, c) for c in near if (d := _edits(name, c, limit)) <= limit)
    return [c for d, c in scored[:3] if d == scored[0][0]]


def _edits(a: str, b: str, limit: int) -> int:
    """The edit distance of ``a`` and ``b`` (insertions, deletions, substitutions and swaps of
    neighbouring characters), or ``limit + 1`` once it is known to exceed ``limit``: only cells
    within ``limit`` of the diagonal are computed."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    far = limit + 1
    prev2: list[int] = []
    prev = [j if j <= limit else far for j in range(len(b) + 1)]
    for i in range(1, len(a) + 1):
        cur = [i if i <= limit else far] + [far] * len(b)
        for j in range(max(1, i - limit), min(len(b), i + limit) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            d = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d = min(d, prev2[j - 2] + 1)
            cur[j] = min(d, far)
        if min(cur) > limit:
            return far
        prev2, prev = prev, cur
    return prev[-1]
