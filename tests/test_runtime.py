"""The sharded runtime on the in-process mesh: frozen parameters, disagreeing ranks, errors."""

import copy

import pytest
import torch

from fsdpx import Mesh, run_threads, strategies, unshard
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import sgd
from fsdpx.runtime.owned_noise import flat_runs
from fsdpx.runtime.sharded_state import init_sharded
from fsdpx.runtime.step import make_sharded_step
from privacy import DPConfig, init_state, make_private_step


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=13, block_size=4, n_layer=2, n_head=2, n_embd=6)).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 13, (5, 4), generator=g), torch.randint(0, 13, (5, 4), generator=g)


def test_frozen_parameters_stay_frozen_and_the_rest_equals_the_unsharded_private_run():
    model = _model()
    trainable = {k: v.detach() for k, v in model.named_parameters() if not k.startswith("blocks.0.")}
    config = DPConfig(clip_norm=0.5, noise_multiplier=0.5, sample_rate=0.1, method="ghost")
    opt = sgd(0.1)
    ref_state = init_state(trainable, opt, key=2, config=config)
    ref_state, _ = make_private_step(model, token_loss, opt, config, num_examples=50)(ref_state, _batch())
    shapes = {k: tuple(v.shape) for k, v in trainable.items()}
    strategy = strategies.zero3()

    def rank(comm):
        m = copy.deepcopy(model)
        step = make_sharded_step(m, token_loss, opt, strategy, comm, param_shapes=shapes, config=config, num_examples=50)
        state, _ = step(init_sharded(trainable, opt, strategy, comm, key=2, config=config), _batch())
        frozen = {k: v for k, v in m.named_parameters() if k.startswith("blocks.0.")}
        return state, frozen

    results = run_threads(Mesh(dp=2), rank)
    for k, want in ref_state.params.items():
        got = unshard([r[0].params[k] for r in results], strategy.param_at_rest(want.dim()), Mesh(dp=2))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for k, v in results[0][1].items():
        assert torch.equal(v, dict(model.named_parameters())[k])


def test_ranks_that_disagree_on_the_configuration_are_named():
    model = _model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        clip = 0.5 if comm.rank != 1 else 0.7  # rank 1 was started with another clip norm
        config = DPConfig(clip_norm=clip, noise_multiplier=0.5, sample_rate=0.1, method="ghost")
        step = make_sharded_step(copy.deepcopy(model), token_loss, sgd(0.1), strategies.zero3(), comm,
                                 param_shapes=shapes, config=config, num_examples=50)
        return step(init_sharded(params, sgd(0.1), strategies.zero3(), comm, key=2, config=config), _batch())

    with pytest.raises(ValueError, match=r"ranks \[1\] disagree"):
        run_threads(Mesh(dp=3), rank)


def test_a_strategy_whose_axis_is_not_in_the_mesh_is_refused():
    model = _model()
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}

    def rank(comm):
        make_sharded_step(model, token_loss, sgd(0.1), strategies.hsdp(), comm, param_shapes=shapes)

    with pytest.raises(ValueError, match="axis 'replica'"):
        run_threads(Mesh(dp=2), rank)


@pytest.mark.parametrize("shape, box, runs", [
    ((5, 3), ((0, 3), (0, 3)), [(0, 9)]),
    ((5, 3), ((3, 5), (0, 3)), [(9, 15)]),
    ((2, 4), ((0, 2), (1, 3)), [(1, 3), (5, 7)]),
    ((4,), ((4, 4),), []),
    ((), (), [(0, 1)]),
])
def test_flat_runs_list_the_global_indices_of_a_box(shape, box, runs):
    assert flat_runs(shape, box) == runs


@pytest.mark.parametrize("shape, box", [
    ((300, 700), ((0, 300), (350, 700))),  # a row-parallel column block: one short run per row
    ((300, 700), ((100, 200), (0, 700))),  # a row block: one run
    ((3, 70000), ((0, 3), (10, 20))),  # runs a block apart: drawn one by one
    ((5, 3), ((2, 2), (0, 3))),  # empty
    ((), ()),
])
def test_shard_noise_equals_the_unsharded_draw_of_its_box(shape, box):
    from fsdpx.runtime.owned_noise import shard_noise
    from privacy.noise import noise_slice

    numel = max(1, int(torch.tensor(shape).prod())) if shape else 1
    full = noise_slice("w", numel, 0, numel, key=3, step=2, std=0.5, dtype=torch.float64).view(shape)
    want = full[tuple(slice(a, b) for a, b in box)]
    got = shard_noise("w", shape, box, key=3, step=2, std=0.5, dtype=torch.float64)
    assert got.shape == want.shape and torch.equal(got, want)
