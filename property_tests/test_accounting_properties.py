"""Invariants of privacy.accounting: it is dp_accounting (bit for bit), noise_multiplier inverts
epsilon, epsilon grows with steps, and the Accountant ledger survives serialisation."""

import json

import dp_accounting
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy.accounting import Accountant, epsilon, noise_multiplier

# Coarse PLD grids keep each PLD evaluation near 0.1 s; agreement with dp_accounting is exact on
# any grid, and the default grid is checked against the project anchor in tests/test_accounting.py.
intervals = st.sampled_from([1e-3, 2e-3])
sigmas = st.floats(0.6, 5.0)
rates = st.floats(1e-3, 1.0)
deltas = st.floats(1e-8, 1e-2)
accountants = st.sampled_from(["pld", "rdp"])


def _reference(events, delta, accountant, interval):
    acc = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
        if accountant == "pld"
        else dp_accounting.rdp.RdpAccountant()
    )
    ledger = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
        for sigma, q, steps in events
    ]
    return acc.compose(dp_accounting.ComposedDpEvent(ledger)).get_epsilon(delta)


@settings(max_examples=12, deadline=None)
@given(sigmas, rates, st.integers(1, 400), deltas, accountants, intervals)
def test_epsilon_equals_dp_accounting_directly(sigma, q, steps, delta, accountant, interval):
    got = epsilon(sigma, q, steps, delta, accountant=accountant, value_discretization_interval=interval)
    assert got == _reference([(sigma, q, steps)], delta, accountant, interval)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(sigmas, st.floats(1e-3, 0.2), st.integers(1, 50)), min_size=1, max_size=3),
       deltas, accountants, intervals)
def test_accountant_epsilon_equals_dp_accounting_on_the_composed_ledger(events, delta, accountant, interval):
    acc = Accountant(delta=delta, accountant=accountant, value_discretization_interval=interval)
    for e in events:
        acc = acc.record(*e)
    # Merging consecutive equal events is exact: a k-fold self-composition is what dp_accounting
    # computes for k identical steps in one SelfComposedDpEvent.
    assert acc.epsilon() == _reference(acc.events, delta, accountant, interval)


@settings(max_examples=5, deadline=None)
@given(st.floats(0.3, 8.0), st.floats(1e-3, 0.1), st.integers(10, 1000), deltas)
def test_noise_multiplier_inverts_epsilon_rdp(target, q, steps, delta):
    sigma = noise_multiplier(target, delta, q, steps, accountant="rdp")
    eps = epsilon(sigma, q, steps, delta, accountant="rdp")
    assert (1 - 1e-3) * target <= eps <= target


@settings(max_examples=2, deadline=None)
@given(st.floats(0.5, 4.0), st.floats(5e-3, 0.05), st.integers(10, 200))
def test_noise_multiplier_inverts_epsilon_pld(target, q, steps):
    sigma = noise_multiplier(target, 1e-5, q, steps, value_discretization_interval=1e-3)
    eps = epsilon(sigma, q, steps, 1e-5, value_discretization_interval=1e-3)
    assert (1 - 1e-3) * target <= eps <= target


@settings(max_examples=10, deadline=None)
@given(sigmas, rates, st.integers(0, 300), st.integers(0, 300), deltas, accountants)
def test_epsilon_is_non_decreasing_in_steps(sigma, q, a, b, delta, accountant):
    lo, hi = sorted((a, b))
    kw = dict(accountant=accountant, value_discretization_interval=2e-3)
    assert epsilon(sigma, q, lo, delta, **kw) <= epsilon(sigma, q, hi, delta, **kw)


events_lists = st.lists(
    st.tuples(st.floats(0.0, 100.0), st.floats(1e-6, 1.0), st.integers(0, 10**6)), max_size=6
)


@settings(max_examples=30, deadline=None)
@given(events_lists, accountants, deltas, st.none() | st.floats(1e-3, 1e3), intervals)
def test_accountant_round_trips_through_json(events, accountant, delta, budget, interval):
    acc = Accountant(delta=delta, accountant=accountant, epsilon_budget=budget, value_discretization_interval=interval)
    for e in events:
        acc = acc.record(*e)
    text = json.dumps(acc.to_dict(), allow_nan=False)
    assert Accountant.from_dict(json.loads(text)) == acc


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 1.0]), st.sampled_from([0.01, 0.1]), st.integers(0, 5)), max_size=12))
def test_recording_step_by_step_equals_recording_in_bulk(events):
    one_by_one, bulk = Accountant(delta=1e-5), Accountant(delta=1e-5)
    for sigma, q, steps in events:
        for _ in range(steps):
            one_by_one = one_by_one.record(sigma, q)
        bulk = bulk.record(sigma, q, steps)
    assert one_by_one == bulk
    assert all(a[:2] != b[:2] for a, b in zip(bulk.events, bulk.events[1:]))  # fully merged
