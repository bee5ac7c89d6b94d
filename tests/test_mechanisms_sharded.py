"""A banded or BLT mechanism on sharded layouts (in-process mesh): each rank's noise of its block is the
unsharded draw, bit for bit; sharded steps equal the one-process steps, and their noise history
is the one-process history bit for bit; a run saved and resumed, in its own layout or another,
continues its noise bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ckpt
from fsdpx import Mesh, strategies
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.optim import sgd
from fsdpx.runtime.owned_noise import mechanism_noise
from fsdpx.sharding.cost_model import as_plan, memory_by_rank
from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline, unshard_stages
from fsdpx.sharding.tensor_parallel import resolve
from privacy import DPConfig, init_state, make_private_step
from privacy.mechanisms import INDEPENDENT, BufferedToeplitz, banded, blt_mechanism, empty_history, streamed_noise
from privacy.noise import noise_slice

from support.mesh_runs import rank_runs, sharded_run
from support.threads import one_thread  # noqa: F401

MECH = banded((0.8, 0.5, 0.3))
BLT = blt_mechanism(BufferedToeplitz((0.9, 0.3), (0.4, 0.2)), min_sep=2)
GPT_CONFIG = GPTConfig(vocab_size=13, block_size=4, n_layer=2, n_head=2, n_embd=6)
CONFIG = DPConfig(clip_norm=0.5, noise_multiplier=0.5, sample_rate=0.1, method="ghost", mechanism=MECH)


@pytest.mark.parametrize("shape, box", [
    ((300, 700), ((0, 300), (350, 700))),  # a row-parallel column block: one short run per row
    ((300, 700), ((100, 200), (0, 700))),  # a row block: one run
    ((3, 70000), ((0, 3), (10, 20))),  # runs a noise block apart
    ((5, 3), ((2, 2), (0, 3))),  # empty
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mech", [MECH, BLT], ids=["banded", "blt"])
def test_mechanism_noise_of_a_box_is_the_unsharded_draw(shape, box, dtype, mech):
    cut = tuple(slice(a, b) for a, b in box)
    like, history = {"w": torch.zeros(shape, dtype=dtype)}, empty_history(mech)
    for t in range(4):
        _, history = streamed_noise(mech, like, history, key=3, step=t, std=0.5)
    full, after = streamed_noise(mech, like, history, key=3, step=4, std=0.5)
    got, kept = mechanism_noise(mech, "w", shape, box, key=3, step=4, std=0.5, dtype=dtype,
                                past=[h["w"][cut] for h in history])
    assert got.shape == full["w"][cut].shape and torch.equal(got, full["w"][cut])
    assert len(kept) == len(after) == mech.history_length  # the history entries of the box, bit for bit
    assert all(torch.equal(k, a["w"][cut]) and k.dtype == torch.float64 for k, a in zip(kept, after))
    numel = shape[0] * shape[1]
    indep, none = mechanism_noise(INDEPENDENT, "w", shape, box, key=3, step=4, std=0.5, dtype=dtype)
    assert none is None and torch.equal(indep, noise_slice("w", numel, 0, numel, key=3, step=4, std=0.5,
                                                           dtype=dtype).view(shape)[cut])


def _model_and_batches(steps):
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG).double()
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randint(0, 13, (5, 4), generator=g), torch.randint(0, 13, (5, 4), generator=g))
                   for _ in range(steps)]


def _plan(model, layout):
    mesh = {"tp2": Mesh(dp=1, tp=2), "pp2": Mesh(dp=1, pp=2)}.get(layout, Mesh(dp=2))
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    if layout == "tp2":
        return resolve(model, gpt_plan(GPT_CONFIG), strategies.zero3(), mesh), mesh
    if layout == "pp2":
        return resolve_pipeline(model, resolve(model, None, strategies.ddp(), mesh),
                                PipelineParallel(schedule="1f1b", microbatches=3), mesh), mesh
    return as_plan(getattr(strategies, layout)(), shapes), mesh


def _whole(results, plan, mesh, model):
    """The ranks' parameters and noise history, unsharded in the parameters' own shapes."""
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    states = [r[0] for r in results]
    params = unshard_stages([s.params for s in states], plan, mesh)
    history = [unshard_stages([s.noise_history[j] for s in states], plan, mesh, layout="opt_state")
               for j in range(len(states[0].noise_history))]
    return ({k: t.reshape(shapes[k]) for k, t in params.items()},
            [{k: t.reshape(shapes[k]) for k, t in h.items()} for h in history])


@pytest.mark.parametrize("layout", ["zero3", "ddp", "tp2", "pp2"])
@pytest.mark.parametrize("mech", [MECH, BLT], ids=["banded", "blt"])
def test_sharded_mechanism_steps_equal_the_one_process_steps(layout, mech):
    model, batches = _model_and_batches(4)
    opt, config = sgd(0.1), dataclasses.replace(CONFIG, mechanism=mech)
    ref = init_state(dict(model.named_parameters()), opt, key=2, config=config)
    step = make_private_step(model, token_loss, opt, config, num_examples=50)
    for b in batches:
        ref, _ = step(ref, b)
    plan, mesh = _plan(model, layout)
    results = rank_runs(model, batches, opt, config, plan, mesh, key=2)
    params, history = _whole(results, plan, mesh, model)
    for k, want in ref.params.items():
        torch.testing.assert_close(params[k], want, rtol=1e-10, atol=1e-12, msg=k)
    assert len(history) == len(ref.noise_history) == 2
    for mine, theirs in zip(history, ref.noise_history):  # the recursion is elementwise: the same bits
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert results[0][0].accountant == ref.accountant and ref.accountant.steps == 4
    assert ref.accountant.bands == mech.groups and ref.accountant.blt == mech.ledger_fields["blt"]


@pytest.mark.parametrize("mech", [MECH, BLT], ids=["banded", "blt"])
def test_a_mechanisms_run_resumes_bit_for_bit_in_its_own_layout_and_another(tmp_path, mech):
    model, batches = _model_and_batches(4)
    opt, config = sgd(0.1), dataclasses.replace(CONFIG, mechanism=mech)
    plan, mesh = _plan(model, "zero3")
    straight = rank_runs(model, batches, opt, config, plan, mesh, key=2)
    ckpt.save_ranks(tmp_path / "c", [s for s, _ in rank_runs(model, batches[:2], opt, config, plan, mesh, key=2)],
                    mesh=mesh, strategy=plan, private=True)
    same = rank_runs(model, batches[2:], opt, config, plan, mesh,
                     states=ckpt.load_ranks(tmp_path / "c", mesh=mesh, strategy=plan, private=True))
    for (mine, _), (theirs, _) in zip(same, straight):
        assert all(torch.equal(mine.params[k], theirs.params[k]) for k in theirs.params)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(mine.noise_history, theirs.noise_history) for k in b)
    tp_plan, tp_mesh = _plan(model, "tp2")  # the same checkpoint, resharded into a tensor-parallel plan
    other = rank_runs(model, batches[2:], opt, config, tp_plan, tp_mesh,
                      states=ckpt.load_ranks(tmp_path / "c", mesh=tp_mesh, strategy=tp_plan, private=True))
    want_params, want_history = _whole(straight, plan, mesh, model)
    got_params, got_history = _whole(other, tp_plan, tp_mesh, model)
    for mine, theirs in zip(got_history, want_history):
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    for k, want in want_params.items():  # the layouts sum gradients in other orders
        torch.testing.assert_close(got_params[k], want, rtol=1e-10, atol=1e-12, msg=k)


def test_resident_bytes_count_the_noise_history(one_thread):
    """A banded zero3 step's resident bytes exceed an independent one's by the history: over the
    ranks, ``bands - 1`` float64 copies of every parameter (the ranks' blocks partition them);
    on each rank exactly what ``memory_by_rank(..., history_copies=bands - 1)`` adds."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, block_size=4, n_layer=1, n_head=2, n_embd=6)).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 13, (5, 4), generator=g), torch.randint(0, 13, (5, 4), generator=g))] * 3
    resident = {}
    for mech in (INDEPENDENT, MECH):
        config = DPConfig(clip_norm=0.5, noise_multiplier=0.5, sample_rate=0.1, method="ghost", mechanism=mech)
        _, metrics, _ = sharded_run(model, batches, sgd(0.1), config, strategies.zero3(), Mesh(dp=2))
        resident[mech.kind] = [m["resident_bytes"] for m in metrics]
    numel = sum(p.numel() for p in model.parameters())
    assert sum(resident["banded"]) - sum(resident["independent"]) == (MECH.bands - 1) * 8 * numel
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    copies = len(empty_history(MECH))
    extra = [a - b for a, b in zip(*(memory_by_rank(strategies.zero3(), shapes, Mesh(dp=2), "sgd", torch.float64,
                                                    history_copies=c) for c in (copies, 0)))]
    assert [a - b for a, b in zip(resident["banded"], resident["independent"])] == extra
