"""Optimizer offloading: ZenFlow's selective update and the ZeRO-Offload baseline.

- ``column_scores``, ``select_columns``: which columns of a 2-D weight are updated at once.
- ``zenflow(inner, ...)``: selected columns on the device every step, the rest on the host every
  few steps (``offload.zenflow`` documents the exact semantics).
- ``zero_offload(inner)``: the whole optimizer on the host, synchronously, every step.
- ``materialize``, ``element_state``, ``master_params``: read a ZenFlow state (waiting for its
  in-flight host window, if any).
- ``AutoConfig``: thresholds of the ``"auto"`` intervals (``offload.auto``).
- ``select_interval_steps``, ``steps_per_epoch``: DeepSpeed's ``select_strategy`` (step, epoch,
  auto) as the steps ``zenflow`` counts (``offload.schedule``).
- ``sharded_scores(comm, axes)``: ZenFlow on ZeRO-2/3 row shards, selecting as one unsharded
  run does (``offload.sharded``); ``layout_scores(comm, layouts)``: the same per weight, rows or
  columns split (tensor parallelism), ``weight_layouts(plan)`` giving each weight's layout;
  ``layout_stats(comm, plan)``: the ``"auto"`` window rule's sums over every rank's blocks.
- ``offload.host_process``: ZenFlow's host window in a worker process of its own
  (``zenflow(..., host_process=True)``), shared-memory tensors by reference, the same bits.
- ``offload.checkpoint_form``: a ZenFlow state as a checkpoint holds it, one selection per
  weight in every layout (``to_checkpoint`` / ``from_checkpoint``).
"""

from offload.auto import AutoConfig
from offload.columns import column_scores, select_columns
from offload.schedule import select_interval_steps, steps_per_epoch
from offload.sharded import layout_scores, layout_stats, matrix_views, sharded_scores, weight_layouts
from offload.zenflow import element_state, master_params, materialize, zenflow
from offload.zero_offload import zero_offload

__all__ = [
    "AutoConfig",
    "column_scores",
    "element_state",
    "layout_scores",
    "layout_stats",
    "master_params",
    "materialize",
    "matrix_views",
    "select_columns",
    "select_interval_steps",
    "sharded_scores",
    "steps_per_epoch",
    "zenflow",
    "weight_layouts",
    "zero_offload",
]
