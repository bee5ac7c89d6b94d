"""The auditor's guesses: "in" for the highest canary scores, "out" for the lowest, and their count."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from privacy.errors import PrivacyError


class Guesses(NamedTuple):
    """How many canaries the auditor guessed (abstaining on the rest) and how many it got right."""

    guesses: int
    correct: int


def guess_membership(scores: np.ndarray, included: np.ndarray, *, top: int, bottom: int = 0) -> Guesses:
    """Guess "in" for the ``top`` highest ``scores`` and "out" for the ``bottom`` lowest, abstain
    on the rest; returns ``Guesses(top + bottom, right guesses)`` against ``included``.

    Formal Guarantees (``tests/test_audit_bound.py::test_guesses_count_the_right_ones``): the
    guesses depend on ``scores`` only (ties are ordered by canary index, which is public), so
    they are a post-processing of the run and Theorem 5.2 applies to them; ``top`` and
    ``bottom`` must be chosen before the scores are seen (choosing them after needs a
    correction for the choice, which this function does not make).

    Edge cases: ``top == bottom == 0`` -> ``Guesses(0, 0)``; ``top + bottom > len(scores)``,
    a negative count, shapes that differ, or a NaN score -> :class:`PrivacyError`."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if scores.ndim != 1 or scores.shape != included.shape:
        raise PrivacyError(f"scores and included must be 1-D of one length, got {scores.shape} and {included.shape}")
    if top < 0 or bottom < 0 or top + bottom > scores.size:
        raise PrivacyError(f"need top, bottom >= 0 and top + bottom <= {scores.size} canaries, got {top}, {bottom}")
    if np.isnan(scores).any():
        raise PrivacyError("a canary score is NaN: the run did not produce a usable model")
    order = np.argsort(-scores, kind="stable")  # highest first, ties by index
    guessed_in = order[:top]
    guessed_out = order[scores.size - bottom:]
    correct = int(included[guessed_in].sum()) + int((~included[guessed_out]).sum())
    return Guesses(top + bottom, correct)
