"""``PrivacyEngine``: Opacus' entry, over fsdpx's functional core (:mod:`privacy.opacus`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from privacy.accounting import Accountant, noise_multiplier as calibrated_sigma
from privacy.errors import PrivacyError

from .capture import PrivateModule
from .criterion import SequenceCriterion
from .loader import draw_key, poisson_loader
from .adaclip import ADAPTIVE_ARGUMENTS, AdaClipDPOptimizer
from .optimizer import DPOptimizer

ACCOUNTANTS = {"prv": "pld", "pld": "pld", "rdp": "rdp"}  # Opacus' name -> fsdpx's accountant of that kind
MODES = {"hooks": "vmap", "functorch": "vmap", "ew": "vmap", "ghost": "ghost", "ghost_fsdp": "ghost"}


def _refuse(what: str, why: str) -> None:
    raise PrivacyError(f"privacy.opacus: {what} is not supported: {why}")


class PrivacyEngine:
    """Opacus' ``PrivacyEngine``: :meth:`make_private`, :meth:`make_private_with_epsilon`,
    :meth:`get_epsilon`. ``accountant``: "rdp", or "prv" / "pld" (fsdpx's PLD accountant, an
    upper bound of the same kind as Opacus' PRV). What Opacus offers and this entry does not
    (``secure_mode``, the "gdp" accountant, per-layer clipping, ...)
    raises :class:`PrivacyError` naming it; nothing is ignored."""

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False) -> None:
        if accountant not in ACCOUNTANTS:
            _refuse(f"accountant={accountant!r}", f"use one of {sorted(ACCOUNTANTS)}")
        if secure_mode:
            _refuse("secure_mode=True", "fsdpx's noise is a pure function of (key, step, parameter, element), drawn"
                    " from a seeded generator, not a cryptographically secure one")
        self.kind = ACCOUNTANTS[accountant]
        self.accountant = Accountant(accountant=self.kind, delta=1e-5)

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     noise_multiplier: float, max_grad_norm: float, criterion: Any = None, batch_first: bool = True,
                     loss_reduction: str = "mean", poisson_sampling: bool = True, clipping: str = "flat",
                     noise_generator: Any = None, grad_sample_mode: str = "hooks", wrap_model: bool = True,
                     rand_on_empty: bool = False, key: int | None = None, **kwargs: Any) -> tuple:
        """Opacus' ``make_private``: returns ``(model, optimizer, data_loader)``, or with
        ``grad_sample_mode="ghost"`` ``(model, optimizer, criterion, data_loader)``; ``criterion``
        (default ``nn.CrossEntropyLoss()``) comes back taking Opacus' ``shape=`` for sequence
        losses (:class:`~privacy.opacus.criterion.SequenceCriterion`); the model records the
        backward of any criterion. Randomness: ``key`` (an int: fsdpx's key, the same noise and batches as
        ``fsdpx train`` with that key) chooses the noise and the Poisson batches; without it, as
        in Opacus, the noise key comes from ``noise_generator`` (a seeded ``torch.Generator``) or
        else from torch's global generator at the first step, and the batches' key from the data
        loader's ``generator`` or else the global generator (two unseeded runs differ;
        ``torch.manual_seed`` reproduces one). ``grad_sample_mode="ghost_fsdp"``: ``module`` is a
        model wrapped by ``fsdpx.runtime.opacus_fsdp.FSDP2Wrapper`` in every rank of a torchrun
        job (refused otherwise, and the wrapped model in any other mode); the keys are rank 0's
        on every rank, drawn now if not given, and each rank's loader yields its chunk of each
        Poisson batch. Guarantee: with ``noise_multiplier=0`` the parameters after each step
        equal Opacus' (``tests/test_opacus_entry.py``); ``ghost_fsdp`` steps equal the
        one-process ``ghost`` steps on the union of the ranks' rows, noise included
        (``tests/test_opacus_fsdp.py``)."""
        adaptive = _adaptive_arguments(clipping, grad_sample_mode, kwargs)
        _check_supported(batch_first, loss_reduction, clipping, grad_sample_mode, wrap_model, rand_on_empty,
                         max_grad_norm, kwargs)
        _check_sharding(module, grad_sample_mode)
        _check_same_parameters(module, optimizer)
        sample_rate = 1.0 / len(data_loader)
        expected = int(len(data_loader.dataset) * sample_rate)
        model = PrivateModule(module, method=MODES[grad_sample_mode], loss_reduction=loss_reduction)
        noise_key = key if key is not None or noise_generator is None else draw_key(noise_generator)
        settings = dict(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, expected_batch_size=expected,
                        loss_reduction=loss_reduction)
        if grad_sample_mode == "ghost_fsdp":  # one key on every rank: rank 0's, drawn now
            batch_key = module.agreed_key(key if key is not None else draw_key(data_loader.generator))
            noise_key = module.agreed_key(noise_key if noise_key is not None else draw_key(None))
            private = module.private_optimizer(optimizer, model, key=noise_key, sample_rate=sample_rate,
                                               num_examples=len(data_loader.dataset), **settings)
            loader = poisson_loader(data_loader, key=batch_key, share=module.share) if poisson_sampling else data_loader
        else:
            private = (AdaClipDPOptimizer(optimizer, model, key=noise_key, **settings, **adaptive) if adaptive
                       else DPOptimizer(optimizer, model, key=noise_key, **settings))
            loader = poisson_loader(data_loader, key=key) if poisson_sampling else data_loader
        private.attach_step_hook(lambda _: self._record(noise_multiplier, sample_rate))
        if grad_sample_mode in ("ghost", "ghost_fsdp"):
            loss = SequenceCriterion(criterion if criterion is not None else nn.CrossEntropyLoss(), loss_reduction)
            return model, private, loss, loader
        return model, private, loader

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, target_epsilon: float, target_delta: float, epochs: int,
                                  max_grad_norm: float, **kwargs: Any) -> tuple:
        """``make_private`` with the smallest noise multiplier whose epsilon after ``epochs``
        epochs (``epochs * len(data_loader)`` steps) at ``target_delta`` is at most
        ``target_epsilon``, by this engine's accountant."""
        sample_rate = 1.0 / len(data_loader)
        sigma = calibrated_sigma(target_epsilon, target_delta, sample_rate, epochs * len(data_loader),
                                 accountant=self.kind)
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                 noise_multiplier=sigma, max_grad_norm=max_grad_norm, **kwargs)

    def _record(self, sigma: float, sample_rate: float) -> None:
        self.accountant = self.accountant.record(sigma, sample_rate)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent by every step taken so far, at ``delta``."""
        return self.accountant.epsilon(delta)


def _check_supported(batch_first: bool, loss_reduction: str, clipping: str, mode: str, wrap_model: bool,
                     rand_on_empty: bool, max_grad_norm: Any, extra: dict) -> None:
    if extra:
        _refuse(f"argument {sorted(extra)[0]!r}", "this entry takes Opacus' make_private arguments only")
    if mode not in MODES:
        _refuse(f"grad_sample_mode={mode!r}", f"use one of {sorted(MODES)}")
    if not batch_first:
        _refuse("batch_first=False", "the examples are the first dimension of every input")
    if loss_reduction not in ("mean", "sum"):
        _refuse(f"loss_reduction={loss_reduction!r}", "use 'mean' or 'sum'")
    if clipping not in ("flat", "adaptive") or isinstance(max_grad_norm, (list, tuple)):
        _refuse(f"clipping={clipping!r}", "flat or adaptive clipping (one max_grad_norm over all parameters)")
    if not wrap_model:
        _refuse("wrap_model=False", "use the returned model")
    if rand_on_empty:
        _refuse("rand_on_empty=True", "an empty Poisson batch is taken as it is (zero gradient, the step counts)")


def _adaptive_arguments(clipping: str, mode: str, kwargs: dict) -> dict | None:
    """Adaptive clipping's five arguments taken out of ``kwargs`` (:mod:`privacy.opacus.adaclip`),
    or None for flat clipping; adaptive clipping needs all five and a one-process mode."""
    if clipping != "adaptive":
        return None
    missing = [a for a in ADAPTIVE_ARGUMENTS if a not in kwargs]
    if missing:
        _refuse("clipping='adaptive' without " + ", ".join(missing), "Opacus' AdaClipDPOptimizer needs all of "
                + ", ".join(ADAPTIVE_ARGUMENTS))
    if mode == "ghost_fsdp":
        _refuse("clipping='adaptive' with grad_sample_mode='ghost_fsdp'", "adaptive clipping runs in one process"
                " (Opacus' AdaClipDPOptimizer is not distributed either)")
    return {a: kwargs.pop(a) for a in ADAPTIVE_ARGUMENTS}


def _check_sharding(module: nn.Module, mode: str) -> None:
    """``ghost_fsdp`` takes a model sharded by ``fsdpx.runtime.opacus_fsdp.FSDP2Wrapper`` (found by
    its ``private_optimizer``: ``privacy`` sits below the runtime), and only that mode takes one."""
    sharded = hasattr(module, "private_optimizer")
    if mode == "ghost_fsdp" and not sharded:
        _refuse("grad_sample_mode='ghost_fsdp' on a model not wrapped by FSDP2Wrapper",
                "wrap it first: from fsdpx.runtime.opacus_fsdp import FSDP2Wrapper; model = FSDP2Wrapper(model)")
    if sharded and mode != "ghost_fsdp":
        _refuse(f"grad_sample_mode={mode!r} on a model wrapped by FSDP2Wrapper", "use grad_sample_mode='ghost_fsdp'")


def _check_same_parameters(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    own = {id(p) for p in module.parameters()}
    if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
        raise PrivacyError("privacy.opacus: the optimizer holds parameters that are not the module's")
