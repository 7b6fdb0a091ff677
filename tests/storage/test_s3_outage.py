"""An object store that stops answering: ``open`` and ``merge`` raise a ``SpillStorageError``
within the retry budget (docs/GUARANTEES.md, *Object-store faults*), before or mid-way through
the call. Each test runs its own moto server, so stopping it hurts no other test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import spillmerge

pytestmark = pytest.mark.s3

ATTEMPTS = 2  # a smaller budget than the default 10 attempts keeps the test short; same mechanism


def backoff_budget(attempts: int) -> float:
    """Most seconds botocore's standard retry mode sleeps across ``attempts`` attempts of one
    request: rand(0, 1) * min(2**i, 20) before retry i (docs/GUARANTEES.md)."""
    return float(sum(min(2**i, 20) for i in range(attempts - 1)))


# An operation fails at its first request that exhausts the budget; fsspec may try a second
# request for the same question (info, then a listing) before giving up. Refused connections
# fail at once (no connect_timeout spent). The slack covers process start-up of the call.
BOUND = 3 * backoff_budget(ATTEMPTS) + 20


@pytest.fixture
def server() -> Iterator[Any]:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from _s3 import S3Server

    srv = S3Server()
    srv.create_bucket("test")
    try:
        yield srv
    finally:
        srv.stop()  # stopping twice is harmless


def _opts(endpoint: str) -> dict[str, Any]:
    from _s3 import storage_options

    return storage_options(endpoint, config_kwargs={"retries": {"max_attempts": ATTEMPTS, "mode": "standard"}})


def _spill(opts: dict[str, Any], frames: int) -> None:
    with spillmerge.SpillWriter("s3://test/root", 0, 1, storage_options=opts, chunk_bytes=16 << 10) as w:
        for i in range(frames):
            w.write(f"v{i % 7}.mp4", i, {"x": torch.full((2048,), float(i))})


def test_a_stopped_store_fails_open_and_merge_within_the_retry_budget(server: Any) -> None:
    opts = _opts(server.endpoint)
    _spill(opts, 10)
    spillmerge.merge("s3://test/root", "s3://test/out.zarr", storage_options=opts, progress=False)
    server.stop()
    for what, call in (
        ("open", lambda: spillmerge.open("s3://test/out.zarr", storage_options=opts)),
        ("merge", lambda: spillmerge.merge("s3://test/root", "s3://test/o2.zarr", storage_options=opts)),
    ):
        t0 = time.monotonic()
        with pytest.raises(spillmerge.SpillStorageError, match="s3://test/") as info:
            call()
        took = time.monotonic() - t0
        assert took < BOUND, f"{what} raised {info.value!r} after {took:.0f} s, bound {BOUND:.0f} s"


def test_a_store_stopped_mid_merge_fails_it_within_the_retry_budget(server: Any) -> None:
    """The server stops once the merge has written its first object below the output (polled
    through a client of its own, with a deadline): the merge raises, it does not hang."""
    import boto3

    opts = _opts(server.endpoint)
    _spill(opts, 400)
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    started = threading.Event()

    def stop_when_the_output_appears() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if client.list_objects_v2(Bucket="test", Prefix="out.zarr/", MaxKeys=1).get("KeyCount", 0):
                break
            time.sleep(0.02)  # polling interval of the condition, not a wait for it
        started.set()
        server.stop()

    stopper = threading.Thread(target=stop_when_the_output_appears, daemon=True)
    stopper.start()
    t0 = time.monotonic()
    with pytest.raises(spillmerge.SpillMergeError) as info:
        spillmerge.merge("s3://test/root", "s3://test/out.zarr", storage_options=opts, progress=False)
    took = time.monotonic() - t0
    stopper.join(timeout=150)
    assert started.is_set()
    assert took < 120 + BOUND, f"merge raised {info.value!r} after {took:.0f} s"
