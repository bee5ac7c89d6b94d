"""Hypothesis strategies for small random models built from the supported layers.

Each draw returns a :class:`Case`: a float64 model, the trainable parameter dict (some
parameters may be frozen, i.e. left out), a batch and a per-example loss. Families:

* ``tokens``  — Embedding -> (Linear | LayerNorm | RMSNorm | tanh)* -> Linear head, optionally
  tied to the embedding, with a Linear applied twice (the same weight used by two calls);
* ``vectors`` — float inputs of rank 2, 3 or 4 (Linear on sequence and 4-D inputs);
* ``convs``   — Conv1d / Conv2d with random stride, padding (mode), dilation and groups;
* ``custom``  — a layer with no ghost rule (exercises the per-module vmap fallback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import Tensor, nn

from fsdpx.models.gpt import RMSNorm


@dataclass
class Case:
    model: nn.Module
    params: dict[str, Tensor]
    batch: tuple[Any, Tensor]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    has_custom: bool = False

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.params.items()}
        return f"Case({self.model}, params={shapes}, batch={tuple(self.batch[1].shape)})"


class Scale(nn.Module):
    """An elementwise learned scale: a layer no ghost rule knows."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class Stack(nn.Module):
    """Applies ``layers`` in order; a layer listed twice is called twice (shared weights)."""

    def __init__(self, layers: list[nn.Module], order: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.order = order

    def forward(self, x: Tensor) -> Tensor:
        for i in self.order:
            layer = self.layers[i]
            x = torch.tanh(layer(x)) if isinstance(layer, nn.Linear) else layer(x)
        return x


def per_example_mse(out: Tensor, target: Tensor) -> Tensor:
    return (out - target).pow(2).flatten(1).sum(1)


def per_example_xent(logits: Tensor, target: Tensor) -> Tensor:
    B, T, V = logits.shape
    return F.cross_entropy(logits.reshape(B * T, V), target.reshape(B * T), reduction="none").view(B, T).sum(1)


def _hidden_layers(draw: Any, d: int, custom: bool) -> list[nn.Module]:
    kinds = draw(st.lists(st.sampled_from(["linear", "layernorm", "rmsnorm", "gptrms"] + (["scale"] if custom else [])),
                          min_size=0, max_size=3))
    layers: list[nn.Module] = []
    for kind in kinds:
        if kind == "linear":
            layers.append(nn.Linear(d, d, bias=draw(st.booleans())))
        elif kind == "layernorm" and d >= 2:
            # over one feature LayerNorm's output is constant: the true gradient below it is 0
            # and batched vs per-example backward round differently around that 0.
            layers.append(nn.LayerNorm(d, bias=draw(st.booleans())))
        elif kind == "rmsnorm":
            layers.append(nn.RMSNorm(d))
        elif kind == "gptrms":
            layers.append(RMSNorm(d))
        elif kind == "scale":
            layers.append(Scale(d))
    return layers


def _randomise(model: nn.Module, seed: int) -> None:
    """Norm weights start at 1 and biases at 0; move them so every term is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


def _freeze(draw: Any, model: nn.Module) -> dict[str, Tensor]:
    names = [n for n, _ in model.named_parameters()]
    frozen = draw(st.sets(st.sampled_from(names), max_size=max(0, len(names) - 1))) if names else set()
    return {n: p for n, p in model.named_parameters() if n not in frozen}


class TokenNet(nn.Module):
    def __init__(self, vocab: int, d: int, hidden: Stack, tie: bool, reuse: bool):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.hidden = hidden
        self.mid = nn.Linear(d, d)
        self.reuse = reuse
        self.head = nn.Linear(d, vocab, bias=not tie)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        x = self.hidden(self.emb(ids))
        x = torch.tanh(self.mid(x))
        if self.reuse:
            x = torch.tanh(self.mid(x))
        return self.head(x)


@st.composite
def token_cases(draw: Any, custom: bool = False) -> Case:
    vocab, d = draw(st.integers(2, 9)), draw(st.integers(1, 6))
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    hidden = _hidden_layers(draw, d, custom)
    model = TokenNet(vocab, d, Stack(hidden, list(range(len(hidden)))), draw(st.booleans()), draw(st.booleans()))
    model = model.double()
    _randomise(model, draw(st.integers(0, 2**31)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    ids = torch.randint(0, vocab, (B, T), generator=g)
    targets = torch.randint(0, vocab, (B, T), generator=g)
    has_custom = any(isinstance(m, Scale) for m in hidden)
    return Case(model, _freeze(draw, model), (ids, targets), per_example_xent, has_custom)


@st.composite
def vector_cases(draw: Any, custom: bool = False) -> Case:
    d_in, d = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    B = draw(st.integers(1, 4))
    steps = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))  # rank 2, 3 or 4 inputs
    hidden = _hidden_layers(draw, d, custom)
    first = nn.Linear(d_in, d, bias=draw(st.booleans()))
    order = list(range(len(hidden) + 1))
    if draw(st.booleans()) and d_in == d:
        order = [0] + order  # the first Linear is called twice
    model = Stack([first, *hidden], order).double()
    _randomise(model, draw(st.integers(0, 2**31)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(B, *steps, d_in, generator=g, dtype=torch.float64)
    y = torch.randn(B, *steps, d, generator=g, dtype=torch.float64)
    has_custom = any(isinstance(m, Scale) for m in hidden)
    return Case(model, _freeze(draw, model), (x, y), per_example_mse, has_custom)


class ConvNet(nn.Module):
    def __init__(self, conv: nn.Module, out_features: int, n_out: int):
        super().__init__()
        self.conv = conv
        self.head = nn.Linear(out_features, n_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


@st.composite
def conv_cases(draw: Any) -> Case:
    dims = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2]))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    k = draw(st.integers(1, 3))
    stride, dilation = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    padding = draw(st.integers(0, 1)) if mode == "zeros" else draw(st.sampled_from([0, 1]))
    size = draw(st.integers(dilation * (k - 1) + 2, 6))
    cls = nn.Conv1d if dims == 1 else nn.Conv2d
    conv = cls(c_in, c_out, k, stride=stride, padding=padding, dilation=dilation, groups=groups,
               bias=draw(st.booleans()), padding_mode=mode).double()
    B = draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(B, c_in, *([size] * dims), generator=g, dtype=torch.float64)
    out_features = conv(x).flatten(1).shape[1]
    model = ConvNet(conv, out_features, 2).double()
    _randomise(model, draw(st.integers(0, 2**31)))
    y = torch.randn(B, 2, generator=g, dtype=torch.float64)
    return Case(model, _freeze(draw, model), (x, y), per_example_mse)


def supported_cases() -> st.SearchStrategy[Case]:
    return st.one_of(token_cases(), vector_cases(), conv_cases())


def any_cases() -> st.SearchStrategy[Case]:
    return st.one_of(token_cases(custom=True), vector_cases(custom=True), conv_cases())
