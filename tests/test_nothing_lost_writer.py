"""Issue 17, "Nothing lost" (writer side): duplicates are compared by their bytes, a partial merge
salvages whole frames only, a writer notices a spill root that vanished, and the same bytes
written twice on one rank are not an error."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest
import torch

import spillmerge


def forge_same_crc(data: bytes, pos: int) -> bytes:
    """``data`` with byte ``pos`` flipped and its last 4 bytes rewritten so that the CRC-32C is
    unchanged: a real collision. CRC-32C is affine over GF(2), so the CRC change caused by the
    last 4 bytes is a linear function of their 32 bits, and a 32x32 linear system gives the patch
    that cancels the flip (the standard CRC forging technique)."""
    n = len(data)
    assert n >= 8 and pos < n - 4
    out = bytearray(data)
    out[pos] ^= 0xFF
    zero = google_crc32c.value(bytes(n))
    basis: dict[int, tuple[int, int]] = {}  # leading bit of a CRC change -> (change, tail bits)
    for bit in range(32):
        e = bytearray(n)
        e[n - 4 + bit // 8] = 1 << (bit % 8)
        v, m = google_crc32c.value(bytes(e)) ^ zero, 1 << bit
        for lead in range(31, -1, -1):
            if v >> lead & 1:
                if lead not in basis:
                    basis[lead] = (v, m)
                    break
                v, m = v ^ basis[lead][0], m ^ basis[lead][1]
    target, tail = google_crc32c.value(bytes(out)) ^ google_crc32c.value(data), 0
    for lead in range(31, -1, -1):
        if target >> lead & 1:
            target, tail = target ^ basis[lead][0], tail ^ basis[lead][1]
    assert target == 0
    out[n - 4 :] = (int.from_bytes(out[n - 4 :], "little") ^ tail).to_bytes(4, "little")
    forged = bytes(out)
    assert forged != data and google_crc32c.value(forged) == google_crc32c.value(data)
    return forged


def u8(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------- row 5
def test_forged_collision_is_a_real_crc32c_collision():
    rng = np.random.default_rng(5)
    for n, pos in ((8, 0), (100, 50), (4096, 7)):
        raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        forged = forge_same_crc(raw, pos)
        assert forged[pos] != raw[pos] and google_crc32c.value(forged) == google_crc32c.value(raw)


def test_duplicates_across_ranks_with_equal_crc_but_different_bytes_follow_the_policy(backend):
    rng = np.random.default_rng(17)
    small = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    # 2.5 MiB over 1 MiB chunks: compared in pieces; the flipped byte is in the first MiB, the
    # patch in the last, so every piece of the comparison matters.
    big = rng.integers(0, 256, (5 << 19), dtype=np.uint8).tobytes()
    values = {
        0: {"clip": u8(small), "dets": {"boxes": torch.ones(3, 4), "mask": u8(big)}, "same": u8(small)},
        1: {"clip": u8(forge_same_crc(small, 100)), "dets": {"boxes": torch.ones(3, 4), "mask": u8(forge_same_crc(big, 9))}, "same": u8(small)},
    }  # fmt: skip
    root = backend.url("spill")
    for rank in (0, 1):  # rank 0 first: its segment is the earlier one ("first")
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, storage_options=backend.options, chunk_bytes=1 << 20) as w:  # fmt: skip
            for name, v in values[rank].items():
                w.write(name, 0, v)
    opts = {"storage_options": backend.options, "out_storage_options": backend.options}
    with pytest.raises(spillmerge.DuplicateFrameError, match="CRC-32C checksums agree, their bytes do not") as info:
        spillmerge.merge(root, backend.url("err"), **opts)
    assert info.value.ranks == [0, 1] and info.value.frame_idx == 0
    assert info.value.filename in ("clip", "dets")
    for policy, rank in (("first", 0), ("last", 1)):
        out = backend.url(policy)
        rep = spillmerge.merge(root, out, on_duplicate=policy, **opts)
        assert rep.duplicates == 3  # clip and dets by the policy, "same" as identical content
        res = spillmerge.open(out, storage_options=backend.options)
        assert bytes(res["clip"][0]) == bytes(values[rank]["clip"].numpy())
        assert bytes(res["dets"]["mask"][0]) == bytes(values[rank]["dets"]["mask"].numpy())
        assert bytes(res["same"][0]) == small
        assert res.frame_ranks("clip").tolist() == [rank] and res.frame_ranks("same").tolist() == [0]


def test_identical_duplicates_across_ranks_are_read_and_still_merge(tmp_path):
    root = str(tmp_path / "spill")
    for rank in (0, 1):
        with spillmerge.SpillWriter(root, rank=rank, world_size=2, chunk_bytes=4096) as w:
            w.write("v", 0, {"x": torch.arange(3000.0), "y": 1})
    rep = spillmerge.merge(root, str(tmp_path / "out"))
    assert rep.duplicates == 1 and rep.n_frames == 1
    assert spillmerge.open(str(tmp_path / "out"))["v"]["x"][0].tolist() == list(range(3000))
