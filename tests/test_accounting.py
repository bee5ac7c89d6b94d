"""Tests of privacy.accounting: agreement with dp_accounting, edge cases, the Accountant ledger."""

import json
import math

import dp_accounting
import pytest

from privacy.accounting import Accountant, Event, epsilon, noise_multiplier
from privacy.errors import BudgetExhaustedError, PrivacyError

COARSE = 1e-3  # PLD discretization used where the test is about logic, not the default's numbers


def _dp_accounting_epsilon(events, delta, accountant, interval=1e-4):
    acc = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
        if accountant == "pld"
        else dp_accounting.rdp.RdpAccountant()
    )
    for sigma, q, steps in events:
        step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        acc.compose(dp_accounting.SelfComposedDpEvent(step, steps))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant,anchor", [("rdp", 1.352), ("pld", 1.100)])
def test_epsilon_reproduces_the_project_anchor_exactly_as_dp_accounting(accountant, anchor):
    eps = epsilon(1.0, 0.004267, 2343, 1e-5, accountant=accountant)
    assert eps == _dp_accounting_epsilon([(1.0, 0.004267, 2343)], 1e-5, accountant)
    assert abs(eps - anchor) < 1e-3


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_zero_steps_cost_zero_epsilon(accountant):
    assert epsilon(1.0, 0.1, 0, 1e-5, accountant=accountant) == 0.0
    assert epsilon(0.0, 0.1, 0, 1e-5, accountant=accountant) == 0.0


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_steps_without_noise_cost_infinite_epsilon(accountant):
    assert epsilon(0.0, 0.1, 1, 1e-5, accountant=accountant) == math.inf


@pytest.mark.parametrize(
    "args,word",
    [
        ((1.0, 0.1, 10, 0.0), "delta"),
        ((1.0, 0.1, 10, 1.0), "delta"),
        ((1.0, 0.1, 10, float("nan")), "delta"),
        ((1.0, 0.0, 10, 1e-5), "sample_rate"),
        ((1.0, 1.5, 10, 1e-5), "sample_rate"),
        ((-0.1, 0.1, 10, 1e-5), "noise_multiplier"),
        ((float("nan"), 0.1, 10, 1e-5), "noise_multiplier"),
        ((float("inf"), 0.1, 10, 1e-5), "noise_multiplier"),
        ((1.0, 0.1, -1, 1e-5), "steps"),
        ((1.0, 0.1, 2.0, 1e-5), "steps"),
    ],
)
def test_invalid_epsilon_arguments_raise_privacy_error_naming_them(args, word):
    with pytest.raises(PrivacyError, match=word):
        epsilon(*args)


def test_unknown_accountant_raises_privacy_error():
    with pytest.raises(PrivacyError, match="accountant"):
        epsilon(1.0, 0.1, 10, 1e-5, accountant="gdp")


def test_sample_rate_one_is_the_plain_gaussian_mechanism():
    assert epsilon(5.0, 1.0, 10, 1e-5, accountant="rdp") == _dp_accounting_epsilon([(5.0, 1.0, 10)], 1e-5, "rdp")
    pld = epsilon(5.0, 1.0, 10, 1e-5, value_discretization_interval=COARSE)
    assert pld == _dp_accounting_epsilon([(5.0, 1.0, 10)], 1e-5, "pld", COARSE)


def test_noise_multiplier_inverts_epsilon_on_the_anchor():
    sigma = noise_multiplier(1.352, 1e-5, 0.004267, 2343, accountant="rdp")
    eps = epsilon(sigma, 0.004267, 2343, 1e-5, accountant="rdp")
    assert (1 - 1e-3) * 1.352 <= eps <= 1.352
    assert abs(sigma - 1.0) < 5e-3


def test_noise_multiplier_for_large_targets_halves_below_one():
    sigma = noise_multiplier(20.0, 1e-5, 0.01, 100, accountant="rdp")
    assert sigma < 1.0
    assert (1 - 1e-3) * 20.0 <= epsilon(sigma, 0.01, 100, 1e-5, accountant="rdp") <= 20.0


def test_noise_multiplier_edge_cases():
    assert noise_multiplier(1.0, 1e-5, 0.01, 0) == 0.0
    assert noise_multiplier(math.inf, 1e-5, 0.01, 100) == 0.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(PrivacyError, match="target_epsilon"):
            noise_multiplier(bad, 1e-5, 0.01, 100)
    with pytest.raises(PrivacyError, match="delta"):
        noise_multiplier(1.0, 2.0, 0.01, 100)
    with pytest.raises(PrivacyError, match="sample_rate"):
        noise_multiplier(1.0, 1e-5, 0.0, 100)


