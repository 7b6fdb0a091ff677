"""Output codecs: the Zarr v3 chain of merged arrays (``bytes`` → optional Blosc / Zstd configured
as zarr's codecs configure them → ``crc32c``) and the encoder matching it exactly: the merge
writes whole chunks itself, and plain zarr must decode every one."""

from __future__ import annotations

import functools
from typing import Any

from .._errors import SpillValueError

CODECS = ("none", "blosc-lz4", "zstd")
"""Accepted ``codec=`` values; ``none`` (raw bytes + crc32c) is the default."""

BLOSC_CLEVEL = 5
ZSTD_LEVEL = 3


def check(codec: Any) -> str:
    if codec not in CODECS:
        raise SpillValueError(f"codec must be one of {', '.join(repr(c) for c in CODECS)}, got {codec!r}")
    return str(codec)


def compressor_doc(codec: str, itemsize: int) -> dict[str, Any] | None:
    """The bytes-to-bytes codec entry placed between ``bytes`` and ``crc32c`` (None for ``none``)."""
    if codec == "blosc-lz4":
        # Byte shuffle by the stored item size: the gain on float data comes from it.
        return {
            "name": "blosc",
            "configuration": {
                "typesize": itemsize, "cname": "lz4", "clevel": BLOSC_CLEVEL, "shuffle": "shuffle", "blocksize": 0,
            },
        }  # fmt: skip
    if codec == "zstd":
        return {"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": False}}
    return None


@functools.lru_cache(maxsize=64)
def encoder(codec: str, itemsize: int) -> Any:
    """A numcodecs codec whose ``encode`` matches :func:`compressor_doc` (None for ``none``), safe
    to share between threads: Blosc compresses with a private context off the main thread, Zstd
    with a context per call."""
    if codec == "blosc-lz4":
        from numcodecs import Blosc

        config = {"cname": "lz4", "clevel": BLOSC_CLEVEL, "shuffle": Blosc.SHUFFLE, "blocksize": 0}
        # As zarr's BloscCodec does: typesize is a config key since numcodecs 0.16 (before, zarr
        # shuffled by the byte, and so do we).
        try:
            return Blosc.from_config({**config, "typesize": itemsize})
        except TypeError:
            return Blosc.from_config(config)
    if codec == "zstd":
        from numcodecs import Zstd

        return Zstd(level=ZSTD_LEVEL, checksum=False)
    return None


# --------------------------------------------------------------------------------------------
# reading untrusted chunks: the chain an output array may declare, and what a compressed chunk
# says it decodes to, read from its header before anything is decoded (docs/FORMAT.md, *Size limits*)

_COMPRESSORS = ("blosc", "zstd")


def chain(codecs: object) -> tuple[str | None, bool]:
    """(compressor or None, crc32c last) of an output array's ``codecs`` list, which starts with
    ``bytes``; ``ValueError`` for any chain the format does not write (sharding, transpose, gzip
    ...: codecs whose decoded size no header states)."""
    codecs = list(codecs) if isinstance(codecs, tuple) else codecs  # (zarr's metadata gives tuples)
    if not isinstance(codecs, list) or not codecs:
        raise ValueError(f"codecs {codecs!r:.200} is not a non-empty list")
    names = [c.get("name") if isinstance(c, dict) else c for c in codecs]
    first, rest = names[0], names[1:]
    crc = bool(rest) and rest[-1] == "crc32c"
    if crc:
        rest = rest[:-1]
    if first != "bytes" or len(rest) > 1 or (rest and rest[0] not in _COMPRESSORS):
        raise ValueError(
            f"codec chain {names!r:.200} is not one spillmerge writes (bytes, then blosc or zstd, then crc32c)"
        )
    return (str(rest[0]) if rest else None), crc


def decoded_size(compressor: str, data: memoryview) -> int:
    """The bytes a ``compressor`` chunk decodes to, as its header declares it (the decoder allocates
    that much and writes no more): blosc's ``nbytes``, the sum of zstd's frame content sizes;
    ``ValueError`` when it declares none (a growing buffer, no bound) or is no such chunk."""
    if compressor == "blosc":
        if len(data) < 16:
            raise ValueError(f"a blosc chunk of {len(data)} bytes has no 16-byte header")
        nbytes = int.from_bytes(data[4:8], "little")
        cbytes = int.from_bytes(data[12:16], "little")
        if cbytes != len(data):
            raise ValueError(f"blosc header says {cbytes} compressed bytes, the chunk has {len(data)}")
        return nbytes
    if compressor == "zstd":
        return _zstd_content_size(data)
    raise ValueError(f"unknown compressor {compressor!r}")


_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE = 0x184D2A50  # .. 0x184D2A5F


def _le(data: memoryview, at: int, k: int, what: str) -> int:
    """The ``k``-byte little-endian integer at byte ``at`` of a zstd chunk; ``ValueError`` naming
    ``what`` it is part of when the chunk ends first."""
    if at + k > len(data):
        raise ValueError(f"truncated zstd {what} at byte {at}")
    return int.from_bytes(data[at : at + k], "little")


def _zstd_content_size(data: memoryview) -> int:
    """Sum of the content sizes of the zstd frames in ``data`` (RFC 8878 section 3.1), walking
    block headers to find each frame's end: every frame must declare its size."""
    total, pos, n = 0, 0, len(data)
    if n == 0:
        raise ValueError("an empty zstd chunk")
    while pos < n:
        magic = _le(data, pos, 4, "frame")
        if magic & 0xFFFFFFF0 == _ZSTD_SKIPPABLE:
            pos += 8 + _le(data, pos + 4, 4, "skippable frame")
            continue
        if magic != _ZSTD_MAGIC:
            raise ValueError(f"no zstd frame at byte {pos} (magic {magic:#x})")
        fhd = _le(data, pos + 4, 1, "frame header")
        fcs_flag, single, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
        p = pos + 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
        fcs_len = (1 if single else 0, 2, 4, 8)[fcs_flag]
        if fcs_len == 0:
            raise ValueError(f"the zstd frame at byte {pos} does not declare its content size")
        total += _le(data, p, fcs_len, "frame header") + (256 if fcs_len == 2 else 0)
        p += fcs_len
        while True:  # blocks: 3-byte little-endian header (last, type, size)
            h = _le(data, p, 3, "block")
            last, btype, bsize = h & 1, (h >> 1) & 3, h >> 3
            if btype == 3:
                raise ValueError(f"reserved zstd block type at byte {p}")
            p += 3 + (1 if btype == 1 else bsize)
            if last:
                break
        pos = p + (4 if checksum else 0)
    if pos != n:
        raise ValueError("the zstd frames end past the chunk")
    return total
