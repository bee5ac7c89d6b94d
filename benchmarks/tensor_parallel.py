"""Tensor parallelism on N gloo processes: fsdpx's TP (plain and private) vs torch's DTensor TP.

    .venv/bin/python benchmarks/tensor_parallel.py [--small] [--nproc 2,4] [--rounds 6] [--out results.json]

Run plainly, this file is the driver: for each process count it launches itself under torchrun
(1 thread per process) once for the timing job, then once per (mode, malloc setting) for the
memory jobs, and prints markdown tables. Progress goes to stderr. Modelled on
``benchmarks/sharded_step.py`` (same counting wrappers, rounds, memory jobs).

Every mode trains the SAME function: one ``fsdpx.models.gpt.GPT`` (~49M fp32 parameters, the
LM head tied to the token embedding, the configuration of ``sharded_step.py``) built from one
seed, on the SAME global batch (every rank of the tensor-parallel group sees all of it), with
AdamW of the same hyper-parameters. Pure tensor parallelism: the mesh is ``Mesh(dp=1, tp=N)``.

* ``fsdpx-tp``          ``resolve(model, gpt_plan(config), strategies.ddp(), Mesh(dp=1, tp=N))``
                        (Megatron's layout: vocab-parallel embedding, q|k|v and fc column-parallel
                        split by heads, proj layers row-parallel, the LM head vocab-parallel with
                        the loss on the shards), ``make_sharded_step(..., donate=True)``,
                        ``fsdpx.optim.adamw``. ``ddp`` over ``dp`` of one rank moves nothing,
                        but the runtime still runs (and counts) its all-reduces on the 1-rank
                        group: they are reported apart as ``@1``.
* ``fsdpx-tp-private``  the same with ``DPConfig(method="ghost", clip 1, noise 1)``
* ``dtensor-tp``        ``parallelize_module`` on the same GPT: ``ColwiseParallel`` for
                        ``blocks.*.attn.qkv`` and ``blocks.*.mlp.fc``, ``RowwiseParallel`` for
                        ``blocks.*.attn.proj`` and ``blocks.*.mlp.proj``, ``wte`` with
                        ``RowwiseParallel(input_layouts=Replicate())`` (torch's vocab-parallel
                        embedding), ``lm_head`` with ``ColwiseParallel(use_local_output=False)``
                        and ``loss_parallel()`` around the loss and its backward;
                        ``torch.optim.AdamW``.

Two things make the DTensor baseline train the same function:

* The fused ``qkv`` Linear (``[3C, C]``): ``ColwiseParallel`` cuts its rows into N contiguous
  chunks, so on 2 ranks rank 0 would get all of q and half of k, and ``chunk(3)`` in the
  attention would mix them (a different function that runs without error: the timing job
  measures that "naive" loss too). The baseline therefore stores ``qkv.weight`` with its rows
  permuted before ``parallelize_module``: chunk ``r`` of the permuted weight is
  ``[q heads of r; k heads of r; v heads of r]``, exactly fsdpx's ``ColumnParallel(fused=3,
  head_dim=...)`` shard. AdamW is elementwise, so training the permuted parameter is training
  the original one.
* Tied embedding: ``parallelize_module`` replaces ``wte.weight`` and ``lm_head.weight`` by two
  new DTensor parameters (both ``Shard(0)``), breaking the tie; the baseline re-ties them
  (``lm_head.weight = wte.weight``), so both layers use and accumulate into one parameter, as
  in fsdpx's plan (one layout: vocabulary rows over ``tp``).

The timing job checks it: the losses of the first step (before any update) of fsdpx-tp,
dtensor-tp and an unsharded forward must agree (table below the timings).

Timing job: all modes live in one set of processes; for each round, for each mode (the order
rotates every round): barrier, time one step on each rank. A step's time is the slowest rank's;
the table gives the median over the measured rounds (after the warm-up rounds).

Bytes: per collective kind per rank, counted where the runtimes call into torch: wrappers
around the ``torch.distributed`` functions fsdpx's ``DistComm`` calls (``all_reduce``,
``all_gather_single`` / ``all_gather_into_tensor``: the output buffer, ``reduce_scatter_single``
/ ``reduce_scatter_tensor``: the input buffer, ``all_to_all``) and around the functional
collectives DTensor calls (``torch.distributed._functional_collectives.all_reduce``,
``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``, ``broadcast`` and the
coalesced ones; ``wait_tensor`` for their waits), same conventions. The first warm-up step of
every mode also runs under a ``TorchDispatchMode`` (the mechanism of torch's
``CommDebugMode``) that sees every ``_c10d_functional`` / ``c10d`` collective op below those
Python functions; its bytes must equal the wrappers' (column "op audit"). For fsdpx the step's
own ``metrics["comm_bytes"]`` is shown to agree, next to the algebra's prediction
(``comm_per_step(plan, ..., activations=activation_collectives(...))``).

Memory job: one mode per torchrun invocation. ``VmRSS`` right after the full model is built is
the baseline; ``VmHWM`` is reset there (``/proc/self/clear_refs`` = 5), the mode is set up and
runs ``--mem-steps`` steps, and the peak above the baseline is reported, with glibc's defaults
and with ``MALLOC_MMAP_THRESHOLD_=65536``. fsdpx's full parameters are released after
``init_sharded`` (the step reads only its state); ``parallelize_module`` replaces DTensor's.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (Counter, MemMarks, clocks, launch_worker, logger, nbytes as _nbytes,  # noqa: E402
                          paired_ratio, per_rank_cell, random_token_batch, reset_hwm, seeded_gpt, status_kb,
                          write_report)

MODES = ["fsdpx-tp", "fsdpx-tp-private", "dtensor-tp"]
LR, WD = 1e-3, 0.01
CLIP, SIGMA = 1.0, 1.0
NUM_EXAMPLES = 8000
MB = 1e6

# sharded_step.py's model: ~49M parameters (48,912,896), width 512, 8 heads, 10 blocks, no
# biases, tied head; the vocabulary (33944) and every split size divide by 2 and 4.
FULL = dict(vocab_size=33944, block_size=128, n_layer=10, n_head=8, n_embd=512, bias=False, tie_weights=True)
SMALL = dict(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False, tie_weights=True)
GLOBAL_BATCH = 8
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]


log = logger("tensor_parallel")


# ----------------------------------------------------------------------------------------------
# worker side: counting
# ----------------------------------------------------------------------------------------------

# bytes, calls and seconds per collective kind and per phase of one step; a kind on a process
# group of one rank (nothing moves) is suffixed ``@1``
COUNT = Counter()


def _suffix(size: int) -> str:
    return "@1" if size == 1 else ""


def install_counting_wrappers() -> None:
    """Wrap the ``torch.distributed`` functions fsdpx calls and the functional collectives
    DTensor calls. Must run before fsdpx is imported: ``DistComm`` binds ``all_gather_single``
    and ``reduce_scatter_single`` at import time. DTensor looks ``funcol.<name>`` up at call
    time, and the deprecated names (``all_gather_tensor``...) call the wrapped ones."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    def arg(i: int, name: str):
        return lambda args, kwargs: args[i] if len(args) > i else kwargs[name]

    def dist_group_size(args, kwargs, pos: int) -> int:
        group = kwargs.get("group", args[pos] if len(args) > pos else None)
        return dist.get_world_size(group)

    table = {  # name: (kind, the buffer counted, position of ``group``)
        "all_gather_into_tensor": ("all_gather", arg(0, "output_tensor"), 2),
        "all_gather_single": ("all_gather", arg(0, "output_tensor"), 2),
        "reduce_scatter_tensor": ("reduce_scatter", arg(1, "input"), 3),
        "reduce_scatter_single": ("reduce_scatter", arg(1, "input"), 3),
        "all_reduce": ("all_reduce", arg(0, "tensor"), 2),
        "broadcast": ("broadcast", arg(0, "tensor"), 2),
        "all_to_all": ("all_to_all", lambda a, k: _ListBytes(a[1] if len(a) > 1 else k["input_tensor_list"]), 2),
        "all_gather_object": ("object", None, 2),
    }
    for fn_name, (kind, pick, gpos) in table.items():
        real = getattr(dist, fn_name, None)
        if real is None:
            continue

        def counted(*args, _real=real, _kind=kind, _pick=pick, _gpos=gpos, **kwargs):
            if not COUNT.active:
                return _real(*args, **kwargs)
            nbytes = _nbytes(_pick(args, kwargs)) if _pick else 0
            label = _kind + _suffix(dist_group_size(args, kwargs, _gpos))
            t0 = clocks()
            out = _real(*args, **kwargs)
            COUNT.add(label, nbytes, t0)
            return out

        setattr(dist, fn_name, functools.wraps(real)(counted))

    def funcol_size(group, tag: str = "") -> int:
        g = funcol._resolve_group(group, tag)
        return g.size() if isinstance(g, dist.ProcessGroup) else c10d._get_group_size_by_name(g)

    def ts(x):
        return x if isinstance(x, (list, tuple)) else [x]

    # name: (kind, bytes(args, kwargs, group size), position of ``group``)
    fc = {
        "all_reduce": ("all_reduce", lambda a, k, n: _nbytes(a[0]), 2),
        "all_reduce_coalesced": ("all_reduce", lambda a, k, n: sum(map(_nbytes, ts(a[0]))), 2),
        "all_gather_single": ("all_gather", lambda a, k, n: n * _nbytes(a[0]), 2),
        "all_gather_single_coalesced": ("all_gather", lambda a, k, n: n * sum(map(_nbytes, ts(a[0]))), 1),
        "reduce_scatter_single": ("reduce_scatter", lambda a, k, n: _nbytes(a[0]), 3),
        "reduce_scatter_single_coalesced": ("reduce_scatter", lambda a, k, n: sum(map(_nbytes, ts(a[0]))), 3),
        "all_to_all_single": ("all_to_all", lambda a, k, n: _nbytes(a[0]), 3),
        "broadcast": ("broadcast", lambda a, k, n: _nbytes(a[0]), 2),
    }
    for fn_name, (kind, size_of, gpos) in fc.items():
        real = getattr(funcol, fn_name, None)
        if real is None:
            continue

        def counted_fc(*args, _real=real, _kind=kind, _size=size_of, _gpos=gpos, **kwargs):
            if not COUNT.active:
                return _real(*args, **kwargs)
            group = args[_gpos] if len(args) > _gpos else kwargs["group"]
            n = funcol_size(group, kwargs.get("tag", ""))
            nbytes = _size(args, kwargs, n)
            t0 = clocks()
            out = _real(*args, **kwargs)
            COUNT.add(_kind + _suffix(n), nbytes, t0)
            return out

        setattr(funcol, fn_name, functools.wraps(real)(counted_fc))

    real_wait = funcol.wait_tensor

    def wait_tensor(tensor):  # an async functional collective's result is waited for: time only
        if not COUNT.active:
            return real_wait(tensor)
        t0 = clocks()
        out = real_wait(tensor)
        COUNT.add_time("wait", t0)
        return out

    funcol.wait_tensor = functools.wraps(real_wait)(wait_tensor)


