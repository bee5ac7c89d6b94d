"""ZenFlow (offload.zenflow) and its "auto" rules (offload.auto): the documented semantics on
small hand-checked cases. The exhaustive equalities are in property_tests/test_zenflow_properties.py."""

from __future__ import annotations

import importlib
import io
import math
import threading
from concurrent.futures import Future

import pytest
import torch

import offload
from fsdpx.optim import adamw, sgd
from offload import worker
from offload.auto import AutoConfig, host_update_due, reselect_due
from offload.columns import column_scores, select_columns

F64 = torch.float64
INNER = adamw(lr=0.1, weight_decay=0.01)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def col(p: torch.Tensor, c: int) -> dict:
    return {"x": p[:, c].clone()}


def steps(opt, params, grads):
    state, p, history = opt.init(params), params, []
    for g in grads:
        p, state = opt.update(g, state, p)
        history.append(p)
    return history, state


def two_column_problem(n_steps):
    """Column 0 always dominates, so it stays selected (topk_ratio 0.5 of 2 columns)."""
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(2, 2, dtype=F64, generator=gen)}
    scale = torch.tensor([10.0, 0.1], dtype=F64)
    grads = [{"w": torch.randn(2, 2, dtype=F64, generator=gen) * scale} for _ in range(n_steps)]
    return params, grads


# --- semantics -------------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0, 1])
def test_worked_example_from_the_docstring(delay):
    params, grads = two_column_problem(12)
    opt = offload.zenflow(INNER, topk_ratio=0.5, update_interval=4, select_interval=100, delay=delay)
    history, _ = steps(opt, params, grads)
    # s: inner every step; u: H_1 = inner(p0, mean g_1..g_4), H_2 = inner(H_1, mean g_5..g_8), ...
    s, s_state, want_s = col(params["w"], 0), INNER.init(col(params["w"], 0)), []
    for g in grads:
        s, s_state = INNER.update({"x": g["w"][:, 0]}, s_state, s)
        want_s.append(s["x"])
    u, u_state, h = col(params["w"], 1), INNER.init(col(params["w"], 1)), [params["w"][:, 1]]
    for w in range(3):
        window = [g["w"][:, 1] for g in grads[4 * w: 4 * w + 4]]
        u, u_state = INNER.update({"x": (window[0] + window[1] + window[2] + window[3]) / 4}, u_state, u)
        h.append(u["x"])
    for t, p in enumerate(history, 1):
        assert same(p["w"][:, 0], want_s[t - 1])
        shown = t // 4 - delay  # number of host windows visible after step t
        assert same(p["w"][:, 1], h[max(shown, 0)]), f"step {t}"


def test_entering_column_gets_its_closing_window_applied_first():
    """delay=1: column 1 is on the host in window 1 and enters the selection at its end; its
    window-1 update is applied at once (step 2), not at the end of window 2 like column 2's."""
    params = {"w": torch.tensor([[1.0, 2.0, 3.0]], dtype=F64)}
    grads = [{"w": torch.tensor([[9.0, 1.0, 0.5]], dtype=F64)},   # step 1: column 0 selected
             {"w": torch.tensor([[0.1, 9.0, 0.5]], dtype=F64)},   # step 2: window ends, column 1 wins
             {"w": torch.tensor([[0.3, 7.0, 0.2]], dtype=F64)},
             {"w": torch.tensor([[0.2, 6.0, 0.4]], dtype=F64)}]
    opt = offload.zenflow(INNER, topk_ratio=0.34, update_interval=2, select_interval=2, delay=1)
    history, state = steps(opt, params, grads)
    assert state["selected"]["w"].tolist() == [1]

    def host_window(c):
        g = (grads[0]["w"][:, c] + grads[1]["w"][:, c]) / 2
        return INNER.update({"x": g}, INNER.init(col(params["w"], c)), col(params["w"], c))

    h1, h1_state = host_window(1)
    assert same(history[1]["w"][:, 1], h1["x"])  # applied at the end of window 1
    assert same(history[1]["w"][:, 2], params["w"][:, 2])  # column 2 keeps delay=1
    assert same(history[3]["w"][:, 2], host_window(2)[0]["x"])  # ... and shows it a window later
    d3, d3_state = INNER.update({"x": grads[2]["w"][:, 1]}, h1_state, h1)  # count 2, moments of H_1
    assert same(history[2]["w"][:, 1], d3["x"])
    d4, _ = INNER.update({"x": grads[3]["w"][:, 1]}, d3_state, d3)
    assert same(history[3]["w"][:, 1], d4["x"])


