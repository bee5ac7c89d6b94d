"""Gradient-space ("Dirac") canaries: examples whose clipped gradient is known exactly.

Canary ``i`` is the input row ``norm * e_i`` to a bias-free ``nn.Linear(m, 1)`` whose
per-example loss is minus its output: the example's gradient is ``-norm * e_i`` on the weight,
whatever the weight, so a working clip makes it ``-min(norm, C) * e_i`` and every canary moves
its own coordinate and no other. A canary's score is that coordinate's change over the run,
the white-box, strongest score of Steinke, Nasr and Jagielski (their gradient-space canaries):
an included canary adds ``lr * min(norm, C) / (q N)`` to it each step it is sampled, and the
noise adds the same Gaussian to every coordinate, included or not.

Membership is a seeded draw, recorded (:func:`draw_membership`): each canary in with
probability 1/2, independently, as the theorem requires.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor, nn

from privacy.errors import PrivacyError

_HASH_PERSON = b"fsdpx.canary.v1"


def draw_membership(canaries: int, *, seed: int) -> np.ndarray:
    """A bool array of ``canaries`` entries, each True with probability 1/2 independently,
    a pure function of ``(canaries, seed)``: record the seed and the draw can be replayed
    (``tests/test_audit_run.py::test_membership_is_a_seeded_fair_draw``).

    Edge cases: ``canaries < 1`` -> :class:`PrivacyError`."""
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 1:
        raise PrivacyError(f"canaries must be an int >= 1, got canaries={canaries!r}")
    digest = hashlib.blake2b(repr(int(seed)).encode(), digest_size=16, person=_HASH_PERSON).digest()
    gen = np.random.Generator(np.random.SFC64(int.from_bytes(digest, "little")))
    return gen.integers(0, 2, size=canaries).astype(bool)


def canary_model(canaries: int) -> nn.Linear:
    """The bias-free ``nn.Linear(canaries, 1)`` at zero that the canaries are trained into."""
    model = nn.Linear(canaries, 1, bias=False, dtype=torch.float64)
    nn.init.zeros_(model.weight)
    return model


def canary_rows(included: np.ndarray, *, norm: float) -> tuple[Tensor, Tensor]:
    """The training set ``(inputs, targets)``: one row ``norm * e_i`` per included canary ``i``
    (float64), targets zeros (the loss ignores them).

    Edge cases: no canary included -> :class:`PrivacyError` (there is nothing to train on);
    ``norm <= 0`` or not finite -> :class:`PrivacyError`."""
    if not 0 < norm < float("inf"):
        raise PrivacyError(f"canary norm must be finite and > 0, got {norm}")
    rows = np.flatnonzero(included)
    if rows.size == 0:
        raise PrivacyError("no canary was drawn in: draw more canaries")
    inputs = torch.zeros(rows.size, included.size, dtype=torch.float64)
    inputs[torch.arange(rows.size), torch.from_numpy(rows)] = norm
    return inputs, torch.zeros(rows.size, dtype=torch.float64)


def canary_loss(output: Tensor, target: Tensor) -> Tensor:
    """Per-example loss ``-output``: its gradient does not depend on the weight, so a canary's
    gradient is exactly its input row, negated. ``output`` is ``(B, 1)``; returns ``(B,)``."""
    return -output[:, 0]


def canary_scores(initial: Tensor, final: Tensor) -> np.ndarray:
    """Each canary's score: its coordinate's increase over the run (``final - initial`` of the
    ``(1, m)`` weight), as a float64 numpy array of ``m``."""
    return (final - initial).reshape(-1).detach().to(torch.float64).numpy()
