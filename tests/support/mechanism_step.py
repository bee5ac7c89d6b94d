"""What a private step adds under a noise mechanism, against the dense oracle ``C^{-1} z``
(``tests/test_train_mechanisms.py``, ``tests/test_blt_accounting.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import sgd
from privacy import DPConfig, clipped_grad, init_state, make_private_step
from privacy.mechanisms import Mechanism
from privacy.noise import noise_slice
from privacy.step import TrainState

CLIP, SIGMA, RATE, EXAMPLES, KEY = 0.7, 1.3, 0.05, 100, 9


def steps_add_the_dense_noise(mechanism: Mechanism, inverse: Tensor) -> tuple[TrainState, DPConfig]:
    """Run ``len(inverse)`` private steps of a one-block float64 GPT (SGD at lr 1, so the update is
    minus the noised mean) under ``mechanism`` and assert that step ``t`` moved every parameter by
    its clipped sum plus row ``t`` of ``inverse @ z`` (``z`` the unit draws of steps ``0..t``) times
    ``SIGMA * CLIP``, over ``RATE * EXAMPLES``, to 1e-12. Returns the last state and the config."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=17, block_size=5, n_layer=1, n_head=1, n_embd=4)).double()
    ids = torch.randint(0, 17, (6, 5))
    batch = (ids, ids.roll(1, 1))
    config = DPConfig(clip_norm=CLIP, noise_multiplier=SIGMA, sample_rate=RATE, mechanism=mechanism)
    opt = sgd(1.0)
    state = init_state(dict(model.named_parameters()), opt, key=KEY, config=config)
    step = make_private_step(model, token_loss, opt, config, num_examples=EXAMPLES)
    for t in range(len(inverse)):
        before = {k: v.clone() for k, v in state.params.items()}
        clipped, _ = clipped_grad(model, before, batch, token_loss, clip_norm=CLIP)
        state, _ = step(state, batch)
        for k, p in before.items():
            z = torch.stack([noise_slice(k, p.numel(), 0, p.numel(), key=KEY, step=s, std=1.0, dtype=torch.float64)
                             for s in range(t + 1)])
            noise = (SIGMA * CLIP * inverse[t, :t + 1] @ z).view(p.shape)
            torch.testing.assert_close(state.params[k], p - (clipped[k] + noise) / (RATE * EXAMPLES),
                                       rtol=1e-12, atol=1e-14)
    return state, config
