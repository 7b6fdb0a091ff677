"""SpillWriter: each rank appends frames to its own segment under the spill root.

Protocol:
  (every rank)   __enter__ → write/update ... → __exit__ (commit record last) → merge(out)
  (merging rank) merge waits for every rank's commit record, moves the shards of ranks whose
                 storage it cannot see over torch.distributed, then merges (the round: _dist/round.py).

The writer keeps rows (the index it commits); opening, committing and aborting its segment are
``_write.segment.SegmentSteps``', the per-file leaf rule ``_write.layouts.FileSchemas``, the byte
and CUDA copies into staging ``_write.staging.Staging``.
"""

from __future__ import annotations

import array
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from .._dist.rank import resolve_rank
from .._dist.round import Rounds
from .._errors import DuplicateFrameError, SpillValueError, WriterClosedError
from .._format import common as F
from .._format import spill as FS
from .._format.common import user_key
from .._storage import Storage
from .batch import as_rows, at_position, batch_keys, cuda_to_host, dense_columns, flat_rows, mapping_items, split_batch
from .columns import flatten_items
from .flatten import flatten, flatten_dense
from .leaves import Leaf, check_filename, check_frame_idx
from .lifecycle import MergeSteps, WriterState
from .segment import SegmentSteps
from .staging import Staging
from .templates import DenseTemplate, FrameTemplate

DuplicatePolicy = Literal["error", "first", "last"]
_POLICIES = ("error", "first", "last")


