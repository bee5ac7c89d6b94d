"""Standard normal draws addressed by element: a 256-strip ziggurat over Philox4x32-10 words,
compiled by numba.

This is the host sampler under :mod:`privacy.noise`; it knows nothing about keys, steps or
names. A block's *seed* is five 32-bit words ``(c1, c2, c3, k0, k1)``. The normal at offset
``i`` of the block (``0 <= i < 2^16``) is a function of the seed and ``i`` alone, drawn from a
sequence of 64-bit words of Philox4x32-10 (:mod:`privacy.philox`; key ``(k0, k1)``, counter
``(x0, c1, c2, c3)``; a call gives ``W0 = y1:y0`` and ``W1 = y3:y2``):

* word 0, the *pair call*: ``x0 = i >> 1``, and offset ``i`` takes ``W0`` if ``i`` is even,
  ``W1`` if odd (one call serves two neighbours: 98.5% of draws need nothing else, and the
  call is the sampler's main cost);
* call ``n >= 1``: ``x0 = i + n * 2^16`` (at least ``2^16``, so never a pair counter; for
  ``n < 2^16`` distinct offsets and calls never share a counter).

The ziggurat of Marsaglia and Tsang (2000) turns them into a normal. A *position word* gives a
strip (its low 8 bits), a sign (bit 8) and a 52-bit position ``u = word >> 12``; if ``u`` lies
inside the strip's inner rectangle, ``x = u * scale[strip]`` is the draw. The first position
word is the pair call's. Otherwise:

* in strips 1-255, the wedge: the next call's ``W0`` (top 53 bits) is the height uniform,
  tested against ``exp(-x^2/2)``; a rejection takes the next call's ``W0`` as a fresh position
  word;
* in strip 0, the tail beyond ``r`` by Marsaglia's exponential method, one call per trial
  (``t = -log(U) / r`` from ``W0``, ``e`` from ``W1``), which reaches past ``13 sigma`` (a
  ``log`` of a 53-bit uniform), so the tail is not cut where DP analysis cares.

The sign is that of the accepted position word. ``exp`` and ``log`` are those of
:mod:`privacy.exact_math` (``+ - * /`` only), so the device implementation
(:mod:`privacy.ziggurat_ops`), which reads the same words for the same element, gets the same
bits (``tests/test_ziggurat.py::test_torch_ops_equal_the_host_sampler_bit_for_bit``). An element
needs ``2^16`` calls with probability below ``0.03^65535`` (never observed); the counter would
then wrap into other offsets' counters of the same block.

Numba caches the compiled kernel on disk keyed on this file only, while it inlines
:mod:`privacy.philox` and :mod:`privacy.exact_math`: after editing either, clear the cache
(``__pycache__/ziggurat*.nbi``/``.nbc``) or touch this file.
``tests/test_ziggurat.py::test_the_cached_kernel_computes_what_its_source_says`` fails on a stale
cache.

The strips cover the half-normal density ``f(x) = exp(-x^2 / 2)`` with 256 strips of equal
area ``v``: strip ``i`` is the rectangle ``[0, x_i] x [f(x_i), f(x_{i+1})]`` (strip 0 is the
rectangle under ``f(r)`` plus the tail beyond ``r = x_1``, drawn with the virtual width
``x_0 = v / f(r)``). The tables are those of the SFC64 sampler this replaced (scheme v2).

Cost: ``benchmarks/noise_draw.py`` (ns per normal on the host, this scheme beside the v2
SFC64 stream it replaced) and ``benchmarks/privacy_step.py --phases``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from privacy.exact_math import exp_host, log_host
from privacy.philox import philox_host

STRIPS = 256
TAIL_START = 3.6541528853610088  # r for 256 strips: the strips then exactly tile the density
STRIP_AREA = 4.92867323399e-3  # v: the area of every strip, the tail included in strip 0
COUNTER_SHIFT = 16  # call n of offset i is counter word i + (n << 16): offsets are below 2^16
_U53 = 2.0**-53


def _f(x: float) -> float:
    return math.exp(-0.5 * x * x)


def strip_edges() -> list[float]:
    """``[x_0, ..., x_256]``: ``x_0 = v / f(r)``, ``x_1 = r``, ``x_{i+1} = f^{-1}(v / x_i +
    f(x_i))``, and ``x_256 = 0`` (the top strip's left edge). Computed with Python's scalar
    ``math`` so every platform with a correctly rounding libm gets the same tables."""
    x = [STRIP_AREA / _f(TAIL_START), TAIL_START]
    for i in range(1, STRIPS - 1):
        x.append(math.sqrt(-2.0 * math.log(STRIP_AREA / x[i] + _f(x[i]))))
    return x + [0.0]


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per strip: the 52-bit threshold below which a draw is accepted at once, the scale from
    52-bit integer to ``x``, and ``f`` at the strip's edges (``STRIPS + 1`` values)."""
    x = strip_edges()
    accept = np.array([int(x[i + 1] / x[i] * 2.0**52) for i in range(STRIPS)], dtype=np.uint64)
    scale = np.array([x[i] * 2.0**-52 for i in range(STRIPS)], dtype=np.float64)
    height = np.array([_f(v) for v in x], dtype=np.float64)
    return accept, scale, height


ACCEPT, SCALE, HEIGHT = _tables()

_8 = np.uint64(8)
_11 = np.uint64(11)
_12 = np.uint64(12)
_20 = np.uint64(20)
_21 = np.uint64(21)
_32 = np.uint64(32)
_1 = np.uint64(1)
_SHIFT = np.uint64(COUNTER_SHIFT)
_STRIP_MASK = np.uint64(STRIPS - 1)
_SIGNED_STRIP_MASK = np.uint64(2 * STRIPS - 1)


@numba.njit(inline="always")
def _word(c1, c2, c3, k0, k1, counter):  # noqa: ANN001, ANN202
    """``W0`` (words 1:0) of one Philox call."""
    y0, y1, _, _ = philox_host(counter, c1, c2, c3, k0, k1)
    return y0 | (y1 << _32)


@numba.njit(inline="always")
def _normal(c1, c2, c3, k0, k1, offset, accept, scale, height):  # noqa: ANN001, ANN202, PLR0913
    """The standard normal at ``offset`` of the block with seed ``(c1, c2, c3, k0, k1)``."""
    y0, y1, y2, y3 = philox_host(offset >> _1, c1, c2, c3, k0, k1)  # the pair call
    p = (y2 | (y3 << _32)) if offset & _1 else (y0 | (y1 << _32))
    return _from_word(c1, c2, c3, k0, k1, offset, p, accept, scale, height)


@numba.njit(inline="always")
def _from_word(c1, c2, c3, k0, k1, offset, p, accept, scale, height):  # noqa: ANN001, ANN202, PLR0913
    """:func:`_normal` given its pair call's word ``p`` (the kernel has it already)."""
    n = np.uint64(1)
    while True:
        strip = p & _STRIP_MASK
        negative = (p >> _8) & _1
        u = p >> _12  # 52 bits
        x = np.float64(np.int64(u)) * scale[strip]  # exact either way; the signed conversion is one instruction
        if u < accept[strip]:
            break
        if strip == 0:  # the tail beyond r: one call per trial
            while True:
                t0, t1, t2, t3 = philox_host(offset + (n << _SHIFT), c1, c2, c3, k0, k1)
                n += _1
                t = -log_host((np.float64(np.int64((t1 << _21) | (t0 >> _11))) + 1.0) * _U53) / TAIL_START
                e = -log_host((np.float64(np.int64((t3 << _21) | (t2 >> _11))) + 1.0) * _U53)
                if e + e > t * t:
                    break
            x = TAIL_START + t
            break
        # the wedge between the inner rectangle and the strip's top: the next word is the height
        v = _word(c1, c2, c3, k0, k1, offset + (n << _SHIFT))
        n += _1
        y = height[strip] + (height[strip + 1] - height[strip]) * (np.float64(np.int64(v >> _11)) * _U53)
        if y < exp_host(-0.5 * x * x):
            break
        p = _word(c1, c2, c3, k0, k1, offset + (n << _SHIFT))  # rejected: the next word starts over
        n += _1
    return -x if negative else x


_STORE, _ADD32, _ADD64 = 0, 1, 2  # what the kernel does with draw j
_CHUNK = 1024  # even


@numba.njit(nogil=True, cache=True)
def _kernel(c1, c2, c3, k0, k1, first, out, mode, std, accept, scale, height):  # noqa: ANN001, ANN202, PLR0913
    """The normals at offsets ``first .. first + len(out)``: stored into ``out`` (mode
    ``_STORE``) or scaled and added to it in float32 (``_ADD32``) or float64 (``_ADD64``).

    Chunk by chunk of ``_CHUNK`` offsets (scratch that stays in the L1 cache): a loop without
    branches computes call 0's ``W0`` for each (the compiler vectorises Philox's 32x32-bit
    multiplies: about 1.6 ns a call instead of 20 for the scalar loop); a second loop without
    branches turns each word into its candidate (strip and sign read together from a table of
    signed scales: ``u * -s`` is exactly ``-(u * s)``) and stores it, or adds it, into ``out``
    at every offset, noting the offsets call 0 leaves open (1.5%; an entry is written at every
    offset and the count advanced only at those) with, when adding, the value ``out`` had
    there; the scalar :func:`_from_word` then settles each noted offset from its word and
    stores it, or adds it to the noted value. Every element ends as the same operations on the
    same draw as storing it, or scaling and adding it."""
    n = out.shape[0]
    words = np.empty(_CHUNK + 2, dtype=np.uint64)
    noted = np.empty(_CHUNK + 1, dtype=np.int64)
    before = np.empty(_CHUNK + 1, dtype=out.dtype)
    signed_scale = _signed(scale)
    accept_signed = _signed_accept(accept)
    std32 = np.float32(std)
    for c0 in range(0, n, _CHUNK):
        m = min(_CHUNK, n - c0)
        base = first + c0
        pair0 = base >> 1
        for q in range(((base + m - 1) >> 1) - pair0 + 1):  # straight-line uint64 code: vectorised
            y0, y1, y2, y3 = philox_host(np.uint64(pair0 + q), c1, c2, c3, k0, k1)
            words[2 * q] = y0 | (y1 << _32)
            words[2 * q + 1] = y2 | (y3 << _32)
        shift = base - 2 * pair0  # 1 when the chunk starts at an odd offset
        open_ = 0
        for j in range(m):
            w = words[j + shift]
            signed_strip = w & _SIGNED_STRIP_MASK  # the strip and, in bit 8, the sign
            u = np.int64(w >> _12)
            x = np.float64(u) * signed_scale[signed_strip]
            noted[open_] = j
            before[open_] = out[c0 + j]
            open_ += np.int64(u >= accept_signed[signed_strip])
            if mode == _STORE:
                out[c0 + j] = x
            elif mode == _ADD32:
                out[c0 + j] = out[c0 + j] + np.float32(np.float32(x) * std32)
            else:
                out[c0 + j] = out[c0 + j] + x * std
        for k in range(open_):
            j = noted[k]
            x = _from_word(c1, c2, c3, k0, k1, np.uint64(base + j), words[j + shift], accept, scale, height)
            if mode == _STORE:
                out[c0 + j] = x
            elif mode == _ADD32:
                out[c0 + j] = before[k] + np.float32(np.float32(x) * std32)
            else:
                out[c0 + j] = before[k] + x * std


@numba.njit(inline="always")
def _signed(scale):  # noqa: ANN001, ANN202
    """Per position word's low 9 bits (strip, then sign): the strip's scale with that sign."""
    out = np.empty(2 * STRIPS, dtype=np.float64)
    for i in range(STRIPS):
        out[i] = scale[i]
        out[STRIPS + i] = -scale[i]
    return out


@numba.njit(inline="always")
def _signed_accept(accept):  # noqa: ANN001, ANN202
    """Per position word's low 9 bits: the strip's threshold as int64 (below 2^52: same order)."""
    out = np.empty(2 * STRIPS, dtype=np.int64)
    for i in range(STRIPS):
        out[i] = np.int64(accept[i])
        out[STRIPS + i] = np.int64(accept[i])
    return out


def _check_out(out: np.ndarray) -> None:
    if out.ndim != 1 or out.dtype not in (np.float32, np.float64) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous 1-D float32 or float64 array, got {out.dtype} {out.shape}")


def _check(seed: tuple[int, ...], first: int, n: int) -> None:
    if len(seed) != 5 or not all(0 <= w <= 0xFFFFFFFF for w in seed):
        raise ValueError(f"seed must be five 32-bit words, got {seed!r}")
    if first < 0 or first + n > 1 << COUNTER_SHIFT:
        raise ValueError(f"offsets must lie in [0, 2^{COUNTER_SHIFT}), got first={first}, n={n}")


def fill_normals(seed: tuple[int, ...], first: int, out: np.ndarray) -> None:
    """Fill ``out`` (1-D, float32 or float64, contiguous) with the normals at offsets ``first ..
    first + len(out)`` of the block with ``seed`` (five 32-bit words).

    Formal Guarantees:
      * The normal at an offset does not depend on ``first`` or ``len(out)``
        (``tests/test_ziggurat.py::test_an_offsets_draw_does_not_depend_on_the_range``); float32
        output is the float64 draw rounded to nearest.
      * Releases the GIL: threads filling different buffers run in parallel.
    Edge cases: an empty ``out`` draws nothing; ``first < 0``, offsets past ``2^16`` or a seed
    that is not five 32-bit words raise ``ValueError``."""
    _check_out(out)
    _check(seed, first, out.shape[0])
    if out.shape[0]:
        _kernel(*(np.uint64(w) for w in seed), first, out, _STORE, 1.0, ACCEPT, SCALE, HEIGHT)


def add_scaled_normals(seed: tuple[int, ...], out: np.ndarray, std: float) -> None:
    """``out += round(draw) * std`` for the block's offsets ``0 .. len(out)``, in ``out``'s
    precision: for float32, ``out[j] + float32(float32(z_j) * float32(std))``, i.e. exactly what
    filling a float32 buffer, multiplying it by ``std`` and adding it does with torch.

    Guarantee: ``tests/test_ziggurat.py::test_adding_scaled_draws_is_filling_scaling_and_adding``.
    Releases the GIL."""
    _check_out(out)
    _check(seed, 0, out.shape[0])
    if out.shape[0]:
        mode = _ADD32 if out.dtype == np.float32 else _ADD64
        _kernel(*(np.uint64(w) for w in seed), 0, out, mode, float(std), ACCEPT, SCALE, HEIGHT)
