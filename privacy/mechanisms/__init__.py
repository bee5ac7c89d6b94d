"""Correlated-noise (matrix-factorization) mechanisms: the strategy as data
(:mod:`.mechanism`), its optimised coefficients (:mod:`.optimize`), its sensitivity
(:mod:`.sensitivity`), its noise regenerated from the independent draws of earlier steps on any
slice (:mod:`.correlated`), the sampler that keeps participations apart
(:mod:`.cyclic_sampling`) and its epsilon (:mod:`.accounting`)."""

from privacy.mechanisms.accounting import banded_epsilon, banded_noise_multiplier, participations
from privacy.mechanisms.correlated import correlated_gaussian_noise, correlated_noise_slice
from privacy.mechanisms.cyclic_sampling import CyclicPoissonSampler
from privacy.mechanisms.mechanism import INDEPENDENT, KINDS, Mechanism, banded
from privacy.mechanisms.optimize import optimal_banded, prefix_sum_error
from privacy.mechanisms.sensitivity import banded_sensitivity, dense_strategy, min_sep_sensitivity

__all__ = [
    "INDEPENDENT", "KINDS", "CyclicPoissonSampler", "Mechanism", "banded", "banded_epsilon", "banded_noise_multiplier",
    "banded_sensitivity", "correlated_gaussian_noise", "correlated_noise_slice", "dense_strategy",
    "min_sep_sensitivity", "optimal_banded", "participations", "prefix_sum_error",
]
