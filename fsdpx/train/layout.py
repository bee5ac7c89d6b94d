"""The parallel layout of a run: one value for ``fsdpx train``'s ``[parallelism]`` section, the
jobs planner's techniques and their workers.

    layout = Layout(strategy="zero3", tp=2, pp=2, microbatches=4)
    layout.mesh(8)      # Mesh(pp=2, dp=2, tp=2): the processes' grid, derived here only

A :class:`Layout` holds degrees, not processes: the same layout runs on any world size its
``tp x pp`` divides. Resolving it on a model (the per-parameter sharding plan) is
:func:`fsdpx.train.parallel.resolve_parallel`, once per run.

This module loads no torch: ``fsdpx train --help`` reads its names (:data:`STRATEGIES`,
:data:`SCHEDULES`) and builds its default before anything heavy is imported; the sharding
algebra (whose package loads torch) is imported where a mesh or a strategy is made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from .errors import ConfigError

if TYPE_CHECKING:
    from fsdpx.sharding.mesh import Mesh

STRATEGIES = ("ddp", "hsdp", "zero1", "zero2", "zero3")
"""The names of :data:`fsdpx.sharding.strategies.ALL`, sorted, as plain data (equal to them:
``tests/test_fast_feedback.py::test_the_light_names_are_the_algebras``)."""

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
""":data:`fsdpx.sharding.schedule.KINDS`, as plain data (equal to them: the same test)."""


@dataclass(frozen=True)
class Layout:
    """``tp`` x ``pp`` x ``dp = world / (tp pp)`` ranks with ``strategy`` (one of
    :data:`STRATEGIES`; ``None``: one process, no sharding) over the
    data-parallel ranks. ``tp``: Megatron tensor parallelism with the model's plan
    (:func:`fsdpx.train.parallel.tp_plan`), ``sequence_parallel`` splitting the activations
    between its regions along the sequence; ``pp``: the model's blocks cut into ``pp *
    virtual_stages`` stages run by ``schedule`` on ``microbatches`` per data-parallel rank.
    Inconsistent degrees raise :class:`ConfigError`; what depends on the model (heads, blocks,
    the schedule on the stages) is checked where the layout is resolved on it
    (:func:`fsdpx.train.parallel.resolve_parallel`)."""

    strategy: str | None = None
    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of {list(STRATEGIES)}")
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.tp > 1 and self.strategy is None:
            raise ConfigError("tp needs a strategy: tensor parallelism runs on several processes")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1: it splits the sequence over the tensor-parallel ranks")
        if self.pp < 1 or self.microbatches < 1 or self.virtual_stages < 1:
            raise ConfigError("pp, microbatches and virtual_stages must all be >= 1")
        if self.pp > 1 and self.strategy is None:
            raise ConfigError("pp needs a strategy: pipeline stages run on several processes")

    @property
    def sharded(self) -> bool:
        """Whether the run is spread over processes (a strategy is set)."""
        return self.strategy is not None

    def mesh(self, world: int) -> Mesh:
        """The mesh of this layout over ``world`` processes: ``dp = world / (tp pp)``; for hsdp,
        shards of 2 (or of all data ranks when their count is odd) replicated over the rest;
        with ``tp > 1`` an axis ``tp`` (tensor-parallel ranks adjacent, as Megatron places them),
        with ``pp > 1`` a first axis ``pp`` (stages farthest apart: their traffic is the
        lightest). Raises :class:`ConfigError` when ``tp * pp`` does not divide ``world``.
        Proven by ``tests/test_train_layout.py``."""
        from fsdpx.sharding.mesh import Mesh

        tp, pp = self.tp, self.pp
        if world % (tp * pp):
            raise ConfigError(f"tp={tp} x pp={pp} does not divide the {world} processes")
        data = world // (tp * pp)
        if self.strategy == "hsdp":
            shard = 2 if data % 2 == 0 else data
            axes = {"replica": data // shard, "shard": shard}
        else:
            axes = {"dp": data}
        # Mesh keeps keyword order: pp first (the slowest-varying axis), tp last (adjacent ranks)
        return Mesh(**({"pp": pp} if pp > 1 else {}), **axes, **({"tp": tp} if tp > 1 else {}))

    def strategy_axes(self) -> dict[str, str]:
        """Keyword arguments naming :meth:`mesh`'s data-parallel axes for the strategy."""
        return {"replica_axis": "replica", "shard_axis": "shard"} if self.strategy == "hsdp" else {"axis": "dp"}

    def data_parallel(self) -> Any:
        """The strategy's :class:`fsdpx.sharding.strategies` value over :meth:`mesh`'s axes."""
        from fsdpx.sharding import strategies

        return strategies.ALL[self.strategy](**self.strategy_axes())

    def params(self) -> dict[str, Any]:
        """The layout as JSON values, by field (a technique's params, ``[parallelism]`` keys)."""
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> "Layout":
        """The layout named by ``params``' layout fields (others ignored), the rest defaults."""
        return cls(**{f.name: params[f.name] for f in dataclasses.fields(cls) if f.name in params})
