"""Invariants of privacy.noise: the noise of an element is a pure function of
(key, step, name, index, dtype), so any sharding of a parameter draws the same noise."""

import math
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy import noise
from privacy.noise import BLOCK, noise_slice

keys = st.integers(-(2**70), 2**70)
steps = st.integers(0, 10**9)
names = st.text(max_size=12)
stds = st.floats(0.0, 100.0, allow_nan=False)
dtypes = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])


@st.composite
def partitions(draw, max_numel: int, block: int):
    """A numel and sorted cut points 0 = c_0 <= ... <= c_k = numel, often on or next to block
    edges, with repeated cuts (empty slices)."""
    numel = draw(st.integers(0, max_numel))
    edges = [e + d for e in range(0, numel + 1, block) for d in (-1, 0, 1) if 0 <= e + d <= numel]
    anywhere = st.integers(0, numel)
    cut = st.one_of(anywhere, st.sampled_from(edges)) if edges else anywhere
    cuts = draw(st.lists(cut, max_size=8))
    return numel, [0, *sorted(cuts), numel]


def _concatenated(name, numel, cuts, **kw):
    return torch.cat([noise_slice(name, numel, a, b, **kw) for a, b in zip(cuts, cuts[1:])])


@settings(max_examples=20, deadline=None)
@given(partitions(max_numel=4 * BLOCK + 3, block=BLOCK), names, keys, steps, dtypes)
def test_noise_slices_concatenate_to_the_full_draw(part, name, key, step, dtype):
    numel, cuts = part
    kw = dict(key=key, step=step, std=1.5, dtype=dtype)
    assert torch.equal(_concatenated(name, numel, cuts, **kw), noise_slice(name, numel, 0, numel, **kw))


@settings(max_examples=30, deadline=None)
@given(partitions(max_numel=200, block=16), names, keys, steps)
def test_noise_slices_concatenate_to_the_full_draw_with_tiny_blocks(part, name, key, step):
    # A 16-element block puts many block edges inside small draws; the argument does not
    # depend on the block size.
    numel, cuts = part
    with mock.patch.object(noise, "BLOCK", 16):
        whole = noise_slice(name, numel, 0, numel, key=key, step=step, std=1.0)
        assert torch.equal(_concatenated(name, numel, cuts, key=key, step=step, std=1.0), whole)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2 * BLOCK), st.integers(0, 2 * BLOCK), names, keys, steps)
def test_element_noise_does_not_depend_on_numel(n1, extra, name, key, step):
    small = noise_slice(name, n1, 0, n1, key=key, step=step, std=1.0)
    big = noise_slice(name, n1 + extra, 0, n1 + extra, key=key, step=step, std=1.0)
    assert torch.equal(small, big[:n1])


@settings(max_examples=20, deadline=None)
@given(names, keys, steps, st.integers(0, 3 * BLOCK), dtypes)
def test_noise_is_a_pure_function_of_its_arguments(name, key, step, numel, dtype):
    kw = dict(key=key, step=step, std=0.7, dtype=dtype)
    first = noise_slice(name, numel, 0, numel, **kw)
    noise_slice(name + "x", numel, 0, numel, **kw)  # other draws in between change nothing
    assert torch.equal(first, noise_slice(name, numel, 0, numel, **kw))


@settings(max_examples=30, deadline=None)
@given(st.tuples(keys, steps, names), st.tuples(keys, steps, names))
def test_distinct_key_step_or_name_give_distinct_noise(a, b):
    if a == b:
        return
    x = noise_slice(a[2], 64, 0, 64, key=a[0], step=a[1], std=1.0, dtype=torch.float64)
    y = noise_slice(b[2], 64, 0, 64, key=b[0], step=b[1], std=1.0, dtype=torch.float64)
    assert not torch.equal(x, y)
    assert (x == y).sum() == 0  # independent streams, not shifted copies of one another


@settings(max_examples=10, deadline=None)
@given(names, keys, steps, st.integers(0, 30))
def test_blocks_of_one_parameter_are_distinct_streams(name, key, step, block):
    first = noise_slice(name, 10**12, block * BLOCK, block * BLOCK + 64, key=key, step=step, std=1.0)
    nxt = noise_slice(name, 10**12, (block + 1) * BLOCK, (block + 1) * BLOCK + 64, key=key, step=step, std=1.0)
    assert (first == nxt).sum() == 0


@settings(max_examples=20, deadline=None)
@given(names, keys, steps, stds, dtypes, st.integers(0, 2 * BLOCK + 5))
def test_std_scales_the_unit_draw_exactly(name, key, step, std, dtype, numel):
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    unit = noise_slice(name, numel, 0, numel, key=key, step=step, std=1.0, dtype=draw_dtype)
    scaled = noise_slice(name, numel, 0, numel, key=key, step=step, std=std, dtype=dtype)
    assert torch.equal(scaled, (unit * std).to(dtype))


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([0, 1, 2**40, -5]), st.sampled_from([0, 1, 99_999]), st.sampled_from(["w", "emb.weight"]),
       st.sampled_from([0.01, 1.0, 3.0]), st.sampled_from([torch.float32, torch.float64]))
def test_noise_moments_match_the_requested_gaussian(key, step, name, std, dtype):
    n = 1_000_000
    x = noise_slice(name, n, 0, n, key=key, step=step, std=std, dtype=dtype).double() / std
    # Standard errors of a N(0, 1) sample of size n: mean 1/sqrt(n), std 1/sqrt(2n), and for the
    # fraction beyond 2 sigma, sqrt(p(1-p)/n) with p = erfc(sqrt(2)).
    assert abs(x.mean().item()) < 5 / math.sqrt(n)
    assert abs(x.std().item() - 1.0) < 5 / math.sqrt(2 * n)
    p = math.erfc(math.sqrt(2))
    assert abs((x.abs() > 2).double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
