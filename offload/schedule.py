"""When ZenFlow reselects its columns, in steps: DeepSpeed's ``select_strategy`` and
``select_interval`` resolved against the run's update interval and epoch length.

``zenflow(select_interval=)`` counts steps (or is ``"auto"``: the coverage rule of
``offload.auto``). DeepSpeed's configuration also speaks of epochs; this module turns its words
into that one number, by one documented rule per strategy:

=========  ====================  ===========================================================
strategy   select_interval       reselect every ... steps
=========  ====================  ===========================================================
"step"     int ``n``             ``n`` (a multiple of a fixed ``update_interval``)
"step"     ``"auto"``            the coverage rule (``"auto"`` passed on; fsdpx's rule:
                                 DeepSpeed accepts ``"auto"`` only with strategy ``"auto"``)
"step"     ``None``              fsdpx's default: the largest multiple of a fixed
                                 ``update_interval`` not above 100 (at least one window);
                                 100 with ``update_interval="auto"``
"epoch"    int ``k`` (None: 1)   ``k`` epochs, rounded up to whole windows of a fixed
                                 ``update_interval``: ``ceil(k * E / u) * u``
"auto"     ``None``/``"auto"``   DeepSpeed's rule: "epoch" with ``k = 1``
=========  ====================  ===========================================================

``E`` (``steps_per_epoch``) is the number of steps that draw as many examples as the data
holds: ``ceil(1 / sample_rate)`` for Poisson batches. The count starts at ZenFlow's first step
(``N + 1`` after ``full_warm_up_rounds=N``), so "epoch" reselects at the end of the steps
``N + j * k * E``: on epoch boundaries when the warm-up is whole epochs and the update interval
divides ``E`` (``tests/test_zenflow_knobs.py::test_select_strategy_epoch_reselects_at_epoch_boundaries``);
otherwise at the first window end after them. With ``update_interval="auto"`` a reselection
waits for the first window end at least that many steps after the previous one (``offload.zenflow``).
"""

from __future__ import annotations

import math

SELECT_STRATEGIES = ("step", "epoch", "auto")
DEFAULT_SELECT_STEPS = 100


def steps_per_epoch(sample_rate: float) -> int:
    """Steps whose Poisson batches draw as many examples, in expectation, as the data holds:
    ``ceil(1 / sample_rate)`` (at least 1; a rate whose reciprocal is an integer up to float
    rounding gives that integer). Raises ``ValueError`` unless ``0 < sample_rate <= 1``."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    inverse = 1 / sample_rate
    nearest = round(inverse)
    return max(1, nearest if math.isclose(inverse, nearest, rel_tol=1e-9) else math.ceil(inverse))


def select_interval_steps(strategy: str, select_interval: int | str | None, update_interval: int | str,
                          epoch_steps: int) -> int | str:
    """The ``select_interval`` to pass to ``zenflow``: steps between reselections, or ``"auto"``
    (the coverage rule), by the table of the module docstring.

    Guarantees: an int result is >= 1 and, with a fixed ``update_interval``, a multiple of it
    (so ``zenflow`` accepts it); "epoch" and "auto" give a multiple of ``epoch_steps`` whenever
    the update interval divides ``epoch_steps``.

    Edge cases: an unknown strategy, ``"auto"`` with an int ``select_interval`` (DeepSpeed
    refuses it too), ``"epoch"`` with ``"auto"``, "step" with an int that is not a multiple of a
    fixed ``update_interval``, intervals below 1 or ``epoch_steps < 1`` raise ``ValueError``
    (``tests/test_zenflow_knobs.py::test_select_interval_steps_follows_its_table``)."""
    fixed = update_interval if isinstance(update_interval, int) else None
    if strategy not in SELECT_STRATEGIES:
        raise ValueError(f"select_strategy must be one of {', '.join(SELECT_STRATEGIES)}, got {strategy!r}")
    if epoch_steps < 1:
        raise ValueError(f"steps per epoch must be >= 1, got {epoch_steps}")
    if isinstance(select_interval, int) and select_interval < 1:
        raise ValueError(f"select_interval must be >= 1, got {select_interval}")
    if strategy == "step":
        if select_interval is None:
            return DEFAULT_SELECT_STEPS if fixed is None else fixed * max(1, DEFAULT_SELECT_STEPS // fixed)
        if fixed is not None and select_interval != "auto" and select_interval % fixed:
            raise ValueError(f"select_interval ({select_interval}) must be a multiple of update_interval ({fixed})")
        return select_interval
    if strategy == "auto":
        if select_interval not in (None, "auto"):
            raise ValueError("select_strategy 'auto' reselects every epoch: select_interval must be unset or 'auto'")
        epochs = 1
    else:
        if select_interval == "auto":
            raise ValueError("select_strategy 'epoch' needs a number of epochs, not 'auto'")
        epochs = 1 if select_interval is None else select_interval
    steps = epochs * epoch_steps
    return steps if fixed is None else math.ceil(steps / fixed) * fixed
