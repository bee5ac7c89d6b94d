"""Standard normal draws from a seeded SFC64 stream: a 256-strip ziggurat compiled by numba.

This is the sampler under :mod:`privacy.noise`; it knows nothing about keys, steps or names. A
stream is the SFC64 generator (Chris Doty-Humphrey's Small Fast Chaotic PRNG, 64-bit) started
from a 192-bit state; :func:`fill_normals` turns its words into standard normals by the
ziggurat method of Marsaglia and Tsang (2000), and only ever reads the stream forward, so the
first ``k`` draws of a stream do not depend on how many are drawn after them.

The ziggurat covers the half-normal density ``f(x) = exp(-x^2 / 2)`` with 256 strips of equal
area ``v``: strip ``i`` is the rectangle ``[0, x_i] x [f(x_i), f(x_{i+1})]`` (strip 0 is the
rectangle under ``f(r)`` plus the tail beyond ``r = x_1``, drawn with the virtual width
``x_0 = v / f(r)``). One 64-bit word gives a strip (8 bits), a sign (1 bit) and a uniform
position (52 bits); in 98.5% of draws the point lies inside the curve's inner rectangle and
is returned at once. Otherwise the wedge is tested against ``exp`` with one more word, or, in
strip 0, the tail beyond ``r`` is drawn by Marsaglia's exponential method, which reaches past
``13 sigma`` (a ``log`` of a 53-bit uniform), so the tail is not cut where DP analysis cares.

Why compiled: numpy's ``Generator.standard_normal`` calls its bit generator through a function
pointer per draw; this loop keeps the generator state in registers. ``benchmarks/privacy_step.py
--phases`` (2 threads, wall) measured 10.1 ns per normal with numpy and 5.3 ns with this loop on
the small GPT's 7.4M parameters (8.0 and 6.6 ns on the large one's 27.4M). The bits depend only
on this file and on the platform's ``exp``/``log`` (used by the wedge and tail tests, in 1.5% of
draws); ``tests/test_noise.py::test_noise_bits_match_the_recorded_reference`` pins them.
"""

from __future__ import annotations

import math

import numba
import numpy as np

STRIPS = 256
TAIL_START = 3.6541528853610088  # r for 256 strips: the strips then exactly tile the density
STRIP_AREA = 4.92867323399e-3  # v: the area of every strip, the tail included in strip 0
_WARMUP = 12  # SFC64's reference seeding discards its first 12 outputs
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

_1 = np.uint64(1)
_3 = np.uint64(3)
_8 = np.uint64(8)
_11 = np.uint64(11)
_12 = np.uint64(12)
_24 = np.uint64(24)
_40 = np.uint64(40)
_STRIP_MASK = np.uint64(STRIPS - 1)


@numba.njit(inline="always")
def _sfc64(a, b, c, w):  # noqa: ANN001, ANN202 - numba infers uint64 throughout
    """One SFC64 step: ``(output, a, b, c, w)``."""
    out = a + b + w
    return out, b ^ (b >> _11), c + (c << _3), ((c << _24) | (c >> _40)) + out, w + _1


_STORE, _ADD32, _ADD64 = 0, 1, 2  # what the kernel does with draw j


@numba.njit(nogil=True, cache=True)
def _kernel(a, b, c, skip, out, mode, std, accept, scale, height):  # noqa: ANN001, ANN202, C901
    """Draws ``skip + len(out)`` normals; draw ``skip + j`` is stored into ``out[j]`` (mode
    ``_STORE``) or scaled and added to it in float32 (``_ADD32``) or float64 (``_ADD64``)."""
    w = _1
    for _ in range(_WARMUP):
        _, a, b, c, w = _sfc64(a, b, c, w)
    std32 = np.float32(std)
    n = skip + out.shape[0]
    i = 0
    while i < n:
        word, a, b, c, w = _sfc64(a, b, c, w)
        strip = word & _STRIP_MASK
        negative = (word >> _8) & _1
        u = word >> _12  # 52 bits
        x = np.float64(np.int64(u)) * scale[strip]  # exact either way; the signed conversion is one instruction
        if u >= accept[strip]:
            if strip == 0:  # the tail beyond r
                while True:
                    word, a, b, c, w = _sfc64(a, b, c, w)
                    t = -math.log((np.float64(word >> _11) + 1.0) * _U53) / TAIL_START
                    word, a, b, c, w = _sfc64(a, b, c, w)
                    e = -math.log((np.float64(word >> _11) + 1.0) * _U53)
                    if e + e > t * t:
                        break
                x = TAIL_START + t
            else:  # the wedge between the inner rectangle and the strip's top
                word, a, b, c, w = _sfc64(a, b, c, w)
                y = height[strip] + (height[strip + 1] - height[strip]) * (np.float64(word >> _11) * _U53)
                if y >= math.exp(-0.5 * x * x):
                    continue  # rejected: a fresh draw for the same element
        if i >= skip:
            if negative:  # a branch, not a multiply by -1: it predicts well and frees the FPU
                x = -x
            j = i - skip
            if mode == _STORE:
                out[j] = x
            elif mode == _ADD32:
                out[j] = out[j] + np.float32(np.float32(x) * std32)
            else:
                out[j] = out[j] + x * std
        i += 1


def _check_out(out: np.ndarray) -> None:
    if out.ndim != 1 or out.dtype not in (np.float32, np.float64) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous 1-D float32 or float64 array, got {out.dtype} {out.shape}")


def fill_normals(state: tuple[int, int, int], skip: int, out: np.ndarray) -> None:
    """Fill ``out`` (1-D, float32 or float64, contiguous) with draws ``skip .. skip + len(out)``
    of the standard normal stream started from the SFC64 ``state`` ``(a, b, c)``.

    Formal Guarantees:
      * Draw ``k`` of a stream is the same whatever ``skip`` and ``len(out)`` are
        (``tests/test_ziggurat.py::test_a_stream_prefix_does_not_depend_on_its_length``); float32
        output is the float64 draw rounded to nearest.
      * Releases the GIL: threads filling different buffers run in parallel.
    Edge cases: an empty ``out`` draws nothing; ``skip < 0`` raises ``ValueError``."""
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    _check_out(out)
    if out.shape[0]:
        a, b, c = (np.uint64(v) for v in state)
        _kernel(a, b, c, skip, out, _STORE, 1.0, ACCEPT, SCALE, HEIGHT)


def add_scaled_normals(state: tuple[int, int, int], out: np.ndarray, std: float) -> None:
    """``out += round(draw) * std`` for the stream's first ``len(out)`` draws, in ``out``'s
    precision: for float32, ``out[j] + float32(float32(z_j) * float32(std))``, i.e. exactly what
    filling a float32 buffer, multiplying it by ``std`` and adding it does with torch.

    Guarantee: ``tests/test_ziggurat.py::test_adding_scaled_draws_is_filling_scaling_and_adding``.
    Releases the GIL."""
    _check_out(out)
    if out.shape[0]:
        a, b, c = (np.uint64(v) for v in state)
        mode = _ADD32 if out.dtype == np.float32 else _ADD64
        _kernel(a, b, c, 0, out, mode, float(std), ACCEPT, SCALE, HEIGHT)
