"""Privacy accounting of DP-SGD with Poisson sampling, on top of ``dp_accounting``.

One DP-SGD step with noise multiplier ``sigma`` and sample rate ``q`` is the event
``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``; a run is the composition of its steps.
``epsilon`` and ``Accountant.epsilon`` give the numbers ``dp_accounting``'s own accountants give
for that composition, bit for bit (``test_epsilon_equals_dp_accounting_directly``):

* ``"pld"``: ``dp_accounting.pld.PLDAccountant`` (add-or-remove-one neighbours, pessimistic
  rounding) with ``value_discretization_interval`` 1e-4 by default, the library's default.
  A coarser interval is faster and still an upper bound, only a looser one.
* ``"rdp"``: ``dp_accounting.rdp.RdpAccountant`` with its default orders.

For PLD the sequence of ``PLDAccountant`` is replayed with the public ``privacy_loss_distribution``
API so that its pieces can be cached: building the PLD of one subsampled Gaussian step is the
expensive part (a Python loop in ``dp_accounting``) and depends only on ``(sigma, q)``, not on
the step count, so a training loop that asks every step pays it once.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import numbers
from typing import TYPE_CHECKING, Any, NamedTuple

from ckpt.flatten import register_type
from privacy.blt_sensitivity import cyclic_blt_sensitivity
from privacy.errors import BudgetExhaustedError, PrivacyError

if TYPE_CHECKING:
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

ACCOUNTANTS = ("pld", "rdp")
DEFAULT_PLD_DISCRETIZATION = 1e-4
NOISE_MULTIPLIER_RTOL = 1e-3
_MAX_NOISE_MULTIPLIER = 2.0**20  # bracket search gives up beyond this
_MIN_NOISE_MULTIPLIER = 2.0**-4  # halving search stops here (tiny sigmas make huge PLDs)


class Event(NamedTuple):
    """``steps`` DP-SGD steps, each with ``noise_multiplier`` and Poisson ``sample_rate``."""

    noise_multiplier: float
    sample_rate: float
    steps: int


# --------------------------------------------------------------------------- validation


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PrivacyError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _check_event(noise_multiplier: Any, sample_rate: Any, steps: Any) -> Event:
    sigma, q = _real(noise_multiplier, "noise_multiplier"), _real(sample_rate, "sample_rate")
    if not (sigma >= 0.0 and math.isfinite(sigma)):
        raise PrivacyError(f"noise_multiplier must be finite and >= 0, got noise_multiplier={sigma}")
    if not 0.0 < q <= 1.0:
        raise PrivacyError(f"sample_rate must be in (0, 1], got sample_rate={q}")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise PrivacyError(f"steps must be an int >= 0, got steps={steps!r}")
    return Event(sigma, q, int(steps))


def _check_delta(delta: Any) -> float:
    delta = _real(delta, "delta")
    if not 0.0 < delta < 1.0:
        raise PrivacyError(f"delta must be in (0, 1), got delta={delta}")
    return delta


def _check_accountant(accountant: Any) -> str:
    if accountant not in ACCOUNTANTS:
        raise PrivacyError(f"accountant must be one of {ACCOUNTANTS}, got accountant={accountant!r}")
    return accountant


def _check_discretization(interval: Any) -> float:
    interval = _real(interval, "value_discretization_interval")
    if not (interval > 0.0 and math.isfinite(interval)):
        raise PrivacyError(f"value_discretization_interval must be finite and > 0, got {interval}")
    return interval


def _canonical_events(events: Any) -> tuple[Event, ...]:
    """Validated events, zero-step ones dropped, consecutive equal ``(sigma, q)`` merged."""
    merged: list[Event] = []
    for e in events:
        e = _check_event(*e)
        if e.steps == 0:
            continue
        if merged and merged[-1][:2] == e[:2]:
            merged[-1] = merged[-1]._replace(steps=merged[-1].steps + e.steps)
        else:
            merged.append(e)
    return tuple(merged)


# --------------------------------------------------------------------------- composition (cached)


def _dp():
    """``dp_accounting``, imported when an epsilon is first composed: its import (scipy's signal,
    stats and optimize) takes about a second, which a process that never composes one does not
    pay (the launcher of a sharded run, a non-private run)."""
    import dp_accounting
    import dp_accounting.pld.privacy_loss_distribution  # noqa: F401 - pld_lib below
    import dp_accounting.rdp  # noqa: F401

    return dp_accounting


def _pld():
    """``dp_accounting.pld.privacy_loss_distribution`` (see :func:`_dp`)."""
    return _dp().pld.privacy_loss_distribution


@functools.lru_cache(maxsize=16)
def _step_pld(noise_multiplier: float, sample_rate: float, interval: float) -> pld_lib.PrivacyLossDistribution:
    # What PLDAccountant builds for one PoissonSampledDpEvent of a GaussianDpEvent.
    return _pld().from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        value_discretization_interval=interval,
        sampling_prob=sample_rate,
        neighboring_relation=_dp().NeighboringRelation.ADD_OR_REMOVE_ONE,
    )


_PLD_CACHE: collections.OrderedDict[tuple, pld_lib.PrivacyLossDistribution] = collections.OrderedDict()
_PLD_CACHE_SIZE = 8


def _composed_pld(events: tuple[Event, ...], interval: float) -> pld_lib.PrivacyLossDistribution:
    # PLDAccountant starts from the identity and composes each event in turn; this replays that
    # sequence. The state before the last event (the PLD of events[:-1]) is cached on its own:
    # a training loop changes only the last event (one more step) or appends a new one, and both
    # then cost a single self_compose of the last event.
    key = (events, interval)
    if key in _PLD_CACHE:
        _PLD_CACHE.move_to_end(key)
        return _PLD_CACHE[key]
    if not events:
        return _pld().identity(value_discretization_interval=interval)
    *head, last = events
    head_key = (tuple(head), interval)
    if head_key in _PLD_CACHE:
        _PLD_CACHE.move_to_end(head_key)
        pld = _PLD_CACHE[head_key]
    else:  # iterative, not recursive: a noise schedule can make thousands of events
        pld = _pld().identity(value_discretization_interval=interval)
        for e in head:
            pld = pld.compose(_step_pld(e.noise_multiplier, e.sample_rate, interval).self_compose(e.steps))
        _remember(head_key, pld)
    pld = pld.compose(_step_pld(last.noise_multiplier, last.sample_rate, interval).self_compose(last.steps))
    _remember(key, pld)
    return pld


def _remember(key: tuple, pld: pld_lib.PrivacyLossDistribution) -> None:
    _PLD_CACHE[key] = pld
    while len(_PLD_CACHE) > _PLD_CACHE_SIZE:
        _PLD_CACHE.popitem(last=False)


@functools.lru_cache(maxsize=256)
def _composed_epsilon(events: tuple[Event, ...], delta: float, accountant: str, interval: float) -> float:
    if not events:
        return 0.0
    if any(e.noise_multiplier == 0.0 for e in events):
        return math.inf  # a step without noise is not private at all
    if accountant == "rdp":
        dp = _dp()
        ledger = dp.ComposedDpEvent([_dp_event(e) for e in events])
        return float(dp.rdp.RdpAccountant().compose(ledger).get_epsilon(delta))
    return float(_composed_pld(events, interval).get_epsilon_for_delta(delta))


def _dp_event(e: Event) -> dp_accounting.DpEvent:
    dp = _dp()
    step = dp.PoissonSampledDpEvent(e.sample_rate, dp.GaussianDpEvent(e.noise_multiplier))
    return dp.SelfComposedDpEvent(step, e.steps)


# --------------------------------------------------------------------------- public functions


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    *,
    accountant: str = "pld",
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
) -> float:
    """The epsilon of ``steps`` DP-SGD steps with Poisson sampling at ``delta``.

    Formal Guarantees:
      * Equals ``PLDAccountant(value_discretization_interval=...)`` or ``RdpAccountant()``
        composing ``SelfComposedDpEvent(PoissonSampledDpEvent(sample_rate,
        GaussianDpEvent(noise_multiplier)), steps)``, then ``get_epsilon(delta)``, exactly
        (``test_epsilon_equals_dp_accounting_directly``); both are upper bounds on the true
        epsilon (PLD rounds pessimistically).
      * Non-decreasing in ``steps`` (``test_epsilon_is_non_decreasing_in_steps``).
      * ``value_discretization_interval`` is used by ``"pld"`` only.

    Edge cases:
      ================================  =======================================
      ``steps == 0``                    ``0.0``
      ``noise_multiplier == 0``,        ``math.inf``
      ``steps > 0``
      ``noise_multiplier`` < 0/NaN/inf  ``PrivacyError`` naming it
      ``sample_rate`` outside (0, 1]    ``PrivacyError`` naming it
      ``delta`` outside (0, 1)          ``PrivacyError`` naming it
      ``steps`` < 0 or not an int       ``PrivacyError`` naming it
      unknown ``accountant``            ``PrivacyError`` naming it
      ================================  =======================================
    """
    events = _canonical_events([(noise_multiplier, sample_rate, steps)])
    return _composed_epsilon(
        events, _check_delta(delta), _check_accountant(accountant), _check_discretization(value_discretization_interval)
    )


@functools.lru_cache(maxsize=64)
def max_steps(
    noise_multiplier: float,
    sample_rate: float,
    delta: float,
    epsilon_budget: float,
    *,
    accountant: str = "pld",
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    history: tuple[Event, ...] = (),
) -> int:
    """The largest number of steps of ``(noise_multiplier, sample_rate)`` whose epsilon at
    ``delta`` stays within ``epsilon_budget`` (0 if even one step exceeds it); with ``history``
    (an ``Accountant``'s ``events``), the largest number of steps MORE that the history composed
    with them stays within it (0 when the history alone is over).

    Guarantees: ``epsilon(..., max_steps) <= epsilon_budget < epsilon(..., max_steps + 1)``
    (``tests/test_accounting.py::test_max_steps_is_the_last_step_within_budget``; with a
    history ``tests/test_budget.py::test_steps_that_fit_after_a_history_are_the_last_within_budget``),
    found by doubling then bisection on ``epsilon``, which is non-decreasing in steps; cached, so a
    training loop can test its budget every step in O(1). Capped at 2**40 steps."""
    past = _canonical_events(history)
    delta = _check_delta(delta)

    def within(steps: int) -> bool:
        if past:
            events = _canonical_events([*past, (noise_multiplier, sample_rate, steps)])
            return _composed_epsilon(events, delta, _check_accountant(accountant),
                                     _check_discretization(value_discretization_interval)) <= epsilon_budget
        return epsilon(noise_multiplier, sample_rate, steps, delta, accountant=accountant,
                       value_discretization_interval=value_discretization_interval) <= epsilon_budget

    if not within(1):
        return 0
    lo, hi = 1, 2
    while within(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40:
            return lo
    while hi - lo > 1:  # within(lo) and not within(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo


def noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    *,
    accountant: str = "pld",
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    history: tuple[Event, ...] = (),
) -> float:
    """The smallest noise multiplier whose ``epsilon`` is at most ``target_epsilon``: of
    ``steps`` steps alone, or, with ``history`` (an ``Accountant``'s ``events``: steps already
    taken, whatever their sigma and q), of the history composed with ``steps`` more steps at
    ``sample_rate`` (a resumed run calibrating its remaining steps against the budget left;
    ``tests/test_accounting.py::test_noise_for_the_rest_keeps_the_whole_run_within_the_target``).

    Method: double (or halve) from 1.0 until the answer is bracketed, then bisect in
    ``log(sigma)``, always keeping the upper end feasible. Each probe is one ``epsilon`` call,
    typically 12 to 16 probes.

    Formal Guarantees:
      * ``epsilon(result, ...) <= target_epsilon`` always (the result is a probed, feasible
        point).
      * ``epsilon(result, ...) >= (1 - 1e-3) * target_epsilon`` whenever epsilon is continuous
        in sigma near the answer (``test_noise_multiplier_inverts_epsilon``); if bisection
        stalls on a discontinuity of the numerical accountant, the feasible end is returned.

    Edge cases:
      ==============================  ===========================================
      ``steps == 0``                  ``0.0`` (no step, no noise needed)
      ``target_epsilon == inf``       ``0.0``
      ``target_epsilon`` <= 0 / NaN   ``PrivacyError`` naming it
      target needs sigma > 2**20      ``PrivacyError`` (unreachable in practice)
      target met already at 1/16      ``1/16`` (feasible, not minimal: smaller sigmas make
                                      PLDs too large to build)
      other arguments invalid         as in ``epsilon``
      ==============================  ===========================================
    """
    target = _real(target_epsilon, "target_epsilon")
    if not target > 0.0:
        raise PrivacyError(f"target_epsilon must be > 0, got target_epsilon={target}")
    _check_event(0.0, sample_rate, steps)
    delta = _check_delta(delta)
    _check_accountant(accountant)
    _check_discretization(value_discretization_interval)
    if steps == 0 or target == math.inf:
        return 0.0

    past = _canonical_events(history)
    if past and _composed_epsilon(past, delta, accountant, value_discretization_interval) > target:
        raise PrivacyError(f"the steps already taken spent epsilon "
                           f"{_composed_epsilon(past, delta, accountant, value_discretization_interval):.6g}, over"
                           f" the target {target}: no noise makes {steps} more step(s) fit")

    def eps(sigma: float) -> float:
        if past:
            events = _canonical_events([*past, (sigma, sample_rate, steps)])
            return _composed_epsilon(events, delta, accountant, value_discretization_interval)
        return epsilon(sigma, sample_rate, steps, delta, accountant=accountant,
                       value_discretization_interval=value_discretization_interval)

    hi = 1.0
    eps_hi = eps(hi)
    if eps_hi > target:  # double until feasible
        lo = hi
        while eps_hi > target:
            lo, hi = hi, 2.0 * hi
            if hi > _MAX_NOISE_MULTIPLIER:
                raise PrivacyError(f"no noise_multiplier <= {_MAX_NOISE_MULTIPLIER} reaches epsilon {target}")
            eps_hi = eps(hi)
    else:  # halve until infeasible
        while True:
            lo = hi / 2.0
            if lo < _MIN_NOISE_MULTIPLIER:
                return hi  # feasible for every sigma we are willing to probe
            eps_lo = eps(lo)
            if eps_lo > target:
                break
            hi, eps_hi = lo, eps_lo
    # Invariant: eps(lo) > target >= eps(hi).
    while eps_hi < (1.0 - NOISE_MULTIPLIER_RTOL) * target and hi - lo > 1e-12 * hi:
        mid = math.sqrt(lo * hi)
        eps_mid = eps(mid)
        if eps_mid <= target:
            hi, eps_hi = mid, eps_mid
        else:
            lo = mid
    return hi


def gaussian_epsilon(noise_multiplier: float, delta: float, *, accountant: str = "pld",
                     value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION) -> float:
    """The epsilon at ``delta`` of ONE Gaussian mechanism (no sampling) of noise multiplier
    ``noise_multiplier`` (noise std over sensitivity): :func:`epsilon` at rate 1 and one step,
    except below ``1/16`` with ``"pld"``, where the PLD's grid would hold millions of points
    (epsilon is then above 100): there the RDP accountant's figure, also an upper bound.

    Formal Guarantee: an upper bound on the mechanism's epsilon, equal to :func:`epsilon`'s at
    and above ``1/16`` (``tests/test_blt_accounting.py::test_blt_epsilon_is_the_analytic_gaussian_at_sigma_over_the_sensitivity``).
    Edge cases: 0 gives inf; others as :func:`epsilon`."""
    if accountant == "pld" and 0.0 < noise_multiplier < _MIN_NOISE_MULTIPLIER:
        accountant = "rdp"
    return epsilon(noise_multiplier, 1.0, 1, delta, accountant=accountant,
                   value_discretization_interval=value_discretization_interval)


def group_events(events: tuple[Event, ...], bands: int) -> list[tuple[Event, ...]]:
    """Per cyclic group ``g`` of ``bands`` (``privacy.mechanisms.cyclic_sampling``: group
    ``t mod bands`` samples at step ``t``), the canonical events of the steps it samples: an
    event of ``s`` steps starting at step ``a`` gives group ``g`` the steps ``t`` in ``[a, a + s)``
    with ``t mod bands == g``. With a banded, column-normalised mechanism each group's epsilon is
    that of DP-SGD over its own steps (``privacy.mechanisms.accounting``); the run's is the
    largest."""
    out = []
    for g in range(bands):
        pos, mine = 0, []
        for e in events:
            count = -(-(pos + e.steps - g) // bands) - -(-(pos - g) // bands)
            mine.append((e.noise_multiplier, e.sample_rate, count))
            pos += e.steps
        out.append(_canonical_events(mine))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accountant:
    """An immutable ledger of DP-SGD steps and the epsilon they spend.

    ``events`` is canonical: validated, zero-step events dropped and consecutive events with
    equal ``(noise_multiplier, sample_rate)`` merged, so equal ledgers compare and hash equal
    however they were built. ``record`` returns a new value; nothing mutates.

    Use in a training loop: ``acc.check(sigma, q)`` before touching parameters or optimizer
    state, then ``acc = acc.record(sigma, q)`` once the step is applied.

    Formal Guarantees:
      * ``epsilon(delta)`` is what dp_accounting's accountant of the same kind returns after
        composing every event in order, exactly
        (``test_accountant_epsilon_equals_dp_accounting_on_the_composed_ledger``); merging equal
        consecutive events does not change it.
      * ``check`` raises ``BudgetExhaustedError`` iff ``epsilon_budget`` is set and
        ``record(...).epsilon() > epsilon_budget``; it changes nothing either way.
      * ``from_dict(to_dict()) == self`` and ``to_dict()`` holds only JSON types
        (``test_accountant_round_trips_through_json``).
      * Cost: results are cached per ``(events, delta)``; for PLD the one-step PLD is cached per
        ``(sigma, q)`` and the ledger minus its last event is cached, so ``check`` after a
        ``record`` costs one ``self_compose`` and one epsilon query
        (``test_appending_steps_reuses_the_cached_prefix``). RDP recomposes all events (cheap).

    ``bands`` (default 1): the ledger of a banded mechanism with cyclic Poisson sampling over
    ``bands`` groups: ``steps`` and ``events`` count every step, ``epsilon`` is the largest over
    the groups of the composition of the steps each samples (:func:`group_events`;
    ``tests/test_mechanisms.py::test_a_banded_ledger_spends_the_epsilon_of_its_participations``).

    ``blt`` (default None): ``(decays, scales)`` of a buffered linear Toeplitz strategy
    (``privacy.mechanisms.blt``), its participations ``bands`` (the min separation) steps apart by
    cyclic groups: the ledger of the whole run as ONE Gaussian mechanism of noise multiplier
    ``min(sigma) / sens``, ``sens`` the BLT's sensitivity for ``ceil(steps / bands)``
    participations over the steps so far (:func:`privacy.blt_sensitivity.cyclic_blt_sensitivity`,
    recomputed for the total steps whenever steps are recorded, so resumes and branches compose
    like one run). No amplification by the Poisson draws within a group is claimed: an upper bound
    on epsilon (``privacy.mechanisms.accounting`` says why;
    ``tests/test_blt_accounting.py::test_a_blt_ledger_is_one_gaussian_at_sigma_over_the_sensitivity``).

    Edge cases: no events gives epsilon 0.0; an event with ``noise_multiplier == 0`` gives inf;
    ``record(..., steps=0)`` returns an equal ledger; ``epsilon_budget`` must be None or finite
    and > 0; ``delta`` must be in (0, 1).
    """

    events: tuple[Event, ...] = ()
    accountant: str = "pld"
    delta: float
    epsilon_budget: float | None = None
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION
    bands: int = 1
    blt: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", _canonical_events(self.events))
        if self.blt is not None:
            decays, scales = (tuple(float(x) for x in part) for part in self.blt)
            if not decays or len(decays) != len(scales):
                raise PrivacyError(f"blt must be (decays, scales) of equal, non-zero lengths, got {self.blt!r}")
            object.__setattr__(self, "blt", (decays, scales))
        if isinstance(self.bands, bool) or not isinstance(self.bands, numbers.Integral) or self.bands < 1:
            raise PrivacyError(f"bands must be an int >= 1, got bands={self.bands!r}")
        object.__setattr__(self, "bands", int(self.bands))
        _check_accountant(self.accountant)
        object.__setattr__(self, "delta", _check_delta(self.delta))
        if self.epsilon_budget is not None:
            budget = _real(self.epsilon_budget, "epsilon_budget")
            if not (budget > 0.0 and math.isfinite(budget)):
                raise PrivacyError(f"epsilon_budget must be None or finite and > 0, got {budget}")
            object.__setattr__(self, "epsilon_budget", budget)
        object.__setattr__(
            self, "value_discretization_interval", _check_discretization(self.value_discretization_interval)
        )

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return sum(e.steps for e in self.events)

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> Accountant:
        """A new ledger with ``steps`` more steps of ``(noise_multiplier, sample_rate)``."""
        return dataclasses.replace(self, events=self.events + (_check_event(noise_multiplier, sample_rate, steps),))

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """The events as Opacus' accountants keep them: ``(noise_multiplier, sample_rate, steps)``
        per run of equal consecutive steps, oldest first (``tests/test_opacus_entry.py::
        test_epsilon_agrees_with_opacus_accountant_of_the_same_kind``)."""
        return [tuple(e) for e in self.events]

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: ``self.delta``)."""
        delta = self.delta if delta is None else _check_delta(delta)
        if self.blt is not None:
            return self._blt_epsilon(delta)
        if self.bands == 1:
            return _composed_epsilon(self.events, delta, self.accountant, self.value_discretization_interval)
        return max(_composed_epsilon(events, delta, self.accountant, self.value_discretization_interval)
                   for events in set(group_events(self.events, self.bands)))

    @property
    def is_dp_sgd(self) -> bool:
        """Whether the ledger composes DP-SGD steps over the whole dataset (no cyclic groups, no
        BLT): the one ``max_steps`` and ``noise_multiplier``'s ``history`` know."""
        return self.bands == 1 and self.blt is None

    def _blt_epsilon(self, delta: float) -> float:
        if not self.events:
            return 0.0
        sens = cyclic_blt_sensitivity(*self.blt, self.steps, self.bands)
        sigma = min(e.noise_multiplier for e in self.events)  # the least noise bounds every step's
        return gaussian_epsilon(sigma / sens, delta, accountant=self.accountant,
                                value_discretization_interval=self.value_discretization_interval)

    def check(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> float:
        """Raise ``BudgetExhaustedError`` if recording these steps would exceed the budget.

        Returns the epsilon the ledger would reach (at ``self.delta``). Without a budget it
        never raises."""
        after = self.record(noise_multiplier, sample_rate, steps).epsilon()
        if self.epsilon_budget is not None and after > self.epsilon_budget:
            raise BudgetExhaustedError(
                f"privacy budget exhausted: spent epsilon {self.epsilon():.6g}, {steps} more step(s) with "
                f"noise_multiplier={noise_multiplier}, sample_rate={sample_rate} would bring it to {after:.6g}, "
                f"over the budget epsilon_budget={self.epsilon_budget:.6g} (delta={self.delta:g}, "
                f"accountant={self.accountant!r})"
            )
        return after

    def to_dict(self) -> dict[str, Any]:
        """The ledger as JSON types (lists, dicts, str, float, int, None); ``bands`` only when
        it is not 1 and ``blt`` only when set (the ledgers written before them read back unchanged)."""
        return {
            "accountant": self.accountant,
            "delta": self.delta,
            "epsilon_budget": self.epsilon_budget,
            "value_discretization_interval": self.value_discretization_interval,
            "events": [e._asdict() for e in self.events],
            **({"bands": self.bands} if self.bands != 1 else {}),
            **({"blt": {"decays": list(self.blt[0]), "scales": list(self.blt[1])}} if self.blt is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Accountant:
        """Inverse of ``to_dict``; unknown or missing fields raise ``PrivacyError``."""
        expected = {"accountant", "delta", "epsilon_budget", "value_discretization_interval", "events"}
        expected |= {"bands", "blt"} & set(data)
        if set(data) != expected:
            raise PrivacyError(
                f"Accountant data needs exactly {sorted(expected)}, got missing "
                f"{sorted(expected - set(data))}, unexpected {sorted(set(data) - expected)}"
            )
        events = []
        for e in data["events"]:
            if not isinstance(e, dict) or set(e) != set(Event._fields):
                raise PrivacyError(f"each event needs exactly {list(Event._fields)}, got {e!r}")
            events.append(Event(**e))
        return cls(
            events=tuple(events),
            accountant=data["accountant"],
            delta=data["delta"],
            epsilon_budget=data["epsilon_budget"],
            value_discretization_interval=data["value_discretization_interval"],
            bands=data.get("bands", 1),
            blt=(tuple(data["blt"]["decays"]), tuple(data["blt"]["scales"])) if "blt" in data else None,
        )


# ckpt stores states without pickle, by registered type, and knows no type of privacy's: each
# registers itself where it is defined (importing any module of privacy imports this one)
register_type("Accountant", Accountant, Accountant.to_dict, Accountant.from_dict)
