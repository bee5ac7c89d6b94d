"""A rank of a real gloo run of transformers' BERT classifier, unmodified: mapping inputs with an
attention mask and right padding, private ZeRO-3 over ``dp = WORLD_SIZE``. Saves this rank's
final state to ``<out>/rank<r>.pt`` for ``test_hf_gloo.py`` to compare with one process. Started
with ``support.processes.python_env()`` (its problem is ``support.gloo_bert_problem``)."""

import argparse
import os

import torch

from fsdpx import Mesh, strategies
from fsdpx.runtime import init_sharded, make_sharded_step
from fsdpx.runtime.dist_comm import init_from_env, shutdown

from support.gloo_bert_problem import NUM_EXAMPLES, batches, config, make_bert, optimizer
from support.hf import cls_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    mesh = Mesh(dp=int(os.environ["WORLD_SIZE"]))
    comm = init_from_env(mesh, timeout_s=60.0)
    model = make_bert()
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    step = make_sharded_step(model, cls_loss, optimizer(), strategies.zero3(), comm, param_shapes=shapes,
                             config=config(), num_examples=NUM_EXAMPLES)
    state = init_sharded(params, optimizer(), strategies.zero3(), comm, key=5, config=config())
    metrics = []
    for batch in batches():
        state, m = step(state, batch)
        metrics.append({k: v for k, v in m.items() if k in ("loss", "batch_size")})
    torch.save({"params": state.params, "metrics": metrics}, f"{args.out}/rank{comm.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
