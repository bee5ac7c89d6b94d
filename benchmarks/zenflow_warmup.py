"""ZenFlow from scratch with DeepSpeed's ``full_warm_up_rounds`` (issue 31): loss after 200 steps.

    .venv/bin/python benchmarks/zenflow_warmup.py                       # 200 steps, warm-ups 0 20 50 100
    .venv/bin/python benchmarks/zenflow_warmup.py --warm-ups 0,10 --steps 20   # a quick look
    .venv/bin/python benchmarks/zenflow_warmup.py --update-interval auto      # DeepSpeed's default window

The loss part of ``benchmarks/offload_step.py`` (the same small GPT, 2 x 128, vocabulary 512,
0.5M parameters; the same Markov-chain batches, batch 16 x 32; AdamW lr 1e-3, betas (0.9, 0.999),
weight decay 0.01), from the seeded initial weights, for:

* ``none``: plain AdamW every step (no offload);
* ``zenflow`` with warm-up ``N`` for each ``--warm-ups`` value: ``offload.zenflow(adamw,
  topk_ratio=0.1, update_interval=4, select_interval=16, delay=1, overlap=True,
  full_warm_up_rounds=N)`` (``N = 0`` is the setting of ``offload_step.py``, +48% there);
  ``--update-interval auto`` replaces the fixed window of 4 by the ``"auto"`` rule.

Reported per run: the training loss (mean of the last 10 steps), the loss on the held-out batch
at the end, and the held-out loss relative to ``none`` (the issue's target: within 5% with
warm-up). Every run in this process, one after another, one thread each (``--threads``); the
load average before and after is printed, and the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_step import BETAS, EPS, HELD_OUT, LR, WD, ZENFLOW, batch_for, build_model  # noqa: E402

import offload  # noqa: E402
from fsdpx.optim import adamw, update_fn  # noqa: E402

CONFIG = {"vocab": 512, "seq": 32, "batch": 16, "n_layer": 2, "n_head": 4, "n_embd": 128}


def train(optimizer, steps: int) -> dict:
    """``steps`` steps of the small GPT with ``optimizer`` on the shared batches:
    ``{"train_loss": mean of the last 10, "held_out": loss on the held-out batch, "losses": [...]}``."""
    from torch.func import functional_call

    gpt, model = build_model(CONFIG)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = optimizer.init(params)
    update = update_fn(optimizer, donate=True)
    losses = []
    for step in range(steps):
        x, y = batch_for(CONFIG, step)
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = gpt.token_loss(functional_call(model, live, (x,)), y).mean()
        grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
        params, state = update(grads, state, params)
        losses.append(float(loss.detach()))
    x, y = batch_for(CONFIG, HELD_OUT)
    with torch.no_grad():
        held_out = float(gpt.token_loss(functional_call(model, params, (x,)), y).mean())
    return {"train_loss": statistics.fmean(losses[-10:]), "held_out": held_out, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm-ups", default="0,20,50,100", help="full_warm_up_rounds values, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--update-interval", default="4", help="ZenFlow's window: steps, or auto")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "bench_out" / "zenflow_warmup.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    inner = adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)
    window = args.update_interval if args.update_interval == "auto" else int(args.update_interval)
    zenflow = {**ZENFLOW, "update_interval": window}
    runs = {"none": lambda: inner}
    for n in (int(w) for w in args.warm_ups.split(",") if w):
        runs[f"zenflow (window {window}) warm-up {n}"] = lambda n=n: offload.zenflow(inner, **zenflow,
                                                                                     full_warm_up_rounds=n)
    load_before = os.getloadavg()
    results = {}
    for name, make in runs.items():
        start = time.perf_counter()
        results[name] = {**train(make(), args.steps), "seconds": time.perf_counter() - start}
        print(f"{name:32s} train {results[name]['train_loss']:.4f} held-out {results[name]['held_out']:.4f}"
              f" ({results[name]['seconds']:.0f} s)", flush=True)
    ref = results["none"]["held_out"]
    lines = [f"| run ({args.steps} steps from scratch) | train loss (last 10) | held-out loss | vs none |",
             "|---|---|---|---|"]
    for name, r in results.items():
        rel = 100 * (r["held_out"] - ref) / ref
        lines.append(f"| {name} | {r['train_loss']:.4f} | {r['held_out']:.4f} | {rel:+.2f}% |")
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {**CONFIG, "steps": args.steps, "zenflow": zenflow}, "runs": results,
                               "load": load}, indent=1))
    print("\n".join(lines))
    print(f"load average before {load_before[0]:.1f}, after {load['after'][0]:.1f} ({os.cpu_count()} cpus);"
          f" JSON in {out}")


if __name__ == "__main__":
    main()
