"""Logical batches larger than memory, as Opacus' ``BatchMemoryManager`` splits them.

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=32, optimizer=optimizer) as batches:
        for x, y in batches:
            optimizer.zero_grad(); criterion(model(x), y).backward(); optimizer.step()

Each logical batch of ``data_loader`` (a Poisson draw) is cut along its first dimension into
physical batches of at most ``max_physical_batch_size`` examples; the optimizer's ``step()`` on
every physical batch but the last of a logical one only adds to the clipped sum
(``signal_skip_step``), so the parameters move once per logical batch, by exactly what one step on
the whole logical batch gives (``tests/test_opacus_entry.py::
test_virtual_steps_equal_one_step_on_the_logical_batch``). An empty logical batch is one empty
physical batch: its step still counts.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .optimizer import DPOptimizer


def _rows(batch: Any) -> int:
    return next(t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))


def physical_batches(batch: Any, size: int) -> list[Any]:
    """``batch`` cut along dim 0 into pieces of at most ``size`` rows (one empty piece for an
    empty batch)."""
    rows = _rows(batch)
    starts = range(0, rows, size) if rows else [0]
    return [tree_map(lambda t: t[a:a + size] if isinstance(t, torch.Tensor) else t, batch) for a in starts]


class BatchMemoryManager:
    """Context manager over ``data_loader`` yielding physical batches (module doc)."""

    def __init__(self, *, data_loader: Any, max_physical_batch_size: int, optimizer: DPOptimizer) -> None:
        if max_physical_batch_size < 1:
            raise ValueError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.data_loader, self.size, self.optimizer = data_loader, max_physical_batch_size, optimizer

    def __enter__(self) -> Iterator[Any]:
        return self._batches()

    def __exit__(self, *exc: Any) -> None:
        self.optimizer.signal_skip_step(False)

    def _batches(self) -> Iterator[Any]:
        for logical in self.data_loader:
            pieces = physical_batches(logical, self.size)
            for i, piece in enumerate(pieces):
                self.optimizer.signal_skip_step(i < len(pieces) - 1)
                yield piece
