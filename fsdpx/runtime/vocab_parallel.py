"""The vocabulary-parallel loss: cross-entropy on logits split over the vocabulary.

The LM head under ``ColumnParallel(vocab=True)`` leaves each rank of a ``tp`` group with the
logits of its rows of the vocabulary, ``[..., V_r]``. They come out marked as
:class:`VocabShardedLogits`, so the user's own loss function, unmodified, calls
``F.cross_entropy`` and gets this module's vocab-parallel version (torch's ``loss_parallel``
does the same for DTensor logits). Per row ``i`` with target ``t``::

    lse_r = logsumexp(z_r)             over this rank's vocabulary slice
    tgt_r = z_r[t - start_r] if t is in the slice, else 0
    one all-gather over tp of (lse_r, tgt_r): 2 floats per row per rank
    loss = logsumexp_r(lse_r) - sum_r tgt_r

and the backward is local: ``(softmax_r - onehot_r) * grad``. No rank ever holds more than its
``[N, V_r]`` logits (Megatron's ``vocab_parallel_cross_entropy`` needs three all-reduces of
``N`` floats; the gathered pair is one collective).

Only operations that keep the vocabulary dim whole and last are allowed on the marked logits:
reshapes, views, casts, indexing of the leading dims, and elementwise arithmetic with scalars or
with tensors constant along the vocabulary (Gemma-2's final soft-capping ``tanh(z / c) * c``,
Granite's and Cohere's logit scales), which acts on each vocabulary entry alone. Anything else
(softmax, argmax, a transpose of the vocabulary dim, adding a vocabulary-sized bias) raises
:class:`VocabParallelError` instead of silently computing on a slice
(``tests/test_tensor_parallel.py::test_elementwise_scalar_ops_keep_logits_vocab_sharded``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fsdpx.sharding.collectives import cached_plan
from fsdpx.sharding.comm import Comm
from fsdpx.sharding.spec import Spec


class VocabParallelError(RuntimeError):
    """An operation that would mix the vocabulary dim of vocabulary-sharded logits."""


@dataclass(frozen=True)
class VocabShard:
    """Rows ``[start, stop)`` of a vocabulary of ``vocab`` held by this rank of the ``axis``
    group of ``comm``."""

    comm: Comm
    axis: str
    start: int
    stop: int
    vocab: int


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, shard: VocabShard, *, ignore_index: int = -100,
                                 reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(full_logits, target, ...)`` from this rank's ``[N, V_r]`` (or ``[V_r]``)
    slice of the logits, without gathering them.

    Returns the loss per ``reduction`` (``"none"``: ``[N]``; ``"mean"`` over non-ignored rows;
    ``"sum"``), identical on every rank of the group.

    Guarantees: equals ``F.cross_entropy`` on the gathered logits, forward and backward, to
    float rounding (``tests/test_tensor_parallel.py::
    test_vocab_parallel_cross_entropy_equals_cross_entropy_on_gathered_logits``); moves one
    all-gather of ``2 N`` values per rank; allocates nothing of the full vocabulary's size.

    Edge cases: a rank whose slice is empty (vocabulary smaller than its chunk) contributes
    ``-inf`` to the log-sum-exp and 0 to the target logit; rows whose target is
    ``ignore_index`` have loss 0 and gradient 0 (a mean over no rows is NaN, as in torch);
    a target outside ``[0, vocab)`` raises ``IndexError`` on every rank."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    squeeze = logits.dim() == 1
    if squeeze:
        logits, target = logits.unsqueeze(0), target.reshape(1)
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise VocabParallelError(f"vocab-parallel cross_entropy takes logits [N, V] and targets [N], got"
                                 f" {tuple(logits.shape)} and {tuple(target.shape)}")
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= shard.vocab))
    if not bad.is_meta and bool(bad.any()):  # meta: the cost model's shape-only run
        raise IndexError(f"target {int(target[bad][0])} is out of bounds for a vocabulary of {shard.vocab}")
    losses = _VocabCrossEntropy.apply(logits, target, valid, shard)
    if reduction == "none":
        return losses[0] if squeeze else losses
    total = losses.sum()
    return total if reduction == "sum" else total / valid.sum()


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, z: Tensor, target: Tensor, valid: Tensor, shard: VocabShard) -> Tensor:
        n, v_local = z.shape
        mine = valid & (target >= shard.start) & (target < shard.stop)
        local_t = torch.where(mine, target - shard.start, torch.zeros_like(target))
        lse_r = torch.logsumexp(z, dim=-1) if v_local else z.new_full((n,), float("-inf"))
        picked = z.gather(1, local_t.unsqueeze(1)).squeeze(1) if v_local else z.new_zeros(n)
        tgt_r = torch.where(mine, picked, torch.zeros_like(picked))
        both = _all_gather_pairs(torch.stack([lse_r, tgt_r]), shard)  # [tp, 2, N]
        lse = torch.logsumexp(both[:, 0], dim=0)
        loss = torch.where(valid, lse - both[:, 1].sum(0), torch.zeros_like(lse))
        ctx.save_for_backward(z, lse, local_t, mine, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        z, lse, local_t, mine, valid = ctx.saved_tensors
        g = torch.exp(z - lse.unsqueeze(1))  # this slice of the softmax
        if z.shape[1]:
            g.scatter_add_(1, local_t.unsqueeze(1), -mine.to(g.dtype).unsqueeze(1))
        g.mul_(torch.where(valid, grad, torch.zeros_like(grad)).unsqueeze(1))
        return g, None, None, None


def _all_gather_pairs(pairs: Tensor, shard: VocabShard) -> Tensor:
    """``[2, N]`` per rank -> ``[tp, 2, N]`` in rank order over ``shard.axis``."""
    comm = shard.comm
    sub = comm.mesh.sub(shard.axis)
    k = sub.size
    shape = (k, *pairs.shape)
    (step,) = cached_plan(Spec(shard.axis, None, None), Spec(None, None, None), shape, sub, pairs.dtype)
    return comm.run(step, pairs.unsqueeze(0).contiguous())


_KEEPS_VOCAB = {
    "reshape", "view", "view_as", "reshape_as", "contiguous", "float", "double", "half", "bfloat16", "to", "type",
    "detach", "clone", "__getitem__", "flatten", "unsqueeze", "requires_grad_", "cpu", "cuda", "as_subclass",
}


# elementwise: each vocabulary entry alone, so a slice of the vocabulary gives the same slice of
# the result, when every other operand is constant along the vocabulary (``_per_entry``)
_ELEMENTWISE = {
    "mul", "div", "add", "sub", "true_divide", "tanh", "neg", "mul_", "div_", "add_", "sub_", "tanh_", "neg_",
    "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__add__", "__radd__", "__sub__", "__rsub__", "__neg__",
    "__imul__", "__itruediv__", "__iadd__", "__isub__",
}


def _per_entry(args: tuple, kwargs: dict, shard: "VocabShard") -> bool:
    """Every tensor operand is these logits (the same shard) or constant along the last dim."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, VocabShardedLogits):
            if a._vocab_shard is not shard:
                return False
        elif isinstance(a, Tensor) and a.dim() and a.shape[-1] != 1:
            return False
    return True


