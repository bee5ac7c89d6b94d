"""Canaries in gradient space, inside a real run: what ``fsdpx train --audit-canaries M`` adds.

A canary is an example whose clipped gradient is ``norm * e_k``: the clip norm (the most one
example may move the sum) on one coordinate ``k`` of one trainable parameter, nothing elsewhere.
``count`` canaries sit on distinct coordinates drawn from the run's key over the trainable
parameters' elements; each is *in* the run with probability 1/2 (the membership the audit
guesses), and an *in* canary joins each step's batch with the run's sample rate, as a real
example does under Poisson sampling. The step adds the participating canaries to the clipped
sum before the noise, as one more example each: the mechanism the accountant describes is the
one that sees them, so the audit's bound holds for the run as trained (Steinke, Nasr,
Jagielski 2023, gradient-space canaries in the white-box setting).

Everything here is a pure function of ``(key, step, canary)``: placement, membership and
participation are numpy draws seeded by them, so a sharded run adds, on the elements each rank
updates, exactly the canaries the one-process run adds (:meth:`GradientCanaries.add_box_`),
and a resumed run continues the same canaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from privacy.errors import PrivacyError

_PLACE, _MEMBER, _JOIN = 0x706C6163, 0x6D656D62, 0x6A6F696E  # draw tags: placement, membership, joining


@dataclass(frozen=True)
class GradientCanaries:
    """``count`` canaries of gradient norm ``norm`` over ``params`` (``(name, numel)`` of the
    trainable parameters, in a fixed order), drawn from ``key``, joining a step's batch with
    probability ``sample_rate`` when in.

    Formal Guarantees (``tests/test_gradient_canaries.py``): distinct coordinates; about half
    in; a canary joins step ``t`` iff in and its ``(key, t)`` uniform is below the rate;
    :meth:`add_box_` on the boxes of any sharding adds what :meth:`add_` adds to the whole
    tensors (``test_boxes_add_what_the_whole_tensor_gets``).
    Edge cases: ``count < 2``, more canaries than elements, or a rate outside (0, 1] ->
    :class:`PrivacyError` naming it."""

    count: int
    key: int
    norm: float
    sample_rate: float
    params: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple((str(n), int(k)) for n, k in self.params))  # from a checkpoint's lists
        total = sum(k for _, k in self.params)
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 2:
            raise PrivacyError(f"audit canaries must be an int >= 2, got {self.count!r}")
        if self.count > total:
            raise PrivacyError(f"{self.count} audit canaries need as many trainable elements; the model has {total}")
        if not 0 < self.sample_rate <= 1:
            raise PrivacyError(f"the canaries' sample rate must be in (0, 1], got {self.sample_rate}")

    @cached_property
    def coordinates(self) -> tuple[np.ndarray, np.ndarray]:
        """``(which parameter, flat index in it)`` per canary: distinct elements drawn uniformly
        over all the trainable elements."""
        sizes = np.array([k for _, k in self.params], dtype=np.int64)
        flat = np.random.default_rng([self.key, _PLACE]).choice(int(sizes.sum()), self.count, replace=False)
        ends = np.cumsum(sizes)
        which = np.searchsorted(ends, flat, side="right")
        return which, flat - (ends[which] - sizes[which])

    @cached_property
    def included(self) -> np.ndarray:
        """Each canary's membership: in with probability 1/2, what the audit guesses."""
        return np.random.default_rng([self.key, _MEMBER]).random(self.count) < 0.5

    def joining(self, step: int) -> np.ndarray:
        """The canaries in step ``step``'s batch: in, and their Poisson draw below the rate (drawn
        once per step: every parameter's block asks for it)."""
        last = self.__dict__.get("_joining")
        if last is None or last[0] != step:
            draw = np.random.default_rng([self.key, step, _JOIN]).random(self.count) < self.sample_rate
            last = (step, self.included & draw)
            self.__dict__["_joining"] = last
        return last[1]

    def _of(self, name: str, step: int) -> np.ndarray:
        """The flat indices in parameter ``name`` of the canaries joining step ``step``."""
        which, index = self.coordinates
        position = self.positions.get(name)
        if position is None:
            return np.empty(0, dtype=np.int64)
        return index[(which == position) & self.joining(step)]

    @cached_property
    def positions(self) -> dict[str, int]:
        """Each parameter's place in ``params``."""
        return {n: i for i, (n, _) in enumerate(self.params)}

    def add_(self, grads: dict[str, Tensor], step: int) -> None:
        """Add ``norm`` at the joining canaries' coordinates of the whole clipped sums ``grads``
        (names not among ``params`` get nothing)."""
        for name, g in grads.items():
            at = self._of(name, step)
            if at.size:
                g.view(-1)[torch.from_numpy(at).to(g.device)] += self.norm

    def add_box_(self, block: Tensor, name: str, shape: tuple[int, ...], box: tuple[tuple[int, int], ...],
                 step: int) -> None:
        """Add to ``block`` (the elements ``box`` of parameter ``name``, whose global shape is
        ``shape``, row-major flat order) what :meth:`add_` adds to those elements."""
        at = self._of(name, step)
        if not at.size:
            return
        point = np.stack(np.unravel_index(at, shape), axis=1) if shape else np.zeros((at.size, 0), dtype=np.int64)
        lo = np.array([a for a, _ in box], dtype=np.int64)
        hi = np.array([b for _, b in box], dtype=np.int64)
        inside = np.all((point >= lo) & (point < hi), axis=1)
        for local in point[inside] - lo:
            block[tuple(int(i) for i in local)] += self.norm

    def values(self, params: dict[str, Tensor]) -> np.ndarray:
        """The canaries' coordinates read from whole ``params`` (float64, one per canary)."""
        which, index = self.coordinates
        out = np.empty(self.count, dtype=np.float64)
        for position, (name, _) in enumerate(self.params):  # one gather (and one copy) per parameter
            mine = which == position
            if mine.any():
                flat = params[name].detach().reshape(-1)
                out[mine] = flat[torch.from_numpy(index[mine]).to(flat.device)].double().cpu().numpy()
        return out
