"""The sensitivity a BLT ledger needs, torch-free: a buffered linear Toeplitz strategy's
min-separation sensitivity when every participation fits.

With cyclic groups of ``min_sep`` (``privacy.mechanisms.cyclic_sampling``), an example of group 0
can take part at steps ``0, min_sep, 2 min_sep, ...``: all ``k = ceil(steps / min_sep)`` of them.
For a lower-triangular Toeplitz ``C`` with a positive, non-increasing first column ``c`` (every
BLT, ``privacy.mechanisms.blt``) that pattern is the worst one (McMahan et al. 2024), and the sum
of those columns obeys ``s_r = c_r + s_{r - min_sep}``: O(steps) once ``c`` is known, no
``steps x steps`` matrix (``privacy.mechanisms.blt.blt_sensitivity`` builds one; both agree:
``tests/test_blt_accounting.py::test_the_ledgers_sensitivity_is_the_blts``).

Lives apart from ``privacy.mechanisms`` so that ``privacy.accounting`` (which that package
builds on) can read it.
"""

from __future__ import annotations

import functools
import math

from privacy.errors import PrivacyError


@functools.lru_cache(maxsize=64)
def cyclic_blt_sensitivity(decays: tuple[float, ...], scales: tuple[float, ...], steps: int, min_sep: int) -> float:
    """The L2 norm of the sum of columns ``0, min_sep, 2 min_sep, ... < steps`` of the BLT with
    buffer ``decays`` and output ``scales`` (first column ``1, sum_i scales_i decays_i^(j-1)``).

    Formal Guarantee: equals ``privacy.mechanisms.blt.blt_sensitivity(blt, steps,
    participations=ceil(steps / min_sep), min_sep=min_sep)`` to 1e-12 relative
    (``tests/test_blt_accounting.py::test_the_ledgers_sensitivity_is_the_blts``); non-decreasing
    in ``steps``. Cached per arguments (a ledger asks it every step).
    Edge cases: ``steps < 1`` or ``min_sep < 1`` raise ``PrivacyError`` naming them;
    no buffers (``()``, ``()``) is ``C = I``: ``sqrt(ceil(steps / min_sep))``."""
    if steps < 1 or min_sep < 1:
        raise PrivacyError(f"steps and min_sep must be >= 1, got steps={steps}, min_sep={min_sep}")
    if len(decays) != len(scales):
        raise PrivacyError(f"a BLT needs as many decays as scales, got {len(decays)} and {len(scales)}")
    summed = [1.0] + [0.0] * (steps - 1)
    powers = [1.0] * len(decays)  # decays_i^(j-1)
    for j in range(1, steps):
        summed[j] = math.fsum(w * p for w, p in zip(scales, powers))
        powers = [p * t for p, t in zip(powers, decays)]
    for r in range(min_sep, steps):  # add the column that starts min_sep earlier
        summed[r] += summed[r - min_sep]
    return math.sqrt(math.fsum(x * x for x in summed))
