"""Offloaded optimizer steps: no offload, ``zero_offload``, ``zenflow`` and DeepSpeed ZeRO-Offload.

    .venv/bin/python benchmarks/offload_step.py --setup-deepspeed   # once: .bench-venv with DeepSpeed
    .venv/bin/python benchmarks/offload_step.py                     # the issue's setting (~63M GPT)
    .venv/bin/python benchmarks/offload_step.py --smoke             # tiny model, a few steps
    python3 benchmarks/offload_step.py --device cuda --smoke --out bench_out/offload_gpu_smoke.json
    python3 benchmarks/offload_step.py --device cuda --workloads "" --out bench_out/offload_gpu.json  # timing

Two parts, each mode in its own process (started by this script with ``--worker``):

* **Timing** on a GPT of ``--n-layer`` x ``--n-embd`` (default 8 x 768, vocabulary 8192, tied
  head: 63M parameters) with short sequences (``--batch`` x ``--seq``, default 4 x 32), so the
  optimizer step is a visible share of the step. Rounds are interleaved (every round runs each
  mode once, in a rotated order), each run does ``--warmup`` untimed steps then ``--steps`` timed
  ones. Reported per step (mean over every timed step of every round): step time (wall), the
  process's CPU time (every thread, ZenFlow's background worker included; steadier than wall
  time on a loaded machine) with its system share, time in the optimizer call, the loop's wait
  for host optimizer work, the host-side bookkeeping the loop does itself (``host_loop_s``:
  gathers into the window sum, a window's input copies, scattering results back, handovers),
  and host bytes moved (gradients down, parameters and states up).
* **Loss** after ``--loss-steps`` steps (default 200) on a smaller GPT (2 x 128, vocabulary 512:
  0.5M parameters, so 200 steps of every mode take a minute), on the same synthetic Markov-chain
  data for every mode: the training loss (mean of the last 10 steps) and the loss on a held-out
  batch at the end. For ZenFlow both parts also report the share of the squared gradient that its
  selected columns hold (measured outside the timed region).

Modes, all AdamW with the same hyper-parameters, fp32, one process, the CPU as "device" (by default;
``--device cuda`` below):

* ``none``: ``fsdpx.optim.adamw`` on the device, in the loop.
* ``zero_offload``: ``offload.zero_offload(adamw)``: the whole optimizer on the host, synchronously.
* ``zenflow``: ``offload.zenflow(adamw, topk_ratio=0.1, update_interval=4, select_interval=16,
  delay=1, overlap=True)``. The timed steps cover one whole selection period (a reselection included).
* ``zenflow_proc`` (timing part only: its bits are ``zenflow``'s): ``zenflow`` with
  ``host_process=True``: the host window runs in a worker process (``offload.host_process``) with
  ``--host-threads`` intra-op threads (default 1), pinned to ``--host-cores`` (default: not
  pinned). Its CPU seconds and page faults per step include the worker process's (its totals
  over the timed steps, spread evenly over them); its host peak is reported as the loop's + the
  worker's (shared memory, the host state, counted in both).
* ``accumulate`` (loss part only): no offload, AdamW once per ``update_interval`` steps on the
  mean gradient of those steps, i.e. gradient accumulation: the schedule DeepSpeed's ZenFlow runs
  its baseline on (it sets ``gradient_accumulation_steps = update_interval``), and exactly what
  ZenFlow's unselected columns get (``offload.zenflow`` with ``topk_ratio=0``, ``delay=0``: equal
  to it by ``property_tests/test_zenflow_properties.py``).
* ``deepspeed``: DeepSpeed ZeRO stage 2 with ``offload_optimizer: cpu`` (``DeepSpeedCPUAdam``),
  ``DS_ACCELERATOR=cpu``, run with ``.bench-venv/bin/python``: DeepSpeed is never a dependency
  of this project. Its loop wait is the time in ``engine.step()`` (its host update is synchronous);
  its host bytes are not observable from outside and are given by its design (fp32 gradients
  down, fp32 parameters up: 2x the model).

Page faults per step depend on glibc's malloc as much as on the step: with its defaults, whether a
freed block's pages go back to the kernel (and fault in again next step) follows its dynamic mmap
and trim thresholds, which move with the allocation history (no offload's own count moved between
124 and 2851 a step from run to run). ``--host-pages keep`` gives every mode's process the settings
``privacy/host_pages.py`` gives a private step (freed pages stay mapped), so the count is what a
step newly needs. ZenFlow's first reselection (step 16 of its process) grows the heap once
(thousands of faults at steps 16-17); ``--warmup 20`` times a steady selection period (steps
21-36, the reselection of step 32 included).

Caveat of a CPU-only machine: "device" and "host" are the same cores, so copies cost a memory
copy, not a PCIe transfer, and ZenFlow's background host update competes with the forward and
backward for the same 2 cores. Wait times and bytes are what the library measures either way.

``--device cuda`` (one GPU; the host is the CPU): the model, batch, gradients and the device-side
optimizer (mode ``none``; ZenFlow's selected columns and non-2-D parameters) live on the GPU,
the host side (``zero_offload``'s whole optimizer, ZenFlow's unselected columns and window sums)
in CPU memory, gradients coming down through pinned buffers. Every clock read at a step boundary
and on either side of the optimizer call follows a ``torch.cuda.synchronize()``, so "step",
"optimizer call" and "loop wait" mean what they mean on the CPU. fp32 throughout (torch's default:
no TF32 matrix products). The timing defaults grow to the setting of the ZenFlow paper, where the
GPU's forward and backward take a few hundred ms and the host AdamW over the whole model longer
(``CUDA_DEFAULTS``: 24 x 1024, vocabulary 8192, ~311M parameters, batch 8 x 512, 1 round of 4 + 16
steps per mode, ``--threads`` = the host's cores minus one for the loop's thread; on one H100 with
16 host cores the timing part took 70 s, the smoke 67 s, the loss part's ``scratch`` 33 s, each
mode 13-28 s with its start-up); ``--n-layer``, ``--n-embd``, ``--n-head``, ``--batch``, ``--seq``,
``--rounds`` override them. ``deepspeed`` runs
only if this Python imports DeepSpeed (with its CUDA build), else it is skipped with the reason
printed. The loss part runs on the GPU too, from the same seeds and batches (built on the CPU and
copied); its losses differ from the CPU run's in the last bits (other kernels, other summation
orders; on an H100 every loss agreed with the CPU's to the 4 decimals printed). Also reported per mode: peak GPU memory allocated (``torch.cuda.max_memory_allocated``)
and the host's peak resident memory (``VmHWM``), both reset after the warm-up steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_common import reset_hwm, status_kb

ROOT = Path(__file__).resolve().parents[1]
BENCH_VENV = ROOT / ".bench-venv"
DEEPSPEED = ["torch==2.13.0", "deepspeed==0.19.8"]
MODES = ["none", "zero_offload", "zenflow", "zenflow_proc", "deepspeed"]
LOSS_ONLY_MODES = ["accumulate"]
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
ZENFLOW = {"topk_ratio": 0.1, "update_interval": 4, "select_interval": 16, "delay": 1, "overlap": True}
CPU_DEFAULTS = {"n_layer": 8, "n_head": 12, "n_embd": 768, "batch": 4, "seq": 32, "rounds": 3}
# ZenFlow's setting on one H100: forward + backward a few hundred ms, the host AdamW over the
# whole model (~311M fp32 parameters, 8.7 GB of state traffic) and its PCIe copies longer.
CUDA_DEFAULTS = {"n_layer": 24, "n_head": 16, "n_embd": 1024, "batch": 8, "seq": 512, "rounds": 1}


def load_gpt():
    """``fsdpx/models/gpt.py`` by file path: the DeepSpeed venv has torch but not fsdpx's
    dependencies, and every mode must run the same model code."""
    spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "fsdpx" / "models" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ---- data: a fixed random Markov chain, learnable down to its entropy ------------------------


def markov_batch(vocab: int, batch: int, seq: int, step: int, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of a chain where each token has 4 successors (probabilities .55/.25/.12/.08):
    the same chain for every mode and step, a different sample per ``step``. ``shift``: the
    fine-tuning domain, the same chain except that a fixed ``shift`` share of the tokens get new
    successors."""
    succ = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(1234))
    if shift:
        moved = torch.randperm(vocab, generator=torch.Generator().manual_seed(99))[:int(shift * vocab)]
        succ[moved] = torch.randint(0, vocab, (len(moved), 4), generator=torch.Generator().manual_seed(4321))
    probs = torch.tensor([0.55, 0.25, 0.12, 0.08])
    g = torch.Generator().manual_seed(10_000 + step)
    tok = torch.randint(0, vocab, (batch,), generator=g)
    out = [tok]
    for _ in range(seq):
        pick = torch.multinomial(probs, batch, replacement=True, generator=g)
        tok = succ[tok, pick]
        out.append(tok)
    seqs = torch.stack(out, 1)  # (B, T + 1)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


