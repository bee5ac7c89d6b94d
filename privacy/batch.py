"""What a batch is, and the few things every path does with one.

A batch is ``(inputs, targets)`` or ``(inputs, targets, mask)``:

* ``inputs`` is whatever the model takes: one tensor, a tuple or list of positional arguments
  (entries need not be tensors), or a mapping of keyword arguments (``{"input_ids": ...,
  "attention_mask": ...}``, as transformers models take them), nested structures included;
* ``targets`` leads with the batch dimension ``B``;
* ``mask`` (optional, bool ``[B]``): ``False`` marks a padding example that must contribute
  nothing (``privacy.padding``: fixed-shape Poisson batches).

Splitting a batch (over data-parallel ranks, into pipeline microbatches) cuts every tensor whose
first dimension is ``B`` and shares everything else (a ``[1, T]`` position table, a flag, a
string) with every part. A tensor that is not per-example but happens to lead with ``B`` is
cut too: give such a value a leading 1 (it broadcasts) to share it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from privacy.errors import PrivacyError


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` the model is called with: a mapping gives keyword arguments, a tuple or
    list positional ones, anything else one positional argument."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(*args, **kwargs)`` with :func:`split_inputs` of ``inputs``."""
    args, kwargs = split_inputs(inputs)
    return model(*args, **kwargs)


def unpack(batch: tuple) -> tuple[Any, Tensor, Tensor | None]:
    """``(inputs, targets, mask)`` of a 2- or 3-tuple batch (``mask`` None when absent).

    Raises :class:`PrivacyError` if the batch has another length, or if the mask is not a bool
    tensor of shape ``[B]`` (``B = targets.shape[0]``)."""
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise PrivacyError(f"a batch is (inputs, targets) or (inputs, targets, mask); got {type(batch).__name__} "
                           f"of length {len(batch) if isinstance(batch, (tuple, list)) else '?'}")
    inputs, targets = batch[0], batch[1]
    mask = batch[2] if len(batch) == 3 else None
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (targets.shape[0],):
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
            raise PrivacyError(f"a batch's mask must be a bool tensor of shape ({targets.shape[0]},) (one entry per "
                               f"example, True for a real one); got {got}")
    return inputs, targets, mask


def take_rows(inputs: Any, start: int, stop: int, batch_size: int) -> Any:
    """``inputs`` with every tensor whose first dimension is ``batch_size`` cut to rows
    ``[start, stop)`` (views); every other leaf is shared unchanged. The structure (tuple,
    list, mapping, nesting) is kept."""
    def cut(x: Any) -> Any:
        if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == batch_size:
            return x[start:stop]
        return x
    return tree_map(cut, inputs)


def index_rows(inputs: Any, index: Tensor, batch_size: int) -> Any:
    """``inputs`` with every tensor whose first dimension is ``batch_size`` indexed by
    ``index`` along it (a gather: a copy); every other leaf is shared unchanged."""
    def gather(x: Any) -> Any:
        if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == batch_size:
            return x[index]
        return x
    return tree_map(gather, inputs)


def slice_batch(batch: tuple, start: int, stop: int) -> tuple:
    """Rows ``[start, stop)`` of ``batch`` (2- or 3-tuple, the same length back): targets and
    mask cut, inputs by :func:`take_rows`.

    Guarantee: concatenating the parts of consecutive ranges gives the batch back, and an
    example's row is in exactly one part (``tests/test_hf_sharded.py`` runs every strategy on
    mapping inputs against the unsharded step)."""
    inputs, targets, mask = unpack(batch)
    b = targets.shape[0]
    cut = (take_rows(inputs, start, stop, b), targets[start:stop])
    return cut if mask is None else (*cut, mask[start:stop])


def first_tensor(inputs: Any) -> Tensor:
    """The first tensor among ``inputs`` (in the order of the positional arguments, or of the
    mapping's keys as given): the one whose shape the runtime reads (a sequence length)."""
    for leaf in tree_flatten(inputs)[0]:
        if isinstance(leaf, Tensor):
            return leaf
    raise PrivacyError("the batch's inputs hold no tensor")


def real_count(batch: tuple) -> int:
    """The number of real (unmasked) examples of ``batch``."""
    _, targets, mask = unpack(batch)
    return int(mask.sum()) if mask is not None else int(targets.shape[0])
