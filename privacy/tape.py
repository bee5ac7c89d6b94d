"""The tape: one forward and ONE backward that yield every layer call's inputs and output grads.

While the model runs (through ``torch.func.functional_call``), a forward hook on every module
that owns a trainable parameter records the call's inputs and output. A single
``torch.autograd.grad`` of the summed loss with respect to all recorded outputs then gives each
call's output gradient. Parameters are not asked for, so autograd skips every weight-gradient
product; the weight gradients are rebuilt from the tape (``A^T diag(c) B``) after clipping.
This is the book-keeping trick: Opacus's ghost mode needs a second backward instead.

Side effects are confined here: hooks are added for the duration of :func:`record` (or of the
``taping`` context, its forward half) and removed in ``finally``; the model's own parameters are
never modified.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

from privacy.batch import split_inputs, unpack
from privacy.errors import PerExampleError
from privacy.example_rows import Known, example_rows
from privacy.layers import ROW_WISE, rule_for
from privacy.precision import exact, exact_dtype

Params = dict[str, Tensor]
LossFn = Callable[[Any, Tensor], Tensor]


@dataclass
class Call:
    """One call of a parameter-owning module: its inputs, output and (after backward) output grads."""

    module_name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    outputs: list[Any]  # autograd edges of the output tensors that require grad, in pytree order
    positions: list[int]  # their indices among the flattened outputs
    grads: list[Tensor] = field(default_factory=list)
    shapes: list[tuple[torch.Size, torch.dtype, torch.device]] = field(default_factory=list)
    weight_shapes: dict[str, torch.Size] = field(default_factory=dict)  # the module's own params during the call
    flowed: bool = True  # after backward: whether any gradient reached an output (else its grads are zeros)
    rows: int = 1  # > 1: called on the examples' rows flattened, k per example; args and grads are [B, k, ...]
    attributes: dict[str, Any] = field(default_factory=dict)  # attributes a rule reads, as they were during the call


@dataclass
class Tape:
    calls: list[Call]
    losses: Tensor  # (B,) per-example losses, detached


def owners(model: nn.Module, params: Params) -> dict[str, dict[str, str]]:
    """``{module_name: {local_param_name: canonical_name}}`` for every module that directly owns
    a trainable parameter. A tied tensor owned by two modules maps to one canonical name (the
    key under which ``model.named_parameters()`` lists it), so its calls add up."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    unknown = sorted(set(params) - set(canonical.values()))
    if unknown:
        raise KeyError(f"params not in the model (or not canonical names of tied weights): {unknown}")
    table: dict[str, dict[str, str]] = {}
    for mod_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            name = canonical.get(id(p))
            if name in params:
                table.setdefault(mod_name, {})[local] = name
    return table


def record(
    model: nn.Module,
    params: Params,
    batch: tuple[Any, Tensor],
    loss_fn: LossFn,
    *,
    run_model: Callable[[Any], Any] | None = None,
) -> Tape:
    """Run the model on ``batch`` with ``params`` and return the tape of every call of a
    parameter-owning module with its output gradient (of the SUM of per-example losses).

    ``batch = (inputs, targets[, mask])``: ``inputs`` as :func:`privacy.batch.split_inputs`
    reads them (a mapping is passed as keyword arguments); the mask is not read here (the
    tape covers every row; ``privacy.clipping.clip_and_sum`` weighs masked rows by zero).
    ``run_model(inputs)``, if given, runs the model on the inputs as given instead of
    ``functional_call(model, params, args, kwargs)``: the sharded runtime passes one that
    gathers each unit's parameters on the fly (``params`` then only names the trainable
    parameters).

    A call whose inputs and outputs all have a leading dimension of 1 (transformers looks up
    position ids of shape ``[1, T]`` and lets the sum broadcast them over the batch) is shared by
    every example: its outputs are expanded to the batch before the model goes on, so each
    example gets its own output gradient and per-example contribution; recorded inputs with a
    leading 1 are expanded likewise (``tests/test_hf_unmodified.py``).

    Raises :class:`privacy.errors.PerExampleError` (a ``ValueError``) naming the module if a
    call's output lacks the batch dimension (such a layer mixes examples, so it has no
    per-example gradient) or an input leads with neither the batch dimension nor 1."""
    inputs, targets, _ = unpack(batch)
    args, kwargs = split_inputs(inputs)
    batch_size = targets.shape[0]
    live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with taping(model, params, batch_size) as calls, torch.enable_grad():
        losses = loss_fn(run_model(inputs) if run_model else functional_call(model, live, args, kwargs), targets)
        _check_losses(losses, batch_size)
    fill_grads(calls, losses.sum())
    return Tape(calls, losses.detach())


