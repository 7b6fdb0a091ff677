"""Mutation check: do the tests guard the guarantees? (issue 16; not collected by pytest)

Each entry of ``MUTATIONS`` deletes or weakens one check of the library: one exact snippet of
one file, replaced. The script applies them one at a time to a temporary copy of the repository
(``spillmerge/``, ``tests/``, ``pyproject.toml``), runs ``python -m pytest -x -q`` on the tests
named for that mutation there (``PYTHONPATH`` = the copy, so spawned ranks import the mutated
code too), and reports KILLED (a test failed: the guard works) or SURVIVED (every test passed:
the check could go unnoticed). It first runs the selected tests on the unmutated copy, so a
KILLED is not a broken test. Exit status: 0 when every mutation is killed, 1 otherwise, 2 when a
snippet is not found exactly once (the code moved: update the entry).

Run from the repository root (about 4 minutes on 2 cores)::

    python tests/mutation_check.py              # all mutations
    python tests/mutation_check.py -k crc       # those whose name contains "crc"
    python tests/mutation_check.py --list       # names and where they apply

When a check moves or is rewritten, update its snippet here; when a new guarantee gets a check,
add its mutation and a test that kills it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 400  # seconds per pytest run; a mutation that hangs the tests counts as killed


@dataclass(frozen=True)
class Mutation:
    """One weakened check."""

    name: str
    """Short id (``-k`` selects by substring)."""
    file: str
    """File below the repository root."""
    original: str
    """Exact snippet, present exactly once in ``file``."""
    replacement: str
    """What the snippet becomes."""
    tests: tuple[str, ...]
    """pytest node ids or files (relative to the repository root) expected to catch it."""
    why: str
    """The guarantee the check protects."""


G = "tests/project/test_guards.py"
H = "tests/spill/test_hostile.py"
U = "tests/storage/test_untrusted_storage.py"
C = "tests/project/test_checks_tested.py"

# The journal thread's group commit (spillmerge/_write/flush.py, ``_journal``), then the
# journal entry it makes safe to write: swapped, the entry lands before its chunks are durable.
_GROUP_COMMIT = (
    "            if self.fsync and chunk.number >= self._synced:\n"
    "                # One group commit: every chunk written since the last one (this one included) and\n"
    "                # their folder (their names), fsynced at once. A disk busy with one commit lets the\n"
    "                # next gather the chunks written meanwhile: fewer cache flushes than one a chunk.\n"
    "                upto = self.written\n"
    '                names = [f"{self.prefix}/{FS.DATA_NAME}/c/{c}" for c in range(self._synced, upto)]\n'
    "                self.storage.sync(names, up=False)\n"
    "                self._synced = upto\n"
)
_JOURNAL_ENTRY = (
    "            self.progress.durable(chunk.number, done)\n"
    "            crc = self.crc\n"
    '            rows = np.empty((len(done), FS.INDEX_COLUMNS), dtype="<i8")\n'
    "            rows[:, : FS.COL_CRC] = done[:, 1:]\n"
    "            rows[:, FS.COL_CRC] = crc[np.minimum(done[:, 0], len(crc) - 1)] * (done[:, 0] < len(crc))\n"
    "            checks = self.checks[chunk.check_base : chunk.check_base + len(chunk.blocks)]\n"
    "            entry = gc_paused(\n"
    "                FS.encode_journal, chunk.number, chunk.file_base, chunk.new_files, chunk.layout_base,\n"
    "                chunk.new_layouts, rows, chunk.check_base, checks,\n"
    "            )  # fmt: skip\n"
    '            self.storage.put(f"{self.prefix}/{FS.journal_name(chunk.number)}", entry)\n'
)
# The test that records the fsyncs, the chunk writes and the journal entries in the order they reach the disk.
FSYNC_ORDER = (
    "tests/write/test_flush_overlap.py::test_a_journal_entry_names_only_chunks_fsynced_with_their_folder_before_it"
)

MUTATIONS: list[Mutation] = [
    # ------------------------------------------------------------------ the 8 of issue 16
    Mutation(
        # The columnar copy checks every row read row by row in one place (OutputChunk._rows),
        # local or read by range GETs, whatever the codec.
        "copy-crc",
        "spillmerge/_merge/outputchunk.py",
        "                if v != crc:\n                    self._mismatch(r, e)",
        "                if False:\n                    self._mismatch(r, e)",
        (
            f"{G}::test_a_flipped_data_byte_fails_the_merge_with_every_codec",
            f"{G}::test_a_flipped_data_byte_on_an_object_store_fails_the_merge",
        ),
        "a corrupt frame never reaches the output (local or object store, compressed or not)",
    ),
    Mutation(
        "copy-block-crc-local",
        "spillmerge/_merge/outputchunk.py",
        "        return len(block) == b_nb and _crc.value(block) == value",
        "        return len(block) == b_nb",
        (f"{G}::test_a_flipped_data_byte_fails_the_merge_with_every_codec", "tests/write/test_write_batch.py"),
        "a corrupt block of write_batch / write rows never reaches the output (local spill root)",
    ),
    Mutation(
        "copy-crc-local-batch",
        "spillmerge/_merge/outputchunk.py",
        "                if _crc.value(whole[a : a + int(n_g[i])]) != int(crc[g[i]]):\n                    return None",
        "                if False:\n                    return None",
        (f"{G}::test_a_flipped_data_byte_fails_the_merge_with_every_codec",),
        "a corrupt frame never reaches the output through the batched copy of a local spill root",
    ),
    Mutation(
        "copy-text-local-batch",
        "spillmerge/_merge/outputchunk.py",
        "            if not _utf8_back_to_back(out[a:b], start[done] - a):",
        "            if False:",
        ("tests/spill/test_hostile.py::test_verify_finds_text_the_merge_refuses",
         "tests/spill/test_hostile.py::test_a_character_split_between_two_strings_is_refused"),
        "string rows that are not valid UTF-8 never reach the output through the batched copy",
    ),
    Mutation(
        "ownership-unflushed-temporary-names",
        "spillmerge/_merge/ownership.py",
        'for kind in ("tmp", "part"))',
        'for kind in ("tmp",))',
        ("tests/merge/test_nothing_lost_output.py::test_a_merge_killed_while_writing_its_first_document_is_rebuilt",),
        "a merge with fsync=False killed while writing a record leaves a temporary name the next merge removes",
    ),
    Mutation(
        "copy-text-cut-row",
        "spillmerge/_merge/outputchunk.py",
        "                    if not _utf8_back_to_back(whole[int(lo[i]) : int(lo[i] + n_g[i])], np.zeros(1, np.int64)):",
        "                    if False:",
        ("tests/spill/test_hostile.py::test_a_string_row_cut_by_output_chunks_is_checked_whole",),
        "a string row cut by output chunks' edges is checked whole before its pieces are copied",
    ),
    Mutation(
        "failure-record-ignored",
        "spillmerge/_spill/barrier.py",
        "        if failures:",
        "        if False:",
        (f"{G}::test_a_failure_record_of_the_run_fails_the_barrier_at_once",),
        "a failed rank is named at once, not waited for (with a run id or without)",
    ),
    Mutation(
        "publish-failure-disabled",
        "spillmerge/_dist/store.py",
        '    _publish(run_id, f"failed/{session}/{rank}", message[:4000], f"failed/{session}")',
        "    return",
        ("tests/distributed/test_guards_multirank.py::test_failure_key_alone_names_the_rank",),
        "dst hears of a failed rank through the store when it cannot see its failure record",
    ),
    Mutation(
        "storage-path-accepts-dotdot",
        "spillmerge/_storage/base.py",
        '        if norm == ".." or norm.startswith("../") or norm != rel.rstrip("/"):',
        '        if norm != rel.rstrip("/"):',
        (f"{G}::test_storage_paths_with_dot_dot_are_refused",),
        "no path leaves its root",
    ),
    Mutation(
        "manifest-prefix-and-normpath-unchecked",
        "spillmerge/_dist/transfer.py",
        "    if not isinstance(rel, str) or not rel.startswith(ok_prefixes) or posixpath.normpath(rel) != rel:",
        "    if not isinstance(rel, str):",
        (f"{G}::test_receiver_refuses_objects_outside_the_senders_ranks",),
        "a sender writes only into the folders of the ranks it sends",
    ),
    Mutation(
        "catalog-crc-vs-commit-record",
        "spillmerge/_spill/root.py",
        "    if cat_crc != commit.catalog_crc32c:",
        "    if False:",
        (f"{G}::test_a_catalog_that_does_not_match_the_commit_record_is_refused",),
        "the catalog merged is the one the rank committed",
    ),
    Mutation(
        "verify-ignores-missing-chunks",
        "spillmerge/_inspect/summary.py",
        "    missing = declared - len(present)\n    if missing:",
        "    missing = declared - len(present)\n    if False:",
        ("tests/read/test_nothing_lost_reader.py::test_verify_lists_every_missing_chunk",),
        "verify of a merged store lists every missing chunk",
    ),
    Mutation(
        "journal-sequence-unchecked",
        "spillmerge/_spill/root.py",
        "                entry.chunk != n\n",
        "                False\n",
        (f"{G}::test_salvage_stops_at_a_journal_entry_of_another_chunk",),
        "salvage replays journal entries in order and stops at the first that is out of place",
    ),
    # ---------------------------------------------------------------------------- others
    Mutation(
        "index-crc-vs-commit-record",
        "spillmerge/_spill/root.py",
        "    if idx_crc != commit.index_crc32c:",
        "    if False:",
        (f"{G}::test_an_index_that_does_not_match_the_commit_record_is_refused",),
        "the index merged is the one the rank committed",
    ),
    Mutation(
        "small-array-chunk-crc",
        "spillmerge/_spill/root.py",
        "    if _crc.value(raw) != stored:",
        "    if False:",
        (f"{G}::test_a_torn_index_or_catalog_chunk_is_named_as_such",),
        "a torn index or catalog chunk is named as such",
    ),
    Mutation(
        "failure-keys-never-read",
        "spillmerge/_dist/store.py",
        '        if int(self.base.add(f"failed/{self.session}", 0)) > 0:',
        "        if False:",
        ("tests/distributed/test_guards_multirank.py::test_failure_key_alone_names_the_rank",),
        "dst reads the failure keys other ranks publish",
    ),
    Mutation(
        "manifest-normpath-unchecked",
        "spillmerge/_dist/transfer.py",
        "    if not isinstance(rel, str) or not rel.startswith(ok_prefixes) or posixpath.normpath(rel) != rel:",
        "    if not isinstance(rel, str) or not rel.startswith(ok_prefixes):",
        (f"{G}::test_receiver_refuses_objects_outside_the_senders_ranks",),
        "rank-00002/../rank-00000 is not below rank 2's folder",
    ),
    Mutation(
        "manifest-size-unchecked",
        "spillmerge/_dist/transfer.py",
        "    if not 0 < size <= _MAX_MANIFEST:",
        "    if False:",
        (f"{G}::test_receiver_refuses_malformed_manifests",),
        "a sender cannot make dst allocate an unbounded manifest",
    ),
    Mutation(
        "manifest-object-size-unchecked",
        "spillmerge/_dist/transfer.py",
        '        if n < 0 or (rel.endswith("/" + FS.COMMIT_NAME) and n > _MAX_RECORD):',
        "        if False:",
        (f"{G}::test_receiver_refuses_negative_sizes_and_huge_commit_records",),
        "object sizes in a manifest are checked before receiving",
    ),
    Mutation(
        "received-crc-unchecked",
        "spillmerge/_dist/transfer.py",
        "        ok = crc == want",
        "        ok = True",
        (f"{G}::test_receiver_keeps_a_commit_record_with_a_bad_checksum_invisible",),
        "a shard damaged in transit is refused",
    ),
    Mutation(
        "received-commit-record-not-held-back",
        "spillmerge/_storage/local.py",
        "                if ok:\n                    os.replace(self._tmp, self.path)",
        "                if True:\n                    os.replace(self._tmp, self.path)",
        (f"{G}::test_receiver_keeps_a_commit_record_with_a_bad_checksum_invisible",),
        "a half-received rank never looks committed",
    ),
    Mutation(
        "get-max-bytes-ignored",
        "spillmerge/_storage/base.py",
        "        if size > max_bytes:",
        "        if False:",
        (f"{G}::test_get_refuses_an_object_larger_than_max_bytes",),
        "an oversized record is refused before it is read",
    ),
    Mutation(
        "merge-memory-budget-ignored",
        "spillmerge/_merge/copy.py",
        "                        while in_flight and in_flight + u.nbytes > o.memory_budget and not errors:",
        "                        while False:",
        (f"{G}::test_merge_keeps_at_most_its_memory_budget_of_stripes_in_flight",),
        "the merge keeps at most memory_budget bytes of stripes in flight",
    ),
    Mutation(
        "writer-backpressure-removed",
        "spillmerge/_write/flush.py",
        "                if self.allocated < self.n_buffers:",
        "                if True:",
        (f"{G}::test_write_blocks_while_every_staging_buffer_waits_for_storage",),
        "write() blocks while every staging buffer waits for storage",
    ),
    Mutation(
        "missing-data-chunk-unchecked",
        "spillmerge/_spill/root.py",
        "        if str(c) not in present:",
        "        if False:",
        ("tests/spill/test_hostile.py::test_missing_data_chunk_and_future_format_are_named",),
        "every data chunk a commit record promises exists",
    ),
    # ------------------------------------------------------------------ issue 26: metadata on trust
    Mutation(
        "chunk-shape-within-array",
        "spillmerge/_format/output.py",
        "big = [d for d, (c, s) in enumerate(zip(chunks, shape, strict=True)) if c > max(s, 1)]",
        "big = []",
        ("tests/spill/test_hostile.py::test_chunk_shape_larger_than_its_array_is_refused",),
        "a chunk shape is never larger than its array's (a 32 KB chunk declared (2**26, 4))",
    ),
    Mutation(
        "compressor-declared-size",
        "spillmerge/_format/output.py",
        "        if n > limits.decoded_bytes:",
        "        if False:",
        (f"{U}::test_array_metadata_attacks",),
        "a compressed chunk declaring more than its chunk decodes to is refused before decoding",
    ),
    Mutation(
        "zstd-content-size-required",
        "spillmerge/_format/codecs.py",
        "        if fcs_len == 0:",
        "        if False:",
        ("tests/spill/test_hostile.py::test_zstd_frame_without_content_size_is_refused_unread",),
        "a zstd frame without a content size (decoded by a growing buffer) is refused",
    ),
    Mutation(
        "blosc-nbytes",
        "spillmerge/_format/codecs.py",
        "        return nbytes",
        "        return 0",
        (f"{U}::test_array_metadata_attacks",),
        "a blosc chunk's declared nbytes bounds what its decoder allocates",
    ),
    Mutation(
        "shape-products-overflow",
        "spillmerge/_format/invariants.py",
        "        over |= big",
        "        pass",
        (f"{H}::test_shapes_row_of_product_zero_is_refused",),
        "shapes products never wrap around ([2**32, 2**32] is not 0 elements)",
    ),
    Mutation(
        "empty-extent-bound",
        "spillmerge/_format/invariants.py",
        "(zero & (lead > F.EMPTY_EXTENT_MAX))",
        "(zero & False)",
        (f"{H}::test_shapes_row_of_product_zero_is_refused",),
        "an empty shape has at most 65536 entries before its zero ([2**27, 0])",
    ),
    Mutation(
        "read-whole-chunk-by-chunk",
        "spillmerge/_format/invariants.py",
        "        if n > k:",
        "        if False:",
        ("tests/read/test_nothing_lost_reader.py::test_a_whole_array_read_ends_at_its_first_absent_chunk",),
        "whole arrays are read chunk by chunk: a declared 2**40 rows allocates nothing",
    ),
    Mutation(
        "duplicates-compare-layouts",
        "spillmerge/_merge/plan.py",
        '(int(c["lp"][r]), int(c["nb"][r]), layouts[c["gl"][r]].dtype, layouts[c["gl"][r]].shape)',
        '(int(c["lp"][r]), int(c["nb"][r]))',
        ("tests/merge/test_duplicate_attribution.py::test_copies_of_the_same_bytes_but_another_dtype_shape_or_kind_are_different_content",),
        "copies of a frame with the same bytes but another dtype, shape or kind are different content",
    ),
    Mutation(
        "none-row-has-no-value",
        "spillmerge/_read/index.py",
        "    if none is not None and np.any(none & has):",
        "    if False:",
        ("tests/read/test_lazy_index.py::test_a_damaged_late_block_opens_and_is_refused_when_read",),
        "a row marked None in a column's none array has no value there",
    ),
    Mutation(
        "none-marks-none-rows",
        "spillmerge/_merge/plan.py",
        "srcs[g][db[m]] = np.where(none[m], NONE, a + m)",
        "srcs[g][db[m]] = np.where(none[m], ABSENT, a + m)",
        ("tests/format/test_lists.py::test_a_dict_that_lacks_keys_and_holds_none_reads_back_as_written",),
        "a key holding None is told from a key the dict lacks",
    ),
    Mutation(
        "empty-array-keeps-dtype",
        "spillmerge/_merge/plancolumns.py",
        "(lay.dtype in F.PY_SCALARS and 0 in lay.shape)",
        "(F.DTYPES[lay.dtype].numeric and 0 in lay.shape)",
        ("tests/write/test_values.py::test_an_empty_array_keeps_its_dtype_and_an_empty_list_stays_a_list",),
        "an empty array keeps its dtype: it joins no other numeric variant of its leaf",
    ),
    Mutation(
        "variants-numbered-in-sorted-order",
        "spillmerge/_merge/plancolumns.py",
        "    sig_code = {sig: i for i, sig in enumerate(sorted(set(lsig.values())))}\n",
        "    sig_code = {sig: i for i, sig in enumerate(dict.fromkeys(lsig.values()))}\n",
        ("tests/write/test_write_batch.py::test_batches_of_flat_records_are_stored_as_row_by_row_writes_or_refused_alike",),
        "write_batch and row-by-row writes of the same values give byte-identical outputs (the variant [] joins)",
    ),
    Mutation(
        "empty-list-joins-python-numbers",
        "spillmerge/_merge/plancolumns.py",
        'if s[0] == "num" and s[1] in F.PY_SCALARS and s[2] == nd]',
        'if s[0] == "num" and s[2] == nd]',
        ("tests/write/test_values.py::test_an_empty_array_keeps_its_dtype_and_an_empty_list_stays_a_list",),
        "an empty Python list joins no array's variant: it reads back as [], not an empty array",
    ),
    Mutation(
        "writer-filename-limit",
        "spillmerge/_write/leaves.py",
        "    if n > FILENAME_MAX_BYTES:",
        "    if False:",
        (f"{H}::test_writer_refuses_what_readers_refuse",),
        "write() refuses a filename readers refuse (1 MiB), naming it",
    ),
    Mutation(
        "writer-empty-shape",
        "spillmerge/_write/leaves.py",
        "    if leaf.nbytes == 0 and DTYPES[leaf.dtype].numeric:",
        "    if False:",
        (f"{H}::test_writer_refuses_what_readers_refuse",),
        "write() refuses an empty value past the format's bound ([2**27, 0])",
    ),
    Mutation(
        "catalog-filename-limit",
        "spillmerge/_spill/root.py",
        "    if long is not None:",
        "    if False:",
        (f"{H}::test_merge_refuses_a_catalog_filename_past_the_limit",),
        "the merge refuses a catalog filename its output's readers would refuse",
    ),
    Mutation(
        "layout-known-key-exact",
        "spillmerge/_format/spill.py",
        "    if not (all(type(p) is str for p in leaf) and all(type(d) is int for d in shape)):",
        "    if not all(type(p) is str for p in leaf):",
        (f"{H}::test_a_layout_equal_to_a_checked_one_but_for_json_types_is_refused",),
        "a layout equal to one already checked but for a float where an int belongs is refused",
    ),
    Mutation(
        "layout-known-key-exact-pos",
        "spillmerge/_format/spill.py",
        "    if pos is not None and (type(pos) is not list or not all(type(d) is int for d in pos)):",
        "    if pos is not None and type(pos) is not list:",
        (f"{H}::test_a_layout_equal_to_a_checked_one_but_for_json_types_is_refused",),
        "a layout equal to one already checked but for a boolean among its key positions is refused",
    ),
    Mutation(
        "strlist-layout-bytes",
        "spillmerge/_format/spill.py",
        'if kind == "strlist" and 4 * shape[0] > shape[1]:',
        "if False:",
        (f"{H}::test_strlist_layout_claiming_more_strings_than_bytes",),
        "a strlist layout claiming 2**31 strings in 12 bytes is corrupt at load, for merge and verify",
    ),
    Mutation(
        "verify-checks-text",
        "spillmerge/_inspect/summary.py",
        'bad = FS.text_problem(lay.kind, lay.shape[0], buf) if lay.kind in ("str", "strlist") else None',
        "bad = None",
        (f"{H}::test_verify_finds_text_the_merge_refuses",),
        "verify ROOT finds the invalid text that makes the merge fail",
    ),
    Mutation(
        "gather-timeout-covers-group-setup",
        "spillmerge/_dist/gather.py",
        'opts["run_id"] = resolve_run_id(opts.get("run_id"), timeout)',
        "pass",
        ("tests/distributed/test_gather.py::test_timeout_covers_the_process_group_setup",),
        "all_gather(timeout=) bounds the process-group set-up (new_group waited 300 s)",
    ),
    # ------------------------------------------------ issue 26, second audit: checks no entry guarded
    Mutation(
        "g26-leaf-view-row-bound",
        "spillmerge/_read/views.py",
        '            if not 0 <= j < n:\n                raise IndexError(f"row {sel} out of range for {n} rows")',
        '            if j < 0:\n                raise IndexError(f"row {sel} out of range for {n} rows")',
        ("tests/project/test_guarded_checks.py::test_a_row_past_a_files_last_row_raises",),
        'res["a"][3] on a 3-row file raises, never returns the next file\'s first row',
    ),
    Mutation(
        "g26-leaf-view-row-bound-numpy-index",
        "spillmerge/_read/views.py",
        '        if not 0 <= j < n:\n            raise IndexError(f"row {int(i)} out of range for {n} rows")',
        '        if j < 0:\n            raise IndexError(f"row {int(i)} out of range for {n} rows")',
        ("tests/project/test_guarded_checks.py::test_a_row_past_a_files_last_row_raises",),
        "the same bound for the row of a tuple index (view[np.int64(i), j])",
    ),
    Mutation(
        "g26-shapes-negative-dimension",
        "spillmerge/_read/index.py",
        "    if np.any(shapes < 0):",
        "    if False:",
        ("tests/project/test_guarded_checks.py::test_a_negative_dimension_in_shapes_is_refused",),
        "a shapes row [-2, -3] is refused although its product agrees with the offsets",
    ),
    Mutation(
        "g26-valid-without-has-valid",
        "spillmerge/_format/invariants.py",
        "        if k in a and not said:",
        "        if False:",
        ("tests/project/test_guarded_checks.py::test_a_valid_array_the_header_does_not_declare_is_refused",),
        "a valid array where the column header says there is none is refused",
    ),
    Mutation(
        "g26-header-counts-vs-index",
        "spillmerge/_format/invariants.py",
        "        if header.get(field) != want:",
        "        if False:",
        ("tests/project/test_guarded_checks.py::test_header_counts_that_disagree_with_the_index_are_refused",),
        "the header's n_files / n_frames agree with the index",
    ),
    Mutation(
        "g26-absent-row-spans-nothing",
        "spillmerge/_read/index.py",
        "        bad = np.flatnonzero(~v & (step != 0))",
        "        bad = np.flatnonzero(~v & (step < 0))",
        ("tests/project/test_guarded_checks.py::test_an_absent_row_whose_offsets_span_bytes_is_refused",),
        "an absent row's offsets span no values",
    ),
    Mutation(
        "g26-local-lease-inode",
        "spillmerge/_merge/lease.py",
        '            if not same:\n                return f"{self.output.describe(rel)} was removed or replaced"',
        '            if False:\n                return f"{self.output.describe(rel)} was removed or replaced"',
        ("tests/project/test_guarded_checks.py::test_a_local_lease_whose_lock_file_was_replaced_is_lost",),
        "a local lease whose lock file was unlinked and recreated is lost",
    ),
    Mutation(
        "g26-storage-path-normalised",
        "spillmerge/_storage/base.py",
        '        if norm == ".." or norm.startswith("../") or norm != rel.rstrip("/"):',
        '        if norm == ".." or norm.startswith("../"):',
        ("tests/project/test_guarded_checks.py::test_storage_refuses_paths_that_are_not_normalised",),
        "a path is its own normal form (a/./b is refused, not silently rewritten)",
    ),
    Mutation(
        "g26-linked-folder-above",
        "spillmerge/_storage/local.py",
        "            if stat.S_ISLNK(mode):\n                self._refuse_mode(above, mode)",
        "            if False:\n                self._refuse_mode(above, mode)",
        ("tests/project/test_guarded_checks.py::test_a_linked_folder_above_an_object_is_refused",),
        "no read follows a linked folder between the root and an object",
    ),
    Mutation(
        "g26-copy-text-check",
        "spillmerge/_merge/outputchunk.py",
        "            bad = FS.text_problem(kind, count, row)",
        "            bad = None",
        (f"{H}::test_verify_finds_text_the_merge_refuses",),
        "the merge's copy refuses string data that is not valid UTF-8",
    ),
    Mutation(
        "finalize-writes-index-share-of-older-parts",
        "spillmerge/_merge/scaleout.py",
        "    left = [c for p, r in enumerate(finished) if not r.index for c in _indexchunks.share(chunks, p, n)]",
        "    left = [c for p, r in enumerate(finished) if False for c in _indexchunks.share(chunks, p, n)]",
        ("tests/merge/test_scaleout.py::test_index_chunks_are_the_bytes_zarr_writes_for_every_index_array",),
        "the finalize writes the index chunks of a part whose record does not say it wrote them",
    ),
    Mutation(
        "part-writes-its-index-share",
        "spillmerge/_merge/scaleout.py",
        "            _indexchunks.write(output, share, threads=job.threads)",
        "            pass",
        ("tests/merge/test_scaleout.py::test_index_chunks_are_the_bytes_zarr_writes_for_every_index_array",),
        "each part writes its share of the index chunks",
    ),
    Mutation(
        "copy-text-batch-row-starts",
        "spillmerge/_merge/outputchunk.py",
        "    ends = np.append(starts, len(whole)).astype(np.int64)\n"
        "    rows = pa.Array.from_buffers(pa.large_string(), len(starts),",
        "    ends = np.array([0, len(whole)], dtype=np.int64)\n"
        "    rows = pa.Array.from_buffers(pa.large_string(), 1,",
        (f"{H}::test_a_character_split_between_two_strings_is_refused",),
        "a batch of strings checked at once still refuses a character split between two rows",
    ),
    Mutation(
        "g26-stale-root-at-merge",
        "spillmerge/_spill/barrier.py",
        "    if stale:\n        raise stale_error(storage, stale, world_size)\n    extra",
        "    if False:\n        raise stale_error(storage, stale, world_size)\n    extra",
        ("tests/spill/test_stale_root.py",),
        "a merge names segments of another world size as stale",
    ),
    Mutation(
        "g26-stale-root-at-writer-open",
        "spillmerge/_spill/barrier.py",
        "    stale = stale_segments(storage, segments, world_size)\n    if stale:\n        raise stale_error(storage, stale, world_size)\n\n",
        "    stale = stale_segments(storage, segments, world_size)\n    if False:\n        raise stale_error(storage, stale, world_size)\n\n",
        ("tests/spill/test_stale_root.py",),
        "a writer of another world size fails at open, before any compute",
    ),
    Mutation(
        "g26-batch-frame-idx-length",
        "spillmerge/_write/batch.py",
        "    if len(raw) != n:",
        "    if False:",
        ("tests/write/test_write_batch.py::test_a_bad_batch_raises_naming_the_leaf_and_position_and_writes_nothing",),
        "write_batch refuses frame indices that do not match the filenames",
    ),
    Mutation(
        "g26-batch-tensor-leaf-length",
        "spillmerge/_write/batch.py",
        "        if len(value) != n:\n            raise _length_error(path, len(value), names)\n        return list(value.unbind(0))",
        "        if False:\n            raise _length_error(path, len(value), names)\n        return list(value.unbind(0))",
        ("tests/write/test_write_batch.py::test_a_bad_batch_raises_naming_the_leaf_and_position_and_writes_nothing",),
        "write_batch refuses a tensor leaf longer or shorter than the batch",
    ),
    Mutation(
        "g26-batch-list-leaf-length",
        "spillmerge/_write/batch.py",
        "        if len(value) != n:\n            raise _length_error(path, len(value), names)\n        return list(value)\n",
        "        if False:\n            raise _length_error(path, len(value), names)\n        return list(value)\n",
        ("tests/write/test_write_batch.py::test_a_bad_batch_raises_naming_the_leaf_and_position_and_writes_nothing",),
        "write_batch refuses a list leaf longer or shorter than the batch",
    ),
    Mutation(
        "g26-remove-spill-missing-ranks",
        "spillmerge/_merge/job.py",
        "    elif report.missing_ranks:",
        "    elif False:",
        ("tests/spill/test_remove_spill.py::test_partial_merge_keeps_the_root",),
        "remove_spill keeps the root when ranks are missing",
    ),
    Mutation(
        "g26-remove-spill-frame-gaps",
        "spillmerge/_merge/job.py",
        "    elif report.frame_gaps and (job.options.allow_partial or report.expected_files is not None):",
        "    elif False:",
        ("tests/spill/test_remove_spill.py::test_frames_missing_against_expected_keep_the_root",),
        "remove_spill keeps the root when frames are missing against expected",
    ),
    # ------------------------------------------------------------------ format 4's list offsets (issue 23)
    Mutation(
        "list-header-vs-offsets",
        "spillmerge/_format/lists.py",
        "        bad = np.flatnonzero(said != steps)",
        "        bad = np.flatnonzero(said != said)",
        ("tests/format/test_lists.py::test_damaged_list_offsets_are_refused_naming_the_array",),
        "verify refuses a list whose header length differs from its offsets step",
    ),
    Mutation(
        "list-group-of-header-missing",
        "spillmerge/_format/lists.py",
        "        if lpath not in lists:",
        "        if False:",
        ("tests/format/test_lists.py::test_a_header_whose_list_group_is_missing_is_refused",),
        "a pylist / pytuple header whose items' list group is missing is refused, naming the header",
    ),
    # ------------------------------------------------------------------ parts and leases (issue 24)
    Mutation(
        "lease-conflicts-name-only-real-holders",
        "spillmerge/_merge/lease.py",
        "                named = None if self.exclusive else {f\"{_MERGE}.lock\"}",
        "                named = None",
        ("tests/merge/test_nothing_lost_output.py::test_leases_taken_and_tidied_at_once_refuse_only_real_conflicts",),
        "parts sharing an output are never refused because of one another",
    ),
    Mutation(
        "lease-lock-on-a-vanished-file",
        "spillmerge/_merge/lease.py",
        "            if self._still_linked() is None:",
        "            if True:",
        ("tests/merge/test_nothing_lost_output.py::test_leases_taken_and_tidied_at_once_refuse_only_real_conflicts",),
        "a lock taken on a file a tidying holder just unlinked is not counted: no whole merge shares the output",
    ),
    # ------------------------------------------------------------------ object stores' bounded reads
    Mutation(
        "fsspec-read-folder-refused",
        "spillmerge/_storage/fsspec_store.py",
        '                self._refuse_kind(rel, self.fs.info(p).get("type"))  # FileNotFoundError: nothing there',
        "                pass",
        ("tests/storage/test_s3.py::test_a_commit_record_that_is_a_folder_or_oversized_is_refused_by_name",),
        "on an object store, a prefix in place of an object is refused as a folder, naming it",
    ),
    Mutation(
        "fsspec-rm-never-a-glob",
        "spillmerge/_storage/fsspec_store.py",
        "            plain = [q for q in found if not _GLOB_CHARS.intersection(q)]",
        "            plain = found",
        ("tests/storage/test_backends.py::test_glob_characters_in_a_name_delete_that_name_and_nothing_beside_it",),
        "an object store's path holding * ? [ is deleted by name, never expanded as a glob pattern",
    ),
    Mutation(
        "fsspec-memory-sink-whole-at-exit",
        "spillmerge/_storage/fsspec_store.py",
        "        self._gather = isinstance(storage.fs, MemoryFileSystem)",
        "        self._gather = False",
        ("tests/storage/test_backends.py::test_a_receive_interrupted_in_a_commit_record_never_looks_committed",),
        "on memory:// a streamed write that fails partway leaves no object: a half-received rank never looks committed",
    ),
    Mutation(
        "fsspec-discarded-upload-closed",
        "spillmerge/_storage/fsspec_store.py",
        "                        self._fh.closed = True",
        "                        pass",
        ("tests/storage/test_backends.py::test_a_receive_interrupted_in_a_commit_record_never_looks_committed",),
        "a discarded upload is never completed when its file object is collected",
    ),
    Mutation(
        "export-parquet-whole-or-nothing",
        "spillmerge/_read/export.py",
        'if tmp else dest.open_write("")',
        'if tmp else dest.fs.open(dest.root, "wb")',
        ("tests/storage/test_backends.py::test_a_parquet_export_that_fails_partway_leaves_no_file",),
        "a to_parquet that fails partway leaves no file on an object store or memory://",
    ),
    Mutation(
        "fsspec-memory-create-exclusive",
        "spillmerge/_storage/fsspec_store.py",
        "        exclusive = _MEMORY_CREATE if isinstance(self.fs, MemoryFileSystem) else contextlib.nullcontext()",
        "        exclusive = contextlib.nullcontext()",
        ("tests/storage/test_backends.py::test_of_threads_creating_one_name_at_once_exactly_one_succeeds",),
        "of threads creating one name on memory:// at once (a lease), exactly one succeeds",
    ),
    # Not listed: _fsspec's size bound on its own. A commit record past its bound is refused by the
    # JSON loader's own size check too (the mutation survives test_s3's oversized case).
    # Not listed: remove_spill's "no completion marker" condition: both merge paths write the marker
    # before they return, so it cannot decide alone (the mutation survives every test). Its
    # "salvaged_frames" condition was removed as dead: a rank with salvaged frames is always in
    # missing_ranks too, which keeps every segment first.
    Mutation(
        "cuda-batch-copy-keeps-tuples",
        "spillmerge/_write/batch.py",
        "        return tuple(_replace(v, host) for v in value)",
        "        return [_replace(v, host) for v in value]",
        ("tests/write/test_write_batch.py::test_the_cuda_batch_copy_keeps_item_containers_and_leaves_odd_batches_alone",),
        "a CUDA batch copied to host stores each item as write() would: a tuple stays a tuple",
    ),
    Mutation(
        "parts-wait-while-the-planner-holds-its-lease",
        "spillmerge/_merge/planstore.py",
        "        if waited >= timeout > 0:",
        "        if True:",
        ("tests/merge/test_scaleout.py::test_with_timeout_0_a_part_waits_for_the_plan_while_the_planner_runs",),
        "with timeout=0 a part waits for the plan of a planner at work instead of planning everything again",
    ),
    Mutation(
        "busy-part-0-leaves-no-failure-record",
        "spillmerge/_merge/opening.py",
        "                failed = isinstance(exc, SpillMergeError) and not isinstance(exc, OutputBusyError)",
        "                failed = isinstance(exc, SpillMergeError)",
        ("tests/merge/test_scaleout.py::test_a_second_part_0_is_refused_before_it_plans_and_leaves_no_failure_record",),
        "a part 0 refused because another part 0 is at work does not tell the waiting parts that part 0 failed",
    ),
    # ------------------------------------------------------------------ checks nothing tested
    Mutation(
        "write-template-refuses-a-dict-with-more-keys",
        "spillmerge/_write/templates.py",
        "        if len(value) != len(self.keys) or tuple(value) != self.order:\n            return None\n        out = []",
        "        out = []",
        (f"{C}::test_a_dict_with_a_key_the_last_files_structure_lacks_is_merged_whole",),
        "a write() of a dict with a key the last file's structure lacks merges that key too",
    ),
    Mutation(
        "write-batch-swaps-big-endian",
        "spillmerge/_write/flatten.py",
        '    arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)',
        '    arr = arr.astype(arr.dtype, copy=False)',
        (f"{C}::test_a_big_endian_array_reads_back_as_its_values",),
        "a big-endian array given to write_batch reads back as its values (stored little-endian)",
    ),
    Mutation(
        "index-row-tail-inside-its-block",
        "spillmerge/_spill/root.py",
        "        if np.any(off[blocked] < c[:, 0]) or np.any(off[blocked] + nb[blocked] > c[:, 0] + c[:, 1]):",
        "        if np.any(off[blocked] < c[:, 0]):",
        (f"{C}::test_an_index_row_reaching_past_its_block_is_refused",),
        "an index row whose bytes run past the block checksum it points at is refused, never copied unchecked",
    ),
    Mutation(
        "block-checksums-match-the-commit-record",
        "spillmerge/_spill/root.py",
        "    if len(raw) != want or crc != commit.checks_crc32c:",
        "    if len(raw) != want:",
        (f"{C}::test_block_checksums_the_commit_record_does_not_vouch_for_are_refused",),
        "data damaged together with its block checksum is caught by the commit record's checksum of the checks",
    ),
    Mutation(
        "block-checksum-inside-one-data-chunk",
        "spillmerge/_spill/root.py",
        "            or np.any(c_off // chunk_bytes != (c_off + c_nb - 1) // chunk_bytes)\n",
        "",
        (f"{C}::test_a_block_checksum_spanning_two_data_chunks_is_refused",),
        "a block checksum spanning two data chunks is refused at load, named as such",
    ),
    Mutation(
        "block-crc-object-store",
        "spillmerge/_spill/root.py",
        "    if _crc.value(buf) != value:\n        raise mismatch(",
        "    if False:\n        raise mismatch(",
        (f"{C}::test_a_corrupt_block_on_an_object_store_fails_the_merge",),
        "a corrupt block of write_batch rows never reaches the output (spill root on an object store)",
    ),
    Mutation(
        "flat-records-batch-repeating-a-file",
        "spillmerge/_write/writer.py",
        "        if n < 2 or not self._file_ids.keys().isdisjoint(names) or len(set(names)) != n:",
        "        if n < 2 or not self._file_ids.keys().isdisjoint(names):",
        ("tests/write/test_write_batch.py::test_duplicate_policies_apply_inside_a_batch_as_row_by_row",),
        "a batch of flat records naming one file twice applies the duplicate policy as row-by-row writes do",
    ),
    Mutation(
        "empty-list-joins-the-lists-beside-it",
        "spillmerge/_read/arrow.py",
        '    return col.info.dtype == "pyfloat" and bool(col.info.ndim) and 0 in (col.n_units, *col.unit_shape)\n',
        "    return False\n",
        ("tests/read/test_reader_edges.py::test_an_empty_list_beside_lists_of_dicts_or_tensors_exports_as_an_empty_list",),
        "an empty list beside lists of dicts or tensors exports as their list type, not a union Parquet refuses",
    ),
    Mutation(
        "no-flat-column-only-lists-of-dicts-hold",
        "spillmerge/_read/arrow.py",
        "                if hidden is None or _meets(_valued([col], offs, ()), ~hidden):\n",
        "                if True:\n",
        ("tests/read/test_reader_edges.py::test_a_key_only_lists_of_dicts_hold_makes_no_flat_column_of_nulls",),
        "a key whose only values are inside lists of dicts makes no exported column of nulls beside them",
    ),
    Mutation(
        "empty-nested-lists-take-the-items-type",
        "spillmerge/_read/arrow.py",
        "            if like is not None:\n",
        "            if False:\n",
        (
            "tests/read/test_reader_edges.py::"
            "test_empty_nested_lists_beside_deeper_lists_of_dicts_or_tensors_export_as_their_list_type",
        ),
        "[[]] beside lists of lists of dicts or tensors exports as their list type, not a union Parquet refuses",
    ),
    Mutation(
        "exported-node-pruned-to-its-rows",
        "spillmerge/_read/arrow.py",
        "            kept = node.pruned(lambda c: bool(L.any_per_row(offs, F.list_domain(c.info.leaf), _held(c))[own].any()))\n",
        "            kept = node.pruned(lambda c: True)\n",
        ("tests/read/test_reader_edges.py::test_a_column_beside_lists_of_dicts_has_no_union_child_only_their_rows_hold",),
        "a top-level Arrow column has no union child or field only rows it does not show hold",
    ),
    Mutation(
        "empty-records-lists-from-arrays",
        "spillmerge/_read/arrow.py",
        "                lists = pa.LargeListArray.from_arrays(nil, arr.values.slice(0, 0), type=arr.type)\n",
        "                lists = pa.array([[]] * len(none), type=arr.type)\n",
        ("tests/read/test_reader_edges.py::test_an_empty_list_beside_lists_of_dicts_of_tensors_or_unions_exports",),
        "an empty list beside lists of dicts holding tensors or unions exports (no Python lists of those types)",
    ),
    Mutation(
        "parquet-untensors-nested-tensors",
        "spillmerge/_read/export.py",
        "        return pa.StructArray.from_arrays(kids, fields=fields, mask=nulls)\n",
        "        return arr\n",
        ("tests/read/test_reader_edges.py::test_tensors_inside_lists_of_dicts_keep_their_shape_in_parquet",),
        "a tensor inside a list of dicts goes to Parquet as nested lists of its shape, not flat",
    ),
    Mutation(
        "flat-records-others-checked-first",
        "spillmerge/_write/writer.py",
        "            item_leaves = self._item_leaves(items[i], i, names, frames, positions)\n            others.append(",
        "            try:\n                item_leaves = self._item_leaves(items[i], i, names, frames, positions)\n"
        "            except SpillValueError:\n                continue\n            others.append(",
        ("tests/write/test_write_batch.py::test_a_bad_batch_raises_naming_the_leaf_and_position_and_writes_nothing",),
        "a batch of records whose bad item holds an empty list is refused whole, naming that item",
    ),
    Mutation(
        "flat-records-kept-items-only",
        "spillmerge/_write/writer.py",
        "            names, frames = [names[i] for i in kept], [frames[i] for i in kept]\n",
        "            pass\n",
        ("tests/write/test_write_batch.py::test_a_batch_is_stored_byte_for_byte_as_its_row_by_row_writes",),
        "records staged a column at a time are filed under their own names when items with an empty list go apart",
    ),
    Mutation(
        "flat-records-row-offsets",
        "spillmerge/_write/staging.py",
        "                cube[:, j, 4] = base + fill + lo\n",
        "                cube[:, j, 4] = base + fill\n",
        ("tests/write/test_write_batch.py::test_a_batch_is_stored_byte_for_byte_as_its_row_by_row_writes",),
        "each row of a batch of flat records is indexed at its own bytes",
    ),
    Mutation(
        "index-rows-of-handed-off-chunks",
        "spillmerge/_write/staging.py",
        "            self._sealed_rows.append(completed_rows(chunk))\n",
        "",
        ("tests/write/test_writer_merge.py",),
        "the index holds the rows of every chunk handed off, not only the last one",
    ),
    Mutation(
        "flat-records-direct-block-crc",
        "spillmerge/_write/staging.py",
        "                        value = _crc.value(src[lo[r] : hi[s - 1]]) if chunk.direct else None",
        "                        value = _crc.value(src[lo[r] : hi[s - 1] - 1]) if chunk.direct else None",
        ("tests/write/test_direct_chunks.py::test_direct_chunks_of_flat_record_batches_match_staged_ones_and_read_back",),
        "a direct writer's block checksum of flat record rows covers exactly their bytes",
    ),
    Mutation(
        "write-batch-multibyte-filename-limit",
        "spillmerge/_write/batch.py",
        "                or max(map(len, names), default=0) <= FILENAME_MAX_BYTES // 4\n",
        "                or max(map(len, names), default=0) <= FILENAME_MAX_BYTES\n",
        (f"{C}::test_write_batch_refuses_a_multibyte_filename_over_the_limit",),
        "write_batch refuses a filename of fewer characters but more UTF-8 bytes than the limit",
    ),
    Mutation(
        "filename-block-starts-with-its-head",
        "spillmerge/_read/filenames.py",
        "        if len(names) and names[0] != self._heads[j]:",
        "        if False:",
        (f"{C}::test_a_filename_block_that_does_not_start_with_its_head_is_refused",),
        "an output whose filename heads disagree with the blocks (files listed, never found) is refused when read",
    ),
    Mutation(
        "file-across-two-row-blocks-checks-both",
        "spillmerge/_read/index.py",
        "            if j != (b - 1) // ROW_BLOCK or j not in self._done:",
        "            if j not in self._done:",
        ("tests/read/test_lazy_index.py::test_a_file_across_two_blocks_is_read_only_after_both_are_checked",),
        "a file whose rows span two row blocks is read only after the second block is checked too",
    ),
    Mutation(
        "row-valid-in-one-variant-only",
        "spillmerge/_read/index.py",
        "        if count.size and int(count.max()) > 1:",
        "        if False:",
        ("tests/read/test_lazy_index.py::test_a_row_with_a_value_in_two_variants_of_a_leaf_is_refused",),
        "a row marked valid in two variant columns of a leaf is refused when read, not read as either",
    ),
    Mutation(
        "iter-values-checks-frame-offsets-first",
        "spillmerge/_read/values.py",
        "        if len(fo) != i1 - i0 + 1 or fo[0] < 0 or fo[-1] > files.n_rows or np.any(fo[1:] < fo[:-1]):",
        "        if False:",
        ("tests/read/test_lazy_index.py::test_iter_values_names_frame_offsets_decreasing_across_chunks",),
        "iter_values over damaged frame offsets names index/frame_offsets, not the rows they misattribute",
    ),
    Mutation(
        "frames-ascend-across-row-block-edges",
        "spillmerge/_read/index.py",
        "        lo = r0 - 1 if r0 else r0",
        "        lo = r0",
        ("tests/read/test_lazy_index.py::test_frames_descending_across_a_row_blocks_edge_are_refused",),
        "a file's frame indices descending where its rows cross a row block's edge are refused when read",
    ),
    Mutation(
        "list-header-agrees-with-its-list-offsets",
        "spillmerge/_read/values.py",
        'if dtype in ("pylist", "pytuple") and n != max(items, 0):',
        'if dtype in ("pylist", "pytuple") and n < 0:',
        ("tests/format/test_lists.py::test_damaged_list_offsets_are_refused_naming_the_array",),
        "value() refuses a list header that disagrees with its list offsets, not padded with None",
    ),
    Mutation(
        "arrow-tuple-mark-only-for-tuples",
        "spillmerge/_read/arrow.py",
        '    meta = TUPLE_META if ps and all(k[0] == "pytuple" for k, _, _, _ in ps) else None',
        '    meta = TUPLE_META if ps and any(k[0] == "pytuple" for k, _, _, _ in ps) else None',
        ("tests/read/test_arrow_values.py::test_only_a_leaf_that_is_a_tuple_in_every_row_is_marked_as_tuples",),
        "Arrow marks a column as tuples only when every row's value is a tuple, not lists mixed with tuples",
    ),
    Mutation(
        "one-list-group-per-list",
        "spillmerge/_format/lists.py",
        "        if key in out:\n",
        "        if False:\n",
        ("tests/format/test_lists.py::test_a_list_group_the_lists_do_not_account_for_is_refused",),
        "an output with two list groups for one list path is refused (their items could disagree)",
    ),
    Mutation(
        "nested-list-group-has-its-parent",
        "spillmerge/_format/lists.py",
        "        if stored.parent and stored.parent not in out:",
        "        if False:",
        ("tests/format/test_lists.py::test_a_list_group_the_lists_do_not_account_for_is_refused",),
        "an output with a list group of items of a list that has no group is refused",
    ),
    Mutation(
        "cached-chunks-read-only",
        "spillmerge/_read/cache.py",
        "            arr.flags.writeable = False\n",
        "",
        (f"{C}::test_arrays_a_reader_returns_cannot_change_what_it_reads_next",),
        "an array a read returns cannot change what later reads return (cached chunks are shared)",
    ),
    Mutation(
        "filename-suggestions-only-a-typo-away",
        "spillmerge/_read/filenames.py",
        "(d := _edits(name, c, limit)) <= limit",
        "(d := _edits(name, c, limit)) <= limit + 1",
        ("tests/inspect/test_inspect_cli.py::test_a_mistyped_filename_suggests_only_names_a_typo_away",),
        "a mistyped filename suggests only names a few typos away, never names that merely share a prefix",
    ),
    # ------------------------------------------------- issue 37: remove only what was merged, gather called twice
    Mutation(
        "g37-remove-spill-only-planned-segments",
        "spillmerge/_spill/removal.py",
        "            why = None if rel in planned else",
        "            why = None if rel in planned or read_segment(src, rank, name).commit is not None else",
        ("tests/spill/test_remove_spill.py::test_a_segment_committed_or_opened_while_the_merge_ran_stays",),
        "remove_spill never deletes a segment committed after the merge's plan was made",
    ),
    Mutation(
        "g37-remove-spill-keeps-a-live-segment",
        "spillmerge/_spill/removal.py",
        "    if seg.failure is None and not superseded:",
        "    if False:",
        ("tests/spill/test_remove_spill.py::test_a_segment_committed_or_opened_while_the_merge_ran_stays",),
        "remove_spill never deletes a segment still being written (no commit or failure record, no later session merged)",
    ),
    Mutation(
        "g37-remove-spill-keeps-frames-the-output-lacks",
        "spillmerge/_spill/removal.py",
        "    if missing:\n        return (",
        "    if False:\n        return (",
        ("tests/spill/test_remove_spill.py::test_a_killed_segment_whose_frames_the_output_lacks_is_kept_with_them",),
        "remove_spill keeps an abandoned (killed) segment whose journaled frames the output lacks",
    ),
    Mutation(
        "g37-writer-remove-spill-before-commit",
        "spillmerge/_write/lifecycle.py",
        "        if self._state is not WriterState.COMMITTED:\n            raise WriterClosedError(\n"
        "                f\"SpillWriter for rank {self.rank} is {self._state}; only a committed spill is removed\"",
        "        if False:\n            raise WriterClosedError(\n"
        "                f\"SpillWriter for rank {self.rank} is {self._state}; only a committed spill is removed\"",
        ("tests/spill/test_remove_spill.py::test_writer_remove_spill_refuses_before_commit_and_before_merge",),
        "SpillWriter.remove_spill refuses before the writer commits, deleting nothing",
    ),
    Mutation(
        "g37-writer-remove-spill-before-merge",
        "spillmerge/_write/lifecycle.py",
        "        if self._merged_into is None:",
        "        if False:",
        ("tests/spill/test_remove_spill.py::test_writer_remove_spill_refuses_before_commit_and_before_merge",),
        "SpillWriter.remove_spill refuses before the writer merged: only a segment an output holds is removed",
    ),
    Mutation(
        "g37-writer-remove-spill-own-segment-only",
        "spillmerge/_write/lifecycle.py",
        "        remove_listed(self.storage, [self._prefix], failure_record=False)",
        "        remove_listed(self.storage, [f\"{FS.rank_dirname(r)}/{n}\" for r in list_ranks(self.storage) "
        "for n in self.storage.listdir(FS.rank_dirname(r))], failure_record=False)",
        ("tests/spill/test_remove_spill.py::test_writer_remove_spill_removes_only_its_own_merged_segment",),
        "SpillWriter.remove_spill removes this writer's own segment, never another rank's",
    ),
    Mutation(
        "g37-writer-remove-spill-output-holds-it",
        "spillmerge/_write/lifecycle.py",
        "            if not complete_for(output, self.run_id, self._session_number):",
        "            if False:",
        ("tests/spill/test_remove_spill.py::test_writer_remove_spill_everything_takes_only_what_the_output_holds",),
        "SpillWriter.remove_spill keeps its segment unless the output is complete with its round (a later session)",
    ),
    Mutation(
        "g37-writer-remove-spill-everything-only-merged",
        "spillmerge/_write/lifecycle.py",
        "[r for r in rels if self.storage.describe(r) in merged]",
        "rels",
        ("tests/spill/test_remove_spill.py::test_writer_remove_spill_everything_takes_only_what_the_output_holds",),
        "remove_spill(everything=True) removes only the segments the merge's report lists as merged",
    ),
    Mutation(
        "g37-gather-waits-for-dsts-removal",
        "spillmerge/_dist/gather.py",
        "    together = coordinated(session)",
        "    together = False",
        ("tests/distributed/test_gather.py::test_all_gather_called_back_to_back_with_the_same_out_always_works",),
        "no rank returns from gather before dst removed this call's spill (the next call's segments are safe)",
    ),
    # ------------------------------------------------------------------ issue 37: shared writers, waits, CLI
    Mutation(
        "writer-lock",
        "spillmerge/_write/segment.py",
        "        self._lock = threading.Lock()\n",
        "        self._lock = __import__('contextlib').nullcontext()\n",
        ("tests/write/test_writer_threads.py",),
        "threads sharing a SpillWriter take turns: every key of every thread merges exactly",
    ),
    Mutation(
        "wait-notices",
        "spillmerge/_spill/barrier.py",
        "        if waited < timeout:\n            notices(state, segments, run_id)\n",
        "",
        ("tests/spill/test_waits.py",),
        "a merge waiting for commit records names the missing ranks on stderr",
    ),
    Mutation(
        "wait-notices-quiet",
        "spillmerge/_spill/barrier.py",
        "notices = WaitNotices(storage, timeout, quiet=progress is False)",
        "notices = WaitNotices(storage, timeout, quiet=False)",
        ("tests/spill/test_waits.py",),
        "progress=False keeps a waiting merge quiet",
    ),
    Mutation(
        "wait-notices-coordinated",
        "spillmerge/_dist/transfer.py",
        "            notices(state, segments, session.run_id, away)\n",
        "            pass\n",
        ("tests/spill/test_waits.py::test_a_coordinated_merge_names_the_rank_still_writing",),
        "a merge under torch.distributed names on stderr the ranks it waits for",
    ),
    Mutation(
        "cli-broken-pipe",
        "spillmerge/cli.py",
        "    except BrokenPipeError:  # the reader of stdout went away (`spillmerge inspect OUT | head`): exit quietly\n",
        "    except BrokenPipeError:  # the reader of stdout went away (`spillmerge inspect OUT | head`): exit quietly\n"
        "        raise\n",
        ("tests/cli/test_cli_messages.py::test_a_reader_that_goes_away_ends_the_command_quietly",),
        "`spillmerge inspect ... | head` ends quietly (141), not with 'error: Broken pipe'",
    ),
    Mutation(
        "cli-positional-out",
        "spillmerge/cli.py",
        'if unknown and args.command == "merge" and args.out is None and not unknown[0].startswith("-"):',
        "if False:",
        ("tests/cli/test_cli_messages.py::test_a_positional_output_asks_for_out",),
        "`spillmerge merge ROOT OUT` is one line asking for --out OUT, not the top-level usage",
    ),
    Mutation(
        "cli-demo-needs-torch",
        "spillmerge/cli.py",
        '    require_torch("spillmerge demo")',
        "    pass",
        ("tests/cli/test_cli_messages.py::test_demo_without_torch_names_the_install_in_one_line",),
        "`spillmerge demo` without torch is one line naming the install, not a traceback",
    ),
    Mutation(
        "report-size-units",
        "spillmerge/_merge/report.py",
        "{self.n_frames} frames, {size_text(self.nbytes)} from",
        "{self.n_frames} frames, {self.nbytes / (1 << 30):.3f} GiB from",
        ("tests/cli/test_cli_messages.py::test_merge_report_and_verify_print_sizes_in_the_unit_that_fits",),
        "a merge report prints its size in the unit that fits it",
    ),
    # Issue 40: the drop-ins gather_object / all_gather_object (spillmerge/_dist/dropin.py)
    Mutation(
        'records-copy-is-deep',
        "spillmerge/_dist/records.py",
        "                    d[k] = _copy(d[k])",
        "                    d[k] = d[k]",
        ("tests/distributed/test_records.py::test_records_of_one_kind_a_key_are_taken_and_come_back_exactly",),
        "the destination's own records come back as a deep copy: no list or dict shared with what it passed",
    ),
    Mutation(
        'i40-dropin-list-off-dst',
        "spillmerge/_dist/dropin.py",
        '        if object_list:\n            raise DropInArgumentError(',
        '        if False:\n            raise DropInArgumentError(',
        ("tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",),
        'gather_object refuses an output list on a rank other than dst, as torch does',
    ),
    Mutation(
        'i40-dropin-list-length',
        "spillmerge/_dist/dropin.py",
        'if not isinstance(object_list, list) or len(object_list) != world:',
        'if not isinstance(object_list, list):',
        ("tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",),
        'the output list must hold world_size items, refused on every rank naming the rank',
    ),
    Mutation(
        'i40-dropin-dst-and-group-dst',
        "spillmerge/_dist/dropin.py",
        '    if dst is not None and group_dst is not None:',
        '    if False:',
        ("tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",),
        'dst= and group_dst= together are refused with a ValueError, as torch does',
    ),
    Mutation(
        'i40-dropin-subgroup',
        "spillmerge/_dist/dropin.py",
        '        and group is not dist.group.WORLD\n',
        '        and False\n',
        ("tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",),
        'a group other than the default one is refused, not gathered over the wrong ranks',
    ),
    Mutation(
        'i40-dropin-two-hosts',
        "spillmerge/_dist/dropin.py",
        '    if where is None and len(hosts) > 1:',
        '    if False:',
        ("tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",),
        'on several hosts without SPILLMERGE_ROOT / root=, every rank raises ConfigError naming the setting',
    ),
    Mutation(
        'i40-dropin-rank-named',
        "spillmerge/_dist/dropin.py",
        'errors do\n        error = exc.prefixed(f"rank {rank}")',
        'errors do\n        error = exc',
        ("tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",),
        "the rank whose object cannot be stored names itself, as the other ranks' errors do",
    ),
    Mutation(
        'i40-dropin-numpy-back',
        "spillmerge/_dist/shape.py",
        '"numpy": lambda v: _numpy(v) if isinstance(v, torch.Tensor) else v,',
        '"numpy": lambda v: v,',
        ("tests/distributed/test_dropin.py::test_returns_what_torch_returns",),
        'numpy arrays come back as numpy arrays, tensors as tensors',
    ),
    Mutation(
        'i40-dropin-timeout-removes-the-call',
        "spillmerge/_dist/dropin.py",
        "it\n        with contextlib.suppress(Exception):\n            _remove(call, storage_options)\n        raise",
        "it\n        raise",
        ("tests/distributed/test_dropin.py::test_a_rank_too_slow_fails_the_call_everywhere_and_its_folder_goes",),
        "a call that times out on a rank removes its folder on every rank (nobody else is left to)",
    ),
    Mutation(
        'i40-dropin-shared-root',
        "spillmerge/_dist/dropin.py",
        "    if check:\n        _check_shared(",
        "    if False:\n        _check_shared(",
        ("tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",),
        "on several hosts a root some rank does not see is a ConfigError on every rank, nothing left",
    ),
    Mutation(
        'i40-dropin-grad-and-bytearray',
        "spillmerge/_dist/shape.py",
        '"bytearray": lambda v: bytearray(v) if type(v) is bytes else v,\n    "grad": lambda v: v.requires_grad_()',
        '"bytearray": lambda v: v,\n    "grad": lambda v: v.requires_grad_()',
        ("tests/distributed/test_dropin.py::test_returns_what_torch_returns",),
        "a bytearray comes back as a bytearray, as torch returns it",
    ),
    Mutation(
        'writer-dict-key-utf8',
        "spillmerge/_write/flatten.py",
        "            if not utf8_keys(keys):",
        "            if False:",
        ("tests/write/test_value_model.py::test_bad_input_names_filename_frame_and_path_and_loses_nothing",),
        "a dict key with a lone surrogate is refused at write(), not by the flush thread",
    ),
    Mutation(
        'i40-dropin-key-order',
        "spillmerge/_format/keyorder.py",
        "    rank = None if spec is None else spec.get(path) or spec.get(F.general_path(path)[0])\n",
        "    rank = None\n",
        ("tests/distributed/test_dropin.py::test_returns_what_torch_returns",),
        'dicts come back from the drop-ins with their key order',
    ),
    Mutation(
        'i40-dropin-removes-folder',
        "spillmerge/_dist/dropin.py",
        "        if rank == target:  # every rank is done with the call's folder\n            _remove(call, storage_options)",
        '        pass',
        ("tests/distributed/test_dropin.py::test_back_to_back_calls_apart_and_nothing_left",),
        'nothing is left on storage after a drop-in call',
    ),
    Mutation(
        'i40-dropin-cleanup-after-failure',
        'spillmerge/_dist/dropin.py',
        "what the caller sees\n            _remove(call, storage_options)",
        "what the caller sees\n            pass",
        ("tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",),
        "a failed drop-in call's folder is removed once every rank raised",
    ),
    Mutation(
        'i40-dropin-numpy-scalar',
        'spillmerge/_dist/shape.py',
        '"scalars": _scalar,',
        '"scalars": lambda v: v,',
        ("tests/distributed/test_dropin.py::test_returns_what_torch_returns",),
        'numpy scalars come back as numpy scalars',
    ),
    Mutation(
        'i40-dropin-pickled-whole',
        'spillmerge/_dist/shape.py',
        '        self.found["whole"].append(path)\n        return _Whole(obj)',
        '        return obj',
        ("tests/distributed/test_dropin.py::test_returns_what_torch_returns",),
        'with allow_pickle, dicts with int keys, mapping / list / tuple subclasses and dataclasses come back as their own type',
    ),
    Mutation(
        'i40-rowvalue-0d-raw-bits',
        'spillmerge/_read/views.py',
        'raw = np.ascontiguousarray(arr).reshape(arr.shape)',
        'raw = np.ascontiguousarray(arr)',
        ("tests/distributed/test_dropin.py::test_returns_what_torch_returns",),
        'value(as_torch=True) of a 0-d bfloat16 leaf is a 0-d tensor',
    ),
    # Bounded status and exports: readers refuse headers before sizing anything by them.
    Mutation(
        "to-arrow-records-header-matches-its-keys",
        "spillmerge/_read/arrow.py",
        "            bad = np.flatnonzero(have != lengths[pos])",
        "            bad = np.flatnonzero(have < 0)",
        ("tests/read/test_export_bounds.py",),
        "to_arrow refuses a list-of-dicts header that its keys' lists do not match before sizing arrays by it",
    ),
    Mutation(
        "verify-records-header-matches-its-keys",
        "spillmerge/_format/invariants.py",
        "            bad = np.flatnonzero(has & v & (got != n))",
        "            bad = np.flatnonzero(has & v & (got < 0))",
        ("tests/read/test_export_bounds.py",),
        "verify lists a list-of-dicts header that to_arrow refuses",
    ),
    Mutation(
        "status-missing-rank-is-not-done",
        "spillmerge/_inspect/status.py",
        'all(x.state in ("committed", "failed") for x in rows)',
        'all(x.state in ("committed", "failed", "missing") for x in rows)',
        ("tests/inspect/test_status.py::test_status_shows_frames_written_before_a_chunk_fills_and_stalls_only_idle_ranks",),
        "a job with a rank that never started is not done (status --watch goes on)",
    ),
    Mutation(
        "status-folders-outside-the-world-size-are-not-ranks",
        "spillmerge/_inspect/status.py",
        "    outside = [r for r in found if r >= top]",
        "    outside: list[int] = []",
        ("tests/inspect/test_status.py::test_status_reads_rank_folders_within_the_world_size_only",),
        "a rank folder outside the agreed world size is one note, not a rank",
    ),
    Mutation(
        "status-disagreeing-headers-give-no-world-size",
        "spillmerge/_inspect/status.py",
        "    if len(others) == 1:",
        "    if others:",
        ("tests/inspect/test_status.py::test_status_reads_rank_folders_within_the_world_size_only",),
        "segment headers that disagree on the world size give none (no rank count taken from one header)",
    ),
    Mutation(
        "status-missing-ranks-listed-bounded",
        "spillmerge/_inspect/status.py",
        "for r in itertools.islice(absent, LISTED_MISSING)]",
        "for r in absent]",
        ("tests/inspect/test_status.py::test_status_reads_rank_folders_within_the_world_size_only",),
        "a world size of millions costs the first 1000 missing rows, not one row per rank",
    ),
    Mutation(
        "status-bad-progress-record-costs-its-rank-only",
        "spillmerge/_inspect/status.py",
        "    except SpillMergeError as exc:  # advisory: a bad record only costs this rank's counts",
        "    except ZeroDivisionError as exc:  # advisory: a bad record only costs this rank's counts",
        ("tests/inspect/test_status.py::test_a_bad_progress_record_costs_only_its_ranks_counts",),
        "a FIFO or oversized progress.json loses that rank's counts, not the whole status",
    ),
    Mutation(
        "status-shows-staged-frames",
        "spillmerge/_write/staging.py",
        "        self.flusher.progress.staged = lambda: (self.frames, self.offset)\n",
        "",
        ("tests/inspect/test_status.py::test_status_shows_frames_written_before_a_chunk_fills_and_stalls_only_idle_ranks",),
        "status shows frames written before a chunk fills, and a writing rank is not flagged stalled",
    ),
    Mutation(
        "status-not-a-spill-root",
        "spillmerge/_inspect/status.py",
        "        raise _not_a_spill_root(storage)",
        "        pass",
        ("tests/inspect/test_status.py::test_status_of_a_path_that_is_no_spill_root_is_a_one_line_error",),
        "status on a mistyped path or a merged output is a one-line error, not an empty table",
    ),
    Mutation(
        "output-of-another-version-refused-at-open",
        "spillmerge/_read/store.py",
        "        self.format_version: int = F.check_version(header, self.storage.describe(), spill=False)",
        '        self.format_version: int = header.get("format_version")',
        ("tests/format/test_format_version.py::test_an_output_of_another_version_is_refused_naming_both_versions",),
        "an output of another format version is refused at open, naming both versions, never misread",
    ),
    Mutation(
        "output-of-another-version-named-by-verify",
        "spillmerge/_inspect/summary.py",
        '    if isinstance(header, dict) and header.get("format_version") != F.FORMAT_VERSION:',
        "    if False:",
        ("tests/format/test_format_version.py::test_an_output_of_another_version_is_refused_naming_both_versions",),
        "verify says an output of another format version is one, not a list of damage",
    ),
    Mutation(
        "spill-record-of-another-version-refused",
        "spillmerge/_format/common.py",
        "    if type(version) is not int or version != (SPILL_FORMAT_VERSION if spill else FORMAT_VERSION):",
        "    if type(version) is not int:",
        ("tests/format/test_format_version.py",),
        "a spill root or output of another format version is refused naming both versions, never misread",
    ),
    Mutation(
        "column-leaf-with-an-item-position-refused",
        "spillmerge/_format/output.py",
        "        if any(F.item_index(k) is not None for k in leaf):",
        "        if False:",
        ("tests/format/test_format_version.py::test_a_column_naming_a_list_item_by_position_is_refused",),
        "an output column whose leaf names a list item by position (a spill path) is refused at open",
    ),
    # ------------------------------------------------- the stored plan of a merge in parts
    Mutation(
        "stored-plan-array-digest-checked",
        "spillmerge/_merge/planstore.py",
        "        if len(data) != nbytes or digest(data) != self._digests[k]:",
        "        if len(data) != nbytes:",
        ("tests/merge/test_scaleout.py::test_a_stored_plan_pointing_out_of_range_is_never_used",),
        "a stored plan array whose bytes changed (same size) is never used: the plan is built again",
    ),
    Mutation(
        "stored-plan-removed-by-finalize",
        "spillmerge/_merge/scaleout.py",
        "    output.rm_tree(_planstore.PLAN_DIR)  # the parts are done with it (the output is complete)",
        "    pass",
        ("tests/merge/test_planstore.py::test_a_planner_killed_while_building_or_storing_the_plan_reruns_to_the_same_bytes",),
        "the finalize removes the stored plan once the output is complete",
    ),
    Mutation(
        "plan-sql-stale-work-folder-removed",
        "spillmerge/_merge/plansql.py",
        "                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)",
        "                pass",
        ("tests/merge/test_plan_sql.py::test_the_work_folder_goes_after_a_success_an_error_and_a_kill_then_a_rerun",),
        "a plan killed mid-sort leaves its DuckDB work folder; the next plan under the same folder removes it",
    ),
    Mutation(
        "plan-sql-duplicates-resolved-across-batches",
        "spillmerge/_merge/plansql.py",
        "        if not final:  # the last key may go on in the next batch",
        "        if False:",
        ("tests/merge/test_plan_sql.py::test_keys_whose_copies_straddle_sorted_batches_are_decided_whole",),
        "a key whose rows straddle two sorted batches is one row (its copies decided together), whatever the batch size",
    ),
    Mutation(
        "key-order-written-on-layouts",
        "spillmerge/_write/flatten.py",
        "    if w.odd:  # some dict was not in sorted key order: the leaves carry every dict's order",
        "    if False:",
        ("tests/format/test_key_order.py::test_value_and_iter_values_keep_key_order",),
        "a dict's key order reaches the spill layouts (pos) and comes back from value()",
    ),
    Mutation(
        "key-order-write-template-checks-order",
        "spillmerge/_write/templates.py",
        " or tuple(value) != self.order:",
        ":",
        ("tests/format/test_key_order.py::test_dicts_of_tensors_of_one_structure_keep_each_order",),
        "a dict written through the write() template keeps its own key order, not the template's",
    ),
    Mutation(
        "key-order-runs-checked",
        "spillmerge/_format/keyorder.py",
        "                or not end <= run[0] < run[1] <= n_files\n",
        "",
        ("tests/format/test_key_order.py::test_a_damaged_key_order_table_is_refused",),
        "a key_orders run beyond the output's files is refused at open",
    ),
    Mutation(
        "key-order-arrow-struct-fields",
        "spillmerge/_read/arrow.py",
        "        return ordered(self.keys, self.path, self.order)",
        "        return sorted(self.keys.items())",
        ("tests/format/test_key_order.py::test_arrow_export_follows_the_key_order",),
        "Arrow struct fields follow the dicts' key order",
    ),
    Mutation(
        "stored-plan-carries-key-orders",
        "spillmerge/_merge/planstore.py",
        '            "key_orders": plan.key_orders,',
        "",
        ("tests/merge/test_scaleout.py::test_cli_parts_then_finalize_equal_one_process_merge",),
        "a merge in parts writes the dicts' key order its stored plan carries, as a whole merge does",
    ),
    Mutation(
        "plan-sort-memory-floor",
        "spillmerge/_merge/plansql.py",
        "    limit = max(int(memory_limit) // ENGINE_SHARE, MIN_SORT_MEMORY)",
        "    limit = max(int(memory_limit) // ENGINE_SHARE, 1 << 20)",
        ("tests/merge/test_plan_sql.py::test_a_plan_budget_below_what_the_sort_needs_is_raised_to_it",),
        "a plan_budget below what DuckDB can sort in is raised to the floor, not an out-of-memory failure",
    ),
    Mutation(
        "i40-gloo-group-has-the-call-timeout",
        "spillmerge/_dist/rank.py",
        "    key = (id(dist.group.WORLD), float(timeout))",
        "    key = (id(dist.group.WORLD), 0.0)",
        (
            "tests/distributed/test_dropin.py::test_a_rank_that_never_calls_is_a_timeout_error_not_a_hang",
            "tests/distributed/test_gather.py::test_a_call_s_timeout_bounds_its_waits_after_calls_with_longer_ones",
        ),
        "a call waits for a rank that never calls at most its own timeout, not an earlier call's",
    ),
    Mutation(
        "i40-small-plan-sorted-by-frame",
        "spillmerge/_merge/plansql.py",
        '    order = np.lexsort((lp, rows["seg"], rows["frame"], rank))',
        '    order = np.lexsort((lp, rows["seg"], rank))',
        ("tests/merge/test_plan_in_memory.py::test_a_small_plan_in_memory_equals_the_duckdb_plan",),
        "a small plan sorted in memory orders rows as the DuckDB sort does (frames ascending within a file)",
    ),
    Mutation(
        "i40-small-merge-no-pool",
        "spillmerge/_merge/opening.py",
        "    return 1 if small else job.threads",
        "    return job.threads",
        ("tests/merge/test_plan_in_memory.py::test_a_small_merge_starts_neither_duckdb_nor_a_thread_pool",),
        "a small merge between local storages writes its chunks and index without a thread pool",
    ),
    Mutation(
        "flush-worker-skips-chunk-fsync",
        "spillmerge/_write/flush.py",
        "        if self.fsync and chunk.number >= self._synced:",
        "        if self.fsync and chunk.number > self._synced:",
        ("tests/write/test_nothing_lost_writer.py::test_a_writer_killed_with_several_flush_workers_in_flight_journals_only_durable_chunks",),
        "a data chunk is fsynced (in a group commit) before any journal entry names it, with several flush workers in flight",
    ),
    Mutation(
        "journal-before-chunk-folder-sync",
        "spillmerge/_write/flush.py",
        "            self.storage.sync(names, up=False)",
        "            pass",
        ("tests/write/test_nothing_lost_writer.py::test_a_writer_killed_with_several_flush_workers_in_flight_journals_only_durable_chunks",),
        "a journal entry is written only after its chunks and the folder naming them were fsynced",
    ),
    Mutation(
        "copy-pending-block-combine-ignored",
        "spillmerge/_merge/outputchunk.py",
        "            if got == value and pos == b_off + b_nb:",
        "            if True:",
        ("tests/merge/test_copy_checks.py::test_a_flipped_byte_in_a_block_spread_over_output_chunks_fails_the_merge",),
        "a block checked from its rows' CRC-32Cs (combined as they are copied) still catches a flipped byte",
    ),
    Mutation(
        "copy-partial-block-never-read",
        "spillmerge/_merge/outputchunk.py",
        "            if (s, block) not in self.checked:\n                job.check_block(s, block, r, e)",
        "            if False:\n                job.check_block(s, block, r, e)",
        ("tests/merge/test_copy_checks.py::test_a_flipped_byte_in_a_block_whose_rows_are_not_all_merged_fails_the_merge",),
        "a block whose rows are not all in the merge is read and checked once the copy is done",
    ),
    Mutation(
        "records-same-key-order",
        "spillmerge/_write/leaves.py",
        "    if set(map(type, keys)) != {str} or not utf8_keys(keys) or not all(map(keys.__eq__, map(tuple, items))):",
        "    if set(map(type, keys)) != {str} or not utf8_keys(keys):",
        ("tests/write/test_value_model.py::test_python_payload_shapes_come_back_exactly",),
        "a list of dicts with the same keys in different orders keeps each dict's order",
    ),
    Mutation(
        "staging-buffer-freed-before-its-write",
        "spillmerge/_write/flush.py",
        '        self.storage.put(f"{self.prefix}/{FS.DATA_NAME}/c/{chunk.number}", buf[:size].data)\n        self._release(chunk)',
        '        self._release(chunk)\n        self.storage.put(f"{self.prefix}/{FS.DATA_NAME}/c/{chunk.number}", buf[:size].data)',
        ("tests/write/test_flush_overlap.py::test_a_buffer_is_refilled_only_after_its_bytes_are_written",),
        "a flush worker gives a staging buffer back only once its bytes are written, never while write() could refill it",
    ),
    Mutation(
        "staging-buffer-held-through-fsync",
        "spillmerge/_write/flush.py",
        "                    bound = self.pool.n_buffers  # + flush_threads uploads in flight",
        "                    bound = 0",
        ("tests/write/test_flush_overlap.py::test_write_fills_buffers_while_earlier_chunks_wait_for_their_fsync",),
        "write() refills staging buffers while the flush workers fsync earlier chunks",
    ),
    Mutation(
        "s45-plan-file-goes-on-across-blocks",
        "spillmerge/_merge/plansql.py",
        "files != np.append(last_file, files[:-1])",
        "files != np.append(-1, files[:-1])",
        ("tests/merge/test_plan_blocks.py::test_the_plan_is_the_same_whatever_the_block_size_and_with_maps",),
        "a file whose keys go on from one sorted batch of the plan's rows to the next is one file (its offsets)",
    ),
    Mutation(
        "s45-list-offsets-over-blocks",
        "spillmerge/_merge/plancolumns.py",
        "        total = int(a[hi - 1])",
        "        total = 0",
        ("tests/merge/test_plan_blocks.py::test_the_plan_is_the_same_whatever_the_block_size_and_with_maps",),
        "a list's offsets run on across the blocks of its parent rows",
    ),
    Mutation(
        "plan-name-starts-import-pandas",
        "spillmerge/_merge/plansql.py",
        '            new_name[1:] = np.unpackbits(bits, count=ne.offset + n - 1, bitorder="little")[ne.offset :]',
        "            new_name[1:] = ne.to_numpy(zero_copy_only=False)",
        ("tests/merge/test_plan_in_memory.py::test_a_merge_sorted_by_duckdb_imports_no_pandas",),
        "a merge sorted by DuckDB in a fresh process does not import pandas (a second spent on nothing the merge needs)",
    ),
    Mutation(
        "dropin-one-file-per-element",
        "spillmerge/_dist/dropin.py",
        '            w.write(f"{name}-{i:010d}", 0, v)',
        "            w.write(f\"{name}-0\", i, v)",
        ("tests/distributed/test_dropin.py::test_returns_what_torch_returns",),
        "an element of a gathered list of dicts lacks no key another element has (one file each)",
    ),
    Mutation(
        "columns-empty-records-list",
        "spillmerge/_write/columns.py",
        "    empty = {i for column in columns for i, v in enumerate(column) if type(v) is list and not v}",
        "    empty = set()",
        ("tests/write/test_write_batch.py::test_a_batch_is_stored_byte_for_byte_as_its_row_by_row_writes[coco]",),
        "an item with an empty list of records is stored as write() stores it (an empty list, not empty columns)",
    ),
    Mutation(
        "static-tree-absent-column",
        "spillmerge/_read/values.py",
        "            if part is not None and not all(part):\n",
        "            if False:\n",
        ("tests/read/test_reading.py::test_iter_values_of_frames_holding_a_dict_or_none_at_a_key_is_what_value_gives",),
        "a row without a value in one of its layout's columns is built as value() builds it",
    ),
    Mutation(
        "static-tree-key-order",
        "spillmerge/_read/values.py",
        "kid_nodes = list(ordered(node[\"kids\"], path, order))",
        "kid_nodes = sorted(node[\"kids\"].items())",
        ("tests/read/test_reading.py::test_iter_values_gives_what_value_gives_in_key_order_whatever_the_layouts",),
        "iter_values keeps every dict's key order",
    ),
    Mutation(
        "records-display-key-order",
        "spillmerge/_read/values.py",
        "    for key, column in zip(keys, columns, strict=True):",
        "    for key, column in zip(sorted(keys), columns, strict=True):",
        ("tests/distributed/test_dropin.py::test_returns_what_torch_returns",),
        "a list of dicts comes back with each dict's keys in their order",
    ),
    Mutation(
        "overwrite-checks-the-spill-first",
        "spillmerge/_merge/job.py",
        "                    copy_units(job, todo, check=True)",
        "                    pass",
        ("tests/merge/test_nothing_lost_output.py::test_an_overwrite_that_meets_a_corrupt_spill_keeps_the_complete_output",),
        "a complete output is replaced only after the spill's rows replacing it have been checked",
    ),
    Mutation(
        "parquet-refuses-empty-structs",
        "spillmerge/_read/export.py",
        "    if empty:\n        raise ParquetTypeError(",
        "    if False:\n        raise ParquetTypeError(",
        ("tests/read/test_reader_agreement.py::test_to_parquet_of_an_empty_dict_is_refused_by_name",),
        "to_parquet refuses a column of only empty dicts by name before writing, not with pyarrow's error",
    ),
    Mutation(
        "dataset-reads-every-variant",
        "spillmerge/_read/dataset.py",
        "    return [col.view(0, col.n_rows) for col in cols]",
        "    return [col.view(0, col.n_rows) for col in cols[:1]]",
        ("tests/read/test_dataset.py::test_every_column_by_default_includes_a_leaf_whose_kind_differs_between_files",),
        "OutputDataset gives a row the value of whichever of a leaf's variants holds it",
    ),
    Mutation(
        "copy-runs-destination",
        "spillmerge/_merge/outputchunk.py",
        " | (dst[1:] != dst[:-1] + n[:-1])) + 1",
        ") + 1",
        ("tests/merge/test_copy_checks.py::test_rows_back_to_back_in_a_spill_land_where_the_output_order_puts_them",),
        "rows are copied where their output offsets say, not back to back as they lie in the spill",
    ),
    Mutation(
        "copy-rows-across-data-chunks",
        "spillmerge/_merge/outputchunk.py",
        "                out[int(start[i]) : int(start[i] + size[i])] = row[int(first[i]) : int(first[i] + size[i])]",
        "                pass",
        ("tests/merge/test_copy_checks.py::test_small_rows_across_data_chunks_come_back_and_a_flipped_byte_in_one_is_named",),
        "a small row that crosses data chunk objects is copied with the rows around it",
    ),
    Mutation(
        "parts-split-by-key-range",
        "spillmerge/_merge/copy.py",
        "        out[min(parts - 1, (2 * done + nb) * parts // max(2 * total, 1))].append(k)",
        "        out[k % parts].append(k)",
        ("tests/merge/test_planstore.py::test_each_part_reads_its_share_of_the_stored_plan_and_the_finalize_almost_none",),
        "a part's output chunks cover one range of keys, so it reads that share of the stored plan",
    ),
    Mutation(
        "damaged-block-in-use-replans",
        "spillmerge/_merge/opening.py",
        "            if self.rebuild is None or \"finish\" in self.phases:",
        "            if True:",
        ("tests/merge/test_scaleout.py::test_a_damaged_stored_plan_is_planned_again",),
        "a stored plan block that fails its digest while a part uses it: the plan is built again, the part redone",
    ),
    Mutation(
        "key-order-runs-carried-across-blocks",
        "spillmerge/_format/keyorder.py",
        "            if runs and runs[-1][1] == f0 and runs[-1][2] == e:  # a run goes on across the block's edge",
        "            if False:",
        ("tests/merge/test_plan_blocks.py::test_key_orders_are_the_same_whatever_the_block_size",),
        "a run of files of one key order goes on across the edge of output_orders' blocks of files",
    ),
    Mutation(
        "group-commit-after-journal-entry",
        "spillmerge/_write/flush.py",
        _GROUP_COMMIT + _JOURNAL_ENTRY,
        _JOURNAL_ENTRY + _GROUP_COMMIT,
        (FSYNC_ORDER,),
        "the journal thread fsyncs a group of chunks before the entry naming them is written, not after",
    ),
    Mutation(
        "group-commit-skips-folder-fsync",
        "spillmerge/_storage/local.py",
        "        paths.update(self._folders(rels, up))\n",
        "",
        (FSYNC_ORDER,),
        "a group commit fsyncs the folder naming its chunks before a journal entry names them",
    ),
    Mutation(
        "group-commit-skips-chunk-fsync",
        "spillmerge/_storage/local.py",
        "        paths = {self.path(r) for r in rels if r not in self._synced}\n",
        "        paths = set()\n",
        (FSYNC_ORDER,),
        "a group commit fsyncs each chunk's bytes, not only its folder, before a journal entry names it",
    ),
    Mutation(
        "key-order-walk-in-row-order-within-a-block",
        "spillmerge/_format/keyorder.py",
        "        first.sort()\n",
        "",
        (
            "tests/merge/test_plan_sql.py::test_a_file_whose_frames_order_one_dict_differently_keeps_the_first_written",
            "tests/merge/test_plan_blocks.py::test_a_merge_planned_in_tiny_blocks_gives_every_dict_in_its_key_order",
        ),
        "a walked file's layouts meet its state in row order within a block of rows, not by layout number",
    ),
    Mutation(
        "s47-array-doc-shape",
        "spillmerge/_merge/documents.py",
        '    doc["shape"] = shape\n',
        "",
        ("tests/merge/test_documents.py::test_every_array_document_is_zarrs_own_form_across_merges_of_other_shapes",),
        "an array document normalised once per kind gets each merge's own shape",
    ),
    Mutation(
        "stored-plan-block-offsets-rise",
        "spillmerge/_merge/planstore.py",
        "        if self._monotonic and n > 1 and bool(np.any(block[1:] < block[:-1])):",
        "        if False:",
        ("tests/merge/test_scaleout.py::test_a_stored_plan_forged_with_matching_digests_is_checked_block_by_block",),
        "a stored plan's offsets block that does not rise is never used, whatever its digest",
    ),
    Mutation(
        "stored-plan-block-first-element",
        "spillmerge/_merge/planstore.py",
        "        if self._first is not None and n and int(block[0]) != self._first[k]:",
        "        if False:",
        ("tests/merge/test_scaleout.py::test_a_stored_plan_forged_with_matching_digests_is_checked_block_by_block",),
        "a stored plan block that does not start with the element plan.json names is never used",
    ),
    Mutation(
        "stored-plan-block-size-bounded",
        "spillmerge/_merge/planstore.py",
        "        if self._rows * self._row_bytes > max(BLOCK_BYTES, self._row_bytes) or self._row_bytes > BLOCK_BYTES:",
        "        if False:",
        ("tests/merge/test_scaleout.py::test_a_stored_plan_forged_with_matching_digests_is_checked_block_by_block",),
        "a stored plan's block size is bounded before anything is read or allocated",
    ),
    Mutation(
        "forked-child-starts-its-own-fsync-threads",
        "spillmerge/_storage/local.py",
        "os.register_at_fork(after_in_child=_fsync_pool.cache_clear)",
        "pass",
        ("tests/storage/test_backends.py::test_a_process_forked_after_a_spill_spills_and_merges",),
        "a process forked after a spill syncs with threads of its own, not its parent's (which it lacks)",
    ),
    Mutation(
        "py-template-long-list-types",
        "spillmerge/_write/templates.py",
        "raw: Any = exact_numbers(v, len(v), typ, how) if",
        "raw: Any = array.array(how, v) if",
        ("tests/write/test_values.py::test_long_number_lists_are_stored_as_the_general_walk_stores_them_whatever_item_breaks_them",),
        "write()'s template checks every item of a long list too (marshal): [1, ..., True] is no list of ints",
    ),
    Mutation(
        "columns-number-types",
        "spillmerge/_write/columns.py",
        "        if operator.countOf(map(type, items(lists)), kind) != count:\n            return False\n",
        "",
        ("tests/write/test_write_batch.py::test_many_numbers_with_an_odd_item_anywhere_are_stored_as_row_by_row_writes",),
        "write_batch stores a column of numbers as one array only when every item is exactly of its kind",
    ),
    Mutation(
        "py-template-item-types",
        "spillmerge/_write/templates.py",
        "(len(v) > 1 and set(map(type, v)) != {typ})",
        "False",
        ("tests/write/test_values.py::test_python_dicts_of_one_structure_are_stored_as_the_general_walk_stores_them",),
        "write()'s template of a Python dict checks every list item's type: [1, True] is no list of ints",
    ),
    Mutation(
        "iter-values-run-key-order",
        "spillmerge/_read/values.py",
        "                        and orders[g + 1] is order\n",
        "",
        ("tests/read/test_reading.py::test_iter_values_of_flat_dicts_in_runs_is_what_value_gives",),
        "a run of flat dicts read at once ends where a file's key order changes",
    ),
    Mutation(
        "segments-kept-within-budget",
        "spillmerge/_spill/lazy.py",
        "        if cost <= self._kept[0]:",
        "        if False:",
        ("tests/merge/test_plan_sql.py::test_a_small_merge_reads_each_segment_once_a_large_one_again_for_each_pass",),
        "a small merge keeps each segment it read for the sort loaded for the key-order pass",
    ),
    Mutation(
        "segments-let-go-past-budget",
        "spillmerge/_spill/lazy.py",
        "            return\n        self._whole = None\n",
        "            return\n",
        ("tests/merge/test_plan_sql.py::test_a_small_merge_reads_each_segment_once_a_large_one_again_for_each_pass",),
        "past the keep budget a segment's catalog and index are let go between passes (one held at a time)",
    ),
    Mutation(
        "stream-frame-twice",
        "spillmerge/_merge/plancheck.py",
        "    if not same.any():\n        return\n",
        "    if True:\n        return\n",
        (
            "tests/merge/test_plan_stream.py::test_a_damaged_segment_read_a_block_at_a_time_raises_what_a_whole_read_does[frame-twice]",
        ),
        "a segment read a block at a time: a frame its index lists twice is found on the sorted rows",
    ),
    Mutation(
        "stream-name-twice-count",
        "spillmerge/_merge/plancheck.py",
        "        if seen and int(np.count_nonzero(np.asarray(stamp) == si)) != seen:",
        "        if False:",
        (
            "tests/merge/test_plan_stream.py::test_a_damaged_segment_read_a_block_at_a_time_raises_what_a_whole_read_does[name-twice-other-frames]",
        ),
        "a segment read a block at a time: two catalog names with rows of other frames are found by their file numbers",
    ),
    Mutation(
        "stream-unused-name-twice",
        "spillmerge/_merge/plancheck.py",
        "        if found != len(ids):",
        "        if False:",
        (
            "tests/merge/test_plan_stream.py::test_a_damaged_segment_read_a_block_at_a_time_raises_what_a_whole_read_does[unused-name-twice]",
        ),
        "a segment read a block at a time: a catalog name without rows equal to another is found",
    ),
    Mutation(
        "stream-commit-crc",
        "spillmerge/_spill/stream.py",
        ' != crc or crc != want:',
        " != crc:",
        (
            "tests/merge/test_plan_stream.py::test_a_damaged_segment_read_a_block_at_a_time_raises_what_a_whole_read_does[index-checksum]",
            "tests/merge/test_plan_stream.py::test_a_damaged_segment_read_a_block_at_a_time_raises_what_a_whole_read_does[catalog-checksum]",
        ),
        "a catalog and an index read a block at a time are checked against the commit record's CRC-32C after the last block",
    ),
    Mutation(
        "stream-damaged-between-passes",
        "spillmerge/_spill/lazy.py",
        "            self._load()  # raises the segment's error",
        "            pass",
        (
            "tests/merge/test_plan_stream.py::test_an_index_damaged_between_the_plans_passes_raises_what_a_whole_read_does",
        ),
        "an index damaged between the plan's passes gives the error a whole read gives",
    ),
    Mutation(
        "direct-group-commit-after-journal-entry",
        "spillmerge/_write/flush.py",
        _GROUP_COMMIT + _JOURNAL_ENTRY,
        _JOURNAL_ENTRY + _GROUP_COMMIT,
        ("tests/write/test_direct_chunks.py::test_a_direct_writers_journal_entry_names_only_chunks_fsynced_after_their_last_write",),
        "a chunk file the caller wrote directly is fsynced, with its folder, after its last write and before the entry naming it",
    ),
    Mutation(
        "direct-writer-unbounded",
        "spillmerge/_write/staging.py",
        "        if self.n_chunks - fl.journaled >= self.pool.n_buffers and fl.ident is not None:",
        "        if False:",
        ("tests/write/test_direct_chunks.py::test_a_direct_writer_waits_while_its_bound_of_chunks_awaits_the_journal",),
        "a direct writer opens a new chunk file only while fewer than n_buffers await their journal entry",
    ),
    Mutation(
        "direct-row-crc-dropped",
        "spillmerge/_write/flush.py",
        "        for row, value in chunk.row_crcs:\n            crc[row] = value\n",
        "",
        ("tests/write/test_direct_chunks.py::test_direct_chunks_hold_the_same_bytes_journal_and_checks_as_staged_ones",),
        "a row a direct chunk took across chunk edges carries the CRC-32C the caller computed from its memory",
    ),
    Mutation(
        "flush-unsynced-bound",
        "spillmerge/_write/flush.py",
        "        while len(self._unjournaled) + len(self._pending) >= self.pool.n_buffers + 1 + self.flush_threads:",
        "        while False:",
        ("tests/write/test_flush_overlap.py::test_chunks_written_ahead_of_their_journal_stay_bounded_when_uploads_report_late",),
        "written chunks awaiting their journal entry stay within n_buffers + 1 plus flush_threads being written",
    ),
    Mutation(
        "dropin-records-one-kind-a-key",
        "spillmerge/_dist/records.py",
        "    if len(kinds) > 1 or depth > _MAX_DEPTH:\n        raise _NotExact",
        "    if depth > _MAX_DEPTH:\n        raise _NotExact",
        ("tests/distributed/test_records.py::test_what_would_not_come_back_exactly_is_declined",),
        "an int and a float under one key never travel as one Arrow column (the int would come back a float)",
    ),
    Mutation(
        "dropin-records-key-order",
        "spillmerge/_dist/records.py",
        "        if not all(type(k) is str for k in keys) or not all(map(keys.__eq__, map(tuple, present))):",
        "        if not all(type(k) is str for k in keys):",
        ("tests/distributed/test_records.py::test_what_would_not_come_back_exactly_is_declined",),
        "dicts of other keys or key orders never travel as one struct column (a key gained as None, an order lost)",
    ),
    Mutation(
        "dropin-records-number-lists-exact",
        "spillmerge/_util/marshalled.py",
        ' or raw[5::size] != code * n:',
        ":",
        ("tests/distributed/test_records.py::test_lists_of_numbers_come_back_exact_whatever_mix_of_kinds_they_hold",),
        "lists of numbers go into one buffer only when every item is exactly of the buffer's kind",
    ),
    Mutation(
        "dropin-records-file-checked",
        "spillmerge/_dist/dropin.py",
        "            if data is None or len(data) != nbytes or crc.value(data) != want:",
        "            if data is None or len(data) != nbytes:",
        ("tests/distributed/test_records.py::test_records_files_come_back_and_damage_is_refused_naming_rank_and_path",),
        "a drop-in's records file whose bytes are not the ones its rank wrote is refused before Arrow reads it",
    ),
    Mutation(
        "plan-in-memory-within-budget",
        "spillmerge/_merge/plansql.py",
        "    return n_rows < max(IN_MEMORY_ROWS, memory_limit // IN_MEMORY_ROW_BYTES)",
        "    return n_rows < memory_limit",
        ("tests/merge/test_plan_in_memory.py::test_the_plan_is_sorted_in_memory_while_the_budget_holds_its_rows",),
        "a plan is sorted in memory only while plan_budget holds its rows (2 KiB a row)",
    ),
    Mutation(
        "crc-combine",
        "spillmerge/_format/crc.py",
        "            crc_a = t0[crc_a & 255] ^ t1[(crc_a >> 8) & 255] ^ t2[(crc_a >> 16) & 255] ^ t3[crc_a >> 24]",
        "            crc_a = t0[crc_a & 255] ^ t1[(crc_a >> 8) & 255] ^ t2[(crc_a >> 16) & 255]",
        ("tests/merge/test_copy_checks.py::test_crc32c_combine_matches_the_crc_of_the_joined_bytes",),
        "the output chunk's CRC-32C combined from its rows' is the CRC of its bytes",
    ),
    Mutation(
        "gc-pause-restarts",
        "spillmerge/_util/gcpause.py",
        "    finally:\n        gc.enable()",
        "    finally:\n        pass",
        ("tests/read/test_gc_state.py",),
        "the garbage collector runs again after a step that paused it",
    ),
    Mutation(
        "gc-pause-keeps-disabled",
        "spillmerge/_util/gcpause.py",
        "    if not gc.isenabled():\n        return fn(*args)\n",
        "",
        ("tests/read/test_gc_state.py",),
        "a caller who disabled the garbage collector finds it disabled after a call",
    ),
    Mutation(
        "removal-keeps-damaged-journal",
        "spillmerge/_spill/removal.py",
        "    if problems and src.listdir(",
        "    if False and src.listdir(",
        ("tests/spill/test_damaged_spill.py::test_remove_spill_keeps_an_ended_segment_whose_journal_is_damaged",),
        "remove_spill never deletes an ended segment whose damaged journal hides what its data holds",
    ),
    Mutation(
        "journal-gap-is-damage",
        "spillmerge/_spill/root.py",
        "            if later:\n                problems.append(",
        "            if False:\n                problems.append(",
        ("tests/spill/test_damaged_spill.py::test_remove_spill_keeps_an_ended_segment_whose_journal_is_damaged",),
        "a journal entry missing before later ones is damage, not the journal's end",
    ),
    Mutation(
        "commit-world-size-matches-header",
        "spillmerge/_spill/root.py",
        "        if said is not None and said != commit.world_size:",
        "        if False:",
        ("tests/spill/test_damaged_spill.py::test_a_commit_record_contradicting_its_header_is_named_as_corrupt",),
        "a commit record whose world size its header contradicts is named as damaged, never called stale",
    ),
    Mutation(
        "dataset-list-items-by-row",
        "spillmerge/_read/dataset.py",
        "            if domain:  # the items of lists",
        "            if False:  # the items of lists",
        ("tests/read/test_dataset.py::test_a_list_column_gives_each_row_its_own_items",),
        "OutputDataset gives a list's items column row i's items, not the i-th item of every row",
    ),
    Mutation(
        "export-distinct-column-names",
        "spillmerge/_read/export.py",
        "        names[T.unique_name(names, name, col.info.leaf)] = col",
        "        names[name] = col",
        ("tests/read/test_reader_agreement.py::test_keys_naming_one_column_export_as_distinct_columns",),
        "a key naming another leaf's export column gets a column of its own",
    ),
    Mutation(
        "export-records-rows-hide-dict-columns",
        "spillmerge/_read/export.py",
        "        if hidden is not None and hidden.any():",
        "        if False:",
        ("tests/read/test_reader_edges.py::test_a_records_row_beside_a_dict_row_exports_without_a_leaked_column",),
        "a column below a path that holds a list of dicts in a row is null there, not the records' column",
    ),
    Mutation(
        "arrow-dict-child-from-the-whole-output",
        "spillmerge/_read/arrow.py",
        "            self._dicts = bool(self.keys_in(offs, False)) or any(",
        "            self._dicts = bool(self.keys_in(offs, False)) and any(",
        ("tests/read/test_reader_edges.py::test_a_list_of_dicts_beside_an_empty_dict_in_lists_has_one_schema_in_every_batch",),
        "whether a list's items have a dict child is decided from the whole output: every batch has one schema",
    ),
    Mutation(
        "transfer-outside-dsts-outcome",
        "spillmerge/_dist/round.py",
        "        if session.rank != dst:\n            transfer()\n",
        "        transfer()\n",
        ("tests/distributed/test_round_failures.py::test_a_transfer_failing_on_dst_is_told_at_once_to_every_waiting_rank",),
        "a transfer failing on dst is told to every rank waiting for the output, not left to its timeout",
    ),
    Mutation(
        "merge-arguments-not-compared",
        "spillmerge/_dist/transfer.py",
        "    if odd:\n        names = ",
        "    if False:\n        names = ",
        ("tests/distributed/test_round_failures.py::test_a_rank_passing_other_arguments_is_named_on_every_rank",),
        "a rank passing merge() another out or dst than the merging rank is named on every rank",
    ),
    Mutation(
        "transfer-sender-failure-not-told",
        "spillmerge/_dist/transfer.py",
        "                failed = exc\n",
        "                raise\n",
        ("tests/distributed/test_round_failures.py::test_a_sender_that_cannot_read_its_shard_is_named_at_once_on_every_rank",),
        "a sender that cannot read its shard tells dst in-band: every rank names it at once, not after the timeout",
    ),
    Mutation(
        "gather-refused-writer-uncounted",
        "spillmerge/_dist/gather.py",
        '        refused(opts["run_id"], rank, world_size, exc)\n',
        "        pass\n",
        (
            "tests/distributed/test_round_failures.py::"
            "test_a_rank_whose_writer_is_refused_is_named_at_once_and_the_next_call_merges",
        ),
        "a rank whose gather writer is refused is named at once, and the ranks' session counts stay alike",
    ),
    Mutation(
        "writer-refused-uncounted",
        "spillmerge/_write/segment.py",
        "                refused(launcher_run_id(run_id), rank, world_size, exc)\n",
        "                pass\n",
        (
            "tests/distributed/test_round_waits.py::"
            "test_a_direct_writer_refused_under_a_launcher_run_id_is_named_at_once_and_the_next_round_merges",
        ),
        "a rank whose SpillWriter is refused under a launcher's run id is named at once, and its session count stays",
    ),
    Mutation(
        "parallel-part-failure-untold",
        "spillmerge/_dist/round.py",
        "                    publish_part_failure(session.run_id, session.number, self.calls, session.rank, exc)\n",
        "                    pass\n",
        (
            "tests/distributed/test_round_waits.py::"
            "test_a_part_failing_before_it_opens_is_named_at_once_and_the_next_call_merges",
        ),
        "a rank whose part of merge(parallel=True) fails before it opens is named by dst at once",
    ),
    Mutation(
        "coord-timeout-blames-dst",
        "spillmerge/_dist/store.py",
        "                    missing = absent\n",
        "                    pass\n",
        (
            "tests/distributed/test_round_kills.py::"
            "test_a_rank_killed_in_each_phase_is_named_by_every_survivor_and_a_rerun_merges[gather]",
        ),
        "a rank waiting for dst's plan names, at its timeout, the ranks dst itself waits for",
    ),
    Mutation(
        "dropin-arguments-not-compared",
        "spillmerge/_dist/dropin.py",
        "    if odd:\n        who = ",
        "    if False:\n        who = ",
        (
            "tests/distributed/test_round_failures.py::test_dropin_a_rank_passing_another_dst_is_named_on_every_rank",
            "tests/distributed/test_round_failures.py::test_dropin_roots_that_differ_are_named_at_once_and_nothing_is_left",
        ),
        "a rank passing a drop-in another dst or root is named on every rank before anything is written",
    ),
    Mutation(
        "dropin-long-message-sent-whole",
        "spillmerge/_dist/dropin.py",
        "    if any(r[0] == _LONG for r in raw):",
        "    if False:",
        (
            "tests/distributed/test_dropin.py::test_a_failing_rank_is_named_on_every_rank",
            "tests/distributed/test_dropin.py::test_back_to_back_calls_apart_and_nothing_left",
        ),
        "a rank's message longer than its slot in the drop-in's all-gathers (a long error, a long root) is sent whole",
    ),
    Mutation(
        "dropin-read-back-failure-untold",
        "spillmerge/_dist/dropin.py",
        '            _settle(rank, target, call, storage_options, error, timeout, "reading back")\n',
        "            pass\n",
        ("tests/distributed/test_round_failures.py::test_dropin_a_rank_failing_to_read_back_is_named_on_every_rank",),
        "a rank that cannot read all_gather_object's result back is named on every rank",
    ),
    Mutation(
        "write-one-element-any-stride",
        "spillmerge/_write/flatten.py",
        "    if t.numel() == 1 and flat.stride(0) != 1:",
        "    if False:",
        ("tests/write/test_write_batch.py::test_one_element_tensors_of_any_stride_are_written",),
        "write() of a one-element bfloat16 tensor of any stride stores its bytes",
    ),
    Mutation(
        "ragged-complex-to-arrow",
        "spillmerge/_read/views.py",
        'return raw.view(raw.real.dtype).reshape(*raw.shape, 2) if raw.dtype.kind == "c" else raw',
        "return raw",
        ("tests/read/test_reader_edges.py::test_a_ragged_complex_leaf_exports_to_arrow_as_real_imag_pairs",),
        "a ragged complex leaf exports to Arrow as (real, imag) pairs",
    ),
    Mutation(
        "update-checked-whole-first",
        "spillmerge/_write/writer.py",
        "            self._put_items(names, frames, values, records=True, positions=False)\n",
        "            for name, frame, value in zip(names, frames, values, strict=True):\n"
        "                self._write(name, frame, value)\n",
        ("tests/write/test_writer_merge.py::test_update_is_all_or_nothing",),
        "update() checks the whole call before it stages a frame: a refused call stages nothing",
    ),
    Mutation(
        "plot-never-through-a-link",
        "spillmerge/_read/export.py",
        "    if os.path.lexists(target) and not stat.S_ISREG(os.lstat(target).st_mode):",
        "    if False:",
        ("tests/cli/test_cli_rough_edges.py::test_a_plot_is_never_written_through_a_link_or_into_a_pipe",),
        "inspect --plot refuses a link, a folder or a pipe at its path, even with --overwrite",
    ),
    Mutation(
        "writer-finalizer-ends-the-flush-thread",
        "spillmerge/_write/staging.py",
        "        self.flusher.q.put(None)\n        chunk = self._current\n",
        "        chunk = self._current\n",
        ("tests/write/test_writer_threads.py::test_a_writer_dropped_while_open_ends_its_threads_and_commits_nothing",),
        "an open writer garbage-collected without close() ends its flush thread",
    ),
    Mutation(
        "b61-transfer-on-the-shared-gloo-group",
        "spillmerge/_dist/transfer.py",
        '    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout)), torch.device("cpu")',
        '    from .rank import gloo_group\n\n    return gloo_group(group_timeout), torch.device("cpu")',
        ("tests/distributed/test_nodelocal.py::test_a_transfer_that_timed_out_leaves_later_collectives_working",),
        "a transfer that timed out leaves no broken gloo group to later collectives",
    ),
    Mutation(
        "b61-dropin-one-host-root-identity",
        "spillmerge/_dist/dropin.py",
        "    check = len(hosts) > 1 or len({tuple(g[5]) for g in got}) > 1\n",
        "    check = len(hosts) > 1\n",
        ("tests/distributed/test_dropin.py::test_a_root_each_rank_of_one_host_has_to_itself_is_refused_in_seconds",),
        "ranks of one host whose root names a folder of each one's own are refused in seconds, not at the timeout",
    ),
    Mutation(
        "subclass-of-a-plain-type-pickled",
        "spillmerge/_write/flatten.py",
        "    elif w.allow_pickle and isinstance(value, (str, int, float, complex)) and not isinstance(value, np.generic):\n",
        "    elif False:\n",
        (
            "tests/write/test_values.py::"
            "test_subclasses_of_plain_types_come_back_as_themselves_with_pickle_and_as_the_plain_type_without",
        ),
        "with allow_pickle an IntEnum comes back as itself, not as an int",
    ),
    Mutation(
        "gather-output-only-dst-sees-named",
        "spillmerge/_dist/gather.py",
        "            if together:  # dst said the output is complete: this rank does not see it\n",
        "            if False:\n",
        ("tests/distributed/test_gather.py::test_all_gather_to_an_output_only_dst_sees_says_so_on_the_other_ranks",),
        "a rank that cannot see the output dst completed says so, not that the merge is incomplete",
    ),
    Mutation(
        "b61-damage-read-during-a-replacement",
        "spillmerge/_read/cache.py",
        "            except CorruptSpillError:\n                self.damage_found()\n                raise\n",
        "            except CorruptSpillError:\n                raise\n",
        (
            "tests/read/test_replaced_output.py::test_a_replacement_of_other_rows_is_refused_as_a_replacement_not_damage",
            "tests/read/test_replaced_output.py::test_an_output_being_replaced_is_named_as_such",
        ),
        "a read of an output being replaced says so, naming the output, not that it is damaged",
    ),
    Mutation(
        "reader-refuses-a-replaced-output",
        "spillmerge/_read/store.py",
        "        if marker != self._marker:",
        "        if False:",
        ("tests/read/test_replaced_output.py::test_a_cached_chunk_is_not_mixed_with_the_replacement",),
        "a store opened before an overwrite never serves its cached chunks beside the replacement's",
    ),
]


def _copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in ("spillmerge", "tests"):
        shutil.copytree(REPO / name, dst / name, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", dst / "pyproject.toml")


def _pytest(tree: Path, tests: tuple[str, ...]) -> tuple[str, str, float]:
    """``(PASSED | FAILED | TIMEOUT, what failed, seconds)`` of the tests run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", f"no result within {TIMEOUT} s", time.monotonic() - t0
    seconds = time.monotonic() - t0
    if p.returncode == 0:
        return "PASSED", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", p.stdout, flags=re.M)
    return "FAILED", ", ".join(failed) or (p.stdout + p.stderr).strip().splitlines()[-1], seconds