# ----------------------------------------------------------------------------- Accountant


def test_record_merges_consecutive_equal_events_and_drops_empty_ones():
    acc = Accountant(delta=1e-5)
    acc = acc.record(1.0, 0.01).record(1.0, 0.01, 4).record(2.0, 0.01, 0).record(2.0, 0.01, 2).record(1.0, 0.01)
    assert acc.events == (Event(1.0, 0.01, 5), Event(2.0, 0.01, 2), Event(1.0, 0.01, 1))
    assert acc.steps == 8


def test_record_merges_only_events_equal_in_both_noise_multiplier_and_sample_rate():
    acc = Accountant(delta=1e-5).record(1.0, 0.01).record(1.0, 0.02).record(1.5, 0.02)
    assert acc.events == (Event(1.0, 0.01, 1), Event(1.0, 0.02, 1), Event(1.5, 0.02, 1))


def test_record_returns_a_new_value_and_leaves_the_old_one_unchanged():
    acc = Accountant(delta=1e-5)
    new = acc.record(1.0, 0.01, 3)
    assert acc.events == () and new.events == (Event(1.0, 0.01, 3),)
    with pytest.raises(AttributeError):
        acc.events = ()  # type: ignore[misc]


def test_equal_ledgers_built_differently_compare_and_hash_equal():
    a = Accountant(delta=1e-5).record(1.0, 0.01, 3)
    b = Accountant(delta=1e-5, events=[(1, 0.01, 1), (1.0, 0.01, 2)])
    assert a == b and hash(a) == hash(b)


def test_empty_ledger_has_spent_nothing():
    assert Accountant(delta=1e-5).epsilon() == 0.0


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_accountant_epsilon_equals_dp_accounting_on_the_composed_ledger(accountant):
    events = [(1.1, 0.02, 30), (0.8, 0.01, 20), (1.1, 0.02, 10)]
    acc = Accountant(delta=1e-6, accountant=accountant, value_discretization_interval=COARSE)
    for e in events:
        acc = acc.record(*e)
    ref = _dp_accounting_epsilon(events, 1e-6, accountant, COARSE)
    assert acc.epsilon() == ref
    assert acc.epsilon(1e-3) == _dp_accounting_epsilon(events, 1e-3, accountant, COARSE)


def test_cached_compositions_do_not_leak_between_ledgers():
    # Interleave ledgers that share prefixes; each must still equal a fresh dp_accounting run.
    base = Accountant(delta=1e-5, value_discretization_interval=COARSE).record(1.0, 0.05, 10)
    ledgers = [base, base.record(1.0, 0.05), base.record(2.0, 0.05), base.record(1.0, 0.05, 5), base]
    for acc in ledgers + ledgers[::-1]:
        assert acc.epsilon() == _dp_accounting_epsilon(acc.events, 1e-5, "pld", COARSE)


def test_appending_steps_reuses_the_cached_prefix(monkeypatch):
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from privacy import accounting

    accounting._PLD_CACHE.clear()
    acc = Accountant(delta=1e-5, value_discretization_interval=COARSE).record(1.3, 0.05, 20).record(0.9, 0.05, 5)
    acc.epsilon()
    starts = []
    real = pld_lib.identity
    monkeypatch.setattr(pld_lib, "identity", lambda **kw: starts.append(1) or real(**kw))
    # The loop's pattern: check, then record, then report epsilon.
    after = acc.check(0.9, 0.05)  # one more step of the last event
    acc = acc.record(0.9, 0.05)
    assert acc.epsilon() == after
    after = acc.check(1.3, 0.05, steps=2)  # a new event after the last one
    acc = acc.record(1.3, 0.05, 2)
    eps = acc.epsilon()
    assert starts == []  # never recomposed from the identity
    assert eps == _dp_accounting_epsilon(acc.events, 1e-5, "pld", COARSE)


def test_single_event_ledger_equals_the_epsilon_function():
    acc = Accountant(delta=1e-5, value_discretization_interval=COARSE).record(1.0, 0.01, 100)
    assert acc.epsilon() == epsilon(1.0, 0.01, 100, 1e-5, value_discretization_interval=COARSE)


def test_check_raises_budget_exhausted_with_spent_next_and_budget():
    acc = Accountant(delta=1e-5, accountant="rdp", epsilon_budget=2.0).record(1.0, 0.01, 100)
    spent = acc.epsilon()
    assert spent < 2.0
    with pytest.raises(BudgetExhaustedError) as info:
        acc.check(1.0, 0.01, steps=10_000)
    message = str(info.value)
    after = acc.record(1.0, 0.01, 10_000).epsilon()
    assert f"{spent:.6g}" in message and f"{after:.6g}" in message and "epsilon_budget=2" in message
    assert acc.epsilon() == spent and acc.steps == 100  # nothing changed
    assert isinstance(info.value, PrivacyError)


