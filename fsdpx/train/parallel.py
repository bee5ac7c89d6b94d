"""A run's parallel layout resolved on its model: the per-parameter sharding plan, built once per
run by :func:`resolve_parallel` and handed to everything that needs it (the step, the checkpoint
manager, the gathering of the full parameters, the planner's memory model).

    mesh = layout.mesh(world)                                   # fsdpx.train.layout
    parallel = resolve_parallel(layout, model, mesh, example)   # the plan, checked on the model
    parallel.plan, parallel.mesh

The tensor-parallel plan of a model comes from :func:`tp_plan`: the built-in GPT's, the ready
plan of its transformers class (:data:`TP_PLANS`), or the model's own.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

from torch import Tensor, nn

from fsdpx.models.gpt import GPT
from fsdpx.models.tp_plans import gpt2_plan, gpt_plan, llama_plan, opt_plan, qwen3_plan, stablelm_plan
from fsdpx.runtime.stage_links import check_stage_links, zero_parameters
from fsdpx.runtime.stages import check_stages, traced_prologue
from fsdpx.sharding.mesh import Mesh
from fsdpx.sharding.pipeline import PipelineParallel, PipelinePlanError, find_blocks, resolve_pipeline
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.tensor_parallel import TensorParallel, resolve

from .errors import ConfigError
from .layout import Layout

LLAMA_LIKE = ("Llama", "Mistral", "Ministral", "Ministral3", "Qwen2", "Gemma", "Gemma2", "VaultGemma", "Olmo",
              "SmolLM3", "Granite", "Helium", "Cohere", "Cohere2", "Ernie4_5", "Cwm", "HyperCLOVAX")
PER_HEAD_NORMS = ("Qwen3", "Gemma3", "Exaone4")
TP_PLANS = {"GPT2LMHeadModel": gpt2_plan, "OPTForCausalLM": opt_plan, "StableLmForCausalLM": stablelm_plan,
            **{f"{family}ForCausalLM": llama_plan for family in LLAMA_LIKE},
            **{f"{family}ForCausalLM": qwen3_plan for family in PER_HEAD_NORMS}}
"""Tensor-parallel plans of transformers models, by class name (``fsdpx.models.tp_plans``): the
``LLAMA_LIKE`` families have Llama's module tree (their logit scales and soft-capping act on each
vocabulary entry alone, so the vocabulary-parallel loss takes them); the ``PER_HEAD_NORMS``
families add Qwen3's per-head query/key norms; StableLM shapes its heads with its own counts.
Each equals the unsharded run, plain and private
(``tests/test_tensor_parallel_hf.py::test_every_planned_family_equals_the_unsharded_run``)."""


class Parallel(NamedTuple):
    """A layout resolved on a model: ``mesh`` (:meth:`Layout.mesh`) and ``plan``, every
    parameter's layout on it."""

    layout: Layout
    mesh: Mesh
    plan: ShardingPlan


def resolve_parallel(layout: Layout, model: nn.Module, mesh: Mesh, example: Tensor | None = None) -> Parallel:
    """``layout`` resolved on ``model`` over ``mesh``: the strategy's per-parameter layouts, with
    the model's tensor-parallel plan (:func:`tp_plan`) when ``tp > 1`` and its blocks cut into
    pipeline stages when ``pp > 1``, the prologue traced on ``example`` (one of the run's inputs,
    :func:`pipeline_prologue`) and every stage checked against the whole model on it
    (:func:`check_pipeline`). ``model`` may live on ``meta`` (a pipeline rank of a pretrained
    save, the launcher's check): traced and checked on zeros then; without ``example`` (the
    planner's) nothing is.

    Raises :class:`ConfigError` for a model without a tensor-parallel plan, heads that do not
    divide by ``tp``, or a pipeline that does not fit or whose stages differ from the model;
    ``TensorParallelPlanError`` for a plan that does not fit the model or the mesh. A run calls
    it once (``tests/test_train_layout.py::test_a_run_resolves_its_plan_once``)."""
    prologue = pipeline_prologue(model, example) if layout.pp > 1 else None
    plan = resolve_plan(model, mesh, layout, prologue=prologue)
    check_pipeline(model, plan, example)
    return Parallel(layout, mesh, plan)


def resolve_plan(model: nn.Module, mesh: Mesh, layout: Layout,
                 prologue: tuple[str, ...] | None = None) -> ShardingPlan:
    """The plan of :func:`resolve_parallel`, unchecked; ``prologue``:
    ``PipelineParallel.prologue`` (None: registration order)."""
    tensor = tp_plan(model, layout.tp, sequence_parallel=layout.sequence_parallel) if layout.tp > 1 else None
    plan = resolve(model, tensor, layout.data_parallel(), mesh)
    if layout.pp == 1:
        return plan
    spec = PipelineParallel(schedule=layout.schedule, microbatches=layout.microbatches,
                            virtual_stages=layout.virtual_stages, prologue=prologue)
    try:
        return resolve_pipeline(model, plan, spec, mesh)
    except PipelinePlanError as e:
        raise ConfigError(str(e)) from None


