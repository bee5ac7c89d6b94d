"""Freezing and unfreezing during a run (issue 14, section 2): the schedule, the update that leaves
frozen parameters alone, the GPT whose embedding is unfrozen at step k (sharded == unsharded,
resumed across the change bit for bit), and transformers' GPT-2 with its tied wte/lm_head frozen
then unfrozen. The random-model properties are in ``property_tests/test_freezing_properties.py``."""

from __future__ import annotations

import copy

import pytest
import torch

import ckpt
from fsdpx import Mesh, strategies, unshard
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import Freezing, TrainableSets, adamw, sgd, update_trainable
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.plain_step import init_plain, make_plain_step
from fsdpx.runtime.threads import run_threads
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, init_state, make_private_step, sample_batch

DP = DPConfig(clip_norm=0.5, noise_multiplier=0.9, sample_rate=0.25, accountant="rdp", method="ghost")
EXAMPLES = 16


# ---- the schedule --------------------------------------------------------------------------------


def test_freezing_schedule_holds_each_set_until_the_next_key():
    f = Freezing({3: {"b"}, 0: {"a", "b"}, 5: set()})
    assert [sorted(f.frozen_at(t)) for t in range(7)] == [["a", "b"]] * 3 + [["b"]] * 2 + [[]] * 2
    assert Freezing({2: {"a"}}).frozen_at(1) == frozenset()  # nothing frozen before the first key
    assert f == Freezing({0: ["b", "a"], 3: ["b"], 5: []}) and hash(f) == hash(Freezing({0: {"a", "b"}, 3: {"b"}, 5: ()}))
    with pytest.raises(ValueError, match="steps must be ints >= 0"):
        Freezing({-1: {"a"}})
    with pytest.raises(TypeError, match="give a set of names"):
        Freezing({0: "wte"})


def test_parse_reads_intervals():
    f = Freezing.parse("wte, wpe@0-100; lm_head@50-; h.0@-20")
    assert f.frozen_at(0) == {"wte", "wpe", "h.0"}
    assert f.frozen_at(20) == {"wte", "wpe"}
    assert f.frozen_at(50) == {"wte", "wpe", "lm_head"}
    assert f.frozen_at(100) == f.frozen_at(10**6) == {"lm_head"}
    assert Freezing.parse("wte").frozen_at(10**9) == {"wte"}  # no interval: the whole run
    assert all(not Freezing.parse("").frozen_at(t) for t in (0, 10**6))
    for bad, why in [("@0-3", "names no parameter"), ("a@5-5", "start < stop"), ("a@x-3", "ints"), ("a@5", "start < stop")]:
        with pytest.raises(ValueError, match=why):
            Freezing.parse(bad)


def test_names_resolve_to_canonical_parameters():
    names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight", "lm_head.bias"]
    aliases = {"lm_head.weight": "transformer.wte.weight", "other.weight": "not.held"}
    sets = TrainableSets(Freezing({0: {"lm_head.weight", "transformer.h"}, 2: {"transformer.wpe"}}), names, aliases)
    assert sets(0) == {"transformer.wpe.weight", "lm_head.bias"}  # the alias freezes the tied tensor
    assert sets(2) == set(names) - {"transformer.wpe.weight"}
    with pytest.raises(KeyError, match="lm_hea"):  # a prefix is a whole component of the name
        sets.resolve({"lm_hea"})
    with pytest.raises(KeyError, match=r"\['transformer.h.1', 'wte'\] match no trainable parameter"):
        TrainableSets(Freezing({0: {"wte", "transformer.h.1"}}), names, aliases)
    with pytest.raises(KeyError, match="other"):  # an alias of a parameter the step does not hold
        TrainableSets(lambda step: {"other.weight"}, names, aliases)(0)
    with pytest.raises(ValueError, match="nothing to train at step 4"):
        TrainableSets(Freezing({4: {"transformer", "lm_head"}}), names, aliases)(4)
    with pytest.raises(TypeError, match="return a set of names"):
        TrainableSets(lambda step: "lm_head", names)(0)
    with pytest.raises(TypeError, match="Freezing or a callable"):
        TrainableSets({0: {"lm_head"}}, names)


