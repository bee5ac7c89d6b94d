"""The baseline ZenFlow is measured against: the whole optimizer on the host, synchronously.

Every step, as ZeRO-Offload does it: copy every gradient device -> host, run ``inner`` on the
host's fp32 (or wider) master copy and optimizer state, copy every parameter host -> device. The
device waits for all of it. Nothing is selected, accumulated or delayed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fsdpx.optim import Optimizer, Params, update_fn, update_trainable
from offload.worker import HOST, nbytes, to_device, to_host
from offload.zenflow import master_dtype

State = dict[str, Any]


def zero_offload(inner: Optimizer) -> Optimizer:
    """``inner`` run on the host every step.

    Guarantees (``tests/test_zero_offload.py``):
      - With float32/float64 parameters, equals ``inner`` bit for bit, step for step.
      - With lower-precision parameters, equals ``inner`` run on the float32 master copy, the
        result cast to the parameters' dtype; the master is never re-read from ``params``.
      - State is plain data, every tensor on the host: ``{"master": {name: T}, "inner": inner's
        state, "metrics": ...}``. ``state["metrics"]`` for the last step: ``host_wait_s`` (the
        whole step: the device waits for copies and host update; ``host_loop_s`` is 0, nothing
        is left outside the wait), ``d2h_bytes`` (every gradient),
        ``h2d_bytes`` (every parameter, in its dtype).

    ``params`` passed to ``update`` must be those returned by the previous ``update`` (or the
    initial ones); they give the device and dtype of the result.

    Freezing (``partial_grads``): ``grads`` may name a subset of ``params``; the others are
    frozen: their parameters, master and ``inner`` state are returned as they are, and the
    update runs through ``fsdpx.optim.update_trainable`` (per-parameter counts), so a run under
    a freezing schedule equals the non-offloaded one bit for bit (fp32;
    ``tests/test_offload_freezing.py::test_zero_offload_under_a_schedule_equals_adamw_bit_for_bit``).
    A gradient for a name not in ``params`` raises ``KeyError``."""

    def init(params: Params) -> State:
        master = {k: p.detach().to(device=HOST, dtype=master_dtype(p.dtype), copy=True) for k, p in params.items()}
        return {"master": master, "inner": inner.init(master),
                "metrics": {"host_wait_s": 0.0, "host_loop_s": 0.0, "d2h_bytes": 0, "h2d_bytes": 0}}

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        return step(grads, state, params, inplace=False)

    def update_inplace(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        """``update`` for a caller that donates ``state`` and ``params``: the same bits, with the
        host update run by ``inner.update_inplace`` (when it has one) and the parameters
        overwritten (``tests/test_zero_offload.py::test_donated_update_gives_the_same_bits``)."""
        with torch.no_grad():
            return step(grads, state, params, inplace=True)

    def step(grads: Params, state: State, params: Params, *, inplace: bool) -> tuple[Params, State]:
        extra = sorted(set(grads) - set(params))
        if extra:
            raise KeyError(f"gradients for names not in params: {extra}")
        start = time.perf_counter()
        d2h = h2d = 0
        host_grads = {}
        for k, g in grads.items():
            h = to_host(g)
            d2h += nbytes(h)
            host_grads[k] = h.to(state["master"][k].dtype)
        apply = update_fn(inner, donate=inplace)
        per_param = isinstance(state["inner"], dict) and isinstance(state["inner"].get("count"), dict)
        if per_param or grads.keys() != params.keys():  # a frozen parameter: per-parameter counts from then on
            master, inner_state = update_trainable(apply, host_grads, state["inner"], state["master"])
        else:
            master, inner_state = apply(host_grads, state["inner"], state["master"])
        new_params = {}
        for k, p in params.items():
            if k not in grads:
                new_params[k] = p
                continue
            if inplace:
                new_params[k] = p.copy_(master[k])  # cast and copy to the device in one write
            else:
                new_params[k] = to_device(master[k].to(p.dtype, copy=True), p.device)  # never alias the state
            h2d += p.numel() * p.element_size()
        metrics = {"host_wait_s": time.perf_counter() - start, "host_loop_s": 0.0, "d2h_bytes": d2h, "h2d_bytes": h2d}
        return new_params, {"master": master, "inner": inner_state, "metrics": metrics}

    return Optimizer(init, update, update_inplace, partial_grads=True)


def per_parameter_counts(state: State) -> State:
    """``state`` (``zero_offload``'s) with ``inner``'s ``count`` one per parameter
    (``{name: count}``; already so once a parameter was frozen). Continuing from it gives the
    same bits (``update_trainable`` with every count equal is one ``inner`` update), and under
    a freezing schedule every pipeline stage's state then holds the same kind of count, whether
    or not its own weights were frozen yet: what a checkpoint of the stages together needs
    (``tests/test_offload_model_parallel.py::test_zero_offload_under_a_schedule_with_model_parallelism_resumes_bit_for_bit``)."""
    count = state["inner"].get("count") if isinstance(state.get("inner"), dict) else None
    if not isinstance(count, int):
        return state
    return {**state, "inner": {**state["inner"], "count": dict.fromkeys(state["master"], count)}}
