"""Example rows: a layer called on the batch's examples flattened together into rows.

Some models merge the batch with the sequence before a feed-forward block (transformers' OPT:
``h.reshape(-1, hidden)``, then a LayerNorm, ``fc1``, an activation, ``fc2`` on ``[B * T,
hidden]`` rows). A layer that acts on each row alone (a linear map, an embedding lookup, a norm
over the features) then still has per-example gradients: example ``i``'s are the sum over its
rows ``i k .. i k + k - 1``, if that is where its rows are. Shapes alone cannot tell: ``[T, B,
hidden]`` flattened also has ``B * T`` rows, each example's scattered. So the rows must be
proven to be the examples' in order, from how the tensor was made:

* a reshape or view of a tensor that leads with the batch, merging the batch with the dimensions
  after it (``[B, T, H] -> [B * T, H]``), and not of a transpose or permutation that brought
  that dimension first: reshapes follow the logical row-major order, so row ``r`` is example
  ``r // k``; or a contiguous view that shares a batch-leading base's memory (a tensor that
  needs no gradient, such as flattened token ids);
* the output of a row-wise layer call already accepted on proven rows;
* a pointwise operation (an activation, dropout, a residual sum, a cast: :data:`POINTWISE`)
  whose output has the same rows, each of whose inputs is proven or is a leaf (a parameter
  broadcast over the rows) or needs no gradient; likewise a custom autograd function that
  declares it keeps every row where it was (``ctx.preserves_rows = True`` in its forward: a
  tensor-parallel region's entry or exit, ``fsdpx.runtime.regions``).

Anything else is not proven and the tape refuses the call, naming the module. As everywhere in
the tape, a dimension that leads with the batch size is taken to be the batch: a sequence-first
tensor whose length equals the batch size, made elsewhere than by a transpose just before the
reshape, cannot be told apart.
"""

from __future__ import annotations

import math
from typing import Any, MutableMapping, Sequence

from torch import Tensor

VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
POINTWISE = frozenset({
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "MulBackward0", "MulBackward1",
    "DivBackward0", "DivBackward1", "NegBackward0", "PowBackward0", "SqrtBackward0", "RsqrtBackward0",
    "ExpBackward0", "TanhBackward0", "SigmoidBackward0", "ReluBackward0", "GeluBackward0", "SiluBackward0",
    "HardtanhBackward0", "LeakyReluBackward0", "EluBackward0", "ToCopyBackward0", "CloneBackward0",
    "NativeDropoutBackward0", "AliasBackward0",
})
"""Autograd nodes of elementwise operations (the broadcast of a smaller operand aside): each
output row depends on the same row of each full-size input."""
MAX_DEPTH = 32  # nodes walked back from one input before giving up (refusing)

Known = MutableMapping[Any, int]  # autograd node -> rows per example of its output


def example_rows(t: Tensor, batch_size: int, known: Known) -> int | None:
    """``k`` when ``t``'s ``k * batch_size`` leading rows are proven to be the examples' rows
    in order (rows ``i k .. i k + k - 1`` are example ``i``'s: module docstring), else None.
    ``known`` maps the autograd nodes of outputs of calls already accepted on proven rows.

    Edge cases: ``k == 1`` or a leading dimension that ``batch_size`` does not divide -> None
    (the tape's batch-first rule decides those); a 0-dim tensor -> None.

    Guarantee: ghost contributions of a row-wise layer on proven rows equal a per-example
    autograd loop (``property_tests/test_example_rows_properties.py``); a flatten of a
    transposed or permuted (sequence-first) tensor is never proven (same file)."""
    if t.dim() == 0 or batch_size < 1 or t.shape[0] % batch_size or t.shape[0] == batch_size:
        return None
    k = t.shape[0] // batch_size
    if t.grad_fn is not None:
        return k if _proven(t.grad_fn, k * batch_size, batch_size, known, MAX_DEPTH) else None
    return k if _shares_batch_base(t, batch_size) else None


def _proven(node: Any, rows: int, batch_size: int, known: Known, depth: int) -> bool:
    if known.get(node) == rows // batch_size:
        return True
    if depth == 0:
        return False
    name = type(node).__name__
    out = list(node._input_metadata[0].shape) if node._input_metadata else []
    if not out or out[0] != rows:
        return False
    if name in VIEWS:
        return _merges_batch(list(node._saved_self_sym_sizes), out, batch_size) and not _moves_first_dim(node)
    if name in POINTWISE or getattr(node, "preserves_rows", False) is True:
        inputs = [n for n, _ in node.next_functions if n is not None and type(n).__name__ != "AccumulateGrad"]
        return all(_proven(n, rows, batch_size, known, depth - 1) for n in inputs)
    return False


def _moves_first_dim(view: Any) -> bool:
    """Whether the reshaped tensor was itself a transpose or permutation that brought another
    dimension first (``x.transpose(0, 1).reshape(-1, H)``: a sequence-first flatten), looking
    through copies (``.contiguous()``, casts)."""
    node = view.next_functions[0][0] if view.next_functions else None
    while node is not None and type(node).__name__ in ("CloneBackward0", "ToCopyBackward0"):
        node = node.next_functions[0][0] if node.next_functions else None
    name = type(node).__name__ if node is not None else ""
    if name == "TransposeBackward0":
        return 0 in (node._saved_dim0, node._saved_dim1) or -len(node._input_metadata[0].shape) in (
            node._saved_dim0, node._saved_dim1)
    if name == "PermuteBackward0":
        return node._saved_dims[0] not in (0, -len(node._saved_dims))
    return False


def _merges_batch(source: Sequence[int], out: Sequence[int], batch_size: int) -> bool:
    """Whether reshaping ``source`` (leading with the batch) to ``out`` merges the batch with
    the dimensions right after it and keeps the rest: ``[B, d1, .., dj, *rest] -> [B d1 .. dj,
    *rest]``."""
    if not source or source[0] != batch_size:
        return False
    return any(math.prod(source[:j + 1]) == out[0] and list(source[j + 1:]) == list(out[1:])
               for j in range(len(source)))


def _shares_batch_base(t: Tensor, batch_size: int) -> bool:
    base = t._base
    return (base is not None and t.is_contiguous() and base.is_contiguous() and base.data_ptr() == t.data_ptr()
            and base.numel() == t.numel() and _merges_batch(list(base.shape), list(t.shape), batch_size))
