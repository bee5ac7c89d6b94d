"""DP-SGD as pure functions: per-example norms (vmap, ghost), clipping, noise, sampling,
accounting, and the private step. See ``docs/architecture.md``."""

from privacy.accounting import Accountant, epsilon, max_steps, noise_multiplier
from privacy.clipping import clip_factors, clipped_grad, per_sample_norms
from privacy.errors import BudgetExhaustedError, NonFiniteGradientError, PrivacyError, UnsupportedLayerError
from privacy.noise import gaussian_noise, noise_slice
from privacy.per_sample import per_sample_grads
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, TrainState, init_state, make_private_step, sample_batch

__all__ = [
    "Accountant", "BudgetExhaustedError", "DPConfig", "NonFiniteGradientError", "PoissonSampler", "PrivacyError",
    "TrainState", "UnsupportedLayerError", "clip_factors", "clipped_grad", "epsilon", "gaussian_noise",
    "init_state", "make_private_step", "max_steps", "noise_multiplier", "noise_slice", "per_sample_grads",
    "per_sample_norms", "sample_batch",
]
