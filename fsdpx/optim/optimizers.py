"""Functional optimizers over ``dict[str, Tensor]``, optax style.

An optimizer is a pair of pure functions::

    opt = adamw(lr=1e-3)
    state = opt.init(params)
    params, state = opt.update(grads, state, params)

Every rule is elementwise: the update of element ``k`` of a parameter reads only element ``k``
of the parameter, its gradient and its state (plus the step count). Applying an optimizer to any
slice of a tensor therefore gives exactly the same slice of the result, which is what lets
ZeRO-1/2/3 update only the shard a rank owns, and what ZenFlow relies on to move columns
between device and host. Proved by ``property_tests/test_optim.py``.

The arithmetic follows ``torch.optim.SGD`` / ``torch.optim.AdamW`` (foreach=False) operation
for operation, so results match to float rounding (``test_optimizers_match_torch_optim``).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from . import adamw_loop

Params = dict[str, Tensor]
OptState = dict[str, object]


ColumnUpdate = Callable[..., tuple[Tensor, dict[str, Tensor]] | None]
"""``(param [out, n], grad, slots {slot: [out, n]}, counts LongTensor[n], inplace=False) ->
(new_param, new_slots)``: the update of one 2-D tensor whose column ``j`` has ``counts[j]``
updates behind it, equal bit for bit to ``update`` applied to each column alone with its own
count (ZenFlow's per-column counts); ``None`` when the fast path does not apply (the caller then
groups columns by count). ``inplace=True`` (the param and slots are the caller's to overwrite)
may write the results into them and return them: the same bits."""


class Optimizer(NamedTuple):
    """Two pure functions: ``init(params) -> state`` and
    ``update(grads, state, params) -> (new_params, new_state)``. Inputs are never mutated.

    ``update_inplace`` (optional) is the same arithmetic for a caller that donates ``params`` and
    ``state`` (JAX's ``donate_argnums``): it writes the new values into their tensors and returns
    them, sparing one allocation and one pass per tensor. Its results equal ``update``'s bit for
    bit (``property_tests/test_optim.py::test_inplace_update_equals_the_pure_update``).
    ``update_columns`` (optional, :data:`ColumnUpdate`) updates a 2-D tensor whose columns have
    different step counts in one pass (``tests/test_optim_loop.py``).
    ``partial_grads``: ``update`` takes gradients for a subset of the parameters and keeps the
    others frozen itself (ZenFlow, ZeRO-Offload, whose state is not the per-parameter dict
    ``fsdpx.optim.update_trainable`` cuts); a freezing schedule then calls it directly
    (``fsdpx.optim.freezing.frozen_update``).
    ``recipe`` (optional): ``(factory, args)``, a module-level function and the arguments that
    build this optimizer again; with it the optimizer pickles as that call, so another process
    can run it (ZenFlow's host worker process, ``offload.host_process``). ``adamw`` and ``sgd``
    have one; pickling an optimizer without one raises ``TypeError``."""

    init: Callable[[Params], OptState]
    update: Callable[[Params, OptState, Params], tuple[Params, OptState]]
    update_inplace: Callable[[Params, OptState, Params], tuple[Params, OptState]] | None = None
    update_columns: ColumnUpdate | None = None
    partial_grads: bool = False
    recipe: tuple[Callable[..., "Optimizer"], tuple] | None = None

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        if self.recipe is None:
            raise TypeError("this optimizer has no recipe (Optimizer.recipe): it cannot be rebuilt in another process")
        return self.recipe


def update_fn(optimizer: Optimizer, *, donate: bool) -> Callable[[Params, OptState, Params], tuple[Params, OptState]]:
    """``optimizer.update_inplace`` when the caller donates its state and the optimizer has one,
    else the pure ``optimizer.update`` (same bits either way)."""
    return optimizer.update_inplace if donate and optimizer.update_inplace is not None else optimizer.update


def check_same_keys(grads: Params, params: Params) -> None:
    if grads.keys() != params.keys():
        missing = sorted(set(params) - set(grads))
        extra = sorted(set(grads) - set(params))
        raise KeyError(f"gradients and parameters differ: missing {missing}, unexpected {extra}")


def sgd_kernel(p: Tensor, g: Tensor, buf: Tensor, *, lr: float, momentum: float) -> tuple[Tensor, Tensor]:
    """One elementwise SGD step. Returns ``(new_p, new_buf)``.

    With ``momentum == 0`` the buffer is unused and returned unchanged. Torch seeds the
    momentum buffer with the first gradient; a zero buffer gives the same bits
    (``momentum * 0 + g == g``)."""
    if momentum == 0.0:
        return p - lr * g, buf
    new_buf = buf * momentum + g
    return p - lr * new_buf, new_buf


def sgd(lr: float, momentum: float = 0.0) -> Optimizer:
    """Stochastic gradient descent, optionally with heavy-ball momentum (torch's convention).

    Guarantees: elementwise; equals ``torch.optim.SGD(lr, momentum)`` step for step.
    State: ``{"count": int, "momentum": dict}`` (the dict is empty when ``momentum == 0``)."""
    if lr < 0 or momentum < 0:
        raise ValueError(f"sgd needs lr >= 0 and momentum >= 0, got lr={lr}, momentum={momentum}")

    def init(params: Params) -> OptState:
        bufs = {k: torch.zeros_like(v) for k, v in params.items()} if momentum else {}
        return {"count": 0, "momentum": bufs}

    def update(grads: Params, state: OptState, params: Params) -> tuple[Params, OptState]:
        check_same_keys(grads, params)
        new_params, new_bufs = {}, {}
        for k, p in params.items():
            buf = state["momentum"].get(k, p)  # type: ignore[union-attr]
            new_params[k], b = sgd_kernel(p, grads[k], buf, lr=lr, momentum=momentum)
            if momentum:
                new_bufs[k] = b
        return new_params, {"count": state["count"] + 1, "momentum": new_bufs}  # type: ignore[operator]

    return Optimizer(init, update, recipe=(sgd, (lr, momentum)))


def _bias_correction(count: int, *, lr: float, b1: float, b2: float) -> tuple[float, float]:
    """``(sqrt(1 - b2**count), lr / (1 - b1**count))`` in Python floats: the two step-dependent
    scalars of AdamW, computed one way for every caller so their roundings agree."""
    return math.sqrt(1 - b2**count), lr / (1 - b1**count)


def adamw_kernel(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    count: int,
    *,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One elementwise AdamW step, ``count`` = the number of this step (1 on the first update).

    Returns ``(new_p, new_m, new_v)``; the arithmetic of ``torch.optim.AdamW`` (single-tensor
    path) with unfused operations. On CPU float32/float64 tensors the operations run as one
    compiled pass (``fsdpx/optim/adamw_loop.py``: same operations, a correctly rounded ``sqrt``, any
    layout); elsewhere as tensor operations. ``count`` is a Python int on purpose: a vectorised ``pow`` over a
    tensor of counts rounds differently by lane, which would break elementwise exactness, so
    callers with per-column counts (ZenFlow) use ``adamw(...).update_columns``, which computes
    these scalars per distinct count in Python, or group columns by count."""
    bc2_sqrt, step_size = _bias_correction(count, lr=lr, b1=b1, b2=b2)
    if adamw_loop.applies(p, g, m, v):  # the same operations in one compiled pass (adamw_loop.py)
        outs = (torch.empty(p.shape, dtype=p.dtype), torch.empty(m.shape, dtype=m.dtype), torch.empty(v.shape, dtype=v.dtype))
        adamw_loop.adamw_(p, g, m, v, outs, keep=1 - lr * weight_decay, b1=b1, b2=b2, bc2_sqrt=bc2_sqrt, eps=eps,
                          step_size=step_size)
        return outs
    return adamw_ops(p, g, m, v, count, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)


def adamw_ops(p: Tensor, g: Tensor, m: Tensor, v: Tensor, count: int, *, lr: float, b1: float, b2: float,
              eps: float, weight_decay: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`adamw_kernel` as tensor operations, what it runs off the CPU's float32/float64
    loop: ``(new_p, new_m, new_v)``, the inputs never modified."""
    bc2_sqrt, step_size = _bias_correction(count, lr=lr, b1=b1, b2=b2)
    # Plain IEEE operations only (no fused alpha/addcmul/lerp, which may use FMA in SIMD lanes
    # and not in the scalar tail): every element rounds the same in any slice. In place on
    # fresh tensors to spare allocations; the inputs are never modified.
    new_p = p * (1 - lr * weight_decay)
    new_m = m * b1
    new_m += g * (1 - b1)
    new_v = g * g
    new_v *= 1 - b2
    new_v += v * b2
    update = new_v.sqrt()
    update /= bc2_sqrt
    update += eps
    torch.div(new_m, update, out=update)
    update *= step_size
    new_p -= update
    return new_p, new_m, new_v


def adamw_kernel_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, count: int, *, lr: float, b1: float, b2: float,
                  eps: float, weight_decay: float) -> None:
    """:func:`adamw_kernel` written into ``p``, ``m`` and ``v``: the same operations on the same
    operands (IEEE addition commutes, so ``v * b2 + t`` rounds as ``t + v * b2``), hence the
    same bits."""
    bc2_sqrt, step_size = _bias_correction(count, lr=lr, b1=b1, b2=b2)
    if adamw_loop.applies(p, g, m, v):
        adamw_loop.adamw_(p, g, m, v, (p, m, v), keep=1 - lr * weight_decay, b1=b1, b2=b2, bc2_sqrt=bc2_sqrt,
                          eps=eps, step_size=step_size)
        return
    adamw_ops_(p, g, m, v, count, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)


def adamw_ops_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, count: int, *, lr: float, b1: float, b2: float,
               eps: float, weight_decay: float) -> None:
    """:func:`adamw_ops` written into ``p``, ``m`` and ``v``, the same bits."""
    bc2_sqrt, step_size = _bias_correction(count, lr=lr, b1=b1, b2=b2)
    p.mul_(1 - lr * weight_decay)
    m.mul_(b1)
    m.add_(g * (1 - b1))
    t = g * g
    t *= 1 - b2
    v.mul_(b2)
    v.add_(t)
    torch.sqrt(v, out=t)
    t /= bc2_sqrt
    t += eps
    torch.div(m, t, out=t)
    t *= step_size
    p.sub_(t)


FOREACH_DTYPES = (torch.float32, torch.float64)
FOREACH_CHUNK_BYTES = 64 * 2**20
"""Largest parameter bytes one multi-tensor group updates at once: its temporaries (two
tensors' worth per parameter) are alive together, so a group is cut into chunks of at most
this many bytes (a larger tensor is a chunk alone). 64 MiB keeps the extra memory to ~128 MiB
and the launches to a dozen per chunk."""


def _split_by_path(params: Params, grads: Params, state: OptState) -> tuple[list[str], list[list[str]]]:
    """The keys :func:`adamw_kernel` runs one by one and the chunks of keys
    :func:`adamw_foreach` runs together. One by one: CPU float32/float64 (the compiled loop),
    half types and mixed dtypes, and the ``meta`` device (tensor operations). Together: the
    float32/float64 tensors of an accelerator, grouped by (device, dtype) and cut into chunks of
    at most :data:`FOREACH_CHUNK_BYTES` (a few multi-tensor kernels per chunk instead of a dozen
    launches per parameter). Half types stay out: their multi-tensor additions round
    differently from ``add_`` on the CPU (seen with torch 2.13), and bits must not depend on the
    path. ``meta`` stays out so that the memory model (``step_memory.step_peak``) counts the
    one-tensor path's temporaries; an accelerator's chunks add at most two chunks' worth."""
    looped, groups = [], {}
    for k, p in params.items():
        tensors = (p, grads[k], state["mu"][k], state["nu"][k])  # type: ignore[index]
        if (adamw_loop.applies(*tensors) or p.device.type in ("cpu", "meta")
                or any(t.dtype not in FOREACH_DTYPES or t.dtype != p.dtype or t.device != p.device for t in tensors)):
            looped.append(k)
        else:
            groups.setdefault((p.device, p.dtype), []).append(k)
    return looped, [chunk for keys in groups.values() for chunk in _chunks(keys, params)]


def _chunks(keys: list[str], params: Params) -> list[list[str]]:
    """``keys`` cut in order into runs of at most :data:`FOREACH_CHUNK_BYTES` parameter bytes."""
    out: list[list[str]] = []
    size = FOREACH_CHUNK_BYTES
    for k in keys:
        n = params[k].numel() * params[k].element_size()
        if not out or size + n > FOREACH_CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(k)
        size += n
    return out


def adamw_foreach(ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor], count: int, *,
                  lr: float, b1: float, b2: float, eps: float,
                  weight_decay: float) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """:func:`adamw_ops` over lists of tensors with ``torch._foreach_*`` operations: the same
    IEEE operations in the same order on the same operands, so for float32/float64 each result
    equals ``adamw_ops``'s (what ``adamw_kernel`` runs off the CPU) bit for bit (``tests/test_optim_foreach.py``; not for half types,
    which ``adamw`` keeps off this path); on a GPU a handful of
    multi-tensor launches replace a dozen per parameter. Inputs are never modified."""
    bc2_sqrt, step_size = _bias_correction(count, lr=lr, b1=b1, b2=b2)
    new_p = torch._foreach_mul(ps, 1 - lr * weight_decay)
    new_m = torch._foreach_mul(ms, b1)
    torch._foreach_add_(new_m, torch._foreach_mul(gs, 1 - b1))
    new_v = torch._foreach_mul(gs, gs)
    torch._foreach_mul_(new_v, 1 - b2)
    torch._foreach_add_(new_v, torch._foreach_mul(vs, b2))
    upd = torch._foreach_sqrt(new_v)
    torch._foreach_div_(upd, bc2_sqrt)
    torch._foreach_add_(upd, eps)
    upd = torch._foreach_div(new_m, upd)
    torch._foreach_mul_(upd, step_size)
    torch._foreach_sub_(new_p, upd)
    return new_p, new_m, new_v


def adamw_foreach_(ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor], count: int, *,
                   lr: float, b1: float, b2: float, eps: float, weight_decay: float) -> None:
    """:func:`adamw_foreach` written into ``ps``, ``ms`` and ``vs`` (the operations of
    :func:`adamw_ops_`), the same bits (``tests/test_optim_foreach.py``)."""
    bc2_sqrt, step_size = _bias_correction(count, lr=lr, b1=b1, b2=b2)
    torch._foreach_mul_(ps, 1 - lr * weight_decay)
    torch._foreach_mul_(ms, b1)
    torch._foreach_add_(ms, torch._foreach_mul(gs, 1 - b1))
    t = torch._foreach_mul(gs, gs)
    torch._foreach_mul_(t, 1 - b2)
    torch._foreach_mul_(vs, b2)
    torch._foreach_add_(vs, t)
    torch._foreach_copy_(t, vs)  # sqrt(v) into the same temporaries: two sets alive at most
    torch._foreach_sqrt_(t)
    torch._foreach_div_(t, bc2_sqrt)
    torch._foreach_add_(t, eps)
    t = torch._foreach_div(ms, t)
    torch._foreach_mul_(t, step_size)
    torch._foreach_sub_(ps, t)


def adamw(
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> Optimizer:
    """Adam with decoupled weight decay (Loshchilov & Hutter), torch's defaults.

    Guarantees: elementwise; equals ``torch.optim.AdamW`` with the same arguments step for step
    (``property_tests/test_optim.py``). State: ``{"count": int, "mu": dict, "nu": dict}``, the
    moments shaped like the parameters (so a moment's sharding spec is its parameter's)."""
    b1, b2 = betas
    if not (lr >= 0 and 0 <= b1 < 1 and 0 <= b2 < 1 and eps >= 0 and weight_decay >= 0):
        raise ValueError(f"invalid adamw hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")

    def init(params: Params) -> OptState:
        return {
            "count": 0,
            "mu": {k: torch.zeros_like(v) for k, v in params.items()},
            "nu": {k: torch.zeros_like(v) for k, v in params.items()},
        }

    hyper = dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)

    def update(grads: Params, state: OptState, params: Params) -> tuple[Params, OptState]:
        check_same_keys(grads, params)
        count = state["count"] + 1  # type: ignore[operator]
        new_p, mu, nu = {}, {}, {}
        looped, batched = _split_by_path(params, grads, state)
        for k in looped:
            new_p[k], mu[k], nu[k] = adamw_kernel(params[k], grads[k], state["mu"][k], state["nu"][k],  # type: ignore[index]
                                                  count, **hyper)
        for keys in batched:
            outs = adamw_foreach([params[k] for k in keys], [grads[k] for k in keys],
                                 [state["mu"][k] for k in keys], [state["nu"][k] for k in keys],  # type: ignore[index]
                                 count, **hyper)
            for k, p, m, v in zip(keys, *outs):
                new_p[k], mu[k], nu[k] = p, m, v
        return {k: new_p[k] for k in params}, {"count": count, "mu": {k: mu[k] for k in params},
                                               "nu": {k: nu[k] for k in params}}

    def update_inplace(grads: Params, state: OptState, params: Params) -> tuple[Params, OptState]:
        check_same_keys(grads, params)
        count = state["count"] + 1  # type: ignore[operator]
        looped, batched = _split_by_path(params, grads, state)
        with torch.no_grad():
            for k in looped:
                adamw_kernel_(params[k], grads[k], state["mu"][k], state["nu"][k], count, **hyper)  # type: ignore[index]
            for keys in batched:
                adamw_foreach_([params[k] for k in keys], [grads[k] for k in keys],
                               [state["mu"][k] for k in keys], [state["nu"][k] for k in keys],  # type: ignore[index]
                               count, **hyper)
        return params, {**state, "count": count}

    def update_columns(p: Tensor, g: Tensor, slots: dict[str, Tensor], counts: Tensor, inplace: bool = False):
        if p.dim() != 2 or slots.keys() != {"mu", "nu"} or not adamw_loop.applies(p, g, slots["mu"], slots["nu"]):
            return None
        inplace = inplace and all(t.is_contiguous() for t in (p, slots["mu"], slots["nu"]))
        scalars = {c: _bias_correction(int(c) + 1, lr=lr, b1=b1, b2=b2) for c in torch.unique(counts).tolist()}
        per_col = [scalars[c] for c in counts.tolist()]
        new_p, mu, nu = adamw_loop.adamw_columns(p, g, slots["mu"], slots["nu"], keep=1 - lr * weight_decay, b1=b1,
                                                 b2=b2, bc2_sqrt=[x[0] for x in per_col], eps=eps,
                                                 step_size=[x[1] for x in per_col], inplace=inplace)
        return new_p, {"mu": mu, "nu": nu}

    return Optimizer(init, update, update_inplace, update_columns, recipe=(adamw, (lr, betas, eps, weight_decay)))