@contextlib.contextmanager
def taping(model: nn.Module, params: Params, batch_size: int) -> Iterator[list[Call]]:
    """Inside, every call of a module owning one of ``params`` (canonical names) is appended to
    the yielded list, with its inputs and the autograd edges of its outputs (``fill_grads``
    later gives them their gradients). The forward half of :func:`record`, for runtimes that
    run the backward themselves (a pipeline stage starts it from a received gradient).

    A call shared by every example (leading dimension 1 throughout) has its outputs expanded to
    ``batch_size``; see :func:`record`. Raises :class:`privacy.errors.PerExampleError` naming the
    module if a call's inputs or outputs break the batch-first rule, and naming the last expanded
    shared call if the forward then fails with a shape error (the model did not broadcast its
    output: ``tests/test_hf_families.py::test_deberta_under_ghost_names_the_shared_call_it_cannot_follow``)."""
    table = owners(model, params)
    calls: list[Call] = []
    names = {id(m): n for n, m in model.named_modules() if n in table}
    modules = dict(model.named_modules())

    known: Known = {}  # the autograd node of each output of a call on example rows -> rows per example
    expanded: list[str] = []  # the modules whose shared outputs were expanded to the batch

    def hook(module: nn.Module, call_args: tuple, call_kwargs: dict, output: Any) -> Any:
        name = names[id(module)]
        leaves, spec = tree_flatten(output)
        positions = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
        layout = _layout(name, module, call_args, call_kwargs, [leaves[i] for i in positions], batch_size, known)
        expand = layout == SHARED
        if expand:  # one copy per example, so that each gets its own output gradient
            expanded.append(name)
            for i in positions:
                leaves[i] = _expand(leaves[i], batch_size)
        outs = [leaves[i] for i in positions]
        rows = max(layout, 1)
        known.update((t.grad_fn, rows) for t in outs if rows > 1 and t.grad_fn is not None)
        # Edges, not tensors: holding the outputs would keep every layer's output alive through
        # the backward after autograd itself has released it.
        # the parameter shapes as called: a sharded runtime swaps in its blocks for the call only
        calls.append(Call(name, module, tuple(_per_example(_expand(a, batch_size), batch_size, rows) for a in call_args),
                          {k: _expand(v, batch_size) for k, v in call_kwargs.items()},
                          [get_gradient_edge(t) for t in outs], positions,
                          shapes=[(t.shape, t.dtype, t.device) for t in outs],
                          weight_shapes={k: p.shape for k, p in module.named_parameters(recurse=False)}, rows=rows,
                          attributes={a: getattr(module, a) for a in AS_CALLED if hasattr(module, a)}))
        return tree_unflatten(leaves, spec) if expand else None

    # prepend: the tape records what the module itself returned, before any other hook (a
    # tensor-parallel style's collective, say) rewrites its output
    handles = [modules[n].register_forward_hook(hook, with_kwargs=True, prepend=True) for n in table]
    try:
        yield calls
    except RuntimeError as e:  # a shape error after an expansion: the model did not broadcast that output
        if expanded and any(w in str(e).lower() for w in ("size", "shape", "dimension")):
            raise PerExampleError(expanded[-1], type(modules[expanded[-1]]).__name__, _EXPANDED.format(
                batch=batch_size, error=str(e).splitlines()[0] if str(e) else type(e).__name__)) from e
        raise
    finally:
        for h in handles:
            h.remove()


