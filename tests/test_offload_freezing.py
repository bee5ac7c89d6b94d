"""Freezing with an offloaded optimizer (issue 31, item 3): ZenFlow and ZeRO-Offload take the
trainable parameters' gradients and keep the others frozen (``Optimizer.partial_grads``), equal
to AdamW under the same schedule where ZenFlow's semantics coincide with it, and to the
documented ZenFlow rule otherwise (``offload.zenflow``, "Freezing")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ckpt
import offload
from fsdpx.optim import adamw, update_trainable
from fsdpx.optim.freezing import frozen_update
from fsdpx.sharding import Mesh
from fsdpx.train import RunConfig, run
from fsdpx.train.sources import build_source
from support.threads import one_thread  # noqa: F401 - autouse fixture

F64 = torch.float64
INNER = adamw(lr=0.1, weight_decay=0.01)


def _problem(steps: int, dtype: torch.dtype = torch.float32, seed: int = 5) -> tuple[dict, list[dict]]:
    """Two 2-D weights and a bias; column scales vary per step, so selections change."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 8, dtype=dtype, generator=gen), "v": torch.randn(8, 3, dtype=dtype, generator=gen),
              "b": torch.randn(4, dtype=dtype, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=dtype, generator=gen)
              * (1 + torch.rand(v.shape[-1], dtype=dtype, generator=gen) * (1 + t % 3)) for k, v in params.items()}
             for t in range(steps)]
    return params, grads


def _frozen(t: int) -> set[str]:
    """The schedule the tests share: w frozen for steps 2-5, b for 4-6, v from 9 on."""
    return {n for n, lo, hi in (("w", 2, 6), ("b", 4, 7), ("v", 9, 99)) if lo <= t < hi}


def _run(opt, params: dict, grads: list[dict], frozen=_frozen, *, donate: bool = False) -> tuple[list[dict], dict]:
    """``opt`` under the schedule, through the update a step applies (``frozen_update``)."""
    state, p = opt.init(params), {k: v.clone() for k, v in params.items()}
    update = frozen_update(opt, opt.update_inplace if donate and opt.update_inplace else opt.update)
    history = []
    for t, g in enumerate(grads):
        p, state = update({k: v for k, v in g.items() if k not in frozen(t)}, state, p)
        history.append({k: v.clone() for k, v in p.items()})
    return history, state


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def _adamw_under_schedule(params: dict, grads: list[dict]) -> list[dict]:
    state, p, history = INNER.init(params), dict(params), []
    for t, g in enumerate(grads):
        p, state = update_trainable(INNER.update, {k: v for k, v in g.items() if k not in _frozen(t)}, state, p)
        history.append(dict(p))
    return history


@pytest.mark.parametrize("donate", [False, True])
def test_zero_offload_under_a_schedule_equals_adamw_bit_for_bit(donate):
    params, grads = _problem(12)
    got, state = _run(offload.zero_offload(INNER), params, grads, donate=donate)
    assert _same(got, _adamw_under_schedule(params, grads))
    assert state["inner"]["count"] == {"w": 8, "v": 9, "b": 9}  # per-parameter counts, as without offload


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("knobs", [dict(topk_ratio=1.0, update_interval=3, select_interval=3),
                                   dict(topk_ratio=0.3, update_interval=1, select_interval=2, delay=0)],
                         ids=["every_column_selected", "one_step_windows"])
def test_zenflow_where_it_is_adamw_stays_adamw_under_a_schedule(knobs, donate):
    """The exactness anchor: where ZenFlow is AdamW (every column on the device, or one-step
    windows landing at once) it is AdamW under the schedule too, bit for bit: a frozen
    parameter and its moments are untouched, an unfrozen one continues from its own count."""
    params, grads = _problem(12)
    got, state = _run(offload.zenflow(INNER, **knobs), params, grads, donate=donate)
    assert _same(got, _adamw_under_schedule(params, grads))
    merged = offload.element_state(state)
    assert merged["b"]["count"] == 9 and merged["w"]["count"].tolist() == [8] * 8


def test_a_weight_frozen_from_the_start_is_never_selected_and_then_starts_fresh():
    """w frozen for steps 0-5 (two whole windows, select_interval 6): nothing of its state moves
    and it has no selection; from step 6 on it is exactly a ZenFlow run of w alone started
    then (its first selection from its first trained gradient, zero moments, count 0)."""
    params, grads = _problem(14)
    frozen = lambda t: {"w"} if t < 6 else set()  # noqa: E731
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=3, select_interval=6)
    history, _ = _run(opt, params, grads[:6], frozen)
    assert all(torch.equal(h["w"], params["w"]) for h in history)
    state = opt.init(params)
    p = dict(params)
    for t in range(6):
        p, state = opt.update({k: v for k, v in grads[t].items() if k not in frozen(t)}, state, p)
    assert "w" not in state["selected"]
    assert torch.equal(state["host"]["w"]["count"], torch.zeros(8, dtype=torch.int64))
    assert not state["host"]["w"]["mu"].any() and not state["host"]["w"]["nu"].any()
    whole, _ = _run(opt, params, grads, frozen)
    alone, _ = _run(opt, {"w": params["w"]}, [{"w": g["w"]} for g in grads[6:]], lambda t: set())
    assert all(torch.equal(a["w"], b["w"]) for a, b in zip(whole[6:], alone))


