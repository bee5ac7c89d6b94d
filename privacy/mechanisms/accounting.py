"""The epsilon of a banded mechanism under cyclic Poisson sampling, on ``privacy.accounting``.

Cyclic Poisson sampling with ``b`` groups (``privacy.mechanisms.cyclic_sampling``): every
example belongs to one group, group ``t mod b`` is active at step ``t``, and each example of
the active group is in the batch independently with probability ``q`` (the rate within its
group). An example therefore participates only at steps ``b`` apart, at most
``k = ceil(n / b)`` times in ``n`` steps.

With a ``b``-banded, column-normalised ``C`` the run releases ``C x + z``: its participations
touch disjoint rows of ``C``, each a Poisson-subsampled Gaussian of sensitivity 1 and noise
multiplier ``sigma``, so the run has the epsilon of ``k`` DP-SGD steps at rate ``q``
(Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", amplification by
cyclic Poisson sampling; jax_privacy
accounts BandMF with cyclic Poisson sampling the same way). ``b = 1`` is DP-SGD. With ``q = 1``
(every example of the group, no amplification) it is one Gaussian mechanism of sensitivity
``sqrt(k)`` (``tests/test_mechanisms.py::test_unamplified_banded_epsilon_is_one_gaussian_of_sensitivity_sqrt_k``).

A training ledger is ``privacy.accounting.Accountant(bands=b)``: it records every step and
composes, per group, the steps that group samples; for a run of one noise multiplier its epsilon is
this module's (group 0 samples the most steps).

Supported participation: cyclic Poisson with as many groups as bands (or more). Poisson sampling
over the whole dataset with ``b > 1`` is not min-separated and is refused
(``privacy.mechanisms.cyclic_sampling``).

A BLT strategy (``privacy.mechanisms.blt``) has no bands: every column of ``C`` reaches every
later row, so participations ``b`` apart overlap and the argument above does not apply. Its runs
use cyclic groups of ``b`` (the min separation) and are accounted WITHOUT amplification: the run
releases ``C x + z``, and whatever the Poisson draws, an example's participations are a subset
of its group's ``k = ceil(n / b)`` steps, ``b`` apart. ``C``'s entries are non-negative, so the
columns of any subset sum to a vector no longer than the sum over all ``k``; ``sens``, the BLT's
min-separation sensitivity (:func:`privacy.mechanisms.blt.blt_sensitivity`), bounds every
realisation. Conditional on the draws (which do not depend on the other examples) each pair of
neighbouring outputs is a Gaussian pair at distance at most ``sens * clip``, so its hockey-stick
divergence is at most that of one Gaussian mechanism of noise multiplier ``sigma / sens``; the
mixture over the draws is jointly convex in the pair, so the run is at least as private as that
one Gaussian mechanism: :func:`blt_epsilon` is an upper bound on epsilon, and a conservative one
(it ignores the sampling rate ``q`` entirely). With a noise multiplier that changes between
segments the smallest one bounds all (``C S^{-1}`` with ``S >= sigma_min`` has entries at most
``C / sigma_min``). Amplified BLT accounting (Choquette-Choo et al. 2024, "Near-exact privacy
amplification for matrix mechanisms"), which credits ``q``, is not built.
"""

from __future__ import annotations

import math

from privacy.accounting import DEFAULT_PLD_DISCRETIZATION, epsilon, gaussian_epsilon, noise_multiplier
from privacy.blt_sensitivity import cyclic_blt_sensitivity
from privacy.errors import PrivacyError

from .mechanism import Mechanism