def _apply(tree: Path, m: Mutation) -> None:
    """Mutate the copy; a mutant that does not compile would be "killed" by any test: refuse it."""
    path = tree / m.file
    text = path.read_text(encoding="utf-8").replace(m.original, m.replacement)
    compile(text, str(path), "exec")
    path.write_text(text, encoding="utf-8")


def _stale(ms: list[Mutation]) -> list[str]:
    out = []
    for m in ms:
        n = (REPO / m.file).read_text(encoding="utf-8").count(m.original)
        if n != 1:
            out.append(f"{m.name}: snippet found {n} times in {m.file} (expected once)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the tests without mutation")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name:40} {m.file:28} {m.why}")
        return 0
    stale = _stale(chosen)
    if stale:
        print("\n".join(stale), file=sys.stderr)
        return 2
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spillmerge-mutation-") as tmp:
        clean = Path(tmp) / "clean"
        _copy_tree(clean)
        if not args.no_baseline:
            every = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            status, what, seconds = _pytest(clean, every)
            print(f"baseline (no mutation): {status} in {seconds:.0f} s {what}", flush=True)
            if status != "PASSED":
                print("the selected tests fail without any mutation: fix them first", file=sys.stderr)
                return 1
        rows = []
        for m in chosen:
            tree = Path(tmp) / m.name
            _copy_tree(tree)
            _apply(tree, m)
            status, what, seconds = _pytest(tree, m.tests)
            verdict = "SURVIVED" if status == "PASSED" else "KILLED"
            rows.append((m.name, verdict, what, seconds))
            print(f"{verdict:8} {m.name:40} {seconds:5.0f} s  {what}", flush=True)
            shutil.rmtree(tree)
    survived = [r for r in rows if r[1] == "SURVIVED"]
    print("\n| mutation | result | caught by | s |\n|---|---|---|---|")
    for name, verdict, what, seconds in rows:
        print(f"| {name} | {verdict} | {what or '—'} | {seconds:.0f} |")
    print(f"\n{len(rows) - len(survived)} of {len(rows)} killed in {time.monotonic() - t_all:.0f} s")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
