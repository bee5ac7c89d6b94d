"""Tests of privacy.sampling.PoissonSampler: the batch of a step is an independent Bernoulli
draw per example, a pure function of (key, step)."""

import json
import math

import numpy as np
import pytest
import torch

from privacy.errors import PrivacyError
from privacy.sampling import PoissonSampler


def test_indices_are_sorted_unique_and_in_range():
    s = PoissonSampler(1000, 0.3, key=5)
    for step in range(20):
        idx = s.indices(step)
        assert idx.dtype == torch.int64 and idx.dim() == 1
        assert torch.equal(idx, torch.unique(idx))  # unique() sorts
        assert idx.numel() == 0 or (0 <= idx.min() and idx.max() < 1000)


def test_indices_are_a_pure_function_of_key_and_step():
    a, b = PoissonSampler(500, 0.1, key=9), PoissonSampler(500, 0.1, key=9)
    forward = [a.indices(t) for t in range(10)]
    backward = [b.indices(t) for t in reversed(range(10))][::-1]
    assert all(torch.equal(x, y) for x, y in zip(forward, backward))


def test_different_steps_draw_different_batches():
    s = PoissonSampler(2000, 0.5, key=1)
    batches = [s.indices(t) for t in range(30)]
    for i in range(len(batches)):
        for j in range(i + 1, len(batches)):
            assert not torch.equal(batches[i], batches[j])


def test_different_keys_draw_different_batches():
    a, b = PoissonSampler(2000, 0.5, key=1), PoissonSampler(2000, 0.5, key=2)
    assert not any(torch.equal(a.indices(t), b.indices(t)) for t in range(10))


def test_empirical_inclusion_rate_matches_sample_rate():
    n, q, steps = 20_000, 0.05, 20
    s = PoissonSampler(n, q, key=123)
    total = sum(s.indices(t).numel() for t in range(steps))
    mean, sd = n * steps * q, math.sqrt(n * steps * q * (1 - q))
    assert abs(total - mean) < 5 * sd


def test_each_example_is_included_independently_across_steps():
    # Per-example inclusion counts over T steps are Binomial(T, q) if steps are independent;
    # a sampler that repeated batches or correlated steps would inflate their variance.
    n, q, steps = 2000, 0.2, 200
    s = PoissonSampler(n, q, key=77)
    counts = torch.zeros(n)
    for t in range(steps):
        counts[s.indices(t)] += 1
    mean, var = steps * q, steps * q * (1 - q)
    assert abs(counts.mean().item() - mean) < 5 * math.sqrt(var / n)
    # Var of the sample variance of n normal-ish values is about 2 var^2 / (n - 1).
    assert abs(counts.var().item() - var) < 5 * math.sqrt(2 * var**2 / (n - 1))


def test_sample_rate_one_includes_every_example():
    assert torch.equal(PoissonSampler(17, 1.0, key=0).indices(3), torch.arange(17))


def test_empty_samples_are_empty_int64_tensors():
    idx = PoissonSampler(1, 1e-12, key=0).indices(0)
    assert idx.shape == (0,) and idx.dtype == torch.int64


def test_expected_batch_size_is_num_examples_times_sample_rate():
    assert PoissonSampler(60_000, 0.004, key=0).expected_batch_size == pytest.approx(240.0)


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.0000001, 2.0, float("nan"), float("inf"), True])
def test_sample_rate_outside_zero_one_raises_privacy_error_naming_it(rate):
    with pytest.raises(PrivacyError, match="sample_rate"):
        PoissonSampler(10, rate, key=0)


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_num_examples_below_one_raises_privacy_error_naming_it(n):
    with pytest.raises(PrivacyError, match="num_examples"):
        PoissonSampler(n, 0.5, key=0)


def test_negative_step_raises_privacy_error_naming_it():
    with pytest.raises(PrivacyError, match="step"):
        PoissonSampler(10, 0.5, key=0).indices(-1)


def test_privacy_error_is_a_value_error():
    with pytest.raises(ValueError):
        PoissonSampler(10, 0.0, key=0)


def test_config_round_trips_through_json():
    s = PoissonSampler(1234, 0.0123, key=2**80 + 3)
    restored = PoissonSampler.from_dict(json.loads(json.dumps(s.to_dict())))
    assert restored == s
    assert torch.equal(restored.indices(41), s.indices(41))


def test_from_dict_rejects_missing_or_unknown_fields():
    with pytest.raises(PrivacyError, match="missing"):
        PoissonSampler.from_dict({"num_examples": 3, "sample_rate": 0.5})
    with pytest.raises(PrivacyError, match="unexpected"):
        PoissonSampler.from_dict({"num_examples": 3, "sample_rate": 0.5, "key": 1, "step": 4})


def test_batches_yields_consecutive_steps_and_their_indices():
    s = PoissonSampler(100, 0.3, key=4)
    got = list(s.batches(start_step=5, num_steps=3))
    assert [t for t, _ in got] == [5, 6, 7]
    assert all(torch.equal(idx, s.indices(t)) for t, idx in got)
    assert list(s.batches(0, 0)) == []


def test_sampler_leaves_global_random_state_untouched():
    torch.manual_seed(0)
    np.random.seed(0)
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    PoissonSampler(1000, 0.5, key=3).indices(0)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert (np.random.get_state()[1] == np_state).all()
