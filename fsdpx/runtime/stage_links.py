"""Pipeline checks for a model whose parameters are on ``meta`` (a pipeline rank that reads only
its own stages from a pretrained save): the model's forward runs once with every parameter swapped
for a zero that owns one element (:func:`zero_parameters`), so what is checked is the forward's
structure, never a value.

    with zero_parameters(model, example.device):
        prologue = traced_prologue(model, blocks, example)    # which modules run before the blocks
    check_stage_links(model, layout, example)                 # blocks that pass each other state

:func:`fsdpx.runtime.stages.check_stages` compares each stage's values with the whole model's and
needs every parameter real; :func:`check_stage_links` finds what that comparison finds in the
models that fail it (transformers' T5 hands its position bias from block to block), by identity:
a block of a later stage that receives, besides its hidden state, a tensor a block of an earlier
stage returned would run without it. A value derived from such a tensor between the blocks (by
the model's loop, not by a block) is not seen here; :meth:`StageForward.check_output` still
refuses a stage whose first output is not finite.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor
from torch.utils._pytree import tree_flatten

from fsdpx.sharding.pipeline import PipelineLayout, PipelinePlanError
from .stages import hidden_of, run_hooked


@contextlib.contextmanager
def zero_parameters(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside: every parameter of ``model`` (tied ones under each name) is a zero of its shape and
    dtype on ``device`` owning one element (``expand`` of a scalar); after: the parameters as
    they were. Nothing is read or allocated per element: a forward inside computes on zeros."""
    accessor = NamedMemberAccessor(model)
    zeros = {n: torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
             for n, p in model.named_parameters(remove_duplicate=False)}
    saved = accessor.swap_tensors_dict(zeros, allow_missing=True)[0]
    try:
        yield
    finally:
        accessor.swap_tensors_dict(saved, allow_missing=True)


def passed_between_blocks(model: nn.Module, blocks: str, *args: Any, **kwargs: Any) -> dict[int, dict[str, int]]:
    """Block index -> {argument: index of the earlier block that made it} for every tensor a
    block of the list ``blocks`` receives, besides its hidden state (the first positional
    argument, or ``hidden_states``), that an earlier block returned besides its hidden state and
    was not given (a block handing on a mask it received made nothing), in ``model``'s forward on ``args`` / ``kwargs`` (run as is: call it inside
    :func:`zero_parameters` for a model on ``meta``). Empty for blocks that share only what the
    forward computed before them (masks, positions, rotary tables). One forward, quietly
    (``no_grad``, eval mode, the random streams restored).
    Proven by ``tests/test_pipeline_prologue.py::test_blocks_that_pass_state_are_refused_on_meta``."""
    block_list = dict(model.named_modules())[blocks]
    returned: dict[int, int] = {}  # id of a tensor a block made and returned -> that block's index
    given_ids: set[int] = set()  # ids of every tensor a block was given: handed on, not made
    kept: list[Tensor] = []  # alive until the end, so that no id is reused
    links: dict[int, dict[str, int]] = {}

    def hooks(i: int, block: nn.Module) -> list:
        def pre(module: nn.Module, a: tuple, kw: dict) -> None:
            kept.extend(t for t in tree_flatten((a, kw))[0] if isinstance(t, Tensor))
            given_ids.update(id(t) for t in tree_flatten((a, kw))[0] if isinstance(t, Tensor))
            hidden_key = None if a else "hidden_states"  # the hidden state is a[0], or this keyword
            given = {f"argument {j}": t for j, t in enumerate(a[1:], 1)}
            given.update({k: v for k, v in kw.items() if k != hidden_key})
            for where, value in given.items():
                for t in (t for t in tree_flatten(value)[0] if isinstance(t, Tensor)):
                    if id(t) in returned:
                        links.setdefault(i, {})[where] = returned[id(t)]

        def post(module: nn.Module, a: tuple, output: Any) -> None:
            hidden = hidden_of(output)
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t is not hidden and id(t) not in given_ids:
                    returned.setdefault(id(t), i)
                    kept.append(t)
        return [block.register_forward_pre_hook(pre, with_kwargs=True), block.register_forward_hook(post)]

    run_hooked(model, [h for i, block in enumerate(block_list) for h in hooks(i, block)], args, kwargs)
    return links


def check_stage_links(model: nn.Module, layout: PipelineLayout, *args: Any, **kwargs: Any) -> None:
    """Raise ``PipelinePlanError`` naming the first stage with a block that receives, besides
    its hidden state, a tensor a block of an earlier stage returned (:func:`passed_between_blocks`
    on ``args`` / ``kwargs``): run alone, that stage would compute without it. Works on any
    device, ``meta`` inside :func:`zero_parameters` included: no value is compared."""
    links = passed_between_blocks(model, layout.blocks, *args, **kwargs)
    stage_of = {b: s for s, blocks in enumerate(layout.stages) for b in blocks}
    for s, blocks in enumerate(layout.stages):
        for b in blocks:
            crossing = {where: j for where, j in links.get(b, {}).items() if stage_of[j] < s}
            if crossing:
                where, j = next(iter(crossing.items()))
                raise PipelinePlanError(
                    f"stage {s} (blocks {blocks[0]}-{blocks[-1]} of {layout.blocks!r}) would run block {b} without "
                    f"its {where}, which block {j} of stage {stage_of[j]} returns: its blocks take something from "
                    f"earlier blocks besides the hidden state (a position bias passed from block to block, a "
                    f"residual carried apart), which no stage boundary carries; such a model cannot be pipelined")
