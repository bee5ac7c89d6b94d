"""The runtime side of tensor parallelism: region boundaries and the vocab-parallel loss, on
the simulated mesh against the unsharded computation."""

import pytest
import torch
import torch.nn.functional as F

from fsdpx.runtime.regions import enter, leave
from fsdpx.runtime.threads import run_threads
from fsdpx.runtime.vocab_parallel import VocabParallelError, VocabShard, mark_vocab_sharded
from fsdpx.sharding import Mesh
from fsdpx.sharding.layout import chunk_bounds


def _shards(tp: int, vocab: int):
    return [chunk_bounds(vocab, tp, i) for i in range(tp)]


@pytest.mark.parametrize("tp, vocab", [(1, 7), (2, 7), (3, 11), (4, 5)])  # uneven; (4, 5) leaves rank 3 empty
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_vocab_parallel_cross_entropy_equals_cross_entropy_on_gathered_logits(tp, vocab, reduction):
    gen = torch.Generator().manual_seed(tp * 100 + vocab)
    logits = torch.randn(3, 4, vocab, dtype=torch.float64, generator=gen) * 3
    target = torch.randint(0, vocab, (3, 4), generator=gen)
    target[0, 1] = -100  # ignored
    weights = torch.randn(12, dtype=torch.float64, generator=gen)  # an arbitrary downstream gradient
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.reshape(12, vocab), target.reshape(12), reduction=reduction)
    (ref * weights).sum().backward() if reduction == "none" else ref.backward()

    def rank(comm):
        start, stop = _shards(tp, vocab)[comm.rank]
        mine = logits[..., start:stop].clone().requires_grad_(True)
        marked = mark_vocab_sharded(mine, VocabShard(comm, "tp", start, stop, vocab))
        B, T, V = marked.shape  # the user's loss, unmodified: a reshape and F.cross_entropy
        loss = F.cross_entropy(marked.reshape(B * T, V), target.reshape(B * T), reduction=reduction)
        (loss * weights).sum().backward() if reduction == "none" else loss.backward()
        return loss.detach(), mine.grad

    out = run_threads(Mesh(tp=tp), rank)
    for loss, _ in out:
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    got_grad = torch.cat([g for _, g in out], dim=-1)
    torch.testing.assert_close(got_grad, full.grad, rtol=1e-12, atol=1e-12)


def test_vocab_sharded_logits_refuse_operations_that_mix_the_vocabulary():
    def rank(comm):
        z = mark_vocab_sharded(torch.randn(2, 3), VocabShard(comm, "tp", 3 * comm.rank, 3 * comm.rank + 3, 6))
        assert z.reshape(1, 2, 3).shape == (1, 2, 3)  # the vocabulary dim stays whole and last
        with pytest.raises(VocabParallelError):
            z.reshape(3, 2)  # would fold the vocabulary into another dim
        for op in (lambda t: t.softmax(-1), lambda t: t.argmax(-1), lambda t: t.t(), lambda t: t.sum()):
            with pytest.raises(VocabParallelError, match="vocabulary-sharded logits"):
                op(z)
        assert z.float().contiguous()[1:].shape == (1, 3)  # leading-dim indexing and casts are fine
        return True

    assert all(run_threads(Mesh(tp=2), rank))