def test_check_returns_the_epsilon_the_step_would_reach_when_within_budget():
    acc = Accountant(delta=1e-5, accountant="rdp", epsilon_budget=10.0)
    assert acc.check(1.0, 0.01, 5) == acc.record(1.0, 0.01, 5).epsilon()


def test_check_without_budget_never_raises():
    assert Accountant(delta=1e-5, accountant="rdp").check(0.0, 0.5) == math.inf


def test_noiseless_step_exhausts_any_budget():
    with pytest.raises(BudgetExhaustedError):
        Accountant(delta=1e-5, epsilon_budget=100.0).check(0.0, 0.01)


def test_accountant_round_trips_through_json():
    acc = Accountant(delta=1e-6, accountant="rdp", epsilon_budget=3.0).record(1.0, 0.01, 7).record(0.9, 0.02)
    data = json.loads(json.dumps(acc.to_dict(), allow_nan=False))
    assert Accountant.from_dict(data) == acc


@pytest.mark.parametrize(
    "kwargs,word",
    [
        (dict(delta=0.0), "delta"),
        (dict(delta=1e-5, accountant="moments"), "accountant"),
        (dict(delta=1e-5, epsilon_budget=0.0), "epsilon_budget"),
        (dict(delta=1e-5, epsilon_budget=math.inf), "epsilon_budget"),
        (dict(delta=1e-5, events=[(1.0, 0.0, 1)]), "sample_rate"),
        (dict(delta=1e-5, value_discretization_interval=0.0), "value_discretization_interval"),
    ],
)
def test_invalid_accountant_fields_raise_privacy_error_naming_them(kwargs, word):
    with pytest.raises(PrivacyError, match=word):
        Accountant(**kwargs)


def test_from_dict_rejects_missing_unknown_or_malformed_fields():
    good = Accountant(delta=1e-5).record(1.0, 0.1).to_dict()
    with pytest.raises(PrivacyError, match="missing"):
        Accountant.from_dict({k: v for k, v in good.items() if k != "delta"})
    with pytest.raises(PrivacyError, match="unexpected"):
        Accountant.from_dict({**good, "spent": 1.0})
    with pytest.raises(PrivacyError, match="event"):
        Accountant.from_dict({**good, "events": [[1.0, 0.1, 1]]})


def test_max_steps_is_the_last_step_within_budget():
    from privacy.accounting import epsilon, max_steps

    n = max_steps(1.0, 0.01, 1e-5, 1.0, accountant="rdp")
    assert n > 0
    assert epsilon(1.0, 0.01, n, 1e-5, accountant="rdp") <= 1.0 < epsilon(1.0, 0.01, n + 1, 1e-5, accountant="rdp")
    assert max_steps(0.3, 1.0, 1e-5, 0.01, accountant="rdp") == 0


def test_noise_for_the_rest_keeps_the_whole_run_within_the_target():
    """20 steps calibrated for epsilon 8 over 20, then 10 more: the noise for the 10 is the
    smallest that keeps the composed 30 at or below 8; a history already over the target is
    refused by name."""
    from privacy.accounting import Accountant, noise_multiplier
    from privacy.errors import PrivacyError

    q, delta = 0.05, 1e-5
    sigma20 = noise_multiplier(8.0, delta, q, 20)
    past = Accountant(delta=delta).record(sigma20, q, 20)
    rest = noise_multiplier(8.0, delta, q, 10, history=past.events)
    whole = past.record(rest, q, 10).epsilon()
    assert rest > sigma20 and whole <= 8.0 and whole >= 0.99 * 8.0
    assert past.record(sigma20, q, 10).epsilon() > 8.0  # keeping the old noise would overspend
    with pytest.raises(PrivacyError, match="already taken spent epsilon"):
        noise_multiplier(1.0, delta, q, 10, history=past.events)


def test_dp_accounting_is_imported_only_when_an_epsilon_is_composed():
    """A process that never composes an epsilon (the launcher of a sharded run, which builds the
    step's modules to check the layout) does not pay dp_accounting's import (scipy's signal and
    stats: about a second); the first epsilon imports it."""
    import subprocess
    import sys

    from support.processes import python_env

    script = ("import sys\nimport fsdpx.train.build\nfrom privacy.accounting import epsilon\n"
              "before = 'dp_accounting' in sys.modules\nepsilon(1.0, 0.01, 10, 1e-5)\n"
              "print(before, 'dp_accounting' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], env=python_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]
