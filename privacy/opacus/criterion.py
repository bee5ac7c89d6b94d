"""The criterion ``make_private(grad_sample_mode="ghost")`` returns: the user's, taking Opacus'
``shape=`` for sequence losses.

    criterion = engine.make_private(..., grad_sample_mode="ghost")[2]
    loss = criterion(logits.flatten(0, 1), targets.flatten(), shape=logits.shape)   # Opacus' LM loop

Opacus' privacy unit for a sequence model is the sequence: given ``shape=(B, T, ...)`` its ghost
criterion reduces the ``B * T`` per-token losses to one loss per sequence (the mean over the
sequence's tokens, those equal to the criterion's ``ignore_index`` left out of the count; or the
sum) and then takes the mean (or sum) over the ``B`` sequences. That is a different loss from the
criterion's own mean over all tokens when the sequences have different numbers of valid tokens,
so :class:`SequenceCriterion` forms the same one; the model records its backward as it records
any loss. Without ``shape`` it is the user's criterion as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class SequenceCriterion:
    """``criterion`` (an ``nn.Module`` loss with a ``reduction`` attribute), called as Opacus'
    ghost criterion is (module doc). ``loss_reduction``: "mean" or "sum", over the sequences.
    Guarantee: with ``shape`` the loss equals Opacus' ``DPLossFastGradientClipping`` loss
    (``tests/test_opacus_entry.py::test_ghost_sequence_loss_with_shape_steps_as_with_opacus``).
    Edge cases: a sequence with no valid token counts 1 in the denominator (loss 0), as in
    Opacus; ``shape`` whose ``B * T`` is not the number of per-token losses leaves the
    per-example losses as they are."""

    def __init__(self, criterion: Any, loss_reduction: str) -> None:
        self.criterion, self.loss_reduction = criterion, loss_reduction

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["criterion"], name)

    def __call__(self, *args: Any, shape: Any = None, **kwargs: Any) -> Tensor:
        if shape is None:
            return self.criterion(*args, **kwargs)
        old, self.criterion.reduction = self.criterion.reduction, "none"
        try:
            per_token = self.criterion(*args, **kwargs)
        finally:
            self.criterion.reduction = old
        per_example = per_token
        if per_token.shape[0] == shape[0] * shape[1]:
            per_token = per_token.view(shape[0], shape[1])
            if self.loss_reduction == "sum":
                per_example = per_token.sum(1)
            else:
                per_example = per_token.sum(1) / valid_tokens(self.criterion, args, kwargs, shape, per_token)
        return per_example.mean() if self.loss_reduction == "mean" else per_example.sum()


def valid_tokens(criterion: Any, args: tuple, kwargs: dict, shape: Any, per_token: Tensor) -> Tensor:
    """Per sequence, the number of tokens whose target is not ``criterion.ignore_index`` (at least
    1); ``T`` each when the criterion has no ``ignore_index`` or no target was passed."""
    ignore = getattr(criterion, "ignore_index", None)
    targets = kwargs.get("target", args[1] if len(args) >= 2 else None)
    if ignore is None or targets is None:
        return torch.full((shape[0],), shape[1], dtype=per_token.dtype, device=per_token.device)
    return (targets.view(shape[0], shape[1]) != ignore).sum(1).clamp(min=1).to(per_token.dtype)