class _ListBytes:
    """A list of tensors seen as one buffer (``all_to_all``'s inputs)."""

    def __init__(self, ts):
        self.n = sum(_nbytes(t) for t in ts)

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1


def make_audit():
    """A ``TorchDispatchMode`` that records every collective op below the Python functions the
    wrappers see: ``_c10d_functional.*`` (DTensor) and ``c10d.*`` (``torch.distributed``), with
    the wrappers' byte conventions. Returning ``NotImplemented`` for DTensor arguments lets
    DTensor lower its ops first (as ``CommDebugMode`` does)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    def ts(x):
        return list(x) if isinstance(x, (list, tuple)) else [x]

    def pg_size(pg) -> int:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if isinstance(pg, str):  # a group name
            return c10d._get_group_size_by_name(pg)
        if not isinstance(pg, dist.ProcessGroup):  # the dispatcher's boxed (TorchScript) group
            pg = dist.ProcessGroup.unbox(pg)
        return pg.size()

    functional = {  # op name: (kind, bytes(args), group size(args))
        "all_reduce": ("all_reduce", lambda a: _nbytes(a[0]), lambda a: pg_size(a[2])),
        "all_reduce_": ("all_reduce", lambda a: _nbytes(a[0]), lambda a: pg_size(a[2])),
        "all_reduce_coalesced": ("all_reduce", lambda a: sum(map(_nbytes, a[0])), lambda a: pg_size(a[2])),
        "all_gather_into_tensor": ("all_gather", lambda a: a[1] * _nbytes(a[0]), lambda a: a[1]),
        "all_gather_into_tensor_coalesced": ("all_gather", lambda a: a[1] * sum(map(_nbytes, a[0])), lambda a: a[1]),
        "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0]), lambda a: a[2]),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: sum(map(_nbytes, a[0])), lambda a: a[2]),
        "all_to_all_single": ("all_to_all", lambda a: _nbytes(a[0]), lambda a: pg_size(a[3])),
        "broadcast": ("broadcast", lambda a: _nbytes(a[0]), lambda a: pg_size(a[2])),
    }
    c10d_ops = {
        "allreduce_": ("all_reduce", lambda a: sum(map(_nbytes, ts(a[0]))), lambda a: pg_size(a[1])),
        "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0]), lambda a: pg_size(a[2])),
        "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1]), lambda a: pg_size(a[2])),
        "alltoall_": ("all_to_all", lambda a: sum(map(_nbytes, ts(a[1]))), lambda a: pg_size(a[2])),
        "alltoall_base_": ("all_to_all", lambda a: _nbytes(a[1]), lambda a: pg_size(a[2])),
        "broadcast_": ("broadcast", lambda a: sum(map(_nbytes, ts(a[0]))), lambda a: pg_size(a[1])),
        "allgather_": ("object", lambda a: 0, lambda a: 2),  # all_gather_object's size and data rounds
    }

    NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_")

    class CollectiveAudit(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, int] = {}
            self.calls: dict[str, int] = {}
            self.unknown: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            ns, name = func.namespace, func._overloadpacket.__name__
            table = functional if ns in ("_c10d_functional", "c10d_functional") else c10d_ops if ns == "c10d" else None
            if table is not None and name in table:
                kind, size_of, group_of = table[name]
                label = kind if kind == "object" else kind + _suffix(group_of(args))
                self.bytes[label] = self.bytes.get(label, 0) + size_of(args)
                self.calls[label] = self.calls.get(label, 0) + 1
            elif table is not None and name not in NOT_COLLECTIVES:
                self.unknown[f"{ns}.{name}"] = self.unknown.get(f"{ns}.{name}", 0) + 1
            return out

    return CollectiveAudit()


MEM = MemMarks()
timed = functools.partial(COUNT.timed, marks=MEM)  # fn timed as a phase of COUNT, marking MEM


def install_fsdpx_timers() -> None:
    """Phase timers (and memory marks) around fsdpx's gradient reduction + update and its noise
    draws: ``fsdpx.runtime.step``'s module global ``reduce_and_update``, looked up at call time,
    and ``fsdpx.runtime.owned_noise.OwnedNoise.pop``, patched in this process only (fsdpx's files
    are untouched). Once the backward is over the step calls ``reduce_and_update``, which draws
    each parameter's noise (``OwnedNoise.pop``, private only) as it reduces that parameter's
    gradient: the noise phase is inside the reduction's."""
    import fsdpx.runtime.owned_noise as noise_mod
    import fsdpx.runtime.step as step_mod

    noise_mod.OwnedNoise.pop = timed("noise", noise_mod.OwnedNoise.pop)
    step_mod.reduce_and_update = timed("reduce_and_update", step_mod.reduce_and_update, before="forward+backward")