# ---- the update ----------------------------------------------------------------------------------


def _params(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in [("a", (3, 2)), ("b", (4,)), ("c", ())]}


def test_frozen_parameters_and_their_state_are_untouched():
    opt = adamw(1e-2, weight_decay=0.1)
    params = _params()
    state = opt.init(params)
    params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state, params)  # moments != 0
    new_params, new_state = update_trainable(opt.update, {"a": torch.ones(3, 2, dtype=torch.float64)}, state, params)
    for k in ("b", "c"):
        assert new_params[k] is params[k]
        assert new_state["mu"][k] is state["mu"][k] and new_state["nu"][k] is state["nu"][k]
    assert new_state["count"] == {"a": 2, "b": 1, "c": 1}
    assert not torch.equal(new_params["a"], params["a"])
    with pytest.raises(KeyError, match="not in params"):
        update_trainable(opt.update, {"z": torch.ones(1)}, state, params)
    with pytest.raises(TypeError, match="per-parameter optimizer state"):
        update_trainable(opt.update, {}, {"count": 0, "lr_scale": 1.0}, params)


@pytest.mark.parametrize("inplace", [False, True])
def test_all_trainable_equals_the_plain_update(inplace):
    opt = adamw(1e-2, weight_decay=0.05)
    update = opt.update_inplace if inplace else opt.update
    p1, p2 = _params(), _params()
    s1, s2 = opt.init(p1), opt.init(p2)
    for t in range(3):
        grads = _params(seed=t + 1)
        p1, s1 = update(grads, s1, p1)
        p2, s2 = update_trainable(update, grads, s2, p2)
    for k in p1:
        assert torch.equal(p1[k], p2[k]) and torch.equal(s1["mu"][k], s2["mu"][k]) and torch.equal(s1["nu"][k], s2["nu"][k])
    assert s2["count"] == {k: 3 for k in p1}


@pytest.mark.parametrize("make", [lambda: (adamw(1e-2, weight_decay=0.1), torch.optim.AdamW,
                                           dict(lr=1e-2, weight_decay=0.1)),
                                  lambda: (sgd(0.1, momentum=0.9), torch.optim.SGD, dict(lr=0.1, momentum=0.9))])
def test_unfrozen_parameter_starts_its_own_count(make):
    """torch.optim skips a parameter without a gradient and keeps a step count per parameter:
    ours under a schedule equals it (frozen for some steps, then unfrozen)."""
    opt, torch_cls, kwargs = make()
    params = _params()
    schedule = [{"a"}, {"a", "c"}, {"b"}, {"a", "b", "c"}, {"b", "c"}]
    leaves = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    reference = torch_cls(list(leaves.values()), foreach=False, **kwargs)
    state = opt.init(params)
    for t, names in enumerate(schedule):
        grads = {k: v for k, v in _params(seed=10 + t).items() if k in names}
        for k, leaf in leaves.items():
            leaf.grad = grads[k].clone() if k in grads else None
        reference.step()
        params, state = update_trainable(opt.update, grads, state, params)
    for k in params:
        torch.testing.assert_close(params[k], leaves[k].detach(), rtol=1e-12, atol=1e-12)
    assert state["count"] == {"a": 3, "b": 3, "c": 3}


# ---- the steps -------------------------------------------------------------------------------------


def _gpt(tie=True):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=1, n_embd=6, tie_weights=tie)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 11, (EXAMPLES, 4), generator=g), torch.randint(0, 11, (EXAMPLES, 4), generator=g)


