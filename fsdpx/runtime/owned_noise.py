"""The private step's noise on a sharded run: each rank draws the unsharded run's noise for
exactly the elements it updates, so the ranks together add one unsharded draw.

``privacy.noise_slice`` is a pure function of (key, step, parameter name, flat index), so the
bits of an element do not depend on who draws it or in what order; replicas draw identical bits.
``flat_runs`` turns a rank's block (a box of global indices) into flat index ranges,
``shard_noise`` draws a box, ``mechanism_noise`` a correlated-noise mechanism's noise of a box
(``privacy.mechanisms.correlated``: one draw and the box's last ``b - 1`` outputs, which the
state keeps), and ``OwnedNoise`` draws each parameter's optimizer-state block when the reduction
adds it (``fsdpx.runtime.reduce.reduce_and_update``) and gives the step the history after it.
"""

from __future__ import annotations

import math
from typing import Collection, Sequence

import torch
from torch import Tensor

from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import local_box
from fsdpx.sharding.plan import ShardingPlan
from privacy.mechanisms.correlated import NoiseHistory, check_history, history_after, past_outputs, scaled, stream_step
from privacy.mechanisms.mechanism import Mechanism
from privacy.noise import BLOCK, draws_on_device, noise_slice, open_names
from privacy.step import DPConfig

from .sharded_state import ShardedState


def flat_runs(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The global flat index ranges ``[start, stop)`` of ``box`` in row-major order, merged
    where contiguous (one range for a dim-0 shard)."""
    if any(a >= b for a, b in box):
        return []
    if not shape:
        return [(0, 1)]
    inner = math.prod(shape[1:])
    if all(box[d] == (0, shape[d]) for d in range(1, len(shape))):
        return [(box[0][0] * inner, box[0][1] * inner)]
    runs = []
    for i in range(*box[0]):
        runs += [(i * inner + a, i * inner + b) for a, b in flat_runs(shape[1:], box[1:])]
    return runs


def shard_noise(name: str, shape: tuple[int, ...], box, *, key: int, step: int, std: float, dtype,
                device: torch.device | str = "cpu", checked: bool = True) -> Tensor:
    """The unsharded run's noise for the elements of ``box`` of parameter ``name``, shaped like
    the box: ``noise_slice`` of each of the box's flat runs, concatenated, on ``device``. It is
    drawn where it goes (on a CUDA device in torch ops, nothing copied from the host but the
    block seeds): the same bits on any device.

    Runs closer than ``privacy.noise.BLOCK`` are drawn as one covering slice and cut out of it
    (partition invariance makes the bits the same): a column block of a row-parallel weight is
    one short run per row, and drawing each alone would restart its noise block every time, up
    to ``BLOCK`` draws per run; covering costs at most the gaps, never more than the parameter
    (``tests/test_runtime.py::test_shard_noise_equals_the_unsharded_draw_of_its_box``).
    ``checked=False``: as ``noise_slice``'s (off the CPU, NaN where the sampler left an element
    open, nothing read)."""
    numel = math.prod(shape)
    parts = []
    for lo, hi, runs in _clusters(flat_runs(shape, box), BLOCK):
        drawn = noise_slice(name, numel, lo, hi, key=key, step=step, std=std, dtype=dtype, device=device,
                            checked=checked)
        parts += [drawn] if len(runs) == 1 else [drawn[a - lo:b - lo] for a, b in runs]
    size = tuple(b - a for a, b in box)
    if not parts:
        return torch.zeros(size, dtype=dtype, device=device)
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).view(size)


def mechanism_noise(mechanism: Mechanism, name: str, shape: tuple[int, ...], box, *, key: int, step: int,
                    std: float, dtype, device: torch.device | str = "cpu",
                    past: Sequence[Tensor | None] = (), checked: bool = True
                    ) -> tuple[Tensor, list[Tensor | None] | None]:
    """``(noise, kept)``: the unsharded run's noise of ``mechanism`` for the elements of
    ``box``, and the history entries to keep after it (``None`` for independent noise).
    Independent: :func:`shard_noise`. Banded or BLT: ``std * w_t`` with ``w_t`` the streaming step
    (``privacy.mechanisms.correlated.stream_step``) of the box's unit float64 draw and ``past``,
    the box's history entries (past outputs, or a BLT's buffers), all on ``device``: the operations (and so the bits) of
    ``privacy.mechanisms.correlated.streamed_noise`` on the whole parameter, cut to the box
    (``tests/test_mechanisms_sharded.py::test_mechanism_noise_of_a_box_is_the_unsharded_draw``).
    ``checked=False``: as :func:`shard_noise`'s; the streaming step is elementwise, so an open
    element is NaN in the noise and in the kept entries and nowhere else."""
    if mechanism.kind == "independent":
        return shard_noise(name, shape, box, key=key, step=step, std=std, dtype=dtype, device=device,
                           checked=checked), None
    z = shard_noise(name, shape, box, key=key, step=step, std=1.0, dtype=torch.float64, device=device,
                    checked=checked)
    output, kept = stream_step(mechanism, z, past)
    return scaled(output, std, dtype), kept


def _clusters(runs: list[tuple[int, int]], gap: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Consecutive ``runs`` grouped while the space between them is at most ``gap``: each group
    as ``(first start, last stop, its runs)``."""
    out: list[tuple[int, int, list[tuple[int, int]]]] = []
    for a, b in runs:
        if out and a - out[-1][1] <= gap:
            lo, _, members = out[-1]
            members.append((a, b))
            out[-1] = (lo, b, members)
        else:
            out.append((a, b, [(a, b)]))
    return out


