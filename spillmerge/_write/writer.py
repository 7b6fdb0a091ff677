"""SpillWriter: each rank appends frames to its own segment under the spill root.

Protocol:
  (every rank)   __enter__ → write/update ... → __exit__ (commit record last) → merge(out)
  (merging rank) merge waits for every rank's commit record, moves the shards of ranks whose
                 storage it cannot see over torch.distributed, then merges (the round: _dist/round.py).
"""

from __future__ import annotations

import array
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import DuplicateFrameError, SpillValueError, WriterClosedError
from .._format import common as F
from .._format import spill as FS
from .._util.gcpause import gc_paused
from .batch import at_position, batch_keys, cuda_to_host, dense_columns, mapping_items, nest, split_batch
from .columns import first_leaves, flat_columns, flatten_items
from .flatten import array_bytes, flatten, flatten_dense
from .leaves import Leaf, check_filename, check_frame_idx, same_leaves
from .lifecycle import MergeSteps
from .segment import WriterState
from .templates import DenseTemplate, FrameTemplate, PyTemplate


class SpillWriter(MergeSteps):
    """Append ``(filename, frame_idx) -> value`` predictions of one rank to a spill root.

    ``root`` is a local path or an fsspec URL; every rank of a job uses the same root and writes
    only below ``root/rank-RRRRR/``. Use it as a context manager; leaving the ``with`` block writes
    the commit record (or a failure record when the block raised). Then every rank calls
    :meth:`merge`.

    Threads may share a writer: ``open``, ``write``, ``write_batch``, ``update``, ``close`` and
    ``abort`` take turns under one lock, so every call's frames are staged whole (writes of
    several threads interleave call by call; under ``on_duplicate="first"`` / ``"last"`` the order
    they got the lock decides). A thread writing after another left the ``with`` block gets
    :class:`~spillmerge.WriterClosedError`; what was committed stays as committed.

    Args:
        root: spill root (local path or fsspec URL).
        rank, world_size: default to torch.distributed when initialised, else env ``RANK`` /
            ``WORLD_SIZE``, else 0 / 1.
        storage_options: passed to fsspec for ``root``.
        chunk_bytes: size of each data chunk object (default 16 MiB).
        staging_bytes: host memory for staging chunks (default 4 chunks); ``write`` blocks while
            all of it waits for storage.
        on_duplicate: ``"error"`` (default: a key written again with different bytes raises
            :class:`~spillmerge.DuplicateFrameError`; the same bytes again are kept once, see
            :meth:`stats`), ``"first"`` (ignore later writes of a key) or ``"last"`` (a later write
            replaces the earlier one).
        run_id: id shared by all ranks of a job run; defaults to the launcher's id.
        fsync: on local disks, fsync each data chunk before a journal entry names it (the chunks
            written since the last fsync together, with their folder) and every other object of
            the segment before the commit record (default True).
        flush_threads: chunk uploads in flight (default 2 on local disks; 4 on object stores).
        allow_pickle: store values of no other kind (docs/FORMAT.md section 1) as pickled bytes
            instead of refusing them with :class:`~spillmerge.SpillValueError`; reading them back
            needs ``spillmerge.open(out, allow_pickle=True)``. Off by default: nothing is pickled
            unless both sides opt in.
        expected: frames the whole job (all ranks) will write, if known; recorded in the segment
            header so that ``spillmerge status`` can estimate the end.
    """

    # ---------------------------------------------------------------------------------- write
    def write(self, filename: str, frame_idx: int, value: Any) -> None:
        """Append one frame. Copies the value into a staging buffer (on a local disk, large host
        frames straight into their chunk file) and returns: the caller may change the value at
        once. Blocks only while every staging buffer (or as many chunk files) waits for storage.
        A batch of items goes faster through :meth:`write_batch`."""
        with self._lock, self._staging_rows():  # one call at a time: the writer may be shared by threads
            filename = check_filename(filename)
            common = type(frame_idx) is int and 0 <= frame_idx < (1 << 63)  # needs no general check
            frame = frame_idx if common else check_frame_idx(frame_idx, filename)
            new_dict = type(value) is dict and filename not in self._file_ids
            if new_dict:  # a new file of the last one's structure, or of the last Python dict's
                for t in (self._frame_template, self._py_template):
                    got = t.match(value, self._catalog) if t is not None else None
                    if got is not None:
                        self._put_new(filename, frame, *got)
                        return
            leaves = flatten_dense(value)  # the common value, without the general walk
            dense = leaves is not None
            if leaves is None:
                leaves = flatten(value, filename, frame, self.allow_pickle)
            layout_ids = self._put(filename, frame, leaves, self._catalog.layouts_of(leaves))
            if new_dict and layout_ids is not None:  # the next new file of this structure takes the template
                if dense:
                    self._frame_template = FrameTemplate.of(leaves, layout_ids)
                else:
                    self._py_template = PyTemplate.of(value, leaves, layout_ids) or self._py_template

    @contextlib.contextmanager
    def _staging_rows(self) -> Iterator[None]:
        """Stage frames of an open writer, the lock held. A failure after they took index rows
        (their bytes half staged: a full disk, an interrupt) fails the writer at once: its index
        would not match its bytes, so the segment must never commit."""
        if self._state is WriterState.NEW:
            raise WriterClosedError(
                f"SpillWriter for rank {self.rank} was never opened: call `open()` first, or use "
                "`with SpillWriter(...) as w:` (it opens, commits on success and records a failure)"
            )
        if self._state is not WriterState.OPEN:
            raise WriterClosedError(
                f"SpillWriter for rank {self.rank} is {self._state}: it takes no more writes; write inside "
                "`with SpillWriter(...) as w:`, or create a new writer (it starts a new segment)"
            )
        self._staging.check()
        rows = self._n_rows
        try:
            yield
        except BaseException as exc:
            if self._n_rows != rows:
                self._abort(exc)
            raise

    def _put_new(
        self, filename: str, frame: int, data: bytes | list[np.ndarray], sizes: Any, total: int,
        layout_ids: tuple[int, ...],
    ) -> None:  # fmt: skip
        """``_put`` of a frame of a new file whose value matched a template (``FrameTemplate``:
        each leaf's bytes; ``PyTemplate``: the leaves' bytes joined), of the template's catalog
        ids."""
        file_id = len(self._filenames)
        self._filenames.append(filename)
        self._file_ids[filename] = file_id
        first_row = self._n_rows
        self._n_rows = first_row + len(sizes)
        self._staging.add_host_frame(first_row, file_id, frame, layout_ids, data, sizes, total)
        self._new_keys.extend((file_id, frame, first_row, len(sizes)))

    def write_batch(self, filenames: Sequence[str], batch: Any, frame_idx: Any = None) -> None:
        """Append one frame per item of a batched output: item ``i`` is stored exactly as
        ``write(filenames[i], frame_idx[i], item_i)`` would store it.

        ``filenames``: one str per item. ``frame_idx``: None (every item is frame 0: an image or a
        document needs no frame index), or a sequence / 1-d tensor of ints, one per item.
        ``batch``: a tensor or array whose first dimension is the batch; a list with one value per
        item (the per-image dicts torchvision detection returns, strings, ragged tensors); or a
        dict / TensorDict / dataclass of those, nested to any depth (item ``i`` is then the dict
        of each leaf's item ``i``).

        The whole batch is checked before any byte of it is staged: a leaf of the wrong length or
        not batched, a filenames or frame_idx list of the wrong length, a value of a kind the
        writer refuses, a layout change or a duplicate key raises :class:`~spillmerge.SpillValueError`
        (or its subclass) naming the leaf, the batch position and the filename, and nothing of
        that batch is written; everything written before it is kept.

        A batch of CUDA tensors of at most 16 MiB in all is copied to host memory one tensor at a
        time and waited for, as ``.cpu()`` would; a larger one is copied item by item, without
        waiting (see ``_write.batch.cuda_to_host``).
        """
        with self._lock, self._staging_rows():  # one call at a time: the writer may be shared by threads
            names, frames = batch_keys(filenames, frame_idx)
            batch = cuda_to_host(batch)
            dense = dense_columns(batch, len(names))
            if dense is not None and self._put_dense(names, frames, dense):
                return
            self._put_items(names, frames, split_batch(batch, names), records=type(batch) is list)

    def _put_items(
        self, names: list[str], frames: list[int], items: list[Any], *, records: bool, positions: bool = True
    ) -> None:
        """Stage the values ``items`` (``write_batch``'s split batch, ``update``'s values), the
        whole call checked first; ``records``: try the dict-records path first. ``positions``: an
        error names the item's batch position (``update``'s say what ``write``'s say)."""
        if records and self._put_records(names, frames, items, positions):
            return
        for name, frame, leaves, layouts in gc_paused(self._check_batch, names, frames, items, positions):
            self._put(name, frame, leaves, layouts)

    def _put_dense(self, names: list[str], frames: list[int], columns: dict[tuple[str, ...], Any]) -> bool:
        """The vectorised ``write_batch`` of a batch of host tensors / arrays: every item has the
        same layouts, so item 0 is flattened and checked for all, and the bytes and journal rows
        of the frames are made a block at a time (``Staging.add_frames``), the same as
        item-by-item writes make them. False (nothing done) when a key of the batch was written
        before or repeats in it: the item-by-item path applies the duplicate policy."""
        n = len(names)
        base = len(self._filenames)
        # The common batch: n files never written before, each once. Their ids are the next n and
        # no key can repeat.
        fresh = self._file_ids.keys().isdisjoint(names) and len(set(names)) == n
        file_ids: list[int] = []
        new_names: dict[str, int] = {}
        if not fresh:
            for name in names:
                fid = self._file_ids.get(name)
                file_ids.append(new_names.setdefault(name, base + len(new_names)) if fid is None else fid)
            keys = list(zip(file_ids, frames, strict=True))
            if len(set(keys)) != n or not self._key_map().keys().isdisjoint(keys):
                return False
        template = self._dense_template(names, frames, columns)
        if template is None:
            return False
        data = [array_bytes(columns[path]) for path in template.paths]  # each leaf's items back to back
        ids = self._catalog.accept(template.layouts, self._catalog.ids(template.layouts))  # cached by key
        layout_ids = np.tile(np.array(ids, dtype=np.int64), (n, 1))
        sizes = np.tile(np.array([len(d) // n for d in data], dtype=np.int64), (n, 1))
        if fresh:
            row0 = self._add_keys(names, range(base, base + n), frames, len(data))
        else:
            row0 = self._add_keys(list(new_names), file_ids, frames, len(data))
        fids = base if fresh else np.array(file_ids, dtype=np.int64)
        self._staging.add_frames(row0, fids, _frame_array(frames), layout_ids, sizes, data)
        return True

    def _add_keys(self, new: list[str], file_ids: Sequence[int], frames: list[int], n_leaves: int) -> int:
        """File a checked batch's frames of new keys (``new``: its filenames not written before,
        ids from the next one; the keys go to ``_fresh_keys``); returns their first row."""
        base = len(self._filenames)
        self._filenames.extend(new)
        self._file_ids.update(zip(new, range(base, base + len(new)), strict=True))
        row0 = self._n_rows
        self._n_rows += len(frames) * n_leaves
        self._fresh_keys.append((file_ids, frames, row0, n_leaves))
        return row0

    def _put_records(self, names: list[str], frames: list[int], items: list[Any], positions: bool) -> bool:
        """``write_batch`` of dicts into new files a column at a time (``_write.columns.flat_columns``):
        the first item taken is flattened and checked for all (the others' leaves differ from its
        leaves only in their first dimension), and each length's layout joins the catalog once.
        Items holding an empty list are checked before anything is staged and staged after, item
        by item. False (nothing done) when a filename was written before or repeats, or the items
        are not such dicts."""
        n, base = len(names), len(self._filenames)
        if n < 2 or not self._file_ids.keys().isdisjoint(names) or len(set(names)) != n:
            return False
        cols = flat_columns(items)
        leaves = first_leaves(cols, items, names) if cols is not None else None
        if cols is None or leaves is None:
            return False  # the item-by-item way says what is wrong, naming the item
        kept = cols.kept
        layouts = self._catalog.layouts_of(leaves)
        others = []
        for i in sorted(set(range(n)) - set(kept)):  # checked before any byte of the batch is staged
            item_leaves = self._item_leaves(items[i], i, names, frames, positions)
            others.append((names[i], frames[i], item_leaves, self._catalog.layouts_of(item_leaves)))
        self._catalog.accept(layouts, self._catalog.ids(layouts))
        layout_ids = np.empty_like(cols.lengths)
        for j, lay in enumerate(layouts):
            if lay.dtype == "strlist":  # shape (strings, bytes)
                pairs = np.stack([cols.lengths[:, j], cols.sizes[:, j]], axis=1)
                found, where = np.unique(pairs, axis=0, return_inverse=True)
                shapes = [(m, nb) for m, nb in found.tolist()]
            else:  # a length of -1: a 0-d leaf
                found, where = np.unique(cols.lengths[:, j], return_inverse=True)
                shapes = [() if m < 0 else (m, *lay.shape[1:]) for m in found.tolist()]
            ids = self._catalog.shape_ids(lay, shapes)
            layout_ids[:, j] = np.asarray(ids, dtype=np.int64)[where.reshape(-1)]
        if len(kept) < n:
            names, frames = [names[i] for i in kept], [frames[i] for i in kept]
        row0 = self._add_keys(names, range(base, base + len(names)), frames, len(leaves))
        self._staging.add_frames(row0, base, _frame_array(frames), layout_ids, cols.sizes, cols.data)
        for name, frame, item_leaves, item_layouts in others:
            self._put(name, frame, item_leaves, item_layouts)
        return True

    def _dense_template(
        self, names: list[str], frames: list[int], columns: dict[tuple[str, ...], Any]
    ) -> DenseTemplate | None:
        """The leaves every item of a dense batch has (item 0 flattened and checked for all),
        made once per distinct (leaf paths, array kinds, dtypes, item shapes): what ``flatten``
        checks and yields depends on nothing else, so a batch like the previous one skips it.
        None when the batch holds leaves the vectorised path does not stage."""
        sig = tuple([(path, type(col), col.dtype, tuple(col.shape[1:])) for path, col in columns.items()])
        template = self._dense_templates.get(sig)
        if template is not None:
            return template
        item0 = nest({path: col[0] for path, col in columns.items()})
        leaves = self._item_leaves(item0, 0, names, frames)
        if len(leaves) != len(columns) or any(leaf.dtype in ("pickle", "str", "bytes") for leaf in leaves):
            return None
        by_leaf = {tuple([F.user_key(k) for k in path]): path for path in columns}  # keys as flatten escapes them
        paths = [by_leaf.get(leaf.path) for leaf in leaves]
        if None in paths:
            return None
        template = DenseTemplate(tuple(paths), self._catalog.layouts_of(leaves))  # type: ignore[arg-type]
        if len(self._dense_templates) < 256:  # bounded: batches of ever new shapes take the slow way
            self._dense_templates[sig] = template
        return template

    def _item_leaves(
        self, item: Any, i: int, names: list[str], frames: list[int], positions: bool = True
    ) -> list[Leaf]:
        """``flatten`` of item ``i`` of a batch, whose error names the item's position (with
        ``positions``: ``update()``'s keep ``write()``'s words)."""
        try:
            return flatten(item, names[i], frames[i], self.allow_pickle)
        except SpillValueError as exc:
            raise at_position(exc, i, len(names), names[i]) if positions else exc from None

    def _key_map(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Every key written so far -> (first row, n rows)."""
        for file_ids, frames, row0, n_leaves in self._fresh_keys:
            n = len(frames)
            spans = zip(range(row0, row0 + n * n_leaves, n_leaves), [n_leaves] * n, strict=True)
            self._keys.update(zip(zip(file_ids, frames, strict=True), spans, strict=True))
        self._fresh_keys.clear()
        if self._new_keys:
            log = np.frombuffer(self._new_keys, dtype=np.int64).reshape(-1, 4).tolist()
            self._keys.update(((f, fr), (r, n)) for f, fr, r, n in log)
            self._new_keys = array.array("q")
        return self._keys

    def _check_batch(
        self, names: list[str], frames: list[int], items: list[Any], positions: bool
    ) -> list[tuple[str, int, list[Leaf], list[FS.Layout]]]:
        """Flatten every item and run what ``_put`` would check (the duplicate policy), in
        batch order, against the writer's state as the earlier items of the batch
        leave it, without changing anything: the batch is refused whole or staged whole."""
        out: list[tuple[str, int, list[Leaf], list[FS.Layout]]] = []
        new_ids: dict[str, int] = {}
        in_batch: dict[tuple[int, int], list[Leaf]] = {}  # key -> leaves of its last accepted item
        by_column = flatten_items(items, names)  # items of one structure: a column at a time
        for i, (name, frame, item) in enumerate(zip(names, frames, items, strict=True)):
            try:
                if by_column is not None:
                    leaves = by_column[i]
                else:  # the common value without the general walk, as write()'s
                    leaves = flatten_dense(item) or flatten(item, name, frame, self.allow_pickle)
                file_id = self._file_ids.get(name)
                if file_id is None:
                    file_id = new_ids.setdefault(name, len(self._filenames) + len(new_ids))
                layouts = self._catalog.layouts_of(leaves)  # cached per frame shape, as _put's
                key = (file_id, frame)
                earlier = in_batch.get(key)
                # (a file the writer has not written yet has no key yet: no lookup)
                dup = earlier is not None or (file_id < len(self._filenames) and key in self._key_map())
                if dup and self.on_duplicate == "error":
                    if earlier is not None:
                        same = same_leaves(earlier, leaves)
                    else:
                        same = self._same_as_written(self._key_map()[key], leaves, self._catalog.ids(layouts))
                    if not same:
                        raise self._duplicate(name, frame)
            except SpillValueError as exc:
                raise at_position(exc, i, len(names), name) if positions else exc from None
            if not dup or self.on_duplicate == "last":  # "first" and an identical copy keep the earlier one
                in_batch[key] = leaves
            out.append((name, frame, leaves, layouts))
        return out

    def _put(self, filename: str, frame: int, leaves: list[Leaf], layouts: list[FS.Layout]) -> tuple[int, ...] | None:
        """Stage one checked frame (``layouts``: its leaves' ``LayoutCatalog.layouts_of``): the
        duplicate policy, then its rows. Returns the frame's catalog layout ids, or None when the
        duplicate policy kept the earlier copy."""
        file_id = self._file_ids.get(filename, len(self._filenames))
        layout_ids = self._catalog.ids(layouts)  # -1: not in the catalog yet
        key = (file_id, frame)
        # A file never written has no key yet (its id is the next one).
        prev = self._key_map().get(key) if file_id < len(self._filenames) else None
        if prev is not None:
            if self.on_duplicate == "error":
                if not self._same_as_written(prev, leaves, layout_ids):
                    raise self._duplicate(filename, frame)
                self._identical_rewrites += 1  # identical content is never an error
            self._rewrites += 1  # whatever the policy keeps
            if self.on_duplicate != "last":  # "first", and an identical copy: the earlier one stays
                return None
            self._dead_rows.append(prev)  # "last": the earlier copy is dropped
        layout_ids = self._catalog.accept(layouts, layout_ids)
        new_file = file_id == len(self._filenames)
        if new_file:
            self._filenames.append(filename)
            self._file_ids[filename] = file_id
        first_row, n_leaves = self._n_rows, len(leaves)
        self._n_rows += n_leaves
        self._staging.add_frame(first_row, file_id, frame, layout_ids, leaves)
        if new_file:
            self._new_keys.extend((file_id, frame, first_row, n_leaves))  # looked up only later, if ever
        else:
            self._keys[key] = (first_row, n_leaves)
        return layout_ids

    def _duplicate(self, filename: str, frame: int) -> DuplicateFrameError:
        return DuplicateFrameError(
            f"frame {frame} of {filename!r:.200} was already written by rank {self.rank} "
            "(pass on_duplicate='first' or 'last' to allow rewrites)",
            filename=filename,
            frame_idx=frame,
            ranks=[self.rank],
        )

    def update(self, mapping: Mapping[str, Any]) -> None:
        """Write many frames: ``{filename: (frame_idx, value)}`` or ``{filename: {frame_idx: value}}``,
        each as :meth:`write` would, in one call (other threads' calls wait for it). The whole
        call is checked before any frame of it is staged, as :meth:`write_batch`'s: a bad key or
        value, or a duplicate the policy refuses, raises the error :meth:`write` would, and nothing
        of that call is written; everything written before it is kept."""
        with self._lock, self._staging_rows():
            keys = list(mapping_items(mapping))
            names = [check_filename(name) for name, _, _ in keys]
            frames = [check_frame_idx(frame, name) for name, (_, frame, _) in zip(names, keys, strict=True)]
            values = [value for _, _, value in keys]
            self._put_items(names, frames, values, records=True, positions=False)

    def _same_as_written(self, prev: tuple[int, int], leaves: list[Leaf], layout_ids: tuple[int, ...]) -> bool:
        """Do ``leaves`` hold the same bytes (and layouts) as the frame already written at rows
        ``prev``? Only a rewrite of a key gets here; staging reads the earlier bytes back."""
        self._sync_rows()
        first, n = prev
        if n != len(leaves):
            return False
        staged: list[tuple[int, Any, int]] = []
        for i, leaf in enumerate(leaves):
            lid, off, nbytes = (int(v) for v in self._rows[first + i, [FS.COL_LAYOUT, FS.COL_OFFSET, FS.COL_NBYTES]])
            if nbytes != leaf.nbytes or lid != layout_ids[i]:  # same bytes, other shape/kind: different
                return False
            staged.append((off, leaf.data, nbytes))
        return self._staging.same_bytes(staged)


def _frame_array(frames: list[int]) -> np.ndarray | None:
    """A batch's frame indices as int64, None when all are 0 (``Staging.add_frames``)."""
    return np.array(frames, dtype=np.int64) if any(frames) else None
