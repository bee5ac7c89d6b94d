"""Named exceptions of the private core. Each says what was wrong with which input."""

from __future__ import annotations


class PrivacyError(ValueError):
    """Base class: a private computation was asked something it cannot do safely."""


class NonFiniteGradientError(PrivacyError):
    """Some examples have a non-finite (NaN or inf) per-example gradient norm.

    ``indices`` lists their positions in the batch."""

    def __init__(self, indices: list[int]):
        self.indices = indices
        super().__init__(
            f"non-finite per-example gradient for batch examples {indices}; "
            "pass nonfinite='zero' to drop their contribution instead"
        )


class BudgetExhaustedError(PrivacyError):
    """Taking the requested step would spend more than the configured epsilon budget.

    Raised before anything changes: the state that was passed in is still valid."""


class UnsupportedLayerError(PrivacyError):
    """``method="ghost"`` met a module with trainable parameters that has no ghost rule."""


class PerExampleError(PrivacyError):
    """A module of the model cannot give per-example gradients: it mixes the examples of a
    batch (BatchNorm's batch statistics, a mean over the batch) or does not put the batch
    dimension first. ``module`` is its qualified name in the model, ``reason`` says why.

    Raised by :func:`privacy.validate.check_model` before any step, and by the tape when a call
    breaks the batch-first rule at run time."""

    def __init__(self, module: str, kind: str, reason: str):
        self.module, self.kind, self.reason = module, kind, reason
        super().__init__(f"module {module!r} ({kind}) {reason}")
