"""Every GPU measurement the project has, in one command, within a time budget: one JSON and one table.

    python3 benchmarks/gpu_suite.py OUT_DIR                      # on a GPU machine: ~8 min at most
    python3 benchmarks/gpu_suite.py OUT_DIR --device cpu --smoke # the same plumbing on a CPU, in ~3 min

The parts, in this order (each its own subprocess under a hard time limit, so one that hangs or
fails costs its own slot only; the next part starts anyway):

========== ===================================================== ===========================
part       command                                               measures
========== ===================================================== ===========================
tests      ``pytest -m cuda tests``                               the tests that need CUDA
                                                                 (skipped elsewhere): pass/fail
check      ``gpu_check.py`` (``STEPS=10``)                        every ``fsdpx train`` path
                                                                 on CUDA vs CPU: PASS/FAIL
privacy-*  ``privacy_step.py --device cuda`` (one per model and   private step vs non-private,
           precision in ``PRIVACY_RUNS``)                        Opacus beside it
offload    ``offload_step.py --device cuda --workloads ""``       ZenFlow vs ZeRO-Offload vs
                                                                 none: step, stalls, bytes
sharded    ``sharded_step.py --device cuda --nproc 1``            fsdpx ZeRO-3 / DDP vs FSDP2
                                                                 and DDP at world size 1 (NCCL)
ckpt       ``ckpt_io.py --device cuda``                           save/load of a GPU-resident
                                                                 state vs torch.save, DCP
========== ===================================================== ===========================

Budget: ``--budget-s`` (default 480 s, the issue's 8 minutes) is split by ``SLOTS`` (each part's
share); a part gets its share plus whatever earlier parts left unused, and is stopped with SIGTERM
(then SIGKILL) at its limit. A part that ran out of time or failed is recorded with its return
code and the last lines of its output. Writes ``OUT_DIR/suite.json`` (each part: command, return
code, seconds, the JSON the part wrote, its printed tables) and ``OUT_DIR/suite.md`` (a summary
table, then each part's own tables): copy the figures from there into ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PYTHON = sys.executable

# (model, precision) of privacy_step.py's runs on the GPU: the GPT-2-small-shaped step
PRIVACY_RUNS: list[tuple[str, str]] = [("gpt", "fp32"), ("hf-gpt2", "fp32"), ("hf-gpt2", "bf16"), ("hf-llama", "bf16")]
# each part's share of the budget, in seconds at the default 480 s budget (scaled otherwise)
SLOTS = {"tests": 40, "check": 90, "privacy": 210, "offload": 60, "sharded": 40, "ckpt": 40}
TAIL_LINES = 40


def part_commands(out: Path, device: str, smoke: bool) -> list[tuple[str, str, list[str], dict[str, str]]]:
    """``(name, slot, argv, extra env)`` of every part, in run order."""
    py = [PYTHON]
    parts: list[tuple[str, str, list[str], dict[str, str]]] = []
    if device == "cuda":
        parts.append(("tests", "tests", [*py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                         str(ROOT / "tests")], {}))
        parts.append(("check", "check", [*py, str(BENCH / "gpu_check.py"), str(out / "check")], {"STEPS": "10"}))
    for model, precision in PRIVACY_RUNS:
        size = ["--smoke"] if smoke else ["--steps", "20", "--memory-steps", "2"]
        extra = [] if model == "gpt" else ["--model", model]
        extra += [] if precision == "fp32" else ["--precision", precision]
        if extra and not _privacy_step_knows("--model" if model != "gpt" else "--precision"):
            continue  # this checkout's privacy_step.py has no such flag yet
        parts.append((f"privacy-{model}-{precision}", "privacy",
                      [*py, str(BENCH / "privacy_step.py"), "--device", device, *size, *extra,
                       "--out", str(out / f"privacy-{model}-{precision}.json")], {}))
    parts.append(("offload", "offload",
                  [*py, str(BENCH / "offload_step.py"), "--device", device, "--workloads", "",
                   *(["--smoke"] if smoke else []), "--out", str(out / "offload.json")], {}))
    parts.append(("sharded", "sharded",
                  [*py, str(BENCH / "sharded_step.py"), "--device", device, "--nproc", "1",
                   *(["--small", "--steps", "2"] if smoke else ["--steps", "10", "--warmup", "2"]),
                   "--skip-memory", "--out", str(out / "sharded.json")], {}))
    parts.append(("ckpt", "ckpt",
                  [*py, str(BENCH / "ckpt_io.py"), "--device", device,
                   *(["--size-mib", "16", "--rounds", "1"] if smoke else ["--size-mib", "1024", "--rounds", "3"]),
                   "--out", str(out / "ckpt.json")], {}))
    return parts


def _privacy_step_knows(flag: str) -> bool:
    return flag in (BENCH / "privacy_step.py").read_text()


def run_part(argv: list[str], env_extra: dict[str, str], limit_s: float, log_path: Path) -> tuple[int, float]:
    """Run ``argv`` in its own process group with output to ``log_path``; stop it at ``limit_s``.
    Returns ``(return code, seconds)``; 124 when it was stopped at its limit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **env_extra}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = 124
    return rc, time.perf_counter() - t0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's whole process group (torchrun's children included), SIGKILL 10 s later."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def tables_of(log_text: str) -> str:
    """The markdown tables (and the lines around them) a part printed: every line from the first
    line starting with ``|`` on; the whole tail when it printed none."""
    lines = log_text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if first is None:
        return "\n".join(lines[-TAIL_LINES:])
    return "\n".join(line for line in lines[max(0, first - 3):] if not line.startswith("["))


