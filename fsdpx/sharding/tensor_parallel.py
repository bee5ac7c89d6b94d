"""Tensor parallelism as data: styles per module, resolved to one layout per parameter.

A ``TensorParallel`` plan maps module-name patterns to styles (torchtitan's plans, Megatron's
layers); ``resolve(model, plan, strategy, mesh)`` matches them against the model, checks that
the ``tp`` degree fits every size the styles split, and returns a ``ShardingPlan``: each
parameter's compute layout over ``tp``, with the data-parallel ``strategy`` applied on top
(``Strategy.layout_over``). The runtime executes the plan's module styles with hooks
(``fsdpx.runtime.tensor_parallel``); nothing here runs.

Styles (``[out, in]`` is ``nn.Linear``'s weight; Hugging Face's ``Conv1D`` stores ``[in, out]``
and is handled by reading the module):

=========================  =============================  ================================
style                      parameters (compute layout)    activations
=========================  =============================  ================================
``ColumnParallel``         weight rows (out) over ``tp``;  input replicated (entered here
                           bias over ``tp``; ``fused``    unless ``enter=False``); output
                           blocks (q|k|v) each split by   keeps its features split
                           heads, never inside a head
``RowParallel``            weight columns (in) over       input split on features; output
                           ``tp``; bias replicated,       partial, summed over ``tp``, then
                           added once after the sum       the bias is added
``VocabParallelEmbedding`` rows (vocabulary) over ``tp``  ids outside the rank's rows are
                                                          masked; output partial, summed
``EnterParallel``          none                           the region-entry operator at
                                                          this module's input, once for the
                                                          column layers inside it
``LocalAttributes``        none                           integer attributes that count
                                                          output features are divided by
                                                          ``tp`` during the step
``SequenceParallel``       none                           (sequence parallelism) the first
                                                          input is cut to the rank's chunk
                                                          of the sequence
``ReplicatedOnSplit``      replicated; the raw gradient   the module runs as written on the
                           is partial over ``tp``,        rank's split features (Qwen3's
                           summed over it                 per-head query/key norms)
=========================  =============================  ================================

``ColumnParallel(vocab=True)`` is the LM head: its output logits stay split over the vocabulary
and the loss is computed on the shards (``fsdpx.runtime.vocab_parallel``). Entering a region
is Megatron's ``f`` (identity forward, all-reduce of the input gradient backward); leaving
(row-parallel and embedding outputs) is ``g`` (all-reduce forward, identity backward).

Patterns match module names component by component, ``*`` standing for one component
(``"blocks.*.attn.qkv"``), as in torchtitan and Hugging Face's ``tp_plan``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Union

from torch import nn

from .layout import chunk_bounds
from .mesh import Mesh
from .plan import ParamLayout, ShardingPlan, fused_view
from .spec import Spec
from .strategies import Strategy


PARTIAL = "partial"  # a parameter spec's flag: its raw gradient is partial over tp whatever the plan


class TensorParallelPlanError(ValueError):
    """A tensor-parallel plan that does not fit the model or the mesh; the message names the
    module (or pattern) and the size."""


@dataclass(frozen=True)
class ColumnParallel:
    """Output features split over ``tp``.

    ``fused``: the output holds this many equal blocks side by side (GPT-2's ``c_attn``: q, k,
    v), each split over ``tp`` on its own. ``head_dim``: features come in heads of this size;
    every rank gets whole heads (``TensorParallelPlanError`` if the heads of a block do not
    divide by ``tp``). ``enter``: apply the region-entry operator to this module's input
    (``False`` when an enclosing ``EnterParallel`` did it once for several layers). ``vocab``:
    the LM head, whose logits stay vocabulary-sharded for the vocab-parallel loss."""

    fused: int = 1
    head_dim: int | None = None
    enter: bool = True
    vocab: bool = False


@dataclass(frozen=True)
class RowParallel:
    """Input features split over ``tp``; the output is summed over ``tp`` (``g``), then the
    bias (replicated) is added once."""


@dataclass(frozen=True)
class VocabParallelEmbedding:
    """Embedding rows split over ``tp``: each rank looks up the ids in its rows, zeros the
    rest, and the output is summed over ``tp``."""


@dataclass(frozen=True)
class EnterParallel:
    """The region-entry operator (``f``) applied once at this module's input ``arg`` (a
    position, or a keyword name), for column layers inside it built with ``enter=False`` (a
    Llama attention's q, k, v)."""

    arg: Union[int, str] = 0


@dataclass(frozen=True)
class SequenceParallel:
    """With sequence parallelism: the module's first input is the whole sequence (position
    ids) while its output joins activations split along the sequence, so each rank takes its
    chunk of the input before the call (a position embedding)."""


@dataclass(frozen=True)
class ReplicatedOnSplit:
    """A module inside a region whose parameters stay whole on every rank while it computes on
    the rank's split features: Qwen3's ``q_norm`` / ``k_norm``, one ``head_dim`` weight shared by
    every head, applied to the rank's heads. Each rank's raw gradient is then its heads' share,
    partial over ``tp``; the step sums it over ``tp`` (private: each example's gradient of it,
    before its norm). Without this style such a weight would train on one rank's heads alone,
    and differently on each rank."""


@dataclass(frozen=True)
class LocalAttributes:
    """Integer attributes of the module that count features a rank holds only ``1/tp`` of
    (GPT-2 attention's ``split_size``): divided by ``tp`` while the step runs, restored after."""

    names: tuple[str, ...]


Style = Union[ColumnParallel, RowParallel, VocabParallelEmbedding, EnterParallel, LocalAttributes, SequenceParallel,
              ReplicatedOnSplit]


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel plan: ``{module-name pattern: style}`` over mesh axis ``axis``.

    ``sequence_parallel`` (Korthikanti et al.): between regions the activations are split over
    ``tp`` along ``sequence_dim`` instead of replicated; entering a region all-gathers them
    along it (backward: reduce-scatter), leaving reduce-scatters (backward: all-gather), the
    same bytes as the all-reduces they replace. Every parameter used outside the regions (norms,
    row-parallel biases, position embeddings) then sees one chunk of the sequence per rank, so
    its raw gradient is partial over ``tp``."""

    styles: Mapping[str, Style]
    axis: str = "tp"
    sequence_parallel: bool = False
    sequence_dim: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "styles", dict(self.styles))


@dataclass(frozen=True)
class ModuleStyle:
    """A matched module's style, the pattern that matched it, and ``size``: the number of
    features (vocabulary rows for an embedding, per fused block for a column layer) it splits
    over ``tp``; rank ``i`` holds ``chunk_bounds(size, tp, i)`` of them
    (``fsdpx.sharding.layout``). 0 for styles that split nothing."""

    style: Style
    pattern: str
    size: int = 0


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


def match_modules(model: nn.Module, plan: TensorParallel) -> dict[str, tuple[str, Style]]:
    """``{module name: (pattern, style)}`` for every module a pattern matches.

    Raises ``TensorParallelPlanError`` naming a pattern that matches no module, or a module that
    two patterns match."""
    out: dict[str, tuple[str, Style]] = {}
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in plan.styles.items():
        hits = [n for n in names if _matches(pattern, n)]
        if not hits:
            raise TensorParallelPlanError(f"tensor-parallel pattern {pattern!r} matches no module of the model")
        for n in hits:
            if n in out:
                raise TensorParallelPlanError(f"module {n!r} is matched by two patterns: {out[n][0]!r} and {pattern!r}")
            out[n] = (pattern, style)
    return out


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (``y = x @ W + b``, ``W`` stored ``[in, out]``), matched by name
    so that transformers stays optional."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def _out_dim(module: nn.Module) -> int:
    """The weight dim that indexes output features."""
    return 1 if is_conv1d(module) else 0


def _check_linear(name: str, module: nn.Module, style: Style) -> None:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise TensorParallelPlanError(
            f"module {name!r} ({type(module).__name__}) cannot be {type(style).__name__}: it needs an nn.Linear"
            " or transformers' Conv1D")


def _column_specs(name: str, module: nn.Module, style: ColumnParallel, axis: str, tp: int) -> dict[str, tuple]:
    """``{local param name: (compute spec, view shape, fused, dp dim)}`` of a column layer."""
    _check_linear(name, module, style)
    od = _out_dim(module)
    out = module.weight.shape[od]
    if style.fused < 1 or out % style.fused:
        raise TensorParallelPlanError(f"module {name!r}: {out} output features do not split into {style.fused}"
                                      " fused blocks")
    block = out // style.fused
    if style.head_dim is not None:
        if block % style.head_dim:
            raise TensorParallelPlanError(f"module {name!r}: {block} features per block are not whole heads of"
                                          f" {style.head_dim}")
        heads = block // style.head_dim
        if heads % tp:
            raise TensorParallelPlanError(f"module {name!r}: {heads} heads do not divide by tp={tp}; a head is"
                                          " never split")
    fused = (od, style.fused) if style.fused > 1 else None
    specs = {}
    w_view = fused_view(module.weight.shape, fused)
    w_split = od + 1 if fused else od  # the within-block dim of the view
    dims: list = [None] * len(w_view)
    dims[w_split] = axis
    # the data axes cut dim 0 further, as FSDP2 cuts a tensor-parallel shard; when dim 0 of
    # the view is the count of fused blocks (3 for q|k|v) they cut the split dim instead
    dp_dim = 1 if (fused and od == 0) else 0
    specs["weight"] = (Spec(*dims), w_view, fused, dp_dim)
    if getattr(module, "bias", None) is not None:
        b_fused = (0, style.fused) if style.fused > 1 else None
        b_view = fused_view(module.bias.shape, b_fused)
        b_dims: list = [None] * len(b_view)
        b_dims[-1] = axis
        specs["bias"] = (Spec(*b_dims), b_view, b_fused, len(b_view) - 1)
    return specs


def _row_specs(name: str, module: nn.Module, style: RowParallel, axis: str) -> dict[str, tuple]:
    _check_linear(name, module, style)
    in_dim = 0 if is_conv1d(module) else 1
    dims: list = [None, None]
    dims[in_dim] = axis
    specs = {"weight": (Spec(*dims), tuple(module.weight.shape), None, 0)}
    if getattr(module, "bias", None) is not None:
        # added once after the sum; with sequence parallelism to each rank's chunk, and its
        # gradient then all-reduced at once (``regions.enter``): replicated, never partial
        specs["bias"] = (Spec(None), tuple(module.bias.shape), None, 0, False)
    return specs


def _embedding_specs(name: str, module: nn.Module, style: VocabParallelEmbedding, axis: str,
                     tp: int) -> dict[str, tuple]:
    if not isinstance(module, nn.Embedding):
        raise TensorParallelPlanError(f"module {name!r} ({type(module).__name__}) cannot be VocabParallelEmbedding:"
                                      " it needs an nn.Embedding")
    if module.max_norm is not None or module.scale_grad_by_freq:
        raise TensorParallelPlanError(f"module {name!r}: VocabParallelEmbedding does not support max_norm or"
                                      " scale_grad_by_freq")
    rows = module.num_embeddings
    if tp > 1 and chunk_bounds(rows, tp, tp - 1)[0] == rows:  # torch.chunk leaves trailing ranks empty
        raise TensorParallelPlanError(f"module {name!r}: a vocabulary of {rows} rows split over tp={tp} leaves"
                                      f" rank {tp - 1} without rows (chunks of {-(-rows // tp)}); use a smaller tp")
    return {"weight": (Spec(axis, None), tuple(module.weight.shape), None, 0)}


def _param_specs(name: str, module: nn.Module, style: Style, axis: str, tp: int) -> dict[str, tuple]:
    if isinstance(style, ColumnParallel):
        return _column_specs(name, module, style, axis, tp)
    if isinstance(style, RowParallel):
        return _row_specs(name, module, style, axis)
    if isinstance(style, VocabParallelEmbedding):
        return _embedding_specs(name, module, style, axis, tp)
    if isinstance(style, LocalAttributes):
        for attr in style.names:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TensorParallelPlanError(f"module {name!r} has no integer attribute {attr!r} to divide by tp")
            if value % tp:
                raise TensorParallelPlanError(f"module {name!r}: {attr}={value} does not divide by tp={tp}")
        return {}
    if isinstance(style, ReplicatedOnSplit):
        own = dict(module.named_parameters(recurse=False))
        if not own:
            raise TensorParallelPlanError(f"module {name!r} has no parameters of its own for ReplicatedOnSplit")
        return {k: (Spec.replicated(p.dim()), tuple(p.shape), None, 0, PARTIAL) for k, p in own.items()}
    if isinstance(style, (EnterParallel, SequenceParallel)):
        return {}
    raise TensorParallelPlanError(f"module {name!r}: unknown tensor-parallel style {style!r}")


def _split_size(module: nn.Module, style: Style) -> int:
    if isinstance(style, ColumnParallel):
        return module.weight.shape[_out_dim(module)] // style.fused
    if isinstance(style, RowParallel):
        return module.weight.shape[1 - _out_dim(module)]
    if isinstance(style, VocabParallelEmbedding):
        return module.num_embeddings
    return 0


def resolve(model: nn.Module, plan: TensorParallel | None, strategy: Strategy, mesh: Mesh,
            trainable: Mapping[str, object] | None = None) -> ShardingPlan:
    """The ``ShardingPlan`` of ``model`` under tensor-parallel ``plan`` and data-parallel
    ``strategy`` on ``mesh``.

    Returns one ``ParamLayout`` per trainable parameter (canonical names, ``trainable`` limits
    them; default every parameter that requires grad): styled parameters are computed split over
    ``plan.axis`` and the strategy shards them further over its data axes on their first dim
    (``Strategy.layout_over``); every other parameter is replicated over ``tp`` and gets the
    strategy's own layout. With ``plan=None`` (or ``tp`` of size 1 and no fused view) this is
    ``strategy.resolve`` (``tests/test_tensor_parallel_plans.py``).

    Raises ``TensorParallelPlanError`` before anything runs when: the mesh lacks the plan's
    axis or a data axis, the plan's axis is a data axis; a pattern matches no module or a module
    twice; a style does not fit its module; heads, fused blocks or a local attribute do not
    divide by ``tp``; a tied parameter gets two different layouts from two styles."""
    params = {n: p for n, p in model.named_parameters()}
    names = list(trainable) if trainable is not None else [n for n, p in params.items() if p.requires_grad]
    for axis in strategy.data_axes:
        if axis not in mesh.axis_names:
            raise TensorParallelPlanError(f"strategy {strategy.name} splits data over axis {axis!r}, not in {mesh}")
    if plan is None:
        return strategy.resolve({n: tuple(params[n].shape) for n in names})
    if plan.axis not in mesh.axis_names:
        raise TensorParallelPlanError(f"the tensor-parallel plan splits over axis {plan.axis!r}, which {mesh} lacks")
    if plan.axis in strategy.data_axes:
        raise TensorParallelPlanError(f"axis {plan.axis!r} cannot carry both data and tensor parallelism")
    tp = mesh.axis_size(plan.axis)
    if any(isinstance(st, SequenceParallel) for st in plan.styles.values()) and not plan.sequence_parallel:
        raise TensorParallelPlanError("a SequenceParallel style needs TensorParallel(sequence_parallel=True)")
    partial = (plan.axis,) if plan.sequence_parallel else ()  # replicated params see a sequence chunk
    canonical = {id(p): n for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[ParamLayout, str]] = {}
    matched: dict[str, ModuleStyle] = {}
    for mod_name, (pattern, style) in match_modules(model, plan).items():
        module = modules[mod_name]
        matched[mod_name] = ModuleStyle(style, pattern, _split_size(module, style))
        for local, (compute, view, fused, dp_dim, *flag) in _param_specs(mod_name, module, style, plan.axis,
                                                                         tp).items():
            p = getattr(module, local)
            name = canonical[id(p)]
            if name not in names:
                continue
            if flag and flag[0] is PARTIAL:  # computed on split features: partial over tp always
                tp_partial: tuple[str, ...] = (plan.axis,)
            else:
                chunked = plan.axis not in compute.sharding_axes and (flag[0] if flag else True)
                tp_partial = partial if chunked else ()
            lay = strategy.layout_over(view, compute, dim=dp_dim, fused=fused, tp_partial=tp_partial)
            if name in chosen and chosen[name][0] != lay:
                raise TensorParallelPlanError(
                    f"tied parameter {name!r} gets two layouts: {chosen[name][0].compute} from module"
                    f" {chosen[name][1]!r} and {lay.compute} from module {mod_name!r}")
            chosen[name] = (lay, mod_name)
    layouts = {}
    for n in names:
        if n in chosen:
            layouts[n] = chosen[n][0]
        else:
            shape = tuple(params[n].shape)
            layouts[n] = strategy.layout_over(shape, Spec.replicated(len(shape)), tp_partial=partial)
    name = f"{strategy.name}+tp" + ("+sp" if plan.sequence_parallel else "")
    return ShardingPlan(layouts, tuple(strategy.data_axes), strategy.reshard_after_forward, name, matched,
                        plan.axis, plan.sequence_dim if plan.sequence_parallel else None)