def test_reselection_happens_exactly_every_select_interval_steps():
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(3, 6, dtype=F64, generator=gen)}
    grads = [{"w": torch.randn(3, 6, dtype=F64, generator=gen) * torch.rand(6, dtype=F64, generator=gen)}
             for _ in range(13)]
    opt = offload.zenflow(INNER, topk_ratio=0.34, update_interval=2, select_interval=4)
    state, p = opt.init(params), params
    current = select_columns(column_scores(grads[0]["w"]), 0.34)  # step 1 selects from its gradient
    for t, g in enumerate(grads, 1):
        p, state = opt.update(g, state, p)
        if t % 4 == 0:
            current = select_columns(column_scores(g["w"]), 0.34)
        assert state["selected"]["w"].tolist() == current.tolist(), f"after step {t}"


def test_non_2d_parameters_are_updated_on_the_device_every_step():
    gen = torch.Generator().manual_seed(7)
    params = {"b": torch.randn(3, dtype=F64, generator=gen), "conv": torch.randn(2, 1, 2, 2, dtype=F64, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=F64, generator=gen) for k, v in params.items()} for _ in range(5)]
    got, state = steps(offload.zenflow(INNER, topk_ratio=0.0, update_interval=4, select_interval=4), params, grads)
    want, _ = steps(INNER, params, grads)
    for a, b in zip(got, want):
        assert all(same(a[k], b[k]) for k in params)
    assert state["metrics"]["d2h_bytes"] == 0


def test_low_precision_params_follow_the_fp32_master():
    """bf16 weights: the result is the fp32 run cast to bf16, step by step; nothing is re-read from
    the bf16 copy."""
    gen = torch.Generator().manual_seed(11)
    def bf16_values(*shape):
        return torch.randn(*shape, generator=gen).bfloat16().float()

    p32 = {"w": bf16_values(4, 6), "b": bf16_values(4)}
    g32 = [{k: bf16_values(*v.shape) for k, v in p32.items()} for _ in range(7)]
    p16, g16 = {k: v.bfloat16() for k, v in p32.items()}, [{k: v.bfloat16() for k, v in g.items()} for g in g32]
    for ratio, u in ((1.0, 1), (0.5, 2)):
        opt = offload.zenflow(INNER, topk_ratio=ratio, update_interval=u, select_interval=2 * u, delay=1)
        low, low_state = steps(opt, p16, g16)
        full, full_state = steps(opt, p32, g32)
        for a, b in zip(low, full):
            assert all(same(a[k], b[k].bfloat16()) for k in a)
        masters = offload.master_params(low_state)
        assert all(v.dtype == torch.float32 for v in masters.values())
        assert all(same(masters[k], v) for k, v in offload.master_params(full_state).items())


# --- purity, ownership, checkpoints ----------------------------------------------------------


def _snapshot(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_snapshot(v) for v in x]
    return x


def _assert_same_tree(a, b):
    if isinstance(a, torch.Tensor):
        assert same(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            if k not in ("host_wait_s", "host_loop_s"):
                _assert_same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_tree(x, y)
    else:
        assert a == b


def test_update_is_pure_and_never_writes_its_inputs():
    gen = torch.Generator().manual_seed(13)
    params = {"w": torch.randn(3, 5, dtype=F64, generator=gen), "b": torch.randn(3, dtype=F64, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=F64, generator=gen) for k, v in params.items()} for _ in range(4)]
    opt = offload.zenflow(INNER, topk_ratio=0.4, update_interval=2, select_interval=2, delay=1, overlap=True)
    state, p = opt.init(params), params
    for g in grads[:3]:
        p, state = opt.update(g, state, p)  # step 3: window 1 in flight
    assert isinstance(state["pending"]["result"], Future)
    before = (_snapshot(grads[3]), _snapshot(offload.materialize(state)), _snapshot(p))
    out_a = opt.update(grads[3], state, p)
    out_b = opt.update(grads[3], state, p)
    _assert_same_tree(offload.materialize(out_a[1]), offload.materialize(out_b[1]))
    _assert_same_tree(out_a[0], out_b[0])
    _assert_same_tree((grads[3], offload.materialize(state), p), before)
    new_params, new_state = out_a
    new_params["b"].add_(1.0)  # the caller owns the weights it gets back
    assert not torch.equal(offload.master_params(new_state)["b"], new_params["b"])