HELD_OUT = -1  # the step index of the evaluation batch (never trained on)


def cpu_counters() -> tuple[float, float, int]:
    """This process's user and system CPU seconds (every thread) and minor page faults so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def with_cpu(row: dict, before: tuple[float, float, int]) -> dict:
    after = cpu_counters()
    return {**row, "user_s": after[0] - before[0], "sys_s": after[1] - before[1], "faults": after[2] - before[2]}


def host_peak_bytes() -> int:
    """This process's peak resident set in bytes (``VmHWM``; ``ru_maxrss`` where /proc has none)."""
    try:
        return status_kb("VmHWM") * 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_of(cfg: dict) -> torch.device:
    return torch.device(cfg.get("device", "cpu"))


def memory_marks(device: torch.device) -> dict:
    """The peak-memory readings reset when the warm-up ends (the timed steps' peaks)."""
    reset = reset_hwm()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return {"host_peak_reset": reset}


def memory_report(device: torch.device, marks: dict) -> dict:
    gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {**marks, "host_peak_bytes": host_peak_bytes(), "gpu_peak_bytes": gpu}


# ---- workers ---------------------------------------------------------------------------------


def build_model(cfg: dict):
    gpt = load_gpt()
    torch.manual_seed(0)
    config = gpt.GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["n_layer"],
                           n_head=cfg["n_head"], n_embd=cfg["n_embd"])
    model = gpt.GPT(config)
    if cfg.get("init"):  # fine-tuning: every mode starts from the same pretrained weights
        missing, unexpected = model.load_state_dict(torch.load(cfg["init"]), strict=False)
        aliases = set(model.state_dict()) - set(dict(model.named_parameters()))  # buffers, tied copies
        if unexpected or set(missing) - aliases:
            raise RuntimeError(f"pretrained weights do not fit: missing {missing}, unexpected {unexpected}")
    if device_of(cfg).type != "cpu":  # built on the CPU from the same seed, so every device starts alike
        model = model.to(device_of(cfg))
    return gpt, model