class OwnedNoise:
    """Each parameter's noise on the elements this rank updates (its optimizer-state block):
    the unsharded run's draw for exactly those global indices (a fused view keeps the
    parameter's flat order, so the indices are the parameter's own). Drawn by :meth:`add_to`,
    when the reduction adds it, so one parameter's noise is alive at a time, never the whole
    model's (a full gradient's worth under DDP); a banded or BLT mechanism's history entries of
    each block (past outputs, or buffers) are kept for :meth:`history`. The bits
    do not depend on the order of the draws: each is a pure function of (key, step, name, index)
    and the block's history. Only the ``trainable`` ones exist when a freezing schedule gives
    them: a frozen parameter gets none (``add_to`` raises ``KeyError``), and the others' bits
    are the same (noise is per parameter name).

    On a device (CUDA: ``privacy.noise.draws_on_device``) the draws are unchecked, so no draw
    reads the device: :meth:`settle`, once every block is noised and before the update, reads
    one boolean for all of them and redraws, checked, the rare block the sampler's fixed rounds
    left an element of open (``tests/test_step_syncs.py::
    test_a_sharded_step_with_device_noise_reads_the_guard_and_one_noise_check``)."""

    def __init__(self, state: ShardedState, plan: ShardingPlan, comm: Comm, config: DPConfig,
                 trainable: Collection[str] | None = None):
        self.state, self.plan, self.comm, self.config = state, plan, comm, config
        self.names = frozenset(plan.params if trainable is None else (n for n in plan.params if n in trainable))
        self.kept: dict[str, list[Tensor | None]] = {}
        self.flags: dict[str, Tensor] = {}
        check_history(config.mechanism, state.noise_history)

    def _draw(self, name: str, checked: bool) -> tuple[Tensor, list[Tensor | None] | None]:
        lay = self.plan.params[name]
        box = local_box(lay.shape, lay.opt_state, self.comm.mesh, self.comm.rank)
        held = self.state.params[name]
        noise, kept = mechanism_noise(self.config.mechanism, name, lay.shape, box, key=self.state.key,
                                      step=self.state.step, std=self.config.noise_std, dtype=held.dtype,
                                      device=held.device, past=past_outputs(self.state.noise_history, name),
                                      checked=checked)
        if self.config.canaries is not None:  # an audit's canaries on these elements, as the unsharded sum gets them
            self.config.canaries.add_box_(noise, name, lay.shape, box, self.state.step)
        return noise, kept

    def add_to(self, name: str, grad: Tensor) -> Tensor:
        """``grad`` plus parameter ``name``'s noise on this rank's optimizer-state block (shaped
        like that block, in the dtype and on the device of the parameter's held tensor): the
        bits of ``grad + noise``. On a device an element the draw left open keeps ``grad``'s
        value until :meth:`settle`, which must run before the result is used."""
        if name not in self.names:
            raise KeyError(f"no noise for {name!r}: not a trainable parameter of this step")
        checked = not draws_on_device(self.state.params[name].device)
        noise, kept = self._draw(name, checked)
        if kept is not None:
            self.kept[name] = kept
        if checked:
            return grad + noise
        open_ = noise.isnan()
        self.flags[name] = open_.any()
        out = grad + noise
        return torch.where(open_, grad, out, out=out)

    def settle(self, noised: dict[str, Tensor]) -> None:
        """Complete the unchecked draws of :meth:`add_to` in ``noised`` (name -> its result, in
        place): one read for all of them; a block with an open element (rare) is drawn again
        checked, and the exact noise (and history entries) replaces the open elements only."""
        for name in open_names(self.flags):
            open_ = self._draw(name, checked=False)[0].isnan()
            exact, kept = self._draw(name, checked=True)
            g = noised[name]
            torch.where(open_, g + exact, g, out=g)
            if kept is not None:  # the streaming step is elementwise: only the open elements differ
                self.kept[name] = [e if e is None else torch.where(open_, e, k)
                                   for e, k in zip(kept, self.kept[name])]
        self.flags.clear()

    def history(self) -> NoiseHistory:
        """The state's ``noise_history`` after this step: the entries each :meth:`add_to` kept
        (``privacy.mechanisms.correlated.history_after``); call it once every trainable
        parameter has been noised and :meth:`settle` has run."""
        return history_after(self.config.mechanism.history_length, self.kept)