def test_background_worker_reads_only_its_own_copies():
    """Hold the worker, let update hand it a window, then scribble over everything the caller
    holds; the job's result is unchanged."""
    gen = torch.Generator().manual_seed(17)
    params = {"w": torch.randn(3, 5, dtype=F64, generator=gen)}
    grads = [{"w": torch.randn(3, 5, dtype=F64, generator=gen)} for _ in range(2)]

    def window_result(scribble: bool):
        opt = offload.zenflow(INNER, topk_ratio=0.4, update_interval=2, select_interval=2, delay=1, overlap=True)
        state, p = opt.init(params), {"w": params["w"].clone()}
        gs = [{"w": g["w"].clone()} for g in grads]
        p, state = opt.update(gs[0], state, p)
        release = threading.Event()
        worker.submit(release.wait)  # the window job queues behind this
        old = state
        p, state = opt.update(gs[1], state, p)
        assert not state["pending"]["result"].done()
        if scribble:
            for t in [gs[0]["w"], gs[1]["w"], p["w"], *old["host"]["w"].values(), *state["host"]["w"].values(),
                      *old["acc"].values()]:
                t.fill_(float("nan")) if t.is_floating_point() else t.fill_(7)
        release.set()
        return offload.materialize(state)["pending"]["result"]

    _assert_same_tree(window_result(scribble=True), window_result(scribble=False))


