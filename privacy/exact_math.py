"""``exp`` and ``log`` written out in ``+``, ``-``, ``*``, ``/``, so that the host sampler and
the device one compute the same bits.

The ziggurat (:mod:`privacy.ziggurat`, :mod:`privacy.ziggurat_ops`) calls ``exp`` in its wedge
test and ``log`` in its tail, on about 1.5% of draws. The platform's functions differ in the
last ulp between libm (numba), SLEEF (torch on the CPU) and CUDA's libdevice, and one ulp is
enough to flip an accept/reject decision and shift every later draw of that element. So both
samplers use these: a range reduction that is exact (``floor``, ``frexp`` and a power of two
built from its exponent bits), then a fixed polynomial evaluated by Horner's rule in float64.
Every operation is one correctly rounded IEEE operation in a fixed order, on the host (numba
does not contract ``a * b + c`` into a fused multiply-add without ``fastmath``) and on a device
(each torch op is a kernel of its own, so nothing is fused across them). The same inputs give
the same bits everywhere: ``tests/test_exact_math.py::test_host_torch_and_python_agree_bit_for_bit``.

Accuracy (``tests/test_exact_math.py::test_exp_and_log_are_within_their_stated_error``): relative
error at most ``EXP_MAX_ULPS`` ulps against ``math.exp`` on ``[-7, 0]`` (the wedge calls it on
``[-r^2/2, 0]``, ``r = 3.654``), and at most ``LOG_MAX_ULPS`` ulps against ``math.log`` on
``[2^-53, 1]`` (the tail calls it on 53-bit uniforms); measured: 1 and 3. Neither matters for the distribution
at the level DP cares about: a last-ulp change of ``exp`` moves the wedge's accept boundary by
about ``1e-16`` of a strip's height.

Reduction and polynomials (standard constructions, e.g. Muller, *Elementary Functions*, ch. 11):
``exp(z) = 2^k exp(t)``, ``k = floor(z / ln 2 + 1/2)``, ``t = z - k ln2_hi - k ln2_lo`` (Cody and
Waite's two-part ``ln 2``: ``k * LN2_HI`` is exact for ``|k| < 2^20``), ``|t| <= ln2 / 2``, and
``exp(t)`` its Taylor polynomial of degree 13 (remainder below ``4e-18``). ``log(u) = e ln 2 +
log(m)``, ``u = m 2^e`` with ``m`` in ``[sqrt(1/2), sqrt 2)``, and ``log(m) = 2 atanh(s)``, ``s =
(m - 1) / (m + 1)``, ``|s| <= 0.1716``, the odd series to ``s^25`` (remainder below ``1e-19``).
"""

from __future__ import annotations

import math

import numba
import torch
from torch import Tensor

INV_LN2 = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01  # 0x3fe62e42fee00000: 32 significant bits, so k * LN2_HI is exact
LN2_LO = 1.90821492927058770002e-10  # ln 2 - LN2_HI
SQRT_HALF = 0.7071067811865476
EXP_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(14))  # exp(t) = sum t^k / k!, k <= 13
LOG_ODD = tuple(2.0 / (2 * k + 1) for k in range(13))  # log(m) = s * sum 2 s^(2k) / (2k + 1), k <= 12

EXP_MAX_ULPS = 2
LOG_MAX_ULPS = 4

_E = EXP_TAYLOR
_L = LOG_ODD


@numba.njit(inline="always")
def exp_host(z):  # noqa: ANN001, ANN201 - numba infers float64
    """``exp(z)`` for float64 ``z`` in ``[-700, 700]``, to ``EXP_MAX_ULPS`` ulps (tested on ``[-7, 0]``)."""
    k = math.floor(z * INV_LN2 + 0.5)
    t = (z - k * LN2_HI) - k * LN2_LO
    p = _E[13]
    p = p * t + _E[12]
    p = p * t + _E[11]
    p = p * t + _E[10]
    p = p * t + _E[9]
    p = p * t + _E[8]
    p = p * t + _E[7]
    p = p * t + _E[6]
    p = p * t + _E[5]
    p = p * t + _E[4]
    p = p * t + _E[3]
    p = p * t + _E[2]
    p = p * t + _E[1]
    p = p * t + _E[0]
    return math.ldexp(p, int(k))  # exact: a power of two times p, far from overflow and subnormals


@numba.njit(inline="always")
def log_host(u):  # noqa: ANN001, ANN201
    """``log(u)`` for float64 ``u`` > 0 (normal), to ``LOG_MAX_ULPS`` ulps (tested on ``[2^-53, 1]``)."""
    m, e = math.frexp(u)  # exact: u = m * 2^e, m in [0.5, 1)
    if m < SQRT_HALF:
        m = m * 2.0
        e = e - 1
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    p = _L[12]
    p = p * z + _L[11]
    p = p * z + _L[10]
    p = p * z + _L[9]
    p = p * z + _L[8]
    p = p * z + _L[7]
    p = p * z + _L[6]
    p = p * z + _L[5]
    p = p * z + _L[4]
    p = p * z + _L[3]
    p = p * z + _L[2]
    p = p * z + _L[1]
    p = p * z + _L[0]
    k = float(e)
    return k * LN2_HI + (k * LN2_LO + s * p)


def exp_torch(z: Tensor) -> Tensor:
    """:func:`exp_host` elementwise on a float64 tensor, in the same operations and order."""
    k = torch.floor(z * INV_LN2 + 0.5)
    t = (z - k * LN2_HI) - k * LN2_LO
    p = torch.full_like(t, _E[13])
    for c in _E[12::-1]:
        p = p * t + c
    two_k = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)  # 2^k from its exponent bits
    return p * two_k


def log_torch(u: Tensor) -> Tensor:
    """:func:`log_host` elementwise on a float64 tensor of positive normal numbers."""
    m, e = torch.frexp(u)
    low = m < SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    e = torch.where(low, e - 1, e)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    p = torch.full_like(z, _L[12])
    for c in _L[11::-1]:
        p = p * z + c
    k = e.to(torch.float64)
    return k * LN2_HI + (k * LN2_LO + s * p)
