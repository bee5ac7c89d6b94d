"""Ghost rules: a layer's per-example gradient contributions from what one call of it saw.

A rule gets the module, the positional inputs of one call (batch first), the gradient of the
summed loss with respect to that call's output, and the shapes of the module's own parameters
during the call (a sharded runtime swaps in a rank's blocks for the call only, so the module's
attributes describe the whole layer), and returns, for each of the module's own
parameters, its per-example contribution in factored or dense form (see ``contributions.py``).
No rule forms a per-example weight gradient; biases and norm weights (vectors) are dense.

Supported: ``nn.Linear`` (inputs of any rank: every dimension between batch and features is a
step ``t``), Hugging Face's ``Conv1D`` (GPT-2's transposed linear), ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``, the GPT's own ``RMSNorm``,
``nn.Conv1d`` and ``nn.Conv2d`` (any stride, padding mode, dilation, groups), any module
that declares ``ghost_rule = "normalize_then_scale"`` (a norm written as ``normalize(x) *
weight``, like the GPT's RMSNorm) — declared on the model's side, so ``privacy`` imports no model —
and the transformers classes whose code is a reference's
(:data:`SAME_CODE`: Llama's RMSNorm and its ~140 copies, Olmo-2's, Gemma's, the scaled word
embeddings of Gemma and BART, Falcon's linear).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from privacy.contributions import Contribution, Dense, Factored

Shapes = Mapping[str, torch.Size]
NO_SHAPES: Shapes = MappingProxyType({})  # a rule called without shapes reads the module's own
Rule = Callable[[nn.Module, tuple, Tensor, Shapes], dict[str, Contribution]]
RULES: dict[type, Rule] = {}


def rule(*types: type) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for t in types:
            RULES[t] = fn
        return fn

    return register


def rule_for(module: nn.Module) -> Rule | None:
    """The ghost rule of this module's exact class (subclasses may change ``forward``), or
    None. A class from ``transformers.models`` gets a reference's rule when its code is the
    reference's (:func:`same_code_rule`)."""
    cls = type(module)
    if cls.__module__ == "transformers.pytorch_utils" and cls.__name__ == "Conv1D":
        return transposed_linear  # matched by name so that transformers stays optional
    if getattr(cls, "ghost_rule", None) == "normalize_then_scale":
        return normalize_then_scale
    if cls in RULES:
        return RULES[cls]
    if cls.__module__.startswith("transformers.models."):
        return same_code_rule(cls)
    return None


def _steps(x: Tensor, features: int) -> Tensor:
    """``[B, ..., features] -> [B, T, features]``; ``T = 1`` for 2-D inputs."""
    return x.reshape(x.shape[0], -1, features)


