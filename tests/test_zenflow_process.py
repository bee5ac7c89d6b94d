"""ZenFlow's host work in a worker process (``offload.zenflow(..., host_process=True)``,
``offload.host_process``): the thread worker's bits, a checkpoint taken with a window in flight,
buffers allocated once, a dead worker named, a worker that dies with its parent.

One worker process serves the module (its start costs about a torch import); the test that
kills it runs last and drops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import offload
from fsdpx.optim import Optimizer, adamw
from fsdpx.train import cli
from offload import worker
from offload.checkpoint_form import from_checkpoint, to_checkpoint
from offload.host_process import HostWorkerDied
from support.threads import one_thread  # noqa: F401

F64 = torch.float64
INNER = adamw(lr=0.1, weight_decay=0.01)
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-chars", "20000",
        "--no-progress", "--non-private", "--batch-size", "16", "--no-export", "--offload", "zenflow",
        "--offload-topk", "0.25", "--offload-interval", "2"]


def _problem(dtype: torch.dtype, steps: int, seed: int = 23, freeze: bool = True) -> tuple[dict, list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 9, dtype=dtype, generator=gen), "v": torch.randn(9, 5, dtype=dtype, generator=gen),
              "b": torch.randn(4, dtype=dtype, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=dtype, generator=gen) * (1 + t % 3) for k, v in params.items()
              if not (freeze and k == "w" and 4 <= t <= 6)}  # "w" frozen for three steps: landed columns go stale
             for t in range(steps)]
    return params, grads


def _same_tree(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same_tree(a[k], b[k])
    else:
        assert a == b


def _clone(tree: dict) -> dict:
    return {k: v.clone() for k, v in tree.items()}


@pytest.mark.parametrize("dtype, update_interval, select_interval, delay",
                         [(torch.float32, 3, 9, 1), (F64, "auto", 2, 1), (torch.float32, 2, 4, 0)])
def test_the_process_worker_gives_the_thread_workers_bits(one_thread, dtype, update_interval, select_interval, delay):
    """Step after step, ``host_process=True`` returns the thread worker's parameters bit for bit,
    donated (``update_inplace``) and pure (``update``), through window ends, reselections (mixed
    counts), "auto" windows and a weight frozen mid-run (the windows that land while it is frozen are
    written into its master by the worker and read back by the loop when it trains again); the
    merged element state at the end is the same too."""
    params, grads = _problem(dtype, 14)
    knobs = dict(topk_ratio=0.3, update_interval=update_interval, select_interval=select_interval, delay=delay,
                 overlap=True, auto=offload.AutoConfig(min_interval=1, max_interval=3))
    thread, proc = offload.zenflow(INNER, **knobs), offload.zenflow(INNER, host_process=True, **knobs)
    ref_s, ref_p = thread.init(params), params
    don_s, don_p = proc.init(params), _clone(params)
    pure_s, pure_p = proc.init(params), params
    for g in grads:
        ref_p, ref_s = thread.update(g, ref_s, ref_p)
        don_p, don_s = proc.update_inplace(_clone(g), don_s, don_p)
        pure_p, pure_s = proc.update(g, pure_s, pure_p)
        _same_tree(don_p, ref_p)
        _same_tree(pure_p, ref_p)
    _same_tree(offload.element_state(don_s), offload.element_state(ref_s))
    _same_tree(offload.element_state(pure_s), offload.element_state(ref_s))
    assert not torch.equal(ref_p["w"], params["w"])


def test_a_checkpoint_taken_with_a_window_in_the_worker_resumes_bit_for_bit(one_thread):
    """A donated run saved (``offload.checkpoint_form``) while the worker process still computes
    a window (after steps 5 and 7 of 2-step windows) and restored into fresh state continues as
    the straight run does, bit for bit."""
    params, grads = _problem(torch.float32, 10, seed=5)
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=4, delay=1, overlap=True,
                          host_process=True)

    def run(saves: set[int]) -> list[dict]:
        state, p, out = opt.init(params), _clone(params), []
        for step, g in enumerate(grads, 1):
            p, state = opt.update_inplace(_clone(g), state, p)
            out.append(_clone(p))
            if step in saves:
                state = from_checkpoint(to_checkpoint(state, {}), opt.init(params))
        return out

    for step, (a, b) in enumerate(zip(run(set()), run({5, 7})), 1):
        assert all(torch.equal(a[k], b[k]) for k in a), f"step {step}"


def test_a_steady_run_reuses_its_shared_buffers(one_thread):
    """Without reselection a donated run shares its host state, window sums and result buffers
    with the worker once: after the first windows no new storage goes to the worker."""
    params, grads = _problem(torch.float32, 16, seed=9, freeze=False)
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=100, delay=1, overlap=True,
                          host_process=True)
    state, p = opt.init(params), _clone(params)
    sent = []
    for g in grads:
        p, state = opt.update_inplace(_clone(g), state, p)
        offload.materialize(state)
        sent.append(worker.process(1).storages_sent)
    assert sent[5] > 0 and sent[-1] == sent[5]


def _train(tmp_path: Path, *flags: str) -> Path:
    cli.main(["train", "--out", str(tmp_path / "runs"), "--name", "r", *TINY, *flags])
    return tmp_path / "runs" / "r"


def test_fsdpx_train_with_the_host_process_gives_the_threads_losses(tmp_path):
    """``fsdpx train --offload-host-process``: the losses of the thread worker's run, bit for bit,
    over 6 steps of 2-step windows (window 1's host result, computed in the worker process, is in
    the parameters of steps 5 and 6); the setting is recorded in the run's config.toml."""
    losses = []
    for name, flags in (("thread", ()), ("process", ("--offload-host-process",))):
        run = _train(tmp_path / name, "--steps", "6", *flags)
        losses.append([json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()])
    assert losses[0] == losses[1] and len(losses[0]) == 6
    assert "host_process = true" in (run / "config.toml").read_text()


