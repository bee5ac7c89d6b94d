"""``"auto"`` intervals: when ZenFlow's host update fires and when it reselects columns.

Both rules are pure functions of a few numbers the optimizer observes on the gradients it is
given (the noised gradients under DP, so the rules are post-processing). Each is written as a
comparison of products, never a ratio, so no input can make it divide by zero.

**When the host update fires.** Over the open window of ``n`` steps, let ``g_t`` be the
unselected columns' gradient at step ``t``, ``Q = sum_t |g_t|^2`` and ``S = sum_t g_t``. Always
``|S|^2 <= n Q`` (Cauchy-Schwarz), with equality when every ``g_t`` is the same vector, and
``|S|^2 ~ Q`` when the ``g_t`` are independent noise. The host fires when the accumulated
gradient is coherent enough to be worth applying::

    fire  <=>  n >= max_interval  or  (n >= min_interval and |S|^2 >= coherence * Q)

With ``g_t = mu + noise`` (noise power ``s2``) this fires once ``n >= coherence + (coherence - 1)
* s2 / |mu|^2``: consistent gradients fire after ``coherence`` steps, noisy ones wait longer to
average the noise out (DP gradients are noisy, so their windows grow), and ``max_interval`` bounds
the staleness.

**When to reselect.** At each window end, for each 2-D weight, with ``scores`` the column scores
of that step's gradient: reselect when the current selection captures less than ``coverage`` of
what the best selection of the same size would capture::

    reselect  <=>  sum(scores[selected]) < coverage * sum(top-k scores)

Edge cases (both rules): all-zero gradients give ``0 >= 0`` (fire) and ``0 < 0`` (keep the
selection); a NaN statistic makes the comparison false (no early fire, no reselection), so
``max_interval`` still bounds the window; ``inf`` compares as usual. Proved by
``tests/test_zenflow.py::test_auto_*``.
"""

from __future__ import annotations

from typing import NamedTuple


class AutoConfig(NamedTuple):
    """Thresholds of the ``"auto"`` rules (see the module docstring)."""

    coherence: float = 2.0
    min_interval: int = 1
    max_interval: int = 16
    coverage: float = 0.9


def check_config(config: AutoConfig) -> None:
    """Raise ``ValueError`` unless ``1 <= min_interval <= max_interval``, ``coherence >= 0`` and
    ``0 <= coverage <= 1``."""
    if not (1 <= config.min_interval <= config.max_interval):
        raise ValueError(f"auto intervals need 1 <= min_interval <= max_interval, got {config}")
    if not (config.coherence >= 0 and 0 <= config.coverage <= 1):
        raise ValueError(f"auto needs coherence >= 0 and coverage in [0, 1], got {config}")


def host_update_due(window_steps: int, norm_sq_of_sum: float, sum_of_norm_sq: float, config: AutoConfig) -> bool:
    """Whether the open window of ``window_steps`` steps closes now.

    ``norm_sq_of_sum = |sum_t g_t|^2`` and ``sum_of_norm_sq = sum_t |g_t|^2`` over the window's
    unselected gradients. Guarantees: fires at ``max_interval`` whatever the statistics; never
    before ``min_interval``; otherwise exactly when ``norm_sq_of_sum >= coherence *
    sum_of_norm_sq``. No division."""
    if window_steps >= config.max_interval:
        return True
    if window_steps < config.min_interval:
        return False
    return norm_sq_of_sum >= config.coherence * sum_of_norm_sq


def reselect_due(captured: float, best: float, config: AutoConfig) -> bool:
    """Whether a weight's selection is stale: ``captured`` (score mass of the selected columns)
    ``< coverage * best`` (mass of the top-k columns). No division; ``captured == best`` never
    reselects."""
    return captured < config.coverage * best
