"""Pipeline parallelism: the stage table, bad input, transformers' models unmodified, a dead rank.

Exactness over random models, schedules and meshes is ``property_tests/test_pipeline_properties.py``;
here: what ``resolve_pipeline`` builds and refuses, and the runtime on what users bring.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.models.tp_plans import gpt2_plan, llama_plan
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.threads import run_threads
from fsdpx.sharding import Mesh, RankFailure, strategies
from fsdpx.sharding.pipeline import (PipelineParallel, PipelinePlanError, balanced_split, microbatch_bounds,
                                     rank_plan, resolve_pipeline)
from fsdpx.sharding.tensor_parallel import resolve

from support import tp_hf
from support.mesh_runs import pipelined_run
from support.reference import assert_close_to_reference, baseline, optimizer_for


def _gpt(n_layer=4, tie=True):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=n_layer, n_head=2, n_embd=4, tie_weights=tie)).double()


def _plan(model, mesh, strategy="ddp", **kw):
    return resolve_pipeline(model, resolve(model, None, strategies.ALL[strategy](), mesh), PipelineParallel(**kw),
                            mesh)


# ---- the stage table -------------------------------------------------------------------------


@pytest.mark.parametrize("costs, stages, want", [
    ([1, 1, 1, 1], 2, (2, 2)),
    ([1, 1, 1, 1, 1], 2, (3, 2)),  # the extra block goes first: the last stage also runs the LM head
    ([5, 1, 1, 1], 2, (1, 3)),
    ([1, 1, 1], 3, (1, 1, 1)),
    ([3], 1, (1,)),
])
def test_balanced_split_minimises_the_largest_stage(costs, stages, want):
    assert balanced_split(costs, stages) == want


def test_the_default_split_counts_the_lm_head_on_the_last_stage():
    """A head as costly as ~2.7 blocks (vocabulary 8192 x width 256) pulls blocks onto the
    earlier stages; among equal maxima the most even split wins; embeddings cost nothing."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, block_size=8, n_layer=8, n_head=8, n_embd=256, tie_weights=False))
    assert _plan(model, Mesh(dp=1, pp=2)).pipeline.stages == ((0, 1, 2, 3, 4), (5, 6, 7))
    assert _plan(model, Mesh(dp=1, pp=4)).pipeline.stages == ((0, 1, 2), (3, 4), (5, 6), (7,))
    assert balanced_split([1, 1, 1, 1], 2, first=0.0, last=1.5) == (3, 1)


def test_microbatches_differ_by_at_most_one_example_and_tile_the_batch():
    for n in range(0, 12):
        for m in range(1, 6):
            bounds = microbatch_bounds(n, m)
            sizes = [b - a for a, b in bounds]
            assert bounds[0][0] == 0 and bounds[-1][1] == n and max(sizes) - min(sizes) <= 1
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(m - 1))


def test_tied_embedding_and_head_are_held_by_the_first_and_last_stage():
    model = _gpt()
    plan = _plan(model, Mesh(dp=1, pp=2))
    lay = plan.pipeline
    assert lay.stages == ((0, 1), (2, 3))
    assert lay.param_stages["wte.weight"] == (0, 1)  # also the LM head's weight
    assert lay.param_stages["wpe.weight"] == (0,)
    assert lay.param_stages["ln_f.weight"] == (1,)
    assert lay.param_stages["blocks.2.attn.qkv.weight"] == (1,)
    mesh = Mesh(dp=1, pp=2)
    assert "wpe.weight" in rank_plan(plan, mesh, 0).params and "wpe.weight" not in rank_plan(plan, mesh, 1).params


