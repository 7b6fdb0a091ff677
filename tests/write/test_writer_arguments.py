"""SpillWriter's arguments and the calls allowed before ``open``: bad input is a SpillValueError
naming the argument, never a raw TypeError or a silent default."""

from __future__ import annotations

import pytest
import torch

import spillmerge


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"staging_bytes": "64MiB"}, "staging_bytes must be a positive int or None, got '64MiB'"),
        ({"staging_bytes": -1}, "staging_bytes must be a positive int or None, got -1"),
        ({"staging_bytes": 0}, "staging_bytes must be a positive int or None, got 0"),
        ({"staging_bytes": True}, "staging_bytes must be a positive int or None, got True"),
        ({"flush_threads": 0}, "flush_threads must be a positive int, got 0"),
        ({"flush_threads": True}, "flush_threads must be a positive int, got True"),
    ],
)
def test_bad_sizes_are_refused_naming_the_argument(tmp_path, kwargs, message):
    with pytest.raises(spillmerge.SpillValueError) as err:
        spillmerge.SpillWriter(str(tmp_path / "spill"), rank=0, world_size=1, **kwargs)
    assert str(err.value) == message


def test_committed_keys_can_be_asked_before_the_writer_opens(tmp_path):
    root = str(tmp_path / "spill")
    with spillmerge.SpillWriter(root, rank=0, world_size=1) as w:
        w.write("a.mp4", 3, torch.ones(2))
    later = spillmerge.SpillWriter(root, rank=0, world_size=1)
    assert later.committed_keys() == {"a.mp4": {3}}
    assert later.is_committed("a.mp4", 3) and not later.is_committed("a.mp4", 4)
    with later:  # what the previous session committed stays visible once open
        assert later.is_committed("a.mp4", 3)


@pytest.mark.parametrize("root", [None, "", b"/tmp/spill", 5])
def test_a_root_that_is_no_location_is_refused(root):
    with pytest.raises(spillmerge.SpillStorageError, match="a location is a local path or an fsspec URL"):
        spillmerge.SpillWriter(root, rank=0, world_size=1)
