"""The optimizer a :class:`privacy.opacus.PrivacyEngine` hands back: the user's optimizer, whose
``step()`` first turns the recorded backward passes into fsdpx's private gradient.

    optimizer.zero_grad(); loss = criterion(model(x), y); loss.backward(); optimizer.step()

``step()``: the clipped sum of every per-example gradient recorded since the last step
(:func:`privacy.clipped_grad` on each recorded batch, vmap or ghost, with Opacus' clip factor
``min(1, C / (norm + 1e-6))``: clipping ``"opacus_flat"``), plus Gaussian noise of
standard deviation ``noise_multiplier * max_grad_norm`` drawn as a pure function of
``(key, step, parameter name, element)`` (:func:`privacy.gaussian_noise`, the same noise as any
fsdpx run with that key), divided by the expected batch size for a "mean" loss, becomes each
parameter's ``.grad``; then the user's optimizer steps. A skipped step (virtual batches,
:class:`privacy.opacus.BatchMemoryManager`) only adds to the clipped sum.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from privacy.clipping import clip_per_sample, clipped_grad
from privacy.noise import gaussian_noise

from .capture import PrivateModule, surrogate_loss
from .loader import draw_key


class DPOptimizer:
    """``optimizer`` made private for ``module`` (see the module doc). Attributes the wrapper does
    not define (``param_groups``, ``state``, ...) are the original optimizer's
    (``original_optimizer``). ``step_hooks`` are called with the optimizer after each real step
    (the engine's accountant records it there)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: PrivateModule, *, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: int, loss_reduction: str, key: int | None) -> None:
        self.original_optimizer = optimizer
        self.module = module
        self.noise_multiplier, self.max_grad_norm = noise_multiplier, max_grad_norm
        self.expected_batch_size, self.loss_reduction, self.key = expected_batch_size, loss_reduction, key
        self.steps = 0
        self.step_hooks: list[Callable[[DPOptimizer], None]] = []
        self._skip_next = False
        self._summed: dict[str, Tensor] | None = None
        self._names = {id(p): n for n, p in module.module.named_parameters()}

    @property
    def noise_key(self) -> int:
        """The key of the noise; a ``None`` key is drawn from torch's global generator at the
        first step (once), so ``torch.manual_seed`` chooses it as it chooses Opacus' noise."""
        if self.key is None:
            self.key = draw_key(None)
        return self.key

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["original_optimizer"], name)

    def _trained(self) -> dict[str, torch.nn.Parameter]:
        return {self._names[id(p)]: p for g in self.original_optimizer.param_groups for p in g["params"]
                if p.requires_grad}

    def attach_step_hook(self, fn: Callable[[DPOptimizer], None]) -> None:
        """Call ``fn(self)`` after every step that updates the parameters."""
        self.step_hooks.append(fn)

    def physical_pieces(self, rows: int, size: int) -> int:
        """How many physical batches a logical batch of ``rows`` rows is cut into
        (:class:`privacy.opacus.BatchMemoryManager`): ``ceil(rows / size)``, at least 1. A sharded
        optimizer takes the most over its ranks, so every rank runs as many forwards."""
        return max(1, math.ceil(rows / size))

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Make the next ``step()`` only accumulate the clipped sum (a physical batch of a larger
        logical one)."""
        self._skip_next = do_skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' ``.grad`` and set ``.grad_sample`` to ``None``, as Opacus does
        (the clipped sum of a skipped step is kept)."""
        self.module.clear_grad_samples()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def accumulate(self) -> None:
        """Add the clipped per-example gradients of every batch recorded since the last call to
        the clipped sum."""
        params = {n: p.detach() for n, p in self._trained().items()}
        for inputs, cotangent, per_sample in self.module.take():
            if per_sample is not None and per_sample.keys() == params.keys():  # formed at backward (vmap modes)
                grads, norms = clip_per_sample(per_sample, params, clip_norm=self.max_grad_norm,
                                               clipping="opacus_flat")
            else:
                grads, norms = clipped_grad(self.module.module, params, (inputs, cotangent), surrogate_loss,
                                            clip_norm=self.max_grad_norm, method=self.module.method,
                                            clipping="opacus_flat")
            self.count_clipped(norms)
            if self._summed is None:
                self._summed = grads
            else:
                for n, g in grads.items():
                    self._summed[n] += g

    def gradient_noise_multiplier(self) -> float:
        """The noise multiplier of the gradient sum: ``noise_multiplier`` (adaptive clipping
        spends part of it on its count: :mod:`privacy.opacus.adaclip`)."""
        return self.noise_multiplier

    def count_clipped(self, norms: Tensor) -> None:
        """Called with each recorded batch's per-example norms (adaptive clipping counts them)."""

    def after_noise(self) -> None:
        """Called once a real step's noisy gradient is formed, before the step is counted."""

    def pre_step(self, closure: Callable[[], Any] | None = None) -> bool:
        """Opacus' ``pre_step``: accumulate; unless this step is skipped, set each parameter's
        ``.grad`` to the noisy clipped sum (over the expected batch size for a "mean" loss),
        count the step and call the step hooks (the accountant). Returns whether the original
        optimizer should step now (False for a skipped step). ``step()`` is ``pre_step()`` and
        then the original optimizer's ``step()``
        (``tests/test_opacus_entry.py::test_pre_step_then_the_original_step_is_step``)."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.accumulate()
        if self._skip_next:
            self._skip_next = False
            return False
        self.form_gradient()
        self.steps += 1
        for hook in self.step_hooks:
            hook(self)
        return True

    def form_gradient(self) -> None:
        """Set each trained parameter's ``.grad`` to the noisy clipped sum of the batches
        accumulated, scaled for the loss reduction, and start a new sum (a sharded optimizer
        forms it with the sharded step instead: ``fsdpx.runtime.opacus_fsdp``)."""
        trained = self._trained()
        summed = self._summed or {n: torch.zeros_like(p) for n, p in trained.items()}
        std = self.gradient_noise_multiplier() * self.max_grad_norm
        key = self.noise_key
        noise = gaussian_noise(summed, key=key, step=self.steps, std=std) if std > 0 else None
        scale = 1.0 / self.expected_batch_size if self.loss_reduction == "mean" else 1.0
        for n, p in trained.items():
            g = summed[n] if noise is None else summed[n] + noise[n]
            p.grad = (g * scale).to(p.dtype)
        self._summed = None
        self.after_noise()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """:meth:`pre_step`, then the original optimizer's step unless this step is skipped.
        Returns the closure's value (evaluated first, with gradients on), else ``None``."""
        value = None
        if closure is not None:
            with torch.enable_grad():
                value = closure()
        if self.pre_step():
            self.original_optimizer.step()
        return value
