"""Real gloo processes: zero3 (and every strategy on 2 ranks) equals the unsharded run; counted
bytes equal comm_per_step; resident bytes equal memory_by_rank; a dead rank is named."""

import os
import subprocess
import time

import pytest
import torch

from fsdpx import Mesh, comm_per_step, memory_by_rank, strategies, unshard
from fsdpx.train.launch import spawn_ranks, torchrun_command
from fsdpx.models.gpt import token_loss
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.sharding.pipeline import PipelineParallel, pipeline_comm_per_step, resolve_pipeline, unshard_stages
from fsdpx.runtime.activation_cost import activation_collectives
from fsdpx.sharding.cost_model import as_plan
from fsdpx.sharding.tensor_parallel import resolve
from fsdpx.optim import sgd
from fsdpx.runtime.plain_step import init_plain, make_plain_step
from fsdpx.runtime.units import make_units
from privacy.step import init_state, make_private_step

from support.gloo_problem import BATCHES, NUM_EXAMPLES, loss_for, make_model, private_config, tp_plan
from support.processes import python_env

HERE = os.path.dirname(__file__)

pytestmark = pytest.mark.slow
WORKER = os.path.join(HERE, "worker.py")


def _baseline(private: bool, kind: str = "gpt"):
    model = make_model(kind)
    params = dict(model.named_parameters())
    optimizer = sgd(0.1, momentum=0.9)
    if private:
        state = init_state(params, optimizer, key=11, config=private_config())
        step = make_private_step(model, loss_for(kind), optimizer, private_config(), num_examples=NUM_EXAMPLES)
    else:
        state, step = init_plain(params, optimizer), make_plain_step(model, loss_for(kind), optimizer)
    for b in BATCHES:
        state, _ = step(state, b)
    return state.params


def _run_torchrun(nproc: int, tmp_path, *extra: str) -> list[dict]:
    cmd = torchrun_command(nproc, [WORKER, "--out", str(tmp_path), *extra])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=python_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def _assert_equals_unsharded(results: list[dict], strategy, mesh: Mesh, ref: dict) -> None:
    """Every parameter, unsharded from the ranks' results, equals the unsharded run's
    (``strategy``: a Strategy or a resolved ShardingPlan, whose blocks may be fused views)."""
    plan = as_plan(strategy, {k: tuple(v.shape) for k, v in ref.items()})
    for name, want in ref.items():
        got = unshard([r["params"][name] for r in results], plan.params[name].at_rest, mesh)
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-10, atol=1e-12)


def _predicted_comm(strategy, ref: dict, mesh: Mesh) -> dict[str, int]:
    shapes = {k: tuple(v.shape) for k, v in ref.items()}
    units = [list(u.params) for u in make_units(make_model(), shapes)]
    return comm_per_step(strategy, shapes, mesh, units, dtype=torch.float64)


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("private", [False, True])
def test_zero3_on_gloo_equals_the_unsharded_run(tmp_path, nproc, private):
    results = _run_torchrun(nproc, tmp_path, "--strategy", "zero3", *(["--private"] if private else []))
    mesh, strategy = Mesh(dp=nproc), strategies.zero3()
    ref = _baseline(private)
    _assert_equals_unsharded(results, strategy, mesh, ref)
    predicted = _predicted_comm(strategy, ref, mesh)
    shapes = {k: tuple(v.shape) for k, v in ref.items()}
    memory = memory_by_rank(strategy, shapes, mesh, optimizer="sgd_momentum", dtype=torch.float64)
    for rank, r in enumerate(results):
        for metrics in r["metrics"]:
            assert metrics["comm_bytes"] == predicted
            assert metrics["resident_bytes"] == memory[rank]


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_other_strategies_on_two_gloo_ranks_equal_the_unsharded_run(tmp_path, name):
    results = _run_torchrun(2, tmp_path, "--strategy", name, "--private")
    _assert_equals_unsharded(results, strategies.ALL[name](), Mesh(dp=2), _baseline(True))


