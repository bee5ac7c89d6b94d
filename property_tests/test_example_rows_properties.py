"""Invariants of layers called on the examples' rows flattened together (privacy/example_rows.py).

Proven rows: a feed-forward block on ``x.reshape(-1, H)`` (a LayerNorm, a linear map, an
activation, dropout's mask, another linear map, a residual sum), embeddings of flattened ids;
ghost norms and clipped sums then equal a loop of per-example autograd runs. Not proven: the
same block on a transposed or permuted (sequence-first) flatten, or after an operation that
moves rows (a roll, a cumulative sum over rows): the tape refuses, naming the module, whatever
the sizes (a sequence as long as the batch included).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st
from torch import Tensor, nn

from privacy.clipping import clipped_grad, per_sample_norms
from privacy.errors import PerExampleError

VOCAB = 11


class RowsBlock(nn.Module):
    """Embeds ``[B, T]`` ids, then runs a feed-forward block on ``[B * T, H]`` rows made by
    ``flatten`` (``"reshape"``, ``"view"``, ``"flatten"``: proven) or by a sequence-first
    flatten (``"transpose"``, ``"permute"``) or a row-moving step (``"roll"``, ``"cumsum"``): not
    proven. Returns per-example, per-position logits ``[B, T, VOCAB]``."""

    def __init__(self, hidden: int, inner: int, flatten: str, flat_ids: bool):
        super().__init__()
        self.flatten, self.flat_ids = flatten, flat_ids
        self.embed = nn.Embedding(VOCAB, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, inner), nn.Linear(inner, hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def rows(self, h: Tensor) -> Tensor:
        H = h.shape[-1]
        return {"reshape": lambda: h.reshape(-1, H), "view": lambda: h.view(-1, H), "flatten": lambda: h.flatten(0, 1),
                "transpose": lambda: h.transpose(0, 1).reshape(-1, H),
                "permute": lambda: h.permute(1, 0, 2).contiguous().view(-1, H),
                "roll": lambda: torch.roll(h.reshape(-1, H), 1, 0),
                "cumsum": lambda: h.reshape(-1, H).cumsum(0)}[self.flatten]()

    def forward(self, ids: Tensor) -> Tensor:
        B, T = ids.shape
        h = self.embed(ids.reshape(-1)).view(B, T, -1) if self.flat_ids else self.embed(ids)
        x = self.rows(h * 1.0)
        y = x + self.down(F.dropout(F.gelu(self.up(self.norm(x))), 0.2, self.training))
        return self.head(y.view(B, T, -1) if self.flatten in ("reshape", "view", "flatten") else y.view(T, B, -1))


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none").view(targets.shape).mean(1)


def oracle_norms(model: nn.Module, params: dict, ids: Tensor, targets: Tensor) -> Tensor:
    """Each example alone (a batch of one), plain autograd."""
    out = []
    for i in range(ids.shape[0]):
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = token_loss(torch.func.functional_call(model, live, (ids[i:i + 1],)), targets[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, list(live.values()))
        out.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
    return torch.stack(out)


sizes = st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 4), st.integers(1, 5))


@given(sizes, st.sampled_from(["reshape", "view", "flatten"]), st.booleans(), st.integers(0, 2 ** 16))
def test_a_row_wise_block_on_proven_rows_equals_a_per_example_loop(size, flatten, flat_ids, seed):
    B, T, H, inner = size
    torch.manual_seed(seed)
    model = RowsBlock(H, inner, flatten, flat_ids).double().eval()
    params = dict(model.named_parameters())
    ids, targets = torch.randint(0, VOCAB, (B, T)), torch.randint(0, VOCAB, (B, T))
    want = oracle_norms(model, params, ids, targets)
    got = per_sample_norms(model, params, (ids, targets), token_loss, method="ghost")
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    grads, norms = clipped_grad(model, params, (ids, targets), token_loss, clip_norm=0.1, method="ghost")
    ref, _ = clipped_grad(model, params, (ids, targets), token_loss, clip_norm=0.1, method="vmap")
    for name in params:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)


@given(sizes, st.sampled_from(["transpose", "permute", "roll", "cumsum"]), st.integers(0, 2 ** 16))
@example((3, 3, 2, 2), "transpose", 0)  # as many positions as examples: only the transpose tells
@example((2, 2, 3, 1), "permute", 0)
def test_rows_that_are_not_proven_are_refused_naming_the_module(size, flatten, seed):
    B, T, H, inner = size
    B = max(B, 2)  # with one example every row is that example's
    T = max(T, 2)  # one position each: every flatten is the examples in order
    torch.manual_seed(seed)
    model = RowsBlock(H, inner, flatten, False).double().eval()
    params = dict(model.named_parameters())
    ids, targets = torch.randint(0, VOCAB, (B, T)), torch.randint(0, VOCAB, (B, T))
    with pytest.raises(PerExampleError, match="'norm'.*could not be proven"):
        per_sample_norms(model, params, (ids, targets), token_loss, method="ghost")


@given(sizes, st.integers(0, 2 ** 16))
def test_the_same_block_trains_alike_with_dropout(size, seed):
    """Training mode (dropout's mask on the rows): with one example per run the tape and the
    loop draw the same mask; their norms agree."""
    _, T, H, inner = size
    model = RowsBlock(H, inner, "reshape", False).double().train()
    params = dict(model.named_parameters())
    torch.manual_seed(seed)
    ids, targets = torch.randint(0, VOCAB, (1, T)), torch.randint(0, VOCAB, (1, T))
    torch.manual_seed(seed + 1)
    got = per_sample_norms(model, params, (ids, targets), token_loss, method="ghost")
    torch.manual_seed(seed + 1)
    torch.testing.assert_close(got, oracle_norms(model, params, ids, targets), rtol=1e-9, atol=1e-12)
