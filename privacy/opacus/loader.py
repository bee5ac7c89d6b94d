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

from fsdpx.sharding.layout import chunk_bounds
from privacy.sampling import PoissonSampler


class PoissonBatches(Sampler[list[int]]):
    """``steps`` batches of indices per epoch, each drawn by ``sampler`` at the run's next step;
    ``expected_batch_size``: ``sample_rate * examples`` (what ``BatchMemoryManager``'s ``len()``
    reads). ``share=(rank, ranks)``: of each draw, only chunk ``rank`` of ``ranks``
    (``chunk_bounds``, the rows the sharded step gives that rank), so the ranks' batches
    together are the one-process batch; the expected size is then the rank's share."""

    def __init__(self, examples: int, steps: int, key: int | None, share: tuple[int, int] = (0, 1)) -> None:
        self.examples, self.steps, self.epoch, self.key, self.share = examples, steps, 0, key, share
        self.expected_batch_size = examples / steps / share[1]

    @property
    def sampler(self) -> PoissonSampler:
        """The run's sampler; a ``None`` key is drawn from torch's global generator now (once)."""
        if self.key is None:
            self.key = draw_key(None)
        return PoissonSampler(self.examples, 1.0 / self.steps, key=self.key)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        first, sampler = self.epoch * self.steps, self.sampler
        self.epoch += 1
        rank, ranks = self.share
        for t in range(first, first + self.steps):
            drawn = sampler.indices(t)
            a, b = chunk_bounds(len(drawn), ranks, rank)
            yield drawn[a:b].tolist()


def draw_key(generator: torch.Generator | None) -> int:
    """A 62-bit key drawn from ``generator``, or from torch's global generator for ``None``: how
    a seeded ``torch.Generator`` or ``torch.manual_seed`` chooses fsdpx's pure-function
    randomness, as they choose Opacus' (two unseeded runs differ; equal seeds give equal keys)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64))


def _empty_aware(collate: Callable[[list], Any], dataset: Any) -> Callable[[list], Any]:
    def collate_batch(samples: list) -> Any:
        if samples:
            return collate(samples)
        one = collate([dataset[0]])
        return torch.utils._pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)
    return collate_batch


def poisson_loader(loader: DataLoader, *, key: int | None, share: tuple[int, int] = (0, 1)) -> DataLoader:
    """A ``DataLoader`` over ``loader``'s dataset whose batches are Poisson samples with rate
    ``1 / len(loader)`` (module doc); ``len()`` is ``len(loader)``. Guarantee: the batch of step
    ``t`` is ``PoissonSampler(len(dataset), 1 / len(loader), key=key).indices(t)``
    (``tests/test_opacus_entry.py::test_batches_are_the_poisson_sampler_s``). ``key=None``: drawn
    from ``loader.generator`` now if it has one, else from torch's global generator when the
    first epoch starts (Opacus' behaviour: ``tests/test_opacus_entry.py::
    test_unkeyed_runs_take_their_randomness_from_torch_seeds_as_opacus_does``). ``share=(rank,
    ranks)`` (a torchrun job, ``grad_sample_mode="ghost_fsdp"``): this rank's chunk of each
    batch (:class:`PoissonBatches`); every rank must pass the same ``key``."""
    dataset = loader.dataset
    if key is None and loader.generator is not None:
        key = draw_key(loader.generator)
    return DataLoader(dataset, batch_sampler=PoissonBatches(len(dataset), len(loader), key, share),
                      collate_fn=_empty_aware(loader.collate_fn or default_collate, dataset),
                      num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                      worker_init_fn=loader.worker_init_fn, generator=loader.generator)
