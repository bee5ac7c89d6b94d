"""A private step does not make the host wait for its device (issue 30, item 2).

On a GPU, every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, an op
whose output size depends on the data: ``nonzero``, ``unique``, ``masked_select``) stops the host
until the device has finished everything queued, so the device then idles while the host queues
the rest of the step. On the CPU the same reads go through the same aten ops, so counting them
with a dispatch mode proves the property here; the CUDA test counts the real synchronisations
with CUDA's sync debug mode where a GPU is present.

The one documented exception: the non-finite guard (``privacy.clipping.guarded_clip_factors``)
reads one boolean per step, ``any`` over the batch's norms, to raise
:class:`NonFiniteGradientError` before an update.
"""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdpx import Mesh, strategies
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import adamw
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.threads import run_threads
from privacy import DPConfig, init_state, make_private_step
from privacy.step_metrics import StepMetrics, to_host

# aten ops whose result the host must read from the device (or whose output size it must know)
HOST_READS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
              "unique_dim", "unique_consecutive", "repeat_interleave", "equal", "is_nonzero", "_assert_async"}
GUARD = 1  # the non-finite guard's one read per step


class HostReads(TorchDispatchMode):
    """Counts, per op name, the ops of :data:`HOST_READS` run under it (this thread only)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def tiny():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    ids = torch.randint(0, 64, (4, 8))
    return model, (ids, ids.roll(1, 1))


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_the_one_process_private_step_reads_nothing_but_the_guard(method):
    model, batch = tiny()
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.05, method=method)
    opt = adamw(1e-3)
    state = init_state(dict(model.named_parameters()), opt, key=1, config=config)
    step = make_private_step(model, token_loss, opt, config, num_examples=100)
    state, _ = step(state, batch)  # the first step binds schedules and warms caches
    with HostReads() as reads, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's fallback for CPU flash attention
        state, metrics = step(state, batch)
    assert dict(reads.counts) == {"_local_scalar_dense": GUARD}
    assert metrics.pending  # nothing read until the caller reads it
    assert metrics["batch_size"] == 4 and metrics["loss"] > 0 and 0 <= metrics["clipped_fraction"] <= 1


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_a_sharded_private_step_reads_nothing_but_the_guard(strategy):
    """Two simulated ranks (threads; a dispatch mode is per thread, so each rank counts its own):
    the statistics behind the metrics are gathered as a device tensor (``all_gather_stats``)."""
    model, (ids, targets) = tiny()
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.05, method="ghost")
    opt, layout = adamw(1e-3), strategies.ALL[strategy]()

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), token_loss, opt, layout, comm, param_shapes=shapes,
                                 config=config, num_examples=50)
        state = init_sharded(params, opt, layout, comm, key=7, config=config)
        state, _ = step(state, (ids, targets))
        with HostReads() as reads:
            state, metrics = step(state, (ids, targets))
        pending = metrics.pending
        return dict(reads.counts), pending, dict(metrics)

    results = run_threads(Mesh(dp=2), rank)
    for counts, pending, metrics in results:
        assert counts == {"_local_scalar_dense": GUARD}
        assert pending
        assert metrics["batch_size"] == 4
    assert results[0][2]["loss"] == results[1][2]["loss"]


def test_step_metrics_read_exactly_what_an_eager_conversion_gives():
    losses = torch.tensor([0.1, 0.2, 0.30000001], dtype=torch.float32)
    raw = {"loss": losses.sum(), "n": 3, "rows": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    m = StepMetrics(raw, lambda h: {"loss": h["loss"] / h["n"], "rows": h["rows"]})
    assert m.pending and to_host(raw)["loss"] == float(losses.sum())
    m["comm_bytes"] = {"all_gather": 8}
    assert m["loss"] == float(losses.sum()) / 3 and not m.pending
    assert m["rows"] == [[1.0, 2.0], [3.0, 4.0]]
    assert dict(m) == {"loss": float(losses.sum()) / 3, "rows": [[1.0, 2.0], [3.0, 4.0]],
                       "comm_bytes": {"all_gather": 8}}
    assert {**m}["comm_bytes"] == {"all_gather": 8} and len(m) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_private_step_synchronises_at_most_at_the_guard():
    """CUDA's sync debug mode warns at every synchronising call; a step on the GPU makes at most
    the guard's one."""
    model, (ids, targets) = tiny()
    model = model.cuda()
    batch = (ids.cuda(), targets.cuda())
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.05, method="ghost")
    opt = adamw(1e-3)
    state = init_state(dict(model.named_parameters()), opt, key=1, config=config)
    step = make_private_step(model, token_loss, opt, config, num_examples=100)
    state, _ = step(state, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, metrics = step(state, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= GUARD, syncs
    assert metrics["batch_size"] == 4