def _weights_and_grads(seed: int, dtype: torch.dtype, *, rows: int, cols: int, out: int, steps: int,
                       period: int) -> tuple[dict, list[dict]]:
    """Two 2-D weights (``w [rows, cols]``, ``v [cols, out]``) and a bias, and ``steps`` gradients
    whose scale cycles through 1..``period`` (so column scores change and windows reselect)."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(rows, cols, dtype=dtype, generator=gen),
              "v": torch.randn(cols, out, dtype=dtype, generator=gen), "b": torch.randn(rows, dtype=dtype, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=dtype, generator=gen) * (1 + t % period) for k, v in params.items()}
             for t in range(steps)]
    return params, grads


def _twins(opt, params: dict) -> tuple:
    """``(pure_state, pure_params, state, params)``: a state for ``update`` on ``params`` and one
    for ``update_inplace`` on copies it may overwrite."""
    copies = {k: v.clone() for k, v in params.items()}
    return opt.init(params), params, opt.init({k: v.clone() for k, v in params.items()}), copies


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("delay, overlap, update_interval", [(1, True, 2), (1, False, 3), (0, True, 2), (1, True, "auto")])
def test_donated_update_gives_the_same_bits(dtype, delay, overlap, update_interval):
    """``update_inplace`` (state and params donated) returns, step after step, the parameters
    and state ``update`` returns, bit for bit, through window closes and reselections (columns
    entering and leaving, so host updates see mixed counts)."""
    gen = torch.Generator().manual_seed(23)
    params = {"w": torch.randn(4, 9, dtype=dtype, generator=gen), "v": torch.randn(9, 3, dtype=dtype, generator=gen),
              "b": torch.randn(4, dtype=dtype, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=dtype, generator=gen) * (1 + t % 3) for k, v in params.items()}
             for t in range(13)]
    select = 2 if update_interval == "auto" else 2 * update_interval
    opt = offload.zenflow(INNER, topk_ratio=0.3, update_interval=update_interval, select_interval=select,
                          delay=delay, overlap=overlap, auto=AutoConfig(min_interval=1, max_interval=3))
    pure_state, pure_p, state, p = _twins(opt, params)
    for g in grads:
        pure_p, pure_state = opt.update(g, pure_state, pure_p)
        p, state = opt.update_inplace(g, state, p)
        _assert_same_tree(p, pure_p)
    _assert_same_tree(offload.materialize(state), offload.materialize(pure_state))
    assert not all(torch.equal(pure_p[k], params[k]) for k in params)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("delay, hold", [(1, False), (1, True), (0, True)])
def test_background_window_sum_equals_the_inline_sum(monkeypatch, dtype, delay, hold):
    """With the window-sum adds handed to the background thread (as on CUDA; switched on here),
    the donated update still returns ``update``'s parameters and state bit for bit, step after
    step, through window closes and reselections. With ``hold`` the worker is blocked while the
    loop runs on, so adds, the landed window's merge and the window job queue up behind each
    other: they must run in order, and ``materialize`` must wait for all of them."""
    zf = importlib.import_module("offload.zenflow")  # the package exports the function under that name

    monkeypatch.setattr(zf, "_ASYNC_ON_CPU", True)
    params, grads = _weights_and_grads(29, dtype, rows=4, cols=9, out=3, steps=15, period=3)
    opt = offload.zenflow(INNER, topk_ratio=0.3, update_interval=2, select_interval=6, delay=delay, overlap=True)
    pure_state, pure_p, state, p = _twins(opt, params)
    for t, g in enumerate(grads):
        pure_p, pure_state = opt.update(g, pure_state, pure_p)
        release = threading.Event()
        if hold and t % 2 == 0:  # a window's first step (a closing one may wait for the worker)
            worker.submit(release.wait)
        p, state = opt.update_inplace({k: v.clone() for k, v in g.items()}, state, p)
        if hold and t % 2 == 0:  # the add is queued behind the held worker
            assert zf._SUM_JOB in state and not state[zf._SUM_JOB].done()
        release.set()
        _assert_same_tree(p, pure_p)
    _assert_same_tree(offload.materialize(state), offload.materialize(pure_state))
    assert zf._SUM_JOB not in offload.materialize(state)


@pytest.mark.parametrize("async_sum", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_reused_window_buffers_are_never_written_while_a_held_job_reads_them(monkeypatch, dtype, async_sum):
    """A donated fixed-window state reuses its window-sum buffers and its landed windows'
    tensors. Hold the worker from before each window end until after the next window's first
    steps, so each window job runs only after the loop has written the next window's sum: a
    buffer reused while a job still reads it changes that job's result. Step after step the
    parameters and, at the end, the state equal ``update``'s bit for bit (through reselections,
    so shapes change and mixed counts take ``update_columns``), and the buffers are reused."""
    zf = importlib.import_module("offload.zenflow")
    monkeypatch.setattr(zf, "_ASYNC_ON_CPU", async_sum)
    params, grads = _weights_and_grads(37, dtype, rows=5, cols=11, out=4, steps=25, period=4)
    opt = offload.zenflow(INNER, topk_ratio=0.3, update_interval=3, select_interval=9, delay=1, overlap=True)
    pure_state, pure_p, state, p = _twins(opt, params)
    release, seen = threading.Event(), set()
    try:
        for t, g in enumerate(grads, start=1):
            pure_p, pure_state = opt.update(g, pure_state, pure_p)
            if t % 3 == 0 and not (async_sum and t % 9 == 0):  # a window end: its job queues behind the
                release = threading.Event()  # held worker (a reselection waits for its queued adds: not held)
                worker.submit(release.wait)
            p, state = opt.update_inplace({k: v.clone() for k, v in g.items()}, state, p)
            seen |= {id(a) for a in state["acc"].values()}
            if t % 3 == 2:  # the next window's first two steps written: let the held job run
                release.set()
            _assert_same_tree(p, pure_p)
    finally:
        release.set()
    _assert_same_tree(offload.materialize(state), offload.materialize(pure_state))
    assert len(seen) < 2 * len(grads) // 3  # window sums were reused, not allocated per window


def test_donated_window_end_leaves_the_landed_window_to_the_next_job():
    """A donated ``delay=1`` window end without reselection leaves the landed window's master
    and slots to the background thread; ``materialize`` (and so ``element_state``) shows them
    as ``update`` does on the loop."""
    gen = torch.Generator().manual_seed(31)
    params = {"w": torch.randn(5, 8, dtype=F64, generator=gen)}
    grads = [{"w": torch.randn(5, 8, dtype=F64, generator=gen)} for _ in range(6)]
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=100, delay=1, overlap=True)
    pure_state, pure_p, state, p = _twins(opt, params)
    for t, g in enumerate(grads):
        pure_p, pure_state = opt.update(g, pure_state, pure_p)
        p, state = opt.update_inplace(g, state, p)
        if t in (3, 5):  # windows 2 and 3 closed: the merge of the window before queued with the job
            assert isinstance(state["pending"]["result"], Future)
        _assert_same_tree(offload.element_state(state), offload.element_state(pure_state))
        _assert_same_tree(p, pure_p)


def test_a_window_on_the_landed_windows_columns_reads_no_host_column(monkeypatch):
    """A donated ``delay=1`` window end without reselection hands the job the landed window's
    buffers, holding the job's columns already: after the first window's job (which has no
    landed window) no column of the host master or slots is gathered, and every step still
    equals ``update`` bit for bit."""
    zf = importlib.import_module("offload.zenflow")
    read: list[int] = []

    def gather_columns(src, cols, out=None, queue=None):  # the real gather, its source noted
        read.append(id(src))
        return offload.column_copy.gather_columns(src, cols, out=out, queue=queue)

    monkeypatch.setattr(zf, "gather_columns", gather_columns)
    gen = torch.Generator().manual_seed(41)
    params = {"w": torch.randn(5, 8, dtype=F64, generator=gen)}
    grads = [{"w": torch.randn(5, 8, dtype=F64, generator=gen)} for _ in range(10)]
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=100, delay=1, overlap=True)
    pure_state, pure_p, state, p = _twins(opt, params)
    host = {id(t) for f, t in state["host"]["w"].items() if f != "count"}
    for t, g in enumerate(grads, start=1):
        pure_p, pure_state = opt.update(g, pure_state, pure_p)
        p, state = opt.update_inplace(g, state, p)
        offload.materialize(state)  # the window job has run
        if t == 2:
            assert host & set(read)  # the first window gathered its inputs from the host tensors
            read.clear()
        _assert_same_tree(p, pure_p)
    assert not host & set(read)
    _assert_same_tree(offload.materialize(state), offload.materialize(pure_state))


def test_a_donated_reselection_lays_the_new_selection_out_in_the_device_tensors_themselves():
    """Reselections every window (the column scores cycle, so the selection changes) keep the
    device master and slots in the same storage, and every step equals ``update``."""
    params, grads = _weights_and_grads(47, F64, rows=4, cols=9, out=3, steps=12, period=3)
    opt = offload.zenflow(INNER, topk_ratio=0.34, update_interval=2, select_interval=2, delay=1, overlap=True)
    pure_state, pure_p, state, p = _twins(opt, params)
    storage = None
    changed = 0
    for t, g in enumerate(grads, start=1):
        pure_p, pure_state = opt.update(g, pure_state, pure_p)
        before = state["selected"]
        p, state = opt.update_inplace(g, state, p)
        ptrs = {(k, f): v.data_ptr() for k, d in state["device"].items() if k in state["host"] for f, v in d.items()}
        storage = storage or ptrs
        assert ptrs == storage, t
        changed += before is not None and not torch.equal(before["w"], state["selected"]["w"])
        _assert_same_tree(p, pure_p)
    assert changed >= 2
    _assert_same_tree(offload.materialize(state), offload.materialize(pure_state))


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_carried_window_writes_no_host_column(donate, overlap):
    """``delay=1``, no reselection: from the second window end on, each window takes the landed
    window's master and slots as its inputs (carried), so the host tensors' master and slots are
    never written again (they still hold the initial values), while every step, the merged
    element state and the checkpoint form equal those of the same run without donation and
    overlap."""
    gen = torch.Generator().manual_seed(43)
    params = {"w": torch.randn(5, 8, dtype=F64, generator=gen)}
    grads = [{"w": torch.randn(5, 8, dtype=F64, generator=gen)} for _ in range(10)]
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=100, delay=1, overlap=overlap)
    plain = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=100, delay=1, overlap=False)
    pure_state, pure_p, state, p = _twins(plain, params)
    update = opt.update_inplace if donate else opt.update
    for t, g in enumerate(grads, start=1):
        pure_p, pure_state = plain.update(g, pure_state, pure_p)
        p, state = update(g, state, p)
        state = offload.materialize(state) if t % 3 == 0 else state  # a state saved now and then
        if t == 2:
            first = {f: v.clone() for f, v in state["host"]["w"].items() if f != "count"}
        uns = state["unselected"]["w"]
        if t >= 2:
            assert all(torch.equal(state["host"]["w"][f][:, uns], first[f][:, uns]) for f in first), t
        _assert_same_tree(p, pure_p)
        _assert_same_tree(offload.element_state(state), offload.element_state(pure_state))
    assert torch.equal(first["master"], params["w"])
    _assert_same_tree(offload.materialize(state), offload.materialize(pure_state))


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_reselection_carries_the_landed_window_on_without_writing_a_host_column(donate, overlap):
    """``delay=1``, a reselection every other window: at a reselection the landed window covers
    every unselected column, so the columns entering the selection take their update from it and
    the rest carry it on into the next window: the host tensors' master and slots of those
    columns are not written then (before, the whole landed window was merged into them on the
    loop), while every step, the merged element state and the checkpoint form equal those of
    the same run without donation and overlap."""
    gen = torch.Generator().manual_seed(44)
    params = {"w": torch.randn(5, 12, dtype=F64, generator=gen)}
    grads = [{"w": torch.randn(5, 12, dtype=F64, generator=gen) * (1 + t % 3)} for t in range(12)]
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=4, delay=1, overlap=overlap)
    plain = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=4, delay=1, overlap=False)
    pure_state, pure_p, state, p = _twins(plain, params)
    update = opt.update_inplace if donate else opt.update
    carried_on = 0
    for t, g in enumerate(grads, start=1):
        pure_p, pure_state = plain.update(g, pure_state, pure_p)
        before = {f: v.clone() for f, v in state["host"]["w"].items() if f != "count"}
        old_uns = state["unselected"]["w"] if state["unselected"] else None
        p, state = update(g, state, p)
        if t % 4 == 0:  # a reselection; the window landing now (from step t - 2) covered every unselected column
            later = old_uns[~torch.isin(old_uns, state["selected"]["w"])]
            assert 0 < later.numel() < old_uns.numel(), t  # some columns entered the selection
            assert all(torch.equal(state["host"]["w"][f][:, later], before[f][:, later]) for f in before), t
            carried_on += 1
        _assert_same_tree(p, pure_p)
        _assert_same_tree(offload.element_state(state), offload.element_state(pure_state))
    assert carried_on == 3
    _assert_same_tree(offload.materialize(state), offload.materialize(pure_state))


@pytest.mark.parametrize("delay, overlap", [(1, True), (1, False), (0, True)])
def test_materialized_state_resumes_bit_for_bit(delay, overlap):
    gen = torch.Generator().manual_seed(19)
    params = {"w": torch.randn(3, 6, dtype=F64, generator=gen), "b": torch.randn(3, dtype=F64, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=F64, generator=gen) * 2 for k, v in params.items()} for _ in range(10)]
    opt = offload.zenflow(INNER, topk_ratio=0.34, update_interval=3, select_interval=3, delay=delay, overlap=overlap)
    straight, straight_state = steps(opt, params, grads)

    state, p = opt.init(params), params
    for g in grads[:4]:  # window 1 closed at step 3; with delay=1 its result is still pending
        p, state = opt.update(g, state, p)
    buf = io.BytesIO()
    torch.save({"state": offload.materialize(state), "params": p}, buf)  # plain data only
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    state, p = saved["state"], saved["params"]
    if delay == 1:
        assert state["pending"] is not None and not isinstance(state["pending"]["result"], Future)
    for t, g in enumerate(grads[4:], 4):
        p, state = opt.update(g, state, p)
        _assert_same_tree(p, straight[t])
    _assert_same_tree(offload.materialize(state), offload.materialize(straight_state))


# --- metrics ---------------------------------------------------------------------------------


def test_metrics_count_the_bytes_moved_each_way():
    params = {"w": torch.zeros(3, 5), "b": torch.zeros(3)}  # float32: 4 bytes, 3 rows
    grads = {"w": torch.arange(15.0).reshape(3, 5), "b": torch.ones(3)}
    opt = offload.zenflow(INNER, topk_ratio=0.4, update_interval=2, select_interval=100, delay=0)
    state, p = opt.init(params), params
    p, state = opt.update(grads, state, p)
    m = state["metrics"]
    assert m["h2d_bytes"] == 2 * 3 * 3 * 4  # first selection: 2 columns x (master, mu, nu) to the device
    assert m["d2h_bytes"] == 3 * 3 * 4  # 3 unselected gradient columns
    p, state = opt.update(grads, state, p)
    m = state["metrics"]
    assert (m["d2h_bytes"], m["h2d_bytes"]) == (3 * 3 * 4, 3 * 3 * 4)  # window closes: 3 columns back
    assert m["host_wait_s"] >= 0.0
    assert m["host_loop_s"] > 0.0  # the gather into the window sum and the scatter back are timed too


# --- "auto" ----------------------------------------------------------------------------------


def test_auto_fires_after_coherence_steps_on_consistent_gradients():
    cfg = AutoConfig(coherence=3.0, min_interval=1, max_interval=10)
    g2 = 4.0  # |g|^2 of the same gradient every step: |S|^2 = n^2 |g|^2, Q = n |g|^2
    fired = [n for n in range(1, 11) if host_update_due(n, n * n * g2, n * g2, cfg)]
    assert fired[0] == 3


def test_auto_fires_at_max_interval_on_pure_noise():
    cfg = AutoConfig(coherence=2.0, min_interval=1, max_interval=5)
    fired = [n for n in range(1, 8) if host_update_due(n, n * 1.0, n * 1.0, cfg)]  # |S|^2 = Q
    assert fired[0] == 5


def test_auto_respects_min_interval():
    cfg = AutoConfig(coherence=1.0, min_interval=3, max_interval=5)
    assert not host_update_due(2, 100.0, 1.0, cfg) and host_update_due(3, 100.0, 1.0, cfg)


@pytest.mark.parametrize(
    "norm_sq_of_sum, sum_of_norm_sq, fires",
    [(0.0, 0.0, True), (math.inf, 1.0, True), (1.0, math.inf, False), (math.nan, 1.0, False), (1.0, math.nan, False),
     (math.inf, math.inf, True)],
)
def test_auto_fire_rule_never_divides_by_zero_and_handles_non_finite(norm_sq_of_sum, sum_of_norm_sq, fires):
    cfg = AutoConfig(coherence=2.0, min_interval=1, max_interval=4)
    assert host_update_due(2, norm_sq_of_sum, sum_of_norm_sq, cfg) is fires
    assert host_update_due(4, norm_sq_of_sum, sum_of_norm_sq, cfg)  # max_interval bounds every case


@pytest.mark.parametrize(
    "captured, best, due",
    [(0.0, 0.0, False), (1.0, 1.0, False), (0.89, 1.0, True), (0.9, 1.0, False), (math.nan, 1.0, False),
     (0.0, math.inf, True)],
)
def test_auto_reselect_rule(captured, best, due):
    assert reselect_due(captured, best, AutoConfig(coverage=0.9)) is due


def test_auto_update_interval_fires_inside_zenflow():
    """Constant gradients are perfectly coherent: with coherence 2 every window is 2 steps long."""
    params = {"w": torch.zeros(2, 4, dtype=F64)}
    g = {"w": torch.tensor([[5.0, 1.0, 1.0, 1.0], [5.0, 1.0, 1.0, 1.0]], dtype=F64)}
    opt = offload.zenflow(sgd(lr=0.1), topk_ratio=0.25, update_interval="auto", select_interval=100, delay=0,
                          auto=AutoConfig(coherence=2.0, max_interval=8))
    state, p = opt.init(params), params
    moved = []
    for _ in range(6):
        old = p["w"][:, 1].clone()
        p, state = opt.update(g, state, p)
        moved.append(not torch.equal(p["w"][:, 1], old))
    assert moved == [False, True] * 3
    assert torch.allclose(p["w"][:, 1], torch.full((2,), -0.3, dtype=F64))  # 3 host updates of lr * mean


def test_auto_select_interval_reselects_when_the_selection_goes_stale():
    params = {"w": torch.zeros(1, 3, dtype=F64)}
    opt = offload.zenflow(sgd(lr=0.1), topk_ratio=0.34, update_interval=1, select_interval="auto", delay=1,
                          auto=AutoConfig(coverage=0.9))
    state, p = opt.init(params), params
    schedule = [[3.0, 1.0, 1.0], [3.0, 2.9, 1.0], [1.0, 3.0, 1.0], [1.0, 3.0, 2.0]]
    seen = []
    for row in schedule:
        p, state = opt.update({"w": torch.tensor([row], dtype=F64)}, state, p)
        seen.append(state["selected"]["w"].tolist())
    # 9 >= 0.9 * 9 keeps column 0 (step 2 captures 9 of 9); step 3 captures 1 of 9: reselect
    assert seen == [[0], [0], [1], [1]]


# --- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(topk_ratio=1.5), "topk_ratio"), (dict(delay=2), "delay"), (dict(reduce="max"), "reduce"),
     (dict(update_interval=0), "update_interval"), (dict(select_interval="sometimes"), "select_interval"),
     (dict(update_interval=4, select_interval=6), "multiple"), (dict(auto=AutoConfig(min_interval=0)), "auto")],
)
def test_invalid_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        offload.zenflow(INNER, **kwargs)


def test_inner_optimizers_with_non_elementwise_state_are_rejected():
    from fsdpx.optim import Optimizer

    weird = Optimizer(lambda p: {"count": 0, "lr_scale": 1.0}, INNER.update)
    with pytest.raises(TypeError, match="elementwise"):
        offload.zenflow(weird).init({"w": torch.zeros(2, 2)})


def test_default_inner_is_adamw():
    params = {"w": torch.zeros(2, 3)}
    state = offload.zenflow().init(params)
    assert state["slots"] == ["mu", "nu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
@pytest.mark.parametrize("delay, overlap", [(1, True), (0, True), (1, False)])
def test_cuda_params_keep_the_host_on_cpu_and_donated_equals_pure(delay, overlap):
    """With parameters on a GPU: the returned parameters and the device state stay there, the
    host state stays on the CPU, the donated update (window sum added in place through the pinned
    copy) equals the pure one bit for bit, and both follow the CPU run closely (the device's
    columns run torch's CUDA kernels, not the CPU's compiled loop)."""
    gen = torch.Generator().manual_seed(29)
    cpu = {"w": torch.randn(5, 12, generator=gen), "v": torch.randn(12, 4, generator=gen),
           "b": torch.randn(5, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) * (1 + t % 3) for k, v in cpu.items()} for t in range(14)]
    opt = offload.zenflow(INNER, topk_ratio=0.25, update_interval=2, select_interval=4, delay=delay, overlap=overlap)
    dev = torch.device("cuda")
    on_dev = {k: v.to(dev) for k, v in cpu.items()}
    pure_state, pure_p = opt.init(on_dev), on_dev
    state, p = opt.init({k: v.clone() for k, v in on_dev.items()}), {k: v.clone() for k, v in on_dev.items()}
    ref_state, ref = opt.init(cpu), cpu
    for g in grads:
        g_dev = {k: v.to(dev) for k, v in g.items()}
        pure_p, pure_state = opt.update(g_dev, pure_state, pure_p)
        p, state = opt.update_inplace(g_dev, state, p)
        ref, ref_state = opt.update(g, ref_state, ref)
        assert all(t.device.type == "cuda" for t in p.values())
        _assert_same_tree(p, pure_p)
        for k in ref:
            torch.testing.assert_close(p[k].cpu(), ref[k], rtol=1e-5, atol=1e-6)
    state = offload.materialize(state)
    assert all(t.device.type == "cpu" for h in state["host"].values() for t in h.values())
    assert all(t.device.type == "cpu" for t in state["acc"].values())
    assert state["device"]["b"]["master"].device.type == "cuda"
    _assert_same_tree(state, offload.materialize(pure_state))