def test_a_window_half_frozen_updates_with_the_mean_of_the_steps_it_trained():
    """No column selected (topk 0), one window of 4 steps landing at once (delay 0): w frozen
    at steps 1 and 2 gets one AdamW step with the mean of its gradients of steps 0 and 3."""
    params, grads = _problem(4, F64)
    frozen = lambda t: {"w"} if t in (1, 2) else set()  # noqa: E731
    got, _ = _run(offload.zenflow(INNER, topk_ratio=0.0, update_interval=4, select_interval=4, delay=0),
                  params, grads, frozen)
    mean = (grads[0]["w"] + grads[3]["w"]) / 2
    want, _ = INNER.update({"w": mean}, INNER.init({"w": params["w"]}), {"w": params["w"]})
    assert torch.equal(got[-1]["w"], want["w"])
    assert all(torch.equal(h["w"], params["w"]) for h in got[:3])  # nothing lands before the window ends


@pytest.mark.parametrize("donate", [False, True])
def test_a_host_window_landing_while_frozen_waits_for_the_next_trained_step(donate):
    """delay=1, windows of 3: w trains in steps 0-2, is frozen for 3-8 and trains again at 9.
    Its window of steps 0-2 lands at the end of step 5 into its master and moments, not into
    the frozen parameter, which holds its value through step 8; step 9 first writes the landed
    columns, so after it every unselected column of w equals its master."""
    params, grads = _problem(10)
    frozen = lambda t: {"w"} if 3 <= t < 9 else set()  # noqa: E731
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=3, select_interval=99, delay=1)
    history, state = _run(opt, params, grads, frozen, donate=donate)
    assert all(torch.equal(h["w"], history[2]["w"]) for h in history[3:9])
    uns = state["unselected"]["w"]
    master = offload.element_state(state)["w"]["master"]
    assert not torch.equal(master[:, uns], history[8]["w"][:, uns])  # the window landed in the master ...
    assert torch.equal(history[9]["w"][:, uns], master[:, uns])  # ... and reaches the parameter at step 9
    pure, _ = _run(opt, params, grads, frozen, donate=not donate)
    assert _same(history, pure)


def test_overlap_and_donation_give_the_same_bits_under_a_schedule():
    params, grads = _problem(15)
    runs = []
    for overlap in (False, True):
        for donate in (False, True):
            opt = offload.zenflow(INNER, topk_ratio=0.3, update_interval=2, select_interval=4, overlap=overlap)
            history, state = _run(opt, params, grads, donate=donate)
            runs.append((history, offload.master_params(state)))
    for history, masters in runs[1:]:
        assert _same(history, runs[0][0]) and _same([masters], [runs[0][1]])


def test_a_materialized_state_under_a_schedule_resumes_bit_for_bit():
    """A state saved inside a window while w's landed columns wait (step 7 of the schedule
    that freezes w at 3-8) continues as the straight run."""
    params, grads = _problem(12)
    frozen = lambda t: {"w"} if 3 <= t < 9 else set()  # noqa: E731
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=3, select_interval=6)
    straight, _ = _run(opt, params, grads, frozen)
    state, p = opt.init(params), dict(params)
    update = frozen_update(opt, opt.update)
    for t in range(7):
        p, state = update({k: v for k, v in grads[t].items() if k not in frozen(t)}, state, p)
    saved = offload.materialize(state)
    assert "stale" in saved and saved["window_steps"] == 1
    for t in range(7, 12):
        p, saved = update({k: v for k, v in grads[t].items() if k not in frozen(t)}, saved, p)
        assert all(torch.equal(p[k], straight[t][k]) for k in p), t


def test_a_gradient_for_an_unknown_name_is_refused():
    params, grads = _problem(1)
    for opt in (offload.zenflow(INNER), offload.zero_offload(INNER)):
        with pytest.raises(KeyError, match="'z'"):
            opt.update({**grads[0], "z": grads[0]["b"]}, opt.init(params), params)


# --- fsdpx train --freeze with --offload -------------------------------------------------------

TINY = dict(n_layer=1, n_embd=8, n_head=1, block_size=8, corpus_chars=4000, batch_size=16, noise_multiplier=1.0,
            target_epsilon=None, seed=2, freeze="wte,wpe@0-3;blocks.0.mlp.fc@2-5;ln_f@2-5")


def _final(root) -> dict:
    return ckpt.load(ckpt.CheckpointManager(root).latest(), mesh=Mesh(dp=1), strategy=None, private=True).params


