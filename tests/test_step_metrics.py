"""The sharded step's metrics count the global batch once on every layout (issue 28).

Under ``--tp 2`` a run's ``metrics.jsonl`` said ``batch_size`` 784 for a batch of 392: every
rank of a tensor-parallel group holds the same share of the batch, and each counted it. Here
every strategy x tp x pp layout of ``fsdpx train`` (resolved as a run resolves it,
``fsdpx.train.parallel.resolve_parallel``) runs one step on the simulated mesh, on a batch of
5 examples that no rank count divides, and every rank must report that batch's size, the
unsharded step's loss (and, private, clipped fraction and mean norm), and bytes per collective
kind under ``comm_bytes``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdpx.models.gpt import GPT, GPTConfig, token_loss
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.threads import run_threads
from fsdpx.sharding import strategies
from fsdpx.train.layout import Layout
from fsdpx.train.parallel import resolve_parallel
from privacy.step import init_state, make_private_step
from fsdpx.runtime.plain_step import init_plain, make_plain_step

from support.reference import dp_config, optimizer_for

EXAMPLES = 5  # divides by no data-parallel count here: ranks hold 3 and 2 examples
# (strategy, tp, pp, sequence parallel): sequence parallelism with tp only (not with a pipeline, yet)
LAYOUTS = [(s, tp, pp, sp) for s in sorted(strategies.ALL) for tp in (1, 2) for pp in (1, 2)
           for sp in ((False, True) if tp > 1 and pp == 1 else (False,))]


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=8)).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (EXAMPLES, 4), generator=g), torch.randint(0, 11, (EXAMPLES, 4), generator=g)


def _unsharded_metrics(model, batch, optimizer, config) -> dict:
    params = dict(model.named_parameters())
    if config is None:
        state, step = init_plain(params, optimizer), make_plain_step(model, token_loss, optimizer)
    else:
        state = init_state(params, optimizer, key=7, config=config)
        step = make_private_step(model, token_loss, optimizer, config, num_examples=50)
    return step(state, batch)[1]


def _sharded_metrics(layout: Layout, model, batch, optimizer, config) -> list[dict]:
    mesh = layout.mesh(2 * layout.tp * layout.pp)  # two data-parallel ranks
    plan = resolve_parallel(layout, model, mesh, batch[0][:1]).plan
    params = {k: v.detach() for k, v in model.named_parameters() if k in plan.params}
    shapes = {k: tuple(v.shape) for k, v in params.items()}

    def rank(comm):
        step = make_sharded_step(copy.deepcopy(model), token_loss, optimizer, plan, comm, param_shapes=shapes,
                                 config=config, num_examples=50)
        return step(init_sharded(params, optimizer, plan, comm, key=7, config=config), batch)[1]

    return run_threads(mesh, rank, timeout=60)


@pytest.mark.parametrize("private", [False, True], ids=["plain", "private"])
@pytest.mark.parametrize("strategy, tp, pp, sp", LAYOUTS,
                         ids=[f"{s}-tp{t}-pp{p}" + "-sp" * sp for s, t, p, sp in LAYOUTS])
def test_every_layout_reports_the_global_batch_once(strategy, tp, pp, sp, private):
    model, batch, optimizer, config = _model(), _batch(), optimizer_for(torch.float64), dp_config(private)
    layout = Layout(strategy=strategy, tp=tp, pp=pp, sequence_parallel=sp, microbatches=2)
    want = _unsharded_metrics(model, batch, optimizer, config)
    for got in _sharded_metrics(layout, model, batch, optimizer, config):
        assert got["batch_size"] == EXAMPLES == want["batch_size"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)
        if private:
            assert got["clipped_fraction"] == want["clipped_fraction"]
            assert got["mean_norm"] == pytest.approx(want["mean_norm"], rel=1e-10)
        assert "comm" not in got and all(v >= 0 for v in got["comm_bytes"].values())
