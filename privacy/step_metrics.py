"""A step's metrics that do not make the step wait for its device.

A private step's metrics (mean loss, clipped fraction, mean norm) are reductions of tensors the
step computed on its device. Reading one as a Python float (``float(t)``, ``t.item()``) makes the
host wait until the device has finished everything queued before it: inside a GPU step, before
the noise and the optimizer update are even queued, so the device idles while the host queues
them. :class:`StepMetrics` holds the tensors and converts them on the first read, after the step
has returned and queued all its work: all of them in one transfer, then the same Python
arithmetic (same floats) as an eager conversion would do.

    m = StepMetrics({"loss_sum": losses.sum(), "n": 8}, finish)   # nothing read yet
    m["loss"]                                                       # one transfer, then cached

Mutable like a dict (a caller may add entries, e.g. ``comm_bytes``); ``dict(m)``, ``{**m}``,
``m.items()`` and ``==`` read every value, so they convert.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch import Tensor

Raw = dict[str, Any]
"""Tensors (any shape, any device) and Python numbers, by name: what a step measured."""


def to_host(raw: Raw) -> dict[str, Any]:
    """``raw`` with every tensor as Python numbers (a 0-d tensor a float, others nested lists),
    moved in one device-to-host transfer per device: each tensor is cast to float64 (exact for
    float32/bf16 values and integers below 2**53) and concatenated. Other values are kept."""
    tensors = {k: v for k, v in raw.items() if isinstance(v, Tensor)}
    out = {k: v for k, v in raw.items() if k not in tensors}
    by_device: dict[torch.device, list[str]] = {}
    for k, v in tensors.items():
        by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        flat = torch.cat([tensors[k].detach().reshape(-1).to(torch.float64) for k in keys]).tolist()
        start = 0
        for k in keys:
            t = tensors[k]
            n = t.numel()
            values = flat[start:start + n]
            start += n
            out[k] = values[0] if t.dim() == 0 else torch.tensor(values, dtype=torch.float64).reshape(t.shape).tolist()
    return out


class StepMetrics(MutableMapping):
    """Metrics computed from ``raw`` by ``finish`` at the first read (module doc).

    ``finish(host)`` receives ``raw`` with its tensors as Python numbers (:func:`to_host`) and
    returns the metrics. Guarantee: reading gives exactly ``finish(to_host(raw))``, the values an
    eager step would have returned, and nothing is transferred before the first read
    (``tests/test_step_syncs.py``). Entries set with ``m[k] = v`` are kept as they are."""

    def __init__(self, raw: Raw, finish: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._raw: Raw | None = raw
        self._finish = finish
        self._values: dict[str, Any] = {}
        self._set: dict[str, Any] = {}

    def _read(self) -> dict[str, Any]:
        if self._raw is not None:
            self._values = self._finish(to_host(self._raw))
            self._raw = None
        return self._values

    @property
    def pending(self) -> bool:
        """Whether the values are still on the device (nothing read yet)."""
        return self._raw is not None

    def __getitem__(self, key: str) -> Any:
        if key in self._set:
            return self._set[key]
        return self._read()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._set[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self._set:
            del self._set[key]
        else:
            del self._read()[key]

    def __iter__(self) -> Iterator[str]:
        yield from self._read()
        yield from (k for k in self._set if k not in self._values)

    def __len__(self) -> int:
        return len(set(self._read()) | set(self._set))

    def __repr__(self) -> str:
        return f"StepMetrics({dict(self)!r})"
