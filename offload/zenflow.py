"""ZenFlow: update the important columns on the device at once, the rest on the host, later.

``zenflow(inner)`` wraps an elementwise optimizer (``fsdpx.optim.adamw`` or ``sgd``). Each 2-D
weight ``[out, in]`` has a set of *selected* columns (``offload.columns``): every step the device
applies ``inner`` to them with that step's gradient. The other columns' gradients are summed on
the host over a *window* of steps; when the window closes the host applies ``inner`` once to
them with the window's mean (``reduce="mean"``) or sum (``reduce="sum"``). Parameters that are
not 2-D are updated on the device every step.

Semantics
---------
* **One state per element.** Each element has one fp32 (or wider) master value, one set of
  ``inner`` moments and one update count (shared by its column, which is updated as a whole).
  The selected columns' share lives on the device, the rest on the host; moving a column hands
  its state over, never resets it. Bias correction uses the column's own count: the number of
  updates actually applied to it (one per device step while selected, one per window while not).
* **Warm-up.** With ``full_warm_up_rounds=N`` the first ``N`` steps apply ``inner`` to every
  element with that step's gradient, as plain ``inner`` does (DeepSpeed's
  ``full_warm_up_rounds``): the 2-D weights on the host, where their whole state lives until
  the first selection, the rest on the device. No column is selected and no window is open
  during warm-up; ZenFlow's schedule (first selection, windows, reselections) starts at step
  ``N + 1`` as it starts at step 1 without warm-up, with every count at ``N``
  (``tests/test_zenflow_knobs.py::test_warm_up_rounds_equal_plain_adamw_bit_for_bit``). The
  2-D weights' warm-up runs ``inner`` on the host, so with a GPU its bits are those of ``inner``
  on the host (as ZeRO-Offload's are), not of ``inner`` on the GPU; each warm-up step moves the
  whole 2-D gradient down and the 2-D weights up, synchronously.
* **Windows.** A window closes after ``update_interval`` steps (or by the ``"auto"`` rule of
  ``offload.auto``). The host update of window ``w`` reads the state left by window ``w-1``.
* **delay** alone fixes what the parameters hold. ``delay=0``: window ``w``'s host result is in
  the parameters returned at the end of window ``w``. ``delay=1``: it is in those returned at
  the end of window ``w+1``, so the host computes while the device runs window ``w+1``. The
  master/moment chain of every element is the same for both delays; only visibility differs.
* **overlap** only chooses where the host work of ``delay=1`` runs (the background thread of
  ``offload.worker``, the worker process of ``offload.host_process`` with ``host_process=True``,
  or inline); it never changes a bit. ``delay=0`` needs the host result at
  once, so its host work always runs inline.
* **Reselection** happens only when a window closes: with fixed intervals at the end of every
  step ``t`` with ``t % select_interval == 0`` (``select_interval`` must be a multiple of
  ``update_interval``); with ``update_interval="auto"`` at the first window end at least
  ``select_interval`` steps after the previous selection; with ``select_interval="auto"`` per
  weight by the coverage rule of ``offload.auto``. The new selection is the top-k of the column
  scores of that step's gradient. The first selection is made at step 1 (``N + 1`` after a
  warm-up of ``N`` steps) from that step's gradient, before its update; every interval counts
  from there.
* **A column entering the selection while its host update would be in flight** (``delay=1``)
  gets that update (of the window just closed) computed and applied at once, before the device
  touches the column; columns staying unselected keep ``delay=1``. It is the only exception to
  the ``delay=1`` visibility rule and it costs a synchronous host update of the entering columns
  only (``tests/test_zenflow.py::test_entering_column_gets_its_closing_window_applied_first``).

* **Freezing.** ``grads`` may name a subset of the parameters (a freezing schedule,
  ``fsdpx.optim.freezing``; ``Optimizer.partial_grads``): the others are frozen at this step. A
  frozen parameter gets no gradient, no device update, no window sum, no selection or
  reselection, and no new host update; its moments and counts stay as they are, so a weight
  unfrozen mid-run continues from them (zeros and count 0 if it never trained, as
  ``update_trainable`` does without offload). A weight's first selection is made at its first
  trained step, from that step's gradient; reselections stay on the run's schedule. A window's
  host update of a weight covers the steps it trained in that window: the mean divides by their
  number. Host results of steps it trained that land while it is frozen (``delay=1``, or a
  window it left before its end) go into its master and moments, and into the parameter only
  when it trains again (before that step's update): a frozen parameter's value never changes.
  With ``topk_ratio=1``, or ``delay=0`` and ``update_interval=1``, this is ``inner`` under the
  same schedule bit for bit (``tests/test_offload_freezing.py``).

Worked example: ``update_interval=4``, one selected column ``s`` and one unselected column ``u``
(no reselection). ``D_t`` = ``inner`` applied at steps 1..t with each step's gradient;
``H_1 = inner(p0, mean(g_1..g_4))``, ``H_2 = inner(H_1, mean(g_5..g_8))`` (count 2)::

    after step        1    2    3    4    5    6    7    8    ... 12
    s                D_1  D_2  D_3  D_4  D_5  D_6  D_7  D_8
    u, delay=0       p0   p0   p0   H_1  H_1  H_1  H_1  H_2
    u, delay=1       p0   p0   p0   p0   p0   p0   p0   H_1  ... H_2

(``tests/test_zenflow.py::test_worked_example_from_the_docstring``.)

Synchronisation points: the loop waits for the host only (a) when a window closes with
``delay=0`` (by definition), (b) when a window closes with ``delay=1``, for the previous window's
host work, which has had a whole window to finish, plus the entering columns' update at a
reselection, (c) in ``materialize`` / ``element_state`` / ``master_params``. Every step also
copies the unselected columns' gradient to the host and adds it to the window sum there, and a
reselection reads the new column indices back to the host.

What the loop thread does itself (``update_inplace``, ``overlap=True``, a fixed
``update_interval``): on CUDA it gathers the unselected columns on the device and enqueues their
copy into a pinned buffer on a copy stream of its own (``offload.worker.copy_stream``: the loop's
next kernels do not wait for it); the background thread waits for the copy and adds it to the window
sum (``_add_to_window_sum``), jobs in submission order, so the same adds happen in the same
order and the window job, queued after them, sees them all. The state then carries the add
job's ``Future`` under ``"window_sum_job"`` until it is waited for (``materialize`` drops it).
On ``cpu`` the loop reads each gradient once: one pass over its rows gathers the selected
columns for the device update and adds the unselected ones into the window sum
(``offload.column_copy.split_columns_``), or, in a donated state, the whole row into a window
sum of the weight's full width, a streaming loop about twice as fast, of which only the
unselected columns are ever read (``split_wide_``: the window's job compacts them in place,
``materialize`` hands out those columns alone); every weight's pass is queued and run together, each
weight's rows split over the loop's intra-op threads (``offload.column_copy.ColumnCopies``), as
are the writes of the selected columns into the parameters. The background thread runs its torch
operations and column copies on one thread (the loop's own fill the cores;
``offload.worker.submit``). At a ``delay=1``
window end without reselection the loop writes only the landed window's counts and the
parameters' columns (in the same pass over each parameter as this step's selected columns:
``offload.column_copy.scatter_two_columns_``). Where the next window updates the landed
window's very columns (no reselection since), it takes the landed master and slots as its
inputs and updates them in place: they are never written into the host tensors, nor gathered
from them (*carried*, ``_carried``). Other weights' landed master and slots are written into
the host tensors by the background thread just before the next window's deferred gathers
(``_merge_then``). A reselection waits for the queued adds; where the landed window covered
every unselected column, the entering columns' update reads the landed tensors and the rest
carry on (the next window's job compacts the landed tensors and the window sum in place:
``offload.column_moves.compact_columns_``); a same-size selection is handed over in one pass
over each row (``offload.column_moves.handover_columns_``). Any other reselection, and
``delay=0``, merges on the loop.

State is plain data (dicts, lists, ints, floats, tensors): per 2-D weight, ``host[name]`` holds
the full-shape master, ``inner`` slots and per-column ``count`` (authoritative for unselected
columns, but for the master and slots of columns an in-flight window carries on from the
landed one: its result replaces them when it lands, and nothing reads them before),
``device[name]`` the ``[out, n_selected]`` master and slots of the selected columns,
``selected``/``unselected`` the sorted column indices and ``acc`` the open window's gradient
sum (``[out, n_unselected]``; a donated CPU state's is ``[out, in]``, its unselected columns
the sum); other parameters have their full state in ``device[name]``. Read it merged with
``element_state``. It may hold one ``Future``, the in-flight host window of ``delay=1,
overlap=True``: ``materialize(state)`` waits for it and returns a plain-data state that continues
bit for bit like the original (so it can be saved, in-flight window included). ``update`` is
pure: the same inputs give the same outputs bit for bit, except the clock reading
``state["metrics"]["host_wait_s"]``; its background job only reads copies it owns and finished
host results (which nothing writes).
``update_inplace`` (a donated state) gives the same bits, writing the window sum, the host state
and the parameters' columns in place; its background job gathers the columns it updates from the
host tensors themselves, which nothing writes until the next window end has resolved the job.
A donated fixed-window state also reuses its host buffers instead of allocating each window:
two window sums per weight (a window opens into the one of the window before last, whose job
the last window end resolved; the state keeps them under ``"window_sum_buffers"``, which
``materialize`` drops); the background job divides its window sum in place, gathers its
columns into the landed window's tensors (free once merged; taken as they are where they
hold its columns) and updates them in place with
``inner.update_inplace`` where its columns share one count (mixed counts take
``inner.update_columns(..., inplace=True)``, in place too for AdamW); a reselection writes the leaving columns
into the host tensors (``tests/test_zenflow.py::
test_reused_window_buffers_are_never_written_while_a_held_job_reads_them``).

``state["metrics"]`` describes the last step: ``host_wait_s`` (seconds the call spent blocked on
host optimizer work), ``host_loop_s`` (seconds the call itself spent on host-side bookkeeping:
gathering the unselected columns' gradient into the window sum (on ``cpu`` in the same pass as
the selected columns' gather for the device update), copying a window's inputs for
the host job, scattering a finished window into the host state and the parameters, handing
state over at a reselection; with a GPU these are copies and small kernels, here they share the
CPU with the model), ``d2h_bytes`` and ``h2d_bytes`` (bytes of gradients, states and
parameters moved each way).

Under DP, pass the noised gradient: selection and the ``"auto"`` rules read only ``grads``.

**Row shards.** Under ZeRO-2/3 each rank updates a block of rows of every weight (``torch.chunk``
of dim 0) and ``update`` sees only that block. Everything ZenFlow decides from the gradient is a
sum over rows: the column scores (first selection, reselection, the ``"auto"`` coverage rule)
and the two ``"auto"`` window statistics ``|S|^2`` and ``Q``. ``combine_scores(name, local)``
turns this rank's row sums of weight ``name`` (a float64 vector) into the sums over every rank's
rows (``offload.sharded_scores`` does it with one all-reduce). With it every rank makes the same
decisions as one unsharded run; rows are never mixed, so each rank's host state, accumulators and
moments cover its own rows only. Cost per 2-D weight: ``in`` float64 values at each selection and,
with ``update_interval="auto"``, 2 values every step.

Exactness note: ``inner`` is always called with a Python ``int`` count; columns with different
counts are updated in groups of equal count. (A tensor count would go through vectorised
``torch.pow``, whose bits depend on an element's position in the vector, so the same column
would round differently in slices of different widths.)
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from fsdpx.optim import Optimizer, Params, adamw
from offload import worker
from offload.auto import AutoConfig, check_config, host_update_due, reselect_due
from offload.column_copy import (ColumnCopies, gather_columns, scatter_columns_, scatter_two_columns_,
                                 split_columns_, split_wide_)
from offload.column_moves import compact_columns_, handover_columns_
from offload.columns import column_scores, complement, num_selected, select_columns
from offload.worker import HOST, nbytes, to_device, to_host

State = dict[str, Any]
CombineScores = Callable[[str, Tensor], Tensor]
"""``(weight name, this rank's row sums) -> the sums over every rank's rows`` (float64 vectors):
with columns split over ranks too, the whole vector of every column's sum."""
CombineStats = Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]]
"""``{weight name: this rank's float64 vector of sums over its block}`` (the weights it holds and
trains) ``-> {weight name: the sums over every rank's blocks}`` for every weight of the model, in
the unsharded run's order (an all-reduce: ``offload.layout_stats``)."""
LocalColumns = Callable[[str], Tensor]
"""``weight name -> sorted LongTensor``: the columns this rank holds, as indices into
``CombineScores``' vector (its own columns in order)."""
_X = "x"  # the one key of the single-parameter dicts handed to ``inner``


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The master copy's dtype: float32, or the parameter's dtype if wider."""
    return torch.promote_types(dtype, torch.float32)


# --- the elementwise core --------------------------------------------------------------------


def _inner_step(inner: Optimizer, slot_names: list[str], master: Tensor, grad: Tensor,
                slots: dict[str, Tensor], count: int, inplace: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """``inner`` on one tensor whose elements all have ``count`` updates behind them. With
    ``inplace`` (``master`` and ``slots`` are the caller's to overwrite) ``inner.update_inplace``
    writes the result into them where ``inner`` has one: the same bits."""
    sub = {"count": count, **{s: ({_X: slots[s]} if s in slots else {}) for s in slot_names}}
    fn = inner.update_inplace if inplace and inner.update_inplace is not None else inner.update
    new_p, new_state = fn({_X: grad}, sub, {_X: master})
    return new_p[_X], {s: new_state[s][_X] for s in slots}


def _update_columns(inner: Optimizer, slot_names: list[str], master: Tensor, grad: Tensor,
                    slots: dict[str, Tensor], counts: Tensor, inplace: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """``inner`` on ``[out, n]`` column slices; ``counts[j]`` (host) is column ``j``'s count.
    Columns with different counts take ``inner.update_columns`` (one pass; with ``inplace``
    written into ``master`` and ``slots`` where it can) when it applies, else one ``inner`` call
    per distinct count. ``inplace``: as in :func:`_inner_step`."""
    values = torch.unique(counts).tolist()
    if len(values) == 1:
        return _inner_step(inner, slot_names, master, grad, slots, int(values[0]), inplace)
    fast = (inner.update_columns(master, grad, slots, counts, inplace=inplace) if inner.update_columns is not None
            else None)
    if fast is not None:
        return fast
    out_master = torch.empty_like(master)
    out_slots = {s: torch.empty_like(t) for s, t in slots.items()}
    for v in values:
        pos = (counts == v).nonzero().squeeze(1).to(master.device)
        m, sl = _inner_step(inner, slot_names, master.index_select(1, pos), grad.index_select(1, pos),
                            {s: t.index_select(1, pos) for s, t in slots.items()}, int(v))
        out_master.index_copy_(1, pos, m)
        for s, t in sl.items():
            out_slots[s].index_copy_(1, pos, t)
    return out_master, out_slots


def _host_window(inner: Optimizer, slot_names: list[str], divisor: int | dict[str, int], inputs: dict[str, dict], *,
                 owned: bool = False, into: dict[str, dict] | None = None) -> dict[str, dict]:
    """The host update of one window: pure, on tensors the job owns. ``inputs[k]`` holds the
    columns ``cols``, their window gradient sum ``grad``, ``master``, slots and ``count``.
    ``divisor``: what the sum is divided by, or per weight (a weight frozen for part of the
    window divides by the steps it trained).

    ``owned`` (the donated path): the job may overwrite ``grad`` (divided in place) and the
    master and slots it gathers (updated in place by ``inner.update_inplace`` where the columns
    share one count); ``into[k]`` offers buffers to gather them into (the landed window's
    result, already merged). The same bits either way."""
    out = {}
    for k, job in inputs.items():
        job = _gather_deferred(job, (into or {}).get(k, {}))
        slots = {s: t for s, t in job.items() if s not in ("cols", "grad", "master", "count")}
        grad = job["grad"]
        by = divisor[k] if isinstance(divisor, dict) else divisor
        if by != 1:
            grad = grad.div_(by) if owned else grad / by
        master, new_slots = _update_columns(inner, slot_names, job["master"], grad, slots, job["count"], owned)
        out[k] = {"cols": job["cols"], "master": master, **new_slots, "count": job["count"] + 1}
    return out


# --- state plumbing (out of place; in place on a donated state) ------------------------------


def _merge_host_result(result: dict[str, dict], host: dict, inplace: bool = False, part: str = "all",
                       counts_only: frozenset[str] = frozenset()) -> None:
    """Scatter a finished host window into ``host``: rebinding its entries to new tensors, or,
    with ``inplace`` (a donated state), writing into the host tensors themselves. ``part``:
    ``"all"``, ``"count"`` (the per-column counts only) or ``"state"`` (master and slots only);
    a weight in ``counts_only`` gets its counts at most."""
    copies = ColumnCopies()
    for k, r in result.items():
        this = part if k not in counts_only else {"all": "count", "count": "count", "state": None}[part]
        if this is None:
            continue
        h = dict(host[k])
        for f, v in r.items():
            if (this == "count") != (f == "count") and this != "all":
                continue
            if f == "count":
                h[f] = h[f].index_copy_(0, r["cols"], v) if inplace else h[f].index_copy(0, r["cols"], v)
            elif f != "cols":
                h[f] = scatter_columns_(h[f] if inplace else h[f].clone(), r["cols"], v, queue=copies)
        host[k] = h
    copies.run()


def _apply_host_result(result: dict[str, dict], host: dict, params: Params, metrics: dict,
                       inplace: bool = False, part: str = "all", *, frozen: frozenset[str] = frozenset(),
                       stale: dict[str, Tensor] | None = None, held: dict[str, tuple[Tensor, Tensor]] | None = None,
                       carried: Mapping[str, dict] | None = None) -> None:
    """Write a finished host window into the host state (``part`` of it, as in
    :func:`_merge_host_result`) and the parameters: rebinding entries of the caller's fresh
    ``host`` / ``params`` dicts, or with ``inplace`` (donated state and parameters) writing into
    their tensors. A weight in ``frozen`` keeps its parameter: its columns are added to
    ``stale[k]``, written from the master when it trains again (:func:`_write_stale`).
    ``held[k]``: ``(columns, values)`` of weight ``k`` not written yet (its selected columns'
    step, disjoint from the window's), written in the same pass and removed from ``held``.
    ``carried``: weights whose master and slots go on elsewhere (a landed window the next
    window takes as its inputs: :func:`_carried`; the entering columns' update, which the
    handover takes to the device): only their counts go into ``host``."""
    _merge_host_result(result, host, inplace, part, counts_only=frozenset(carried or ()))
    copies = ColumnCopies()
    for k, r in result.items():
        cols = r["cols"]
        if k in frozen:
            stale[k] = cols if k not in stale else torch.unique(torch.cat([stale[k], cols]))
            continue
        p = params[k]
        value = r["master"].to(p.dtype)
        metrics["h2d_bytes"] += nbytes(value)
        p = p if inplace else p.clone()
        if held and k in held:
            idx, step_value = held.pop(k)
            params[k] = scatter_two_columns_(p, cols.to(p.device), to_device(value, p.device), idx, step_value,
                                             queue=copies)
        else:
            params[k] = scatter_columns_(p, cols.to(p.device), to_device(value, p.device), queue=copies)
    copies.run()


def _write_stale(k: str, cols: Tensor, h: dict, params: Params, metrics: dict, inplace: bool) -> None:
    """Write weight ``k``'s ``cols`` (host indices, unselected) from its host master into its
    parameter: the host windows that landed while it was frozen, the same bits
    :func:`_apply_host_result` would have written then."""
    p = params[k]
    value = gather_columns(h["master"], cols).to(p.dtype)
    metrics["h2d_bytes"] += nbytes(value)
    params[k] = scatter_columns_(p if inplace else p.clone(), cols.to(p.device), to_device(value, p.device))


def _handover(h: dict, d: dict, old: Tensor, new: Tensor, metrics: dict,
              inplace: bool = False, queue: ColumnCopies | None = None,
              entering: dict[str, Tensor] | None = None) -> tuple[dict, dict]:
    """Move the state of columns leaving the selection to the host and of columns entering it to
    the device. ``old`` and ``new`` are sorted host index tensors. Returns ``(host, device)``.
    ``entering``: the entering columns' master and slots (in order), where they come from their
    closing window's update rather than the host tensors (``delay=1``: not written there).
    ``inplace`` (a donated state): the leaving columns are written into the host tensors
    themselves, not into copies of them (a window job in flight reads only unselected columns,
    never these), and a selection of the same size is laid out in the device tensors themselves
    (after the step's writes of them into the parameters), so that a reselection allocates no
    lasting memory (a new ``[rows, n_selected]`` tensor per slot each time grew the host heap
    now and then: page faults). With the device the host itself, that same-size handover is one
    pass over each row of both tensors (``offload.column_moves.handover_columns_``, queued on
    ``queue`` when given: written when it runs)."""
    given, leaving, entering = entering, ~torch.isin(old, new), ~torch.isin(new, old)
    dev = d["master"].device
    if inplace and dev.type == HOST.type and old.numel() == new.numel() == d["master"].shape[1]:
        for f, t in d.items():
            width = t.shape[0] * t.element_size()
            metrics["d2h_bytes"] += int(leaving.sum()) * width
            metrics["h2d_bytes"] += int(entering.sum()) * width
            handover_columns_(h[f], t, old, new, None if given is None else given[f], queue=queue)
        return dict(h), dict(d)
    kept_old, kept_new = (~leaving).nonzero().squeeze(1).to(dev), (~entering).nonzero().squeeze(1).to(dev)
    new_h, new_d = dict(h), {}
    for f, t in d.items():  # column copies by offload.column_copy: the bits of index_select / index_copy
        if leaving.any():
            v = to_host(gather_columns(t, leaving.nonzero().squeeze(1).to(dev)))
            metrics["d2h_bytes"] += nbytes(v)
            new_h[f] = scatter_columns_(h[f] if inplace else h[f].clone(), old[leaving], v)
        same_size = inplace and t.shape[1] == new.numel()
        out = t if same_size else torch.empty((t.shape[0], new.numel()), dtype=t.dtype, device=dev)
        scatter_columns_(out, kept_new, gather_columns(t, kept_old))  # the kept columns read before any write
        if entering.any():
            v = to_device(gather_columns(h[f], new[entering]) if given is None else given[f], dev)
            metrics["h2d_bytes"] += nbytes(v)
            scatter_columns_(out, entering.nonzero().squeeze(1).to(dev), v)
        new_d[f] = out
    return new_h, new_d


def _carried(landed: dict[str, dict] | None, later_cols: Mapping[str, Tensor], unselected: Mapping[str, Tensor],
             frozen: frozenset[str]) -> dict[str, dict]:
    """The weights whose landed window result the next windows take as their inputs instead of
    the host tensors: a weight that trains at this window end and whose next window updates
    exactly the landed window's columns (``delay=1``, no reselection of it since), or, at a
    reselection, whose landed window covered every unselected column: the columns entering the
    selection take theirs for their update now, the rest carry on in the next window (its
    inputs are the landed tensors compacted in place: :func:`_job_inputs`). Their master and
    slots are never written into the host tensors, whose copy of those columns is then older
    than the in-flight window's result and read by nobody: the result replaces it when it lands
    (``tests/test_zenflow.py::test_a_carried_window_writes_no_host_column``,
    ``::test_a_reselection_carries_the_landed_window_on_without_writing_a_host_column``). A
    frozen weight's landed result is merged as usual: it waits in the master for the weight to
    train again (:func:`_write_stale`)."""
    if not landed:
        return {}
    return {k: r for k, r in landed.items()
            if k not in frozen and k in later_cols and (torch.equal(r["cols"], later_cols[k]) or (
                later_cols[k].numel() and torch.equal(r["cols"], unselected[k])))}


def _job_inputs(h: dict, acc: Tensor, unselected: Tensor, cols: Tensor, *, defer: bool = False,
                carry: dict | None = None, queue: ColumnCopies | None = None) -> dict:
    """What the host update of ``cols`` reads: copies owned by the job, or with ``defer`` the
    host tensors themselves under ``"deferred"``, for the job to gather its columns from when it
    runs (the donated path: nothing writes those columns of those tensors until the job is
    resolved, so the gathers move off the training loop onto the host worker). ``carry``: the
    landed window's result on these columns or more (:func:`_carried`): its master and slots
    are the inputs, taken as they are (a donated, overlapped job updates them in place) where
    they hold exactly ``cols``, else ``cols``' share of them: gathered, or with ``defer`` (and
    the landed window on every unselected column) the landed tensors themselves with the
    positions to keep under ``"compact"``, for the job to compact in place
    (:func:`_gather_deferred`: no copy on the loop, no new memory). The window sum ``acc``
    (``[rows, unselected]``, or ``[rows, columns]`` from ``split_wide_``) is taken as it is
    where it holds exactly ``cols``, else with ``defer`` as it is with the positions to keep
    under ``"grad_compact"`` (the job owns it), else gathered. ``queue``: the gathers are queued
    on it (``offload.column_copy.ColumnCopies``): the inputs hold their values once it has run."""
    count = h["count"][cols]
    wide = acc.shape[1] != unselected.numel()
    pos = cols if wide else torch.searchsorted(unselected, cols)
    if not wide and cols.numel() == unselected.numel():
        grad = {"grad": acc}
    elif defer:
        grad = {"grad": acc, "grad_compact": pos}
    else:
        grad = {"grad": gather_columns(acc, pos, queue=queue)}
    if carry is not None and not torch.equal(carry["cols"], cols):
        state = {f: t for f, t in carry.items() if f not in ("cols", "count")}
        at = torch.searchsorted(carry["cols"], cols)
        if defer and torch.equal(carry["cols"], unselected):
            return {"cols": cols, **grad, **state, "count": count, "compact": at}
        if "grad_compact" in grad:
            grad = {"grad": gather_columns(acc, pos, queue=queue)}
        return {"cols": cols, **grad, **{f: gather_columns(t, at, queue=queue) for f, t in state.items()},
                "count": count}
    if carry is not None:
        return {"cols": cols, **grad, **{f: t for f, t in carry.items() if f not in ("cols", "count")},
                "count": count}
    if defer:
        return {"cols": cols, **grad, "count": count, "deferred": {f: t for f, t in h.items() if f != "count"}}
    job = {f: gather_columns(t, cols, queue=queue) for f, t in h.items() if f != "count"}
    return {"cols": cols, **grad, **job, "count": count}


def _gather_deferred(job: dict, into: dict[str, Tensor]) -> dict:
    """``job`` with its deferred host columns gathered (see :func:`_job_inputs`), into the
    buffers of ``into`` that have the right shape and dtype, else into new tensors.

    ``into`` is a landed window's result, already merged into the host tensors the job reads:
    where it covers the job's very columns (a window end without reselection), its buffers hold
    those columns' values already, bit for bit, and are taken without a pass over the host
    tensors (``tests/test_zenflow.py::test_a_window_on_the_landed_windows_columns_reads_no_host_column``;
    never written while a held job reads them: ``test_reused_window_buffers_are_never_written_while_a_held_job_reads_them``)."""
    if "grad_compact" in job:  # the window sum, this job's to compact
        job = {**{f: v for f, v in job.items() if f != "grad_compact"},
               "grad": _kept_columns(job["grad"], job["grad_compact"])}
    if "compact" in job:  # the landed window's tensors, this job's to compact
        pos = job["compact"]
        return {f: v if f in ("cols", "count", "grad") else _kept_columns(v, pos) for f, v in job.items()
                if f != "compact"}
    if "deferred" not in job:
        return job
    rest = {f: v for f, v in job.items() if f != "deferred"}
    cols = job["cols"]
    same_cols = "cols" in into and torch.equal(into["cols"], cols)
    out = {}
    for f, t in job["deferred"].items():
        buf = _fitting(into.get(f), (t.shape[0], cols.numel()), t.dtype)
        out[f] = buf if same_cols and buf is not None and buf is into.get(f) else gather_columns(t, cols, out=buf)
    return {**rest, **out}


def _kept_columns(t: Tensor, pos: Tensor) -> Tensor:
    """``t[:, pos]``, compacted into ``t``'s own memory where it is contiguous (``t`` is the
    job's to overwrite), else gathered."""
    return compact_columns_(t, pos) if t.is_contiguous() else gather_columns(t, pos)


def _fitting(buf: Tensor | None, shape: tuple[int, int], dtype: torch.dtype) -> Tensor | None:
    """``buf`` if it is a host tensor of ``shape`` and ``dtype``; a contiguous ``shape`` view of
    the start of its memory if it is a contiguous host tensor of ``dtype`` with room for one (a
    reselection changes a window's column count: its buffers are reused, not reallocated, and a
    worker process keeps the storage it already maps); else ``None``."""
    if buf is None or buf.dtype != dtype or buf.device.type != HOST.type:
        return None
    if tuple(buf.shape) == shape:
        return buf
    room = buf.untyped_storage().nbytes() // buf.element_size() - buf.storage_offset()
    if not buf.is_contiguous() or room < math.prod(shape):
        return None
    return torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), buf.storage_offset(), shape)


