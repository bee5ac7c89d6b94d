"""torch's process-wide random number generator, used by one thread at a time.

Ranks run as threads (``fsdpx.runtime.threads``) share one global generator. A rank that seeds
it and builds its model, and another that forks it around a check forward (``fork_rng`` puts the
state it saw back on exit), must not overlap: the second rank's exit rewound the first rank's
stream mid-build, the ranks built different parameters, and a pipelined run's tied embedding
trained apart between its stages. Every fork or seeding of the global generator in fsdpx goes
through :func:`exclusive`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_LOCK = threading.RLock()


@contextlib.contextmanager
def exclusive(seed: int | None = None) -> Iterator[None]:
    """Inside: torch's global CPU generator held by this thread alone (other users of
    :func:`exclusive` wait), seeded with ``seed`` when one is given; after: the generator as it
    was. Re-entrant within one thread. Do not run collectives inside (another rank may be waiting
    here). Proven by ``tests/test_train_config.py::test_runs_building_their_models_at_once_get_the_same_parameters``
    and ``test_a_model_built_while_another_rank_checks_its_stages_is_the_same``."""
    with _LOCK, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield
