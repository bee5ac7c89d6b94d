"""A rank of a real multi-process run (gloo), started by torchrun or by ``spawn_ranks`` with
``support.processes.python_env()`` (its problem is ``support.gloo_problem``).

Trains a tiny GPT for a few sharded steps and saves this rank's final state and metrics to
``<out>/rank<r>.pt`` for the test to compare with the unsharded run. ``--die-rank R
--die-after K`` makes rank R exit abruptly after its K-th collective (a rank dying mid-step).
"""

import argparse
import os

import torch

from fsdpx import Mesh, strategies
from fsdpx.sharding.comm import RankFailure
from fsdpx.runtime.dist_comm import init_from_env, shutdown
from fsdpx.optim import sgd
from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline
from fsdpx.sharding.tensor_parallel import TensorParallelPlanError, resolve
from fsdpx.runtime import init_sharded, make_sharded_step
from privacy.step import DPConfig

from support.gloo_problem import BATCHES, NUM_EXAMPLES, loss_for, make_model, private_config, tp_plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--private", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mesh-size", type=int, default=None)
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--die-after", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the model's plan); the rest is data")
    ap.add_argument("--model", default="gpt", choices=("gpt", "gpt-untied", "hf-gpt2", "hf-llama", "hf-qwen3"))
    ap.add_argument("--plan", default=None, choices=("hf-llama",), help="another model's plan (a misfit, on purpose)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline degree (stages over their own mesh axis)")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=2)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    mesh = _mesh(args, world)
    try:
        comm = init_from_env(mesh, timeout_s=args.timeout)
    except ValueError as e:
        torch.save({"error": str(e)}, f"{args.out}/rank{os.environ['RANK']}.pt")
        return
    if comm.rank == args.die_rank:
        _die_after(comm, args.die_after)
    model = make_model(args.model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    config: DPConfig | None = private_config() if args.private else None
    strategy = strategies.ALL[args.strategy]()
    if args.tp > 1 or args.pp > 1:
        strategy = resolve(model, tp_plan(args.plan or args.model, model) if args.tp > 1 else None, strategy, mesh)
    if args.pp > 1:
        strategy = resolve_pipeline(model, strategy, PipelineParallel(schedule=args.schedule,
                                                                      microbatches=args.microbatches), mesh)
    optimizer = sgd(0.1, momentum=0.9)
    step = make_sharded_step(model, loss_for(args.model), optimizer, strategy, comm, param_shapes=shapes,
                             config=config, num_examples=NUM_EXAMPLES)
    state = init_sharded(params, optimizer, strategy, comm, key=11, config=config)
    result: dict = {"metrics": []}
    try:
        for batch in BATCHES:
            state, metrics = step(state, batch)
            result["metrics"].append(metrics)
        result["params"] = state.params
    except RankFailure as e:
        result["failure"] = {"ranks": e.ranks, "message": str(e)}
    except TensorParallelPlanError as e:  # every rank refuses at the same point: no one is left waiting
        result["refused"] = str(e)
    torch.save(result, f"{args.out}/rank{comm.rank}.pt")
    if "failure" not in result:  # after a rank failure there is nobody to meet at a barrier
        shutdown()


def _mesh(args, world: int) -> Mesh:
    """hsdp: replicas of 2-way shards (its axes); every other strategy: one data-parallel axis;
    with ``--tp`` a tensor-parallel axis (its ranks adjacent, as Megatron places them), with
    ``--pp`` a pipeline axis last."""
    data = (args.mesh_size or world) // (args.tp * args.pp)
    tp = {"tp": args.tp} if args.tp > 1 else {}
    pp = {"pp": args.pp} if args.pp > 1 else {}
    if args.strategy == "hsdp":
        return Mesh(replica=data // 2, shard=2, **tp, **pp)
    return Mesh(dp=data, **tp, **pp)


def _die_after(comm, k: int) -> None:
    real = comm.run
    calls = [0]

    def run(c, x):
        calls[0] += 1
        if calls[0] > k:
            os._exit(3)
        return real(c, x)

    comm.run = run


if __name__ == "__main__":
    main()
