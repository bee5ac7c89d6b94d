"""Benchmark: the same Opacus training loop through ``opacus.PrivacyEngine`` and through
``privacy.opacus.PrivacyEngine`` (issue 33's "what gets faster"), on transformers' GPT-2.

Modes (the same initial weights, the same fixed batch, AdamW, one loop body per mode):

  non-private     ``criterion(model(x).logits, y).backward(); optimizer.step()``
  opacus-hooks    Opacus ``make_private(grad_sample_mode="hooks")``
  opacus-ghost    Opacus ``make_private(grad_sample_mode="ghost")`` (its criterion runs both backwards)
  fsdpx-vmap      ``privacy.opacus`` with ``grad_sample_mode="hooks"`` (per-example gradients by vmap)
  fsdpx-ghost     ``privacy.opacus`` with ``grad_sample_mode="ghost"``

The loop is the user's, unchanged between the private modes but for the import. The model is
GPT-2 with an untied head (Opacus' ghost mode refuses tying) and dropout 0; positions are passed
per example (Opacus needs them). Private modes: noise multiplier 1.0, max_grad_norm 1.0, fixed
batches (``poisson_sampling=False``) so every mode sees the same batch. Each mode's first step is a
warm-up that must train (loss finite, every parameter changed).

Timing: ``--rounds`` rounds after the warm-up; in each round every mode takes one step, the order
rotated by one each round, so load from other processes hits all modes alike. Reported: the
median seconds per step, the median over rounds of the same-round ratio to the non-private step
(wall clock, and process CPU time of all threads: the steadier figure on a shared machine).
Memory: each mode alone in a fresh process (``--memory-mode MODE``, with
``MALLOC_MMAP_THRESHOLD_=65536`` so glibc hands freed blocks back): the peak resident set of two
steps over the resident set once the model, batch and ``make_private`` exist.

    PYTHONPATH=. .venv/bin/python benchmarks/opacus_entry.py                  # table on stdout
    PYTHONPATH=. .venv/bin/python benchmarks/opacus_entry.py --smoke          # tiny model, one round
    PYTHONPATH=. .venv/bin/python benchmarks/opacus_entry.py --rounds 7 --no-memory
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import clocks, logger, median_ratio, reset_hwm, status_kb  # noqa: E402

MODES = ["non-private", "opacus-hooks", "opacus-ghost", "fsdpx-vmap", "fsdpx-ghost"]
CONFIGS = {
    "cpu": {"n_layer": 4, "n_embd": 256, "n_head": 4, "seq": 128, "batch": 16, "vocab": 4096},
    "smoke": {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq": 16, "batch": 4, "vocab": 64},
}
log = logger("opacus_entry")


def gpt2(cfg: dict) -> nn.Module:
    """transformers' GPT-2 of ``cfg``'s shape, untied head, dropout 0, seeded (equal in every mode)."""
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["n_embd"],
                                     n_layer=cfg["n_layer"], n_head=cfg["n_head"], tie_word_embeddings=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def batch(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def make_step(mode: str, cfg: dict) -> tuple[Callable[[], float], nn.Module]:
    """One mode's model and its loop body as a ``step() -> loss``."""
    model = gpt2(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch(cfg)
    criterion: Callable = nn.CrossEntropyLoss()
    private = model
    if mode != "non-private":
        if mode.startswith("opacus"):
            from opacus import PrivacyEngine
        else:
            from privacy.opacus import PrivacyEngine
        kind = "ghost" if mode.endswith("ghost") else "hooks"
        out = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=kind,
            criterion=criterion)
        private, optimizer = out[0], out[1]
        criterion = out[2] if kind == "ghost" else criterion
    positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)

    def step() -> float:
        optimizer.zero_grad()
        logits = private(input_ids=x, position_ids=positions).logits
        shape = {"shape": logits.shape} if mode.endswith("ghost") else {}  # Opacus' ghost LM loss needs it
        loss = criterion(logits.flatten(0, 1), y.flatten(), **shape)
        loss.backward()
        optimizer.step()
        value = getattr(loss, "loss_per_sample", loss)  # Opacus' ghost loss wraps the per-sample losses
        return float(value.detach().mean())

    return step, model


def warm_up(mode: str, step: Callable[[], float], model: nn.Module) -> None:
    before = [p.detach().clone() for p in model.parameters()]
    loss = step()
    unchanged = [n for (n, p), b in zip(model.named_parameters(), before) if torch.equal(p, b)]
    if not torch.isfinite(torch.tensor(loss)) or unchanged:
        raise SystemExit(f"{mode}: did not train (loss {loss}, unchanged {unchanged[:3]})")


def time_modes(cfg: dict, modes: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
    steps = {}
    for mode in modes:
        log(f"build + warm up {mode}")
        steps[mode] = make_step(mode, cfg)
        warm_up(mode, *steps[mode])
    times: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            w0, c0 = clocks()
            steps[mode][0]()
            w1, c1 = clocks()
            times[mode]["wall"].append(w1 - w0)
            times[mode]["cpu"].append(c1 - c0)
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{m} {times[m]['wall'][-1]:.2f}s" for m in modes))
    return times


def memory_of(mode: str, cfg: dict) -> dict[str, float]:
    """Run in a fresh process: peak RSS of two steps over the RSS once everything exists (MiB)."""
    step, _ = make_step(mode, cfg)
    base = status_kb("VmRSS")
    reset_hwm()
    step()
    step()
    return {"peak_over_base_mib": (status_kb("VmHWM") - base) / 1024, "base_mib": base / 1024}


def memory_modes(config: str, modes: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for mode in modes:
        log(f"memory {mode} (own process)")
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--config", config, "--memory-mode", mode],
                              env=env, capture_output=True, text=True, check=True)
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def table(times: dict, memory: dict | None) -> str:
    ref = times["non-private"]
    rows = ["| mode | median s/step | x non-private (wall, same-round median) | x non-private (CPU time) |"
            " peak RSS over base (MiB) |", "|---|---:|---:|---:|---:|"]
    for mode, t in times.items():
        mem = f"{memory[mode]['peak_over_base_mib']:.0f}" if memory else "-"
        rows.append(f"| {mode} | {statistics.median(t['wall']):.3f} | {median_ratio(t['wall'], ref['wall']):.2f} |"
                    f" {median_ratio(t['cpu'], ref['cpu']):.2f} | {mem} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="*", default=MODES)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="config smoke, one round")
    parser.add_argument("--memory-mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the raw numbers as JSON")
    args = parser.parse_args()
    if args.smoke:
        args.config, args.rounds = "smoke", 1
    cfg = CONFIGS[args.config]
    if args.memory_mode:
        print(json.dumps(memory_of(args.memory_mode, cfg)))
        return
    if "non-private" not in args.modes:
        args.modes = ["non-private", *args.modes]
    started = time.time()
    times = time_modes(cfg, args.modes, args.rounds)
    memory = None if args.no_memory else memory_modes(args.config, args.modes)
    print(f"config {args.config} {cfg}, {args.rounds} rounds, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC,"
          f" load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()},"
          f" {time.time() - started:.0f} s\n")
    print(table(times, memory))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": cfg, "times": times, "memory": memory}, f, indent=1)


if __name__ == "__main__":
    main()
