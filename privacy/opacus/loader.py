"""Poisson batches from a user's ``DataLoader``, as Opacus' ``DPDataLoader`` makes them.

    loader = poisson_loader(DataLoader(dataset, batch_size=64), key=0)

Each batch holds every example independently with probability ``1 / len(original loader)``
(:class:`privacy.PoissonSampler`: a pure function of ``(key, step)``, the sampler every fsdpx run
uses), ``len(original loader)`` batches per epoch, the dataset, ``collate_fn``, workers and pinning
of the original. An empty draw is a batch of zero rows (the sample's shapes, 0 first), which
the private step takes as zero gradient and still counts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data._utils.collate import default_collate

from privacy.sampling import PoissonSampler


class PoissonBatches(Sampler[list[int]]):
    """``steps`` batches of indices per epoch, each drawn by ``sampler`` at the run's next step."""

    def __init__(self, sampler: PoissonSampler, steps: int) -> None:
        self.sampler, self.steps, self.epoch = sampler, steps, 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        first = self.epoch * self.steps
        self.epoch += 1
        for t in range(first, first + self.steps):
            yield self.sampler.indices(t).tolist()


def _empty_aware(collate: Callable[[list], Any], dataset: Any) -> Callable[[list], Any]:
    def collate_batch(samples: list) -> Any:
        if samples:
            return collate(samples)
        one = collate([dataset[0]])
        return torch.utils._pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)
    return collate_batch


def poisson_loader(loader: DataLoader, *, key: int) -> DataLoader:
    """A ``DataLoader`` over ``loader``'s dataset whose batches are Poisson samples with rate
    ``1 / len(loader)`` (module doc); ``len()`` is ``len(loader)``. Guarantee: the batch of step
    ``t`` is ``PoissonSampler(len(dataset), 1 / len(loader), key=key).indices(t)``
    (``tests/test_opacus_entry.py::test_batches_are_the_poisson_sampler_s``)."""
    dataset = loader.dataset
    sampler = PoissonSampler(len(dataset), 1.0 / len(loader), key=key)
    return DataLoader(dataset, batch_sampler=PoissonBatches(sampler, len(loader)),
                      collate_fn=_empty_aware(loader.collate_fn or default_collate, dataset),
                      num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                      worker_init_fn=loader.worker_init_fn, generator=loader.generator)