def fill_grads(calls: list[Call], root: Tensor, grad_root: Tensor | None = None,
               inputs: tuple[Tensor, ...] = ()) -> tuple[Tensor | None, ...]:
    """The backward half of :func:`record`: ONE ``autograd.grad`` from ``root`` (seeded with
    ``grad_root``) to every recorded call output and to ``inputs``; each call gets its output
    gradients (zeros where none flowed; ``flowed`` False when none did at all) and drops its
    edges. Returns the gradients of
    ``inputs`` (``None`` where none flowed). Captured bf16 or fp16 inputs and output gradients
    (a forward under :func:`privacy.precision.compute_in`) are kept upcast to fp32, so every
    norm and clipped sum is formed in fp32 (``tests/test_precision.py``)."""
    wanted = [t for c in calls for t in c.outputs]
    targets = [*inputs, *wanted]
    grads = torch.autograd.grad(root, targets, grad_root, allow_unused=True) if targets else ()
    it = iter(grads[len(inputs):])
    for c in calls:
        got = [next(it) for _ in c.shapes]
        c.flowed = any(g is not None for g in got)
        # a forward under bf16 (privacy.precision) captured bf16 tensors: norms and clipped sums
        # are formed from them upcast to fp32, never in bf16
        c.grads = [exact(g) if g is not None else torch.zeros(s, dtype=exact_dtype(d), device=v)
                   for (s, d, v), g in zip(c.shapes, got)]
        if c.rows > 1:  # rows of examples -> [B, k, ...], as the call's inputs were recorded
            c.grads = [g.reshape(g.shape[0] // c.rows, c.rows, *g.shape[1:]) for g in c.grads]
        c.args = tuple(exact(a.detach()) if isinstance(a, Tensor) else a for a in c.args)
        c.kwargs = {k: exact(v) for k, v in c.kwargs.items()}
        c.outputs = []
    return tuple(grads[:len(inputs)])


def _expand(t: Any, batch_size: int) -> Any:
    """``t`` with a leading dimension of 1 broadcast to ``batch_size`` (a view, no copy);
    anything else unchanged."""
    if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == 1 and batch_size != 1:
        return t.expand(batch_size, *t.shape[1:])
    return t


AS_CALLED = ("padding_idx",)
"""Module attributes a rule reads that a runtime may change for the call only (a vocabulary-
parallel embedding's ``padding_idx`` is made local to the rank's rows): recorded per call."""

SHARED, BATCH_FIRST = 0, 1  # a call's layout (_layout); k > 1: the examples' rows, k each


def _layout(name: str, module: nn.Module, args: tuple, kwargs: dict, outs: list[Tensor], batch_size: int,
            known: Known) -> int:
    """A call's layout: ``SHARED`` when all its outputs (and tensor inputs) have a leading
    dimension of 1 while the batch has ``batch_size > 1`` (transformers' ``[1, T]`` position
    ids): its outputs are then expanded to the batch, which broadcasting against the batch
    would do anyway, so that each example gets its own output gradient. ``k > 1`` when the
    module is row-wise (``layers.ROW_WISE``), takes no keyword tensors, and every tensor input
    is proven to hold the examples' rows, ``k`` each (``example_rows``), every output having as
    many rows. Else ``BATCH_FIRST``: every tensor input must lead with the batch dimension or
    1, and every output with the batch dimension; raises :class:`PerExampleError` naming the
    module when not."""
    inputs = [a for a in args if isinstance(a, Tensor)]
    lead = lambda t: t.shape[0] if t.dim() else None  # noqa: E731
    if batch_size != 1 and outs and all(lead(t) == 1 for t in (*inputs, *outs)):
        return SHARED
    if all(lead(t) in (batch_size, 1) for t in inputs) and all(lead(t) == batch_size for t in outs):
        return BATCH_FIRST
    rows = _example_rows_call(module, inputs, kwargs, outs, batch_size, known)
    if rows:
        return rows
    for t in inputs:
        if lead(t) not in (batch_size, 1):
            merged = lead(t) is not None and lead(t) % batch_size == 0 and lead(t) > batch_size
            raise PerExampleError(name, type(module).__name__, f"sees an input of shape {tuple(t.shape)} without "
                                  f"the batch dimension {batch_size} first; per-example gradients need batch-first "
                                  "layers (or a leading 1 for an input shared by every example)" +
                                  (_MERGED if merged else ""))
    for t in outs:
        if lead(t) != batch_size:
            raise PerExampleError(name, type(module).__name__, f"returns a tensor of shape {tuple(t.shape)} without "
                                  f"the batch dimension {batch_size} first: it mixes or drops examples, so it has "
                                  "no per-example gradient")
    return BATCH_FIRST


_EXPANDED = ("returns an output shared by every example (leading dimension 1), which the tape expanded to the "
             "batch ({batch}) so that each example gets its own gradient; the model then failed on shapes ({error}): it uses "
             "that output otherwise than by broadcasting it against the batch (DeBERTa repeats its relative "
             "embeddings per head), so ghost clipping cannot follow it. method='vmap' computes per-example "
             "gradients for any layout")

_MERGED = ("; its rows could not be proven to be the examples' in order (a row-wise layer on a reshape of a "
           "batch-first tensor, through elementwise operations, is accepted: privacy/example_rows.py); "
           "method='vmap' computes per-example gradients for any layout")


def _example_rows_call(module: nn.Module, inputs: list[Tensor], kwargs: dict, outs: list[Tensor], batch_size: int,
                       known: Known) -> int:
    """``k`` when the call is a row-wise layer on proven example rows (see :func:`_layout`), else 0."""
    if not inputs or rule_for(module) not in ROW_WISE or any(isinstance(v, Tensor) for v in kwargs.values()):
        return 0
    ks = {example_rows(t, batch_size, known) for t in inputs}
    if len(ks) != 1 or None in ks:
        return 0
    k = ks.pop()
    return k if all(t.dim() and t.shape[0] == k * batch_size for t in outs) else 0


def _per_example(t: Any, batch_size: int, rows: int) -> Any:
    """An input of a call on example rows as ``[B, k, ...]``; anything else unchanged."""
    if rows > 1 and isinstance(t, Tensor):
        return t.reshape(batch_size, rows, *t.shape[1:])
    return t


def _check_losses(losses: Tensor, batch_size: int) -> None:
    if losses.shape != (batch_size,):
        raise ValueError(
            f"loss_fn must return one loss per example, shape ({batch_size},); got {tuple(losses.shape)}"
        )
