"""A banded mechanism on sharded layouts (in-process mesh): each rank's noise of its block is the
unsharded draw, bit for bit, and sharded steps equal the one-process steps."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdpx import Mesh, run_threads, strategies, unshard
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.optim import sgd
from fsdpx.runtime.owned_noise import mechanism_noise
from fsdpx.runtime.sharded_state import init_sharded
from fsdpx.runtime.step import make_sharded_step
from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline, unshard_stages
from fsdpx.sharding.tensor_parallel import resolve
from privacy import DPConfig, init_state, make_private_step
from privacy.mechanisms import INDEPENDENT, banded, correlated_noise_slice
from privacy.noise import noise_slice

from support.threads import one_thread  # noqa: F401

MECH = banded((0.8, 0.5, 0.3))


@pytest.mark.parametrize("shape, box", [
    ((300, 700), ((0, 300), (350, 700))),  # a row-parallel column block: one short run per row
    ((300, 700), ((100, 200), (0, 700))),  # a row block: one run
    ((3, 70000), ((0, 3), (10, 20))),  # runs a noise block apart
    ((5, 3), ((2, 2), (0, 3))),  # empty
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mechanism_noise_of_a_box_is_the_unsharded_draw(shape, box, dtype):
    numel = shape[0] * shape[1]
    full = correlated_noise_slice(MECH, "w", numel, 0, numel, key=3, step=4, std=0.5, dtype=dtype).view(shape)
    want = full[tuple(slice(a, b) for a, b in box)]
    got = mechanism_noise(MECH, "w", shape, box, key=3, step=4, std=0.5, dtype=dtype)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(mechanism_noise(INDEPENDENT, "w", shape, box, key=3, step=4, std=0.5, dtype=dtype),
                       noise_slice("w", numel, 0, numel, key=3, step=4, std=0.5, dtype=dtype).view(shape)[
                           tuple(slice(a, b) for a, b in box)])


@pytest.mark.parametrize("layout", ["zero3", "ddp", "tp2", "pp2"])
def test_sharded_banded_steps_equal_the_one_process_steps(layout):
    torch.manual_seed(0)
    gpt = GPTConfig(vocab_size=13, block_size=4, n_layer=2, n_head=2, n_embd=6)
    model = GPT(gpt).double()
    mesh = {"tp2": Mesh(dp=1, tp=2), "pp2": Mesh(dp=1, pp=2)}.get(layout, Mesh(dp=2))
    if layout == "tp2":
        plan = resolve(model, gpt_plan(gpt), strategies.zero3(), mesh)
    elif layout == "pp2":
        plan = resolve_pipeline(model, resolve(model, None, strategies.ddp(), mesh),
                                PipelineParallel(schedule="1f1b", microbatches=3), mesh)
    else:
        plan = getattr(strategies, layout)()
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 13, (5, 4), generator=g), torch.randint(0, 13, (5, 4), generator=g)
    config = DPConfig(clip_norm=0.5, noise_multiplier=0.5, sample_rate=0.1, method="ghost", mechanism=MECH)
    opt = sgd(0.1)
    ref = init_state(params, opt, key=2, config=config)
    step = make_private_step(model, token_loss, opt, config, num_examples=50)
    for _ in range(4):
        ref, _ = step(ref, batch)
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        m = copy.deepcopy(model)
        sharded = make_sharded_step(m, token_loss, opt, plan, comm, param_shapes=shapes, config=config,
                                    num_examples=50)
        state = init_sharded(params, opt, plan, comm, key=2, config=config)
        for _ in range(4):
            state, _ = sharded(state, batch)
        return state

    results = run_threads(mesh, rank)
    if layout in ("tp2", "pp2"):
        whole = unshard_stages([r.params for r in results], plan, mesh)
        got = {k: whole[k].reshape(shapes[k]) for k in shapes}
    else:
        got = {k: unshard([r.params[k] for r in results], plan.param_at_rest(len(shapes[k])), mesh) for k in shapes}
    for k, want in ref.params.items():
        torch.testing.assert_close(got[k], want, rtol=1e-10, atol=1e-12, msg=k)
    assert results[0].accountant.bands == 3 and results[0].accountant.steps == 4
