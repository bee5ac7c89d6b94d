"""What a short ``fsdpx train`` costs beyond its steps: start-up (imports, the launcher's checks,
torchrun) and exit, this checkout against a baseline checkout, side by side.

    .venv/bin/python benchmarks/cli_startup.py --baseline /tmp/base --repeats 3

``--baseline`` is another checkout of the repository (e.g. ``git archive <commit> | tar -x -C
/tmp/base``). Each repeat runs, for each of this checkout and the baseline in turn (the order
alternates from one repeat to the next), a 1-step run of a one-layer GPT of width 8 in one
process and with ``--strategy zero2 --nproc 2``: its wall time and the CPU time of the whole
process tree (``RUSAGE_CHILDREN``: the launcher, torchrun's agent and the workers). Printed: the
medians of each, and this checkout's over the baseline's (below 1: cheaper), with the load
average (1 min) before and after. On a shared machine the wall times move with the load; the
CPU times much less.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--steps", "1", "--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8", "--corpus-chars",
       "4000", "--batch-size", "16", "--no-progress"]
KINDS = {"one process": [], "--nproc 2": ["--strategy", "zero2", "--nproc", "2"]}


def timed_run(checkout: Path, extra: list[str], out: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process tree) of ``python -m fsdpx train RUN EXTRA`` with
    ``checkout`` first on ``PYTHONPATH``; fails if the run does."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fsdpx", "train", *RUN, *extra, "--out", str(out)], cwd=checkout,
                          env={**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, done.stderr[-2000:]
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout of the repository")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sides = {"this": ROOT, "baseline": args.baseline.resolve()}
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for kind, extra in KINDS.items():
                for side in order:
                    out = Path(tmp) / f"{side}-{r}-{len(extra)}"
                    got.setdefault((kind, side), []).append(timed_run(sides[side], extra, out))
    load1 = os.getloadavg()[0]
    print(f"load average {load0:.1f} -> {load1:.1f}, {args.repeats} repeats, medians")
    print(f"{'run':<12} {'wall this':>10} {'wall base':>10} {'ratio':>6} {'CPU this':>9} {'CPU base':>9} {'ratio':>6}")
    for kind in KINDS:
        this, base = got[(kind, "this")], got[(kind, "baseline")]
        w = [statistics.median(x[0] for x in s) for s in (this, base)]
        c = [statistics.median(x[1] for x in s) for s in (this, base)]
        print(f"{kind:<12} {w[0]:>9.2f}s {w[1]:>9.2f}s {w[0] / w[1]:>6.2f} {c[0]:>8.2f}s {c[1]:>8.2f}s {c[0] / c[1]:>6.2f}")


if __name__ == "__main__":
    main()
