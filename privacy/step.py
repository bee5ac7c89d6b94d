"""One DP-SGD step as a pure function of (state, batch).

    step = make_private_step(model, token_loss, adamw(1e-3), config, num_examples=N)
    state = init_state(params, adamw(1e-3), key=0, config=config)
    for t in range(steps):
        state, metrics = step(state, sample_batch(data, sampler, state.step))

The step composes: budget check -> clipped_grad -> Gaussian noise of std
``noise_multiplier * clip_norm``, the draw of :func:`privacy.noise.gaussian_noise` from (key, step,
name, element), added in place by ``add_gaussian_noise_`` (same bits; for parameters on a CUDA
device it is drawn there, in torch ops, nothing copied from the host) -> divide by the EXPECTED
batch size ``q N`` (the Poisson batch size is random; a fixed divisor keeps the sensitivity
fixed) -> optimizer update -> accountant record.

With a correlated-noise mechanism (``DPConfig.mechanism``, :mod:`privacy.mechanisms`) the noise of
step ``t`` is the mechanism's ``(C^{-1} z)_t``, each ``z_k`` the draw above for step ``k`` in
float64, streamed from this step's draw and the last ``b - 1`` outputs, which the state keeps
(``TrainState.noise_history``, :mod:`privacy.mechanisms.correlated`); batches then come from ``privacy.mechanisms.CyclicPoissonSampler`` with
``bands`` groups, and the accountant (its ``bands``) composes each group's own steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from torch import Tensor, nn

from ckpt.flatten import register_type
from fsdpx.optim.freezing import Trainable, bind, frozen_update, values_in
from privacy.accounting import Accountant, max_steps
from privacy.batch import real_count
from privacy.clipping import CLIPPINGS, METHODS, clip_and_sum
from privacy.errors import PrivacyError
from privacy.gradient_canaries import GradientCanaries
from privacy.host_pages import keep_freed_pages
from privacy.mechanisms.correlated import NoiseHistory, empty_history, streamed_noise
from privacy.mechanisms.mechanism import INDEPENDENT, Mechanism
from privacy.noise import add_gaussian_noise_
from privacy.sampling import PoissonSampler
from privacy.step_metrics import StepMetrics
from privacy.tape import LossFn, Params
from privacy.validate import check_model

if TYPE_CHECKING:  # privacy needs only the optimizer's shape, not the fsdpx package
    from fsdpx.optim import Optimizer


@dataclass(frozen=True)
class DPConfig:
    """The privacy knobs of a run. ``noise_multiplier`` is sigma: noise std / clip_norm."""

    clip_norm: float
    noise_multiplier: float
    sample_rate: float
    delta: float = 1e-5
    method: str = "auto"
    clipping: str = "flat"
    nonfinite: str = "raise"
    epsilon_budget: float | None = None
    accountant: str = "pld"
    mechanism: Mechanism = INDEPENDENT
    canaries: GradientCanaries | None = None  # an audit's gradient canaries, added to the clipped sum

    def __post_init__(self) -> None:
        if isinstance(self.mechanism, dict):  # read back from a checkpoint (dataclasses.asdict)
            object.__setattr__(self, "mechanism", Mechanism.from_dict(self.mechanism))
        if isinstance(self.canaries, dict):
            object.__setattr__(self, "canaries", GradientCanaries(**self.canaries))
        if not self.clip_norm > 0 or math.isinf(self.clip_norm):
            raise PrivacyError(f"clip_norm must be finite and > 0 for a private step, got {self.clip_norm}")
        if not self.noise_multiplier >= 0:
            raise PrivacyError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise PrivacyError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if not 0 < self.delta < 1:
            raise PrivacyError(f"delta must be in (0, 1), got {self.delta}")
        if self.method not in METHODS or self.clipping not in CLIPPINGS:
            raise PrivacyError(f"method must be in {METHODS} and clipping in {CLIPPINGS}")

    @property
    def noise_std(self) -> float:
        """Std of the noise added to the clipped SUM (sensitivity ``clip_norm`` per example)."""
        return self.noise_multiplier * self.clip_norm


class TrainState(NamedTuple):
    params: Params
    opt_state: Any
    step: int
    key: int
    accountant: Accountant
    noise_history: NoiseHistory = ()  # a banded mechanism's last outputs (privacy.mechanisms.correlated)


# ckpt stores states without pickle, by registered type: privacy registers its own types
register_type("TrainState", TrainState, lambda s: dict(s._asdict()), lambda d: TrainState(**d))
register_type("DPConfig", DPConfig, dataclasses.asdict, lambda d: DPConfig(**d))


def init_state(params: Params, optimizer: Optimizer, *, key: int, config: DPConfig) -> TrainState:
    """The state before the first step: detached copies of ``params``, fresh optimizer state,
    step 0, an empty accountant carrying the run's budget and delta, and the mechanism's empty
    noise history (``()`` for independent noise)."""
    params = {k: v.detach().clone() for k, v in params.items()}
    accountant = Accountant(accountant=config.accountant, delta=config.delta, epsilon_budget=config.epsilon_budget,
                            **config.mechanism.ledger_fields)
    return TrainState(params, optimizer.init(params), 0, key, accountant, empty_history(config.mechanism))


def sample_batch(data: tuple[Tensor, Tensor], sampler: PoissonSampler, step: int) -> tuple[Tensor, Tensor]:
    """The Poisson batch of ``step``: rows of ``data`` chosen by ``sampler.indices(step)``."""
    idx = sampler.indices(step)
    return data[0][idx], data[1][idx]


def make_private_step(
    model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, config: DPConfig, *, num_examples: int,
    donate: bool = False, trainable: Trainable | None = None,
) -> Callable[[TrainState, tuple[Any, Tensor]], tuple[TrainState, dict[str, float]]]:
    """Returns ``step(state, batch) -> (new_state, metrics)``, pure: ``state`` is not changed.
    ``metrics`` is a :class:`~privacy.step_metrics.StepMetrics`: read like a dict, its values
    leave the device on the first read, so the step itself never waits for the device (the one
    exception, the non-finite guard, is in :func:`privacy.clipping.guarded_clip_factors`).

    Guarantees: the noised gradient is ``(sum_i c_i g_i + N(0, (sigma C)^2 I)) / (q N)``; the
    noise depends only on (state.key, state.step, parameter name, element index), so a sharded
    run adding :func:`privacy.noise.noise_slice` on its shards draws the same bits
    (``tests/test_private_step.py``). With ``epsilon_budget`` set, a step that would exceed it
    raises :class:`BudgetExhaustedError` before anything is computed. An empty batch is a valid
    step: gradient zero plus noise. Metrics: loss (mean over the batch), batch_size,
    clipped_fraction, mean_norm. Epsilon is not a per-step metric (a PLD composition costs
    up to a second): ask ``state.accountant.epsilon()`` when you want it.

    ``donate=True``: the caller gives up ``state`` (JAX's ``donate_argnums``); the optimizer may
    write the new parameters and moments into its tensors (``Optimizer.update_inplace``), with
    the same bits (``tests/test_private_step.py::test_donated_state_gives_the_same_bits``).
    A model with a module that mixes examples (BatchNorm in training mode) raises
    :class:`privacy.errors.PerExampleError` here, naming it. Making a step sets glibc's malloc
    to keep the host pages a step frees for the next one (:mod:`privacy.host_pages`; not where
    the environment configures malloc): allocation only, no value changes.

    ``trainable`` (``fsdpx.optim.Freezing`` or a callable ``step -> names``) changes which of
    ``state.params`` train, step by step. Formal Guarantees: a parameter frozen at a step adds
    nothing to any example's norm (the norm is over the trainable parameters: the sensitivity
    stays ``C``), gets no noise and no update, and it and its optimizer state are the same
    tensors after the step (``fsdpx.optim.update_trainable``, per-parameter counts); the
    accountant records the step as usual (noise of the same sigma on the trainable ones keeps
    the guarantee); a trainable parameter's noise bits do not depend on which others are frozen
    (``property_tests/test_freezing_properties.py``)."""
    check_model(model)  # a layer that mixes examples is named now, before any step
    keep_freed_pages()  # each step reuses the host pages the last one freed (privacy/host_pages.py)
    expected_batch = config.sample_rate * num_examples
    if expected_batch <= 0:
        raise PrivacyError(f"num_examples must be >= 1, got {num_examples}")

    # fsdpx.optim.update_fn, inlined: privacy does not import fsdpx
    inplace = getattr(optimizer, "update_inplace", None)
    update = inplace if donate and inplace is not None else optimizer.update

    bound: list = []  # the schedule bound to the state's parameter names at the first step
    mechanism = config.mechanism
    correlated = mechanism.kind != "independent"

    def step(state: TrainState, batch: tuple[Any, Tensor]) -> tuple[TrainState, dict[str, float]]:
        check_budget(state.accountant, config)
        if not bound:
            bound.append(bind(trainable, model, state.params))
        train, frozen = bound[0].split(state.params, state.step) if bound[0] else (state.params, {})
        with values_in(model, frozen):  # the forward reads the frozen ones' current values
            clipped = clip_and_sum(model, train, batch, loss_fn, clip_norm=config.clip_norm,
                                   method=config.method, clipping=config.clipping, nonfinite=config.nonfinite)
        if config.canaries is not None:  # an audit's canaries joining this batch: examples like the others
            config.canaries.add_(clipped.grads, state.step)
        # in place on the fresh clipped sums: the bits of (g + gaussian_noise(...)) / qN, and on
        # the CPU no parameter-sized noise tensor is ever allocated; on a CUDA device it is drawn there
        history = state.noise_history
        if correlated:  # (C^{-1} z)_t from z_t and the last bands - 1 outputs
            noise, history = streamed_noise(mechanism, clipped.grads, history, key=state.key, step=state.step,
                                            std=config.noise_std)
            noised = {k: g.add_(noise.pop(k)) for k, g in clipped.grads.items()}
        else:
            noised = add_gaussian_noise_(clipped.grads, key=state.key, step=state.step, std=config.noise_std)
        noised = {k: g.div_(expected_batch) for k, g in noised.items()}
        if bound[0] is not None:  # per-parameter counts once there is a schedule
            params, opt_state = frozen_update(optimizer, update)(noised, state.opt_state, state.params)
        else:
            params, opt_state = update(noised, state.opt_state, state.params)
        accountant = state.accountant.record(config.noise_multiplier, config.sample_rate)
        metrics = _metrics(clipped.norms, clipped.losses, config, real_count(batch))
        return TrainState(params, opt_state, state.step + 1, state.key, accountant, history), metrics

    return step


def check_budget(accountant: Accountant, config: DPConfig) -> None:
    """Raise :class:`BudgetExhaustedError` if one more step of ``config`` would exceed the
    accountant's ``epsilon_budget``; nothing is computed when there is no budget.

    When every recorded event is ``config``'s (the usual run) the test is O(1) against the
    cached :func:`privacy.accounting.max_steps`; otherwise the ledger is recomposed."""
    if accountant.epsilon_budget is None:
        return
    sigma, q = config.noise_multiplier, config.sample_rate
    if accountant.is_dp_sgd and all((e.noise_multiplier, e.sample_rate) == (sigma, q) for e in accountant.events):
        allowed = max_steps(sigma, q, accountant.delta, accountant.epsilon_budget, accountant=accountant.accountant,
                            value_discretization_interval=accountant.value_discretization_interval)
        if accountant.steps + 1 <= allowed:
            return
    accountant.check(sigma, q)  # raises with the full message


def _metrics(norms: Tensor, losses: Tensor, config: DPConfig, n: int) -> StepMetrics:
    """Means over the ``n`` real examples; padding rows (mask False) hold exact zeros in
    ``norms`` and ``losses`` (``clip_and_sum``), so sums over all rows are sums over the real.
    The sums stay on the step's device until the metrics are read (:class:`StepMetrics`)."""
    raw = {"loss": losses.detach().sum(), "clipped": (norms > config.clip_norm).sum(), "norm": norms.detach().sum()}
    return StepMetrics(raw, partial(_means, n=n))


def _means(host: dict[str, float], n: int) -> dict[str, float]:
    return {
        "loss": host["loss"] / n if n else float("nan"),
        "batch_size": n,
        "clipped_fraction": host["clipped"] / n if n else 0.0,
        "mean_norm": host["norm"] / n if n else 0.0,
    }
