"""Nanoseconds per standard normal of the noise sampler on the host, beside a baseline.

    PYTHONPATH=. .venv/bin/python benchmarks/noise_draw.py                      # baseline: v2 at 55e9461
    PYTHONPATH=. .venv/bin/python benchmarks/noise_draw.py --baseline-commit REV --rounds 20

Times ``privacy.ziggurat.fill_normals`` of this tree (scheme v3: Philox4x32-10 words, element
addressable) and the ``fill_normals`` of ``privacy/ziggurat.py`` at ``--baseline-commit`` (loaded
from git into a module of its own; v2 was an SFC64 stream seeded by three 64-bit words), on one
thread, block after block of 65536 normals into a float64 buffer, the two interleaved round
after round; prints the median ns per normal of each, the ratio of medians and the median of
the per-round ratios (the steadier figure on a loaded machine). With ``--ops`` it also
times the torch-ops formulation (``privacy.ziggurat_ops.block_normals``), the device path: on
the CPU for information (it runs there only in tests), or with ``--device cuda`` on a GPU, over
``--device-normals`` normals (default one step of GPT-2 small). ``--ops-baseline-commit REV``
times the torch-ops formulation of ``privacy/ziggurat_ops.py`` at ``REV`` beside this tree's, the
two interleaved (e.g. ``d7ce62c``: the loop that read a count from the device every round).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 65536


def _baseline(commit: str, file: str = "privacy/ziggurat.py"):  # noqa: ANN202 - a module
    source = subprocess.run(["git", "show", f"{commit}:{file}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    name = Path(file).stem + "_baseline"
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ns_per_normal(fill, seed: tuple[int, ...], blocks: int) -> tuple[float, float]:
    """Wall and process-CPU nanoseconds per normal (CPU time: steadier on a loaded machine)."""
    out = np.empty(BLOCK)
    start, cpu = time.perf_counter(), time.process_time()
    for b in range(blocks):
        fill(seed[:-1] + (seed[-1] + b,), 0, out)
    n = blocks * BLOCK
    return (time.perf_counter() - start) / n * 1e9, (time.process_time() - cpu) / n * 1e9


def _seed(fill) -> tuple[int, ...]:  # noqa: ANN001
    """A seed the sampler takes: five 32-bit words since v3, three 64-bit words in v2."""
    try:
        fill((1, 2, 3, 4, 5), 0, np.empty(2))
        return (1, 2, 3, 4, 5)
    except ValueError:
        return (1, 2, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-commit", default="55e9461")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=60, help="blocks of 65536 normals per round and sampler")
    ap.add_argument("--ops", action="store_true", help="also time the torch-ops formulation (the device path)")
    ap.add_argument("--ops-baseline-commit", default=None,
                    help="with --ops: also time privacy/ziggurat_ops.py at this commit, interleaved")
    ap.add_argument("--device", default="cpu", help="where --ops draws: cpu, or cuda on a GPU machine")
    ap.add_argument("--device-normals", type=int, default=163_000_000,
                    help="normals per --ops draw off the CPU (default: GPT-2 small's 163M parameters, one step)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from privacy.ziggurat import fill_normals
    from privacy.ziggurat_ops import block_normals

    base = _baseline(args.baseline_commit)
    samplers = {"v3 (this tree)": (fill_normals, (1, 2, 3, 4, 5)),
                f"baseline ({args.baseline_commit})": (base.fill_normals, _seed(base.fill_normals))}
    for fill, seed in samplers.values():
        _ns_per_normal(fill, seed, 2)  # compile
    times: dict[str, list[float]] = {k: [] for k in samplers}
    cpu: dict[str, list[float]] = {k: [] for k in samplers}
    for _ in range(args.rounds):
        for name, (fill, seed) in samplers.items():
            wall, cpu_ns = _ns_per_normal(fill, seed, args.blocks)
            times[name].append(wall)
            cpu[name].append(cpu_ns)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k}: {v:.2f} ns per normal (median of {args.rounds} rounds; min {min(times[k]):.2f}, "
              f"max {max(times[k]):.2f})")
    v3, v2 = med["v3 (this tree)"], med[f"baseline ({args.baseline_commit})"]
    per_round = statistics.median(a / b for a, b in zip(times["v3 (this tree)"], times[f"baseline ({args.baseline_commit})"]))
    print(f"ratio v3 / baseline: {v3 / v2:.2f}x of medians, {per_round:.2f}x median of per-round ratios "
          f"(1 thread, {args.blocks} blocks of {BLOCK} per round)")
    a, b = cpu["v3 (this tree)"], cpu[f"baseline ({args.baseline_commit})"]
    print(f"process CPU time: {statistics.median(a):.2f} / {statistics.median(b):.2f} ns per normal, "
          f"{statistics.median(x / y for x, y in zip(a, b)):.2f}x median of per-round ratios")
    if args.ops:
        _time_ops(block_normals, args)


def _time_ops(block_normals, args: argparse.Namespace) -> None:  # noqa: ANN001
    """ns per normal of the torch-ops draw (and of the baseline commit's, interleaved), median of
    ``--rounds`` rounds."""
    blocks = 16 if args.device == "cpu" else -(-args.device_normals // BLOCK)
    seeds = torch.tensor([[1, 2, 3, 4, 5 + b] for b in range(blocks)], dtype=torch.int64).to(args.device)
    draws = {"torch ops (this tree)": block_normals}
    if args.ops_baseline_commit:
        draws[f"torch ops ({args.ops_baseline_commit})"] = _baseline(args.ops_baseline_commit,
                                                                   "privacy/ziggurat_ops.py").block_normals
    runs: dict[str, list[float]] = {k: [] for k in draws}
    for draw in draws.values():
        draw(seeds, 0, 0, BLOCK, BLOCK)
    for _ in range(args.rounds):
        for name, draw in draws.items():
            _sync(args.device)
            start = time.perf_counter()
            draw(seeds, 0, 0, blocks * BLOCK, BLOCK)
            _sync(args.device)
            runs[name].append((time.perf_counter() - start) / (blocks * BLOCK) * 1e9)
    for name, r in runs.items():
        print(f"{name} on {args.device}: {statistics.median(r):.2f} ns per normal over {blocks * BLOCK} normals "
              f"(median of {args.rounds}; {torch.get_num_threads()} CPU thread)")
    if len(runs) == 2:
        (a, ra), (b, rb) = runs.items()
        print(f"ratio {a} / {b}: {statistics.median(x / y for x, y in zip(ra, rb)):.2f}x median of per-round ratios")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
