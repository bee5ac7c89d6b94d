"""Freezing and unfreezing during a run: sharded == unsharded under the same schedule, frozen
parameters and their optimizer state untouched, noise independent of what else is frozen.

Random small models (``random_models``: embeddings, tied heads, norms, a Linear called twice)
and random schedules (``Freezing`` data by canonical name or module prefix, or a callable of
trainable names), every strategy's layout on one or two simulated ranks, plain and private.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fsdpx import Mesh, comm_per_step, strategies, unshard
from fsdpx.optim import Freezing, adamw, sgd
from fsdpx.optim.freezing import bind
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.plain_step import init_plain, make_plain_step
from fsdpx.runtime.threads import run_threads
from fsdpx.runtime.units import make_units
from fsdpx.sharding.pipeline import unshard_stages
from privacy.noise import noise_slice
from privacy.step import DPConfig, init_state, make_private_step

from support.pipeline_cases import pipelines
from support.random_models import Stack, token_cases, vector_cases
from support.reference import assert_close_to_reference

CASES = [("ddp", Mesh(dp=1)), ("ddp", Mesh(dp=2)), ("zero2", Mesh(dp=2)), ("zero3", Mesh(dp=1)),
         ("zero3", Mesh(dp=2)), ("hsdp", Mesh(replica=2, shard=1)), ("hsdp", Mesh(replica=1, shard=2))]
STEPS = 3
EXAMPLES = 50


def _dp(private: bool) -> DPConfig | None:
    return DPConfig(clip_norm=0.5, noise_multiplier=0.8, sample_rate=0.1, method="ghost") if private else None


def _optimizer() -> adamw:
    # eps bounds AdamW's amplification of rounding noise in gradients that are 0 in exact
    # arithmetic (support.reference.optimizer_for)
    return adamw(1e-2, eps=1e-5, weight_decay=0.05)


@st.composite
def schedules(draw, names: list[str]):
    """A ``Freezing`` over ``STEPS`` steps (each set by name or by module prefix) or a callable of
    trainable names; at least one parameter trains at every step."""
    prefixes = sorted({n.rsplit(".", 1)[0] for n in names if "." in n} | set(names))
    sets = [draw(st.sets(st.sampled_from(prefixes), max_size=3)) for _ in range(STEPS)]
    as_data = draw(st.booleans())
    freezing = Freezing({t: s for t, s in enumerate(sets) if t == 0 or s != sets[t - 1]})
    probe = bind(freezing, torch.nn.Module(), names)
    trainable = [frozenset(names) - probe.resolve(s) for s in sets]
    assume(all(trainable))
    if as_data:
        return freezing
    return lambda step: trainable[step]


@st.composite
def problems(draw):
    case = draw(st.one_of(token_cases(), vector_cases()))
    model = case.model
    # a unit (a ModuleList child) called twice in one forward is gathered twice under zero3 and
    # breaks the runtime with or without freezing (a limitation of fsdpx.runtime.gather)
    assume(not any(isinstance(m, Stack) and len(set(m.order)) < len(m.order) for m in model.modules()))
    names = [n for n, _ in model.named_parameters()]
    schedule = draw(schedules(names))
    batches = [case.batch] * STEPS
    return model, case.loss_fn, batches, schedule


def _unsharded(model, loss_fn, batches, optimizer, config, schedule, key=7):
    """The single-process run; also checks, step by step, that every parameter frozen at the
    step keeps the same tensor and the same optimizer state (bit for bit, no moment decay)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    if config is None:
        state, step = init_plain(params, optimizer), make_plain_step(model, loss_fn, optimizer, trainable=schedule)
    else:
        state = init_state(params, optimizer, key=key, config=config)
        step = make_private_step(model, loss_fn, optimizer, config, num_examples=EXAMPLES, trainable=schedule)
    sets = bind(schedule, model, params)
    for b in batches:
        frozen = set(params) - sets(state.step) if sets is not None else set()
        before = state
        state, _ = step(state, b)
        for n in frozen:
            assert torch.equal(state.params[n], before.params[n]), n
            assert state.opt_state["count"][n] == (before.opt_state["count"] if isinstance(
                before.opt_state["count"], int) else before.opt_state["count"][n]), n
            for slot, per_param in state.opt_state.items():
                if slot != "count" and n in per_param:
                    assert torch.equal(per_param[n], before.opt_state[slot][n]), (slot, n)
    return state


