"""Output codecs: the Zarr v3 codec chain of merged arrays and the encoder that produces it.

The merge writes whole chunks itself (zarr's codec pipeline costs a copy and an event-loop hop per
chunk), so it must encode exactly as the chain in the array's ``zarr.json`` says: ``bytes`` →
optional compressor → ``crc32c``. The compressors are numcodecs' Blosc and Zstd configured the way
zarr's own ``BloscCodec`` / ``ZstdCodec`` configure them, so plain zarr decodes every chunk.
"""

from __future__ import annotations

import functools
from typing import Any

from ._errors import SpillValueError

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


def with_codec(meta: dict[str, Any], codec: str, itemsize: int) -> dict[str, Any]:
    """An array ``zarr.json`` document (bytes [+ crc32c]) with the compressor inserted after ``bytes``."""
    doc = compressor_doc(codec, itemsize)
    if doc is None:
        return meta
    codecs = list(meta["codecs"])
    return {**meta, "codecs": [codecs[0], doc, *codecs[1:]]}


@functools.lru_cache(maxsize=64)
def encoder(codec: str, itemsize: int) -> Any:
    """A numcodecs codec whose ``encode`` matches :func:`compressor_doc` (None for ``none``).

    numcodecs codecs are safe to share between threads: Blosc compresses with a private context
    off the main thread, Zstd with a context per call."""
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
