"""A private step does not make the host wait for its device (issue 30, item 2).

On a GPU, every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, an op
whose output size depends on the data: ``nonzero``, ``unique``, ``masked_select``) stops the host
until the device has finished everything queued, so the device then idles while the host queues
the rest of the step. On the CPU the same reads go through the same aten ops, so counting them
with a dispatch mode proves the property here; the CUDA test counts the real synchronisations
with CUDA's sync debug mode where a GPU is present.

The documented exceptions: the non-finite guard (``privacy.clipping.guarded_clip_factors``)
reads one boolean per step, ``any`` over the batch's norms, to raise
:class:`NonFiniteGradientError` before an update; and noise drawn on a device
(:mod:`privacy.ziggurat_ops`: fixed rounds, no read) is checked with one boolean for all the
parameters (:func:`privacy.noise.add_gaussian_noise_`; a sharded step's blocks:
``fsdpx.runtime.owned_noise.OwnedNoise.settle``), whose rare ``True`` (about once in 1e11
steps of GPT-2 small) has the unsettled elements drawn again, checked. Here the device path runs
on CPU tensors by routing them to it (``noise._on_device``).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from fsdpx import Mesh, strategies
from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.optim import adamw
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.threads import run_threads
from privacy import DPConfig, init_state, make_private_step
from privacy.step_metrics import StepMetrics, to_host
from support.host_reads import HostReads
from support.threads import one_thread  # noqa: F401 - a fixture

GUARD = 1  # the non-finite guard's one read per step
DEVICE_NOISE_CHECK = 1  # one read per step when parameters live on a device: is any noise element open?


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


def _pipelined(tie: bool, schedule: str):
    """A tiny private GPT on two simulated pipeline ranks (threads), two microbatches; tied
    embeddings make a parameter two stages share (its norms completed after the schedule)."""
    from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline
    from fsdpx.sharding.tensor_parallel import resolve

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=8, tie_weights=tie))
    mesh = Mesh(dp=1, pp=2)
    plan = resolve_pipeline(model, resolve(model, None, strategies.ALL["ddp"](), mesh),
                            PipelineParallel(schedule=schedule, microbatches=2), mesh)
    return model, mesh, plan


@pytest.mark.parametrize("tie, schedule", [(False, "1f1b"), (True, "gpipe")], ids=["in-schedule", "shared"])
def test_a_pipelined_private_step_reads_nothing_but_the_guard(tie, schedule):
    """Each rank of a private pipelined step (its microbatches' losses, counts and norms kept on
    the device, clipped without reading, ``privacy.clipping.deferred_clip_factors``) reads one
    boolean: the guard over all its examples, after the schedule. Its metrics stay pending and
    agree across the ranks."""
    model, mesh, plan = _pipelined(tie, schedule)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    config = DPConfig(clip_norm=0.5, noise_multiplier=1.0, sample_rate=0.05, method="ghost")
    opt = adamw(1e-3)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 11, (4, 4), generator=g), torch.randint(0, 11, (4, 4), generator=g))

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), token_loss, opt, plan, comm, param_shapes=shapes,
                                 config=config, num_examples=50)
        state = init_sharded(params, opt, plan, comm, key=7, config=config)
        state, _ = step(state, batch)
        with HostReads() as reads:
            state, metrics = step(state, batch)
        pending = metrics.pending
        return dict(reads.counts), pending, dict(metrics)

    results = run_threads(mesh, rank, timeout=60)
    # the tied weight's norm is completed on the last stage: per microbatch it receives the first
    # stage's contributions with a header of their shapes, a host tensor (made on the CPU by
    # ``parts_p2p.send_parts``, never on a device) whose length it reads
    headers = [0, 2] if tie else [0, 0]
    for (counts, pending, metrics), header_reads in zip(results, headers):
        assert counts == {"_local_scalar_dense": GUARD + header_reads}
        assert pending
        assert metrics["batch_size"] == 4 and 0 <= metrics["clipped_fraction"] <= 1
    keys = ("loss", "batch_size", "clipped_fraction", "mean_norm")
    assert [results[0][2][k] for k in keys] == [results[1][2][k] for k in keys]


def test_the_device_sampler_reads_nothing_from_the_device():
    """``draw_normals`` (the torch-ops sampler, on CPU tensors here) runs no op that reads a
    device value, across a block edge at odd offsets, and gives the host's bits there;
    ``block_normals`` adds exactly its one check."""
    from privacy.noise import BLOCK
    from privacy.ziggurat import fill_normals
    from privacy.ziggurat_ops import block_normals, draw_normals

    seeds = [(5, 4, 3, 2, 1), (5, 4, 3, 2, 2)]
    table = torch.tensor(seeds, dtype=torch.int64)
    with HostReads() as reads:
        drawn = draw_normals(table, 0, 3, BLOCK + 1001, BLOCK)
    assert dict(reads.counts) == {}
    host = np.empty(2 * BLOCK)
    for b, seed in enumerate(seeds):
        fill_normals(seed, 0, host[b * BLOCK:(b + 1) * BLOCK])
    assert np.array_equal(drawn.numpy(), host[3:BLOCK + 1001])
    with HostReads() as reads:
        checked = block_normals(table, 0, 3, BLOCK + 1001, BLOCK)
    assert dict(reads.counts) == {"_local_scalar_dense": 1} and torch.equal(checked, drawn)


def _as_device(monkeypatch):
    """CPU tensors take the device path of ``privacy.noise`` (torch ops, checked once)."""
    from privacy import noise

    monkeypatch.setattr(noise, "_on_device", lambda device: device is not None)


def _mixed():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 70_000, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "d": torch.randn(5, 7, generator=g, dtype=torch.float64), "t": torch.randn(9, 8, generator=g).t()}


def test_device_noise_for_many_tensors_is_checked_with_one_read(monkeypatch):
    """``add_gaussian_noise_`` and ``gaussian_noise`` on tensors of several dtypes and layouts
    that take the device path read one boolean from the device for all of them, and give the
    host path's bits."""
    from privacy.noise import add_gaussian_noise_, gaussian_noise

    host_added = add_gaussian_noise_(_mixed(), key=3, step=4, std=0.7)
    host_drawn = gaussian_noise(_mixed(), key=3, step=4, std=0.7)
    _as_device(monkeypatch)
    for draw, host in [(add_gaussian_noise_, host_added), (gaussian_noise, host_drawn)]:
        with HostReads() as reads:
            got = draw(_mixed(), key=3, step=4, std=0.7)
        assert dict(reads.counts) == {"_local_scalar_dense": 1}, draw
        assert all(torch.equal(got[k], host[k]) for k in host), draw