def batch_for(cfg: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s training batch (``HELD_OUT``: the evaluation batch) of the run ``cfg``,
    drawn on the CPU (the same tokens on every device) and moved to the run's device."""
    size = 64 if step == HELD_OUT else cfg["batch"]
    x, y = markov_batch(cfg["vocab"], size, cfg["seq"], step + cfg.get("step_offset", 0), cfg.get("shift", 0.0))
    device = device_of(cfg)
    return (x, y) if device.type == "cpu" else (x.to(device), y.to(device))


def synchronizer(device: torch.device):
    """What to call before reading a clock: the device's queue drained (``None`` on the CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def fsdpx_worker(mode: str, cfg: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from torch.func import functional_call

    import offload
    from fsdpx.optim import adamw, update_fn

    gpt, model = build_model(cfg)
    inner = adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)
    accumulate = {**ZENFLOW, "topk_ratio": 0.0, "delay": 0, "overlap": False}
    host = {"host_process": True, "host_threads": cfg.get("host_threads", 1),
            "host_cores": tuple(cfg.get("host_cores", ()))}
    optimizer = {"none": lambda: inner, "zero_offload": lambda: offload.zero_offload(inner),
                 "zenflow": lambda: offload.zenflow(inner, **ZENFLOW),
                 "zenflow_proc": lambda: offload.zenflow(inner, **ZENFLOW, **host),
                 "accumulate": lambda: offload.zenflow(inner, **accumulate)}[mode]()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = optimizer.init(params)
    update = update_fn(optimizer, donate=True)  # the loop owns its state, as torch's in-place optimizers do
    device = device_of(cfg)
    sync = synchronizer(device)
    rows, marks, child = [], {}, None
    worker_usage(mode, host)  # zenflow_proc: its worker process started (a torch import) before any step
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            marks = memory_marks(device)
            child = worker_usage(mode, host)
        x, y = batch_for(cfg, step)
        if sync:
            sync()
        c0, t0 = cpu_counters(), time.perf_counter()
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = gpt.token_loss(functional_call(model, live, (x,)), y).mean()
        grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
        if sync:
            sync()
        t1 = time.perf_counter()
        params, state = update(grads, state, params)
        if sync:
            sync()
        t2 = time.perf_counter()
        m = state.get("metrics", {}) if isinstance(state, dict) else {}
        rows.append(with_cpu({"step_s": t2 - t0, "opt_s": t2 - t1, "wait_s": m.get("host_wait_s", 0.0),
                              "loop_s": m.get("host_loop_s", 0.0),
                              "bytes": m.get("d2h_bytes", 0) + m.get("h2d_bytes", 0),
                              "loss": float(loss.detach())}, c0))
        if mode.startswith("zenflow"):  # untimed: how much of the gradient the selection updates at once
            rows[-1]["captured"] = captured_share(grads, state["selected"])
    memory = memory_report(device, marks)
    if child is not None:  # the worker process's CPU and faults over the timed steps, spread over them
        offload.materialize(state)
        after = worker_usage(mode, host)
        for key in ("user_s", "sys_s", "faults"):
            for row in rows[cfg["warmup"]:]:
                row[key] += (after[key] - child[key]) / cfg["steps"]
        memory["worker_peak_bytes"] = after["peak_rss"]
    x, y = batch_for(cfg, HELD_OUT)
    with torch.no_grad():
        held_out = float(gpt.token_loss(functional_call(model, params, (x,)), y).mean())
    if cfg.get("save"):  # the pretraining run: its weights start every fine-tuning run
        torch.save(params if device.type == "cpu" else {k: v.cpu() for k, v in params.items()}, cfg["save"])
    return {"rows": rows, "held_out": held_out, "model_bytes": sum(p.numel() * 4 for p in params.values()), **memory}


def worker_usage(mode: str, host: dict) -> dict | None:
    """``zenflow_proc``: its worker process's CPU seconds, page faults and peak RSS so far (a job
    queued behind its window jobs); ``None`` for the other modes."""
    if mode != "zenflow_proc":
        return None
    from offload import worker
    from offload.host_process import resource_usage

    return worker.process(host["host_threads"], host["host_cores"]).submit(resource_usage).result()


def captured_share(grads: dict, selected: dict) -> float:
    """Share of the 2-D weights' squared gradient in the selected columns (ZenFlow's premise is
    that a small ``topk_ratio`` captures most of it)."""
    from offload import column_scores

    total = captured = 0.0
    for k, sel in selected.items():
        scores = column_scores(grads[k])
        total += scores.sum().item()
        captured += scores[sel.to(scores.device)].sum().item()
    return captured / total if total else float("nan")


def deepspeed_worker(cfg: dict) -> dict:
    import deepspeed  # only in .bench-venv

    gpt, model = build_model(cfg)
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg["batch"], "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    device = device_of(cfg)
    sync = synchronizer(device)
    rows, marks = [], {}
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            marks = memory_marks(device)
        x, y = batch_for(cfg, step)
        if sync:
            sync()
        c0, t0 = cpu_counters(), time.perf_counter()
        loss = gpt.token_loss(engine(x), y).mean()
        engine.backward(loss)
        if sync:
            sync()
        t1 = time.perf_counter()
        engine.step()
        if sync:
            sync()
        t2 = time.perf_counter()
        rows.append(with_cpu({"step_s": t2 - t0, "opt_s": t2 - t1, "wait_s": t2 - t1, "bytes": None,
                              "loss": float(loss.detach())}, c0))
    memory = memory_report(device, marks)
    x, y = batch_for(cfg, HELD_OUT)
    with torch.no_grad():
        held_out = float(gpt.token_loss(engine.module(x), y).mean())
    return {"rows": rows, "held_out": held_out, "model_bytes": sum(p.numel() * 4 for p in model.parameters()),
            **memory}


def worker(mode: str, cfg: dict) -> None:
    torch.set_num_threads(cfg["threads"])
    out = deepspeed_worker(cfg) if mode == "deepspeed" else fsdpx_worker(mode, cfg)
    out["threads"] = torch.get_num_threads()
    device = device_of(cfg)
    out["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print("RESULT " + json.dumps(out), flush=True)


# ---- the driver ------------------------------------------------------------------------------


# DeepSpeed JIT-compiles these C++ ops (into ~/.cache/torch_extensions) the first time a worker
# needs them: minutes on a loaded 2-core host. A build stopped half-way leaves its directory and
# `lock` file behind, and every later worker then fails to load the op; building them here, once,
# keeps the compile out of the timing runs.
DS_OPS = ("deepspeed.ops.op_builder.cpu.CPUAdamBuilder", "deepspeed.ops.op_builder.cpu.ShareMemCommBuilder")


def setup_deepspeed() -> None:
    """Create ``.bench-venv`` with torch and DeepSpeed (pinned) and build the CPU ops its worker
    loads (``DS_OPS``); the project's venv is untouched."""
    if not (BENCH_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
    subprocess.run([str(BENCH_VENV / "bin" / "pip"), "install", *DEEPSPEED], check=True)
    build = "; ".join(f"from {m.rsplit('.', 1)[0]} import {m.rsplit('.', 1)[1]}; {m.rsplit('.', 1)[1]}().load()"
                      for m in DS_OPS)
    subprocess.run([str(BENCH_VENV / "bin" / "python"), "-c", build], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})