@pytest.mark.parametrize("mesh, kw, match", [
    (Mesh(dp=1, pp=2), dict(axis="stage"), "axis 'stage'"),
    (Mesh(dp=1, pp=4), dict(), "4 pipeline stages but only 3 blocks"),
    (Mesh(dp=1, pp=2), dict(schedule="looped"), "unknown schedule kind"),
    (Mesh(dp=1, pp=2), dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=3), "multiple"),
    (Mesh(dp=1, pp=2), dict(split=(1, 1)), "split"),
    (Mesh(dp=1, pp=2), dict(microbatches=0), "num_microbatches"),
    (Mesh(dp=2), dict(axis="dp"), "both pipeline and data"),
])
def test_pipelines_that_do_not_fit_are_refused_before_anything_runs(mesh, kw, match):
    with pytest.raises(PipelinePlanError, match=match):
        _plan(_gpt(n_layer=3), mesh, **kw)


def test_a_batch_smaller_than_the_microbatch_count_trains_on_what_there_is():
    """3 examples in 5 microbatches over dp=2 (2 and 1 examples per rank): empty microbatches
    run their parameter collectives, move nothing, and the result is the unsharded step's."""
    model = _gpt()
    mesh = Mesh(dp=2, pp=2)
    plan = _plan(model, mesh, strategy="zero3", microbatches=5)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 11, (3, 4), generator=g), torch.randint(0, 11, (3, 4), generator=g))]
    optimizer = optimizer_for(torch.float64)
    got, metrics = pipelined_run(model, batches, optimizer, plan, mesh)
    assert_close_to_reference(got, baseline(model, batches, optimizer, None), model, 1e-10)
    assert {m["batch_size"] for m in metrics} == {3}


def test_a_rank_that_dies_between_stages_is_named_by_its_peer():
    model = _gpt()
    mesh = Mesh(dp=1, pp=2)
    plan = _plan(model, mesh)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    batch = (torch.randint(0, 11, (4, 4)), torch.randint(0, 11, (4, 4)))

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), token_loss, optimizer_for(torch.float64), plan, comm,
                                 param_shapes=shapes)
        state = init_sharded(params, optimizer_for(torch.float64), plan, comm, key=0)
        step(state, batch)  # both ranks agree and run one step
        if comm.rank == 0:
            raise SystemExit("rank 0 dies before its second step")
        step(state, batch)

    with pytest.raises((RankFailure, SystemExit)) as info:
        run_threads(mesh, rank, timeout=5)
    assert "0" in str(info.value)


# ---- transformers' models, unmodified --------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _hf_check(model, mesh, tp_plan=None, config=None, frozen=(), **kw):
    trainable = [n for n, _ in model.named_parameters() if n not in frozen]
    base = resolve(model, tp_plan, strategies.zero3(), mesh, trainable=trainable)
    plan = resolve_pipeline(model, base, PipelineParallel(**kw), mesh)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 37, (4, 8), generator=g), torch.randint(0, 37, (4, 8), generator=g))
               for _ in range(2)]
    optimizer = optimizer_for(torch.float64)
    ref = tp_hf.reference(model, batches, optimizer, config, trainable)
    got, _ = _pipelined_hf(model, batches, optimizer, plan, mesh, config)
    assert_close_to_reference(got, ref, model, 1e-10)


def _pipelined_hf(model, batches, optimizer, plan, mesh, config=None):
    return pipelined_run(model, batches, optimizer, plan, mesh, config, loss_fn=tp_hf.hf_loss)


@pytest.mark.parametrize("mesh, kw", [
    (Mesh(dp=1, pp=2), dict(schedule="1f1b", microbatches=2)),
    (Mesh(dp=2, pp=2), dict(schedule="zero_bubble", microbatches=2)),
])
def test_hf_gpt2_pipelined_steps_equal_unsharded_steps(mesh, kw):
    """GPT-2 ties ``lm_head`` to ``wte`` (first and last stage) and builds its positions and
    masks inside its forward, which every stage runs as the model does."""
    _hf_check(tp_hf.gpt2("sdpa"), mesh, **kw)


def test_hf_llama_pipelined_with_tensor_parallelism_equals_unsharded_steps():
    """Llama's rotary tables are computed in the model's forward, on every stage."""
    model = tp_hf.llama("eager")
    _hf_check(model, Mesh(dp=1, tp=2, pp=2), llama_plan(model.config), schedule="gpipe", microbatches=2)