def test_the_device_noise_check_adds_the_exact_draw_where_the_rounds_left_elements_open(monkeypatch):
    """With the sampler's fixed rounds cut to one call, elements are left open (NaN) in every
    tensor; ``add_gaussian_noise_`` then adds the host sampler's draw there (one more read per
    flagged tensor, in this rare path) and keeps every bit of the host path, signed zeros too."""
    import privacy.ziggurat_ops as ops
    from privacy.noise import add_gaussian_noise_

    tensors = {**_mixed(), "z": torch.tensor([-0.0, 0.0] * 40_000)}
    host = add_gaussian_noise_({k: v.clone() for k, v in tensors.items()}, key=5, step=6, std=1.3)
    _as_device(monkeypatch)
    monkeypatch.setattr(ops, "ROUNDS_A", 1)
    monkeypatch.setattr(ops, "ROUNDS_B", 0)
    got = add_gaussian_noise_(tensors, key=5, step=6, std=1.3)
    assert all(torch.equal(got[k], host[k]) and torch.equal(got[k].signbit(), host[k].signbit()) for k in host)


def test_a_private_step_with_device_noise_reads_the_guard_and_the_noise_check(monkeypatch):
    """The one-process step whose noise takes the device path (as it does for CUDA parameters):
    the guard and the noise's one check, nothing else."""
    model, batch = tiny()
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.05, method="ghost")
    opt = adamw(1e-3)
    state = init_state(dict(model.named_parameters()), opt, key=1, config=config)
    step = make_private_step(model, token_loss, opt, config, num_examples=100)
    _, host_metrics = step(state, batch)
    host_params = step(state, batch)[0].params
    _as_device(monkeypatch)
    step(state, batch)
    with HostReads() as reads:
        new, metrics = step(state, batch)
    assert dict(reads.counts) == {"_local_scalar_dense": GUARD + DEVICE_NOISE_CHECK}
    assert all(torch.equal(new.params[k], host_params[k]) for k in host_params)
    assert metrics["loss"] == host_metrics["loss"]


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
@pytest.mark.cuda
def test_a_cuda_private_step_synchronises_at_most_at_the_guard():
    """CUDA's sync debug mode warns at every synchronising call; a step on the GPU makes at most
    the guard's one and the device noise's one check."""
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
    assert len(syncs) <= GUARD + DEVICE_NOISE_CHECK, syncs
    assert metrics["batch_size"] == 4


