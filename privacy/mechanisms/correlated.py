"""The correlated noise of a banded (or BLT) mechanism, streamed: ``C w = z`` solved one step at a time.

A BLT (``privacy.mechanisms.blt``) streams the same way from ``D`` buffers instead of past
outputs (:func:`stream_step`); its history entries are those buffers, everything below about the
history (layout, checkpoints, freezing: the restarted BLT's non-negative columns sum to no more)
holds for it too.

Step ``t``'s noise is ``w_t = (C^{-1} z)_t``, ``z_k`` the independent unit draw of step ``k``
(``privacy.noise.noise_slice``, ``step=k``, float64). ``C`` is lower-triangular Toeplitz with
``b`` bands (first column ``c``), so row ``t`` of ``C w = z`` reads
``c_0 w_t + sum_{j=1..b-1} c_j w_{t-j} = z_t``, and

    w_t = (z_t - sum_{j=1..b-1} c_j w_{t-j}) / c_0

needs ONE draw and the last ``b - 1`` outputs: O(b) work per element and step, whatever the
step (``C^{-1}`` itself is dense). Those outputs are the :data:`NoiseHistory`, part of the train
state (``TrainState.noise_history``, ``ShardedState.noise_history``): checkpointed with the run
and laid out like the optimizer state (``ckpt.rules``), so a resume continues bit for bit in
any layout.

Every element takes the same float64 operations (a multiply, a subtract per band, a divide)
whatever the shard, so a sharded run's noise is the unsharded run's bit for bit
(``fsdpx.runtime.owned_noise.mechanism_noise``).

Freezing: a parameter frozen at a step gets no noise and its history is dropped, so its noise
restarts (zero history) when it trains again. Each run of consecutive trainable steps of a
parameter is then the same banded mechanism started afresh: ``C`` is block-diagonal over those
runs, its columns keep norm at most 1 and participations ``b`` apart still touch disjoint rows,
so the sensitivity (``privacy.mechanisms.sensitivity``) is unchanged.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import Tensor

from privacy.errors import PrivacyError
from privacy.noise import gaussian_noise, noise_slice

from .blt import blt_step, strategy_of
from .mechanism import Mechanism

NoiseHistory = tuple[dict[str, Tensor], ...]
"""A banded mechanism's past unit outputs: entry ``j`` maps a parameter's name to its
``w_{t-1-j}`` (float64, shaped like the parameter or the rank's block of it), ``b - 1`` entries.
A name absent from an entry has output 0 there (before its first step, or after a frozen step)."""


def empty_history(mechanism: Mechanism) -> NoiseHistory:
    """The history before step 0: ``history_length`` empty entries (``bands - 1``; a BLT's ``D``;
    ``()`` for independent noise)."""
    return tuple({} for _ in range(mechanism.history_length))


def check_history(mechanism: Mechanism, history: NoiseHistory) -> None:
    """Raise ``PrivacyError`` unless ``history`` has the mechanism's ``bands - 1`` entries: a
    state saved before noise was streamed (no history) or by another mechanism would restart
    the noise silently, so it is refused."""
    if len(history) != mechanism.history_length:
        raise PrivacyError(f"the state's noise_history has {len(history)} entries; the {mechanism.kind} mechanism"
                           f" keeps {mechanism.history_length} (a state saved before its noise was streamed, or by"
                           " another mechanism, cannot continue it)")


def past_outputs(history: NoiseHistory, name: str) -> list[Tensor | None]:
    """Parameter ``name``'s ``w_{t-1}, ..., w_{t-b+1}`` (``None`` where it is 0)."""
    return [entry.get(name) for entry in history]


def next_output(mechanism: Mechanism, z: Tensor, past: Sequence[Tensor | None]) -> Tensor:
    """``w_t = (z_t - sum_{j=1..b-1} c_j w_{t-j}) / c_0`` elementwise in float64, ``z`` the unit
    draw of step ``t`` and ``past`` the outputs ``w_{t-1}, ..., w_{t-b+1}`` (``None``: 0).

    Formal Guarantees:
      * Stepping from ``empty_history`` gives ``C^{-1}`` times the stacked draws (the dense
        product) to float64 rounding
        (``tests/test_mechanisms.py::test_streamed_noise_is_the_inverse_strategy_times_the_draws``);
        its covariance over keys is ``(C^{-1} C^{-T})[t, t']``
        (``test_streamed_noise_has_the_mechanisms_covariance``).
      * Elementwise, in a fixed order of float64 operations: any block of the inputs gives the
        same block of the output, bit for bit.
    Edge cases: ``past`` longer than ``bands - 1`` raises ``ValueError``; a ``past`` shaped
    unlike ``z`` raises torch's broadcasting error; a ``past`` on another device is read on
    ``z``'s (a history loaded from a checkpoint), and the output is on ``z``'s."""
    c = mechanism.coefficients
    if len(past) > len(c) - 1:
        raise ValueError(f"{len(past)} past outputs for a mechanism of {len(c)} bands (at most {len(c) - 1})")
    acc = z.to(torch.float64)
    for coef, w in zip(c[1:], past):
        if w is not None:  # a history read from a checkpoint may still be on the host: moved to z's device
            acc = acc - w.to(acc.device) * coef  # two roundings, no fused multiply-add: the same bits on every device
    return acc / c[0]


def stream_step(mechanism: Mechanism, z: Tensor, past: Sequence[Tensor | None]) -> tuple[Tensor, list[Tensor]]:
    """``(w_t, kept)``: the unit output of step ``t`` from its draw ``z`` and the parameter's
    history entries ``past`` (:func:`past_outputs`), and the entries to keep for step ``t + 1``
    (``history_length`` of them, ``None`` where 0). Banded: :func:`next_output`, then ``w_t`` and
    the older outputs but the oldest. BLT: ``privacy.mechanisms.blt.blt_step`` on the ``D``
    buffers. Elementwise in both: a block of the inputs gives that block of the outputs, bit for bit."""
    if mechanism.kind == "blt":
        return blt_step(strategy_of(mechanism), z, past)
    w = next_output(mechanism, z, past)
    return w, [w, *past][:mechanism.history_length]


def history_after(length: int, kept: Mapping[str, Sequence[Tensor | None]]) -> NoiseHistory:
    """The history after a step whose parameters that trained kept ``kept[name]`` (``length``
    entries each, :func:`stream_step`): entry ``j`` maps each name to its ``j``-th, ``None`` left
    out. A parameter that did not train (frozen) is dropped: its noise restarts (module doc)."""
    return tuple({n: e[j] for n, e in kept.items() if e[j] is not None} for j in range(length))


def streamed_noise(mechanism: Mechanism, params_like: Mapping[str, Tensor], history: NoiseHistory, *, key: int,
                   step: int, std: float) -> tuple[dict[str, Tensor], NoiseHistory]:
    """Step ``step``'s noise of every parameter of ``params_like`` and the history after it:
    per name ``std * w_t`` (:func:`next_output` of the whole parameter's unit float64 draw, drawn
    on its device), reshaped like it, rounded to its dtype. Reads names, shapes, dtypes and
    devices only. ``history`` must be this mechanism's (``bands - 1`` entries); names it lacks
    start from zero.

    Formal Guarantees: for the independent mechanism, ``privacy.noise.gaussian_noise``'s bits
    and ``()`` (``tests/test_mechanisms.py::test_independent_mechanism_is_todays_noise``); else
    the noise of each name is the sharded
    ``fsdpx.runtime.owned_noise.mechanism_noise`` of its blocks, concatenated, bit for bit
    (``tests/test_mechanisms_sharded.py::test_mechanism_noise_of_a_box_is_the_unsharded_draw``);
    ``std == 0`` gives zeros and still advances the history. Edge cases: a history of another
    length raises :func:`check_history`'s ``PrivacyError``; bad ``std``, ``step`` or ``key`` as
    ``noise_slice``."""
    if mechanism.kind == "independent":
        return gaussian_noise(dict(params_like), key=key, step=step, std=std), ()
    check_history(mechanism, history)
    noise, kept = {}, {}
    for name, t in params_like.items():
        z = noise_slice(name, t.numel(), 0, t.numel(), key=key, step=step, std=1.0, dtype=torch.float64,
                        device=t.device).view(t.shape)
        output, kept[name] = stream_step(mechanism, z, past_outputs(history, name))
        noise[name] = scaled(output, std, t.dtype)
    return noise, history_after(mechanism.history_length, kept)


def scaled(output: Tensor, std: float, dtype: torch.dtype) -> Tensor:
    """``std * output`` in float64, rounded to ``dtype``: the noise a step adds. A negative or
    non-finite ``std`` raises ``ValueError`` naming it."""
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"std must be finite and >= 0, got std={std}")
    return (output * std).to(dtype)