def skip_reason(mode: str, device: str) -> str | None:
    """Why ``mode`` cannot run on ``device`` here (``None``: it can). On a GPU, DeepSpeed must be
    importable by this Python (``.bench-venv`` holds a CPU build of torch)."""
    if mode == "deepspeed" and device == "cuda" and importlib.util.find_spec("deepspeed") is None:
        return f"DeepSpeed is not importable by {sys.executable} (never a dependency of this project)"
    return None


def host_page_env(env: dict) -> dict:
    """``--host-pages keep``: glibc's malloc settings of ``privacy/host_pages.py`` (mmap threshold
    32 MiB, trim threshold 1 GiB, no block mapped on its own) as environment variables, for every
    mode's process alike: freed host pages stay mapped for the next step, so page faults count
    what a step newly needs rather than the state of glibc's dynamic thresholds. Empty where the
    environment configures malloc already (its settings win)."""
    sys.path.insert(0, str(ROOT))
    from privacy.host_pages import MMAP_MAX, MMAP_THRESHOLD, TRIM_THRESHOLD, user_configured

    if user_configured(env):
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
            "MALLOC_MMAP_MAX_": str(MMAP_MAX)}


def run_mode(mode: str, cfg: dict, log: Path) -> dict | str:
    """One worker process; its result, or the reason it failed (the tail of its log)."""
    env = dict(os.environ)
    if mode == "deepspeed" and cfg.get("device", "cpu") == "cuda":  # this Python's DeepSpeed (skip_reason)
        python = Path(sys.executable)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
                   RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
    elif mode == "deepspeed":
        python = BENCH_VENV / "bin" / "python"
        if not python.exists():
            return f"no {python}: run with --setup-deepspeed first"
        # one-process "distributed" job on loopback, as the deepspeed launcher would set it up
        env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
                   RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
    else:
        python = Path(sys.executable)
    if cfg.get("host_pages") == "keep":
        env.update(host_page_env(env))
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", mode, "--config", json.dumps(cfg)]
    with open(log, "a") as f:
        f.write(f"\n=== {mode} {json.dumps(cfg)}\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=f, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = log.read_text().strip().splitlines()[-5:]
    return f"exit {proc.returncode}: " + " | ".join(tail)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def timing(args, modes: list[str], log: Path) -> dict:
    cfg = {"vocab": args.vocab, "seq": args.seq, "batch": args.batch, "n_layer": args.n_layer,
           "n_head": args.n_head, "n_embd": args.n_embd, "warmup": args.warmup, "steps": args.steps,
           "threads": args.threads, "host_threads": args.host_threads,
           "host_cores": [int(c) for c in args.host_cores.split(",") if c]}
    if args.host_pages != "default":  # the default's config (and so its JSON) stays as it was
        cfg["host_pages"] = args.host_pages
    if args.device != "cpu":  # the CPU's config (and so its JSON) stays as it was
        cfg["device"] = args.device
    skipped = {m: r for m in modes if (r := skip_reason(m, args.device))}
    for mode, reason in skipped.items():
        print(f"  {mode}: skipped: {reason}", flush=True)
    modes = [m for m in modes if m not in skipped]
    runs: dict[str, list] = {m: [] for m in modes}
    errors: dict[str, str] = {}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            if mode in errors:
                continue
            started = time.perf_counter()
            res = run_mode(mode, cfg, log)
            if isinstance(res, str):
                errors[mode] = res
                print(f"  round {r + 1}: {mode} FAILED: {res}", flush=True)
                continue
            timed = res["rows"][args.warmup:]
            runs[mode].append(res)
            gpu = res.get("gpu_peak_bytes")
            print(f"  round {r + 1}: {mode:13s} step {statistics.fmean(x['step_s'] for x in timed):.3f}s "
                  f"cpu {statistics.fmean(x['user_s'] + x['sys_s'] for x in timed):.3f}s "
                  f"(sys {statistics.fmean(x['sys_s'] for x in timed):.3f}s, "
                  f"{statistics.fmean(x['faults'] for x in timed):.0f} faults) "
                  f"wait {statistics.fmean(x['wait_s'] for x in timed):.3f}s load {os.getloadavg()[0]:.1f}"
                  + (f" gpu peak {gpu / 2**30:.2f} GiB" if gpu is not None else "")
                  + f" host peak {res['host_peak_bytes'] / 2**30:.2f} GiB"
                  + (f" + worker {res['worker_peak_bytes'] / 2**30:.2f} GiB" if res.get("worker_peak_bytes") else "")
                  + f" ({time.perf_counter() - started:.0f}s with start-up)", flush=True)
    table = {}
    for mode, results in runs.items():
        if not results:
            continue
        timed = [x for res in results for x in res["rows"][args.warmup:]]
        byte_rows = [x["bytes"] for x in timed if x["bytes"] is not None]
        model_bytes = results[0]["model_bytes"]
        table[mode] = {  # means: ZenFlow's costs come every few steps, a median would hide them
            "step_s": statistics.fmean(x["step_s"] for x in timed),
            "opt_s": statistics.fmean(x["opt_s"] for x in timed),
            "wait_s": statistics.fmean(x["wait_s"] for x in timed),
            "loop_s": statistics.fmean(x.get("loop_s", 0.0) for x in timed),
            "step_median_s": median([x["step_s"] for x in timed]),
            "round_step_s": [statistics.fmean(x["step_s"] for x in res["rows"][args.warmup:]) for res in results],
            "cpu_s": statistics.fmean(x["user_s"] + x["sys_s"] for x in timed),
            "sys_s": statistics.fmean(x["sys_s"] for x in timed),
            "faults": statistics.fmean(x["faults"] for x in timed),
            "bytes_per_step": statistics.fmean(byte_rows) if byte_rows else None,
            "model_bytes": model_bytes,
            "steps": len(timed),
            "captured": statistics.fmean(x["captured"] for x in timed) if mode.startswith("zenflow") else None,
            "worker_peak_bytes": max_or_none(res.get("worker_peak_bytes") for res in results),
            "threads": results[0]["threads"],
            "device": args.device,
            "device_name": results[0]["device_name"],
            "gpu_peak_bytes": max_or_none(res["gpu_peak_bytes"] for res in results),
            "host_peak_bytes": max_or_none(res["host_peak_bytes"] for res in results),
            "host_peak_reset": all(res["host_peak_reset"] for res in results),  # False: since the start
        }
    return {"config": cfg, "table": table, "errors": errors, "skipped": skipped}


def max_or_none(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def summary(t: dict) -> dict:
    """The issue's measures from the timing table: step time per mode, the ratios of ZenFlow's
    step to zero_offload's and to none's, ZenFlow's loop wait against zero_offload's, host bytes
    per step over the model's bytes, peak GPU and host memory."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    step = {m: r["step_s"] for m, r in t.items()}
    zf, zo = t.get("zenflow", {}), t.get("zero_offload", {})
    return {
        "step_s": step,
        "zenflow_proc_over_none": ratio(step.get("zenflow_proc"), step.get("none")),
        "zenflow_proc_over_zenflow": ratio(step.get("zenflow_proc"), step.get("zenflow")),
        "faults_over_none": {m: ratio(r["faults"], t["none"]["faults"]) for m, r in t.items()} if "none" in t else {},
        "zenflow_over_zero_offload": ratio(step.get("zenflow"), step.get("zero_offload")),
        "zenflow_over_none": ratio(step.get("zenflow"), step.get("none")),
        # each round runs every mode once, one after the other: a round's ratio compares runs minutes
        # apart at most, so a machine whose speed drifts (other tenants) moves it less than the means'
        "zenflow_over_none_by_round": [z / n for z, n in zip(t.get("zenflow", {}).get("round_step_s", []),
                                                              t.get("none", {}).get("round_step_s", []))],
        "zenflow_wait_s": zf.get("wait_s"), "zero_offload_wait_s": zo.get("wait_s"),
        "zenflow_wait_over_zero_offload": ratio(zf.get("wait_s"), zo.get("wait_s")),
        "host_bytes_over_model": {m: ratio(r["bytes_per_step"], r["model_bytes"]) for m, r in t.items()
                                  if r["bytes_per_step"] is not None},
        "gpu_peak_bytes": {m: r.get("gpu_peak_bytes") for m, r in t.items()},
        "host_peak_bytes": {m: r.get("host_peak_bytes") for m, r in t.items()},
    }


def summary_lines(s: dict, device: str) -> list[str]:
    def x(v):
        return f"{v:.2f}x" if v is not None else "-"

    def gib(v):
        return f"{v / 2**30:.2f} GiB" if v is not None else "-"

    steps = ", ".join(f"{m} {v:.3f} s" for m, v in s["step_s"].items())
    lines = [f"summary ({device}): step {steps}",
             f"  zenflow step / zero_offload step {x(s['zenflow_over_zero_offload'])}, "
             f"zenflow step / none step {x(s['zenflow_over_none'])}"]
    if len(s.get("zenflow_over_none_by_round", [])) > 1:
        rounds = s["zenflow_over_none_by_round"]
        lines.append(f"  zenflow step / none step by round: {', '.join(x(v) for v in rounds)}"
                     f" (median {x(statistics.median(rounds))})")
    if s["zenflow_wait_s"] is not None and s["zero_offload_wait_s"] is not None:
        lines.append(f"  loop wait: zenflow {s['zenflow_wait_s']:.3f} s vs zero_offload {s['zero_offload_wait_s']:.3f} s "
                     f"({x(s['zenflow_wait_over_zero_offload'])})")
    by_design = ["deepspeed 2.00 (by its design)"] if "deepspeed" in s["step_s"] else []
    lines.append("  host bytes per step / model bytes: "
                 + ", ".join([f"{m} {v:.2f}" for m, v in s["host_bytes_over_model"].items()] + by_design))
    if s["zenflow_proc_over_none"] is not None:
        lines.append(f"  zenflow_proc step / none step {x(s['zenflow_proc_over_none'])}, "
                     f"zenflow_proc step / zenflow step {x(s['zenflow_proc_over_zenflow'])}")
    if s["faults_over_none"]:
        lines.append("  page faults per step / none's: " + ", ".join(f"{m} {x(v)}" for m, v in s["faults_over_none"].items()))
    lines.append("  peak memory (timed steps): " + ", ".join(
        f"{m} GPU {gib(s['gpu_peak_bytes'][m])} host {gib(s['host_peak_bytes'][m])}" for m in s["step_s"]))
    return lines


FINETUNE_OFFSET = 1_000_000  # fine-tuning batches are drawn at step + this: never a pretraining batch


def loss_part(args, modes: list[str], log: Path, workload: str) -> dict:
    """Every mode trains ``--loss-steps`` steps of the small GPT from the same start; reported:
    the mean training loss of the last 10 steps and the loss on a held-out batch.

    ``scratch``: from the seeded initial weights on the chain. ``finetune``: ZenFlow's setting
    (the DeepSpeed ZenFlow work fine-tunes pretrained models): first ``--pretrain-steps`` of
    plain AdamW on the chain (one run, its weights shared by every mode), then each mode, with a
    fresh optimizer, on the shifted chain (``--shift`` of the tokens have new successors)."""
    cfg = {"vocab": 512, "seq": 32, "batch": 16, "n_layer": 2, "n_head": 4, "n_embd": 128, "warmup": 0,
           "steps": args.loss_steps, "threads": args.threads}
    if args.device != "cpu":
        cfg["device"] = args.device
    skipped = {m: r for m in modes if (r := skip_reason(m, args.device))}
    for mode, reason in skipped.items():
        print(f"  {workload}: {mode} skipped: {reason}", flush=True)
    modes = [m for m in modes if m not in skipped]
    extra: dict = {}
    if workload == "finetune":
        weights = Path(args.out).with_suffix(".pretrained.pt")
        pre = run_mode("none", {**cfg, "steps": args.pretrain_steps, "save": str(weights)}, log)
        if isinstance(pre, str):
            return {"config": cfg, "table": {}, "errors": {"pretrain": pre}, "skipped": skipped}
        extra = {"pretrain_steps": args.pretrain_steps, "pretrained_held_out": pre["held_out"]}
        cfg = {**cfg, "init": str(weights), "shift": args.shift, "step_offset": FINETUNE_OFFSET}
        print(f"  {workload}: pretrained {args.pretrain_steps} steps, held-out loss {pre['held_out']:.4f}", flush=True)
    out, errors = {}, {}
    for mode in modes:
        res = run_mode(mode, cfg, log)
        if isinstance(res, str):
            errors[mode] = res
            print(f"  {workload}: {mode} FAILED: {res}", flush=True)
            continue
        last = [x["loss"] for x in res["rows"][-10:]]
        out[mode] = {"train_loss": statistics.fmean(last), "held_out": res["held_out"],
                     "model_bytes": res["model_bytes"]}
        if mode == "zenflow":
            out[mode]["captured"] = statistics.fmean(x["captured"] for x in res["rows"])
        print(f"  {workload}: {mode:13s} train {out[mode]['train_loss']:.4f} held-out {res['held_out']:.4f}",
              flush=True)
    return {"config": cfg, "table": out, "errors": errors, "skipped": skipped, **extra}


def markdown(result: dict) -> str:
    t, lo = result["timing"]["table"], result["loss"]["table"]
    ft = result.get("loss_finetune", {}).get("table", {})
    base_wait = t.get("zero_offload", {}).get("wait_s")
    lines = ["| mode | device | step (s) | CPU s/step (sys) | optimizer call (s) | loop wait (s) | wait vs zero_offload "
             "| loop's own host work (s) | host bytes/step | x model | GPU peak (MiB) | host peak RSS (MiB) "
             "| from scratch: loss after {} steps (train / held-out) | vs none | fine-tuning: held-out loss "
             "| vs none |".format(result["loss"]["config"]["steps"]),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    device = result.get("device", "cpu")
    ref = lo.get("none", {}).get("held_out")
    ft_ref = ft.get("none", {}).get("held_out")
    for mode in MODES + LOSS_ONLY_MODES:
        if mode not in t and mode not in lo and mode not in ft:
            continue
        r = t.get(mode, {})
        wait = r.get("wait_s")
        vs = f"{100 * wait / base_wait:.1f}%" if wait is not None and base_wait else "-"
        b = r.get("bytes_per_step")
        by = f"{b / 2**20:.1f} MiB" if b is not None else "2x model (design)"
        ratio = f"{b / r['model_bytes']:.2f}" if b is not None else "2.00"
        if mode in ("none", "accumulate"):
            by, ratio = "0", "0"
        if mode not in t:
            by, ratio = "-", "-"
        loss = lo.get(mode)
        ls = f"{loss['train_loss']:.4f} / {loss['held_out']:.4f}" if loss else "-"
        rel = f"{100 * (loss['held_out'] - ref) / ref:+.2f}%" if loss and ref else "-"
        step = f"{r['step_s']:.3f}" if r else "-"
        opt = f"{r['opt_s']:.3f}" if r else "-"
        wait_s = f"{wait:.3f}" if wait is not None else "-"
        cpu = f"{r['cpu_s']:.3f} ({r['sys_s']:.3f})" if r else "-"
        loop = f"{r['loop_s']:.3f}" if r and "loop_s" in r else "-"
        f = ft.get(mode)
        fs = f"{f['held_out']:.4f}" if f else "-"
        frel = f"{100 * (f['held_out'] - ft_ref) / ft_ref:+.2f}%" if f and ft_ref else "-"
        gpu = f"{r['gpu_peak_bytes'] / 2**20:.0f}" if r.get("gpu_peak_bytes") is not None else "-"
        host = f"{r['host_peak_bytes'] / 2**20:.0f}" if r.get("host_peak_bytes") is not None else "-"
        if r.get("worker_peak_bytes"):
            host += f" + {r['worker_peak_bytes'] / 2**20:.0f}"
        lines.append(f"| {mode} | {device} | {step} | {cpu} | {opt} | {wait_s} | {vs} | {loop} | {by} | {ratio} | {gpu} "
                     f"| {host} | {ls} | {rel} | {fs} | {frel} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setup-deepspeed", action="store_true", help="create .bench-venv (torch + DeepSpeed) and exit")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps: checks the script end to end")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model, its gradients and the device-side optimizer live (the host is the CPU)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (cpu), 1 (cuda)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--loss-steps", type=int, default=200)
    ap.add_argument("--workloads", default="scratch,finetune", help="loss part: scratch, finetune or both")
    ap.add_argument("--pretrain-steps", type=int, default=400, help="finetune: plain AdamW steps before")
    ap.add_argument("--shift", type=float, default=0.125, help="finetune: share of tokens with new successors")
    ap.add_argument("--skip-timing", action="store_true", help="run the loss part only")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=None, help="default 32 (cpu), 512 (cuda)")
    ap.add_argument("--batch", type=int, default=None, help="default 4 (cpu), 8 (cuda)")
    ap.add_argument("--n-layer", type=int, default=None, help="default 8 (cpu), 24 (cuda)")
    ap.add_argument("--n-head", type=int, default=None, help="default 12 (cpu), 16 (cuda)")
    ap.add_argument("--n-embd", type=int, default=None, help="default 768 (cpu), 1024 (cuda)")
    ap.add_argument("--threads", type=int, default=None,
                    help="host threads per worker; default torch's (cpu), the host's cores minus one (cuda)")
    ap.add_argument("--host-threads", type=int, default=1, help="zenflow_proc: its worker process's threads")
    ap.add_argument("--host-cores", default="", help="zenflow_proc: pin its worker process to these CPUs (0,1)")
    ap.add_argument("--host-pages", choices=["default", "keep"], default="default",
                    help="keep: every mode's process keeps the host pages it frees (glibc settings of "
                         "privacy/host_pages.py); default: glibc's own dynamic thresholds")
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "offload_step.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, json.loads(args.config))
    if args.setup_deepspeed:
        return setup_deepspeed()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False in this Python")
    if args.smoke:  # on any device: the CPU's batch shape, a tiny model, a few steps
        args.vocab, args.n_layer, args.n_head, args.n_embd = 256, 2, 2, 64
        args.rounds, args.warmup, args.steps, args.loss_steps, args.pretrain_steps = 1, 1, 8, 12, 6
        args.batch, args.seq = args.batch or CPU_DEFAULTS["batch"], args.seq or CPU_DEFAULTS["seq"]
    for key, value in (CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads is None:  # cuda: one core left to the loop's thread (kernel launches, copies)
        args.threads = max(1, len(os.sched_getaffinity(0)) - 1) if args.device == "cuda" else torch.get_num_threads()
    modes = [m for m in args.modes.split(",") if m]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    log.write_text("")
    load_before = os.getloadavg()
    if args.skip_timing:
        result = {"timing": {"table": {}, "errors": {}}}
    else:
        print(f"timing on {args.device}: GPT {args.n_layer} x {args.n_embd}, batch {args.batch} x {args.seq}, "
              f"{args.rounds} interleaved round(s) of {args.warmup} + {args.steps} steps per mode, "
              f"{args.threads} host threads; worker logs in {log}", flush=True)
        result = {"timing": timing(args, modes, log)}
    result["device"] = args.device
    workloads = [w for w in args.workloads.split(",") if w]
    for workload in workloads:
        print(f"loss ({workload})", flush=True)
        key = "loss" if workload == "scratch" else "loss_finetune"
        result[key] = loss_part(args, [m for m in modes if m != "zenflow_proc"] + LOSS_ONLY_MODES, log, workload)
    result.setdefault("loss", {"config": {"steps": args.loss_steps}, "table": {}})
    result["load"] = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    if result["timing"]["table"]:
        result["summary"] = summary(result["timing"]["table"])
    out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    if "summary" in result:
        print("\n".join(summary_lines(result["summary"], args.device)))
    if args.device == "cuda" and workloads:
        print("loss part on cuda: the same seeds and batches as on the CPU; losses differ from the CPU run's "
              "in the last bits (other kernels, other summation orders)")
    for part in ("timing", "loss", "loss_finetune"):
        share = result.get(part, {}).get("table", {}).get("zenflow", {}).get("captured")
        if share is not None:
            print(f"zenflow, {part} model: the selected columns hold {100 * share:.1f}% of the squared gradient "
                  f"(mean over steps; {100 * ZENFLOW['topk_ratio']:.0f}% if it were spread evenly)")
    print(f"load average before {load_before[0]:.1f}, after {result['load']['after'][0]:.1f} "
          f"({os.cpu_count()} cpus); JSON in {out}")


if __name__ == "__main__":
    main()
