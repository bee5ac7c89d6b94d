"""Peak memory of one sharded train step, predicted by running that step on ``meta`` tensors.

The cost model (``fsdpx.sharding.cost_model``) gives what a plan keeps between steps; what a step
allocates on top -- gathered units, activations, the ghost-clipping tape and its per-example
factors, raw and reduced gradients, noise, the optimizer's temporaries -- depends on the model's
forward and on the private step's own code. So it is read off the step itself: rank 0's
``make_sharded_step`` runs once on ``meta`` parameters and a ``meta`` batch (shapes only, no data;
collectives answered with ``meta`` tensors of rank 0's output shape, as in
``fsdpx.runtime.activation_cost``), under a dispatch mode that adds each new storage's bytes
when an operator creates it and subtracts them when the storage dies. The largest sum is the
step's peak above the state it starts from.

Data-dependent values have no meta answer; the mode answers for them:

* a tensor read as a Python number (``.item()``, ``bool``) is 0, so checks such as "is any norm
  non-finite" take their common branch;
* ``torch.unique`` of ``n`` values returns ``n`` of them: every value distinct, the most memory
  (random token ids in a batch are nearly all distinct);
* CPU tensors made by the step (the noise, drawn with a counter-based generator on the CPU into
  a numpy buffer, which no operator reports) are real, counted from their first use, and moved
  to ``meta`` where they meet a ``meta`` operand.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from fsdpx.optim import Optimizer
from fsdpx.sharding.collectives import Collective
from fsdpx.sharding.cost_model import PlanLike
from fsdpx.sharding.layout import local_shape
from fsdpx.sharding.mesh import Mesh
from privacy.step import DPConfig
from privacy.tape import LossFn

from .sharded_state import init_sharded
from .step import make_sharded_step


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages operators create while the mode is on: ``live`` now,
    ``peak`` the most at once (read after every operator). A storage is counted once (views
    share it) at its current size, and leaves ``live`` when it is freed. Storages made before the mode (parameters, the state) are not counted.
    Answers data-dependent calls on ``meta`` tensors as the module docstring says."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._storages: dict[int, weakref.ref] = {}

    @property
    def live(self) -> int:
        """Bytes of the counted storages still alive, at their current size (the runtime's
        gatherer resizes storages to 0 and back, which no operator reports)."""
        return sum(s.nbytes() for s in (r() for r in list(self._storages.values())) if s is not None)

    def _forget(self, key: int) -> None:
        self._storages.pop(key, None)

    def _count(self, out: Any, inputs: set[int]) -> None:
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._storages or key in inputs:  # a view or an in-place result: nothing new
                continue
            self._storages[key] = weakref.ref(storage, lambda _, key=key: self._forget(key))

    def _count_made_outside(self, tensors) -> None:
        """Counts, from their first use, CPU tensors the step made without an operator (the
        noise: numpy's buffer wrapped by ``torch.from_numpy``); on a meta step every real tensor
        an operator meets was made by the step."""
        for t in tensors:
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self._storages:
                self._storages[key] = weakref.ref(storage, lambda _, key=key: self._forget(key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        on_meta = any(t.is_meta for t in tensors)
        if on_meta and func is torch.ops.aten._local_scalar_dense.default:
            return 0
        if on_meta and func is torch.ops.aten._unique2.default:
            x = args[0]
            return (torch.empty(x.numel(), dtype=x.dtype, device="meta"),
                    torch.empty(x.shape, dtype=torch.long, device="meta"),
                    torch.empty(0, dtype=torch.long, device="meta"))
        if on_meta and any(not t.is_meta and t.dim() > 0 for t in tensors):
            self._count_made_outside(t for t in tensors if not t.is_meta and t.dim() > 0)
            args, kwargs = tree_map(lambda t: t.to("meta") if isinstance(t, Tensor) and t.dim() > 0 else t,
                                    (args, kwargs))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        out = func(*args, **kwargs)
        self._count(out, inputs)
        self.peak = max(self.peak, self.live)
        return out


class _MetaComm:
    """Rank 0 of ``mesh``: every collective answers with a ``meta`` tensor of rank 0's output
    shape; every rank is assumed to agree."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.rank = mesh, 0

    def run(self, c: Collective, local: Tensor) -> Tensor:
        return torch.empty(local_shape(c.shape, c.dst, c.mesh, 0), dtype=local.dtype, device="meta")

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.mesh.size

    def all_gather_stats(self, local: Tensor) -> Tensor:
        return torch.empty((self.mesh.size, *local.shape), dtype=local.dtype, device="meta")

    def counts(self) -> dict[str, int]:
        return {}

    def reset_counts(self) -> None:
        pass


class StepPeak(NamedTuple):
    """Bytes on rank 0: ``state`` (the sharded state the step starts from: parameters at rest
    and optimizer state), ``step`` (the most the step allocates on top at any moment) and
    ``total`` (their sum: the predicted peak)."""

    state: int
    step: int
    total: int


def _storage_bytes(tree: Any) -> int:
    seen: dict[int, int] = {}
    for t in tree_flatten(tree)[0]:
        if isinstance(t, Tensor):
            s = t.untyped_storage()
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


def step_peak(model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, strategy: PlanLike, mesh: Mesh,
              batch_shape: tuple[int, ...], *, config: DPConfig | None = None, num_examples: int | None = None,
              dtype: torch.dtype = torch.float32, make_batch: Callable[[tuple[int, ...]], Any] | None = None) -> StepPeak:
    """Predicted peak bytes on rank 0 of one ``make_sharded_step`` step (private with
    ``config``) on a GLOBAL batch of token ids of ``batch_shape`` (inputs and targets; or the
    ``(inputs, targets)`` that ``make_batch(batch_shape)`` returns, on ``meta``). ``model`` may
    live on ``meta`` (build it under ``torch.device("meta")``): nothing of it is allocated.

    What it counts: every storage the step's operators create (see the module docstring), on
    top of the state it starts from (``init_sharded`` on ``meta``). What it cannot see:
    allocations inside an operator's kernel that are not its outputs, the allocator's rounding
    and caching, and memory outside tensors (code, thread stacks, communication buffers).

    Guarantee: the same step run for real on CPU tensors (ranks as threads) under the same
    counting mode has the same peak: to the byte with DDP, within 1% with ZeRO-3, whose thread
    communicator's buffers differ slightly from the meta answers
    (``tests/test_max_batch_search.py::test_step_peak_counts_a_step_exactly``). Against a real
    process's peak RSS: ``benchmarks/max_batch.py``, docs/performance.md. Raises what ``make_sharded_step`` raises for a bad
    plan or config."""
    comm = _MetaComm(mesh)
    with torch.device("meta"):
        params = {k: torch.empty(v.shape, dtype=dtype) for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    step = make_sharded_step(model, loss_fn, optimizer, strategy, comm, param_shapes=shapes, config=config,
                             num_examples=num_examples, donate=True)
    state = init_sharded(params, optimizer, strategy, comm, key=0, config=config)
    del params
    if make_batch is None:
        tokens = torch.zeros(batch_shape, dtype=torch.long, device="meta")
        batch = (tokens, tokens)
    else:
        batch = make_batch(batch_shape)
    state_bytes = _storage_bytes((state.params, state.opt_state))
    mode = LiveBytes()
    with mode:
        step(state, batch)
    return StepPeak(state_bytes, mode.peak, state_bytes + mode.peak)