# ----------------------------------------------------------------------------------------------
# worker side: the modes
# ----------------------------------------------------------------------------------------------

def dp_config():
    from privacy.step import DPConfig

    # expected batch q*N = GLOBAL_BATCH, so private and plain steps divide by the same number
    return DPConfig(clip_norm=CLIP, noise_multiplier=SIGMA, sample_rate=GLOBAL_BATCH / NUM_EXAMPLES, method="ghost")


def fsdpx_plan(model, mesh):
    from fsdpx import strategies
    from fsdpx.models.tp_plans import gpt_plan
    from fsdpx.sharding.tensor_parallel import resolve

    return resolve(model, gpt_plan(model.config), strategies.ddp(), mesh)


def build_fsdpx(model, comm, private: bool):
    """A ``run(batch) -> (loss, metrics)`` for fsdpx's tensor parallelism; consumes ``model``
    (its full parameters are released: the step reads only the sharded state)."""
    from fsdpx import init_sharded, make_sharded_step
    from fsdpx.models.gpt import token_loss
    from fsdpx.optim import Optimizer, adamw

    opt = adamw(LR, weight_decay=WD)
    opt = Optimizer(opt.init, timed("update", opt.update, before="reduce", after="update"),
                    timed("update", opt.update_inplace, before="reduce", after="update"))
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    plan = fsdpx_plan(model, comm.mesh)
    config = dp_config() if private else None
    step = make_sharded_step(model, token_loss, opt, plan, comm, param_shapes=shapes, config=config,
                             num_examples=NUM_EXAMPLES if private else None, donate=True)
    holder = [init_sharded(params, opt, plan, comm, key=0, config=config)]
    del params
    for p in model.parameters():
        p.untyped_storage().resize_(0)

    def run(batch):
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"], metrics

    return run