@pytest.mark.parametrize("flags, words", [
    (["--offload", "none", "--offload-host-process"], "--offload-host-process runs ZenFlow's host window in a"
                                                       " process: it needs --offload \"zenflow\", got 'none'"),
    (["--offload-host-process", "--no-offload-overlap-step"], "it needs --offload-overlap-step"),
    (["--offload-host-threads", "2"], "--offload-host-threads sets ZenFlow's host worker process: it needs"
                                      " --offload-host-process"),
    (["--offload-host-process", "--offload-host-cores", "0-"], "--offload-host-cores must be CPU numbers"),
    (["--offload-host-process", "--offload-host-cores", "4096"], "CPUs [4096] are not among this process's"),
])
def test_host_process_flags_that_cannot_work_are_refused_naming_the_flag(tmp_path, capsys, flags, words):
    """One line on stderr naming the flag, exit 2, nothing written."""
    with pytest.raises(SystemExit) as exit_:
        _train(tmp_path, "--steps", "1", *flags)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert words in err, err
    assert not (tmp_path / "runs").exists()


def test_an_inner_optimizer_the_worker_cannot_rebuild_is_refused():
    """``host_process`` needs an optimizer with a recipe, threads >= 1 and CPUs this process has."""
    custom = Optimizer(INNER.init, INNER.update)
    with pytest.raises(ValueError, match="recipe"):
        offload.zenflow(custom, host_process=True)
    with pytest.raises(ValueError, match="host_threads"):
        offload.zenflow(INNER, host_process=True, host_threads=0)
    with pytest.raises(ValueError, match="host_cores"):
        offload.zenflow(INNER, host_process=True, host_cores=(10_000,))


def test_the_worker_dies_with_its_parent():
    """A parent killed with SIGKILL (no clean-up runs) takes its worker process with it."""
    script = ("import os, signal, sys; from offload import worker; from offload.host_process import resource_usage;"
              " w = worker.process(1); w.submit(resource_usage).result(); print(w.pid, flush=True);"
              " sys.stdin.readline(); os.kill(os.getpid(), signal.SIGKILL)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.stdin.write("\n")
        parent.stdin.flush()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_killed_worker_is_named_at_the_next_wait(one_thread):
    """The worker process killed mid-run: the next window end raises ``HostWorkerDied`` naming
    its pid and signal, within a bounded time (no hang), and so does every later step. (Runs
    last: it drops the module's worker.)"""
    params, grads = _problem(torch.float32, 8, seed=3)
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=100, delay=1, overlap=True,
                          host_process=True)
    state, p = opt.init(params), _clone(params)
    for g in grads[:2]:  # the first window's job is in the worker
        p, state = opt.update_inplace(_clone(g), state, p)
    w = worker.process(1)
    try:
        offload.materialize(state)
        os.kill(w.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(HostWorkerDied, match=rf"pid {w.pid}\) was killed by signal {int(signal.SIGKILL)}"):
            for g in grads[2:6]:
                p, state = opt.update_inplace(_clone(g), state, p)
        assert time.monotonic() - start < 10
        with pytest.raises(HostWorkerDied):
            opt.update_inplace(_clone(grads[6]), state, p)
    finally:
        worker.forget_process(w)
