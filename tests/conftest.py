"""Shared fixtures. Multi-rank tests spawn real processes (see test_multirank.py)."""

from __future__ import annotations

import threading

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
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
