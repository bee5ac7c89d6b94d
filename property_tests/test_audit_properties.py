"""Invariants of privacy.audit's one-run bound over drawn counts (with 2 m delta <= 1, which
the bound requires): the bound is the root of the theorem's p-value (rejected just below it,
not just above), it never falls with one more right guess, never rises with delta, and at
delta 0 never rises with one more wrong guess."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from privacy.audit import correct_guess_p_value, epsilon_lower_bound


@st.composite
def counts(draw):
    canaries = draw(st.integers(2, 1000))
    guesses = draw(st.integers(1, canaries))
    correct = draw(st.integers(0, guesses))
    return canaries, guesses, correct


deltas = st.sampled_from([0.0, 1e-8, 1e-5, 5e-4])  # 2 m delta <= 1
confidences = st.floats(0.5, 0.999)


@settings(max_examples=30, deadline=None)
@given(counts(), deltas, confidences)
def test_the_bound_is_where_the_p_value_crosses_one_minus_confidence(c, delta, confidence):
    m, r, v = c
    eps = epsilon_lower_bound(r, v, canaries=m, delta=delta, confidence=confidence)
    level = 1 - confidence
    if eps > 0:
        # rejected just below the bound, not just above it
        assert correct_guess_p_value(r, v, canaries=m, epsilon=max(eps - 1e-6, 0.0), delta=delta) <= level + 1e-9
        assert correct_guess_p_value(r, v, canaries=m, epsilon=eps + 1e-6, delta=delta) >= level - 1e-9
    else:
        assert correct_guess_p_value(r, v, canaries=m, epsilon=0.0, delta=delta) >= level - 1e-12


@settings(max_examples=20, deadline=None)
@given(counts(), deltas, confidences)
def test_one_more_right_guess_never_lowers_the_bound(c, delta, confidence):
    m, r, v = c
    assume(v < r)
    lower = epsilon_lower_bound(r, v, canaries=m, delta=delta, confidence=confidence)
    assert epsilon_lower_bound(r, v + 1, canaries=m, delta=delta, confidence=confidence) >= lower - 1e-7


@settings(max_examples=20, deadline=None)
@given(counts(), confidences)
def test_a_larger_delta_never_raises_the_bound(c, confidence):
    m, r, v = c
    bounds = [epsilon_lower_bound(r, v, canaries=m, delta=d, confidence=confidence) for d in (0.0, 1e-6, 5e-4)]
    assert bounds[0] >= bounds[1] - 1e-7 and bounds[1] >= bounds[2] - 1e-7


@settings(max_examples=20, deadline=None)
@given(counts(), confidences)
def test_a_wrong_guess_added_never_raises_the_bound_at_delta_zero(c, confidence):
    m, r, v = c
    assume(r < m)
    assert epsilon_lower_bound(r + 1, v, canaries=m, delta=0.0, confidence=confidence) <= \
        epsilon_lower_bound(r, v, canaries=m, delta=0.0, confidence=confidence) + 1e-7
