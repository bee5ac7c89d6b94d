"""privacy.exact_math: the host (numba), torch and plain-Python evaluations of exp and log give
the same bits, and each is within its stated error of math.exp / math.log."""

import math

import numba
import numpy as np
import torch

from privacy.exact_math import EXP_MAX_ULPS, LOG_MAX_ULPS, exp_host, exp_torch, log_host, log_torch


@numba.njit
def _exp_all(z):  # noqa: ANN001, ANN202
    out = np.empty_like(z)
    for i in range(z.shape[0]):
        out[i] = exp_host(z[i])
    return out


@numba.njit
def _log_all(u):  # noqa: ANN001, ANN202
    out = np.empty_like(u)
    for i in range(u.shape[0]):
        out[i] = log_host(u[i])
    return out


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    """Wedge arguments on [-7, 0] and 53-bit tail uniforms on [2^-53, 1], with their edges."""
    g = np.random.default_rng(1)
    z = np.concatenate([-7.0 * g.random(300_000), [0.0, -0.0, -7.0, -math.log(2) / 2, -1e-300]])
    u = (g.integers(0, 2**53, 300_000).astype(np.float64) + 1.0) * 2.0**-53
    u = np.concatenate([u, 2.0 ** -np.arange(54.0), [1.0 - 2.0**-53, 0.5 + 2.0**-53, math.sqrt(0.5)]])
    return z, u


def test_host_torch_and_python_agree_bit_for_bit():
    """numba's compiled functions, the same source run by plain Python (which has no fused
    multiply-add: this catches a compiler contracting ``a * b + c``), and the torch ops."""
    z, u = _inputs()
    host_e, host_l = _exp_all(z), _log_all(u)
    assert np.array_equal(host_e.view(np.int64), exp_torch(torch.from_numpy(z)).numpy().view(np.int64))
    assert np.array_equal(host_l.view(np.int64), log_torch(torch.from_numpy(u)).numpy().view(np.int64))
    for i in range(0, len(z), 97):
        assert exp_host.py_func(float(z[i])) == host_e[i]
    for i in list(range(0, len(u), 97)) + list(range(len(u) - 57, len(u))):
        assert log_host.py_func(float(u[i])) == host_l[i]


def test_exp_and_log_are_within_their_stated_error():
    z, u = _inputs()
    ref_e = np.array([math.exp(v) for v in z])
    assert np.max(np.abs(_exp_all(z) - ref_e) / np.spacing(ref_e)) <= EXP_MAX_ULPS
    ref_l = np.array([math.log(v) for v in u])
    nonzero = ref_l != 0
    err = np.abs(_log_all(u) - ref_l)[nonzero] / np.spacing(np.abs(ref_l[nonzero]))
    assert np.max(err) <= LOG_MAX_ULPS
    assert _log_all(np.array([1.0]))[0] == 0.0 and _exp_all(np.array([0.0]))[0] == 1.0
