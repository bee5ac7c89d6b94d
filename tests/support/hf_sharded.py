"""transformers models, unmodified, on the simulated mesh: the batches a user hands them (right
padding, ``-100`` labels on pads), the unsharded reference run and the sharded run of any
strategy or plan, and the check that the two agree (float64, rel 1e-9). Used as
``from support import hf_sharded`` and ``hf_sharded.check_plan(...)``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.plain_step import init_plain, make_plain_step
from fsdpx.runtime.threads import run_threads
from fsdpx.sharding.cost_model import as_plan
from fsdpx.sharding.pipeline import unshard_stages
from privacy.step import DPConfig, init_state, make_private_step

from support.hf import T, padded_batch
from support.reference import assert_close_to_reference, optimizer_for

TOL = 1e-9
NUM_EXAMPLES = 50
LENGTHS = [[5, 8, 3, 6, 2], [8, 1, 4]]  # two steps; 5 and 3 examples split unevenly over the ranks


def dp_config() -> DPConfig:
    """The privacy knobs of the private cases (ghost clipping)."""
    return DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method="ghost")


def batches(causal: bool, form: str = "mapping"):
    """The steps' batches: ``padded_batch`` of each step's ``LENGTHS`` (seeds 1, 2); ``form``
    "tuple": BERT's positional ``(input_ids, attention_mask, None, position_ids [1, T])``, a
    non-tensor entry and a shared tensor among them."""
    out = []
    for seed, lengths in enumerate(LENGTHS):
        inputs, labels = padded_batch(lengths, causal=causal, seed=seed + 1)
        if form == "tuple":
            inputs = (inputs["input_ids"], inputs["attention_mask"], None, torch.arange(T)[None, :])
        out.append((inputs, labels))
    return out


def reference(model, loss_fn, batches, optimizer, config, trainable=None):
    """``(parameters, losses)`` after one unsharded step per batch (plain when ``config`` is None,
    else private with key 7); parameters outside ``trainable`` (default all) frozen."""
    params = {k: p for k, p in model.named_parameters() if trainable is None or k in trainable}
    if config is None:
        state, step = init_plain(params, optimizer), make_plain_step(model, loss_fn, optimizer)
    else:
        state = init_state(params, optimizer, key=7, config=config)
        step = make_private_step(model, loss_fn, optimizer, config, num_examples=NUM_EXAMPLES)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"])
    return state.params, losses


def sharded_run(model, loss_fn, batches, optimizer, config, strategy, mesh, trainable=None):
    """Every rank's steps on the simulated mesh; the trained parameters unsharded in their own
    shapes, and each step's metrics of every rank."""
    params = {k: v.detach() for k, v in model.named_parameters() if trainable is None or k in trainable}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    plan = as_plan(strategy, shapes)

    def rank(comm):
        m = copy.deepcopy(model)
        step = make_sharded_step(m, loss_fn, optimizer, plan, comm, param_shapes=shapes, config=config,
                                 num_examples=NUM_EXAMPLES)
        state = init_sharded(params, optimizer, plan, comm, key=7, config=config)
        metrics = []
        for b in batches:
            state, got = step(state, b)
            metrics.append(got)
        return state, metrics

    results = run_threads(mesh, rank, timeout=120)
    full = unshard_stages([r[0].params for r in results], plan, mesh)
    return {k: t.reshape(shapes[k]) for k, t in full.items()}, [r[1] for r in results]


def check_plan(model, loss_fn, plan, mesh, private, *, causal, config=None):
    """Asserts that the steps of ``plan`` on the simulated ``mesh`` over ``batches(causal)`` give
    the unsharded run's parameters within ``TOL`` and every rank reports its losses (private with
    ``config``, by default ``dp_config()``, when ``private``)."""
    steps = batches(causal)
    optimizer = optimizer_for(torch.float64)
    config = config or (dp_config() if private else None)
    ref, ref_losses = reference(model, loss_fn, steps, optimizer, config)
    got, metrics = sharded_run(model, loss_fn, steps, optimizer, config, plan, mesh)
    assert_close_to_reference(got, ref, model, TOL)
    for per_rank in metrics:
        for i, m in enumerate(per_rank):
            assert m["loss"] == pytest.approx(ref_losses[i], rel=1e-12)