def qkv_permutation(cfg: dict, tp: int):
    """Row order of the fused ``[3C, C]`` qkv weight whose ``tp`` contiguous chunks are
    ``[q_r; k_r; v_r]``: rank ``r``'s heads of q, k and v (heads split as ``torch.chunk``)."""
    import torch

    C, nh = cfg["n_embd"], cfg["n_head"]
    hd, per = C // nh, nh // tp
    rows: list[int] = []
    for r in range(tp):
        for part in range(3):  # q, k, v
            rows += range(part * C + r * per * hd, part * C + (r + 1) * per * hd)
    return torch.tensor(rows)


def dtensor_parallelize(model, world: int, *, permute: bool = True):
    """``parallelize_module`` of our GPT (see the module docstring); returns the model."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = model.config
    if cfg.n_head % world:
        raise ValueError(f"{cfg.n_head} heads do not divide by {world} ranks")
    if permute:
        rows = qkv_permutation(vars(cfg), world)
        with torch.no_grad():
            for block in model.blocks:
                block.attn.qkv.weight.copy_(block.attn.qkv.weight[rows])
                if block.attn.qkv.bias is not None:
                    block.attn.qkv.bias.copy_(block.attn.qkv.bias[rows])
    mesh = init_device_mesh("cpu", (world,))
    plan: dict[str, Any] = {"wte": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": ColwiseParallel(use_local_output=False)}
    for i in range(cfg.n_layer):
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    # src_data_rank=None: every rank built the same full model from the same seed and keeps its
    # own slice (no scatter at set-up)
    parallelize_module(model, mesh, plan, src_data_rank=None)
    if cfg.tie_weights:  # parallelize_module made two parameters of the tied one: re-tie them
        model.lm_head.weight = model.wte.weight
    return model


def dtensor_loss(model, batch):
    from torch.distributed.tensor.parallel import loss_parallel

    from fsdpx.models.gpt import token_loss

    x, y = batch
    with loss_parallel():
        loss = token_loss(model(x), y).mean()
    return loss


def build_dtensor(model, world: int):
    import torch
    from torch.distributed.tensor.parallel import loss_parallel

    from fsdpx.models.gpt import token_loss

    model = dtensor_parallelize(model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    opt.step = timed("update", opt.step, before="forward+backward", after="update")

    def run(batch):
        x, y = batch  # every tensor-parallel rank takes the whole batch
        with loss_parallel():
            loss = token_loss(model(x), y).mean()  # a replicated DTensor: the global mean
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach().to_local()), {}

    return run


def build(mode: str, model, comm, world: int):
    if mode == "fsdpx-tp":
        return build_fsdpx(model, comm, private=False)
    if mode == "fsdpx-tp-private":
        return build_fsdpx(model, comm, private=True)
    if mode == "dtensor-tp":
        return build_dtensor(model, world)
    raise ValueError(f"unknown mode {mode!r}; known: {MODES}")


def timed_step(run, batch, audit: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    dist.barrier()
    COUNT.reset()
    COUNT.active = True
    MEM.mark("between steps")
    mode = make_audit() if audit else None
    t0, c0 = time.perf_counter(), time.process_time()
    if mode is not None:
        with mode:
            loss, metrics = run(batch)
    else:
        loss, metrics = run(batch)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    MEM.mark("end of step")
    COUNT.active = False
    rec = {"seconds": seconds, "cpu_seconds": cpu, "loss": loss, **COUNT.record(),
           "fsdpx_comm": metrics.get("comm_bytes"), "resident_bytes": metrics.get("resident_bytes")}
    if mode is not None:
        rec["audit"] = {"bytes": mode.bytes, "calls": mode.calls, "unknown": mode.unknown}
    return rec


def predictions(cfg: dict, mesh) -> dict[str, Any]:
    """The algebra's bytes per rank per step (parameter collectives from layouts, activation
    collectives traced on meta tensors) and resident state per rank."""
    import torch

    from fsdpx import comm_per_step, cost, memory_by_rank
    from fsdpx.models.gpt import token_loss
    from fsdpx.runtime.activation_cost import activation_collectives
    from fsdpx.runtime.units import make_units

    with torch.device("meta"):
        model = seeded_gpt(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    units = [list(u.params) for u in make_units(model, shapes)]
    plan = fsdpx_plan(model, mesh)
    shape = (GLOBAL_BATCH, cfg["block_size"])
    params_only = comm_per_step(plan, shapes, mesh, units)
    out: dict[str, Any] = {"params": sum(torch.Size(s).numel() for s in shapes.values()),
                           "memory_by_rank": memory_by_rank(plan, shapes, mesh, "adamw"),
                           "param_collectives": params_only}
    for private in (False, True):
        acts = activation_collectives(model, plan, mesh, token_loss, shape, shape, private=private)
        out["private" if private else "plain"] = {
            "comm": comm_per_step(plan, shapes, mesh, units, activations=acts),
            "activations": cost(acts), "activation_calls": _calls_by_kind(acts)}
    return out


def _calls_by_kind(collectives) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + 1
    return out


def reference_loss(base, batch) -> float:
    """The unsharded model's loss on the batch (no update): what step 1 of every plain mode
    must report."""
    import torch

    from fsdpx.models.gpt import token_loss

    with torch.no_grad():
        return float(token_loss(base(batch[0]), batch[1]).mean())


def naive_dtensor_loss(base, batch, world: int) -> float:
    """Step 1's loss of the DTensor plan with a plain ``ColwiseParallel`` on the fused qkv
    (no permutation): a different function, shown for the record."""
    import torch

    model = dtensor_parallelize(copy.deepcopy(base), world, permute=False)
    with torch.no_grad():
        loss = dtensor_loss(model, batch)
    return float(loss.to_local())


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    # first, before fsdpx is imported: DistComm binds its collectives at import time
    install_counting_wrappers()

    # every runtime's modules are imported before any memory baseline is taken
    import torch.distributed.tensor.parallel  # noqa: F401

    import fsdpx.runtime  # noqa: F401
    import fsdpx.runtime.activation_cost  # noqa: F401
    import privacy.step  # noqa: F401
    from fsdpx import Mesh
    from fsdpx.runtime.dist_comm import init_from_env

    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated. Please use")
    warnings.filterwarnings("ignore", message=".*alltoall.*")
    world = int(os.environ["WORLD_SIZE"])
    comm = init_from_env(Mesh(dp=1, tp=world), timeout_s=1800.0)
    rank = comm.rank
    install_fsdpx_timers()
    cfg = SMALL if args.small else FULL
    say = log if rank == 0 else (lambda msg: None)
    result: dict[str, Any] = {"rank": rank, "world": world, "threads": torch.get_num_threads(),
                              "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}

    if args.worker == "time":
        modes = args.modes.split(",")
        base = seeded_gpt(cfg)
        batch = random_token_batch(cfg, GLOBAL_BATCH)
        result["reference_loss"] = reference_loss(base, batch)
        if "dtensor-tp" in modes:
            result["naive_dtensor_loss"] = naive_dtensor_loss(base, batch, world)
        runs = {}
        for mode in modes:
            t0 = time.perf_counter()
            runs[mode] = build(mode, copy.deepcopy(base), comm, world)
            say(f"built {mode} in {time.perf_counter() - t0:.1f}s")
        steps: dict[str, list] = {m: [] for m in modes}
        for i in range(args.warmup + args.rounds):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                rec = timed_step(runs[mode], batch, audit=i == 0)
                rec["warmup"] = i < args.warmup
                steps[mode].append(rec)
                say(f"{world} procs, round {i + 1}/{args.warmup + args.rounds} {mode}: {rec['seconds']:.2f}s"
                    f"{' (warm-up)' if rec['warmup'] else ''}{' (op audit)' if i == 0 else ''}"
                    f"  load {os.getloadavg()[0]:.1f}")
        result["steps"] = steps
    else:
        mode = args.mode
        rss_start = status_kb("VmRSS")
        model = seeded_gpt(cfg)
        batch = random_token_batch(cfg, GLOBAL_BATCH)
        rss_model = status_kb("VmRSS")
        hwm_model = status_kb("VmHWM")
        reset = reset_hwm()
        MEM.active = reset
        run = build(mode, model, comm, world)
        del model
        MEM.mark("set-up")
        recs = []
        for _ in range(args.mem_steps):
            MEM.peaks = {k: v for k, v in MEM.peaks.items() if k == "set-up"}  # keep the last step's phases
            recs.append(timed_step(run, batch))
        MEM.active = False
        result.update(mode=mode, hwm_reset=reset, rss_start_kb=rss_start, rss_model_kb=rss_model,
                      hwm_model_kb=hwm_model, phase_peaks_kb=dict(MEM.peaks),
                      hwm_kb=MEM.overall if reset else status_kb("VmHWM"), rss_end_kb=status_kb("VmRSS"),
                      resident_bytes=recs[-1]["resident_bytes"], step_seconds=[r["seconds"] for r in recs])

    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        out = {"config": cfg, "global_batch": GLOBAL_BATCH, "ranks": everyone, "load": os.getloadavg()}
        if args.worker == "time":
            out["prediction"] = predictions(cfg, comm.mesh)
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------

def launch(worker_args: list[str], env_extra: dict[str, str], nproc: int) -> dict:
    return launch_worker(os.path.abspath(__file__), worker_args, env_extra, nproc, log)


def summarize_time(job: dict) -> dict[str, Any]:
    """Per mode: median step (slowest rank), bytes/calls per kind per rank (checked equal across
    measured steps), fsdpx's own count, the op audit of step 1, median phases, losses."""
    ranks = job["ranks"]
    out = {}
    for mode in ranks[0]["steps"]:
        per_rank = [[s for s in r["steps"][mode] if not s["warmup"]] for r in ranks]
        n = len(per_rank[0])
        slow = [max(pr[i]["seconds"] for pr in per_rank) for i in range(n)]
        cpu = [max(pr[i]["cpu_seconds"] for pr in per_rank) for i in range(n)]
        slowest = [max((pr[i] for pr in per_rank), key=lambda r: r["seconds"]) for i in range(n)]
        parts = [breakdown(r) for r in slowest]
        phase_med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        bytes_stable = all(s["bytes"] == pr[0]["bytes"] and s["calls"] == pr[0]["calls"] for pr in per_rank for s in pr)
        first = [r["steps"][mode][0] for r in ranks]
        out[mode] = {
            "median_s": statistics.median(slow), "steps_s": slow,
            "median_cpu_s": statistics.median(cpu), "steps_cpu_s": cpu,
            "bytes_per_rank": [pr[-1]["bytes"] for pr in per_rank],
            "calls_per_rank": [pr[-1]["calls"] for pr in per_rank],
            "bytes_stable_across_steps": bytes_stable,
            "fsdpx_comm_per_rank": [pr[-1]["fsdpx_comm"] for pr in per_rank],
            "audit_per_rank": [f.get("audit") for f in first],
            "audit_step_bytes_per_rank": [f["bytes"] for f in first],
            "phases_median_s": phase_med,
            "losses": [s["loss"] for s in ranks[0]["steps"][mode]],  # every rank reports the global mean
            "losses_agree_across_ranks": all(abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"])
                                             for r in ranks for a, b in zip(r["steps"][mode], ranks[0]["steps"][mode])),
        }
    return out