@pytest.mark.parametrize("private", [False, True])
def test_hsdp_on_four_gloo_ranks_equals_the_unsharded_run(tmp_path, private):
    """2 replicas x 2 shards: the flat per-unit all-gather runs on the shard axis's own process
    group, the gradient reduction over both axes; counted bytes equal the algebra's."""
    results = _run_torchrun(4, tmp_path, "--strategy", "hsdp", *(["--private"] if private else []))
    mesh, strategy = Mesh(replica=2, shard=2), strategies.hsdp()
    ref = _baseline(private)
    _assert_equals_unsharded(results, strategy, mesh, ref)
    predicted = _predicted_comm(strategy, ref, mesh)
    for rank, r in enumerate(results):
        for m in r["metrics"]:
            if rank == 0:  # the rank with the largest blocks: exactly the algebra's figure
                assert m["comm_bytes"] == predicted
            # the others all-reduce their own (smaller, uneven) blocks; padded kinds are equal
            assert all(m["comm_bytes"][k] <= v for k, v in predicted.items()), (rank, m["comm_bytes"], predicted)
            assert (m["comm_bytes"]["all_gather"], m["comm_bytes"]["reduce_scatter"]) == \
                (predicted["all_gather"], predicted["reduce_scatter"])


@pytest.mark.parametrize("private", [False, True])
def test_zero3_with_tensor_parallelism_on_four_gloo_ranks_equals_the_unsharded_run(tmp_path, private):
    """dp=2 x tp=2: the GPT plan (vocab-parallel embedding and loss, column/row layers) over
    ZeRO-3; one batch leaves a data-parallel group without examples."""
    results = _run_torchrun(4, tmp_path, "--strategy", "zero3", "--tp", "2", *(["--private"] if private else []))
    mesh = Mesh(dp=2, tp=2)
    model = make_model()
    plan = resolve(model, gpt_plan(model.config), strategies.zero3(), mesh)
    ref = _baseline(private)
    _assert_equals_unsharded(results, plan, mesh, ref)
    losses = {round(m["loss"], 12) for r in results for m in r["metrics"][:1]}
    assert len(losses) == 1  # every rank reports the same global loss
    shapes = {k: tuple(v.shape) for k, v in ref.items()}
    units = [list(u.params) for u in make_units(model, shapes)]
    for (x, y), metrics in zip(BATCHES, results[0]["metrics"]):  # rank 0: the largest blocks and batch share
        acts = activation_collectives(model, plan, mesh, token_loss, x.shape, y.shape, dtype=torch.float64,
                                      private=private)
        assert metrics["comm_bytes"] == comm_per_step(plan, shapes, mesh, units, dtype=torch.float64, activations=acts)


@pytest.mark.parametrize("kind", ["hf-gpt2", "hf-llama", "hf-qwen3"])
def test_transformers_plans_on_two_gloo_ranks_equal_the_unsharded_run(tmp_path, kind):
    """transformers' GPT-2 (fused Conv1D c_attn, tied head), Llama and Qwen3 (per-head norms,
    their gradients summed over tp), unmodified, under their ready plans at tp=2 (one of the
    batches has a single example)."""
    results = _run_torchrun(2, tmp_path, "--strategy", "zero3", "--tp", "2", "--model", kind)
    mesh = Mesh(dp=1, tp=2)
    model = make_model(kind)
    plan = resolve(model, tp_plan(kind, model), strategies.zero3(), mesh)
    _assert_equals_unsharded(results, plan, mesh, _baseline(False, kind))


@pytest.mark.parametrize("private", [False, True])
def test_a_tp_plan_missing_a_style_is_refused_on_gloo(tmp_path, private):
    """Qwen3 under Llama's plan: each process's gradient of a per-head norm is its heads' share.
    Both processes refuse at the first step, naming the norms, before any update
    (``fsdpx.runtime.replicas``)."""
    extra = ["--private"] if private else []
    results = _run_torchrun(2, tmp_path, "--strategy", "zero3", "--tp", "2", "--model", "hf-qwen3", "--plan",
                            "hf-llama", *extra)
    for r in results:
        assert "params" not in r and not r["metrics"]
        assert "ReplicatedOnSplit" in r["refused"] and "model.layers.0.self_attn.q_norm.weight" in r["refused"]


