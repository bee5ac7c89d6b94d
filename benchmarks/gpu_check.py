"""``fsdpx train --device cuda`` on one GPU: short runs of every path, PASS/FAIL each, CPU beside CUDA.

    python3 benchmarks/gpu_check.py OUT_DIR          # from the repo root; ~1-3 min on one H100

Runs the tiny default GPT for 20 steps (each run under ``timeout 90``, continuing after a
failure; private runs at noise multiplier 1.0): the same private run on ``--device cpu`` and ``--device cuda`` in one process, the
same for ``--non-private``; under ``torchrun --standalone --nproc-per-node 1`` (NCCL, world
size 1: NCCL refuses two ranks on one GPU) private ``--strategy zero3`` and ``--strategy ddp``;
``--offload zenflow`` and ``--offload zero``; checkpoints saved at step 10 then ``--resume`` to
20 (one process, and zero3 under torchrun); and one Python-API run that checks the GPU held the
tensors (``torch.cuda.max_memory_allocated() > 0``). Then prints loss and epsilon of CPU vs CUDA
step by step.

What to expect: epsilon and every step's Poisson batch size are EQUAL on CPU and CUDA (sampling
and accounting run on the host; the noise is drawn on each device, the same bits).
Losses are not bitwise equal: cuBLAS sums matrix products in another order than the CPU
(TF32 stays off: ``torch.backends.cuda.matmul.allow_tf32`` is False by default and is not set),
and a few CUDA backward kernels accumulate with atomics (not even run to run equal). In float32
over 20 steps of AdamW at lr 1e-2 the loss should agree to ~1e-6 relative (rounding not yet
amplified by training; it grows with the steps); the check passes at ``LOSS_RTOL`` = 1e-3 and
prints the largest difference seen. A resumed CUDA run is compared the same
way with the straight one (bitwise on the CPU; close, not bitwise, on CUDA).

Needs: python3 with torch (CUDA build), numba, scipy, einops, safetensors, xxhash, tqdm,
matplotlib and dp-accounting importable; the repo is put on ``PYTHONPATH`` for every run.
Environment: ``PYTHON`` (default ``sys.executable``), ``STEPS`` (default 20).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("PYTHON", sys.executable)
STEPS = int(os.environ.get("STEPS", "20"))
TIMEOUT_S = 90
LOSS_RTOL = 1e-3  # pass bound per step; the expected agreement is far closer (module docstring)
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]

PROBE = """
import sys, torch
from fsdpx.train import RunConfig, run
s = run(RunConfig.of(steps=2, device="cuda", out=sys.argv[1], name="probe"), progress=False)
peak = torch.cuda.max_memory_allocated()
print(f"probe: loss {s['final_loss']:.4f}, cuda peak {peak / 2**20:.1f} MiB")
assert peak > 0, "nothing was allocated on the GPU"
"""


def fsdpx(*args: str, torchrun: bool = False) -> list[str]:
    return [*(TORCHRUN if torchrun else [PYTHON]), "-m", "fsdpx", "train", "--no-progress", *args]


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    # a fixed noise multiplier: a run saved at step 10 and resumed to 20 then has the straight run's noise
    # (with --target-epsilon a 10-step segment would be calibrated for 10 steps, not 20)
    common = ["--steps", str(STEPS), "--out", str(out), "--noise-multiplier", "1.0"]
    ck = lambda name: ["--ckpt-dir", str(out / f"ck-{name}"), "--ckpt-every", str(max(1, STEPS // 2))]
    half = ["--steps", str(max(1, STEPS // 2))]
    runs: list[tuple[str, list[str]]] = [
        ("cpu-private", fsdpx(*common, "--name", "cpu-private", "--device", "cpu")),
        ("cuda-private", fsdpx(*common, "--name", "cuda-private", "--device", "cuda")),
        ("cpu-plain", fsdpx(*common[:-2], "--name", "cpu-plain", "--device", "cpu", "--non-private")),
        ("cuda-plain", fsdpx(*common[:-2], "--name", "cuda-plain", "--device", "cuda", "--non-private")),
        ("cuda-zero3-nccl", fsdpx(*common, "--name", "cuda-zero3-nccl", "--device", "cuda", "--strategy", "zero3",
                                  torchrun=True)),
        ("cuda-ddp-nccl", fsdpx(*common, "--name", "cuda-ddp-nccl", "--device", "cuda", "--strategy", "ddp",
                                torchrun=True)),
        ("cuda-zenflow", fsdpx(*common, "--name", "cuda-zenflow", "--device", "cuda", "--offload", "zenflow")),
        ("cuda-zero-offload", fsdpx(*common, "--name", "cuda-zero-offload", "--device", "cuda", "--offload", "zero")),
        ("cuda-ckpt-save", fsdpx(*common, *half, "--name", "cuda-resumed", "--device", "cuda", *ck("single"))),
        ("cuda-ckpt-resume", fsdpx(*common, "--name", "cuda-resumed", "--device", "cuda", *ck("single"), "--resume")),
        ("cuda-zero3-ckpt-save", fsdpx(*common, *half, "--name", "cuda-zero3-resumed", "--device", "cuda",
                                       "--strategy", "zero3", *ck("zero3"), torchrun=True)),
        ("cuda-zero3-ckpt-resume", fsdpx(*common, "--name", "cuda-zero3-resumed", "--device", "cuda",
                                         "--strategy", "zero3", *ck("zero3"), "--resume", torchrun=True)),
        ("cuda-python-api", [PYTHON, "-c", PROBE, str(out)]),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "PYTHONUNBUFFERED": "1"}
    results = {}
    for name, cmd in runs:
        start = time.perf_counter()
        log = out / f"{name}.log"
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        why = "" if rc == 0 else f"exit {rc}, see {log}"
        run_name = {"cuda-ckpt-save": "cuda-resumed", "cuda-ckpt-resume": "cuda-resumed",
                    "cuda-zero3-ckpt-save": "cuda-zero3-resumed", "cuda-zero3-ckpt-resume": "cuda-zero3-resumed"
                    }.get(name, name)
        if rc == 0 and name != "cuda-python-api":
            rows = _metrics(out / run_name)
            want = STEPS // 2 if name.endswith("-save") else STEPS
            if len(rows) != want or not all(math.isfinite(r["loss"]) for r in rows):
                why = f"metrics.jsonl has {len(rows)} rows (want {want}) or a non-finite loss"
        results[name] = not why
        print(f"{'PASS' if not why else 'FAIL'}  {name:24s} {time.perf_counter() - start:6.1f} s  {why}", flush=True)
        if why:  # the error lines (a torchrun log ends with the agent's report), then the end
            lines = log.read_text().splitlines()
            shown = [x for x in lines if "Error" in x or "error:" in x][-3:] + lines[-3:]
            print("      " + "\n      ".join(shown), flush=True)

    print()
    ok = all(results.values())
    for a, b in [("cpu-private", "cuda-private"), ("cpu-plain", "cuda-plain"), ("cuda-private", "cuda-zero3-nccl"),
                 ("cuda-private", "cuda-ddp-nccl"), ("cuda-private", "cuda-resumed"),
                 ("cuda-zero3-nccl", "cuda-zero3-resumed"), ("cpu-private", "cuda-zenflow")]:
        if results.get(a) is False or not (out / a / "metrics.jsonl").exists() or not (out / b / "metrics.jsonl").exists():
            print(f"SKIP  {a} vs {b}: a run is missing")
            continue
        ok &= _compare(a, b, _metrics(out / a), _metrics(out / b), offload=b == "cuda-zenflow")
    print("\nALL PASS" if ok else "\nSOME FAILED")
    return 0 if ok else 1


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{**r, "loss": math.nan if r["loss"] is None else r["loss"]} for r in rows]


def _compare(a: str, b: str, ra: list[dict], rb: list[dict], *, offload: bool = False) -> bool:
    """Side by side: final loss and epsilon; same batches and epsilon; losses within LOSS_RTOL.
    ZenFlow updates other columns than AdamW each step: only its batches and epsilon must agree."""
    n = min(len(ra), len(rb))
    rel = max((abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(ra[:n], rb[:n])), default=math.nan)
    same_batches = [x["batch_size"] for x in ra[:n]] == [y["batch_size"] for y in rb[:n]]
    eps = lambda r: r[-1]["epsilon"] if r and r[-1]["epsilon"] is not None else math.inf
    same_eps = [x["epsilon"] for x in ra[:n]] == [y["epsilon"] for y in rb[:n]]
    ok = n == len(ra) == len(rb) and same_batches and same_eps and (offload or rel <= LOSS_RTOL)
    print(f"{'PASS' if ok else 'FAIL'}  {a:>16s} vs {b:<20s} loss {ra[-1]['loss']:.5f} vs {rb[-1]['loss']:.5f}"
          f"  epsilon {eps(ra):.4f} vs {eps(rb):.4f}  max step loss rel diff {rel:.2e}"
          f"{' (zenflow: not compared)' if offload else ''}  batches {'equal' if same_batches else 'DIFFER'}"
          f"  epsilons {'equal' if same_eps else 'DIFFER'}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[2].strip())
    sys.exit(main(Path(sys.argv[1])))