@pytest.mark.parametrize("tp, vocab", [(2, 7), (3, 11)])
def test_elementwise_scalar_ops_keep_logits_vocab_sharded(tp, vocab):
    """Gemma-2's soft-capping (``z / c``, ``tanh``, ``* c``, in place too), Granite's ``z / s``
    and a scale constant along the vocabulary (``[..., 1]``) act on each vocabulary entry alone:
    on the slices they give the slices of the whole, and the loss and gradient equal those of
    ``F.cross_entropy`` on the whole, to 1e-12. A vocabulary-sized operand is still refused."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 4, vocab, dtype=torch.float64, generator=gen) * 3
    target = torch.randint(0, vocab, (3, 4), generator=gen)
    scale = torch.rand(3, 4, 1, dtype=torch.float64, generator=gen) + 0.5

    def transform(z):
        z = z / 2.5
        z = torch.tanh(z)
        z = z * 2.5
        z.mul_(1.5)
        return (0.5 - z) * scale + 1.0

    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(transform(full).reshape(12, vocab), target.reshape(12))
    ref.backward()

    def rank(comm):
        start, stop = _shards(tp, vocab)[comm.rank]
        mine = logits[..., start:stop].clone().requires_grad_(True)
        z = transform(mark_vocab_sharded(mine, VocabShard(comm, "tp", start, stop, vocab)))
        with pytest.raises(VocabParallelError):
            z + torch.ones(stop - start, dtype=torch.float64)  # a per-entry bias: not constant along the vocabulary
        loss = F.cross_entropy(z.reshape(12, stop - start), target.reshape(12))
        loss.backward()
        return loss.detach(), mine.grad

    out = run_threads(Mesh(tp=tp), rank)
    for loss, _ in out:
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([g for _, g in out], dim=-1), full.grad, rtol=1e-12, atol=1e-12)


def test_region_boundaries_are_exact_and_move_the_planned_bytes():
    """enter: identity forward, all-reduce of the input gradient backward; leave: the reverse.
    y = leave(enter(x) * w_r) sums the ranks' products; its gradient is checked against
    autograd on the unsharded product."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=gen)
    w = torch.randn(6, dtype=torch.float64, generator=gen)
    g = torch.randn(2, 5, 6, dtype=torch.float64, generator=gen)
    xf = x.clone().requires_grad_(True)
    ((xf * w) * g).sum().backward()

    def rank(comm):
        k, i = comm.mesh.size, comm.rank
        w_r = torch.zeros_like(w)
        a, b = chunk_bounds(6, k, i)
        w_r[a:b] = w[a:b]  # each rank multiplies by its slice of w: the sum over ranks is x * w
        xl = x.clone().requires_grad_(True)
        before = comm.counts().get("all_reduce", 0)
        y = leave(enter(xl, comm, "tp") * w_r, comm, "tp")
        forward_bytes = comm.counts().get("all_reduce", 0) - before
        (y * g).sum().backward()
        backward_bytes = comm.counts().get("all_reduce", 0) - before - forward_bytes
        return y.detach(), xl.grad, forward_bytes, backward_bytes

    for y, grad, fwd, bwd in run_threads(Mesh(tp=3), rank):
        torch.testing.assert_close(y, x * w, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(grad, xf.grad, rtol=1e-14, atol=1e-14)
        assert fwd == bwd == x.numel() * 8  # one all-reduce of the activation each way


@pytest.mark.parametrize("n_layer, tp, dp, batch", [(1, 2, 1, 3), (2, 2, 2, 5), (3, 4, 1, 2)])
def test_activation_bytes_follow_the_megatron_formula(n_layer, tp, dp, batch):
    """Per block 2 all-reduces of B T C forward and 2 backward, one more each way for the
    embedding and the LM head, and the loss's all-gather of 2 B T values per rank (B: rank 0's
    share), exactly as ``activation_collectives`` reads them off the model."""
    from fsdpx.models.gpt import GPT, GPTConfig, token_loss
    from fsdpx.models.tp_plans import gpt_plan
    from fsdpx.runtime.activation_cost import activation_collectives
    from fsdpx.sharding import cost, strategies
    from fsdpx.sharding.tensor_parallel import resolve

    C, T, V, s = 8, 6, 13, 4
    config = GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=4, n_embd=C)
    model, mesh = GPT(config), Mesh(dp=dp, tp=tp)
    plan = resolve(model, gpt_plan(config), strategies.zero3(), mesh)
    b = -(-batch // dp)
    got = cost(activation_collectives(model, plan, mesh, token_loss, (batch, T), (batch, T)))
    assert got["all_reduce"] == (4 * n_layer + 2) * b * T * C * s
    assert got["all_gather"] == tp * 2 * b * T * s
    private = cost(activation_collectives(model, plan, mesh, token_loss, (batch, T), (batch, T), private=True))
    assert private["all_reduce"] - got["all_reduce"] == b * s  # the squared norms, once


class _LargestTensor:
    """Records the element count of the largest tensor any operation creates (this thread)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        probe = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        probe.largest = max(probe.largest, t.numel())
                return out

        self.largest, self.mode = 0, Mode()


@pytest.mark.parametrize("private", [False, True])
def test_no_rank_allocates_the_full_logits(private):
    """With the vocabulary split over tp=2 no rank creates a tensor of B T V elements, forward,
    loss or backward (private: tape, norms, clipped sums); the unsharded step does."""
    import copy

    from fsdpx.models.gpt import GPT, GPTConfig, token_loss
    from fsdpx.models.tp_plans import gpt_plan
    from fsdpx.optim import sgd
    from fsdpx.runtime import init_sharded, make_sharded_step
    from fsdpx.runtime.plain_step import init_plain, make_plain_step
    from fsdpx.sharding import strategies
    from fsdpx.sharding.tensor_parallel import resolve
    from privacy.step import DPConfig, init_state, make_private_step

    B, T, V = 4, 8, 512
    config = GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2, n_embd=16, tie_weights=False)
    model = GPT(config)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = (torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T)))
    dp = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.1, method="ghost") if private else None
    opt = sgd(0.1)

    probe = _LargestTensor()
    if private:
        state, step = init_state(params, opt, key=0, config=dp), make_private_step(model, token_loss, opt, dp,
                                                                                   num_examples=40)
    else:
        state, step = init_plain(params, opt), make_plain_step(model, token_loss, opt)
    with probe.mode:
        step(state, batch)
    assert probe.largest >= B * T * V  # the unsharded step holds the full logits: the probe sees them

    mesh = Mesh(dp=1, tp=2)
    plan = resolve(model, gpt_plan(config), strategies.ddp(), mesh)
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        run = make_sharded_step(copy.deepcopy(model), token_loss, opt, plan, comm, param_shapes=shapes, config=dp,
                                num_examples=40)
        s = init_sharded(params, opt, plan, comm, key=0, config=dp)
        p = _LargestTensor()
        with p.mode:
            run(s, batch)
        return p.largest

    for largest in run_threads(mesh, rank):
        assert largest <= B * T * V // 2  # the rank's own slice of the logits at most


@pytest.mark.parametrize("n_layer, tp, batch", [(1, 2, 3), (2, 4, 2)])
def test_sequence_parallel_moves_the_same_activation_bytes_as_reduce_scatters_and_all_gathers(n_layer, tp, batch):
    """Sequence parallelism: each all-reduce of B T C becomes a reduce-scatter and an all-gather
    of the same buffer, (4L + 2) of each; the row-parallel biases' gradients (added to each
    rank's chunk) are all-reduced, C values per bias."""
    from fsdpx.models.gpt import GPT, GPTConfig, token_loss
    from fsdpx.models.tp_plans import gpt_plan
    from fsdpx.runtime.activation_cost import activation_collectives
    from fsdpx.sharding import cost, strategies
    from fsdpx.sharding.tensor_parallel import resolve

    C, T, V, s = 8, 8, 13, 4
    config = GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=4, n_embd=C, bias=True)
    model, mesh = GPT(config), Mesh(dp=1, tp=tp)
    plan = resolve(model, gpt_plan(config, sequence_parallel=True), strategies.zero3(), mesh)
    got = cost(activation_collectives(model, plan, mesh, token_loss, (batch, T), (batch, T)))
    assert got["reduce_scatter"] == (4 * n_layer + 2) * batch * T * C * s
    assert got["all_gather"] == (4 * n_layer + 2) * batch * T * C * s + tp * 2 * batch * T * s  # + the loss's
    assert got["all_reduce"] == 2 * n_layer * C * s
