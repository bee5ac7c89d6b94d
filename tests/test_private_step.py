"""The private step: noise from (key, step, name, element), empty batches, the budget."""

import math

import pytest
import torch

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import sgd
from privacy import (BudgetExhaustedError, DPConfig, PrivacyError, clipped_grad, gaussian_noise, init_state,
                     make_private_step, max_steps)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=17, block_size=5, n_layer=1, n_head=1, n_embd=4)).double()
    ids = torch.randint(0, 17, (6, 5))
    return model, (ids, ids.roll(1, 1))


def _run(model, batch, config, key=1, steps=1):
    opt = sgd(1.0)
    state = init_state(dict(model.named_parameters()), opt, key=key, config=config)
    step = make_private_step(model, token_loss, opt, config, num_examples=100)
    for _ in range(steps):
        state, _ = step(state, batch)
    return state


def test_noised_gradient_is_clipped_sum_plus_keyed_noise_over_expected_batch(setup):
    model, batch = setup
    config = DPConfig(clip_norm=0.7, noise_multiplier=1.3, sample_rate=0.05)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = _run(model, batch, config, key=9)
    clipped, _ = clipped_grad(model, params, batch, token_loss, clip_norm=0.7)
    noise = gaussian_noise(params, key=9, step=0, std=1.3 * 0.7)
    for k, p in params.items():
        expected = p - (clipped[k] + noise[k]) / (0.05 * 100)
        torch.testing.assert_close(state.params[k], expected, rtol=1e-12, atol=1e-14)


def test_same_key_same_run_other_key_other_noise(setup):
    model, batch = setup
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.05)
    a, b, c = (_run(model, batch, config, key=k, steps=2) for k in (3, 3, 4))
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert not all(torch.equal(a.params[k], c.params[k]) for k in a.params)


def test_empty_batch_step_applies_only_noise(setup):
    model, batch = setup
    config = DPConfig(clip_norm=1.0, noise_multiplier=2.0, sample_rate=0.05)
    empty = (batch[0][:0], batch[1][:0])
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = _run(model, empty, config, key=5)
    noise = gaussian_noise(params, key=5, step=0, std=2.0)
    for k, p in params.items():
        torch.testing.assert_close(state.params[k], p - noise[k] / 5.0, rtol=1e-12, atol=1e-14)
    assert state.accountant.steps == 1


def test_budget_refuses_the_step_that_would_overspend_and_changes_nothing(setup):
    model, batch = setup
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.05, epsilon_budget=2.0, accountant="rdp")
    allowed = max_steps(1.0, 0.05, 1e-5, 2.0, accountant="rdp")
    assert 0 < allowed < 50
    opt = sgd(0.1)
    state = init_state(dict(model.named_parameters()), opt, key=0, config=config)
    step = make_private_step(model, token_loss, opt, config, num_examples=100)
    for _ in range(allowed):
        state, _ = step(state, batch)
    before = {k: v.clone() for k, v in state.params.items()}
    with pytest.raises(BudgetExhaustedError, match="budget"):
        step(state, batch)
    assert all(torch.equal(before[k], state.params[k]) for k in before)
    assert state.accountant.steps == allowed and state.accountant.epsilon() <= 2.0


@pytest.mark.parametrize("kwargs, word", [
    (dict(clip_norm=0.0), "clip_norm"), (dict(clip_norm=math.inf), "clip_norm"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"), (dict(sample_rate=0.0), "sample_rate"),
    (dict(sample_rate=1.5), "sample_rate"), (dict(delta=1.0), "delta"), (dict(method="hooks"), "method"),
])
def test_bad_private_config_is_named(kwargs, word):
    base = dict(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(PrivacyError, match=word):
        DPConfig(**{**base, **kwargs})


def test_donated_state_gives_the_same_bits(setup):
    """``donate=True`` lets AdamW write into the state's tensors; the bits do not change."""
    from fsdpx.optim import adamw

    model, batch = setup
    config = DPConfig(clip_norm=0.5, noise_multiplier=1.0, sample_rate=0.05)
    opt = adamw(1e-2)
    runs = []
    for donate in (False, True):
        state = init_state(dict(model.named_parameters()), opt, key=5, config=config)
        step = make_private_step(model, token_loss, opt, config, num_examples=100, donate=donate)
        for _ in range(3):
            state, _ = step(state, batch)
        runs.append(state)
    pure, donated = runs
    for k in pure.params:
        assert torch.equal(pure.params[k], donated.params[k])
        assert torch.equal(pure.opt_state["nu"][k], donated.opt_state["nu"][k])
