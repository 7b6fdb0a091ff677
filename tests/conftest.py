"""Shared fixtures. Multi-rank tests spawn real processes (see test_multirank.py)."""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# The tests live in folders mirroring the package's stages; a test file may import helpers from
# another folder's file (``from test_cli import cli_run``), so every folder is on the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = sorted(e.path for e in os.scandir(_HERE) if e.is_dir() and not e.name.startswith(("_", ".")))

# One intra-op thread in every process the tests start (torch reads it at import): the suite's
# processes share two cores. torch itself is imported only by the tests that need it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_counter = itertools.count()

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis comes with the test extra; the property tests skip without it
    pass
else:
    # The property tests spill, merge and read a root per example: a few examples by default, many
    # under HYPOTHESIS_PROFILE=ci (a thorough run). Fixtures are reused across examples on purpose
    # (a pristine root is copied, a tmp_path_factory folder made per example).
    _common: dict[str, Any] = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}
    settings.register_profile("dev", max_examples=12, **_common)
    settings.register_profile("ci", max_examples=100, **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """One moto S3 server for the session, on 127.0.0.1 and a free port."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from _s3 import S3Server

    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: Any) -> Iterator[Any]:
    """The session's S3 server, reset, with an empty bucket ``test``."""
    s3_server.reset()
    s3_server.create_bucket("test")
    yield s3_server
    s3_server.reset()


@dataclass
class Backend:
    """Where a test puts its spill roots and outputs."""

    name: str
    """local, memory or s3."""
    base: str
    """A URL prefix unique to the test."""
    options: dict[str, Any]
    """fsspec storage options for ``base``."""

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"


def _backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
    """The storage named by ``request.param``, empty and unique to the test."""
    if request.param == "local":
        yield Backend("local", str(tmp_path), {})
    elif request.param == "memory":
        import fsspec

        base = f"memory://t{next(_counter)}"
        yield Backend("memory", base, {})
        fsspec.filesystem("memory").rm(base.removeprefix("memory://"), recursive=True)
    else:
        server = request.getfixturevalue("s3")
        from _s3 import storage_options

        yield Backend("s3", f"s3://test/t{next(_counter)}", storage_options(server.endpoint))


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
    """A local directory, memory:// and a real S3 server: for the storage conformance tests
    (test_backends.py) and the tests whose point is how an object store behaves."""
    yield from _backend(request, tmp_path)


@pytest.fixture(params=["local", "memory"])
def backend_no_s3(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
    """A local directory and memory:// (a file system and an object store without folders): for
    tests of what is written and read, not of the storage. The storage calls they make are the
    ones the ``backend`` tests check against a real S3 server, where each test costs 10-60 s."""
    yield from _backend(request, tmp_path)


#: Test files (``file``) or tests (``file::function``) by the tier they belong to: ``make test-fast``
#: deselects these markers (the tests that start rank processes, need a framework or a model, or
#: take seconds each: a plan sorted out of core, processes killed and rerun, console-script or CLI
#: runs, a fresh venv or interpreter, a storage fault at each kind of write of a parallel merge).
TIERS: dict[str, str] = {
    "multiprocess": (
        "test_dropin test_failures test_gather test_guards_multirank test_multirank test_nodelocal "
        "test_object_collectives test_torchrun test_status test_waits test_s3 test_untrusted_storage test_stale_root "
        "test_round_failures test_round_waits test_round_kills"
    ),
    "framework": "test_integrations test_examples",
    "model": "test_model_outputs",
    "slow": (
        "test_plan_sql::test_a_plan_larger_than_its_memory_limit_is_built_out_of_core_and_equals_the_plan_in_memory "
        "test_plan_sql::test_the_work_folder_goes_after_a_success_an_error_and_a_kill_then_a_rerun "
        "test_plan_sql::test_keys_whose_copies_straddle_sorted_batches_are_decided_whole "
        "test_arrow_values::test_every_kind_of_value_in_one_output_reads_back_row_by_row "
        "test_arrow_values::test_one_type_outputs_read_as_before_in_polars_and_duckdb "
        "test_nothing_lost_writer::test_random_sigkills_of_a_dict_writer_salvage_only_whole_frames "
        "test_nothing_lost_writer::test_a_rank_killed_at_exact_moments_leaves_whole_frames_or_nothing "
        "test_planstore::test_parts_started_at_once_with_different_plan_budgets_plan_once_and_match_a_whole_merge "
        "test_planstore::test_a_planner_killed_while_building_or_storing_the_plan_reruns_to_the_same_bytes "
        "test_scaleout::test_with_timeout_0_a_part_waits_for_the_plan_while_the_planner_runs "
        "test_scaleout::test_parts_stop_waiting_for_the_plan_when_the_planner_fails "
        "test_no_torch::test_reading_works_without_torch "
        "test_nothing_lost_reader::test_inspect_costs_frames_not_the_span_of_frame_indices "
        "test_cli::test_demo_runs_end_to_end_with_config "
        "test_cli::test_incomplete_spill_names_the_rank "
        "test_value_model::test_iter_values_gives_every_row_in_order_as_value_gives_it "
        "test_guards::test_a_rank_sigkilled_mid_spill_leaves_a_salvageable_prefix "
        "test_nothing_lost_output::test_a_merge_killed_at_random_points_is_rebuilt_by_the_next "
        "test_duplicate_attribution::test_identical_duplicates_are_attributed_to_the_lowest_rank_whatever_started_first "
        "test_remove_spill::test_cli_remove_spill_and_an_interrupted_merge_keeps_it "
        "test_imports::test_every_module_imports_on_its_own "
        "test_cli::test_console_script_is_installed_and_runs_a_merge "
        "test_cli_messages::test_a_reader_that_goes_away_ends_the_command_quietly "
        "test_nothing_lost_writer::test_a_batch_writer_killed_mid_stream_salvages_whole_frames_checked_by_their_blocks "
        "test_nothing_lost_output::test_two_merges_into_one_output_never_both_write "
        "test_values::test_a_million_element_list "
        "test_planstore::test_a_stored_plan_file_that_is_no_plain_file_is_refused_or_rebuilt_never_followed "
        "test_nothing_lost_writer::test_a_writer_killed_with_several_flush_workers_in_flight_journals_only_durable_chunks "
        "test_plan_in_memory::test_a_small_merge_starts_neither_duckdb_nor_a_thread_pool "
        "test_direct_chunks::test_a_direct_writer_killed_mid_chunk_salvages_every_journaled_frame "
        "test_direct_chunks::test_direct_writers_killed_at_random_moments_salvage_only_journaled_frames "
        "test_direct_chunks::test_a_direct_writer_killed_while_writing_a_journal_entry_salvages_the_entries_before_it "
        "test_fault_sweep::test_a_fault_at_each_kind_of_write_of_parts_and_finalize_loses_nothing "
        "test_fault_sweep::test_a_fault_at_each_kind_of_write_of_merge_parallel_loses_nothing "
        "test_plan_in_memory::test_a_merge_sorted_by_duckdb_imports_no_pandas "
        "test_torch_blocked::test_reading_needs_no_torch"
    ),
}


#: The files whose tests take longest, longest first (a full run's ``--durations``; after them the
#: longest of ``make test-fast``'s own). ``make test`` runs with ``--no-loadscope-reorder``: xdist
#: hands out work in collection order, so these start first and no worker is left alone with a
#: long one at the end.
FIRST = (
    "test_model_outputs test_untrusted_storage test_examples test_plan_sql test_torchrun "
    "test_object_collectives test_integrations test_s3 test_gather test_failures test_nodelocal test_s3_outage "
    "test_dropin test_round_failures test_waits test_guards_multirank test_multirank test_round_kills test_status "
    "test_stale_root test_round_waits test_every_value "
    "test_nothing_lost_writer test_scaleout test_planstore test_nothing_lost_reader test_nothing_lost_output "
    "test_arrow_values test_properties test_backends test_duplicate_attribution test_no_torch test_cli "
    "test_write_batch test_reader_agreement test_reading test_lazy_index test_value_model test_imports test_writer_merge"
)

#: Files whose tests share no module-scoped set-up and take seconds each: under ``--dist loadfile``
#: their tests go to the workers one by one instead of as one file (tests/project/test_tiers.py checks
#: they hold no module fixture: a worker would build it again each time it comes back to the file; a
#: set-up their tests share is session-scoped, built at most once per worker). Every other file goes
#: to one worker whole.
SPREAD = (
    "test_examples test_plan_sql test_torchrun test_integrations test_s3 test_failures test_s3_outage test_waits "
    "test_status test_stale_root test_every_value test_nothing_lost_writer test_scaleout test_planstore "
    "test_nothing_lost_output test_arrow_values test_properties test_backends test_duplicate_attribution test_cli "
    "test_write_batch test_reader_agreement test_value_model test_writer_merge"
)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, except that the tests of ``SPREAD`` files are units of their own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    spread = set(SPREAD.split())

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return nodeid if file.rsplit("/", 1)[-1].removesuffix(".py") in spread else file

    return Scheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = {name: mark for mark, names in TIERS.items() for name in names.split()}
    first = {name: i for i, name in enumerate(FIRST.split())}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: the rest keep their order
    for item in items:
        for key in (item.path.stem, f"{item.path.stem}::{getattr(item, 'originalname', item.name)}"):
            if key in tier:
                item.add_marker(getattr(pytest.mark, tier[key]))
        if "s3_server" in getattr(item, "fixturenames", ()):  # starts the moto server, however reached
            item.add_marker(pytest.mark.s3)
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _thread_police():
    """Fail a test that leaves spillmerge threads running (a leaked flush or merge thread). The
    fsync threads are the one pool meant to outlive a call: started once per process, shared by
    every sync (``_storage/local._fsync_pool``)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.is_alive() and t.name.startswith("spillmerge")
        and not t.name.startswith("spillmerge-fsync")
    ]
    for t in leaked:
        t.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"test left spillmerge threads running: {leaked}"
