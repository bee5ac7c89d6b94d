"""Multi-job planner benchmark (issue 13): (a) synthetic instances, (b) the real 4-job run.

    .venv/bin/python benchmarks/planner.py                    # (a) J in {8,16,32} x G in {8,16,64}
    .venv/bin/python benchmarks/planner.py --jobs 8 --devices 8 --time-limit 2   # (a) smoke run
    .venv/bin/python benchmarks/planner.py --first-seed 10 --seeds 3            # (a) other instances
    .venv/bin/python benchmarks/planner.py --real --repeats 3                   # (b) on this machine's cores

(a) For every (J, G): the plan's solve time (greedy, search, bound, both MILP stages, the last
search), and the makespan over the proven lower bound LB (``Plan.lower_bound``: the timeline
bound, ``fsdpx.jobs.bounds.timeline_lower_bound``) of the returned plan, of the greedy list
schedule alone, and of Saturn's two baselines: one job after another on all devices with its
best technique, and an equal split of the devices. Beside them, the plan and LB over the area
bound (``bounds.makespan_lower_bound``, the bound before the timeline one): what the plan
gained and what the bound gained. The load average (1 min) is the mean of before and after the
solve. Instances from ``fsdpx.jobs.synthetic.synthetic_options`` (seeded).
Targets: plan <= 1.05x the bound where J >= G/4, never worse than greedy, solve < 10 s.

(b) The four jobs ``tests/support/jobs.py::FOUR_JOBS`` (different sizes, one private) on G = 2 devices
(this machine's cores): each repeat profiles them afresh (``--profile-counts``, ddp and
ddp-private), runs the plan with the local backend (``fsdpx.jobs.runner``), then the same jobs
one after another on all G devices with their best technique (Saturn's first baseline,
``greedy.one_after_another`` of the same options). It reports the wall time of each, their
ratio, and each one's predicted time (the plan's makespan; the sum of the baseline's options)
against the measured, with the load average around the repeat (other processes on the cores
make every figure slower than its profile).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdpx.jobs.bounds import makespan_lower_bound  # noqa: E402
from fsdpx.jobs.greedy import equal_split, greedy, makespan, one_after_another  # noqa: E402
from fsdpx.jobs.solver import solve  # noqa: E402
from fsdpx.jobs.synthetic import synthetic_options  # noqa: E402


def row(J: int, G: int, seed: int, time_limit: float) -> dict:
    options = synthetic_options(J, G, seed)
    load = os.getloadavg()[0]
    plan = solve(options, G, time_limit=time_limit)
    lb, area = plan.lower_bound, makespan_lower_bound(options, G)
    return {"J": J, "G": G, "seed": seed, "solve_s": plan.solve_seconds, "plan": plan.makespan / lb,
            "plan_area": plan.makespan / area, "bound_area": lb / area,
            "greedy": makespan(greedy(options, G)) / lb, "sequential": makespan(one_after_another(options, G)) / lb,
            "split": makespan(equal_split(options, G)) / lb, "method": plan.method,
            "milp": "; ".join(n.split(", ")[-1][:20] for n in plan.notes if n.startswith("MILP:")),
            "load": (load + os.getloadavg()[0]) / 2}


def real_run(root: Path, counts: set[int], time_limit: float) -> dict:
    """One repeat of (b) under ``root``: fresh profiles, the plan run, the one-after-another run."""
    import os
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import fsdpx.jobs as jobs
    from fsdpx.jobs.backends import Attempt, LocalBackend
    from fsdpx.jobs.cli import profiled_options
    from fsdpx.jobs.devices import physical_ids
    from fsdpx.jobs.runner import run_jobs
    from support.jobs import FOUR_JOBS, tiny_gpt

    tasks = [tiny_gpt(name, steps, **kw) for name, steps, kw in FOUR_JOBS]
    cluster = jobs.Devices(len(os.sched_getaffinity(0)), 2**30)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    options, _ = profiled_options(tasks, cluster, counts, root / "profiles", ["ddp", "ddp-private"])
    print(f"profiled in {time.perf_counter() - t0:.0f} s: " + "; ".join(
        f"{j} {o.technique}x{o.devices} {o.seconds:.1f} s (startup {o.startup:.1f})" for j, os_ in options.items()
        for o in os_), file=sys.stderr, flush=True)
    report = run_jobs(tasks, options, cluster, root / "plan", stream=None, solve_options={"time_limit": time_limit})
    print(f"plan: {report.makespan:.1f} s measured, {report.predicted:.1f} s predicted; re-plans: "
          + "; ".join(r.reason for r in report.replans[1:]), file=sys.stderr, flush=True)
    if not report.ok:
        raise RuntimeError({n: o.error for n, o in report.jobs.items() if o.error})
    print_jobs(report)
    sequence = one_after_another(options, cluster.count)
    by_name = {t.name: t for t in tasks}
    start = time.perf_counter()
    for job, o, _ in sequence:
        devices = cluster.group(o.devices, physical_ids(cluster, range(o.devices)))
        handle = LocalBackend().start(Attempt(by_name[job], o.technique, devices, dict(o.params), by_name[job].steps,
                                              root / "sequential" / job / "ckpt"))
        while (msg := handle.poll()) is None:
            time.sleep(0.1)
        if msg[0] != "ok" or not msg[1].ok:
            raise RuntimeError(f"{job} alone: {msg}")
    sequential = time.perf_counter() - start
    return {"load": (load + os.getloadavg()[0]) / 2, "predicted": report.predicted, "makespan": report.makespan,
            "sequential_predicted": makespan(sequence), "sequential": sequential,
            "replans": f"{len(report.replans) - 1} ({sum(len(r.moved) for r in report.replans)} moved)",
            "plan": "; ".join(f"{a.job} {a.option.technique}x{a.option.devices}@{a.start:.1f}"
                              for a in report.replans[0].plan.assignments)}


def print_jobs(report) -> None:
    """Each job's planned ``[start, end)`` beside its measured one (first plan; every segment):
    whether the makespan's error is in the jobs' durations or in when they started."""
    planned = {a.job: a for a in report.replans[0].plan.assignments}
    for name, outcome in report.jobs.items():
        a, segs = planned[name], outcome.segments
        got = sum(s.end - s.start for s in segs)
        print(f"  {name:8s} {a.option.technique}x{a.option.devices} planned [{a.start:5.1f}, {a.end:5.1f}) "
              f"{a.end - a.start:5.1f} s (startup {a.option.startup:.1f}); measured "
              + ", ".join(f"[{s.start:5.1f}, {s.end:5.1f})" for s in segs)
              + f" {got:5.1f} s ({got / (a.end - a.start) - 1:+.0%})", file=sys.stderr, flush=True)


def main_real(args) -> None:
    import tempfile

    print("| repeat | load avg | plan: predicted s | plan: measured s | error | one after another: predicted s "
          "| one after another: measured s | error | plan / one after another (measured) | re-plans | first plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="planner-real-") as tmp:
            r = real_run(Path(tmp), set(args.profile_counts), args.time_limit)
        print(f"| {k} | {r['load']:.1f} | {r['predicted']:.1f} | {r['makespan']:.1f} | "
              f"{r['makespan'] / r['predicted'] - 1:+.0%} | {r['sequential_predicted']:.1f} | {r['sequential']:.1f} | "
              f"{r['sequential'] / r['sequential_predicted'] - 1:+.0%} | {r['makespan'] / r['sequential']:.2f} | "
              f"{r['replans']} | {r['plan']} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--seeds", type=int, default=1, help="instances per cell (seeds FIRST..FIRST+N-1)")
    p.add_argument("--first-seed", type=int, default=0, help="FIRST: the first instance seed")
    p.add_argument("--time-limit", type=float, default=8.0, help="MILP seconds, split over its two stages")
    p.add_argument("--real", action="store_true", help="(b): the real 4-job run against one after another")
    p.add_argument("--repeats", type=int, default=3, help="(b): repeats, each profiling afresh")
    p.add_argument("--profile-counts", type=int, nargs="+", default=[1, 2], help="(b): device counts profiled")
    args = p.parse_args()
    if args.real:
        return main_real(args)
    print("| J | G | seed | load avg | solve s | plan / LB | plan / area LB | LB / area LB | greedy / LB | "
          "one after another / LB | equal split / LB | plan from | MILP stages | J >= G/4: plan <= 1.05 LB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for J in args.jobs:
        for G in args.devices:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                r = row(J, G, seed, args.time_limit)
                target = ("met" if r["plan"] <= 1.05 else "**missed**") if J >= G / 4 else "n/a"
                print(f"| {J} | {G} | {seed} | {r['load']:.1f} | {r['solve_s']:.2f} | {r['plan']:.3f} | "
                      f"{r['plan_area']:.3f} | {r['bound_area']:.3f} | {r['greedy']:.3f} | {r['sequential']:.3f} | "
                      f"{r['split']:.3f} | {r['method']} | {r['milp']} | {target} |", flush=True)


if __name__ == "__main__":
    main()