def participations(steps: int, bands: int) -> int:
    """``ceil(steps / bands)``: the most steps any example can take part in over steps
    ``0..steps-1`` when group ``t mod bands`` is active at step ``t`` (group 0's count)."""
    if bands < 1:
        raise PrivacyError(f"bands must be >= 1, got bands={bands}")
    if steps < 0:
        raise PrivacyError(f"steps must be >= 0, got steps={steps}")
    return -(-steps // bands)


def banded_epsilon(noise_multiplier_: float, sample_rate: float, steps: int, bands: int, delta: float, *,
                   accountant: str = "pld",
                   value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION) -> float:
    """The epsilon at ``delta`` of ``steps`` steps of a column-normalised ``bands``-banded
    mechanism with noise multiplier ``sigma`` under cyclic Poisson sampling at rate
    ``sample_rate`` within the active group: ``privacy.accounting.epsilon(sigma, sample_rate,
    ceil(steps / bands), delta)``.

    Formal Guarantees: equals dp_accounting composing ``ceil(steps / bands)`` Poisson-sampled
    Gaussian steps (``test_banded_epsilon_equals_dp_accounting_on_the_participations``);
    ``bands == 1`` is the DP-SGD epsilon. Edge cases: as ``privacy.accounting.epsilon``."""
    return epsilon(noise_multiplier_, sample_rate, participations(steps, bands), delta, accountant=accountant,
                   value_discretization_interval=value_discretization_interval)


def banded_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int, bands: int, *,
                            accountant: str = "pld",
                            value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION) -> float:
    """The smallest noise multiplier whose :func:`banded_epsilon` is at most ``target_epsilon``
    (``privacy.accounting.noise_multiplier`` on ``ceil(steps / bands)`` participations)."""
    return noise_multiplier(target_epsilon, delta, sample_rate, participations(steps, bands), accountant=accountant,
                            value_discretization_interval=value_discretization_interval)


def blt_epsilon(noise_multiplier_: float, mechanism: Mechanism, steps: int, delta: float, *,
                accountant: str = "pld",
                value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION) -> float:
    """The epsilon at ``delta`` of ``steps`` steps of the BLT ``mechanism`` (kind "blt") with noise
    multiplier ``sigma`` and cyclic groups of its ``min_sep``: one Gaussian mechanism of noise
    multiplier ``sigma / sens``, ``sens`` the BLT's sensitivity for ``ceil(steps / min_sep)``
    participations (un-amplified: an upper bound, see the module doc).

    Formal Guarantees: equals the analytic Gaussian mechanism's epsilon (Balle and Wang 2018) at
    multiplier ``sigma / sens`` to the PLD's pessimistic rounding
    (``tests/test_blt_accounting.py::test_blt_epsilon_is_the_analytic_gaussian_at_sigma_over_the_sensitivity``);
    equals ``Accountant(bands=min_sep, blt=...)`` after recording the steps.
    Edge cases: ``steps == 0`` gives 0.0; ``sigma == 0`` gives inf; a mechanism of another kind
    raises ``PrivacyError``; other arguments as ``privacy.accounting.epsilon``."""
    if steps == 0:
        return 0.0
    sens = blt_ledger_sensitivity(mechanism, steps)
    return gaussian_epsilon(noise_multiplier_ / sens, delta, accountant=accountant,
                            value_discretization_interval=value_discretization_interval)


def blt_noise_multiplier(target_epsilon: float, delta: float, mechanism: Mechanism, steps: int, *,
                         accountant: str = "pld",
                         value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION) -> float:
    """The noise multiplier whose :func:`blt_epsilon` over ``steps`` is at most ``target_epsilon``:
    ``sens`` times the one-step Gaussian's (``privacy.accounting.noise_multiplier`` at rate 1),
    within its 1e-3 relative tolerance in epsilon
    (``tests/test_blt_accounting.py::test_blt_noise_multiplier_inverts_blt_epsilon``).
    Edge cases: ``steps == 0`` gives 0.0; others as ``privacy.accounting.noise_multiplier``."""
    if steps == 0:
        return 0.0
    unit = noise_multiplier(target_epsilon, delta, 1.0, 1, accountant=accountant,
                            value_discretization_interval=value_discretization_interval)
    sens = blt_ledger_sensitivity(mechanism, steps)
    sigma = unit * sens
    while sigma / sens < unit:  # the ledger divides again: never below the calibrated multiplier
        sigma = math.nextafter(sigma, math.inf)
    return sigma


def blt_ledger_sensitivity(mechanism: Mechanism, steps: int) -> float:
    """``sens`` of the BLT ``mechanism`` over ``steps`` steps with every participation of cyclic
    groups of ``mechanism.min_sep``. Raises ``PrivacyError`` for a mechanism of another kind."""
    if mechanism.kind != "blt":
        raise PrivacyError(f"a BLT ledger needs a mechanism of kind 'blt', got {mechanism.kind!r}")
    return cyclic_blt_sensitivity(mechanism.decays, mechanism.scales, steps, mechanism.min_sep)
