"""``grad_sample_mode="ghost_fsdp"``: an Opacus user's FSDP script (``FSDP2Wrapper``, then
``make_private`` in every rank of a torchrun job, then the ordinary loop) over fsdpx's ZeRO-3.

One real torchrun launch (``tests/support/opacus_fsdp_job.py``, 2 gloo processes) trains an MLP
(float64: without noise, with noise, with noise and ``BatchMemoryManager``) and an untied
transformers GPT-2 (float32) for three steps; each must end with the parameters of the
one-process entry on the same key, whose Poisson batches are the union of the ranks' rows.
With noise that means the same noise bits (a different draw moves the parameters by about
``sigma * C / B``, far above 1e-10). The launch ends with rank 1 leaving abruptly: rank 0's
next step names it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy.errors import PrivacyError
from privacy.opacus import PrivacyEngine
from privacy.opacus.loader import PoissonBatches
from privacy.sampling import PoissonSampler
from support.opacus_fsdp_job import CASES, mlp, run_case
from support.processes import ROOT, python_env
from support.threads import one_thread  # noqa: F401  (fixture)

JOB = ROOT / "tests" / "support" / "opacus_fsdp_job.py"


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("opacus_fsdp")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(JOB), str(out)], env=python_env(), capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case, tol", [("mlp", 1e-10), ("mlp_noise", 1e-10), ("mlp_virtual", 1e-10),
                                       ("gpt2", 1e-5)])
def test_ghost_fsdp_under_torchrun_equals_the_one_process_entry(torchrun_job, case, tol, one_thread):  # noqa: F811
    """Both ranks' gathered parameters after three steps equal the one-process ``ghost`` entry's
    on the same key (noise included: the same bits), and every rank's epsilon is the one
    process's. ``mlp_virtual``: each rank cuts its rows into physical batches of at most 4
    (``BatchMemoryManager``; the ranks agree on how many, as their forwards gather together,
    and at step 1 they would cut 2 and 1): still one step per logical batch, the one-process
    step on the whole batch."""
    want, epsilon = run_case(case, sharded=False)
    start = {n: p.detach() for n, p in mlp().named_parameters()} if case.startswith("mlp") else None
    for rank in (0, 1):
        got = torch.load(torchrun_job / f"{case}.rank{rank}.pt")
        assert sorted(got["params"]) == sorted(want)
        for name, value in want.items():
            gap = float((got["params"][name] - value).abs().max())
            assert gap <= tol, (case, rank, name, gap)
        assert got["epsilon"] == epsilon
    if start is not None:
        assert max(float((want[n] - p).abs().max()) for n, p in start.items()) > 1e-3  # the steps moved it
    if CASES[case][1] > 0:
        assert epsilon < float("inf")
        clipped_only, _ = run_case("mlp", sharded=False)
        assert max(float((want[n] - clipped_only[n]).abs().max()) for n in want) > 1e-2  # the noise is there


@pytest.mark.slow
def test_a_rank_that_dies_is_named_by_the_survivor_within_seconds(torchrun_job):
    """Rank 1 exits without a word before a step; rank 0's step raises ``RankFailure`` naming
    rank 1 (``fsdpx.runtime.dist_comm``), after the 10 s grace, not the group's timeout."""
    seen = torch.load(torchrun_job / "dead.rank0.pt")
    assert seen["seen"].startswith("RankFailure: rank(s) [1]"), seen["seen"]
    assert seen["seconds"] < 30, seen


def test_the_ranks_poisson_rows_together_are_the_one_process_batch():
    """``share=(rank, ranks)`` cuts each draw as the sharded step cuts a global batch: the ranks'
    index lists, concatenated in rank order, are the one-process draw, for every step."""
    whole = PoissonBatches(50, 5, key=3)
    parts = [PoissonBatches(50, 5, key=3, share=(r, 3)) for r in range(3)]
    for t, batches in enumerate(zip(whole, *parts)):
        assert batches[0] == sum(batches[1:], []) == PoissonSampler(50, 0.2, key=3).indices(t).tolist()
    assert parts[0].expected_batch_size == pytest.approx(10 / 3)


def test_ghost_fsdp_without_fsdp2wrapper_and_a_wrapper_without_a_process_group_are_refused_by_name():
    model = mlp()
    loader = DataLoader(TensorDataset(torch.zeros(8, 6, dtype=torch.float64), torch.zeros(8, dtype=torch.long)),
                        batch_size=4)
    with pytest.raises(PrivacyError, match="grad_sample_mode='ghost_fsdp' on a model not wrapped by FSDP2Wrapper"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                     grad_sample_mode="ghost_fsdp")
    from fsdpx.runtime.opacus_fsdp import FSDP2Wrapper

    with pytest.raises(PrivacyError, match="call torch.distributed.init_process_group first"):
        FSDP2Wrapper(model)
    with pytest.raises(PrivacyError, match="argument 'mp_policy' is not supported"):
        FSDP2Wrapper(model, mp_policy=None)
    frozen = nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    with pytest.raises(PrivacyError, match="'bias' has requires_grad=False"):
        FSDP2Wrapper(frozen)


def test_a_step_on_each_ranks_own_rows_is_the_global_batch_step(one_thread):  # noqa: F811
    """``make_sharded_step(..., local_batch=True)``, each rank passing its chunk of the batch,
    gives the bits of the step that cuts the global batch itself (ZeRO-3 over 2 thread ranks,
    private, noise on); a plain step or a tensor-parallel plan with ``local_batch`` is refused."""
    from fsdpx.optim import sgd
    from fsdpx.runtime import init_sharded, make_sharded_step, run_threads
    from fsdpx.sharding import Mesh, strategies
    from fsdpx.sharding.layout import chunk_bounds
    from privacy.step import DPConfig

    params = {n: p.detach() for n, p in mlp().named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    x, y = dataset_rows = (torch.randn(11, 6, dtype=torch.float64), torch.randint(0, 3, (11,)))
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
    config = DPConfig(clip_norm=0.5, noise_multiplier=1.0, sample_rate=0.25, method="ghost")

    def rank(comm):
        model = mlp()  # each thread rank its own module: a step swaps tensors into it
        state = init_sharded(params, sgd(0.5), strategies.zero3(), comm, key=7, config=config)
        kw = dict(param_shapes=shapes, config=config, num_examples=44)
        whole, _ = make_sharded_step(model, loss, sgd(0.5), strategies.zero3(), comm, **kw)(state, dataset_rows)
        a, b = chunk_bounds(11, 2, comm.rank)
        local_step = make_sharded_step(model, loss, sgd(0.5), strategies.zero3(), comm, local_batch=True, **kw)
        own, _ = local_step(state, (x[a:b], y[a:b]))
        with pytest.raises(ValueError, match="local_batch=True needs a private step"):
            make_sharded_step(model, loss, sgd(0.5), strategies.zero3(), comm, param_shapes=shapes, local_batch=True)
        return whole.params, own.params

    for whole, own in run_threads(Mesh(dp=2), rank):
        assert all(torch.equal(whole[n], own[n]) for n in whole)
