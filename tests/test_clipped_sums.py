"""``privacy.clipped_sums.ClippedSums``: sums formed when taken equal the eager ones bit for bit,
in any order, and a taken sum's factors are released (what lets a ZeRO-3 rank hold one unit's
full-size gradient at a time instead of all of them)."""

import gc
import weakref

import pytest
import torch

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.runtime.step_memory import step_peak
from fsdpx.optim import adamw
from fsdpx.sharding import Mesh, strategies
from privacy.clipping import clip_and_sum
from privacy.clipped_sums import ClippedSums
from privacy import contributions as C
from privacy.step import DPConfig


@pytest.fixture
def gpt_case():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)).double()
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    x = torch.randint(0, 37, (5, 8))
    return model, params, (x, torch.roll(x, 1, 1))


@pytest.mark.parametrize("method", ["ghost", "auto"])
def test_lazy_sums_taken_in_any_order_equal_the_eager_ones_bit_for_bit(gpt_case, method):
    model, params, batch = gpt_case
    eager = clip_and_sum(model, params, batch, token_loss, clip_norm=0.1, method=method)
    lazy = clip_and_sum(model, params, batch, token_loss, clip_norm=0.1, method=method, lazy=True)
    assert isinstance(lazy.grads, ClippedSums) and isinstance(eager.grads, dict)
    assert torch.equal(lazy.norms, eager.norms) and list(lazy.grads) == list(params)
    names = list(params)[::-1]  # the reverse of the mapping's order, as a unit-by-unit reduce takes them
    first = lazy.grads[names[1]]  # read, then popped: the kept sum is handed over
    for name in names:
        assert name in lazy.grads
        got = lazy.grads.pop(name)
        assert torch.equal(got, eager.grads[name]), name
        assert name not in lazy.grads
    assert first is not None and len(lazy.grads) == 0 and lazy.grads.pop(names[0], None) is None
    with pytest.raises(KeyError):
        lazy.grads.pop(names[0])


def test_a_taken_sum_releases_its_factors():
    B, T, m, n = 3, 4, 5, 6
    left, right = torch.randn(B, T, m), torch.randn(B, T, n)
    gone = weakref.ref(left)
    params = {"w": torch.zeros(m, n), "unused": torch.zeros(2)}
    sums = ClippedSums({"w": [C.Factored(left, right, m, (0, m))]}, torch.rand(B), params)
    del left
    assert gone() is not None  # held by the contribution until the sum is formed
    expected = C.weighted_sum([C.Factored(gone(), right, m, (0, m))], sums._factors, torch.Size((m, n)))
    assert torch.equal(sums.pop("w"), expected)
    gc.collect()
    assert gone() is None
    assert torch.equal(sums.pop("unused"), torch.zeros(2))  # the forward did not use it: zeros


def test_a_zero3_rank_never_holds_every_full_size_clipped_sum_at_once():
    """The private ZeRO-3 step's peak above its state (``step_peak``: the step run on meta
    tensors, every storage counted) on 4 ranks, for a model whose gradient outweighs its
    activations (one short example per rank), stays well below one full-size gradient: the
    sums are reduced unit by unit as they are formed, so they are never all alive together
    (DDP's reduced gradients are, by design)."""
    config = GPTConfig(vocab_size=1024, block_size=4, n_layer=6, n_head=2, n_embd=128)
    with torch.device("meta"):
        model = GPT(config)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    dp = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=4 / 1000, method="ghost")
    zero3 = step_peak(model, token_loss, adamw(1e-3), strategies.zero3(), Mesh(dp=4), (4, 4),
                      config=dp, num_examples=1000)
    ddp = step_peak(model, token_loss, adamw(1e-3), strategies.ddp(), Mesh(dp=4), (4, 4),
                    config=dp, num_examples=1000)
    assert ddp.step >= grad_bytes  # DDP's reduced gradients are full size
    assert zero3.step < 0.75 * grad_bytes, (zero3.step, grad_bytes)