def _assert_pipeline_equals_unsharded(results: list[dict], plan, mesh: Mesh, ref: dict) -> None:
    full = unshard_stages([r["params"] for r in results], plan, mesh)
    for name, want in ref.items():
        torch.testing.assert_close(full[name].reshape(want.shape), want, rtol=1e-10, atol=1e-12)


def _assert_counts_as_predicted(results: list[dict], plan, mesh: Mesh, model, *, private: bool,
                                kinds: tuple[str, ...] = ("p2p",)) -> None:
    """Every rank's counted bytes of each of ``kinds``, every step, are what
    ``pipeline_comm_per_step`` predicts for that rank and batch."""
    for rank, r in enumerate(results):
        for (x, _), metrics in zip(BATCHES, r["metrics"]):
            want = pipeline_comm_per_step(plan, mesh, rank, batch_size=x.shape[0],
                                          hidden=(x.shape[1], model.config.n_embd), dtype=torch.float64,
                                          private=private)
            for kind in kinds:
                assert metrics["comm_bytes"][kind] == want[kind], (rank, kind, metrics["comm_bytes"], want)


@pytest.mark.parametrize("nproc, extra, private", [
    (2, ("--strategy", "ddp", "--pp", "2", "--schedule", "1f1b", "--microbatches", "3"), False),
    (2, ("--strategy", "ddp", "--pp", "2", "--schedule", "1f1b", "--microbatches", "2"), True),
    (4, ("--strategy", "zero3", "--pp", "2", "--schedule", "zero_bubble", "--microbatches", "2"), False),
    (4, ("--strategy", "zero3", "--pp", "2", "--schedule", "1f1b", "--microbatches", "2"), True),
    (4, ("--strategy", "zero3", "--tp", "2", "--pp", "2", "--schedule", "gpipe", "--microbatches", "2"), False),
])
def test_pipelines_on_gloo_equal_the_unsharded_run(tmp_path, nproc, extra, private):
    """pp=2 alone, dp=2 x pp=2 (ZeRO-3, zero-bubble and 1F1B), tp=2 x pp=2 (GPipe), plain
    and private: real processes, batched isend/irecv whose sends complete at the step's end,
    the tied embedding and head summed between the first and last stage (private: its norm
    completed on the last from the first's contributions); the p2p bytes each rank counts are
    ``pipeline_comm_per_step``'s (private: the contributions sent to the last holder too)."""
    results = _run_torchrun(nproc, tmp_path, *extra, *(["--private"] if private else []))
    args = dict(zip(extra[::2], extra[1::2]))
    tp, pp = int(args.get("--tp", 1)), int(args["--pp"])
    mesh = Mesh(dp=nproc // (tp * pp), **({"tp": tp} if tp > 1 else {}), pp=pp)
    model = make_model()
    plan = resolve(model, gpt_plan(model.config) if tp > 1 else None, strategies.ALL[args["--strategy"]](), mesh)
    plan = resolve_pipeline(model, plan, PipelineParallel(schedule=args["--schedule"],
                                                          microbatches=int(args["--microbatches"])), mesh)
    _assert_pipeline_equals_unsharded(results, plan, mesh, _baseline(private))
    _assert_counts_as_predicted(results, plan, mesh, model, private=private)


@pytest.mark.parametrize("nproc, extra", [
    (2, ("--strategy", "ddp", "--pp", "2", "--schedule", "1f1b", "--microbatches", "3")),
    (4, ("--strategy", "zero3", "--tp", "2", "--pp", "2", "--schedule", "interleaved_1f1b", "--microbatches", "2")),
])
def test_private_untied_pipelines_clip_each_microbatch_in_the_schedule_and_equal_the_unsharded_run(
        tmp_path, nproc, extra):
    """With no parameter in two stages each microbatch's norms are all-reduced as soon as a
    rank's backwards of it end (gloo's asynchronous all-reduce) and its clipped sums formed in
    the schedule: the same parameters as the unsharded private run, and every rank's p2p bytes
    and norms all-reduces as ``pipeline_comm_per_step`` predicts."""
    results = _run_torchrun(nproc, tmp_path, *extra, "--private", "--model", "gpt-untied")
    args = dict(zip(extra[::2], extra[1::2]))
    tp, pp = int(args.get("--tp", 1)), int(args["--pp"])
    mesh = Mesh(dp=nproc // (tp * pp), **({"tp": tp} if tp > 1 else {}), pp=pp)
    model = make_model("gpt-untied")
    plan = resolve(model, gpt_plan(model.config) if tp > 1 else None, strategies.ALL[args["--strategy"]](), mesh)
    plan = resolve_pipeline(model, plan, PipelineParallel(schedule=args["--schedule"],
                                                          microbatches=int(args["--microbatches"])), mesh)
    _assert_pipeline_equals_unsharded(results, plan, mesh, _baseline(True, "gpt-untied"))
    # with tp the activation collectives add all-reduces too: only p2p is compared then
    _assert_counts_as_predicted(results, plan, mesh, model, private=True,
                                kinds=("p2p", "all_reduce") if tp == 1 else ("p2p",))


def test_a_rank_dying_mid_step_is_named_by_the_survivors_within_the_timeout(tmp_path):
    start = time.monotonic()
    procs = spawn_ranks(3, [WORKER, "--out", str(tmp_path), "--die-rank", "1", "--die-after", "7",
                            "--timeout", "20"], env=python_env())
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 3
    for rank in (0, 2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert "failure" in result, outputs[rank][-2000:]
        assert result["failure"]["ranks"] == [1], result["failure"]
    assert elapsed < 90


def test_mesh_size_that_differs_from_the_world_size_is_refused(tmp_path):
    procs = spawn_ranks(2, [WORKER, "--out", str(tmp_path), "--mesh-size", "3"], env=python_env())
    for p in procs:
        p.communicate(timeout=60)
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert "mesh" in result["error"] and "3 ranks" in result["error"] and "2 processes" in result["error"]


P2P_WORKER = os.path.join(HERE, "p2p_worker.py")


def test_point_to_point_exchanges_on_gloo_arrive_in_order_and_are_counted(tmp_path):
    cmd = torchrun_command(2, [P2P_WORKER, "--out", str(tmp_path)])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert torch.equal(r0["got"][0], torch.ones(3, 2)) and torch.equal(r0["got"][1], torch.arange(5.0) * 2)
    assert torch.equal(r1["got"][0], torch.zeros(3, 2)) and torch.equal(r1["got"][1], torch.arange(5.0))
    for me, r in enumerate((r0, r1)):  # posted ahead or with the sends: filled in the order posted
        assert [t.tolist() for t in r["got"][2:]] == [[1.0, 1 - me], [2.0, 1 - me], [3.0, 1 - me]]
    assert r0["counts"]["p2p"] == r0["counts"]["send_bytes"] == r0["counts"]["recv_bytes"] == (6 + 5 + 3 * 2) * 4


def test_a_watched_receive_reports_arrival_before_its_wait(tmp_path):
    """gloo's receive reports arrival only once waited for; a watched one (a private pipeline's)
    says ``done()`` as soon as its message is in, and still delivers it in posting order."""
    cmd = torchrun_command(2, [P2P_WORKER, "--out", str(tmp_path), "--watch"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for me in range(2):
        r = torch.load(tmp_path / f"rank{me}.pt", weights_only=False)
        assert r["done_before_wait"] == [True, True]
        assert [t.tolist() for t in r["got"][2:]] == [[1.0, 1 - me], [2.0, 1 - me], [3.0, 1 - me]]


@pytest.mark.parametrize("when", ["--die", "--die-late"])
def test_a_stage_that_dies_before_sending_is_named_by_its_peer(tmp_path, when):
    """Before the first exchange, or after it while the peer waits on a watched receive (the
    waiter thread's wait fails at the group's timeout and hands the error to the handle)."""
    start = time.monotonic()
    procs = spawn_ranks(2, [P2P_WORKER, "--out", str(tmp_path), when])
    for p in procs:
        p.communicate(timeout=120)
    assert procs[1].returncode == 3
    assert torch.load(tmp_path / "rank0.pt", weights_only=False)["failure"] == [1]
    assert time.monotonic() - start < 90
