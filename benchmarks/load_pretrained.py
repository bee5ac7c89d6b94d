"""Issue 29's load target: a GPT-2-small-shaped transformers save (random weights, written
locally, nothing downloaded) loaded by ``fsdpx train``'s own path on 4 gloo processes. Under
ZeRO-3 each rank's peak RSS during the load stays within its resident state + the largest single
tensor + 200 MiB; the DDP row (every rank holds the whole model) stands beside it.

    python benchmarks/load_pretrained.py                         # zero3 and ddp, 4 processes
    python benchmarks/load_pretrained.py --strategies zero3 --nproc 2 --dir /tmp/gpt2-small

Each rank (``torchrun``, one thread) runs what :func:`fsdpx.train.loop.run` runs before its
first step: ``build_source`` (the model on ``meta``, the keys checked), ``resolve_parallel`` and
``build_step`` (``init_sharded`` reading only the rank's blocks from the safetensors file,
AdamW's moments made). "Peak during the load" is ``VmHWM`` after the load minus ``VmRSS``
before it (the imports of torch and transformers are not the load; ``VmHWM`` is reset first),
"resident state" the bytes of the rank's parameters and optimizer state, "largest tensor" the
largest parameter of the file in fp32. The save is written once into ``--dir`` and kept. Prints
a table and, with ``--json``, every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import launch_worker, logger, reset_hwm, status_kb, write_report  # noqa: E402

MiB = 1 << 20
SLACK_MIB = 200
GPT2_SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
log = logger("load_pretrained")


def save_model(path: Path) -> None:
    """A GPT-2-small-shaped ``GPT2LMHeadModel`` with seeded random weights, saved with
    ``save_pretrained`` into ``path`` unless a save is already there."""
    if (path / "model.safetensors").exists():
        return
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_SMALL))
    model.save_pretrained(path)
    log(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters to {path}")


def tensor_bytes(tree) -> int:
    """Bytes of every distinct tensor storage in ``tree`` (dicts, lists, tuples, named tuples)."""
    import torch

    seen: dict[int, int] = {}

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            if not x.is_meta:
                seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return sum(seen.values())


def worker(args) -> None:
    """Load the save on this rank as ``fsdpx train`` does; rank 0 writes every rank's numbers."""
    import torch
    import torch.distributed as dist

    from fsdpx.runtime.dist_comm import init_from_env
    from fsdpx.train.build import build_step
    from fsdpx.train.config import RunConfig
    from fsdpx.train.parallel import resolve_parallel
    from fsdpx.train.sources import build_source, read_mode

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    config = RunConfig.of(model="transformers", model_path=args.dir, strategy=args.strategy, private=False,
                          steps=1, block_size=64, batch_size=8.0)
    comm = init_from_env(config.parallelism.mesh(world), timeout_s=1800.0)
    dist.barrier()
    reset_hwm()
    before = status_kb("VmRSS") * 1024
    source = build_source(config, read=read_mode(config, True))
    parallel = resolve_parallel(config.parallelism, source.model, comm.mesh, source.inputs[:1])
    state, _ = build_step(config, source.model, source.params, None, num_examples=len(source.inputs), comm=comm,
                          parallel=parallel, loss_fn=source.loss_fn, weights=source.weights)
    peak = status_kb("VmHWM") * 1024
    largest = max(4 * _numel(shape) for shape in source.weights.shapes.values())
    row = {"rank": comm.rank, "rss_before": before, "peak": peak, "load_peak": peak - before,
           "state": tensor_bytes((state.params, state.opt_state)), "largest": largest}
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if comm.rank == 0:
        with open(args.result, "w") as f:
            json.dump({"strategy": args.strategy, "world": world, "ranks": rows}, f)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def table(results: list[dict]) -> str:
    """One row per strategy: the largest per-rank load peak, its bound and the verdict."""
    lines = ["| layout | ranks | load peak per rank (MiB) | resident state (MiB) | largest tensor (MiB) |"
             " bound: state + largest + 200 (MiB) | peak / bound | met |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        ranks = res["ranks"]
        worst = max(ranks, key=lambda r: r["load_peak"] - r["state"])
        bound = worst["state"] + worst["largest"] + SLACK_MIB * MiB
        peaks = " / ".join(f"{r['load_peak'] / MiB:.0f}" for r in ranks)
        states = " / ".join(f"{r['state'] / MiB:.0f}" for r in ranks)
        met = all(r["load_peak"] <= r["state"] + r["largest"] + SLACK_MIB * MiB for r in ranks)
        lines.append(f"| {res['strategy']} | {res['world']} | {peaks} | {states} | {worst['largest'] / MiB:.0f} |"
                     f" {bound / MiB:.0f} | {worst['load_peak'] / bound:.2f} | {'yes' if met else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/fsdpx-gpt2-small", help="where the save is written once and kept")
    ap.add_argument("--strategies", default="zero3,ddp")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    save_model(Path(args.dir))
    results = []
    for strategy in args.strategies.split(","):
        log(f"{strategy}: loading on {args.nproc} processes")
        results.append(launch_worker(os.path.abspath(__file__), ["--worker", "--dir", args.dir, "--strategy", strategy],
                                     {}, args.nproc, log))
    text = table(results)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(text)
    print(f"load average {' '.join(load)}")
    write_report(args.json, {"results": results, "load": load}, text)


if __name__ == "__main__":
    main()
