"""Philox4x32-10: the counter-based generator under the noise, on the host and in torch ops.

Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC 2011; the Random123 library) maps a 128-bit counter and a 64-bit key to 128 random bits by
ten rounds of two 32x32->64-bit multiplies and xors, with a Weyl sequence bumping the key
between rounds. For a fixed key it is a bijection of the counter, it passes TestU01's BigCrush
for every key tested by its authors (with 3 rounds of margin: 7 rounds already pass), and it
is the generator of cuRAND's ``curandStatePhilox4_32_10`` and of TensorFlow's stateless random
ops. Any output is a pure function of (counter, key): word ``j`` of element
``i`` is computed without computing any other, which is what lets a GPU draw every element of
a parameter at once.

Two implementations, the same bits (``tests/test_philox.py``, with Random123's known-answer
vectors): :func:`philox_host`, scalar uint64 arithmetic compiled by numba, and
:func:`philox_torch`, the same rounds on int64 tensors (products of two 32-bit numbers wrap
modulo ``2^64`` in int64 as in uint64, so the low and high halves, read with masks, are the
same bits; shapes broadcast, so a key of shape ``(g, 1)`` serves a ``(g, n)`` grid of counters).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key's Weyl increments (golden ratio, sqrt 3 - 1)
ROUNDS = 10
MASK32 = 0xFFFFFFFF

_M0, _M1, _W0, _W1 = np.uint64(M0), np.uint64(M1), np.uint64(W0), np.uint64(W1)
_MASK = np.uint64(MASK32)
_32 = np.uint64(32)
# the key of round r is (k0 + r * W0, k1 + r * W1) mod 2^32
_2W0, _3W0, _4W0, _5W0, _6W0, _7W0, _8W0, _9W0 = (np.uint64(r * W0 % 2**32) for r in range(2, 10))
_2W1, _3W1, _4W1, _5W1, _6W1, _7W1, _8W1, _9W1 = (np.uint64(r * W1 % 2**32) for r in range(2, 10))


@numba.njit(inline="always")
def _round(x0, x1, x2, x3, k0, k1):  # noqa: ANN001, ANN202
    p0 = x0 * _M0
    p1 = x2 * _M1
    return (p1 >> _32) ^ x1 ^ k0, p1 & _MASK, (p0 >> _32) ^ x3 ^ k1, p0 & _MASK


@numba.njit(inline="always")
def philox_host(x0, x1, x2, x3, k0, k1):  # noqa: ANN001, ANN201 - uint64 holding 32-bit words
    """The four 32-bit output words for counter ``(x0, x1, x2, x3)`` and key ``(k0, k1)``
    (the ``ROUNDS = 10`` rounds written out, so the compiler sees straight-line code)."""
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, k0, k1)
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, (k0 + _W0) & _MASK, (k1 + _W1) & _MASK)
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, (k0 + _2W0) & _MASK, (k1 + _2W1) & _MASK)
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, (k0 + _3W0) & _MASK, (k1 + _3W1) & _MASK)
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, (k0 + _4W0) & _MASK, (k1 + _4W1) & _MASK)
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, (k0 + _5W0) & _MASK, (k1 + _5W1) & _MASK)
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, (k0 + _6W0) & _MASK, (k1 + _6W1) & _MASK)
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, (k0 + _7W0) & _MASK, (k1 + _7W1) & _MASK)
    x0, x1, x2, x3 = _round(x0, x1, x2, x3, (k0 + _8W0) & _MASK, (k1 + _8W1) & _MASK)
    return _round(x0, x1, x2, x3, (k0 + _9W0) & _MASK, (k1 + _9W1) & _MASK)


def philox_torch(x0: Tensor, x1: Tensor, x2: Tensor, x3: Tensor, k0: Tensor,
                 k1: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`philox_host` elementwise on int64 tensors holding 32-bit words (broadcasting)."""
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + W0) & MASK32
            k1 = (k1 + W1) & MASK32
        p0 = x0 * M0  # < 2^64: wraps in int64, the low 64 bits are the uint64 product's
        p1 = x2 * M1
        hi1 = (p1 >> 32).bitwise_and_(MASK32)
        hi0 = (p0 >> 32).bitwise_and_(MASK32)
        # in place where the shapes allow it (after the first round every word has the full shape)
        x0 = hi1.bitwise_xor_(x1).bitwise_xor_(k0) if hi1.shape == _shape(hi1, x1, k0) else hi1 ^ x1 ^ k0
        x2 = hi0.bitwise_xor_(x3).bitwise_xor_(k1) if hi0.shape == _shape(hi0, x3, k1) else hi0 ^ x3 ^ k1
        x1, x3 = p1.bitwise_and_(MASK32), p0.bitwise_and_(MASK32)
    return x0, x1, x2, x3


def _shape(*tensors: Tensor) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
