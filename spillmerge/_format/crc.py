"""CRC-32C of buffers (:func:`value`, :func:`extend`, by the ``crc32c`` package, which releases the
GIL) and their combine: ``crc(a + b) = M_n · crc(a) xor crc(b)`` (zlib's ``crc32_combine`` for the
Castagnoli polynomial), ``M_n`` kept as four 256-entry byte tables per power of two."""

from __future__ import annotations

import functools
from typing import Any

import crc32c as _crc32c


def value(data: Any) -> int:
    """CRC-32C of ``data``, a C-contiguous buffer (bytes, memoryview, numpy array)."""
    return _crc32c.crc32c(data)


def extend(crc: int, data: Any) -> int:
    """CRC-32C of the bytes whose CRC-32C is ``crc`` followed by ``data``."""
    return _crc32c.crc32c(data, crc)


POLY = 0x82F63B78
"""The Castagnoli polynomial, bit-reflected (as CRC-32C computes)."""


def _times(mat: list[int], vec: int) -> int:
    """The 32x32 GF(2) matrix ``mat`` (one int per column) times the 32-bit vector ``vec``."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, col) for col in mat]


@functools.cache
def _zero_bytes_power(k: int) -> tuple[int, ...]:
    """The matrix of ``2**k`` zero bytes appended."""
    if k == 0:
        m = [POLY] + [1 << i for i in range(31)]  # one zero bit
        for _ in range(3):  # 2, 4, 8 bits
            m = _square(m)
        return tuple(m)
    return tuple(_square(list(_zero_bytes_power(k - 1))))


@functools.cache
def _tables(k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Byte tables of the matrix of ``2**k`` zero bytes: ``M · v`` is the xor of
    ``t[j][(v >> 8j) & 255]`` over the four bytes of ``v``."""
    cols = _zero_bytes_power(k)
    out = []
    for j in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b
            t[b] = t[b ^ low] ^ cols[8 * j + low.bit_length() - 1]
        out.append(t)
    return out[0], out[1], out[2], out[3]


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32C of ``a + b`` given ``crc_a``, ``crc_b`` and ``len(b)``: ``crc_a`` through the
    matrix of each power of two in ``len_b`` (four lookups each, whatever the length)."""
    k = 0
    while len_b:
        if len_b & 1:
            t0, t1, t2, t3 = _tables(k)
            crc_a = t0[crc_a & 255] ^ t1[(crc_a >> 8) & 255] ^ t2[(crc_a >> 16) & 255] ^ t3[crc_a >> 24]
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
