"""ZenFlow's state as a checkpoint holds it: every tensor shaped like its weight, or one value per column.

A ZenFlow state (``offload.zenflow``) keeps, per 2-D weight, this rank's selected columns as
indices into its own block, their master and moments in ``[rows, n_selected]`` device tensors,
the open window's gradient sum in ``[rows, n_unselected]`` and an in-flight host window as the
columns it updates. Under tensor or pipeline parallelism each rank's selection is its own part
of the weight's (a row-parallel weight's columns), so those tensors have no global shape a
checkpoint can lay out. But the selection itself is the unsharded run's (the scores are
combined over the splitting axes, the top-k taken on the whole vector): it is one bit per
column of the weight. So the checkpoint form stores

* ``host[w][f]``: every element's master and ``inner`` slots, the selected columns' device
  values written in, in the weight's own (local) shape: sharded as the weight's optimizer state;
* ``acc[w]``, ``pending[w][f]``: the window sum and the in-flight host window's result, in the
  weight's shape, zero where they hold no column;
* ``columns[w]``: one value per column, sharded as the weight's columns: ``count``, and as
  masks ``selected``, ``pending`` (with ``pending_count``) and ``stale`` (landed while frozen);
* ``chosen[w]``: the weight's whole selection (sorted column indices, the same on every rank),
  which the ``"auto"`` coverage rule reads where columns are split;
* the non-weight parameters' device state and the scalars as they are.

Every rank derives its runtime part back from its blocks (:func:`from_checkpoint`), so a
checkpoint written in one layout loads into any other the ``ckpt`` rules can re-cut, and into
the same one bit for bit. ``ckpt.rules`` gives tensors under ``opt_state/columns/`` the spec of
their weight's column dims (``docs/checkpoint-format.md``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from offload.columns import complement
from offload.worker import to_host
from offload.zenflow import materialize

State = dict[str, Any]
Shapes = Mapping[str, tuple[tuple[int, ...], int]]
"""``weight name -> (this rank's block shape, b)``: the block as the parameter's layout shapes
it (a view included), its dims before ``b`` the weight's rows and the rest its columns."""

_SCALARS = ("step", "slots", "window_steps", "window_sq", "since_selection", "metrics", "window_trained")


def is_checkpoint_form(opt_state: Any) -> bool:
    """Whether ``opt_state`` is ZenFlow's checkpoint form (``to_checkpoint``'s output)."""
    return isinstance(opt_state, dict) and "columns" in opt_state and "host" in opt_state


def to_checkpoint(state: State, shapes: Shapes) -> State:
    """``state`` (a ZenFlow state; its in-flight window waited for) in the checkpoint form of
    the module doc, every tensor on the host. ``shapes[w]``: weight ``w``'s block shape and
    ``b`` (a weight absent from ``shapes`` keeps its ``[rows, columns]`` matrix shape, ``b = 1``).

    Guarantee: ``from_checkpoint(to_checkpoint(s, shapes), like)`` continues bit for bit as
    ``s`` does (``tests/test_zenflow_checkpoint_form.py``). Nothing here is a collective: every
    tensor is this rank's block of a global one."""
    state = materialize(state)
    selected, unselected = state["selected"] or {}, state["unselected"] or {}
    pending = (state["pending"] or {}).get("result", {})
    stale = state.get("stale", {})
    chosen = state.get("chosen", selected)
    host, columns, acc, results = {}, {}, {}, {}
    for k, h in state["host"].items():
        rows, cols = h["master"].shape
        block, b = shapes.get(k, ((rows, cols), 1))
        col_shape = tuple(block[b:])
        fields = [f for f in h if f != "count"]
        sel = selected.get(k)
        full = {f: h[f].clone() for f in fields}
        if sel is not None and sel.numel():
            for f in fields:
                full[f].index_copy_(1, sel, to_host(state["device"][k][f]))
        host[k] = {f: full[f].reshape(block) for f in fields}
        c = {"count": h["count"].reshape(col_shape)}
        if sel is not None:
            c["selected"] = _mask(sel, cols).reshape(col_shape)
        if k in state["acc"]:
            acc[k] = _spread(state["acc"][k], unselected[k], rows, cols).reshape(block)
        if k in pending:
            r = pending[k]
            results[k] = {f: _spread(r[f], r["cols"], rows, cols).reshape(block) for f in fields}
            c["pending"] = _mask(r["cols"], cols).reshape(col_shape)
            count = torch.zeros(cols, dtype=r["count"].dtype)
            c["pending_count"] = count.index_copy_(0, r["cols"], r["count"]).reshape(col_shape)
        if k in stale:
            c["stale"] = _mask(stale[k], cols).reshape(col_shape)
        columns[k] = c
    device = {k: d for k, d in state["device"].items() if k not in state["host"]}
    return {**{f: state[f] for f in _SCALARS if f in state}, "has_selection": state["selected"] is not None,
            "host": host, "device": device, "columns": columns, "acc": acc, "pending": results,
            "chosen": {k: v.clone() for k, v in chosen.items() if k in state["host"]}}


def from_checkpoint(saved: State, like: State) -> State:
    """The ZenFlow state ``saved`` (the checkpoint form, this rank's blocks) describes, shaped
    and placed as ``like`` (this rank's fresh ``init`` state: which weights it holds, their
    ``[rows, columns]`` and devices). Entries of weights ``like`` does not hold (another
    pipeline stage's, listed by a merged checkpoint tree) are dropped. Raises ``KeyError``
    naming a weight ``like`` holds that ``saved`` lacks (a checkpoint of another model)."""
    has_selection = saved["has_selection"]
    host, device, acc, results, stale = {}, {}, {}, {}, {}
    selected: dict[str, Tensor] = {}
    unselected: dict[str, Tensor] = {}
    for k, fresh in like["host"].items():
        if k not in saved["host"]:
            raise KeyError(f"the checkpoint holds no ZenFlow state for {k!r}")
        rows, cols = fresh["master"].shape
        c = {f: t.reshape(-1) for f, t in saved["columns"][k].items()}
        h = {f: t.reshape(rows, cols) for f, t in saved["host"][k].items()}
        host[k] = {**h, "count": c["count"]}
        dev = like["device"][k]["master"].device
        if "selected" in c:
            sel = c["selected"].nonzero().squeeze(1)
            selected[k], unselected[k] = sel, complement(sel, cols)
            device[k] = {f: t.index_select(1, sel).to(dev) for f, t in h.items()}
        else:
            device[k] = like["device"][k]
        if k in saved["acc"]:
            acc[k] = saved["acc"][k].reshape(rows, cols).index_select(1, unselected[k])
        if "pending" in c:
            pcols = c["pending"].nonzero().squeeze(1)
            r = {f: t.reshape(rows, cols).index_select(1, pcols) for f, t in saved["pending"][k].items()}
            results[k] = {"cols": pcols, **r, "count": c["pending_count"][pcols]}
        if "stale" in c:
            stale[k] = c["stale"].nonzero().squeeze(1)
    for k in like["device"]:
        if k not in like["host"]:
            device[k] = saved["device"][k]
    trained = {k: v for k, v in saved.get("window_trained", {}).items() if k in like["host"]}
    extra = {**({"stale": stale} if stale else {}), **({"window_trained": trained} if trained else {})}
    if "chosen" in like:  # columns split over ranks: the whole selections
        extra["chosen"] = {k: v for k, v in saved["chosen"].items() if k in like["host"] and k in selected}
    return {**{f: saved[f] for f in _SCALARS if f in saved and f != "window_trained"}, **extra,
            "selected": selected if has_selection else None, "unselected": unselected if has_selection else None,
            "host": host, "device": device, "acc": acc, "pending": {"result": results} if results else None}


def _mask(cols: Tensor, n: int) -> Tensor:
    """A ``bool[n]`` true at ``cols``."""
    return torch.zeros(n, dtype=torch.bool).index_fill_(0, cols.to(torch.device("cpu")), True)


def _spread(values: Tensor, cols: Tensor, rows: int, n: int) -> Tensor:
    """``[rows, n]`` zeros with ``values`` (``[rows, len(cols)]``) at columns ``cols``."""
    values = to_host(values)
    return torch.zeros((rows, n), dtype=values.dtype).index_copy_(1, cols, values)

