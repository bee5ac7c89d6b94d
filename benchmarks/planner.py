"""Multi-job planner benchmark (issue 13, part a): synthetic instances.

    .venv/bin/python benchmarks/planner.py                    # J in {8,16,32} x G in {8,16,64}
    .venv/bin/python benchmarks/planner.py --jobs 8 --devices 8 --time-limit 2   # smoke run

For every (J, G): the plan's solve time (greedy + both MILP stages), and the makespan over the
proven lower bound (``fsdpx.jobs.bounds.makespan_lower_bound``) of the returned plan (MILP or,
when it is not better, greedy), of the greedy list schedule alone, and of Saturn's two
baselines: one job after another on all devices with its best technique, and an equal split
of the devices. Instances from ``fsdpx.jobs.synthetic.synthetic_options`` (seeded).
Targets: plan <= 1.05x the bound where J >= G/4, never worse than greedy, solve < 10 s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdpx.jobs.greedy import equal_split, greedy, makespan, one_after_another  # noqa: E402
from fsdpx.jobs.solver import solve  # noqa: E402
from fsdpx.jobs.synthetic import synthetic_options  # noqa: E402


def row(J: int, G: int, seed: int, time_limit: float) -> dict:
    options = synthetic_options(J, G, seed)
    plan = solve(options, G, time_limit=time_limit)
    lb = plan.lower_bound
    return {"J": J, "G": G, "seed": seed, "solve_s": plan.solve_seconds, "plan": plan.makespan / lb,
            "greedy": makespan(greedy(options, G)) / lb, "sequential": makespan(one_after_another(options, G)) / lb,
            "split": makespan(equal_split(options, G)) / lb, "method": plan.method,
            "milp": "; ".join(n.split(", ")[-1][:40] for n in plan.notes if n.startswith("MILP:"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--seeds", type=int, default=1, help="instances per cell (seeds 0..N-1)")
    p.add_argument("--time-limit", type=float, default=8.0, help="MILP seconds, split over its two stages")
    args = p.parse_args()
    print("| J | G | seed | solve s | plan / LB | greedy / LB | one after another / LB | equal split / LB | "
          "plan from | MILP stages | J >= G/4: plan <= 1.05 LB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for J in args.jobs:
        for G in args.devices:
            for seed in range(args.seeds):
                r = row(J, G, seed, args.time_limit)
                target = ("met" if r["plan"] <= 1.05 else "**missed**") if J >= G / 4 else "n/a"
                print(f"| {J} | {G} | {seed} | {r['solve_s']:.2f} | {r['plan']:.3f} | {r['greedy']:.3f} | "
                      f"{r['sequential']:.3f} | {r['split']:.3f} | {r['method']} | {r['milp']} | {target} |",
                      flush=True)


if __name__ == "__main__":
    main()