def _records(run_dir) -> list[dict]:
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_a_run_under_a_schedule_with_every_column_selected_equals_the_run_without_offload(tmp_path, private):
    """``--freeze`` with ``--offload zenflow --offload-topk 1`` (ZenFlow is AdamW) and with
    ``--offload zero`` end with the bits of the run without offload, private and plain."""
    common = dict(TINY, out=str(tmp_path), steps=6, ckpt_every=6, private=private)
    finals = {}
    for name, off in [("none", {}), ("zenflow", dict(offload="zenflow", offload_topk=1.0)), ("zero", dict(offload="zero"))]:
        run(RunConfig.of(name=name, ckpt_dir=str(tmp_path / name), **common, **off), progress=False)
        finals[name] = _final(tmp_path / name)
    initial = build_source(RunConfig.of(**TINY)).params
    for name in ("zenflow", "zero"):
        assert all(torch.equal(finals[name][k], finals["none"][k]) for k in finals["none"]), name
    assert not torch.equal(finals["none"]["wte.weight"], initial["wte.weight"])  # unfrozen at step 3: it trained


def test_a_zenflow_run_under_a_schedule_resumes_inside_a_window_bit_for_bit(tmp_path):
    """The checkpoint after step 5 falls inside a window (interval 2, delay 1) while the MLP's
    fc weight is frozen (steps 2-4) holding its window of steps 0-1, landed at step 3 into its
    master only: the resumed run equals the straight one."""
    common = dict(TINY, out=str(tmp_path), offload="zenflow", offload_interval=2, offload_topk=0.25, ckpt_every=5)
    run(RunConfig.of(steps=8, name="straight", ckpt_dir=str(tmp_path / "s"), **common), progress=False)
    run(RunConfig.of(steps=5, name="resumed", ckpt_dir=str(tmp_path / "r"), **common), progress=False)
    held = ckpt.load(ckpt.CheckpointManager(tmp_path / "r").latest(), mesh=Mesh(dp=1), strategy=None, private=True)
    stale = [k for k, c in held.opt_state["columns"].items() if "stale" in c]  # the checkpoint form's mask
    assert stale == ["blocks.0.mlp.fc.weight"] and held.opt_state["window_steps"] == 1
    run(RunConfig.of(steps=8, name="resumed", ckpt_dir=str(tmp_path / "r"), resume=True, **common), progress=False)
    a, b = _records(tmp_path / "straight"), _records(tmp_path / "resumed")
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b] and len(a) == 8
    straight, resumed = _final(tmp_path / "s"), _final(tmp_path / "r")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.slow
def test_a_zero3_zenflow_run_under_a_schedule_follows_one_process_and_resumes_bit_for_bit(tmp_path):
    """``fsdpx train --strategy zero3 --nproc 2`` (gloo) with ZenFlow and the schedule above:
    its losses follow the one-process run's, and a run resumed from its checkpoint at step 5 (inside
    a window, fc's landed columns held) equals the straight two-process run bit for bit."""
    args = ["--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8", "--corpus-chars", "4000",
            "--batch-size", "16", "--noise-multiplier", "1", "--seed", "2", "--no-progress", "--freeze", TINY["freeze"],
            "--offload", "zenflow", "--offload-interval", "2", "--offload-topk", "0.25", "--out", str(tmp_path)]
    two = ["--strategy", "zero3", "--nproc", "2"]

    def fsdpx(*extra):
        done = subprocess.run([sys.executable, "-m", "fsdpx", "train", *args, *extra], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]

    fsdpx("--steps", "8", "--name", "one")
    fsdpx("--steps", "8", "--name", "straight", *two, "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "5")
    fsdpx("--steps", "8", "--name", "resumed", *two, "--resume-from", str(tmp_path / "ck" / "step_5"))
    one, a, b = (_records(tmp_path / n) for n in ("one", "straight", "resumed"))
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b] and len(a) == 8
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in one], rel=1e-5)


@pytest.mark.parametrize("donate", [False, True])
def test_a_weight_frozen_at_a_window_end_then_training_again_gets_the_window_that_landed(donate):
    """No column selected (topk 0), delay=1, windows of 2: w trains at steps 0-4, is frozen at
    step 5 (the end of window 3, where window 2 lands) and trains again at step 6, while window
    3 (its step 4) is still in flight. Step 6 writes window 2's result into w: its master holds
    it, though window 3 goes on from it (ZenFlow carries a landed window into the next one only
    for a weight that trains at that window end: ``offload.zenflow._carried``)."""
    params, grads = _problem(7, F64)
    frozen = lambda t: {"w"} if t == 5 else set()  # noqa: E731
    opt = offload.zenflow(INNER, topk_ratio=0.0, update_interval=2, select_interval=2, delay=1, overlap=True)
    history, _ = _run(opt, params, grads, frozen, donate=donate)
    state = INNER.init({"w": params["w"]})
    p1, state = INNER.update({"w": (grads[0]["w"] + grads[1]["w"]) / 2}, state, {"w": params["w"]})  # window 1
    p2, _ = INNER.update({"w": (grads[2]["w"] + grads[3]["w"]) / 2}, state, p1)  # window 2
    assert all(torch.equal(history[t]["w"], p1["w"]) for t in (3, 4, 5))  # window 1 landed at step 3
    assert torch.equal(history[6]["w"], p2["w"])
