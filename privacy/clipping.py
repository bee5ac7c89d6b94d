"""Per-example norms and clipped gradient sums: the public entry points of DP-SGD's hard part.

``method`` chooses how per-example norms are obtained:

* ``"vmap"``  — instantiate per-example gradients of the whole model (reference, memory heavy);
* ``"ghost"`` — book-keeping from one forward and one backward; a layer without a ghost rule
  raises :class:`UnsupportedLayerError` naming it;
* ``"auto"``  — ghost, with a per-module vmap for the layers that have no rule.

Within ghost, a parameter's per-example gradients are either instantiated once and reused for
its norm and its clipped sum, or never formed (Gram-form norm, ``L^T diag(c) R`` sum); the cost
rules in ``contributions.py`` decide from shapes only, within a memory budget equal to the
tape's own activations and output gradients. The largest remaining parameters (the GPT's LM
head) are then streamed example by example once every other norm is known (``streaming.py``):
their per-example gradients are formed one at a time, so their Gram products are skipped.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from privacy import contributions as C
from privacy.clipped_sums import ClippedSums
from privacy.errors import NonFiniteGradientError, PrivacyError
from privacy.ghost import contributions
from privacy.per_sample import flat_sq_norms, per_sample_grads
from privacy.streaming import choose_streamed, stream_clipped_sums
from privacy.batch import split_inputs, unpack
from privacy.tape import LossFn, Params, record
from privacy.validate import check_model

METHODS = ("auto", "ghost", "vmap")
CLIPPINGS = ("flat", "automatic", "opacus_flat")
AUTOMATIC_STABILITY = 0.01  # gamma of automatic clipping (Bu et al.): factor C / (norm + gamma)
OPACUS_STABILITY = 1e-6  # what Opacus adds to each norm in its flat clipping factor


def clip_factors(norms: Tensor, clip_norm: float, clipping: str = "flat") -> Tensor:
    """Per-example scale ``c_i`` so that ``c_i * norm_i <= clip_norm``.

    Guarantees (``property_tests/test_clipping_properties.py::test_every_clipped_contribution_is_within_clip_norm``):
    ``"flat"``: ``c_i = min(1, clip_norm / norm_i)``; ``"automatic"``: ``c_i = clip_norm /
    (norm_i + 0.01)``; ``"opacus_flat"``: Opacus' flat clipping, ``c_i = min(1, clip_norm /
    (norm_i + 1e-6))`` (its entry, :mod:`privacy.opacus`, gives Opacus' parameters bit for bit
    in float64 up to summation order). All give ``c_i * norm_i <= clip_norm``.

    Edge cases: ``norm_i == 0`` -> ``c_i = 1`` (flat) or ``clip_norm / 0.01`` (automatic; the
    contribution is 0 anyway); ``clip_norm == inf`` -> ``c_i = 1`` (flat: no clipping; automatic
    rejects it); ``clip_norm <= 0`` or NaN -> :class:`PrivacyError`."""
    _check_clip_norm(clip_norm, clipping)
    if clipping == "automatic":
        return clip_norm / (norms + AUTOMATIC_STABILITY)
    if math.isinf(clip_norm):
        return torch.ones_like(norms)
    if clipping == "opacus_flat":
        return torch.clamp(clip_norm / (norms + OPACUS_STABILITY), max=1.0)
    return torch.clamp(clip_norm / norms, max=1.0)


def _check_clip_norm(clip_norm: float, clipping: str) -> None:
    if clipping not in CLIPPINGS:
        raise PrivacyError(f"clipping must be one of {CLIPPINGS}, got {clipping!r}")
    if not clip_norm > 0:
        raise PrivacyError(f"clip_norm must be > 0, got {clip_norm}")
    if clipping == "automatic" and math.isinf(clip_norm):
        raise PrivacyError("automatic clipping needs a finite clip_norm")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise PrivacyError(f"method must be one of {METHODS}, got {method!r}")


def per_sample_norms(
    model: nn.Module, params: Params, batch: tuple[Any, Tensor], loss_fn: LossFn, *, method: str = "auto"
) -> Tensor:
    """``[B]`` L2 norms of each example's gradient over all trainable ``params``.

    Guarantees: ghost and auto equal vmap norms (float64, rtol 1e-8:
    ``property_tests/test_ghost_properties.py::test_ghost_norms_equal_vmap_norms``), tied
    parameters included (cross terms, not a sum of separate norms)."""
    _check_method(method)
    check_model(model)
    if batch[1].shape[0] == 0:
        return next(iter(params.values())).new_zeros(0)
    if method == "vmap":
        return flat_sq_norms(per_sample_grads(model, params, batch, loss_fn)).sqrt()
    tape = record(model, params, batch, loss_fn)
    parts = contributions(model, params, tape, method=method)
    return _sq_norms(parts, params, tape.losses).sqrt()


def _sq_norms(parts: dict[str, list[C.Contribution]], params: Params, losses: Tensor) -> Tensor:
    total = losses.new_zeros(losses.shape[0], dtype=next(iter(params.values())).dtype)
    for name, plist in parts.items():
        total = total + C.sq_norms(plist, params[name].shape)
    return total


def clipped_grad(
    model: nn.Module,
    params: Params,
    batch: tuple[Any, Tensor],
    loss_fn: LossFn,
    *,
    clip_norm: float,
    method: str = "auto",
    clipping: str = "flat",
    nonfinite: str = "raise",
) -> tuple[dict[str, Tensor], Tensor]:
    """The sum over examples of clipped per-example gradients, and the per-example norms.

    Returns ``(grads, norms)``: ``grads[name] = sum_i c_i g_i[name]`` for every name in
    ``params`` (zeros for parameters the forward did not use), ``c_i`` from :func:`clip_factors`.

    Guarantees (each proved in ``property_tests/test_clipping_properties.py``):
      * ``clip_norm = inf`` gives the gradient of the summed loss (the non-private baseline);
      * ghost/auto equal the sum of clipped vmap per-example gradients;
      * every example's clipped contribution has norm <= clip_norm, so replacing one example
        changes the sum by at most ``2 * clip_norm`` (add/remove: ``clip_norm``);
      * ghost/auto run ONE forward and ONE backward (book-keeping), not two.

    Edge cases: empty batch -> zero gradients and empty norms; ``clip_norm <= 0`` ->
    :class:`PrivacyError`; a non-finite per-example norm -> :class:`NonFiniteGradientError`
    listing the examples, or with ``nonfinite="zero"`` those examples contribute nothing; a module
    that mixes examples (BatchNorm in training mode) -> :class:`privacy.errors.PerExampleError`
    naming it (:func:`privacy.validate.check_model`).

    A batch ``(inputs, targets, mask)`` (``privacy.padding``): an example with ``mask`` False
    contributes exactly zero to the sum and reports norm 0 (whatever its inputs, NaN included),
    so a padded batch gives the unpadded batch's sums (``property_tests/
    test_padded_batch_properties.py``)."""
    check_model(model)
    result = clip_and_sum(model, params, batch, loss_fn, clip_norm=clip_norm, method=method,
                          clipping=clipping, nonfinite=nonfinite)
    return result.grads, result.norms


def clip_per_sample(per_sample: Mapping[str, Tensor], params: Params, *, clip_norm: float, clipping: str = "flat",
                    nonfinite: str = "raise") -> tuple[dict[str, Tensor], Tensor]:
    """:func:`clipped_grad` with ``method="vmap"`` from per-example gradients already formed
    (``per_sample``: ``{name: [B, *shape]}``, :func:`privacy.per_sample.per_sample_grads` of
    the same batch): ``(sum_i c_i g_i for every name in params, norms)``, the same operations
    and so the same bits as ``clipped_grad`` forming them itself (the Opacus entry forms them
    at ``backward`` for ``p.grad_sample``: ``tests/test_opacus_entry.py::
    test_grad_sample_after_backward_is_opacus_s``). A name of ``params`` without per-example
    gradients sums to zeros; an empty batch gives zeros and empty norms; non-finite norms as
    :func:`clipped_grad`."""
    _check_clip_norm(clip_norm, clipping)
    if nonfinite not in ("raise", "zero"):
        raise PrivacyError(f"nonfinite must be 'raise' or 'zero', got {nonfinite!r}")
    if any(g.shape[0] == 0 for g in per_sample.values()) or not per_sample:
        zero = next(iter(params.values())).new_zeros(0)
        return {k: torch.zeros_like(v) for k, v in params.items()}, zero
    parts = {k: [C.Dense(g)] for k, g in per_sample.items()}
    norms = flat_sq_norms(dict(per_sample)).sqrt()
    factors, parts = guarded_clip_factors(norms, parts, clip_norm, clipping, nonfinite)
    return dict(ClippedSums(parts, factors, params).items()), norms


class ShardedNorms(NamedTuple):
    """How each example's squared norm is completed when ranks hold disjoint parts of every
    example's gradient (tensor parallelism): this rank adds the parameters in ``counted`` (a
    parameter whose gradient every rank holds whole is counted on one rank only), and
    ``all_reduce`` sums a ``[B, ...]`` tensor over the ranks that share the examples. The
    per-example gradients of the parameters in ``partial`` are themselves sums over those ranks
    (sequence parallelism: each saw a chunk of the sequence); they are summed (one
    ``all_reduce`` of all of them at once) before their norms, while each rank's clipped sum
    keeps its own part."""

    counted: frozenset[str]
    all_reduce: Callable[[Tensor], Tensor]
    partial: frozenset[str] = frozenset()


class ClipResult(NamedTuple):
    grads: Mapping[str, Tensor]  # sum_i c_i g_i (a dict, or a ClippedSums with lazy=True)
    norms: Tensor  # (B,) per-example gradient norms before clipping
    losses: Tensor  # (B,) per-example losses (detached)


def clip_and_sum(
    model: nn.Module,
    params: Params,
    batch: tuple[Any, Tensor],
    loss_fn: LossFn,
    *,
    clip_norm: float,
    method: str = "auto",
    clipping: str = "flat",
    nonfinite: str = "raise",
    run_model: Callable[[tuple], Any] | None = None,
    sharded_norms: ShardedNorms | None = None,
    lazy: bool = False,
) -> ClipResult:
    """:func:`clipped_grad` plus the per-example losses the forward computed anyway.

    ``run_model`` replaces ``functional_call`` for the ghost/auto forward (see
    ``privacy.tape.record``); the sharded runtime uses it to gather parameters per unit.
    ``sharded_norms`` (ghost/auto only): ``params`` hold this rank's part of every example's
    gradient; the norms are completed by ``sharded_norms.all_reduce`` before any clipping, so
    every rank clips with the full norms and forms the clipped sum of its own part, still with
    one backward (``property_tests/test_tensor_parallel_properties.py``). Streaming is off then
    (it would need one all-reduce per example). With a mask (a batch's third entry) the
    masked rows of ``norms`` and ``losses`` are exactly 0 and add nothing to ``grads``.
    ``lazy=True``: ``grads`` is a :class:`privacy.clipped_sums.ClippedSums` that forms each
    parameter's sum when it is taken (``pop``) and releases that parameter's factors, the same
    bits as the dict (the sharded runtime reduces the sums unit by unit as they are formed)."""
    _check_method(method)
    _check_clip_norm(clip_norm, clipping)
    if nonfinite not in ("raise", "zero"):
        raise PrivacyError(f"nonfinite must be 'raise' or 'zero', got {nonfinite!r}")
    inputs, targets, mask = unpack(batch)
    if targets.shape[0] == 0:
        zero = next(iter(params.values())).new_zeros(0)
        return ClipResult({k: torch.zeros_like(v) for k, v in params.items()}, zero, zero)
    batch = (inputs, targets)
    sums: dict[str, Tensor] = {}  # clipped sums already formed by streaming
    if sharded_norms is not None and method == "vmap":
        raise PrivacyError("sharded norms need method 'ghost' or 'auto'")
    if method == "vmap":
        if run_model is not None:
            raise PrivacyError("method='vmap' cannot run with a custom run_model (sharded runs use ghost/auto)")
        per_sample = per_sample_grads(model, params, batch, loss_fn)
        parts = {k: [C.Dense(g)] for k, g in per_sample.items()}
        sq = flat_sq_norms(per_sample)
        with torch.no_grad():
            args, kwargs = split_inputs(inputs)
            losses = loss_fn(functional_call(model, params, args, kwargs), targets)
    else:
        tape = record(model, params, batch, loss_fn, run_model=run_model)
        parts = contributions(model, params, tape, method=method)
        losses = tape.losses
        del tape  # the contributions hold what is still needed; reuse below frees factors as it goes
        shapes = {n: p.shape for n, p in params.items()}
        parts = C.instantiate_for_reuse(parts, shapes)
        streamed = choose_streamed(parts, shapes) if sharded_norms is None else []
        counted = sharded_norms.counted if sharded_norms is not None else parts
        summed = sharded_norms.partial if sharded_norms is not None else frozenset()
        sq = _sq_norms({k: v for k, v in parts.items() if k not in streamed and k in counted and k not in summed},
                       params, losses)
        if sharded_norms is not None:
            sq = sharded_norms.all_reduce(sq + summed_sq_norms(parts, shapes, sharded_norms, losses))
        if streamed:  # these go last, one example at a time, once every other norm is known
            sums, sq = stream_clipped_sums({k: parts.pop(k) for k in streamed}, shapes, sq,
                                           lambda norm: clip_factors(norm, clip_norm, clipping), keep=mask)
    norms = sq.sqrt()
    factors, parts = guarded_clip_factors(norms, parts, clip_norm, clipping, nonfinite, keep=mask)
    clipped = ClippedSums(parts, factors, params, ready=sums)
    grads = clipped if lazy else dict(clipped.items())
    if mask is not None:  # padding rows report nothing: they drop out of every sum and mean
        norms = torch.where(mask, norms, torch.zeros_like(norms))
        losses = torch.where(mask, losses, torch.zeros_like(losses))
    return ClipResult(grads, norms, losses)


def summed_sq_norms(parts: dict[str, list[C.Contribution]], shapes: dict, sharded: ShardedNorms,
                    losses: Tensor) -> Tensor:
    """Per-example squared norms (``[B]``, ``losses``' length and dtype) of the ``sharded.partial``
    parameters' gradients summed over the ranks (ONE all-reduce of all their instantiated
    ``[B, n]`` gradients), for the parameters this rank counts (every rank holds the same sums;
    the caller all-reduces the total). Zeros, and no collective, when ``parts`` has none of them.
    Proven with the runs it completes: ``property_tests/test_tensor_parallel_properties.py``
    (sequence parallelism), ``tests/test_tensor_parallel_hf.py::test_qwen3_plan_runs_qwen3_unmodified``."""
    sq = losses.new_zeros(losses.shape[0])
    names = sorted(n for n in sharded.partial if n in parts)
    if not names:
        return sq
    blocks = [C.instantiate_sum(parts[n], shapes[n]).reshape(losses.shape[0], -1) for n in names]
    whole = sharded.all_reduce(torch.cat(blocks, 1))
    start = 0
    for name, block in zip(names, blocks):
        if name in sharded.counted:
            sq = sq + whole[:, start:start + block.shape[1]].square().sum(1)
        start += block.shape[1]
    return sq


def deferred_clip_factors(norms: Tensor, parts: dict, clip_norm: float, clipping: str, nonfinite: str,
                          keep: Tensor | None = None) -> tuple[Tensor, dict, Tensor]:
    """:func:`guarded_clip_factors` without its read: ``(c, parts, real_bad)``, reading nothing
    from the device. ``real_bad`` marks the real (not padding) examples whose norm is not
    finite; with ``nonfinite="raise"`` the caller must raise
    :class:`NonFiniteGradientError` for them before it uses any sum formed with ``c`` (for
    them ``c_i = 0`` but their rows of ``parts`` are left as they are, so those sums may be NaN).
    Rows that must add nothing (non-finite padding, and with ``nonfinite="zero"`` every
    non-finite example) are zeroed in ``parts`` unconditionally (``where``; where none is, the
    same values). Otherwise the factors and sums are those of :func:`guarded_clip_factors`, bit
    for bit: the pipelined step (``fsdpx.runtime.pipeline``) clips through it and reads every
    microbatch's ``real_bad`` once (``tests/test_step_syncs.py::
    test_a_pipelined_private_step_reads_nothing_but_the_guard``; raising:
    ``tests/test_pipeline.py::test_a_pipelined_private_step_names_a_non_finite_example``)."""
    bad = ~torch.isfinite(norms)
    use = ~bad if keep is None else keep & ~bad
    safe = torch.where(use, norms, torch.zeros_like(norms))
    factors = torch.where(use, clip_factors(safe, clip_norm, clipping), torch.zeros_like(norms))
    if keep is not None or nonfinite == "zero":
        parts = {k: C.mask_examples(v, ~bad) for k, v in parts.items()}
    return factors, parts, bad if keep is None else bad & keep


def guarded_clip_factors(norms: Tensor, parts: dict, clip_norm: float, clipping: str, nonfinite: str,
                         keep: Tensor | None = None) -> tuple[Tensor, dict]:
    """``(c, parts)``: each example's clipping factor, and ``parts`` with the rows of examples
    that must add nothing zeroed when their norm is not finite (``where``: NaN-safe). An
    example masked out by ``keep`` (padding) gets ``c_i = 0`` and never raises; one with a
    non-finite norm raises :class:`NonFiniteGradientError` or (``nonfinite="zero"``) gets 0.
    ``clip_and_sum`` and the pipelined step's deferred clipping (``fsdpx.runtime.pipeline``)
    both clip through it (``tests/test_clipping.py::test_non_finite_examples_are_named_or_zeroed``;
    padding: ``property_tests/test_padded_batch_properties.py::
    test_a_padding_row_of_nan_contributes_nothing``)."""
    bad = ~torch.isfinite(norms)
    if keep is None and not bad.any():
        return clip_factors(norms, clip_norm, clipping), parts
    real_bad = bad if keep is None else bad & keep
    if nonfinite == "raise" and real_bad.any():
        raise NonFiniteGradientError(real_bad.nonzero().flatten().tolist())
    use = ~bad if keep is None else keep & ~bad
    safe = torch.where(use, norms, torch.zeros_like(norms))
    factors = torch.where(use, clip_factors(safe, clip_norm, clipping), torch.zeros_like(norms))
    if bad.any():  # 0 * inf is NaN: those rows are zeroed in the factors themselves
        parts = {k: C.mask_examples(v, ~bad) for k, v in parts.items()}
    return factors, parts
