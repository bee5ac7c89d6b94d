"""Unit tests of privacy.ziggurat: the tables tile the density, each offset's draw stands alone,
the torch-ops formulation (privacy.ziggurat_ops) has the host's bits, and the draws are standard
normal (moments, tails, a Kolmogorov-Smirnov test)."""

import math

import numpy as np
import pytest
import torch

from privacy.ziggurat import COUNTER_SHIFT, STRIP_AREA, STRIPS, TAIL_START, fill_normals, strip_edges

BLOCK = 1 << COUNTER_SHIFT  # the offsets of one seed


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


SEED = (1, 2, 3, 0xFFFFFFFF, 5)  # five 32-bit words


def test_an_offsets_draw_does_not_depend_on_the_range():
    whole = np.empty(5000)
    fill_normals(SEED, 0, whole)
    for first, n in [(0, 1), (0, 4999), (17, 100), (4000, 1000), (1234, 0)]:
        part = np.empty(n)
        fill_normals(SEED, first, part)
        assert np.array_equal(part, whole[first:first + n])


def test_float32_draws_are_the_float64_draws_rounded():
    d64, d32 = np.empty(60_000), np.empty(60_000, np.float32)
    fill_normals((9, 8, 7, 6, 5), 5, d64)
    fill_normals((9, 8, 7, 6, 5), 5, d32)
    assert np.array_equal(d32, d64.astype(np.float32))


def _host_blocks(seeds: list[tuple[int, ...]], dtype=np.float64) -> np.ndarray:
    out = np.empty(len(seeds) * BLOCK, dtype)
    for b, seed in enumerate(seeds):
        fill_normals(seed, 0, out[b * BLOCK:(b + 1) * BLOCK])
    return out