def pipeline_prologue(model: nn.Module, example: Tensor | None) -> tuple[str, ...] | None:
    """The parameters ``model``'s forward uses before its block list, traced on ``example`` (a
    batch of one of the run's inputs): ``PipelineParallel.prologue``, so that a model
    registered in another order than its forward runs (transformers' OPT) is cut right. A model
    on ``meta`` (a rank that reads only its stages of a pretrained save, or the launcher's check)
    is traced with its parameters zeros that own one element
    (:func:`fsdpx.runtime.stage_links.zero_parameters`): which modules run where does not depend
    on their values. None without an example. Raises :class:`ConfigError` where the trace fails
    (``PipelinePlanError``)."""
    if example is None:
        return None
    try:
        with on_zeros_if_meta(model, example):
            return traced_prologue(model, find_blocks(model), example)
    except PipelinePlanError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a forward that does not run on zeros: named, not a traceback
        if not any(p.is_meta for p in model.parameters()):
            raise
        raise untraceable(model, e) from e


def check_pipeline(model: nn.Module, plan: ShardingPlan, example: Tensor | None) -> None:
    """Raise :class:`ConfigError` unless each stage of ``plan``'s pipeline, run alone from the
    hidden state it receives, computes what the whole model does at that point on ``example``
    (:func:`fsdpx.runtime.stages.check_stages`: blocks that pass state besides the hidden state,
    such as T5's position bias, cannot be pipelined). A model on ``meta`` has no values to
    compare: its blocks are checked for tensors handed from a block of one stage to a block of
    a later one (:func:`fsdpx.runtime.stage_links.check_stage_links`, the same models refused).
    Nothing to check without a pipeline or an example."""
    if plan.pipeline is None or example is None:
        return
    on_meta = any(p.is_meta for p in model.parameters())
    try:
        if on_meta:
            with zero_parameters(model, example.device):
                check_stage_links(model, plan.pipeline, example)
        else:
            check_stages(model, plan.pipeline, example)
    except PipelinePlanError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - as in pipeline_prologue
        if not on_meta:
            raise
        raise untraceable(model, e) from e


def untraceable(model: nn.Module, error: Exception) -> ConfigError:
    """The refusal of a pipeline (``--pp``) whose model, its parameters on ``meta`` (a pretrained
    save read stage by stage), cannot run its forward on one-element zeros to be cut and checked."""
    return ConfigError(f"--pp: {type(model).__name__}'s forward does not run with its parameters as zeros"
                       f" ({type(error).__name__}: {error}), so its pipeline stages cannot be cut and checked"
                       " before each rank reads its own; run it without --pp")


def on_zeros_if_meta(model: nn.Module, example: Tensor):
    """:func:`fsdpx.runtime.stage_links.zero_parameters` on ``example``'s device when a
    parameter of ``model`` is on ``meta``; else nothing."""
    on_meta = any(p.is_meta for p in model.parameters())
    return zero_parameters(model, example.device) if on_meta else contextlib.nullcontext()


def tp_plan(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> TensorParallel:
    """The tensor-parallel plan of ``model`` over ``tp`` ranks: the built-in GPT's, the ready
    plan of its transformers class, or the model's own: ``model.tensor_parallel_plan(tp)``
    (a :class:`TensorParallel`) when its class defines one. :class:`ConfigError` for a class
    without a plan or heads that do not divide by ``tp`` (a rank holds whole heads): the one
    place that is checked."""
    if isinstance(model, GPT):
        check_heads(model.config, tp)
        return gpt_plan(model.config, sequence_parallel=sequence_parallel)
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own) and not sequence_parallel:
        return own(tp)
    name = type(model).__name__
    if name not in TP_PLANS:
        raise ConfigError(f"no tensor-parallel plan for {name}: tp > 1 runs the built-in GPT, "
                          + ", ".join(TP_PLANS) + ", or a model defining tensor_parallel_plan(tp)")
    check_heads(model.config, tp, where=f"{name}: ")
    try:
        return TP_PLANS[name](model.config)
    except ValueError as e:  # a configuration the plan does not cover (OPT's projected embeddings)
        raise ConfigError(f"{name}: {e}") from None


def check_heads(config: object, tp: int, where: str = "") -> None:
    """Raise :class:`ConfigError` when a head count of the model's ``config`` (``n_head``,
    ``num_attention_heads``, ``num_key_value_heads``) does not divide by ``tp``."""
    heads = {k: getattr(config, k) for k in ("n_head", "num_attention_heads", "num_key_value_heads")
             if isinstance(getattr(config, k, None), int)}
    for key, count in heads.items():
        if count % tp:
            raise ConfigError(f"{where}{key}={count} does not divide by tp={tp}: a rank holds whole heads")