@rule(nn.Linear)
def linear(module: nn.Linear, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    n_out, n_in = weights.get("weight", module.weight.shape)  # as called: a tensor-parallel block
    a = _steps(args[0], n_in)  # (B, T, in)
    b = _steps(grad_out, n_out)  # (B, T, out)
    out: dict[str, Contribution] = {"weight": Factored(b, a, n_out, (0, n_out))}
    if module.bias is not None:
        out["bias"] = Dense(b.sum(1))
    return out


def transposed_linear(module: nn.Module, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    """Hugging Face's ``Conv1D`` (GPT-2): ``y = x @ W + b`` with ``W`` shaped ``[in, out]``."""
    n_in, n_out = weights.get("weight", module.weight.shape)  # as called: a tensor-parallel block
    a = _steps(args[0], n_in)  # (B, T, in)
    b = _steps(grad_out, n_out)  # (B, T, out)
    out: dict[str, Contribution] = {"weight": Factored(a, b, n_in, (0, n_in))}
    if module.bias is not None:
        out["bias"] = Dense(b.sum(1))
    return out


@rule(nn.Embedding)
def embedding(module: nn.Embedding, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    if module.max_norm is not None or module.scale_grad_by_freq:
        raise NotImplementedError(
            "ghost clipping of nn.Embedding with max_norm or scale_grad_by_freq is not per-example separable"
        )
    rows, dim = weights.get("weight", module.weight.shape)  # as called: a vocab-parallel rank's rows
    ids = args[0].reshape(args[0].shape[0], -1)  # (B, T); reshape also handles expanded ids
    b = _steps(grad_out, dim)  # (B, T, d)
    if module.padding_idx is not None:  # torch gives the padding row no gradient
        b = torch.where((ids == module.padding_idx)[..., None], torch.zeros_like(b), b)
    return {"weight": Factored(ids, b, rows, (0, rows))}


def _norm_rule(normalize: Callable[[Tensor], Tensor], module: nn.Module, args: tuple, grad_out: Tensor):
    shape = module.weight.shape if module.weight is not None else grad_out.shape[-1:]
    dims = tuple(range(1, grad_out.dim() - len(shape)))  # the step dims between batch and features
    out: dict[str, Contribution] = {}
    if module.weight is not None:
        out["weight"] = Dense((grad_out * normalize(args[0])).sum(dims) if dims else grad_out * normalize(args[0]))
    if getattr(module, "bias", None) is not None:
        out["bias"] = Dense(grad_out.sum(dims) if dims else grad_out)
    return out


@rule(nn.LayerNorm)
def layer_norm(module: nn.LayerNorm, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    shape = module.normalized_shape
    return _norm_rule(lambda x: F.layer_norm(x, shape, None, None, module.eps), module, args, grad_out)


@rule(nn.RMSNorm)
def rms_norm(module: nn.RMSNorm, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    shape = module.normalized_shape
    return _norm_rule(lambda x: F.rms_norm(x, shape, None, module.eps), module, args, grad_out)


def _float32_rms(module: nn.Module, x: Tensor) -> Tensor:
    h = x.to(torch.float32)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)


def llama_rms_norm(module: nn.Module, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    """transformers' ``LlamaRMSNorm`` and its copies: ``weight * rms(x.float()).to(x.dtype)``;
    the normalization runs in float32 and is cast back before the scale, as the module does."""
    return _norm_rule(lambda x: _float32_rms(module, x).to(x.dtype), module, args, grad_out)


def scale_then_cast_rms_norm(module: nn.Module, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    """Olmo-2's RMSNorm and its copies: ``(weight * rms(x.float())).to(x.dtype)``, the scale
    applied in float32 before the cast (where Llama casts first)."""
    return _norm_rule(lambda x: _float32_rms(module, x), module, args, grad_out)


def gemma_rms_norm(module: nn.Module, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    """Gemma's RMSNorm: ``(module._norm(x.float()) * (1 + weight.float())).type_as(x)``; the
    ``1 +`` shifts the output, not the weight's gradient, which autograd forms in float32 (the
    product's dtype), as this does."""
    out = _norm_rule(lambda x: module._norm(x.float()), module, args, grad_out.float())
    return {k: Dense(c.grads.to(module.weight.dtype)) for k, c in out.items()}


def scaled_embedding(module: nn.Module, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    """An ``nn.Embedding`` whose output is multiplied by ``module.embed_scale`` (Gemma's, a
    tensor cast to the weight's dtype; BART's, a number): the lookup's output gradient is
    ``grad_out * scale``, as autograd forms it."""
    scale = module.embed_scale
    if isinstance(scale, Tensor):
        scale = scale.to(module.weight.dtype)
    return embedding(module, args, grad_out * scale, weights)


SAME_CODE: tuple[tuple[str, str, tuple[str, ...], Rule], ...] = (
    ("llama", "LlamaRMSNorm", ("forward",), llama_rms_norm),
    ("olmo2", "Olmo2RMSNorm", ("forward",), scale_then_cast_rms_norm),
    ("gemma", "GemmaRMSNorm", ("forward", "_norm"), gemma_rms_norm),
    ("gemma", "GemmaTextScaledWordEmbedding", ("forward",), scaled_embedding),
    ("bart", "BartScaledWordEmbedding", ("forward",), scaled_embedding),
    ("falcon", "FalconLinear", ("forward",), linear),
)
"""References in ``transformers.models``: (model package, class, methods compared, rule). A class
has the reference's rule when it has the reference's base classes and the compared methods'
code is the reference's (the same syntax tree: comments, layout and docstrings aside; the ~140
RMSNorm classes transformers copies from Llama's, say). Compared, not listed by name, so that a
transformers release that changes a class's code loses the rule rather than keeping a wrong one."""


@functools.cache
def same_code_rule(cls: type) -> Rule | None:
    """The rule of the :data:`SAME_CODE` reference whose code ``cls`` has, or None (also when
    the reference or any source text cannot be read or parsed). Cached per class.

    Guarantee: the rule's contributions equal a per-example autograd loop on the unmodified
    transformers models of ``tests/test_hf_families.py`` (Phi-3, Gemma, Falcon, Olmo-2; BART's
    scaled embedding on its own); a class whose code differs gets no rule, whatever its name
    (``test_a_class_gets_a_rule_by_its_code_not_its_name``)."""
    for package, name, methods, rule_ in SAME_CODE:
        try:
            ref = getattr(importlib.import_module(f"transformers.models.{package}.modeling_{package}"), name)
            if cls.__bases__ == ref.__bases__ and all(_source(cls, m) == _source(ref, m) for m in methods):
                return rule_
        except (ImportError, AttributeError, OSError, TypeError, SyntaxError, IndexError):
            continue
    return None


def _source(cls: type, method: str) -> str:
    """The method's syntax tree as text: its code without comments, layout or docstring (which
    transformers' copies reword with their own class names)."""
    fn = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method)))).body[0]
    body = fn.body  # type: ignore[attr-defined]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        fn.body = body[1:]  # type: ignore[attr-defined]
    fn.name = method  # type: ignore[attr-defined]  # the code compared, however the function was named
    return ast.dump(fn)


def normalize_then_scale(module: nn.Module, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    """Any module declaring ``ghost_rule = "normalize_then_scale"``: its forward is
    ``module.normalize(x) * module.weight (+ module.bias)`` (the GPT's own RMSNorm)."""
    return _norm_rule(module.normalize, module, args, grad_out)


@rule(nn.Conv1d, nn.Conv2d)
def conv(module: nn.Conv1d | nn.Conv2d, args: tuple, grad_out: Tensor, weights: Shapes = NO_SHAPES) -> dict[str, Contribution]:
    patches = _unfold(module, args[0])  # (B, C_in * prod(k), L)
    B, out_ch, g = grad_out.shape[0], module.out_channels, module.groups
    b = grad_out.reshape(B, out_ch, -1).transpose(1, 2)  # (B, L, out)
    rows, cols = out_ch // g, patches.shape[1] // g
    parts = [
        Factored(b[:, :, j * rows:(j + 1) * rows], patches[:, j * cols:(j + 1) * cols].transpose(1, 2), rows,
                 (j * rows, (j + 1) * rows))
        for j in range(g)
    ]
    out: dict[str, Contribution | list[Contribution]] = {"weight": parts if g > 1 else parts[0]}
    if module.bias is not None:
        out["bias"] = Dense(b.sum(1))
    return out  # type: ignore[return-value]


def _unfold(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """Input patches in the weight's ``(C_in, k...)`` order, padding applied as the module does."""
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
    if isinstance(module, nn.Conv1d):
        x = x.unsqueeze(2)  # (B, C, 1, L): a 1-D conv is a 2-D conv of height 1
        kernel, dilation, stride = (1, *module.kernel_size), (1, *module.dilation), (1, *module.stride)
    else:
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    return F.unfold(x, kernel, dilation=dilation, padding=0, stride=stride)


ROW_WISE = frozenset({linear, transposed_linear, embedding, scaled_embedding, layer_norm, rms_norm, llama_rms_norm,
                      scale_then_cast_rms_norm, gemma_rms_norm})
"""Rules of layers that act on each row alone (the features of the last dimension, or one id):
called on the examples' rows flattened together, such a layer's call is the examples' calls
stacked, so the tape may accept it on proven example rows (``privacy/example_rows.py``).
Convolutions (which read neighbouring positions) and declared ``normalize_then_scale`` norms
(whose ``normalize`` is the model's own) are not among them."""
