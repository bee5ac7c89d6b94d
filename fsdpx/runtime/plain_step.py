"""The plain (non-private, unsharded) train step: the baseline every other path is checked
against."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fsdpx.optim import Optimizer, Trainable
from fsdpx.optim.freezing import bind, frozen_update
from privacy.batch import real_count, split_inputs, unpack
from privacy.tape import LossFn

Params = dict[str, Tensor]


class PlainState(NamedTuple):
    params: Params
    opt_state: Any
    step: int


def init_plain(params: Params, optimizer: Optimizer) -> PlainState:
    """Detached copies of ``params``, fresh optimizer state, step 0."""
    params = {k: v.detach().clone() for k, v in params.items()}
    return PlainState(params, optimizer.init(params), 0)


def make_plain_step(
    model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, *, trainable: Trainable | None = None
) -> Callable[[PlainState, tuple[Any, Tensor]], tuple[PlainState, dict[str, float]]]:
    """Returns ``step(state, batch) -> (state, metrics)``: the optimizer applied to the MEAN
    gradient of the batch's per-example losses (an empty batch gives a zero gradient).
    Parameters not in ``state.params`` are frozen. Metrics: loss, batch_size.
    ``batch``: ``(inputs, targets[, mask])`` as ``privacy.batch`` reads it (a mapping of keyword
    arguments included); padding rows (mask False) have their loss set to 0 and are not
    counted, so the mean is over the real examples (their inputs must give finite values).

    ``trainable`` (a ``fsdpx.optim.Freezing`` or a callable ``step -> names``): at each step only
    the parameters it names train; the others of ``state.params`` take part in the forward with
    their current values, get no gradient, and they and their optimizer state stay as they are
    (``fsdpx.optim.update_trainable``: per-parameter counts).
    ``tests/test_freezing.py::test_plain_step_with_a_schedule_equals_stepping_the_trainable_subset``."""
    bound: list = []  # the schedule bound to the state's parameter names at the first step

    def step(state: PlainState, batch: tuple[Any, Tensor]) -> tuple[PlainState, dict[str, float]]:
        if not bound:
            bound.append(bind(trainable, model, state.params))
        sets = bound[0]
        live, frozen = sets.split(state.params, state.step) if sets is not None else (state.params, {})
        live = {k: v.detach().requires_grad_(True) for k, v in live.items()}
        frozen = {k: v.detach() for k, v in frozen.items()}
        inputs, targets, mask = unpack(batch)
        n = real_count(batch)
        args, kwargs = split_inputs(inputs)
        losses = loss_fn(functional_call(model, {**frozen, **live}, args, kwargs), targets)
        if mask is not None:  # padding rows: loss exactly 0, so no gradient and not counted
            losses = torch.where(mask, losses, torch.zeros_like(losses))
        grads = torch.autograd.grad(losses.sum(), list(live.values()), allow_unused=True) if live else ()
        mean = {k: (g if g is not None else torch.zeros_like(live[k])) / max(n, 1) for k, g in zip(live, grads)}
        if sets is None:
            params, opt_state = optimizer.update(mean, state.opt_state, state.params)
        else:
            params, opt_state = frozen_update(optimizer, optimizer.update)(mean, state.opt_state, state.params)
        loss = float(losses.detach().sum()) / n if n else float("nan")
        return PlainState(params, opt_state, state.step + 1), {"loss": loss, "batch_size": n}

    return step