def _merge_then(landed: dict[str, dict], host: dict, window: Callable[..., dict]) -> dict:
    """Background job of a donated window end: write the landed window's master and slots into
    the host tensors (in place; the loop has written its counts), then run ``window``, whose
    deferred gathers read those tensors and are written into the landed window's tensors, free
    once merged (the loop has already scattered their master into the parameters). Nothing else
    reads or writes those columns until the loop resolves this job."""
    _merge_host_result(landed, host, inplace=True, part="state")
    return window(into=landed)


def _add_to_window_sum(adds: list[tuple[Tensor, Tensor, Callable[[], None], bool]]) -> None:
    """Background job of a donated step: for each ``(acc, g, ready, first)``, wait for ``g``'s copy
    (``ready``), then ``acc = g`` (``first``: the weight's first step in the window) or ``acc += g``, the same one
    rounding per element as the inline sum. Jobs run in submission order, so every window sum
    sees its steps' adds in order, and the window job submitted after them sees them all
    (``tests/test_zenflow.py::test_background_window_sum_equals_the_inline_sum``)."""
    for acc, g, ready, first in adds:
        ready()
        if acc is g:
            continue
        if first:
            acc.copy_(g)
        else:
            acc.add_(g.to(acc.dtype))


def _share_written(later: dict[str, dict], landed: dict[str, dict], merged: dict[str, dict]) -> None:
    """Move to shared memory (once: a no-op for a tensor already there) the host tensors a donated
    window job writes or reads in bulk, so the worker process works on them in place: the window
    sums, the host master and slots its gathers read (or the landed result it carries on:
    :func:`_carried`), those its merge writes (``merged``: every weight of the landed window
    but the carried ones, a frozen one too, which has no new window), and the landed window's
    result buffers it gathers into. Its column indices and counts go by value."""
    for job in later.values():
        for f, t in job.items():
            if f == "deferred":
                for d in t.values():
                    d.share_memory_()
            elif f not in ("cols", "count", "compact", "grad_compact"):
                t.share_memory_()
    for trees, skip in ((landed, ("cols", "count")), (merged, ("count",))):
        for r in trees.values():
            for f, t in r.items():
                if f not in skip:
                    t.share_memory_()