class VocabShardedLogits(Tensor):
    """Logits split over the vocabulary (a rank's ``[..., V_r]``): see the module docstring.
    ``_vocab_shard`` is the :class:`VocabShard`; the tensor is otherwise the local logits."""

    _vocab_shard: VocabShard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shard = next(a._vocab_shard for a in args if isinstance(a, VocabShardedLogits))
        if func is F.cross_entropy:
            return _cross_entropy(shard, *args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not isinstance(out, Tensor):
            if isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out):
                raise VocabParallelError(_refusal(func))
            return out  # shapes, sizes, flags, strings
        name = getattr(func, "__name__", "")
        width = shard.stop - shard.start
        if name in _KEEPS_VOCAB and out.dim() and out.shape[-1] == width:
            return mark_vocab_sharded(out, shard)
        if name in _ELEMENTWISE and out.dim() and out.shape[-1] == width and _per_entry(args, kwargs, shard):
            return mark_vocab_sharded(out, shard)
        raise VocabParallelError(_refusal(func))


def _refusal(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return (f"{name} on vocabulary-sharded logits: each tensor-parallel rank holds only its slice of the"
            " vocabulary (ColumnParallel(vocab=True)), so only reshapes, casts, elementwise arithmetic with scalars"
            " and F.cross_entropy may use them;"
            " compute the loss with F.cross_entropy, or plan the LM head without vocab=True to gather the logits")


def mark_vocab_sharded(logits: Tensor, shard: VocabShard) -> VocabShardedLogits:
    """``logits`` (autograd history kept) marked as this rank's vocabulary slice."""
    with torch._C.DisableTorchFunctionSubclass():
        out = logits.as_subclass(VocabShardedLogits)
    out._vocab_shard = shard
    return out


def _cross_entropy(shard: VocabShard, input: Tensor, target: Tensor, weight: Tensor | None = None,
                   size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                   reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    if weight is not None or label_smoothing or size_average is not None or reduce is not None:
        raise VocabParallelError("vocab-parallel cross_entropy supports ignore_index and reduction only"
                                 " (no class weights, label smoothing or the legacy size_average/reduce)")
    with torch._C.DisableTorchFunctionSubclass():
        plain = input.as_subclass(Tensor)
    return vocab_parallel_cross_entropy(plain, target, shard, ignore_index=ignore_index, reduction=reduction)
