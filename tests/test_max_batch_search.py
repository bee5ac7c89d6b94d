"""The max-batch benchmark's search (``benchmarks/max_batch.py::max_fitting``) and the memory
model it is compared with (``fsdpx.runtime.step_memory``)."""

from __future__ import annotations

import pytest
import torch

from fsdpx.optim import adamw
from fsdpx.runtime.sharded_state import init_sharded
from fsdpx.runtime.step import make_sharded_step
from fsdpx.runtime.step_memory import LiveBytes, step_peak
from fsdpx.runtime.threads import run_threads
from fsdpx.sharding import Mesh, strategies
from privacy.step import DPConfig

from support.benchmarks import load_benchmark
from support.hf import T, VOCAB, gpt2, lm_loss

max_fitting = load_benchmark("max_batch").max_fitting


@pytest.mark.parametrize("b_star", [0, 1, 2, 3, 7, 8, 9, 100, 1000])
@pytest.mark.parametrize("guess", [1, 2, 5, 64, 5000])
def test_search_finds_the_largest_fitting_batch_from_any_guess(b_star, guess):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= b_star

    best, probes = max_fitting(fits, guess=guess, limit=1000)
    assert best == b_star
    assert [b for b, _ in probes] == calls and len(set(calls)) == len(calls)  # each batch probed once
    assert all(ok == (b <= b_star) for b, ok in probes)
    assert all(1 <= b <= 1000 for b in calls)
    # exponential then binary: O(log |b* - guess|) probes
    assert len(calls) <= 2 * (abs(b_star - min(guess, 1000)) + 1).bit_length() + 2


def test_search_with_an_exact_guess_needs_two_probes():
    best, probes = max_fitting(lambda b: b <= 13, guess=13)
    assert best == 13 and probes == [(13, True), (14, False)]


def test_search_rejects_a_bad_limit():
    with pytest.raises(ValueError, match="limit"):
        max_fitting(lambda b: True, limit=0)


def test_live_bytes_counts_new_storages_once_and_follows_frees_and_resizes():
    with LiveBytes() as mem:
        a = torch.empty(1000, device="meta")  # 4000 B
        b = a * 2  # 4000 B more
        v = b.view(10, 100)  # a view: nothing new
        b.add_(1)  # in place: nothing new
        assert mem.live == 8000
        del a
        torch.empty(0, device="meta")  # any operator reads the live total
        assert mem.live == 4000
        v.untyped_storage().resize_(0)  # a runtime releasing a gathered unit
        assert mem.live == 0
    assert mem.peak == 8000


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_step_peak_counts_a_step_exactly(strategy):
    """The meta run counts what the real private step allocates on rank 0: the same step on
    CPU tensors (2 ranks as threads), under the same counting mode, has the same peak (DDP: to
    the byte; ZeRO-3 within 1%: the thread communicator's own buffers differ from the meta one's
    answers, 192 of 140,320 bytes here)."""
    model = gpt2()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    config = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=4 / 100, method="ghost")
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4, T))

    def rank(comm):
        step = make_sharded_step(gpt2(), lm_loss, adamw(1e-3), strategies.ALL[strategy](), comm, param_shapes=shapes,
                                 config=config, num_examples=100, donate=True)
        state = init_sharded(params, adamw(1e-3), strategies.ALL[strategy](), comm, key=0, config=config)
        step(state, (tokens, tokens))  # the first step also checks agreement: measure the second
        mem = LiveBytes()
        if comm.rank == 0:
            with mem:
                step(state, (tokens, tokens))
        else:
            step(state, (tokens, tokens))
        return mem.peak

    measured = run_threads(Mesh(dp=2), rank)[0]
    with torch.device("meta"):
        meta_model = gpt2()
    predicted = step_peak(meta_model, lm_loss, adamw(1e-3), strategies.ALL[strategy](), Mesh(dp=2), (4, T),
                          config=config, num_examples=100, dtype=torch.float64)
    if strategy == "ddp":
        assert predicted.step == measured
    assert abs(predicted.step - measured) <= 0.01 * measured
    assert predicted.state > 0 and predicted.total == predicted.state + predicted.step