def _call0_candidates(seeds: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Per element: call 0's unsigned candidate ``x`` and its strip, from the Philox words
    alone (an element whose draw is not +-candidate needed more calls)."""
    from privacy.philox import philox_torch
    from privacy.ziggurat import SCALE

    s = torch.tensor(seeds, dtype=torch.int64)
    c1, c2, c3, k0, k1 = (s[:, j:j + 1] for j in range(5))
    y0, y1, _, _ = philox_torch(torch.arange(BLOCK).unsqueeze(0), c1, c2, c3, k0, k1)
    strip = (y0 & 0xFF).reshape(-1)
    u = ((y1 << 20) | (y0 >> 12)).reshape(-1)
    return (u.double() * torch.from_numpy(SCALE)[strip]).numpy(), strip.numpy()


def test_torch_ops_equal_the_host_sampler_bit_for_bit():
    """``ziggurat_ops.draw_normals`` (the device formulation without its check, here on the
    CPU: no NaN, so no element needed the host fallback) == the numba host sampler over 1M
    elements of 16 blocks of assorted seeds, in float64 (1M more in float32 through
    ``privacy.noise``: ``tests/test_noise.py``); among them draws that went to the tail (beyond
    r, found by scanning) and wedge rejections (elements whose call 0 did not settle in a strip
    above 0), each compared on its own as well."""
    from privacy.ziggurat_ops import draw_normals

    g = np.random.default_rng(5)
    seeds = [tuple(int(w) for w in g.integers(0, 2**32, 5)) for _ in range(14)] + [(0,) * 5, (2**32 - 1,) * 5]
    host = _host_blocks(seeds)
    ops = draw_normals(torch.tensor(seeds, dtype=torch.int64), 0, 0, len(seeds) * BLOCK, BLOCK).numpy()
    assert np.array_equal(host.view(np.int64), ops.view(np.int64))
    tail = np.flatnonzero(np.abs(host) > TAIL_START)
    assert len(tail) > 150  # P(|x| > r) = 2.6e-4: about 270 expected
    assert np.array_equal(host[tail], ops[tail]) and np.all(np.abs(ops[tail]) > TAIL_START)
    candidate, strip = _call0_candidates(seeds)
    redrawn = np.flatnonzero((np.abs(host) != candidate) & (strip != 0))  # wedge rejected at call 0
    assert len(redrawn) > 1000  # wedge rejections: several thousand
    assert np.array_equal(host[redrawn], ops[redrawn])


def test_torch_ops_slices_at_odd_offsets_equal_the_host_slices():
    """Slices that start and end inside blocks, across block edges and inside one block."""
    from privacy.ziggurat_ops import block_normals

    seeds = [(7, 7, 7, 7, b) for b in range(3)]
    host = _host_blocks(seeds)
    table = torch.tensor(seeds, dtype=torch.int64)
    for start, stop in [(1, 2), (BLOCK - 3, BLOCK + 5), (12345, 2 * BLOCK + 7), (2 * BLOCK, 3 * BLOCK), (77, 77)]:
        first = start // BLOCK
        got = block_normals(table[first:], first, start, stop, BLOCK).numpy()
        assert np.array_equal(got, host[start:stop]), (start, stop)


@pytest.mark.parametrize("squeeze", ["rounds", "capacity"])
def test_the_host_fallback_fills_exactly_the_unsettled_elements(squeeze, monkeypatch):
    """With the fixed rounds cut to one call (``rounds``) or the first batch's capacity cut to a
    tenth of what it needs (``capacity``), ``draw_normals`` leaves hundreds of elements open
    (NaN) and exact everywhere else, and ``block_normals`` fills those from the host sampler:
    the host's bits everywhere, in a slice that starts and ends inside blocks."""
    import privacy.ziggurat_ops as ops

    if squeeze == "rounds":
        monkeypatch.setattr(ops, "ROUNDS_A", 1)
        monkeypatch.setattr(ops, "ROUNDS_B", 0)
    else:
        monkeypatch.setattr(ops, "OPEN_AFTER_CALL_0", ops.OPEN_AFTER_CALL_0 / 10)
    seeds = [(3, 1, 4, 1, 5 + b) for b in range(4)]
    host = _host_blocks(seeds)
    table = torch.tensor(seeds, dtype=torch.int64)
    start, stop = 1000, 3 * BLOCK + 17
    drawn = ops.draw_normals(table, 0, start, stop, BLOCK).numpy()
    open_ = np.isnan(drawn)
    assert open_.sum() > 200
    assert np.array_equal(drawn[~open_], host[start:stop][~open_])
    assert np.array_equal(ops.block_normals(table, 0, start, stop, BLOCK).numpy(), host[start:stop])


def test_the_stated_open_probabilities_bound_the_measured_ones(monkeypatch):
    """The fraction of elements still open after call 0 and after call ``ROUNDS_A`` (measured
    as the NaNs ``draw_normals`` leaves with the later rounds cut) over 512k elements lies within
    5 standard deviations of the probabilities the module states (derived from the tables), and
    with no later rounds cut none stays open."""
    import privacy.ziggurat_ops as ops

    seeds = torch.tensor([(8, 6, 7, 5, b) for b in range(8)], dtype=torch.int64)
    n = 8 * BLOCK
    measured = {}
    for rounds_a, p in [(0, ops.OPEN_AFTER_CALL_0), (ops.ROUNDS_A, ops.OPEN_AFTER_ROUNDS_A)]:
        monkeypatch.setattr(ops, "ROUNDS_A", rounds_a)
        monkeypatch.setattr(ops, "ROUNDS_B", 0)
        measured[rounds_a] = int(ops.draw_normals(seeds, 0, 0, n, BLOCK).isnan().sum())
        assert abs(measured[rounds_a] - n * p) < 5 * math.sqrt(n * p), (rounds_a, measured)
    monkeypatch.undo()
    assert not ops.draw_normals(seeds, 0, 0, n, BLOCK).isnan().any()
    assert ops.ROUNDS_A + ops.ROUNDS_B == 16 and ops.OPEN_AFTER_ALL_ROUNDS < 1e-19


def test_draws_pass_a_kolmogorov_smirnov_test_and_reach_the_tail():
    n = 2_000_000
    x = np.empty(n)
    fill_normals((2024, 17, 3, 4, 5), 0, x[:BLOCK])
    for b in range(1, n // BLOCK + 1):  # an offset is below 2^16: one block per 65536 draws
        fill_normals((2024, 17, 3, 4, 5 + b), 0, x[b * BLOCK:(b + 1) * BLOCK])
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
    fill_normals((1, 2, 3, 4, 5), 0, a)
    fill_normals((1, 2, 3, 4, 6), 0, b)
    assert not np.isin(a, b).any()


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="offsets"):
        fill_normals(SEED, -1, np.empty(3))
    with pytest.raises(ValueError, match="offsets"):
        fill_normals(SEED, BLOCK - 2, np.empty(3))
    with pytest.raises(ValueError, match="seed"):
        fill_normals((1, 2, 3), 0, np.empty(3))
    with pytest.raises(ValueError, match="seed"):
        fill_normals((1, 2, 3, 4, 2**32), 0, np.empty(3))
    with pytest.raises(ValueError, match="out"):
        fill_normals(SEED, 0, np.empty(3, np.int64))
    with pytest.raises(ValueError, match="out"):
        fill_normals(SEED, 0, np.empty((2, 2)))
    with pytest.raises(ValueError, match="out"):
        fill_normals(SEED, 0, np.empty(6)[::2])
    fill_normals(SEED, 0, np.empty(0))  # nothing to draw



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("std", [1.0, 0.37, 3.0])
def test_adding_scaled_draws_is_filling_scaling_and_adding(dtype, std):
    """``add_scaled_normals`` == torch's ``out.add_(torch.from_numpy(draw).mul_(std))`` bit for bit."""
    from privacy.ziggurat import add_scaled_normals

    base = np.random.default_rng(0).standard_normal(20_000).astype(dtype)
    draw = np.empty(20_000, dtype)
    fill_normals((4, 5, 6, 7, 8), 0, draw)
    expected = torch.from_numpy(base.copy()).add_(torch.from_numpy(draw).mul_(std))
    out = base.copy()
    add_scaled_normals((4, 5, 6, 7, 8), out, std)
    assert np.array_equal(out, expected.numpy())


def test_the_cached_kernel_computes_what_its_source_says():
    """``fill_normals`` (compiled and cached on disk by numba, keyed on privacy/ziggurat.py
    alone) == ``_normal``'s Python source run element by element with the current Philox and
    exp/log: a cache left stale by an edit of privacy/philox.py or privacy/exact_math.py fails
    here. The elements include tail draws and draws past a wedge test."""
    import privacy.ziggurat as z

    seed = (11, 22, 33, 44, 55)
    out = np.empty(BLOCK)
    fill_normals(seed, 0, out)
    tail = np.flatnonzero(np.abs(out) > TAIL_START)
    candidate, strip = _call0_candidates([seed])
    wedge = np.flatnonzero((np.abs(out) != candidate) & (strip != 0))
    assert len(tail) and len(wedge)
    words = [np.uint64(w) for w in seed]
    for i in [*range(64), *tail[:10], *wedge[:40], BLOCK - 1]:
        assert z._normal.py_func(*words, np.uint64(i), z.ACCEPT, z.SCALE, z.HEIGHT) == out[i], i
