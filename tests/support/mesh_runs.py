"""Training runs on the simulated mesh (one thread per rank, ``fsdpx.runtime.threads``): a
data-parallel strategy, a tensor-parallel plan, a pipeline plan. Each returns the trained
parameters unsharded in their own shapes, for ``support.reference`` to judge, and the ranks'
metrics."""

from __future__ import annotations

import copy

from fsdpx import unshard
from fsdpx.models.gpt import token_loss
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.threads import run_threads
from fsdpx.sharding.pipeline import unshard_stages


def sharded_run(model, batches, optimizer, config, strategy, mesh, donate=False):
    """Every rank's steps of ``strategy`` on the simulated ``mesh`` (each with its own copy of
    ``model``, ``token_loss``, key 7, 50 examples); returns the trained parameters unsharded, every
    rank's last metrics, and the parameters' shapes."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        m = copy.deepcopy(model)
        step = make_sharded_step(m, token_loss, optimizer, strategy, comm, param_shapes=shapes, config=config,
                                 num_examples=50, donate=donate)
        state = init_sharded(params, optimizer, strategy, comm, key=7, config=config)
        for b in batches:
            state, metrics = step(state, b)
        return state, metrics

    results = run_threads(mesh, rank)
    full = {k: unshard([r[0].params[k] for r in results], strategy.param_at_rest(len(s)), mesh)
            for k, s in shapes.items()}
    return full, [r[1] for r in results], shapes


def rank_runs(model, batches, optimizer, config, plan, mesh, *, loss_fn=token_loss, key=7, trainable=None,
              states=None, timeout=120.0):
    """Every rank's steps of ``plan`` (a ``ShardingPlan``, pipelined or not) on the simulated
    ``mesh``, each with its own copy of ``model``, 50 examples and noise ``key``, from step 0 or
    from ``states[rank]`` (e.g. ``ckpt.load_ranks``); returns each rank's ``(last state, last
    metrics)``. ``trainable`` (default all) limits the parameters; the rest stay frozen."""
    params = {k: v.detach() for k, v in model.named_parameters() if trainable is None or k in trainable}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        m = copy.deepcopy(model)
        step = make_sharded_step(m, loss_fn, optimizer, plan, comm, param_shapes=shapes, config=config,
                                 num_examples=50)
        state = states[comm.rank] if states else init_sharded(params, optimizer, plan, comm, key=key, config=config)
        for b in batches:
            state, metrics = step(state, b)
        return state, metrics

    return run_threads(mesh, rank, timeout=timeout)


def tensor_parallel_run(model, batches, optimizer, config, plan, mesh, *, loss_fn=token_loss, trainable=None, key=7):
    """Every rank's steps on the simulated mesh (:func:`rank_runs`); returns the trained
    parameters unsharded in their own shapes, and every rank's last metrics. ``trainable``
    (default all) limits the parameters; the rest stay frozen."""
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters() if trainable is None or k in trainable}
    results = rank_runs(model, batches, optimizer, config, plan, mesh, loss_fn=loss_fn, key=key, trainable=trainable)
    full = {k: unshard([r[0].params[k] for r in results], lay.at_rest, mesh).reshape(shapes[k])
            for k, lay in plan.params.items()}
    return full, [r[1] for r in results]


def pipelined_run(model, batches, optimizer, plan, mesh, config=None, *, loss_fn=None, key=7):
    """Every rank's steps on the simulated mesh (:func:`rank_runs`); returns the trained
    parameters of the plan, unsharded in their own shapes, and every rank's last metrics.
    Parameters outside the plan stay frozen."""
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters() if k in plan.params}
    results = rank_runs(model, batches, optimizer, config, plan, mesh, loss_fn=loss_fn or token_loss, key=key,
                        trainable=plan.params, timeout=60)
    full = unshard_stages([r[0].params for r in results], plan, mesh)
    return {k: t.reshape(shapes[k]) for k, t in full.items()}, [r[1] for r in results]
