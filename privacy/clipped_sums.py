"""Clipped sums formed when they are taken, so a sharded step never holds them all at once.

Once every example's clipping factor ``c_i`` is known, each parameter's clipped sum
``sum_i c_i g_i`` depends only on that parameter's contributions (its factors: activations and
output gradients) and on ``c``. Forming all of them first and reducing them afterwards holds
every parameter's full-size sum at once on top of the tape's factors: for GPT-2 small that is
the whole model's gradient (474 MiB) on every rank, even under ZeRO-3, whose point is to hold a
quarter of it. :class:`ClippedSums` forms a parameter's sum when the reduction takes it
(:meth:`ClippedSums.pop`) and drops that parameter's contributions right away, so the factors
shrink as the sums are taken and only the sums not yet reduced are alive: one unit's at a
time when the runtime reduces unit by unit (``fsdpx.runtime.reduce.reduce_and_update``).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch import Tensor

from privacy import contributions as C

_MISSING = object()


class ClippedSums(Mapping[str, Tensor]):
    """The clipped sum of each parameter, formed on first access.

    ``parts`` (taken over: entries are removed as sums are formed) holds each parameter's
    contributions; ``factors`` the ``[B]`` clipping factors; ``params`` every parameter, in the
    order the mapping iterates (only their shapes, dtypes and devices are read: a parameter
    with no contribution, unused by the forward, gets ``zeros_like``); ``ready`` sums already
    formed (the streamed ones).

    ``self[name]`` forms and keeps the sum; :meth:`pop` forms it (or takes the kept one) and
    forgets it. Either way the parameter's contributions are released once its sum exists.

    Guarantee: every sum is bit-identical to ``privacy.contributions.weighted_sum`` of the same
    contributions and factors, whatever order the sums are taken in (each sum reads only its own
    parameter's contributions) -- ``tests/test_clipped_sums.py``, and every sharded property
    test, which compares a sharded step against the unsharded run.
    """

    def __init__(self, parts: dict[str, list[C.Contribution]], factors: Tensor, params: Mapping[str, Tensor],
                 ready: dict[str, Tensor] | None = None):
        self._parts, self._factors, self._params = parts, factors, params
        self._formed: dict[str, Tensor] = dict(ready or {})
        self._taken: set[str] = set()

    def _form(self, name: str) -> Tensor:
        if name in self._formed:
            return self._formed[name]
        plist = self._parts.pop(name, None)
        p = self._params[name]
        return C.weighted_sum(plist, self._factors, p.shape) if plist else torch.zeros_like(p)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._params or name in self._taken:
            raise KeyError(name)
        if name not in self._formed:
            self._formed[name] = self._form(name)
        return self._formed[name]

    def pop(self, name: str, default=_MISSING) -> Tensor:
        """The sum of ``name``, which the mapping then no longer holds (nor its contributions);
        ``default`` (or ``KeyError``) for a name it does not have or already gave away."""
        if name not in self._params or name in self._taken:
            if default is _MISSING:
                raise KeyError(name)
            return default
        out = self._form(name)
        self._formed.pop(name, None)
        self._taken.add(name)
        return out

    def __contains__(self, name: object) -> bool:  # Mapping's default would form the sum
        return name in self._params and name not in self._taken

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._params if n not in self._taken)

    def __len__(self) -> int:
        return len(self._params) - len(self._taken)
