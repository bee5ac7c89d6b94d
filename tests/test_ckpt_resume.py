"""Bitwise resume: N steps straight == k steps, save (sharded), load into another mesh size and
strategy, N-k steps. Private (epsilon too) and offloaded (ZenFlow, in-flight window included)."""

import copy

import pytest
import torch

import ckpt
import offload
from fsdpx import Mesh, shard, strategies, unshard
from fsdpx.runtime.threads import run_threads
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import adamw
from fsdpx.runtime import ShardedState, init_sharded, make_sharded_step
from privacy.accounting import Accountant
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, TrainState, init_state, make_private_step, sample_batch

N, K, EXAMPLES = 6, 3, 16
CONFIG = GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=6)
DP = DPConfig(clip_norm=1.0, noise_multiplier=1.1, sample_rate=0.25, accountant="rdp")


def _run(optimizer):
    torch.manual_seed(0)
    model = GPT(CONFIG).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    data = (torch.randint(0, 11, (EXAMPLES, 4)), torch.randint(0, 11, (EXAMPLES, 4)))
    sampler = PoissonSampler(EXAMPLES, DP.sample_rate, key=3)
    step = make_private_step(model, token_loss, optimizer, DP, num_examples=EXAMPLES)

    def train(state, steps):
        for _ in range(steps):
            state, _ = step(state, sample_batch(data, sampler, state.step))
        return state

    return model, init_state(params, optimizer, key=5, config=DP), train


def _shard_state(state, mesh, strategy):
    rule = ckpt.strategy_rule(strategy)
    tree, tensors = ckpt.flatten(state)
    pieces = {p: shard(t, rule(p, t.dim()), mesh) for p, t in tensors.items()}
    return [ckpt.unflatten(tree, lambda p, r=r: pieces[p][r]) for r in range(mesh.size)]


def _unshard_state(locals_, mesh, strategy):
    rule = ckpt.strategy_rule(strategy)
    flat = [ckpt.flatten(s) for s in locals_]
    return ckpt.unflatten(flat[0][0], lambda p: unshard([f[1][p] for f in flat], rule(p, flat[0][1][p].dim()), mesh))


def _assert_bitwise(a: TrainState, b: TrainState):
    assert a.params.keys() == b.params.keys()
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k
    assert a.step == b.step and a.accountant == b.accountant
    assert a.accountant.epsilon() == b.accountant.epsilon()


@pytest.mark.parametrize("target", [(Mesh(dp=2), strategies.zero2()), (Mesh(dp=1), None), (Mesh(dp=4), strategies.zero3())])
def test_private_resume_is_bitwise_across_mesh_and_strategy(tmp_path, target):
    _, state0, train = _run(adamw(1e-2))
    straight = train(state0, N)

    src_mesh, src = Mesh(dp=3), strategies.zero3()
    at_k = train(state0, K)
    ckpt.save_ranks(tmp_path / f"step_{K}", _shard_state(at_k, src_mesh, src), mesh=src_mesh, strategy=src,
                    private=True, step=K)
    del at_k  # nothing but the files carries over

    mesh, strategy = target
    locals_ = ckpt.load_ranks(tmp_path / f"step_{K}", mesh=mesh, strategy=strategy, private=True)
    assert all(isinstance(s, TrainState) for s in locals_)
    resumed = train(_unshard_state(locals_, mesh, strategy), N - K)
    _assert_bitwise(resumed, straight)
    assert resumed.accountant.steps == N and resumed.accountant.epsilon() > 0


def test_offloaded_resume_is_bitwise_with_the_host_window_in_flight(tmp_path):
    def zf():
        return offload.zenflow(adamw(1e-2), topk_ratio=0.5, select_interval=2, update_interval=2, delay=1, overlap=True)

    _, state0, train = _run(zf())
    straight = train(state0, N)
    _, state0, train = _run(zf())
    at_k = train(state0, K)
    assert at_k.opt_state["pending"] is not None  # a host window is in flight at the save
    with pytest.raises(ckpt.UnsupportedStateError, match="opt_state/pending/result.*materialize"):
        ckpt.save(tmp_path / "bad", at_k, mesh=Mesh(), strategy=None)
    at_k = at_k._replace(opt_state=offload.materialize(at_k.opt_state))
    manager = ckpt.CheckpointManager(tmp_path / "run", private=True)
    manager.save(K, at_k, blocking=False)
    manager.wait()
    resumed = train(manager.restore(), N - K)
    _assert_bitwise(resumed, straight)
    for k, v in offload.master_params(resumed.opt_state).items():
        assert torch.equal(v, offload.master_params(straight.opt_state)[k]), k