def _sharded_steps(mechanism, steps: int = 2):
    """Each rank's parameters and history after ``steps`` private zero3 steps on two simulated
    ranks, and what each rank read in the last one."""
    from privacy.mechanisms import INDEPENDENT

    model, (ids, targets) = tiny()
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.05, method="ghost",
                      mechanism=mechanism or INDEPENDENT)
    opt, layout = adamw(1e-3), strategies.zero3()

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), token_loss, opt, layout, comm, param_shapes=shapes,
                                 config=config, num_examples=50)
        state = init_sharded(params, opt, layout, comm, key=7, config=config)
        for _ in range(steps - 1):
            state, _ = step(state, (ids, targets))
        with HostReads() as reads:
            state, _ = step(state, (ids, targets))
        return dict(reads.counts), state.params, state.noise_history

    return run_threads(Mesh(dp=2), rank)


@pytest.mark.parametrize("kind, rounds", [("independent", "fixed"), ("banded", "fixed"), ("blt", "cut")],
                         ids=["independent", "banded", "blt-rounds-cut"])
def test_a_sharded_step_with_device_noise_reads_the_guard_and_one_noise_check(monkeypatch, kind, rounds):
    """A zero3 step whose noise takes the device path reads the guard and ONE check for all of
    its parameters' unchecked draws (``OwnedNoise.settle``), not one per parameter, and ends with
    the host path's bits, a banded history or BLT buffers included. With the sampler's rounds
    cut to one call, every block has open elements: each is drawn again checked (more reads in
    that rare path) and the bits, buffers included, are still the host's."""
    import privacy.ziggurat_ops as ops
    from privacy.mechanisms import BufferedToeplitz, banded, blt_mechanism

    mechanism = {"independent": None, "banded": banded((0.8, 0.5)),
                 "blt": blt_mechanism(BufferedToeplitz((0.9, 0.3), (0.4, 0.2)), min_sep=2)}[kind]
    host = _sharded_steps(mechanism)
    _as_device(monkeypatch)
    if rounds == "cut":
        monkeypatch.setattr(ops, "ROUNDS_A", 1)
        monkeypatch.setattr(ops, "ROUNDS_B", 0)
    device = _sharded_steps(mechanism)
    for (counts, params, history), (_, want, want_history) in zip(device, host):
        if rounds == "fixed":
            assert counts == {"_local_scalar_dense": GUARD + DEVICE_NOISE_CHECK}
        assert all(torch.equal(params[k], want[k]) for k in want)
        assert len(history) == len(want_history)
        for mine, theirs in zip(history, want_history):
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
