"""The baseline ZenFlow is measured against: the whole optimizer on the host, synchronously.

Every step, as ZeRO-Offload does it: copy every gradient device -> host, run ``inner`` on the
host's fp32 (or wider) master copy and optimizer state, copy every parameter host -> device. The
device waits for all of it. Nothing is selected, accumulated or delayed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fsdpx.optim import Optimizer, Params, check_same_keys, update_fn
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
    initial ones); they give the device and dtype of the result."""

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
        check_same_keys(grads, params)
        start = time.perf_counter()
        d2h = h2d = 0
        host_grads = {}
        for k, g in grads.items():
            h = to_host(g)
            d2h += nbytes(h)
            host_grads[k] = h.to(state["master"][k].dtype)
        master, inner_state = update_fn(inner, donate=inplace)(host_grads, state["inner"], state["master"])
        new_params = {}
        for k, p in params.items():
            if inplace:
                new_params[k] = p.copy_(master[k])  # cast and copy to the device in one write
            else:
                new_params[k] = to_device(master[k].to(p.dtype, copy=True), p.device)  # never alias the state
            h2d += p.numel() * p.element_size()
        metrics = {"host_wait_s": time.perf_counter() - start, "host_loop_s": 0.0, "d2h_bytes": d2h, "h2d_bytes": h2d}
        return new_params, {"master": master, "inner": inner_state, "metrics": metrics}

    return Optimizer(init, update, update_inplace)