def test_refuses_private_resume_without_accountant(tmp_path):
    _, state0, train = _run(adamw(1e-2))
    at_k = train(state0, 1)
    ckpt.save(tmp_path / "no_ledger", {"params": at_k.params, "step": at_k.step}, mesh=Mesh(), strategy=None)
    with pytest.raises(ckpt.MissingAccountantError, match="no Accountant"):
        ckpt.load(tmp_path / "no_ledger", mesh=Mesh(), strategy=None, private=True)
    wrong = at_k._replace(accountant=Accountant(delta=1e-5, accountant="rdp"))  # a fresh ledger at step 1
    ckpt.save(tmp_path / "fresh_ledger", wrong, mesh=Mesh(), strategy=None, private=True)
    with pytest.raises(ckpt.MissingAccountantError, match="records 0 steps but the state is at step 1"):
        ckpt.load(tmp_path / "fresh_ledger", mesh=Mesh(), strategy=None)  # the manifest says private


def test_refuses_a_model_with_other_shapes(tmp_path):
    model, state0, _ = _run(adamw(1e-2))
    ckpt.save(tmp_path / "s", state0, mesh=Mesh(), strategy=None)
    shapes = {f"params/{k}": tuple(v.shape) for k, v in model.named_parameters()}
    ckpt.load(tmp_path / "s", mesh=Mesh(), strategy=None, expected_shapes=shapes)
    wider = {f"params/{k}": tuple(v.shape) for k, v in GPT(GPTConfig(11, 4, 1, 1, 8)).named_parameters()}
    with pytest.raises(ckpt.ShapeMismatchError, match=r"params/wte.weight: expected shape \(11, 8\).*\(11, 6\)"):
        ckpt.load(tmp_path / "s", mesh=Mesh(), strategy=None, expected_shapes=wider)
    fewer = {k: v for k, v in shapes.items() if k != "params/ln_f.bias"}
    with pytest.raises(ckpt.ShapeMismatchError, match="params/ln_f.bias: the checkpoint has this tensor, the model does not"):
        ckpt.load(tmp_path / "s", mesh=Mesh(), strategy=None, expected_shapes=fewer)


def test_sharded_runtime_resumes_bitwise_from_its_own_checkpoint(tmp_path):
    """The threaded sharded runtime (``fsdpx.runtime``), private, zero3 on 3 ranks: k steps, each
    rank saves its ``ShardedState``, the ranks load it back (same mesh: bit for bit the straight
    run; 2 ranks zero2: bit for bit the same state resharded in memory), N-k more steps."""
    torch.manual_seed(0)
    model = GPT(CONFIG).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    data = (torch.randint(0, 11, (EXAMPLES, 4)), torch.randint(0, 11, (EXAMPLES, 4)))
    sampler = PoissonSampler(EXAMPLES, DP.sample_rate, key=3)

    def train(mesh, strategy, states, steps):
        def rank(comm):
            step = make_sharded_step(copy.deepcopy(model), token_loss, adamw(1e-2), strategy, comm, param_shapes=shapes,
                                     config=DP, num_examples=EXAMPLES)
            state = states[comm.rank] if states else init_sharded(params, adamw(1e-2), strategy, comm, key=5, config=DP)
            for _ in range(steps):
                state, _ = step(state, sample_batch(data, sampler, state.step))
            return state
        return run_threads(mesh, rank)

    src_mesh, src = Mesh(dp=3), strategies.zero3()
    straight = train(src_mesh, src, None, N)
    at_k = train(src_mesh, src, None, K)
    ckpt.save_ranks(tmp_path / "step_3", at_k, mesh=src_mesh, strategy=src, private=True)
    loaded = ckpt.load_ranks(tmp_path / "step_3", mesh=src_mesh, strategy=src, private=True)
    assert all(isinstance(s, ShardedState) for s in loaded)
    resumed = train(src_mesh, src, loaded, N - K)
    for r in range(3):
        for k in params:
            assert torch.equal(resumed[r].params[k], straight[r].params[k]), (r, k)
        assert resumed[r].accountant.epsilon() == straight[r].accountant.epsilon()

    dst_mesh, dst = Mesh(dp=2), strategies.zero2()
    from_disk = ckpt.load_ranks(tmp_path / "step_3", mesh=dst_mesh, strategy=dst)
    in_memory = _shard_state(_unshard_state(at_k, src_mesh, src), dst_mesh, dst)
    a, b = train(dst_mesh, dst, from_disk, N - K), train(dst_mesh, dst, in_memory, N - K)
    for r in range(2):
        for k in params:
            assert torch.equal(a[r].params[k], b[r].params[k]), (r, k)
