"""The privacy target of a run is a budget: the noise of each segment is planned against it.

A run is a sequence of segments (the first run, then each ``--resume`` or ``--resume-from``).
Before a segment trains, :func:`segment_noise` chooses the noise multiplier of its remaining
steps so that the accountant's exact history (every event recorded so far, whatever sigma and q
each used) composed with those steps ends at or below the target; if no noise multiplier up to
the stated maximum fits, it raises :class:`SegmentDoesNotFitError` before anything is trained.
:func:`check_budget_change` refuses a looser promise (a larger budget or delta) unless it is
asked for explicitly. Pure functions: they read an :class:`privacy.accounting.Accountant` and
numbers, and write nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from privacy.accounting import NOISE_MULTIPLIER_RTOL, Accountant, max_steps, noise_multiplier
from privacy.errors import PrivacyError

from .config import MAX_NOISE_MULTIPLIER


class BudgetError(PrivacyError):
    """A segment cannot run within the privacy promise of its run; the message says why."""


class SegmentDoesNotFitError(BudgetError):
    """No noise multiplier up to the maximum keeps the whole run within its target epsilon.

    ``steps_fit``: how many more steps fit at ``current_noise`` (the noise the run used last,
    or the maximum when there is none); ``noise_needed``: the noise multiplier the requested
    steps need (``inf`` when none does: the history alone is over the target)."""

    def __init__(self, message: str, *, steps_fit: int, current_noise: float, noise_needed: float) -> None:
        super().__init__(message)
        self.steps_fit, self.current_noise, self.noise_needed = steps_fit, current_noise, noise_needed


class BudgetIncreaseError(BudgetError):
    """A resumed segment asked for a larger epsilon budget (or delta) without
    ``allow_budget_increase``."""


def segment_noise(spent: Accountant, *, target: float, sample_rate: float, steps: int,
                  current: float | None = None, max_noise: float = MAX_NOISE_MULTIPLIER) -> float:
    """The noise multiplier of ``steps`` more steps at ``sample_rate`` after the history ``spent``.

    Returns ``current`` (the noise the run used last) when it keeps the whole run within
    ``target`` and spends at least ``1 - NOISE_MULTIPLIER_RTOL`` of it, which is exactly what
    calibration would accept: an interrupted segment resumed unchanged continues with the same
    noise, bit for bit. Otherwise the smallest noise multiplier (``privacy.accounting.noise_multiplier``
    with ``history=spent.events``) that keeps it within ``target``.

    Formal Guarantees:
      * ``spent.record(result, sample_rate, steps).epsilon() <= target``
        (``tests/test_budget.py::test_the_whole_history_ends_within_the_target``,
        ``property_tests/test_budget_properties.py``).
      * ``result <= max_noise``; otherwise :class:`SegmentDoesNotFitError`, which names how many
        steps fit at the current noise and which noise the requested steps need
        (``tests/test_budget.py::test_a_segment_that_cannot_fit_names_the_steps_that_fit_and_the_noise_needed``).

    Edge cases:
      =============================  =================================================
      ``steps == 0``                 ``current`` or 0.0 (nothing to calibrate)
      history already over target    :class:`SegmentDoesNotFitError`, 0 steps fit
      ``current`` with another q     pass ``None``: noise is recalibrated
      =============================  =================================================
    """
    if steps <= 0:
        return current if current is not None else 0.0
    if current is not None:
        after = spent.record(current, sample_rate, steps).epsilon()
        if (1.0 - NOISE_MULTIPLIER_RTOL) * target <= after <= target:
            return current
    fits = lambda s: spent.record(s, sample_rate, steps).epsilon() <= target  # noqa: E731
    try:
        if not spent.is_dp_sgd:  # the calibrator below knows DP-SGD's ledger, not cyclic groups' or a BLT's
            sigma = _first_fitting(fits)
        else:
            sigma = noise_multiplier(target, spent.delta, sample_rate, steps, accountant=spent.accountant,
                                     value_discretization_interval=spent.value_discretization_interval,
                                     history=spent.events)
    except PrivacyError:  # the history alone is over the target, or no sigma <= 2**20 reaches it
        sigma = math.inf
    if math.isfinite(sigma):  # the calibrator stops at 0.1% of the target in EPSILON: with a history
        # that spent most of it, that can be far above the smallest sigma; narrow it in sigma
        sigma = _smallest_fitting(fits, sigma)
    if sigma <= max_noise:
        return sigma
    at = current if current is not None else max_noise
    if not spent.is_dp_sgd:  # max_steps composes DP-SGD's ledger; a banded one composes each group's steps
        fit = _last_fitting(lambda s: spent.record(at, sample_rate, s).epsilon() <= target, steps)
    else:
        fit = max_steps(at, sample_rate, spent.delta, target, accountant=spent.accountant,
                        value_discretization_interval=spent.value_discretization_interval, history=spent.events)
    need = f"need noise multiplier {sigma:.4g}" if math.isfinite(sigma) else "cannot fit at any noise"
    raise SegmentDoesNotFitError(
        f"privacy budget: {steps} more step(s) at sample rate {sample_rate:.4g} {need}, above the maximum"
        f" {max_noise:g} (--max-noise-multiplier); the run has spent epsilon {spent.epsilon():.4g} of its"
        f" target {target:g} in {spent.steps} step(s), and only {fit} more step(s) fit at noise multiplier"
        f" {at:.4g}. Ask for fewer steps or a smaller batch, raise the maximum, or raise the target with"
        f" --allow-budget-increase", steps_fit=fit, current_noise=at, noise_needed=sigma)


def _last_fitting(fits: Callable[[int], bool], below: int) -> int:
    """The largest ``s < below`` with ``fits(s)`` (0 when none), by bisection: epsilon is
    non-decreasing in steps."""
    lo, hi = 0, below  # fits(lo) (0 steps spend nothing more), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _first_fitting(fits: Callable[[float], bool]) -> float:
    """The first of ``1/16, 1/8, ..., 2**20`` that fits (:func:`_smallest_fitting` then narrows
    it); ``PrivacyError`` when none does."""
    sigma = 2.0**-4
    while not fits(sigma):
        sigma *= 2.0
        if sigma > 2.0**20:
            raise PrivacyError("no noise multiplier <= 2**20 keeps the run within its target")
    return sigma


def _smallest_fitting(fits: Callable[[float], bool], sigma: float, rtol: float = NOISE_MULTIPLIER_RTOL) -> float:
    """A fitting noise multiplier at most ``1 + rtol`` above the smallest one in
    ``[sigma / 2, sigma]`` (``sigma`` fits; epsilon is non-increasing in sigma)."""
    lo, hi = sigma / 2.0, sigma
    if fits(lo):
        return sigma
    while hi > lo * (1.0 + rtol):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def check_budget_change(spent: Accountant, *, epsilon_budget: float | None, delta: float,
                        allow_increase: bool) -> Accountant:
    """``spent`` with the new segment's ``epsilon_budget`` and ``delta``.

    Guarantee: a promise is only loosened on request. A larger budget than the recorded one
    (or none at all where one was recorded), or a larger delta, raises
    :class:`BudgetIncreaseError` naming both values unless ``allow_increase``
    (``tests/test_budget.py::test_raising_the_target_needs_the_explicit_flag``). A smaller or
    equal budget is always allowed (the planner then refuses if the history is already over)."""
    old_budget, old_delta = spent.epsilon_budget, spent.delta
    looser_budget = old_budget is not None and (epsilon_budget is None or epsilon_budget > old_budget)
    if (looser_budget or delta > old_delta) and not allow_increase:
        raise BudgetIncreaseError(
            f"the run was promised epsilon {old_budget} at delta {old_delta:g}; this segment asks for epsilon"
            f" {epsilon_budget} at delta {delta:g}. A larger budget must be explicit: pass"
            f" --allow-budget-increase (allow_budget_increase=True); it is recorded in the run's segments")
    return dataclasses.replace(spent, epsilon_budget=epsilon_budget, delta=delta)
