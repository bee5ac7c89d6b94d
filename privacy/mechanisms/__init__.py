"""Correlated-noise (matrix-factorization) mechanisms: the strategy as data
(:mod:`.mechanism`), its optimised coefficients (:mod:`.optimize`), its sensitivity
(:mod:`.sensitivity`), its noise streamed from one independent draw per step and the last
``b - 1`` outputs, kept in the train state (:mod:`.correlated`), buffered linear Toeplitz
strategies (:mod:`.blt`: data, streamed noise from ``D`` buffers, sensitivity, optimiser; the
``blt`` kind of :class:`Mechanism`), the sampler that keeps participations apart
(:mod:`.cyclic_sampling`) and its epsilon (:mod:`.accounting`)."""

from privacy.mechanisms.accounting import (banded_epsilon, banded_noise_multiplier, blt_epsilon, blt_noise_multiplier,
                                           participations)
from privacy.mechanisms.blt import (BufferedToeplitz, blt_error, blt_mechanism, blt_sensitivity, blt_step, optimal_blt,
                                    strategy_of)
from privacy.mechanisms.correlated import NoiseHistory, empty_history, next_output, streamed_noise
from privacy.mechanisms.cyclic_sampling import CyclicPoissonSampler
from privacy.mechanisms.mechanism import INDEPENDENT, KINDS, Mechanism, banded
from privacy.mechanisms.optimize import optimal_banded, prefix_sum_error
from privacy.mechanisms.sensitivity import banded_sensitivity, dense_strategy, min_sep_sensitivity

__all__ = [
    "INDEPENDENT", "KINDS", "BufferedToeplitz", "CyclicPoissonSampler", "Mechanism", "NoiseHistory", "banded",
    "banded_epsilon", "banded_noise_multiplier", "banded_sensitivity", "blt_epsilon", "blt_error", "blt_mechanism",
    "blt_noise_multiplier", "blt_sensitivity", "blt_step", "strategy_of",
    "dense_strategy", "empty_history", "min_sep_sensitivity",
    "next_output", "optimal_banded", "optimal_blt", "participations", "prefix_sum_error", "streamed_noise",
]
