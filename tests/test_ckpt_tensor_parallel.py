"""Checkpoints of tensor-parallel states: any saved (dp, tp) layout loads into any other, every
tensor equal, through the ordinary ``ckpt`` API; the manifest records the plan."""

import copy

import pytest
import torch

import ckpt
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.optim import adamw
from fsdpx.runtime import init_sharded, make_sharded_step, run_threads
from fsdpx.sharding import Mesh, strategies, unshard
from fsdpx.sharding.tensor_parallel import resolve

CONFIG = GPTConfig(vocab_size=37, block_size=6, n_layer=2, n_head=4, n_embd=8, tie_weights=True)
OPT = adamw(1e-2)


def _model():
    torch.manual_seed(3)
    return GPT(CONFIG).double()


def _layout(tp_plan, strategy, mesh):
    return resolve(_model(), tp_plan, strategy, mesh) if tp_plan else strategy.resolve(
        {n: tuple(p.shape) for n, p in _model().named_parameters()})


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
    for n, lay in plan.params.items():
        out[f"params/{n}"] = unshard([s.params[n] for s in states], lay.at_rest, mesh).reshape(shapes[n])
        for slot in ("mu", "nu"):
            out[f"{slot}/{n}"] = unshard([s.opt_state[slot][n] for s in states], lay.opt_state, mesh).reshape(shapes[n])
    return out


TARGETS = {
    "tp=4": (gpt_plan(CONFIG), strategies.zero3(), Mesh(dp=1, tp=4)),
    "dp=4 zero3": (None, strategies.zero3(), Mesh(dp=4)),
    "dp=2 x tp=2 zero2": (gpt_plan(CONFIG), strategies.zero2(), Mesh(dp=2, tp=2)),
    "hsdp x tp": (gpt_plan(CONFIG), strategies.hsdp(), Mesh(replica=1, shard=2, tp=2)),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_dp2_tp2_checkpoint_loads_into_other_layouts_with_every_tensor_equal(tmp_path, target):
    mesh = Mesh(dp=2, tp=2)
    plan = resolve(_model(), gpt_plan(CONFIG), strategies.zero3(), mesh)
    states = _trained_states(plan, mesh)
    path = ckpt.save_ranks(tmp_path / "step_1", states, mesh=mesh, strategy=plan)
    want = _globals(states, plan, mesh)

    manifest = ckpt.read_manifest(path)
    assert manifest.plan["tp_axis"] == "tp" and manifest.plan["name"] == "zero3+tp"
    qkv = manifest.tensors["params/blocks.0.attn.qkv.weight"]
    assert qkv.shape == (3, 8, 8) and qkv.param_shape == (24, 8)  # q|k|v split by heads, a view

    tp_plan, strategy, tmesh = TARGETS[target]
    tplan = _layout(tp_plan, strategy, tmesh)
    loaded = ckpt.load_ranks(path, mesh=tmesh, strategy=tplan)
    got = _globals(loaded, tplan, tmesh)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_dp2_tp2_checkpoint_loads_unsharded_in_the_parameters_own_shapes(tmp_path):
    mesh = Mesh(dp=2, tp=2)
    plan = resolve(_model(), gpt_plan(CONFIG), strategies.zero3(), mesh)
    states = _trained_states(plan, mesh)
    path = ckpt.save_ranks(tmp_path / "step_1", states, mesh=mesh, strategy=plan)
    want = _globals(states, plan, mesh)
    shapes = {f"params/{n}": tuple(p.shape) for n, p in _model().named_parameters()}
    (whole,) = ckpt.load_ranks(path, mesh=Mesh(), strategy=None, expected_shapes=shapes)
    for n, p in whole.params.items():
        assert torch.equal(p, want[f"params/{n}"]), n  # [24, 8], not the stored view [3, 8, 8]


def test_an_unsharded_checkpoint_loads_into_tensor_parallel_layouts(tmp_path):
    mesh = Mesh(dp=2, tp=2)
    plan = resolve(_model(), gpt_plan(CONFIG), strategies.zero3(), mesh)
    states = _trained_states(plan, mesh)
    want = _globals(states, plan, mesh)
    whole = _trained_states(strategies.ddp().resolve({n: tuple(p.shape) for n, p in _model().named_parameters()}),
                            Mesh(dp=1))
    path = ckpt.save_ranks(tmp_path / "step_1", whole, mesh=Mesh(dp=1), strategy=strategies.ddp())
    tmesh = Mesh(dp=1, tp=4)
    tplan = resolve(_model(), gpt_plan(CONFIG), strategies.zero3(), tmesh)
    got = _globals(ckpt.load_ranks(path, mesh=tmesh, strategy=tplan), tplan, tmesh)
    for k in want:  # the unsharded run's step equals the sharded one to rounding
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
