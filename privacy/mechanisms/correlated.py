"""The correlated noise of a matrix-factorization mechanism, regenerated, for any flat slice.

Step ``t``'s noise is ``w_t = sum_{k<=t} C^{-1}[t, k] z_k = sum_{j=0..t} d[j] z_{t-j}`` with
``z_k`` the independent noise of step ``k`` (``privacy.noise.noise_slice``, ``step=k``) and ``d``
the first column of the Toeplitz ``C^{-1}``. No ``z_k`` is stored: each is drawn again from its
key, so the correlated noise of any flat range of any parameter is a pure function of
``(mechanism, key, step, name, range)`` like today's noise, and a sharded run adds the
unsharded run's bits (``tests/test_mechanisms.py::test_correlated_slices_concatenate_to_the_full_draw``).

Cost: ``C^{-1}`` of a banded ``C`` is dense, so step ``t`` draws ``t + 1`` slices: O(t) per
step, O(n^2) over a run. That suits the small runs the tests and the benchmark make; a long run
wants the streaming form (``b - 1`` stored outputs, or BLT buffers), which is not built.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from privacy.noise import noise_slice

from .mechanism import Mechanism


def correlated_noise_slice(mechanism: Mechanism, name: str, numel: int, start: int, stop: int, *, key: int,
                           step: int, std: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """``std * sum_{j=0..step} d[j] z_{step-j}[start:stop]`` for flat elements ``[start, stop)``
    of parameter ``name``, a 1-D CPU tensor of ``dtype``.

    Each unit draw ``z_k`` is ``noise_slice(..., step=k, std=1.0, dtype=float64)``; the sum runs
    from ``j = 0`` up, one multiply and one add per term, in float64, then ``* std`` and a
    rounding to ``dtype``: every element takes the same operations wherever the slice is cut.

    Formal Guarantees:
      * Independent mechanism: exactly ``noise_slice(..., std=std, dtype=dtype)``, today's bits
        (``test_independent_mechanism_is_todays_noise``).
      * Partition invariance, as for ``noise_slice``: slices concatenate to the full draw bit
        for bit (``test_correlated_slices_concatenate_to_the_full_draw``).
      * Equals ``C^{-1}`` times the stacked unit draws ``z_0..z_t`` (dense product) to float64
        rounding (``test_correlated_noise_is_the_inverse_strategy_times_the_draws``); its
        covariance over keys is ``std^2 (C^{-1} C^{-T})[t, t']`` between steps ``t, t'``
        (``test_correlated_noise_has_the_mechanisms_covariance``).
    Edge cases: as ``noise_slice`` (``std == 0`` gives zeros; bad ranges raise ``ValueError``).
    """
    if mechanism.kind == "independent":
        return noise_slice(name, numel, start, stop, key=key, step=step, std=std, dtype=dtype)
    if step < 0:
        raise ValueError(f"step must be >= 0, got step={step}")
    d = mechanism.noising_coefficients(step + 1)
    acc = torch.zeros(stop - start, dtype=torch.float64)
    if std == 0.0 or start == stop:
        noise_slice(name, numel, start, stop, key=key, step=step, std=std, dtype=dtype)  # validates
        return acc.to(dtype)
    if not math.isfinite(std) or std < 0:
        raise ValueError(f"std must be finite and >= 0, got std={std}")
    for j, coef in enumerate(d):
        z = noise_slice(name, numel, start, stop, key=key, step=step - j, std=1.0, dtype=torch.float64)
        acc.add_(z.mul_(coef))
    return acc.mul_(std).to(dtype)


def correlated_gaussian_noise(mechanism: Mechanism, params_like: dict[str, Tensor], *, key: int, step: int,
                              std: float) -> dict[str, Tensor]:
    """The mechanism's noise shaped like ``params_like``: per name the full
    :func:`correlated_noise_slice`, reshaped, in the tensor's dtype and on its device. Reads
    names, shapes, dtypes and devices only. For the independent mechanism, the bits of
    ``privacy.noise.gaussian_noise``."""
    return {name: correlated_noise_slice(mechanism, name, t.numel(), 0, t.numel(), key=key, step=step, std=std,
                                         dtype=t.dtype).view(t.shape).to(t.device)
            for name, t in params_like.items()}
