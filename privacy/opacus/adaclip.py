"""Opacus' adaptive clipping (``clipping="adaptive"``): the clip bound follows a target quantile of
the per-example gradient norms (Andrew, Thakkar, McMahan, Ramaswamy 2021, arXiv 1905.03871).

Each step counts the examples the bound did not clip, adds Gaussian noise of standard deviation
``unclipped_num_std`` to that count, and moves the bound geometrically toward the target share::

    C <- clamp(C * exp(-clipbound_learning_rate * (noisy unclipped / examples - target)),
               min_clipbound, max_clipbound)

Privacy (their Theorem 1): releasing the count with noise ``sigma_b`` and the gradient sum with
noise multiplier ``sigma_eff = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` is as private as the gradient
sum alone with ``sigma``, so the accountant records ``sigma`` as for flat clipping, and
``sigma < 2 sigma_b`` is required. As in Opacus, the count is divided by the number of
examples clipped (not the expected batch size) and the bound moves after the noisy gradient is
formed, so a step's gradient is clipped by the bound the previous steps chose.

The count's noise is fsdpx noise like the gradient's: a pure function of the key, the step and
the name ``UNCLIPPED_COUNT`` (no parameter has it), so a run is reproduced by its key.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from privacy.errors import PrivacyError
from privacy.noise import gaussian_noise

from .optimizer import DPOptimizer

UNCLIPPED_COUNT = "opacus.adaclip.unclipped_count"  # the noise "parameter" of the count

ADAPTIVE_ARGUMENTS = ("target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound", "min_clipbound",
                      "unclipped_num_std")


class AdaClipDPOptimizer(DPOptimizer):
    """:class:`DPOptimizer` whose ``max_grad_norm`` adapts after every real step (module doc).
    ``sample_size`` and ``unclipped_num`` count the examples since the last real step.

    Formal Guarantees: with ``noise_multiplier=0`` and a negligible ``unclipped_num_std`` its
    bounds and parameters follow Opacus' ``AdaClipDPOptimizer``
    (``tests/test_opacus_adaclip.py::test_adaptive_clipping_follows_opacus``).
    Edge cases: ``max_clipbound <= min_clipbound`` or ``noise_multiplier >= 2 *
    unclipped_num_std`` -> :class:`PrivacyError` naming them (Opacus raises ``ValueError``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: Any, *, target_unclipped_quantile: float,
                 clipbound_learning_rate: float, max_clipbound: float, min_clipbound: float,
                 unclipped_num_std: float, **settings: Any) -> None:
        super().__init__(optimizer, module, **settings)
        if not max_clipbound > min_clipbound:
            raise PrivacyError(f"privacy.opacus: max_clipbound={max_clipbound} must be larger than"
                               f" min_clipbound={min_clipbound}")
        if not self.noise_multiplier < 2 * unclipped_num_std:
            raise PrivacyError(f"privacy.opacus: noise_multiplier={self.noise_multiplier} must be smaller than"
                               f" 2 * unclipped_num_std={2 * unclipped_num_std} (Theorem 1 of arXiv 1905.03871)")
        self.target_unclipped_quantile = target_unclipped_quantile
        self.clipbound_learning_rate = clipbound_learning_rate
        self.max_clipbound, self.min_clipbound = max_clipbound, min_clipbound
        self.unclipped_num_std = unclipped_num_std
        self.sample_size, self.unclipped_num = 0, 0

    def gradient_noise_multiplier(self) -> float:
        """``sigma_eff = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``, 0 without noise."""
        if self.noise_multiplier == 0:
            return 0.0
        return (self.noise_multiplier ** -2 - (2 * self.unclipped_num_std) ** -2) ** -0.5

    def count_clipped(self, norms: torch.Tensor) -> None:
        """Count the examples whose Opacus clip factor ``C / (norm + 1e-6)`` is at least 1."""
        self.sample_size += int(norms.numel())
        self.unclipped_num += int((self.max_grad_norm / (norms + 1e-6) >= 1).sum())

    def after_noise(self) -> None:
        """The noisy share of unclipped examples moves the bound (module doc); the counts restart."""
        count = torch.tensor([float(self.unclipped_num)], dtype=torch.float64)
        noise = gaussian_noise({UNCLIPPED_COUNT: count}, key=self.noise_key, step=self.steps,
                               std=self.unclipped_num_std)[UNCLIPPED_COUNT] if self.unclipped_num_std > 0 else 0.0
        share = float(count + noise) / max(self.sample_size, 1)
        bound = self.max_grad_norm * math.exp(-self.clipbound_learning_rate * (share - self.target_unclipped_quantile))
        self.max_grad_norm = min(max(bound, self.min_clipbound), self.max_clipbound)
        self.sample_size, self.unclipped_num = 0, 0
