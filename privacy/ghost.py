"""Per-parameter contributions from a tape, with a per-module vmap fallback.

For each call on the tape, the module's ghost rule (``layers.py``) turns (inputs, output grad)
into factored or dense contributions. A module without a rule either raises
(``method="ghost"``) or, with ``method="auto"``, gets its own per-example gradients by a vmap
over that module alone: ``grad_p <f(p, x_i), dL/dy_i>`` on the call's recorded input ``x_i``
and output gradient. That is exact for any batch-first module, and costs one extra forward and
backward of that module only, never of the whole model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from privacy.contributions import Contribution, Dense
from privacy.errors import UnsupportedLayerError
from privacy.layers import rule_for
from privacy.tape import Call, Params, Tape, owners


def contributions(model: nn.Module, params: Params, tape: Tape, *, method: str) -> dict[str, list[Contribution]]:
    """``{canonical param name: [contribution of each call]}`` for every trainable parameter
    that took part in the forward. Raises :class:`UnsupportedLayerError` naming the module
    when ``method == "ghost"`` and a module has no ghost rule."""
    table = owners(model, params)
    parts: dict[str, list[Contribution]] = defaultdict(list)
    for call in tape.calls:
        direct = table[call.module_name]
        rule = rule_for(call.module)
        if rule is not None and len(call.grads) == 1 and not call.kwargs:
            for local, contrib in as_called(rule, call).items():
                if local in direct:
                    parts[direct[local]].extend(contrib if isinstance(contrib, list) else [contrib])
        elif method == "ghost":
            raise UnsupportedLayerError(
                f"module {call.module_name!r} ({type(call.module).__name__}) has no ghost rule; "
                "use method='auto' to fall back to vmap for it, or method='vmap'"
            )
        else:
            for local, g in module_per_sample_grads(model, params, call, direct).items():
                parts[direct[local]].append(Dense(g))
    return parts


def as_called(rule: Callable, call: Call) -> dict[str, Contribution | list[Contribution]]:
    """``rule``'s contributions for ``call``, the module's attributes a rule reads set as they
    were during the call (``Call.attributes``: a vocabulary-parallel embedding's rank-local
    ``padding_idx``) while it runs, and restored; nothing is set where they are already so.
    Proven by ``tests/test_tensor_parallel_hf.py::test_hf_llama_private_tensor_parallel_with_a_padding_token``."""
    module = call.module
    saved = {a: getattr(module, a) for a, v in call.attributes.items() if getattr(module, a) != v}
    try:
        for a in saved:
            setattr(module, a, call.attributes[a])
        return rule(module, call.args, call.grads[0], call.weight_shapes)
    finally:
        for a, v in saved.items():
            setattr(module, a, v)


def module_per_sample_grads(model: nn.Module, params: Params, call: Call, direct: dict[str, str]) -> dict[str, Tensor]:
    """Per-example gradients ``[B, *shape]`` of the module's own trainable parameters (local
    names) for one recorded call, by vmap over the module alone."""
    module = call.module
    canonical = {id(p): n for n, p in model.named_parameters()}
    fixed = {}
    for local, p in module.named_parameters(remove_duplicate=False):
        name = canonical.get(id(p))
        fixed[local] = (params[name] if name in params else p).detach()
    trainable = {local: fixed[local] for local in direct}
    if not call.grads:
        return {}  # no output needed a gradient: the parameters got none from this call
    batch_size = call.grads[0].shape[0]
    # positional tensors lead with the batch (the tape checked); a keyword tensor is split per
    # example when it does (a leading 1 was expanded on the tape), else shared by all
    leaves, spec = tree_flatten((call.args, call.kwargs))
    dims = [0 if isinstance(a, Tensor) and a.dim() and a.shape[0] == batch_size else None for a in leaves]
    positions = call.positions

    def inner(diff: Params, example: list, grads: tuple) -> Tensor:
        args, kwargs = tree_unflatten([a if d is None else a.unsqueeze(0) for a, d in zip(example, dims)], spec)
        out = functional_call(module, {**fixed, **diff}, args, kwargs)
        outs = tree_flatten(out)[0]
        return sum((outs[k] * g.unsqueeze(0)).sum() for k, g in zip(positions, grads))

    in_dims = (None, dims, tuple(0 for _ in call.grads))
    return vmap(grad(inner), in_dims=in_dims)(trainable, leaves, tuple(call.grads))