def check_host_process(inner: Optimizer, threads: int, cores: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless ZenFlow's host work can run in a worker process with these
    settings: ``inner`` has a ``recipe``, ``threads`` is an int >= 1 and ``cores`` are CPUs
    this process may run on."""
    if inner.recipe is None:
        raise ValueError("host_process=True needs an inner optimizer with a recipe (fsdpx.optim.adamw or sgd):"
                         " the worker process builds its own copy of it")
    if not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
        raise ValueError(f"host_threads must be an int >= 1, got {threads!r}")
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    bad = [c for c in cores if not isinstance(c, int) or c not in allowed]
    if bad:
        raise ValueError(f"host_cores {bad} are not CPUs this process may run on ({sorted(allowed)})")


def _resolve_window_sum(job: Future | None) -> None:
    """Wait for the in-flight window-sum job (if any), re-raising its exception; returns ``None``."""
    if job is not None:
        job.result()
    return None


def _async_window_sum(device: torch.device) -> bool:
    """Whether a donated, overlapped step hands its window-sum adds to the background thread: on
    CUDA, where the loop would otherwise wait for the device before adding. On ``cpu`` the fused
    gather-and-add on the loop is cheaper than a gather plus a handoff (tests switch it on)."""
    return device.type == "cuda" or _ASYNC_ON_CPU


_ASYNC_ON_CPU = False
_SUM_JOB = "window_sum_job"  # state key, only while a window-sum job is in flight
_BUFFERS = "window_sum_buffers"  # donated state key: {"free": {name: T}, "busy": {name: T}} (materialize drops it)
_STALE = "stale"  # state key, only while a frozen weight holds landed columns: {name: host cols}
_CHOSEN = "chosen"  # state key with local_columns: {name: the weight's whole selection, sorted global indices}
_TRAINED = "window_trained"  # state key, only while a weight trained fewer steps than the window: {name: steps}


def _timed(metrics: dict, fn, *args, key: str = "host_wait_s"):
    """``fn(*args)``, its wall time added to ``metrics[key]``."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        metrics[key] += time.perf_counter() - start


_LOOP = "host_loop_s"


def _check_inner_state(inner_state: dict, params: Params) -> list[str]:
    if inner_state.get("count") != 0:
        raise TypeError("zenflow needs an inner optimizer whose state has an int 'count' starting at 0")
    slot_names = [s for s in inner_state if s != "count"]
    for s in slot_names:
        slot = inner_state[s]
        if not isinstance(slot, dict) or any(
            k not in params or not isinstance(v, Tensor) or v.shape != params[k].shape for k, v in slot.items()
        ):
            raise TypeError(f"zenflow needs elementwise inner state: entry {s!r} must map parameter names "
                            "to tensors shaped like the parameters")
    return slot_names


def _device_step(inner: Optimizer, slot_names: list[str], d: dict, grad: Tensor, p: Tensor) -> tuple[dict, Tensor]:
    """``inner`` on a parameter whose whole state ``d`` (master, slots, int ``count``) lives on
    the device: ``(new state, new parameter)``, the parameter a copy of the master in its dtype."""
    g = grad.to(d["master"].dtype)
    slots = {s: t for s, t in d.items() if s not in ("master", "count")}
    master, slots = _inner_step(inner, slot_names, d["master"], g, slots, d["count"])
    return {"master": master, **slots, "count": d["count"] + 1}, master.to(p.dtype, copy=True)


def _warm_up_step(inner: Optimizer, grads: Params, state: State, params: Params, *,
                  inplace: bool) -> tuple[Params, State]:
    """A warm-up step: ``inner`` on every element with this step's gradient, the 2-D weights'
    whole state on the host (every column has the same count, ``state["step"]``), the others on
    the device. The same operations on the same operands as plain ``inner``, hence its bits.
    ``inplace`` (a donated state): the host state and the parameters are written in place."""
    slot_names: list[str] = state["slots"]
    metrics = {"host_wait_s": 0.0, _LOOP: 0.0, "d2h_bytes": 0, "h2d_bytes": 0}
    host, device, new_params = dict(state["host"]), dict(state["device"]), dict(params)
    for k, p in params.items():
        if k not in grads:  # frozen
            continue
        if k not in host:
            device[k], new_params[k] = _device_step(inner, slot_names, device[k], grads[k], p)
            continue
        h = host[k]
        g = to_host(grads[k]).to(h["master"].dtype)
        metrics["d2h_bytes"] += nbytes(g)
        slots = {s: t for s, t in h.items() if s not in ("master", "count")}
        count = int(h["count"][0]) if h["count"].numel() else 0  # every column's: the weight's own count
        master, slots = _timed(metrics, _inner_step, inner, slot_names, h["master"], g, slots, count, inplace)
        host[k] = {"master": master, **slots, "count": h["count"].add_(1) if inplace else h["count"] + 1}
        value = to_device(master, p.device).to(p.dtype)
        metrics["h2d_bytes"] += nbytes(value)
        new_params[k] = p.copy_(value) if inplace else (value if value is not master else master.clone())
    return new_params, {**state, "step": state["step"] + 1, "host": host, "device": device, "metrics": metrics}


# --- the optimizer ---------------------------------------------------------------------------


def zenflow(
    inner: Optimizer | None = None,
    *,
    topk_ratio: float = 0.1,
    select_interval: int | str = 100,
    update_interval: int | str = 4,
    delay: int = 1,
    overlap: bool = True,
    reduce: str = "mean",
    auto: AutoConfig = AutoConfig(),
    combine_scores: CombineScores | None = None,
    full_warm_up_rounds: int = 0,
    local_columns: LocalColumns | None = None,
    matrices: Mapping[str, int] | None = None,
    combine_stats: CombineStats | None = None,
    host_process: bool = False,
    host_threads: int = 1,
    host_cores: tuple[int, ...] = (),
) -> Optimizer:
    """ZenFlow selective update around the elementwise optimizer ``inner`` (default
    ``adamw(lr=1e-3)``); semantics in the module docstring.

    Guarantees (``property_tests/test_zenflow_properties.py`` unless named):
      - ``delay=0``: ``topk_ratio=1`` equals ``inner`` bit for bit; ``update_interval=1`` equals
        ``inner`` bit for bit for any ratio; ``topk_ratio=0`` equals ``inner`` applied every
        ``update_interval`` steps to the window's mean gradient.
      - Every step equals a column-by-column sequential reference of the semantics above, for
        both delays, any ratio, intervals and reselections (``test_matches_sequential_reference``).
      - ``overlap=True`` and ``overlap=False`` give the same bits, run after run.
      - ``full_warm_up_rounds=N``: the first ``N`` steps equal ``inner`` bit for bit (parameters
        and every element's master, slots and count); after them the run continues as ZenFlow
        started from that state (``tests/test_zenflow_knobs.py``).
      - ``init`` leaves the weights as they are: ``master_params(init(p))`` is ``p``.
      - A column leaving and re-entering the selection keeps its moments and count.
      - Selected columns are read only from the fp32 master, never from low-precision ``params``
        (``tests/test_zenflow.py::test_low_precision_params_follow_the_fp32_master``).
      - With ``combine_scores`` summing over row shards (module docstring, "Row shards"), ZeRO-2
        and ZeRO-3 runs on any number of ranks select the same columns as the unsharded run and
        match its parameters (``property_tests/test_zenflow_sharded.py``). ``combine_scores=None``
        is the identity: one rank holds every row.
      - With columns split too (tensor parallelism: ``combine_scores`` returns every column's
        score, ``local_columns`` this rank's range of them), the top-k is chosen on the whole
        vector and each rank keeps the chosen columns it holds: the unsharded run's selection,
        cut (``property_tests/test_zenflow_model_parallel.py``). The ``"auto"`` rules then read
        the unsharded run's statistics: the coverage rule the whole score vector and the
        weight's whole selection (kept under ``state["chosen"]``), the window rule every
        weight's sums over all ranks' blocks, combined by ``combine_stats`` (required with
        ``update_interval="auto"`` and ``local_columns``; the sums are added in the unsharded
        order: ``test_auto_intervals_decide_as_the_unsharded_run``). ``matrices``: ``{name: b}``
        for a parameter whose tensor is a view (a tensor-parallel plan's fused ``[3, n, in]`` of
        a ``[3n, in]`` weight): its dims before ``b`` are the weight's rows, the rest its
        columns, and ZenFlow treats it as that matrix, as the unsharded run does; ``b = 0``: not
        a weight (the ``[3, n]`` view of a ``[3n]`` bias), updated on the device every step.

    ``params`` passed to ``update`` must be those returned by the previous ``update`` (or the
    initial ones): columns are written, not re-read; the master copy is authoritative.
    ``combine_scores`` must return the same bits on every rank (an all-reduce does), and every
    rank calls it for the same weights in the same order: the ranks' collectives line up.

    ``host_process=True`` runs the host work of ``overlap=True`` in a worker process
    (``offload.host_process``) instead of the background thread: ``host_threads`` intra-op
    threads, pinned to ``host_cores`` (empty: not pinned). The same jobs in the same order on the
    same operands, hence the same bits (``tests/test_zenflow_process.py``). A donated state's host
    tensors that a job writes or reads in bulk (master, slots, window sums, the landed window's
    result buffers) are moved to shared memory the first time a job takes them and are reused
    from then on; everything else a job takes or returns is small and goes by value. Each
    step's window-sum add stays on the loop (on CUDA it waits for the copy there). A dead worker
    process is named (``offload.host_process.HostWorkerDied``) at the next wait for it.

    Edge cases: ``topk_ratio`` outside ``[0, 1]``, ``delay`` not in ``{0, 1}``, ``reduce`` not
    ``"mean"``/``"sum"``, intervals below 1 or a fixed ``select_interval`` that is not a multiple
    of a fixed ``update_interval`` raise ``ValueError``, as does a ``full_warm_up_rounds`` that
    is not an int >= 0, ``host_process`` with ``host_threads`` not an int >= 1, ``host_cores``
    not CPUs this process may run on, or an ``inner`` without a ``recipe`` (it must be rebuilt in
    the worker process: ``adamw`` and ``sgd`` have one); an ``inner`` whose state is not
    ``{"count": 0, slot: {name: tensor like the parameter}}`` raises ``TypeError`` at ``init``.
    A weight with every column selected never touches the host; with none selected, never the
    device optimizer."""
    inner = adamw(lr=1e-3) if inner is None else inner
    views = dict(matrices or {})
    num_selected(0, topk_ratio)  # validates the ratio
    if delay not in (0, 1):
        raise ValueError(f"delay must be 0 or 1, got {delay}")
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    for name, v in (("select_interval", select_interval), ("update_interval", update_interval)):
        if v != "auto" and not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{name} must be an int >= 1 or 'auto', got {v!r}")
    if isinstance(select_interval, int) and isinstance(update_interval, int) and select_interval % update_interval:
        raise ValueError(f"select_interval ({select_interval}) must be a multiple of update_interval "
                         f"({update_interval}) so that every reselection falls on a window end")
    check_config(auto)
    if local_columns is not None and update_interval == "auto" and combine_stats is None:
        raise ValueError("update_interval=\"auto\" with columns split over ranks (local_columns) needs"
                         " combine_stats: the window rule reads every weight's sums over all ranks")
    if not (isinstance(full_warm_up_rounds, int) and not isinstance(full_warm_up_rounds, bool)
            and full_warm_up_rounds >= 0):
        raise ValueError(f"full_warm_up_rounds must be an int >= 0, got {full_warm_up_rounds!r}")
    if host_process:
        check_host_process(inner, host_threads, host_cores)

    def submit(fn: Callable[..., Any], /, *args: Any, on_cpu: bool = False) -> Future:
        """Hand a host job to the worker thread, or to the worker process. ``on_cpu``: the loop's
        device is the CPU, whose cores its own intra-op threads fill: the worker thread runs its
        torch operations on one thread (``offload.worker.submit``)."""
        if host_process:
            return worker.process(host_threads, tuple(host_cores)).submit(fn, *args)
        return worker.submit(fn, *args, threads=1 if on_cpu else None)

    def as_matrices(tree: Params) -> Params:
        """``tree`` with every view in ``matrices`` reshaped to its weight's ``[rows, columns]``."""
        if not views:
            return tree
        return {k: v.reshape(math.prod(v.shape[:views[k]]), math.prod(v.shape[views[k]:])) if views.get(k) else v
                for k, v in tree.items()}

    def is_weight(name: str, t: Tensor) -> bool:
        """Whether ``name`` (as :func:`as_matrices` gives it) has columns ZenFlow selects in."""
        return views[name] > 0 if name in views else t.dim() == 2

    def init(params: Params) -> State:
        params = as_matrices(params)
        masters = {k: p.detach().to(dtype=master_dtype(p.dtype), copy=True) for k, p in params.items()}
        host_m = {k: m.to(HOST) for k, m in masters.items() if is_weight(k, m)}
        dev_m = {k: m for k, m in masters.items() if not is_weight(k, m)}
        inner_host, inner_dev = inner.init(host_m), inner.init(dev_m)
        slot_names = _check_inner_state(inner_host, params)
        _check_inner_state(inner_dev, params)
        host, device = {}, {}
        for k, m in host_m.items():
            slots = {s: inner_host[s][k] for s in slot_names if k in inner_host[s]}
            host[k] = {"master": m, **slots, "count": torch.zeros(m.shape[1], dtype=torch.int64)}
            device[k] = {f: torch.empty((m.shape[0], 0), dtype=t.dtype, device=params[k].device)
                         for f, t in (("master", m), *slots.items())}
        for k, m in dev_m.items():
            device[k] = {"master": m, **{s: inner_dev[s][k] for s in slot_names if k in inner_dev[s]}, "count": 0}
        return {
            "step": 0,
            "slots": slot_names,
            "selected": None,  # {name: sorted host LongTensor} from step 1 on
            "unselected": None,
            "host": host,
            "device": device,
            "acc": {},  # {name: [out, n_unselected] window gradient sum, on the host}
            "window_steps": 0,
            "window_sq": 0.0,  # sum_t |g_t|^2 over the window (the "auto" fire rule)
            "since_selection": 0,
            "pending": None,  # delay=1: {"result": Future | {name: host result}}
            "metrics": {"host_wait_s": 0.0, _LOOP: 0.0, "d2h_bytes": 0, "h2d_bytes": 0},
            **({_CHOSEN: {}} if local_columns is not None else {}),  # {name: the whole selection, global indices}
        }

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        return shaped(params, *step(as_matrices(grads), state, as_matrices(params), inplace=False))

    def shaped(params: Params, new_params: Params, state: State) -> tuple[Params, State]:
        """``new_params`` with every view in ``matrices`` back in its own shape."""
        if views:
            new_params = {k: v.reshape(params[k].shape) if views.get(k) else v for k, v in new_params.items()}
        return new_params, state

    def update_inplace(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        """``update`` for a caller that donates ``state`` and ``params``: the same bits, written
        into their tensors (the host state, the window sum, the parameters' columns) instead of
        new ones (``tests/test_zenflow.py::test_donated_update_gives_the_same_bits``)."""
        with torch.no_grad():
            return shaped(params, *step(as_matrices(grads), state, as_matrices(params), inplace=True))

    def step(grads: Params, state: State, params: Params, *, inplace: bool) -> tuple[Params, State]:
        extra = sorted(set(grads) - set(params))
        if extra:
            raise KeyError(f"gradients for names not in params: {extra}")
        if state["step"] < full_warm_up_rounds:
            return _warm_up_step(inner, grads, state, params, inplace=inplace)
        slot_names: list[str] = state["slots"]
        metrics = {"host_wait_s": 0.0, _LOOP: 0.0, "d2h_bytes": 0, "h2d_bytes": 0}
        host, device, new_params = dict(state["host"]), dict(state["device"]), dict(params)
        since = state["since_selection"]
        on_cpu = all(p.device.type == HOST.type for p in params.values())  # the same every step
        frozen = frozenset(params) - frozenset(grads)
        stale = dict(state.get(_STALE, {}))
        for k in [k for k in stale if k in grads]:  # trains again: the windows that landed while frozen
            if state["pending"] is not None:  # a deferred merge may still be writing its master
                _timed(metrics, worker.resolve, state["pending"]["result"])
            _write_stale(k, stale.pop(k), host[k], new_params, metrics, inplace)

        # A weight's first selection is made at its first trained step, from that step's gradient.
        selected, unselected = dict(state["selected"] or {}), dict(state["unselected"] or {})
        chosen = dict(state.get(_CHOSEN, {}))
        for k in host:
            if k in grads and k not in selected:
                chosen[k] = choose(k, grads[k])
                sel = local_part(k, chosen[k])
                host[k], device[k] = _handover(host[k], device[k], sel[:0], sel, metrics)
                selected[k], unselected[k] = sel, complement(sel, host[k]["count"].numel())

        # Host: add the unselected columns' gradient to the window sum. A donated, overlapped,
        # fixed-window step only enqueues the copy; the background thread adds it (in order,
        # the same adds as inline), so the loop does not wait for the device here.
        loop_start = time.perf_counter()
        opening = state["window_steps"] == 0
        acc = {} if opening else dict(state["acc"])
        # A donated fixed-window state keeps its window sums: a window opens into the buffers of
        # the window before last, whose host job the last window end resolved (_BUFFERS).
        reuse = inplace and update_interval != "auto"
        buffers = state.get(_BUFFERS, {}) if reuse else {}
        free, busy = dict(buffers.get("free", {})), buffers.get("busy", {})
        window_sq = 0.0 if opening else state["window_sq"]
        norm_sq_of_sum = 0.0
        sum_job = state.get(_SUM_JOB)
        trained = {} if opening else dict(state.get(_TRAINED, {}))  # steps trained, where fewer than the window's
        adds = []
        picked: dict[str, Tensor] = {}  # selected columns' gradients gathered in the window-sum pass
        copies = ColumnCopies()  # every weight's pass, run together on the loop's threads
        local_stats: dict[str, Tensor] = {}
        for k in host:
            if k in frozen:
                if k in acc:  # its window sum waits; it trained fewer steps than the window
                    trained.setdefault(k, state["window_steps"])
                continue
            uns = unselected[k]
            if not uns.numel():
                continue
            first = opening or k not in acc  # the weight's first trained step in this window
            if first and not opening:
                trained[k] = 0
            if k in trained:
                trained[k] += 1
            metrics["d2h_bytes"] += uns.numel() * grads[k].shape[0] * grads[k].element_size()
            in_place_sum = reuse and not first  # the window sum is ours to write
            dtype = host[k]["master"].dtype
            # A donated state's window sum on the CPU spans every column (split_wide_: a streaming
            # pass); only its unselected columns are read. One continued from another path stays narrow.
            async_sum = reuse and overlap and not host_process and _async_window_sum(grads[k].device)
            wide = (reuse and not async_sum and grads[k].device.type == HOST.type and grads[k].dtype == dtype
                    and dtype in (torch.float32, torch.float64) and (first or acc[k].shape[1] == grads[k].shape[1]))
            if not first and not wide and acc[k].shape[1] != uns.numel():  # a wide sum another path continues
                acc[k] = gather_columns(acc[k], uns)
            width = grads[k].shape[1] if wide else uns.numel()
            spare = _fitting(free.pop(k, None), (grads[k].shape[0], width), dtype) if first else None
            if wide:
                sum_job = _resolve_window_sum(sum_job)
                if first:
                    acc[k] = spare if spare is not None else torch.empty(grads[k].shape, dtype=dtype)
                picked[k] = split_wide_(grads[k], selected[k], acc[k], add=not first, queue=copies)
            elif async_sum:
                g, ready = worker.to_host_async(gather_columns(grads[k], uns.to(grads[k].device)))
                if first:  # a spare buffer, or an owned CPU gather of the master's dtype as the sum itself
                    fresh = g if g.dtype == dtype and not g.is_pinned() else torch.empty(g.shape, dtype=dtype)
                    acc[k] = spare if spare is not None else fresh
                adds.append((acc[k], g, ready, first))
            elif (in_place_sum or spare is not None) and grads[k].device.type == HOST.type:
                sum_job = _resolve_window_sum(sum_job)  # one gather (into the spare) or gather-and-add pass
                if first:
                    acc[k] = spare
                # the same pass over the gradient's rows gathers the selected columns for the device
                picked[k] = split_columns_(grads[k], selected[k], acc[k], uns, add=not first, queue=copies)
            else:
                sum_job = _resolve_window_sum(sum_job)
                # On a GPU the gathered columns come down through a pinned buffer (to_host) and are
                # added on the host: the same one rounding per element as the pass above.
                g = to_host(gather_columns(grads[k], uns.to(grads[k].device))).to(host[k]["master"].dtype)
                acc[k] = acc[k].add_(g) if in_place_sum else g if first else acc[k] + g
                if update_interval == "auto" and combine_stats is not None:
                    local_stats[k] = torch.stack([g.double().square().sum(), acc[k].double().square().sum()])
                elif update_interval == "auto":
                    g_sq, s_sq = window_stats(k, g, acc[k])
                    window_sq += g_sq
                    norm_sq_of_sum += s_sq
        if update_interval == "auto" and combine_stats is not None:  # every weight's, in the unsharded order
            for v in combine_stats(local_stats).values():
                g_sq, s_sq = v.tolist()
                window_sq += g_sq
                norm_sq_of_sum += s_sq
        copies.run()
        if adds:
            sum_job = submit(_add_to_window_sum, adds, on_cpu=on_cpu)
        window_steps, since = state["window_steps"] + 1, since + 1
        metrics[_LOOP] += time.perf_counter() - loop_start

        # Device: the selected columns and every non-2-D parameter, with this step's gradient.
        # At a donated window end where a host window lands, a weight's selected columns are
        # written into it in the same pass as the landed columns (_apply_host_result).
        lands = (inplace and update_interval != "auto" and window_steps == update_interval
                 and state["pending"] is not None)
        held: dict[str, tuple[Tensor, Tensor]] = {}
        for k in params:
            if k in frozen:
                continue
            p, d = new_params[k], device[k]  # new_params: a frozen weight's landed columns written above
            if k not in host:
                device[k], new_params[k] = _device_step(inner, slot_names, d, grads[k], p)
            elif selected[k].numel():
                sel, idx = selected[k], selected[k].to(p.device)
                g = (picked.pop(k) if k in picked else gather_columns(grads[k], idx)).to(d["master"].dtype)
                slots = {s: t for s, t in d.items() if s != "master"}
                master, slots = _update_columns(inner, slot_names, d["master"], g, slots, host[k]["count"][sel], inplace)
                device[k] = {"master": master, **slots}
                host[k] = {**host[k], "count": host[k]["count"].index_add(0, sel, torch.ones_like(sel))}
                if lands:
                    held[k] = (idx, master.to(p.dtype))
                else:
                    new_params[k] = scatter_columns_(p if inplace else p.clone(), idx, master.to(p.dtype), queue=copies)
        copies.run()

        if update_interval == "auto":
            closing = host_update_due(window_steps, norm_sq_of_sum, window_sq, auto)
        else:
            closing = window_steps == update_interval
        pending = state["pending"]
        if closing:
            reselect = _reselection(grads, selected, chosen, since)
            if reselect is not None and select_interval != "auto":
                since = 0
            chosen.update(reselect or {})
            reselect = {k: local_part(k, glob) for k, glob in (reselect or {}).items()}
            # A donated, overlapped delay=1 window end without reselection reads no host column on
            # the loop: the landed window's master and slots are written into the host state by the
            # background thread, just before it gathers the next window's inputs (materialize waits
            # for both), or not at all where the next window carries them on (below). The loop
            # writes only the counts and the parameters' columns.
            defer_merge = inplace and overlap and delay == 1 and not reselect
            if not defer_merge:
                sum_job = _timed(metrics, _resolve_window_sum, sum_job)
            landed = _timed(metrics, worker.resolve, pending["result"]) if pending is not None else None
            divisor = window_steps if reduce == "mean" else 1
            if trained and reduce == "mean":  # a weight frozen for part of the window: its own steps
                divisor = {k: trained.get(k, window_steps) for k in acc}
            # delay=0 needs every result now. delay=1 defers all but the entering columns, whose
            # result must land before the device owns them (the one synchronous exception).
            now_cols, later_cols = {}, {}
            for k in host:
                if k not in acc:  # every column selected, or frozen for the whole window
                    continue
                uns = unselected[k]
                entering = uns[torch.isin(uns, reselect[k])] if k in reselect else uns[:0]
                now_cols[k] = uns if delay == 0 else entering
                later_cols[k] = uns[~torch.isin(uns, now_cols[k])]
            carried = _carried(landed, later_cols, unselected, frozen)
            if landed is not None:  # delay=1: the previous window lands now
                part = "count" if defer_merge else "all"
                _timed(metrics, partial(_apply_host_result, frozen=frozen, stale=stale, held=held, carried=carried),
                       landed, host, new_params, metrics, inplace, part, key=_LOOP)
                pending = None
            for k, (idx, value) in held.items():  # weights the landed window does not write
                new_params[k] = scatter_columns_(new_params[k], idx, value, queue=copies)
            copies.run()
            held = {}
            now, later = {}, {}
            gathers = ColumnCopies()  # every input gather of both jobs, run together
            for k in now_cols:
                uns = unselected[k]
                if now_cols[k].numel():  # from the landed window where it covered them, else from the host
                    covered = k in carried and torch.equal(carried[k]["cols"], uns)
                    now[k] = _timed(metrics, partial(_job_inputs, carry=carried[k] if covered else None,
                                                     queue=gathers), host[k], acc[k], uns, now_cols[k], key=_LOOP)
                if later_cols[k].numel():
                    later[k] = _timed(metrics, partial(_job_inputs, defer=inplace and overlap, carry=carried.get(k),
                                                       queue=gathers), host[k], acc[k], uns, later_cols[k], key=_LOOP)
            _timed(metrics, gathers.run, key=_LOOP)
            handed: dict[str, dict] = {}  # delay=1: the entering columns' update, for the device alone
            if now:
                result = _timed(metrics, _host_window, inner, slot_names, divisor, now)
                handed = result if delay == 1 else {}
                _timed(metrics, partial(_apply_host_result, frozen=frozen, stale=stale, carried=handed), result, host,
                       new_params, metrics, inplace, key=_LOOP)
            merging = {k: r for k, r in (landed or {}).items() if k not in carried} if defer_merge else {}
            if merging and not later:  # nothing to hand the merge to: write it here
                _timed(metrics, _merge_host_result, merging, host, True, "state", key=_LOOP)
            if later:
                job = partial(_host_window, inner, slot_names, divisor, later, owned=inplace and overlap)
                merged = {k: host[k] for k in merging}
                if merged:
                    job = partial(_merge_then, merging, merged, job)
                elif landed and inplace and overlap:  # merged above: its tensors are free to gather into
                    job = partial(job, into={k: r for k, r in landed.items() if k not in carried})
                if overlap and host_process and inplace:
                    _timed(metrics, _share_written, later, merging, merged, key=_LOOP)
                pending = {"result": submit(job, on_cpu=on_cpu) if overlap else _timed(metrics, job)}
            sum_job = None  # the window job (or the resolve above) runs after every add
            handovers = ColumnCopies()  # every weight's, run together
            for k, sel in reselect.items():
                host[k], device[k] = _timed(metrics, _handover, host[k], device[k], selected[k], sel, metrics,
                                            inplace, handovers, handed.get(k), key=_LOOP)
                selected[k], unselected[k] = sel, complement(sel, host[k]["count"].numel())
            _timed(metrics, handovers.run, key=_LOOP)
            if reuse:  # the resolved job's sums are free; the job just handed over reads this window's
                in_flight = bool(later) and overlap
                free, busy = {**free, **busy, **({} if in_flight else acc)}, (acc if in_flight else {})
            acc, window_steps, window_sq, trained = {}, 0, 0.0, {}

        extra = {_SUM_JOB: sum_job} if sum_job is not None else {}
        if local_columns is not None:
            extra[_CHOSEN] = chosen
        if reuse:
            extra[_BUFFERS] = {"free": free, "busy": busy}
        if stale:
            extra[_STALE] = stale
        if trained:
            extra[_TRAINED] = trained
        return new_params, {
            **{f: v for f, v in state.items() if f not in (_SUM_JOB, _BUFFERS, _STALE, _TRAINED, _CHOSEN)},
            **extra,
            "step": state["step"] + 1,
            "selected": selected,
            "unselected": unselected,
            "host": host,
            "device": device,
            "acc": acc,
            "window_steps": window_steps,
            "window_sq": window_sq,
            "since_selection": since,
            "pending": pending,
            "metrics": metrics,
        }

    def scores_of(name: str, grad: Tensor) -> Tensor:
        """The column scores of weight ``name`` over all its rows."""
        local = column_scores(grad)
        return local if combine_scores is None else combine_scores(name, local)

    def choose(name: str, grad: Tensor) -> Tensor:
        """The selected columns of weight ``name`` (sorted host indices into the whole score
        vector): the top-k of the scores over all its rows and columns."""
        return select_columns(scores_of(name, grad), topk_ratio).to(HOST)

    def local_part(name: str, glob: Tensor) -> Tensor:
        """The columns of the selection ``glob`` this rank holds, as indices into its block."""
        if local_columns is None:
            return glob
        held = local_columns(name)
        return torch.searchsorted(held, glob[torch.isin(glob, held)])

    def window_stats(name: str, g: Tensor, acc: Tensor) -> tuple[float, float]:
        """``(|g|^2, |acc|^2)`` of weight ``name``'s unselected columns over all its rows."""
        local = torch.stack([g.double().square().sum(), acc.double().square().sum()])
        if combine_scores is not None:
            local = combine_scores(name, local)
        g_sq, s_sq = local.tolist()
        return g_sq, s_sq

    def _reselection(grads: Params, selected: dict, chosen: dict, since: int) -> dict[str, Tensor] | None:
        """New selections (global indices) of the weights that reselect at this window end
        (``None``: not due). ``chosen``: the weights' whole selections where columns are split."""
        if select_interval != "auto":
            if since < select_interval:
                return None
            return {k: choose(k, grads[k]) for k in selected if k in grads}
        out = {}
        for k, sel in selected.items():
            if k not in grads:  # frozen: keeps its selection
                continue
            scores = scores_of(k, grads[k])
            best = select_columns(scores, topk_ratio)
            whole = chosen[k] if local_columns is not None else sel
            captured = scores[whole.to(scores.device)].sum().item()
            if reselect_due(captured, scores[best].sum().item(), auto):
                out[k] = best.to(HOST)
        return out

    return Optimizer(init, update, update_inplace, partial_grads=True)


# --- reading the state -----------------------------------------------------------------------


def materialize(state: State) -> State:
    """``state`` with its in-flight host window (if any) waited for: plain data, safe to save.
    Continuing from it gives the same bits as continuing from ``state``
    (``test_materialized_state_resumes_bit_for_bit``)."""
    if state.get(_SUM_JOB) is not None:
        _resolve_window_sum(state[_SUM_JOB])
    state = {f: v for f, v in state.items() if f not in (_SUM_JOB, _BUFFERS)}
    unselected = state.get("unselected") or {}
    if any(a.shape[1] != unselected[k].numel() for k, a in (state.get("acc") or {}).items() if k in unselected):
        state["acc"] = {k: gather_columns(a, unselected[k]) if k in unselected and a.shape[1] != unselected[k].numel()
                        else a for k, a in state["acc"].items()}  # a split_wide_ sum: its unselected columns
    pending = state.get("pending")
    if pending is None or not isinstance(pending["result"], Future):
        return state
    return {**state, "pending": {"result": pending["result"].result()}}


def element_state(state: State) -> dict[str, dict[str, Any]]:
    """Every element's current state, merged from host and device, with every computed host
    window applied (waits for the in-flight one): ``{name: {"master": T, <slot>: T, "count": c}}``
    where ``c`` is a per-column host ``LongTensor[in]`` for 2-D weights and an ``int`` otherwise.
    Tensors are on the host for 2-D weights, on the device otherwise. The open window's gradient
    sum is not applied."""
    state = materialize(state)
    host = dict(state["host"])
    if state["pending"] is not None:
        _merge_host_result(state["pending"]["result"], host)
    out = {}
    for k, d in state["device"].items():
        if k not in host:
            out[k] = dict(d)
            continue
        h = dict(host[k])
        sel = (state["selected"] or {}).get(k)
        if sel is not None and sel.numel():
            for f, t in d.items():
                h[f] = h[f].index_copy(1, sel, to_host(t))
        out[k] = h
    return out


def master_params(state: State) -> Params:
    """The master weights (fp32 or wider) of every parameter, on its device, with every computed
    host window applied. ``master_params(init(p))`` equals ``p`` (upcast)."""
    merged = element_state(state)
    return {k: to_device(e["master"], state["device"][k]["master"].device) for k, e in merged.items()}
