"""Checkpoints of pipelined states: a run saved at dp=2 x tp=2 x pp=2 loads at pp=1, dp=4, tp=4 or
unsharded and vice versa, every tensor equal (stage assignment never changes a tensor's global
name or shape); each rank holds, and reads, only its stages' tensors."""

import copy

import pytest
import torch

import ckpt
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.optim import adamw
from fsdpx.runtime import init_sharded, make_sharded_step, run_threads
from fsdpx.sharding import Mesh, strategies
from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline, unshard_stages
from fsdpx.sharding.tensor_parallel import resolve

CONFIG = GPTConfig(vocab_size=37, block_size=6, n_layer=4, n_head=4, n_embd=8, tie_weights=True)
OPT = adamw(1e-2)


def _model():
    torch.manual_seed(3)
    return GPT(CONFIG).double()


def _plan(mesh, strategy=strategies.zero3(), tp=False, pp=False):
    model = _model()
    plan = resolve(model, gpt_plan(CONFIG) if tp else None, strategy, mesh)
    return resolve_pipeline(model, plan, PipelineParallel(schedule="1f1b", microbatches=2), mesh) if pp else plan


def _trained_states(plan, mesh):
    model = _model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    batch = (torch.randint(0, 37, (4, 6)), torch.randint(0, 37, (4, 6)))

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), token_loss, OPT, plan, comm, param_shapes=shapes)
        state, _ = step(init_sharded(params, OPT, plan, comm, key=1), batch)
        return state

    return run_threads(mesh, rank)


def _globals(states, plan, mesh):
    """Every parameter and AdamW moment, unsharded and in the parameter's own shape."""
    shapes = {n: tuple(p.shape) for n, p in _model().named_parameters()}
    out = {}
    for key, pick, layout in (("params", lambda s: s.params, "at_rest"), ("mu", lambda s: s.opt_state["mu"], "opt_state"),
                              ("nu", lambda s: s.opt_state["nu"], "opt_state")):
        for n, t in unshard_stages([pick(s) for s in states], plan, mesh, layout=layout).items():
            out[f"{key}/{n}"] = t.reshape(shapes[n])
    return out


TARGETS = {
    "dp=2 x tp=2 x pp=2": (Mesh(dp=2, tp=2, pp=2), dict(tp=True, pp=True)),
    "pp=4": (Mesh(dp=1, pp=4), dict(pp=True)),
    "dp=4 zero3": (Mesh(dp=4), dict()),
    "tp=4": (Mesh(dp=1, tp=4), dict(tp=True)),
    "dp=2 x pp=2 zero2": (Mesh(dp=2, pp=2), dict(pp=True)),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_dp2_tp2_pp2_checkpoint_loads_into_other_layouts_with_every_tensor_equal(tmp_path, target):
    mesh = Mesh(dp=2, tp=2, pp=2)
    plan = _plan(mesh, tp=True, pp=True)
    states = _trained_states(plan, mesh)
    path = ckpt.save_ranks(tmp_path / "step_1", states, mesh=mesh, strategy=plan)
    want = _globals(states, plan, mesh)
    manifest = ckpt.read_manifest(path)
    assert manifest.plan["pipeline"]["holders"]["wte.weight"] == [0, 1]  # the tied embedding and head
    tmesh, kw = TARGETS[target]
    tplan = _plan(tmesh, strategy=strategies.zero2() if "zero2" in target else strategies.zero3(), **kw)
    loaded = ckpt.load_ranks(path, mesh=tmesh, strategy=tplan)
    if tplan.pipeline is not None:  # each rank holds only its stages' parameters
        assert "wpe.weight" in loaded[0].params and "wpe.weight" not in loaded[-1].params
    got = _globals(loaded, tplan, tmesh)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_an_unsharded_checkpoint_loads_into_a_pipeline_each_rank_taking_its_stages(tmp_path):
    """Parameters saved with no sharding, loaded at dp=2 x pp=2: each rank gets exactly the
    parameters of its stages, each equal bit for bit to what the pipelined run holds."""
    mesh = Mesh(dp=2, pp=2)
    plan = _plan(mesh, pp=True)
    states = _trained_states(plan, mesh)
    whole = {k: t for k, t in _globals(states, plan, mesh).items()}
    single = {"params": {n[len("params/"):]: t for n, t in whole.items() if n.startswith("params/")}}
    path = ckpt.save_ranks(tmp_path / "whole", [single], mesh=Mesh(), strategy=None)
    loaded = ckpt.load_ranks(path, mesh=mesh, strategy=plan)
    for r, state in enumerate(loaded):
        assert set(state["params"]) == set(states[r].params)
        for n, t in state["params"].items():
            assert torch.equal(t, states[r].params[n]), (r, n)


def test_ranks_that_disagree_on_non_tensor_state_are_still_refused(tmp_path):
    mesh = Mesh(dp=1, pp=2)
    plan = _plan(mesh, strategy=strategies.ddp(), pp=True)
    states = _trained_states(plan, mesh)
    bad = [states[0], states[1]._replace(step=states[1].step + 1)]
    with pytest.raises(ckpt.SaveError, match="non-tensor state differs"):
        ckpt.save_ranks(tmp_path / "bad", bad, mesh=mesh, strategy=plan)
