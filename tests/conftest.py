"""Shared fixtures. Multi-rank tests spawn real processes (see test_multirank.py)."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# One intra-op thread in every process the tests start (torch reads it at import): the suite's
# processes share two cores. torch itself is imported only by the tests that need it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_counter = itertools.count()


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


#: Test files by the tier they belong to: ``make test-fast`` deselects these markers (the
#: tests that start rank processes, need a framework or a model, or are slow for another reason).
TIERS: dict[str, str] = {
    "multiprocess": (
        "test_dropin test_failures test_gather test_guards_multirank test_multirank test_nodelocal "
        "test_object_collectives test_torchrun test_status test_waits test_s3 test_untrusted_storage"
    ),
    "framework": "test_integrations test_examples",
    "model": "test_model_outputs",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = {name: mark for mark, names in TIERS.items() for name in names.split()}
    for item in items:
        mark = tier.get(item.path.stem)
        if mark is not None:
            item.add_marker(getattr(pytest.mark, mark))
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
    """Fail a test that leaves spillmerge threads running (a leaked flush or merge thread)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [
        t for t in threading.enumerate() if t.ident not in before and t.is_alive() and t.name.startswith("spillmerge")
    ]
    for t in leaked:
        t.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"test left spillmerge threads running: {leaked}"
