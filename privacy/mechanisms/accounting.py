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
"""

from __future__ import annotations


from privacy.accounting import DEFAULT_PLD_DISCRETIZATION, epsilon, noise_multiplier
from privacy.errors import PrivacyError


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
