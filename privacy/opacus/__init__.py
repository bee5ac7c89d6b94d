"""Opacus' entry over fsdpx's functional core: change the import, keep the loop.

    from privacy.opacus import PrivacyEngine          # was: from opacus import PrivacyEngine
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    for x, y in loader:
        optimizer.zero_grad(); criterion(model(x), y).backward(); optimizer.step()
    engine.get_epsilon(1e-5)

Underneath: the model records each forward and the gradient of the loss with respect to its
output (:mod:`privacy.opacus.capture`); the optimizer's ``step()`` forms the clipped sum with
:func:`privacy.clipped_grad` and adds :func:`privacy.gaussian_noise` (:mod:`privacy.opacus.optimizer`);
batches are :class:`privacy.PoissonSampler` draws (:mod:`privacy.opacus.loader`); epsilon is
:class:`privacy.Accountant`'s. See ``docs/from_opacus.md``.
"""

from .adaclip import AdaClipDPOptimizer
from .batch_memory import BatchMemoryManager
from .engine import PrivacyEngine
from .optimizer import DPOptimizer

__all__ = ["AdaClipDPOptimizer", "BatchMemoryManager", "DPOptimizer", "PrivacyEngine"]
