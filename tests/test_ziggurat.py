"""Unit tests of privacy.ziggurat: the tables tile the density, streams are prefix-stable, and
the draws are standard normal (moments, tails, a Kolmogorov-Smirnov test)."""

import math

import numpy as np
import pytest
import torch

from privacy.ziggurat import STRIP_AREA, STRIPS, TAIL_START, fill_normals, strip_edges


def _f(x):
    return math.exp(-0.5 * x * x)


def test_every_strip_has_the_same_area_and_the_strips_reach_the_top():
    x = strip_edges()
    assert len(x) == STRIPS + 1 and x[1] == TAIL_START and x[-1] == 0.0
    tail = math.sqrt(math.pi / 2) * math.erfc(TAIL_START / math.sqrt(2))  # integral of f beyond r
    assert x[0] * _f(TAIL_START) == pytest.approx(TAIL_START * _f(TAIL_START) + tail, rel=1e-9)
    for i in range(1, STRIPS):
        assert x[i] * (_f(x[i + 1]) - _f(x[i])) == pytest.approx(STRIP_AREA, rel=1e-9), i
    assert all(a > b for a, b in zip(x[1:], x[2:]))  # edges decrease to the top strip


def test_a_stream_prefix_does_not_depend_on_its_length():
    whole = np.empty(5000)
    fill_normals((1, 2, 3), 0, whole)
    for skip, n in [(0, 1), (0, 4999), (17, 100), (4000, 1000), (1234, 0)]:
        part = np.empty(n)
        fill_normals((1, 2, 3), skip, part)
        assert np.array_equal(part, whole[skip:skip + n])


def test_float32_draws_are_the_float64_draws_rounded():
    d64, d32 = np.empty(70_000), np.empty(70_000, np.float32)
    fill_normals((9, 8, 7), 5, d64)
    fill_normals((9, 8, 7), 5, d32)
    assert np.array_equal(d32, d64.astype(np.float32))


def test_draws_pass_a_kolmogorov_smirnov_test_and_reach_the_tail():
    n = 2_000_000
    x = np.empty(n)
    fill_normals((2024, 17, 3), 0, x)
    xs = np.sort(x)
    cdf = 0.5 * torch.special.erfc(torch.from_numpy(-xs / math.sqrt(2))).numpy()
    ks = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert ks < 1.63 / math.sqrt(n)  # the 1% critical value of the KS statistic
    beyond = np.abs(x) > TAIL_START  # drawn by the tail method: P = erfc(r / sqrt 2) ~ 2.6e-4
    p = math.erfc(TAIL_START / math.sqrt(2))
    assert abs(beyond.mean() - p) < 5 * math.sqrt(p / n)
    assert abs(np.mean(x)) < 5 / math.sqrt(n) and abs(np.var(x) - 1) < 5 * math.sqrt(2 / n)
    assert abs(np.mean(x > 0) - 0.5) < 5 * math.sqrt(0.25 / n)  # the sign bit is fair


def test_different_states_give_unrelated_streams():
    a, b = np.empty(1000), np.empty(1000)
    fill_normals((1, 2, 3), 0, a)
    fill_normals((1, 2, 4), 0, b)
    assert not np.isin(a, b).any()


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="skip"):
        fill_normals((1, 2, 3), -1, np.empty(3))
    with pytest.raises(ValueError, match="out"):
        fill_normals((1, 2, 3), 0, np.empty(3, np.int64))
    with pytest.raises(ValueError, match="out"):
        fill_normals((1, 2, 3), 0, np.empty((2, 2)))
    with pytest.raises(ValueError, match="out"):
        fill_normals((1, 2, 3), 0, np.empty(6)[::2])
    fill_normals((1, 2, 3), 0, np.empty(0))  # nothing to draw



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("std", [1.0, 0.37, 3.0])
def test_adding_scaled_draws_is_filling_scaling_and_adding(dtype, std):
    """``add_scaled_normals`` == torch's ``out.add_(torch.from_numpy(draw).mul_(std))`` bit for bit."""
    from privacy.ziggurat import add_scaled_normals

    base = np.random.default_rng(0).standard_normal(20_000).astype(dtype)
    draw = np.empty(20_000, dtype)
    fill_normals((4, 5, 6), 0, draw)
    expected = torch.from_numpy(base.copy()).add_(torch.from_numpy(draw).mul_(std))
    out = base.copy()
    add_scaled_normals((4, 5, 6), out, std)
    assert np.array_equal(out, expected.numpy())