def _sharded(model, loss_fn, batches, optimizer, config, schedule, strategy, mesh, key=7):
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), loss_fn, optimizer, strategy, comm, param_shapes=shapes,
                                 config=config, num_examples=EXAMPLES, trainable=schedule)
        state = init_sharded(params, optimizer, strategy, comm, key=key, config=config)
        comms = []
        for b in batches:
            state, metrics = step(state, b)
            comms.append(metrics["comm_bytes"])
        return state, comms

    results = run_threads(mesh, rank)
    full = {k: unshard([r[0].params[k] for r in results], strategy.param_at_rest(len(s)), mesh)
            for k, s in shapes.items()}
    return full, results


@settings(max_examples=25, deadline=None)
@given(problems(), st.sampled_from(CASES), st.booleans())
def test_sharded_runs_under_a_schedule_equal_the_unsharded_run(problem, case, private):
    """Parameters (rel 1e-10, float64) and per-parameter counts equal the unsharded run's under
    the same schedule; each step moves exactly ``comm_per_step(..., trainable=<its set>)``."""
    model, loss_fn, batches, schedule = problem
    name, mesh = case
    strategy = strategies.ALL[name]()
    config = _dp(private)
    ref = _unsharded(model, loss_fn, batches, _optimizer(), config, schedule)
    got, results = _sharded(model, loss_fn, batches, _optimizer(), config, schedule, strategy, mesh)
    assert_close_to_reference(got, ref.params, model, 1e-10)
    assert all(r[0].opt_state["count"] == ref.opt_state["count"] for r in results)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    sets = bind(schedule, model, shapes)
    units = [list(u.params) for u in make_units(model, shapes)]
    for t, counted in enumerate(results[0][1]):
        assert counted == comm_per_step(strategy, shapes, mesh, units, dtype=torch.float64, trainable=sets(t)), t


@settings(max_examples=8, deadline=None)
@given(pipelines(), st.booleans(), st.data())
def test_pipelined_and_tensor_parallel_runs_under_a_schedule_equal_the_unsharded_run(case, private, data):
    """Pipeline stages (every schedule kind, with dp and tp) under a random schedule."""
    model, batches, plan, mesh = case
    names = list(plan.params)
    schedule = data.draw(schedules(names))
    from fsdpx.models.gpt import token_loss

    optimizer = _optimizer()
    config = _dp(private)
    ref = _unsharded(model, token_loss, batches, optimizer, config, schedule)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), token_loss, optimizer, plan, comm, param_shapes=shapes,
                                 config=config, num_examples=EXAMPLES, trainable=schedule)
        state = init_sharded(params, optimizer, plan, comm, key=7, config=config)
        for b in batches:
            state, _ = step(state, b)
        return state

    results = run_threads(mesh, rank, timeout=60)
    full = unshard_stages([r.params for r in results], plan, mesh)
    assert_close_to_reference({k: t.reshape(shapes[k]) for k, t in full.items()}, ref.params, model, 1e-10)


@settings(max_examples=10, deadline=None)
@given(problems(), st.sampled_from(CASES))
def test_noise_of_a_trainable_parameter_does_not_depend_on_what_else_is_frozen(problem, case):
    """On an empty batch the private update is noise alone: with SGD at lr 1, every parameter
    that trains moves by exactly ``-noise_slice(key, step, name) / (q N)`` whether the others
    are frozen or not, sharded or not; a frozen one does not move."""
    model, loss_fn, batches, schedule = problem
    names = [n for n, _ in model.named_parameters()]
    config = _dp(True)
    empty = tuple(x[:0] for x in batches[0])
    params = {k: v.detach() for k, v in model.named_parameters()}
    sets = bind(schedule, model, params)
    alone = _unsharded(model, loss_fn, [empty], sgd(1.0), config, None)
    frozen = _unsharded(model, loss_fn, [empty], sgd(1.0), config, schedule)
    name, mesh = case
    sharded, _ = _sharded(model, loss_fn, [empty], sgd(1.0), config, schedule, strategies.ALL[name](), mesh)
    for n in names:
        if n not in sets(0):
            assert torch.equal(frozen.params[n], params[n]) and torch.equal(sharded[n], params[n]), n
            continue
        noise = noise_slice(n, params[n].numel(), 0, params[n].numel(), key=7, step=0, std=config.noise_std,
                            dtype=params[n].dtype).view(params[n].shape)
        expected = params[n] - noise / (config.sample_rate * EXAMPLES)
        assert torch.equal(frozen.params[n], alone.params[n]), n
        assert torch.equal(frozen.params[n], expected), n
        assert torch.equal(sharded[n], expected), n