def test_hf_gpt2_pipelined_with_tensor_parallelism_equals_unsharded_steps():
    model = tp_hf.gpt2("eager")
    _hf_check(model, Mesh(dp=1, tp=2, pp=2), gpt2_plan(model.config), schedule="1f1b", microbatches=3)


def test_hf_gpt2_private_pipeline_equals_unsharded_private_steps():
    """Ghost clipping through a pipeline: the tied ``wte``/``lm_head`` norm is completed on the
    last stage with the first stage's contributions; ``wpe``, looked up with positions ``[1, T]``
    broadcast over the batch, trains too (the tape expands that call to the batch)."""
    _hf_check(tp_hf.gpt2("eager"), Mesh(dp=1, pp=2), config=tp_hf.dp_config("ghost"),
              schedule="1f1b", microbatches=2)


def test_hf_llama_private_pipeline_with_tensor_parallelism_equals_unsharded_private_steps():
    """``method="auto"``: every layer ghost-clipped at its stage's backward (Llama's RMSNorm by
    its code's rule, ``privacy.layers.SAME_CODE``), norms completed over ``tp`` and ``pp``."""
    model = tp_hf.llama("eager")
    _hf_check(model, Mesh(dp=1, tp=2, pp=2), llama_plan(model.config), config=tp_hf.dp_config("auto"), schedule="gpipe",
              microbatches=2)


def test_a_split_backward_does_the_work_of_one_fused_backward():
    """zero_bubble's B (input gradients) and W (weight gradients, from the kept module outputs
    and their gradients) together run exactly the matrix products of 1F1B's fused backward,
    shape for shape: nothing is computed twice (``fsdpx/runtime/weight_pass.py``)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "baddbmm"):
                self.seen[(func.__name__, *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))] += 1
            return func(*args, **(kwargs or {}))

    model = _gpt(tie=False)
    mesh = Mesh(dp=1, pp=2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    batch = (torch.randint(0, 11, (4, 4)), torch.randint(0, 11, (4, 4)))
    flops = {}
    for kind in ("1f1b", "zero_bubble"):
        plan = _plan(model, mesh, schedule=kind, microbatches=2)

        def rank(comm):
            optimizer = optimizer_for(torch.float64)
            step = make_sharded_step(copy.deepcopy(model), token_loss, optimizer, plan, comm, param_shapes=shapes)
            state = init_sharded(params, optimizer, plan, comm, key=0)
            with Products() as counter:
                step(state, batch)
            return counter.seen

        flops[kind] = run_threads(mesh, rank)
    assert flops["zero_bubble"] == flops["1f1b"] and all(flops["1f1b"])


class _ViewSum(torch.nn.Module):
    """``x.view(...) + p.view(...)``: with one example per microbatch both gradients are views
    of the output's gradient, which ``AccumulateGrad`` steals as they are, so the stage's input
    gradient (sent to the previous stage) and ``p``'s gradient share one storage."""

    def __init__(self, block_size: int, width: int):
        super().__init__()
        self.p = torch.nn.Parameter(0.1 * torch.randn(block_size * width, dtype=torch.float64))

    def forward(self, x):  # (B, T, C)
        return x.view(x.shape) + self.p.view(1, *x.shape[1:]).expand(x.shape)