def test_plain_step_with_a_schedule_equals_stepping_the_trainable_subset():
    """The user's torch way: requires_grad toggled per step, torch.optim.AdamW over every
    parameter (a parameter without a gradient is skipped). Same parameters."""
    model = _gpt(tie=False)
    schedule = Freezing({0: {"wte", "wpe", "blocks.0"}, 2: {"lm_head"}, 3: set()})
    data = _data()
    opt = adamw(1e-2, weight_decay=0.05)
    state, step = init_plain(dict(model.named_parameters()), opt), make_plain_step(model, token_loss, opt,
                                                                                    trainable=schedule)
    torch_model = copy.deepcopy(model)
    reference = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    sets = TrainableSets(schedule, [n for n, _ in model.named_parameters()])
    for t in range(4):
        batch = (data[0][4 * t:4 * t + 4], data[1][4 * t:4 * t + 4])
        state, _ = step(state, batch)
        for n, p in torch_model.named_parameters():
            p.requires_grad_(n in sets(t))
        reference.zero_grad(set_to_none=True)
        token_loss(torch_model(batch[0]), batch[1]).mean().backward()
        reference.step()
    for n, p in torch_model.named_parameters():
        torch.testing.assert_close(state.params[n], p.detach(), rtol=1e-10, atol=1e-12)


def _private_run(model, schedule, steps, state=None):
    data, sampler = _data(), PoissonSampler(EXAMPLES, DP.sample_rate, key=3)
    opt = adamw(1e-2, eps=1e-5, weight_decay=0.05)
    step = make_private_step(model, token_loss, opt, DP, num_examples=EXAMPLES, trainable=schedule)
    state = state or init_state(dict(model.named_parameters()), opt, key=5, config=DP)
    for _ in range(steps):
        state, _ = step(state, sample_batch(data, sampler, state.step))
    return state


def _sharded_run(model, schedule, steps, mesh, strategy, states=None):
    data, sampler = _data(), PoissonSampler(EXAMPLES, DP.sample_rate, key=3)
    opt = adamw(1e-2, eps=1e-5, weight_decay=0.05)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), token_loss, opt, strategy, comm, param_shapes=shapes, config=DP,
                                 num_examples=EXAMPLES, trainable=schedule)
        state = states[comm.rank] if states else init_sharded(params, opt, strategy, comm, key=5, config=DP)
        for _ in range(steps):
            state, _ = step(state, sample_batch(data, sampler, state.step))
        return state

    return run_threads(mesh, rank)


def _full(states, mesh, strategy):
    return {k: unshard([s.params[k] for s in states], strategy.param_at_rest(v.dim()), mesh)
            for k, v in states[0].params.items()}


K = 3  # the embedding is unfrozen at step K
UNFREEZE = Freezing({0: {"wte", "wpe"}, K: set()})


@pytest.mark.parametrize("strategy,mesh", [(strategies.zero3(), Mesh(dp=2)), (strategies.hsdp(), Mesh(replica=2, shard=2))])
def test_unfreezing_the_gpt_embedding_at_step_k_sharded_equals_unsharded(strategy, mesh):
    model = _gpt()
    ref = _private_run(model, UNFREEZE, 5)
    before = _private_run(model, UNFREEZE, K)
    start = dict(model.named_parameters())
    for n in ("wte.weight", "wpe.weight"):
        assert torch.equal(before.params[n], start[n].detach()), n  # frozen until K: its value at step 0
        assert before.opt_state["count"][n] == 0 and not before.opt_state["mu"][n].any()
        assert not torch.equal(ref.params[n], start[n].detach()), n  # trained after K
    got = _full(_sharded_run(model, UNFREEZE, 5, mesh, strategy), mesh, strategy)
    moved = max(float((ref.params[k] - start[k].detach()).abs().max()) for k in ref.params)
    for k in ref.params:
        assert float((got[k] - ref.params[k]).abs().max()) <= 1e-10 * max(moved, float(ref.params[k].abs().max())), k
    # the accountant does not see the schedule: one event of the same sigma and q per step
    assert ref.accountant == _private_run(_gpt(), None, 5).accountant


