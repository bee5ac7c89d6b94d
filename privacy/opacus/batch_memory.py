"""Logical batches larger than memory, as Opacus' ``BatchMemoryManager`` splits them.

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=32, optimizer=optimizer) as batches:
        for x, y in batches:
            optimizer.zero_grad(); criterion(model(x), y).backward(); optimizer.step()

Each logical batch of ``data_loader`` (a Poisson draw) is cut along its first dimension into
``ceil(rows / max_physical_batch_size)`` physical batches of near-equal size (Opacus'
``np.array_split``); the optimizer's ``step()`` on
every physical batch but the last of a logical one only adds to the clipped sum
(``signal_skip_step``), so the parameters move once per logical batch, by exactly what one step on
the whole logical batch gives (``tests/test_opacus_entry.py::
test_virtual_steps_equal_one_step_on_the_logical_batch``). An empty logical batch is one empty
physical batch: its step still counts. ``len()`` of what the manager yields is Opacus': the
expected number of physical batches per epoch (``ceil(len(loader) * expected / max)``, expected
being the loader's batch size, or for a Poisson loader the expected batch size).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .optimizer import DPOptimizer


def _rows(batch: Any) -> int:
    return next(t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))


def physical_batches(batch: Any, size: int, pieces: int | None = None) -> list[Any]:
    """``batch`` cut along dim 0 into ``pieces`` (default ``ceil(rows / size)``) pieces of at
    most ``size`` rows, the first ``rows % pieces`` one row longer (``np.array_split``, as Opacus
    cuts); one empty piece for an empty batch. More ``pieces`` than rows gives empty ones."""
    rows = _rows(batch)
    pieces = max(1, math.ceil(rows / size)) if pieces is None else pieces
    lengths = [rows // pieces + (1 if i < rows % pieces else 0) for i in range(pieces)]
    starts = [sum(lengths[:i]) for i in range(pieces)]
    return [tree_map(lambda t: t[a:a + n] if isinstance(t, torch.Tensor) else t, batch)
            for a, n in zip(starts, lengths)]


def expected_rows(loader: Any) -> float | None:
    """The expected rows of one of ``loader``'s batches: its ``batch_size``, or its batch
    sampler's ``expected_batch_size`` (a Poisson loader); ``None`` when neither is known."""
    if getattr(loader, "batch_size", None):
        return float(loader.batch_size)
    return getattr(getattr(loader, "batch_sampler", None), "expected_batch_size", None)


class PhysicalBatches:
    """What :class:`BatchMemoryManager` yields: iterable once per epoch over the physical
    batches, signalling the optimizer which steps only accumulate; ``len()`` as Opacus'."""

    def __init__(self, loader: Any, size: int, optimizer: DPOptimizer) -> None:
        self.loader, self.size, self.optimizer = loader, size, optimizer

    def __len__(self) -> int:
        expected = expected_rows(self.loader)
        return len(self.loader) if expected is None else math.ceil(len(self.loader) * expected / self.size)

    def __iter__(self) -> Iterator[Any]:
        for logical in self.loader:
            pieces = physical_batches(logical, self.size, self.optimizer.physical_pieces(_rows(logical), self.size))
            for i, piece in enumerate(pieces):
                self.optimizer.signal_skip_step(i < len(pieces) - 1)
                yield piece


class BatchMemoryManager:
    """Context manager over ``data_loader`` yielding physical batches (module doc)."""

    def __init__(self, *, data_loader: Any, max_physical_batch_size: int, optimizer: DPOptimizer) -> None:
        if max_physical_batch_size < 1:
            raise ValueError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.data_loader, self.size, self.optimizer = data_loader, max_physical_batch_size, optimizer

    def __enter__(self) -> PhysicalBatches:
        return PhysicalBatches(self.data_loader, self.size, self.optimizer)

    def __exit__(self, *exc: Any) -> None:
        self.optimizer.signal_skip_step(False)