PHASES = ["comm", "comm@1", "noise", "update", "compute"]


def breakdown(rec: dict) -> dict[str, float]:
    """One rank's step split: time inside the counted collectives (and DTensor's waits for
    them), noise, the gradient reduction + optimizer (fsdpx: ``reduce_and_update`` minus its
    collectives; DTensor: ``optimizer.step``), the rest (forward, backward, clipping)."""
    cs, ph = rec["coll_seconds"], rec["phases"]
    one = sum(v for k, v in cs.items() if k.endswith("@1"))
    out = {"comm": sum(v for k, v in cs.items() if k != "object" and not k.endswith("@1")), "comm@1": one,
           "noise": ph.get("noise", 0.0)}
    if "reduce_and_update" in ph:  # fsdpx: its 1-rank all-reduces and the noise draws happen inside
        out["update"] = max(ph["reduce_and_update"] - one - out["noise"], 0.0)
    else:
        out["update"] = ph.get("update", 0.0)
    out["compute"] = rec["seconds"] - sum(out.values())
    return out


def fmt_mb(b) -> str:
    if not b:
        return "-"
    return f"{b / MB:.2f}" if b >= 0.1 * MB else f"{b / MB:.2g}"


def _kinds_of(d: dict) -> dict[str, int]:
    return {k: v for k, v in d.items() if k.split("@")[0] in KINDS}


