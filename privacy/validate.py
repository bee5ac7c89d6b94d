"""The model check run before any private step: does every module keep examples apart?

DP-SGD bounds each example's influence by clipping its own gradient. A layer that mixes the
examples of a batch (BatchNorm normalising with the batch's statistics) makes one example's
gradient depend on the others, so no clipping bounds it. Opacus refuses such models in its
``ModuleValidator``; we refuse them too, naming the module that breaks the rule, before a step
runs rather than in the middle of one.

Layers that merely do not lead with the batch dimension are caught at run time by the tape
(:func:`privacy.tape.taping`), which sees the actual shapes.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from privacy.errors import PerExampleError


def check_model(model: nn.Module) -> None:
    """Raise :class:`PerExampleError` naming the first module that mixes examples; return None
    when there is none.

    Refused: any BatchNorm (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, the lazy ones) in training
    mode, which normalises each example with statistics of the whole batch. Accepted: BatchNorm
    in eval mode (running statistics are constants of the step), and every per-example norm
    (LayerNorm, GroupNorm, RMSNorm, InstanceNorm).

    Edge cases: a model with no parameters passes; a frozen BatchNorm in training mode is still
    refused (its output mixes examples whatever trains after it).
    Proved by ``tests/test_validate.py``."""
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) and module.training:
            raise PerExampleError(name or "<root>", type(module).__name__,
                                  "normalises each example with the statistics of the whole batch in training mode,"
                                  " so an example's gradient depends on the others and clipping cannot bound it;"
                                  " use GroupNorm or LayerNorm, or put the module in eval mode")