class SpillWriter(SegmentSteps, MergeSteps):
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

    _flush_at_commit = False
    """Start the flush thread only once a chunk fills (``Staging.start``'s ``at_commit``): a
    subclass for short-lived writers (the drop-ins) whose bytes usually fit in one chunk."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        chunk_bytes: int = F.DEFAULT_CHUNK_BYTES,
        staging_bytes: int | None = None,
        on_duplicate: DuplicatePolicy = "error",
        run_id: str | None = None,
        fsync: bool = True,
        flush_threads: int | None = None,
        allow_pickle: bool = False,
        expected: int | None = None,
    ) -> None:
        if on_duplicate not in _POLICIES:
            raise SpillValueError(f"on_duplicate must be one of {_POLICIES}, got {on_duplicate!r}")
        if not isinstance(chunk_bytes, int) or not 4096 <= chunk_bytes <= (1 << 32):
            raise SpillValueError(f"chunk_bytes must be an int in [4096, 2**32], got {chunk_bytes!r}")
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.storage = Storage(root, storage_options)
        self.root = self.storage.url
        self.chunk_bytes = chunk_bytes
        self.flush_threads = flush_threads or (2 if self.storage.local else 4)
        if not isinstance(self.flush_threads, int) or self.flush_threads < 1:
            raise SpillValueError(f"flush_threads must be a positive int, got {flush_threads!r}")
        staging = staging_bytes if staging_bytes is not None else 4 * chunk_bytes
        self.n_buffers = max(2, -(-staging // chunk_bytes))
        self.on_duplicate: DuplicatePolicy = on_duplicate
        self.fsync = fsync
        self.allow_pickle = bool(allow_pickle)
        if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool) or expected < 0):
            raise SpillValueError(f"expected must be a number of frames >= 0 or None, got {expected!r}")
        self.expected = expected
        self._run_id_arg = run_id
        self.run_id: str | None = None
        self.segment: str | None = None
        self._state = WriterState.NEW
        self._staging = Staging(chunk_bytes, self.n_buffers)
        self._rounds = Rounds()
        self._lock = threading.Lock()
        """Held by every call that changes the segment (open, write, write_batch, close, abort):
        threads sharing the writer take turns, a call at a time."""

    # ---------------------------------------------------------------------------------- write
    def write(self, filename: str, frame_idx: int, value: Any) -> None:
        """Append one frame. Copies the value into a staging buffer and returns; blocks only while
        every staging buffer waits for storage. A batch of items goes faster through
        :meth:`write_batch`."""
        with self._lock:  # one call at a time: the writer may be shared by threads
            self._check_open()
            filename = check_filename(filename)
            if type(frame_idx) is int and 0 <= frame_idx < (1 << 63):  # the common index, without the general check
                frame = frame_idx
            else:
                frame = check_frame_idx(frame_idx, filename)
            template = self._frame_template
            if type(value) is dict and filename not in self._file_ids:
                if template is not None:
                    data = template.match(value)
                    if data is not None:  # a new file of the last new file's structure
                        self._put_templated(filename, frame, template, data)
                        return
                leaves = flatten_dense(value)  # the common value, without the general walk
                if leaves is not None:
                    layout_ids = self._put(filename, frame, leaves)
                    if layout_ids is not None:  # the next new file of this structure takes the template
                        schema = self._schema.schema_of(len(self._filenames) - 1)
                        self._frame_template = FrameTemplate.of(leaves, schema, layout_ids)
                    return
            else:
                leaves = flatten_dense(value)
            if leaves is None:
                leaves = flatten(value, filename, frame, self.allow_pickle)
            self._put(filename, frame, leaves)

    def _put_templated(self, filename: str, frame: int, template: FrameTemplate, data: list[np.ndarray]) -> None:
        """``_put`` of a frame of a new file whose value matched ``template``: the layout rule's
        move and the catalog ids are the template's; the index rows wait in ``_row_log``."""
        file_id = len(self._filenames)
        self._schema.accept_new_files(1, template.schema, [], template.layout_ids)
        self._filenames.append(filename)
        self._file_ids[filename] = file_id
        first_row = self._n_rows
        if self._row_log_template is not template or len(self._row_log) >= 4096:
            self._flush_row_log()
            self._row_log_template = template
        self._row_log.append((first_row, file_id, frame, self._staging.offset))
        self._n_rows = first_row + len(template.sizes)
        self._staging.add_host_frame(
            first_row, file_id, frame, template.layout_ids, data, template.sizes, template.total
        )
        self._keys[(file_id, frame)] = (first_row, len(template.sizes))

    def _flush_row_log(self) -> None:
        """Write the index rows of the frames ``_put_templated`` logged into ``_rows`` (every
        reader of ``_rows`` calls this first), a block at a time."""
        log, template = self._row_log, self._row_log_template
        if len(self._rows) < self._n_rows:
            grown = np.zeros((max(self._n_rows, 2 * len(self._rows)), FS.INDEX_COLUMNS), dtype=np.int64)
            grown[: len(self._rows)] = self._rows
            self._rows = grown
        if not log or template is None:
            return
        frames = np.array(log, dtype=np.int64)
        log.clear()
        rows = frames[:, :1] + np.arange(len(template.sizes), dtype=np.int64)  # (frames, leaves)
        self._rows[rows, FS.COL_FILE] = frames[:, 1:2]
        self._rows[rows, FS.COL_FRAME] = frames[:, 2:3]
        self._rows[rows, FS.COL_LAYOUT] = template.layout_ids
        self._rows[rows, FS.COL_OFFSET] = frames[:, 3:4] + template.starts
        self._rows[rows, FS.COL_NBYTES] = template.sizes

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
        with self._lock:  # one call at a time: the writer may be shared by threads
            self._check_open()
            names, frames = batch_keys(filenames, frame_idx)
            n = len(names)
            batch = cuda_to_host(batch)
            flat = flat_rows(batch, n) if type(batch) is dict and n else None
            if flat is not None:  # the common batch: a flat dict of host tensors, like an earlier one
                fast = self._flat_templates.get(flat[0])
                if fast is not None and self._put_fresh(names, frames, frame_idx is None, fast, flat[1]):
                    return
            dense = dense_columns(batch, n)
            if dense is not None and self._put_dense(names, frames, dense):
                if flat is not None:
                    self._learn_flat(flat[0])
                return
            items = split_batch(batch, names)
            checked = self._check_batch(names, frames, items)
            for name, frame, leaves, layouts in checked:
                self._put(name, frame, leaves, layouts)

    def _put_dense(self, names: list[str], frames: list[int], columns: dict[tuple[str, ...], Any]) -> bool:
        """The vectorised ``write_batch`` of a batch of host tensors / arrays: every item has the
        same layouts, so item 0 is flattened and checked for all, the layout rule runs once per
        file schema, and the bytes, index rows and journal entries of the frames are made a block
        at a time (``Staging.add_frames``), the same as item-by-item writes make them. False
        (nothing done) when a key of the batch was written before or repeats in it: the
        item-by-item path applies the duplicate policy."""
        self._flush_row_log()
        n = len(names)
        base = len(self._filenames)
        # The common batch: n files never written before, each once. Their ids are the next n, no
        # key can repeat, and every file's schema before the frame is the empty one.
        fresh = self._file_ids.keys().isdisjoint(names) and len(set(names)) == n
        file_ids: Any
        new_names: dict[str, int] = {}
        if fresh:
            file_ids = range(base, base + n)
        else:
            file_ids = []
            next_id = base
            for name in names:
                fid = self._file_ids.get(name)
                if fid is None:
                    fid = new_names.get(name)
                    if fid is None:
                        fid = new_names[name] = next_id
                        next_id += 1
                file_ids.append(fid)
            keys = list(zip(file_ids, frames, strict=True))
            known = self._key_map()
            if len(set(keys)) != n or (known and any(k in known for k in keys)):
                return False
        template = self._dense_template(names, frames, columns)
        if template is None:
            return False
        layouts = template.layouts
        # The layout rule: once per (file schema before the frame); a file may repeat with other frames.
        moves: dict[int, tuple[int, tuple[int, ...]]] = {}
        schemas: dict[int, int] = {}
        if fresh and template.fresh_move is not None:
            moves[0] = template.fresh_move
        elif fresh:
            try:
                moves[0] = self._schema.check(names[0], frames[0], base, layouts, 0)
            except SpillValueError as exc:
                raise at_position(exc, 0, n, names[0]) from None
        for i, (name, fid) in enumerate(zip(names, file_ids, strict=True)) if not fresh else ():
            cur = schemas.get(fid)
            if cur is None:
                cur = self._schema.schema_of(fid)
            move = moves.get(cur)
            if move is None:
                try:
                    move = moves[cur] = self._schema.check(name, frames[i], fid, layouts, cur)
                except SpillValueError as exc:
                    raise at_position(exc, i, n, name) from None
            schemas[fid] = move[0]
        rows = [as_rows(columns[path], n) for path in template.paths]
        self._last_dense = template
        if fresh:
            layout_ids = self._schema.accept_new_files(n, moves[0][0], layouts, moves[0][1])
            # the move from the empty schema is the same for every later batch of new files
            template.fresh_move = (moves[0][0], layout_ids)
            self._filenames.extend(names)
            self._file_ids.update(zip(names, range(base, base + n), strict=True))
            self._stage_frames(names, frames, None, layout_ids, rows, _frame_array(frames))
            return True
        layout_ids = self._schema.accept_files(schemas, layouts, next(iter(moves.values()))[1])
        self._filenames.extend(new_names)
        self._file_ids.update(new_names)
        self._stage_frames(names, frames, np.asarray(file_ids, dtype=np.int64), layout_ids, rows, _frame_array(frames))
        return True

    def _put_fresh(
        self, names: list[str], frames: list[int], zero: bool, fast: tuple[DenseTemplate, tuple[int, ...]],
        columns: list[np.ndarray],
    ) -> bool:  # fmt: skip
        """``_put_dense`` of a flat dict batch whose structure an earlier batch of new files had
        (``_learn_flat``): when every filename is new and none repeats, the layout rule's move
        and the catalog ids are the template's and nothing else needs a look. ``columns``: each
        leaf's rows in the dict's order; ``zero``: every frame index is 0. False (nothing done)
        when a filename was written before or repeats: the general way handles the batch."""
        template, order = fast
        n, base = len(names), len(self._filenames)
        file_ids = self._file_ids
        if template.fresh_move is None or not file_ids.keys().isdisjoint(names):
            return False
        file_ids.update(zip(names, range(base, base + n), strict=True))
        if len(file_ids) != base + n:  # a filename repeats in the batch: none of them was there before
            for name in names:
                file_ids.pop(name, None)
            return False
        self._flush_row_log()
        schema, layout_ids = template.fresh_move
        self._schema.accept_new_files(n, schema, template.layouts, layout_ids)
        self._filenames.extend(names)
        rows = [columns[j] for j in order]
        self._stage_frames(names, frames, None, layout_ids, rows, None if zero else _frame_array(frames))
        return True

    def _learn_flat(self, sig: tuple[Any, ...]) -> None:
        """Remember the flat dict batch of signature ``sig`` that ``_put_dense`` just staged: once
        its template knows a new file's move, the next batch like it takes ``_put_fresh``."""
        template = self._last_dense
        if template is None or template.fresh_move is None or len(self._flat_templates) >= 256:
            return
        keys = [entry[0] for entry in sig]
        # the template's leaves in flatten's order; each path of a flat dict is (key,)
        self._flat_templates[sig] = (template, tuple([keys.index(path[0]) for path in template.paths]))

    def _stage_frames(
        self, names: list[str], frames: list[int], file_ids: np.ndarray | None, layout_ids: tuple[int, ...],
        rows: list[np.ndarray], frame_arr: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """The index rows and staged bytes of a checked dense batch whose files are accepted:
        ``file_ids`` None for a batch of new files (the last ``len(names)`` ids), ``rows`` each
        leaf's ``(n, item bytes)`` uint8 rows in the layouts' order; ``frame_arr`` None when
        every frame index is 0."""
        n, n_leaves, row0 = len(names), len(layout_ids), self._n_rows
        need = row0 + n * n_leaves
        if need > len(self._rows):
            grown = np.zeros((max(need, 2 * len(self._rows)), FS.INDEX_COLUMNS), dtype=np.int64)
            grown[:row0] = self._rows[:row0]
            self._rows = grown
        self._n_rows = need
        index = self._rows[row0:need, : FS.COL_CRC]
        if file_ids is None:
            base = len(self._filenames) - n
            self._fresh_keys.append((base, frames, row0, n_leaves))
            self._n_fresh_keys += n
            self._staging.add_frames(row0, base, frame_arr, layout_ids, rows, index)
        else:
            spans = zip(range(row0, need, n_leaves), [n_leaves] * n, strict=True)
            self._keys.update(zip(zip(file_ids.tolist(), frames, strict=True), spans, strict=True))
            self._staging.add_frames(row0, file_ids, frame_arr, layout_ids, rows, index)

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
        n = len(names)
        item0 = _nest({path: col[0] for path, col in columns.items()})
        try:
            leaves = flatten(item0, names[0], frames[0], self.allow_pickle)
        except SpillValueError as exc:
            raise at_position(exc, 0, n, names[0]) from None
        if len(leaves) != len(columns) or any(leaf.dtype in ("pickle", "str", "bytes") for leaf in leaves):
            return None
        by_leaf = {tuple([user_key(k) for k in path]): path for path in columns}  # keys as flatten escapes them
        paths = [by_leaf.get(leaf.path) for leaf in leaves]
        if None in paths:
            return None
        template = DenseTemplate(
            tuple(paths),  # type: ignore[arg-type]
            [FS.Layout(leaf.path, leaf.dtype, leaf.shape, leaf.pos) for leaf in leaves],
        )
        if len(self._dense_templates) < 256:  # bounded: batches of ever new shapes take the slow way
            self._dense_templates[sig] = template
        return template

    def _key_map(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Every key written so far -> (first row, n rows)."""
        for base, frames, row0, n_leaves in self._fresh_keys:
            n = len(frames)
            spans = zip(range(row0, row0 + n * n_leaves, n_leaves), [n_leaves] * n, strict=True)
            self._keys.update(zip(zip(range(base, base + n), frames, strict=True), spans, strict=True))
        self._fresh_keys.clear()
        self._n_fresh_keys = 0
        if self._new_keys:
            log = np.frombuffer(self._new_keys, dtype=np.int64).reshape(-1, 4).tolist()
            self._keys.update(((f, fr), (r, n)) for f, fr, r, n in log)
            self._new_keys = array.array("q")
        return self._keys

    @property
    def _n_frames(self) -> int:
        return len(self._keys) + self._n_fresh_keys + len(self._new_keys) // 4

    def _check_batch(
        self, names: list[str], frames: list[int], items: list[Any]
    ) -> list[tuple[str, int, list[Leaf], list[FS.Layout]]]:
        """Flatten every item and run what ``_put`` would check (the layout rule, the duplicate
        policy), in batch order, against the writer's state as the earlier items of the batch
        leave it, without changing anything: the batch is refused whole or staged whole."""
        n = len(names)
        out: list[tuple[str, int, list[Leaf], list[FS.Layout]]] = []
        schemas: dict[int, int] = {}  # file id -> its schema after the batch's items so far
        new_ids: dict[str, int] = {}
        in_batch: dict[tuple[int, int], list[Leaf]] = {}  # key -> leaves of its last accepted item
        by_column = flatten_items(items, names)  # items of one structure: a column at a time
        for i, (name, frame, item) in enumerate(zip(names, frames, items, strict=True)):
            try:
                leaves = by_column[i] if by_column is not None else flatten(item, name, frame, self.allow_pickle)
                file_id = self._file_ids.get(name)
                if file_id is None:
                    file_id = new_ids.setdefault(name, len(self._filenames) + len(new_ids))
                layouts = self._schema.layouts_of(leaves)  # cached per frame shape, as _put's
                new_schema, layout_ids = self._schema.check(name, frame, file_id, layouts, schemas.get(file_id))
                key = (file_id, frame)
                earlier = in_batch.get(key)
                # (a file the writer has not written yet has no key yet: no lookup)
                if earlier is not None or (file_id < len(self._filenames) and key in self._key_map()):
                    if self.on_duplicate == "first":
                        out.append((name, frame, leaves, layouts))
                        continue
                    if self.on_duplicate == "error":
                        same = (
                            _same_leaves(earlier, leaves)
                            if earlier is not None
                            else self._same_as_written(self._key_map()[key], leaves, layout_ids)
                        )
                        if not same:
                            raise DuplicateFrameError(
                                f"frame {frame} of {name!r:.200} was already written by rank {self.rank} "
                                "(pass on_duplicate='first' or 'last' to allow rewrites)",
                                filename=name,
                                frame_idx=frame,
                                ranks=[self.rank],
                            )
                        out.append((name, frame, leaves, layouts))
                        continue
            except SpillValueError as exc:
                raise at_position(exc, i, n, name) from None
            schemas[file_id] = new_schema
            in_batch[key] = leaves
            out.append((name, frame, leaves, layouts))
        return out

    def _put(
        self, filename: str, frame: int, leaves: list[Leaf], layouts: list[FS.Layout] | None = None
    ) -> tuple[int, ...] | None:
        """Stage one checked frame: the layout rule, the duplicate policy, then its rows. Returns
        the frame's catalog layout ids, or None when the duplicate policy kept the earlier copy.
        ``layouts``: the leaves' ``FileSchemas.layouts_of``, when the caller has them."""
        self._flush_row_log()
        file_id = self._file_ids.get(filename)
        if file_id is None:
            file_id = len(self._filenames)
        if layouts is None:
            layouts = self._schema.layouts_of(leaves)
        # raises before anything of this frame is staged or cataloged
        new_schema, layout_ids = self._schema.check(filename, frame, file_id, layouts)  # -1: not in the catalog yet
        key = (file_id, frame)
        # A file never written has no key yet (its id is the next one).
        prev = self._key_map().get(key) if file_id < len(self._filenames) else None
        if prev is not None:
            if self.on_duplicate == "first":
                self._rewrites += 1
                return None
            if self.on_duplicate == "error":
                if self._same_as_written(prev, leaves, layout_ids):  # identical content is never an error
                    self._identical_rewrites += 1
                    self._rewrites += 1
                    return None
                raise DuplicateFrameError(
                    f"frame {frame} of {filename!r:.200} was already written by rank {self.rank} "
                    "(pass on_duplicate='first' or 'last' to allow rewrites)",
                    filename=filename,
                    frame_idx=frame,
                    ranks=[self.rank],
                )
            self._dead_rows.append(prev)
            self._rewrites += 1  # "last": the earlier copy is dropped
        layout_ids = self._schema.accept(file_id, new_schema, layouts, layout_ids)
        new_file = file_id == len(self._filenames)
        if new_file:
            self._filenames.append(filename)
            self._file_ids[filename] = file_id
        first_row, n_leaves = self._n_rows, len(leaves)
        if first_row + n_leaves > len(self._rows):
            self._rows = np.concatenate(
                [self._rows, np.zeros((len(self._rows) + n_leaves, FS.INDEX_COLUMNS), np.int64)]
            )
        off, rows = self._staging.offset, []
        for leaf, lid in zip(leaves, layout_ids, strict=True):
            rows.append((file_id, frame, lid, off, leaf.nbytes))
            off += leaf.nbytes
        self._rows[first_row : first_row + n_leaves, : FS.COL_CRC] = rows  # one assignment per frame
        self._n_rows += n_leaves
        self._staging.add_frame(first_row, file_id, frame, layout_ids, leaves)
        if new_file:
            self._new_keys.extend((file_id, frame, first_row, n_leaves))  # looked up only later, if ever
        else:
            self._keys[key] = (first_row, n_leaves)
        return layout_ids

    def update(self, mapping: Mapping[str, Any]) -> None:
        """Write many frames: ``{filename: (frame_idx, value)}`` or ``{filename: {frame_idx: value}}``."""
        for filename, frame_idx, value in mapping_items(mapping):
            self.write(filename, frame_idx, value)

    def _same_as_written(self, prev: tuple[int, int], leaves: list[Leaf], layout_ids: tuple[int, ...]) -> bool:
        """Do ``leaves`` hold the same bytes (and layouts) as the frame already written at rows
        ``prev``? Only a rewrite of a key gets here; staging reads the earlier bytes back."""
        self._flush_row_log()
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

    def _check_open(self) -> None:
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


def _frame_array(frames: list[int]) -> np.ndarray | None:
    """A batch's frame indices as int64, None when all are 0 (``Staging.add_frames``)."""
    return np.array(frames, dtype=np.int64) if any(frames) else None


def _same_leaves(a: list[Leaf], b: list[Leaf]) -> bool:
    """Do two frames of one batch hold the same leaves (layouts and bytes)?"""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if (x.path, x.dtype, x.shape, x.nbytes) != (y.path, y.dtype, y.shape, y.nbytes):
            return False
        dx = x.data.cpu().numpy() if isinstance(x.data, torch.Tensor) else x.data
        dy = y.data.cpu().numpy() if isinstance(y.data, torch.Tensor) else y.data
        if not np.array_equal(dx, dy):
            return False
    return True


def _nest(by_path: dict[tuple[str, ...], Any]) -> Any:
    """The nested dict of leaves given by path (``()``: the value itself)."""
    if () in by_path:
        return by_path[()]
    out: dict[str, Any] = {}
    for path, v in by_path.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out