def _merged(d: dict) -> dict[str, int]:
    """Kinds with the 1-rank-group ones folded in (fsdpx's own count does not split them)."""
    out: dict[str, int] = {}
    for k, v in _kinds_of(d).items():
        out[k.split("@")[0]] = out.get(k.split("@")[0], 0) + v
    return out


def tables_for(nproc: int, res: dict) -> str:
    lines: list[str] = []
    pred = res.get("prediction")
    t = res.get("time")
    cfg = res.get("config")
    if cfg:
        params = pred["params"] if pred else None
        lines += [f"### {nproc} processes (Mesh(dp=1, tp={nproc})), GPT {params / 1e6:.1f}M params "
                  f"(width {cfg['n_embd']}, {cfg['n_head']} heads, {cfg['n_layer']} blocks, vocab "
                  f"{cfg['vocab_size']}, tied head), global batch {res['global_batch']} x {cfg['block_size']} "
                  "tokens, fp32, 1 thread per process", ""]
    if t:
        lines += ["Step time: wall clock and process CPU time of the slowest rank, median over the measured "
                  "rounds; ratios are medians of same-round ratios. Phases (slowest rank of each round, median "
                  "per column): time inside the collectives over tp (DTensor: with its waits); inside fsdpx's "
                  "all-reduces on the 1-rank dp group (`@1`); fsdpx's noise draw; update: everything after the "
                  "backward (fsdpx: `reduce_and_update` less its `@1` calls; DTensor: `optimizer.step`); "
                  "the rest (forward, backward, clipping):", "",
                  "| mode | wall s | vs dtensor-tp | vs fsdpx-tp | CPU s | collectives over tp s "
                  "| all-reduces @1 s | noise s | update s | compute + rest s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for mode, m in t.items():
            ph = m["phases_median_s"]
            lines.append(f"| {mode} | {m['median_s']:.2f} | {paired_ratio(t, mode, 'dtensor-tp', 'steps_s')} "
                         f"| {paired_ratio(t, mode, 'fsdpx-tp', 'steps_s')} | {m['median_cpu_s']:.2f} | "
                         + " | ".join(f"{ph[k]:.2f}" for k in PHASES) + " |")
        lines += ["", "Bytes per collective kind per rank per step (MB = 1e6 B; one number when every rank "
                  "agrees, else rank by rank), counted at the torch.distributed / functional-collective call; "
                  "`@1`: on fsdpx's data-parallel group of ONE rank (ddp over dp=1: nothing moves; the runtime "
                  "counts it in metrics[\"comm\"], as the algebra does, but makes no torch.distributed call, "
                  "so the agreement adds the algebra's @1 bytes to the counted ones):", "",
                  "| mode | all-reduce over tp | all-gather over tp | reduce-scatter over tp | all-reduce @1 "
                  "| calls AR/AG/RS/AR@1 | fsdpx's own metrics[\"comm\"] agrees | op audit (step 1) agrees |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, m in t.items():
            b, c, own = m["bytes_per_rank"], m["calls_per_rank"][0], m["fsdpx_comm_per_rank"]
            agree = "-"
            if own[0] is not None:
                # DistComm counts its all-reduces on the 1-rank dp group as the algebra does, but
                # makes no torch.distributed call for them (nothing moves): add them back
                at1 = (pred or {}).get("param_collectives", {}).get("all_reduce", 0)
                seen = [{**_merged(bb), "all_reduce": _merged(bb).get("all_reduce", 0) + at1} for bb in b]
                agree = "yes" if all(sb == {k: v for k, v in _merged(o).items() if v or k in sb}
                                     for o, sb in zip(own, seen)) else "NO"
            aud = m["audit_per_rank"]
            audit = "-"
            if aud[0] is not None:
                audit = "yes" if all(_kinds_of(a["bytes"]) == _kinds_of(s) and not a["unknown"]
                                     for a, s in zip(aud, m["audit_step_bytes_per_rank"])) else "NO"
            other = {k for bb in b for k in _kinds_of(bb)} - {"all_reduce", "all_gather", "reduce_scatter",
                                                               "all_reduce@1"}
            note = f" (also {sorted(other)})" if other else ""
            lines.append(f"| {mode}{note} | {per_rank_cell([x.get('all_reduce') for x in b], fmt_mb)} "
                         f"| {per_rank_cell([x.get('all_gather') for x in b], fmt_mb)} "
                         f"| {per_rank_cell([x.get('reduce_scatter') for x in b], fmt_mb)} "
                         f"| {per_rank_cell([x.get('all_reduce@1') for x in b], fmt_mb)} "
                         f"| {c.get('all_reduce', 0)}/{c.get('all_gather', 0)}/{c.get('reduce_scatter', 0)}"
                         f"/{c.get('all_reduce@1', 0)} | {agree} | {audit} |")
        if pred:
            pc = pred["param_collectives"]
            for name in ("plain", "private"):
                a, calls = pred[name]["activations"], pred[name]["activation_calls"]
                lines.append(f"| algebra ({name}): `comm_per_step(plan, activations=activation_collectives(...))` "
                             f"| {fmt_mb(a.get('all_reduce'))} | {fmt_mb(a.get('all_gather'))} "
                             f"| {fmt_mb(a.get('reduce_scatter'))} | {fmt_mb(pc.get('all_reduce'))} "
                             f"| {calls.get('all_reduce', 0)}/{calls.get('all_gather', 0)}"
                             f"/{calls.get('reduce_scatter', 0)}/- | | |")
        if "fsdpx-tp" in t and pred:
            counted = t["fsdpx-tp"]["bytes_per_rank"][0]
            one_rank = _merged(pred["param_collectives"])  # on the 1-rank dp group: counted by the algebra, never sent
            sent = {k: v - one_rank.get(k, 0) for k, v in _merged(pred["plain"]["comm"]).items()}
            ok = _merged(counted) == {k: v for k, v in sent.items() if v}
            lines += ["", f"fsdpx-tp rank 0's counted bytes {'equal' if ok else 'DIFFER FROM'} the algebra's "
                          f"total less its 1-rank-group collectives "
                          f"({', '.join(f'{k} {v / MB:.2f} MB' for k, v in sorted(sent.items()))})."]
        lines += ["", "Correctness: loss of step 1 (before any update), global mean over the batch; an unsharded "
                  "forward of the same model on the same batch is the reference:", "",
                  "| | loss at step 1 | minus the unsharded reference |", "|---|---|---|"]
        ref = res["reference_loss"]
        lines.append(f"| unsharded reference | {ref:.7f} | |")
        for mode, m in t.items():
            lines.append(f"| {mode} | {m['losses'][0]:.7f} | {m['losses'][0] - ref:+.2e} |")
        if res.get("naive_dtensor_loss") is not None:
            nl = res["naive_dtensor_loss"]
            lines.append(f"| DTensor with a plain ColwiseParallel on the fused qkv (not benchmarked) | {nl:.7f} "
                         f"| {nl - ref:+.2e} |")
        if "fsdpx-tp" in t and "dtensor-tp" in t:
            a, b = t["fsdpx-tp"]["losses"], t["dtensor-tp"]["losses"]
            rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
            lines += ["", f"fsdpx-tp vs dtensor-tp: step 1 losses differ by {abs(a[0] - b[0]):.1e} (relative "
                          f"{rel[0]:.1e}); over all {len(rel)} steps (same updates: AdamW, same hyper-parameters) "
                          f"at most relative {max(rel):.1e}."]
        lines.append("")
    mem = res.get("memory")
    if mem:
        def mb(kb: int) -> str:
            return f"{kb * 1024 / MB:.0f}"

        def state(b: int) -> str:
            return f"{b / MB:.0f}" if b >= 10 * MB else f"{b / MB:.2f}"

        def above(job) -> str:
            return " / ".join(mb(r["hwm_kb"] - r["rss_model_kb"]) for r in job["ranks"]) if job else "-"

        lines += ["Peak resident memory per rank over set-up + steps, above VmRSS right after the full model "
                  "was built (MB; rank by rank), next to the resident state the algebra predicts "
                  "(`memory_by_rank`: params + reduced grads + 2 AdamW moments, the same for every mode):", "",
                  "| mode | predicted state | fsdpx resident_bytes | peak above model, glibc default "
                  "| peak above model, MALLOC_MMAP_THRESHOLD_=65536 | VmRSS after model |",
                  "|---|---|---|---|---|---|"]
        mem = {mode: by_env for mode, by_env in mem.items() if by_env}  # failed jobs left out
        p = pred["memory_by_rank"] if pred else None
        for mode, by_env in mem.items():
            d, th = by_env.get("default"), by_env.get("threshold")
            rb = [r["resident_bytes"] for r in (d or th)["ranks"]]
            base = " / ".join(mb(r["rss_model_kb"]) for r in (d or th)["ranks"])
            lines.append(f"| {mode} | {per_rank_cell(p, state) if p else '-'} | "
                         f"{per_rank_cell(rb, state) if rb[0] is not None else '-'} "
                         f"| {above(d)} | {above(th)} | {base} |")
        phases = ["set-up", "forward+backward", "noise", "reduce", "update", "end of step"]
        lines += ["", "Where the peak is (MALLOC_MMAP_THRESHOLD_=65536 where run, rank 0, last step; MB above "
                  "VmRSS after the model; fsdpx: its 1-rank gradient all-reduces with each parameter's "
                  "noise draw, then AdamW):", "",
                  "| mode | " + " | ".join(phases) + " |", "|---" * (len(phases) + 1) + "|"]
        for mode, by_env in mem.items():
            job = by_env.get("threshold") or by_env.get("default")
            r = job["ranks"][0]
            pk = r.get("phase_peaks_kb", {})
            lines.append(f"| {mode} | " + " | ".join(mb(pk[ph] - r["rss_model_kb"]) if ph in pk else "-"
                                                   for ph in phases) + " |")
        lines.append("")
    return "\n".join(lines)


def driver(args) -> None:
    modes = args.modes.split(",")
    size = ["--small"] if args.small else []
    nprocs = [int(n) for n in str(args.nproc).split(",")]
    res: dict[str, Any] = {"argv": sys.argv, "load_start": os.getloadavg(), "cpus": os.cpu_count(), "runs": {}}
    t_start = time.perf_counter()
    for nproc in nprocs:
        run: dict[str, Any] = {}
        res["runs"][str(nproc)] = run
        if not args.skip_time:
            log(f"timing job on {nproc} processes: {modes}, {args.warmup} warm-up + {args.rounds} measured rounds")
            job = launch(["--worker", "time", "--modes", ",".join(modes), "--rounds", str(args.rounds),
                          "--warmup", str(args.warmup), *size], {}, nproc)
            run["config"], run["prediction"], run["global_batch"] = job["config"], job["prediction"], job["global_batch"]
            run["reference_loss"] = job["ranks"][0]["reference_loss"]
            run["naive_dtensor_loss"] = job["ranks"][0].get("naive_dtensor_loss")
            run["time"] = summarize_time(job)
            run["time_raw_ranks"] = job["ranks"]
            run["load_after_time"] = job["load"]
        if not args.skip_memory:
            run["memory"] = {}
            envs = {"default": {}, "threshold": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
            for mode in args.mem_modes.split(","):
                run["memory"][mode] = {}
                for label in args.mem_malloc.split(","):
                    log(f"memory job on {nproc} processes: {mode}, malloc {label}")
                    try:
                        job = launch(["--worker", "mem", "--mode", mode, "--mem-steps", str(args.mem_steps), *size],
                                     envs[label], nproc)
                    except (subprocess.CalledProcessError, OSError, ValueError) as e:
                        log(f"memory job {mode} ({label}) failed: {e}; its row is left out")
                        continue
                    run["memory"][mode][label] = job
    res["load_end"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - t_start
    text = "\n".join(tables_for(int(n), run) for n, run in res["runs"].items())
    print(text)
    log(f"done in {res['wall_s']:.0f}s; load average start {res['load_start'][0]:.1f}, end {res['load_end'][0]:.1f}")
    write_report(args.out, res, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny GPT, for checking the script")
    ap.add_argument("--nproc", default="2,4", help="process counts (= tp degrees), comma-separated")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds (the first also runs the op audit)")
    ap.add_argument("--mem-steps", type=int, default=2, help="steps per memory job (AdamW state is lazy in torch)")
    ap.add_argument("--mem-modes", default=",".join(MODES), help="modes measured for memory, one job each")
    ap.add_argument("--mem-malloc", default="default,threshold",
                    help="malloc settings of the memory jobs: default (glibc's), threshold (MALLOC_MMAP_THRESHOLD_)")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default=None, help="write every number to this JSON file")
    ap.add_argument("--worker", choices=["time", "mem"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