def test_a_run_resumed_across_the_change_equals_the_uninterrupted_run(tmp_path):
    """Saved at step K-1 (before the unfreeze), loaded, stepped across it: bit for bit the
    straight run, unsharded through ckpt.save/load and sharded (zero3, 2 ranks) through
    save_ranks/load_ranks. A checkpoint after the change resumes the same way."""
    model = _gpt()
    straight = _private_run(model, UNFREEZE, 5)
    for at in (K - 1, K + 1):
        ckpt.save(tmp_path / f"u{at}", _private_run(model, UNFREEZE, at), mesh=Mesh(), strategy=None, private=True)
        resumed = _private_run(model, UNFREEZE, 5 - at, ckpt.load(tmp_path / f"u{at}", mesh=Mesh(), strategy=None))
        for k in straight.params:
            assert torch.equal(resumed.params[k], straight.params[k]), (at, k)
            assert torch.equal(resumed.opt_state["mu"][k], straight.opt_state["mu"][k]), (at, k)
        assert resumed.opt_state["count"] == straight.opt_state["count"] and resumed.accountant == straight.accountant

    mesh, strategy = Mesh(dp=2), strategies.zero3()
    whole = _sharded_run(model, UNFREEZE, 5, mesh, strategy)
    ckpt.save_ranks(tmp_path / "s", _sharded_run(model, UNFREEZE, K - 1, mesh, strategy), mesh=mesh,
                    strategy=strategy, private=True)
    resumed = _sharded_run(model, UNFREEZE, 5 - (K - 1), mesh, strategy,
                           ckpt.load_ranks(tmp_path / "s", mesh=mesh, strategy=strategy, private=True))
    for r in range(mesh.size):
        for k in whole[r].params:
            assert torch.equal(resumed[r].params[k], whole[r].params[k]), (r, k)
        assert resumed[r].opt_state["count"] == whole[r].opt_state["count"]


def test_a_freezing_that_names_no_parameter_is_refused_before_any_step():
    model = _gpt()
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    with pytest.raises(KeyError, match="wtee"):
        run_threads(Mesh(dp=1), lambda comm: make_sharded_step(model, token_loss, sgd(0.1), strategies.ddp(), comm,
                                                               param_shapes=shapes, trainable=Freezing({0: {"wtee"}})))


def test_hf_gpt2_tied_embedding_frozen_then_unfrozen():
    """transformers' GPT-2, unmodified: its tied wte/lm_head frozen (named by the lm_head alias)
    with wpe for two steps, then trained; private ZeRO-3 on 2 ranks == the unsharded run."""
    pytest.importorskip("transformers")
    from support.hf import VOCAB, gpt2, lm_loss

    model = gpt2()
    schedule = Freezing({0: {"lm_head", "transformer.wpe"}, 2: set()})
    g = torch.Generator().manual_seed(4)
    batches = [(ids, ids.clone()) for ids in torch.randint(1, VOCAB, (3, 4, 8), generator=g)]
    opt = adamw(1e-2, eps=1e-5, weight_decay=0.05)
    params = {k: v.detach() for k, v in model.named_parameters()}
    step = make_private_step(model, lm_loss, opt, DP, num_examples=EXAMPLES, trainable=schedule)
    ref = init_state(params, opt, key=5, config=DP)
    for t, b in enumerate(batches):
        ref, _ = step(ref, b)
        if t < 2:
            assert torch.equal(ref.params["transformer.wte.weight"], params["transformer.wte.weight"])
    assert not torch.equal(ref.params["transformer.wte.weight"], params["transformer.wte.weight"])
    mesh, strategy = Mesh(dp=2), strategies.zero3()
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        s = make_sharded_step(copy.deepcopy(model), lm_loss, opt, strategy, comm, param_shapes=shapes, config=DP,
                              num_examples=EXAMPLES, trainable=schedule)
        state = init_sharded(params, opt, strategy, comm, key=5, config=DP)
        for b in batches:
            state, _ = s(state, b)
        return state

    got = _full(run_threads(mesh, rank), mesh, strategy)
    moved = max(float((ref.params[k] - params[k]).abs().max()) for k in params)
    for k in params:
        assert float((got[k] - ref.params[k]).abs().max()) <= 1e-10 * max(moved, float(ref.params[k].abs().max())), k