def summary(records: list[dict]) -> str:
    rows = ["| part | result | seconds | limit s | JSON |", "|---|---|---:|---:|---|"]
    for r in records:
        result = {0: "ok", 124: "stopped at its limit"}.get(r["rc"], f"failed (rc {r['rc']})")
        if r["rc"] is None:
            result = "skipped: no budget left"
        rows.append(f"| {r['name']} | {result} | {r['seconds']:.0f} | {r['limit_s']:.0f} | "
                    f"{'yes' if r.get('json') is not None else '-'} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the plumbing")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--only", nargs="+", help="run only the parts whose names start with these")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scale = args.budget_s / sum(SLOTS.values())
    parts = part_commands(args.out, args.device, args.smoke)
    if args.only:
        parts = [p for p in parts if any(p[0].startswith(o) for o in args.only)]
    slot_counts = {s: sum(1 for p in parts if p[1] == s) for s in SLOTS}
    start, spare, records = time.perf_counter(), 0.0, []
    for name, slot, argv, env_extra in parts:
        share = SLOTS[slot] * scale / slot_counts[slot]
        left = args.budget_s - (time.perf_counter() - start)
        limit = min(share + spare, left)
        rec = {"name": name, "argv": argv, "limit_s": limit, "rc": None, "seconds": 0.0}
        if limit < 15:
            records.append(rec)
            print(f"[gpu_suite] {name}: skipped, {left:.0f} s of the budget left", file=sys.stderr, flush=True)
            continue
        print(f"[gpu_suite] {name}: up to {limit:.0f} s: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
        log_path = args.out / f"{name}.log"
        rec["rc"], rec["seconds"] = run_part(argv, env_extra, limit, log_path)
        spare = max(0.0, limit - rec["seconds"])
        text = log_path.read_text(errors="replace")
        rec["tables"] = tables_of(text)
        json_path = next((Path(a) for a in argv if a.endswith(".json")), None)
        rec["json"] = json.loads(json_path.read_text()) if json_path and json_path.exists() else None
        records.append(rec)
        print(f"[gpu_suite] {name}: rc {rec['rc']} in {rec['seconds']:.0f} s", file=sys.stderr, flush=True)
    total = time.perf_counter() - start
    head = (f"gpu_suite: {args.device}{' (smoke)' if args.smoke else ''}, {total:.0f} s of a {args.budget_s:.0f} s "
            f"budget, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    md = [head, "", summary(records)]
    for r in records:
        if r["rc"] is not None:
            md += ["", f"## {r['name']}", "", r["tables"]]
    (args.out / "suite.md").write_text("\n".join(md) + "\n")
    (args.out / "suite.json").write_text(json.dumps({"head": head, "parts": records}, indent=1, default=str))
    print("\n".join(md))
    return 0 if all(r["rc"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