def test_a_gradient_sum_never_writes_into_a_sent_tensor():
    """A stage's gradient sums are added into in place; a sum that shares storage with the
    input gradient it sends (``_ViewSum`` first on stage 1) is copied first: every tensor handed
    to a send still holds, after the step, what it held when sent (gloo sends from it until the
    end of the step), and the steps equal the unsharded ones."""
    torch.manual_seed(0)
    model = _gpt(tie=False)
    model.blocks[2] = _ViewSum(4, 4)
    mesh = Mesh(dp=1, pp=2)
    plan = _plan(model, mesh, schedule="gpipe", microbatches=4, split=(2, 2))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 11, (4, 4), generator=g), torch.randint(0, 11, (4, 4), generator=g))
               for _ in range(2)]
    optimizer = optimizer_for(torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        sent = []
        send = comm.exchange_p2p

        def watched(sends, recvs):
            sent.extend((t, t.detach().clone()) for _, t in sends)
            return send(sends, recvs)
        comm.exchange_p2p = watched
        step = make_sharded_step(copy.deepcopy(model), token_loss, optimizer, plan, comm, param_shapes=shapes)
        state = init_sharded(params, optimizer, plan, comm, key=7)
        for b in batches:
            state, _ = step(state, b)
            assert sent and all(torch.equal(t, was) for t, was in sent)
            sent.clear()
        return state

    from fsdpx.sharding.pipeline import unshard_stages

    states = run_threads(mesh, rank, timeout=60)
    got = unshard_stages([s.params for s in states], plan, mesh)
    got = {k: t.reshape(shapes[k]) for k, t in got.items()}
    assert_close_to_reference(got, baseline(model, batches, optimizer, None), model, 1e-10)


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_hf_qwen3_pipelined_with_tensor_parallelism_equals_unsharded_steps(private):
    """Qwen3's per-head norms (``ReplicatedOnSplit``) on every stage: their gradients summed over
    ``tp`` within the stage's group, as without a pipeline; private, each example's gradient of
    them summed over ``tp`` before its norm."""
    from fsdpx.models.tp_plans import qwen3_plan

    model = tp_hf.qwen3()
    _hf_check(model, Mesh(dp=1, tp=2, pp=2), qwen3_plan(model.config),
              config=tp_hf.dp_config("ghost") if private else None, schedule="1f1b", microbatches=2)


def test_hf_qwen3_private_pipeline_counts_its_per_head_norms_all_reduce():
    """The private step adds to the plain one's all-reduces exactly what
    ``pipeline_comm_per_step`` adds for it: the norms' ``[B]`` all-reduce over ``pp`` and
    ``tp`` per microbatch, and per stage and microbatch the ``[B, n]`` per-example gradients of
    its ``ReplicatedOnSplit`` norms over ``tp`` (rank 0's bytes; transformers' Qwen3 does not
    trace on meta tensors, so the activation collectives, the same in both, cancel out)."""
    from fsdpx.models.tp_plans import qwen3_plan
    from fsdpx.sharding.pipeline import pipeline_comm_per_step

    model, mesh = tp_hf.qwen3(), Mesh(dp=1, tp=2, pp=2)
    plan = resolve_pipeline(model, resolve(model, qwen3_plan(model.config), strategies.zero3(), mesh),
                            PipelineParallel(schedule="1f1b", microbatches=2), mesh)
    batch = (torch.randint(0, 37, (4, 8)), torch.randint(0, 37, (4, 8)))
    counted, want = {}, {}
    for private in (False, True):
        _, metrics = _pipelined_hf(model, [batch], optimizer_for(torch.float64), plan, mesh,
                                   tp_hf.dp_config("ghost") if private else None)
        counted[private] = metrics[0]["comm_bytes"].get("all_reduce", 0)
        want[private] = pipeline_comm_per_step(plan, mesh, 0, batch_size=4, hidden=(8, model.config.hidden_size),
                                               dtype=torch.float64, private=private).get("all_reduce", 0)
    # the same model and pipeline under a plan without the per-head style: the norms' all-reduce alone
    bare = resolve_pipeline(model, resolve(model, llama_plan(model.config), strategies.zero3(), mesh),
                            PipelineParallel(schedule="1f1b", microbatches=2), mesh)
    norms_only = [pipeline_comm_per_step(bare, mesh, 0, batch_size=4, hidden=(8, model.config.hidden_size),
                                         dtype=torch.float64, private=private).get("all_reduce", 0)
                  for private in (False, True)]
    assert counted[True] - counted[False] == want[True] - want[False] > norms_only[1] - norms_only[0] > 0
    # rank 0 holds stage 0 (layer 0: q_norm and k_norm, 4 + 4 elements): per microbatch one
    # all-reduce over tp = 2 of [2 examples, 8] float64, whose ring moves 2 (k - 1) / k of 128 bytes
    assert (want[True] - want[False]) - (norms_only[1] - norms_only[0]) == 2 * 128


@pytest.mark.parametrize("tie, schedule", [(False, "1f1b"), (True, "gpipe")], ids=["in-schedule", "shared"])
def test_a_pipelined_private_step_names_a_non_finite_example(tie, schedule):
    """An example whose loss is infinite (its gradient, so its norm, not finite) is named by its
    position in the rank's batch share, on every stage's rank, before anything is updated: the
    pipeline clips without reading (``deferred_clip_factors``) and checks all its microbatches
    once, after the schedule. With ``nonfinite="zero"`` the step trains on the other examples."""
    from privacy import DPConfig
    from privacy.errors import NonFiniteGradientError

    model = _gpt(n_layer=2, tie=tie)
    mesh = Mesh(dp=1, pp=2)
    plan = _plan(model, mesh, schedule=schedule, microbatches=2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    ids = torch.randint(0, 10, (4, 4), generator=torch.Generator().manual_seed(2))
    targets = ids.roll(1, 1)
    targets[3, 0] = 10  # the marked example: the second microbatch's second

    def loss(out, t):  # token 10 first marks an example whose loss is infinite
        return token_loss(out, t) * torch.where(t[:, 0] == 10, float("inf"), 1.0)

    def rank(comm, nonfinite):
        config = DPConfig(clip_norm=1.0, noise_multiplier=0.0, sample_rate=0.05, nonfinite=nonfinite)
        opt = optimizer_for(torch.float64)
        step = make_sharded_step(copy.deepcopy(model), loss, opt, plan, comm, param_shapes=shapes, config=config,
                                 num_examples=80)
        state = init_sharded(params, opt, plan, comm, key=7, config=config)
        try:
            state, metrics = step(state, (ids, targets))
        except NonFiniteGradientError as e:
            return e.indices
        return all(torch.isfinite(t).all() for t in state.params.values()), metrics["batch_size"]

    assert run_threads(mesh, lambda comm: rank(comm, "raise"), timeout=60) == [[3], [3]]
    assert run_threads(mesh, lambda comm: rank(comm, "zero"), timeout=60) == [(True, 4), (True, 4)]


@pytest.mark.parametrize("tie, schedule", [(False, "1f1b"), (True, "gpipe")], ids=["in-schedule", "shared"])
def test_a_padded_private_pipeline_equals_the_unpadded_one(tie, schedule):
    """Padding rows (mask False, random tokens) in a private pipelined step: counted on the
    device (the mask's sum), clipped without reading, they add nothing: the parameters and the
    metrics are the unpadded run's."""
    from privacy import DPConfig

    model = _gpt(n_layer=2, tie=tie)
    mesh = Mesh(dp=1, pp=2)
    plan = _plan(model, mesh, schedule=schedule, microbatches=2)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 11, (3, 4), generator=g), torch.randint(0, 11, (3, 4), generator=g)
    mask = torch.tensor([True, False, True, False, True])
    px, py = torch.randint(0, 11, (5, 4), generator=g), torch.randint(0, 11, (5, 4), generator=g)
    px[mask], py[mask] = x, y
    config = DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1)
    optimizer = optimizer_for(torch.float64)
    want, want_metrics = pipelined_run(model, [(x, y)], optimizer, plan, mesh, config)
    got, metrics = pipelined_run(model, [(px, py, mask)], optimizer, plan, mesh, config)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-14), k
    for m, w in zip(metrics, want_metrics):
        assert m["batch_size"] == w["batch_size"] == 3
        for key in ("loss", "clipped_fraction", "mean_norm"):
            assert m[key] == pytest.approx(w[key], rel=1e-12), key
