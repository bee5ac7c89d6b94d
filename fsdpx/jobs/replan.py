"""Re-planning the work left (pure): one function for the event simulation (``simulate.py``)
and the real runs (``runner.py``).

A job's full options (``{job: [Option]}`` for its whole ``steps``) are rescaled to the steps it
has left: ``startup + left x per-step seconds x drift factor``, where the per-step seconds are
``(seconds - startup) / steps``. A job still running may stay where it is: its current option
(same technique, device count and params) then costs the steps it has left from where it is,
without a new startup; any other option (or the same one started later) is a move by
checkpoint-and-restart and costs a startup plus the steps left from its last checkpoint. After
solving, the device ids are relabelled so that every job that stays keeps the ids it holds
(``keep_placement``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from .greedy import in_order, makespan, place
from .plan import Assignment, Option, Options, Plan
from .solver import solve

EPS = 1e-9


@dataclass(frozen=True)
class Running:
    """A job running now: its ``option`` (the one it was started with), the device ``ids`` it
    holds, and ``left`` -- the steps it still has to train if it stays (its steps left after a
    move are the caller's ``left``, counted from its last checkpoint)."""

    option: Option
    ids: tuple[int, ...]
    left: int


def same_choice(a: Option, b: Option) -> bool:
    """Whether two options run a job the same way (technique, device count, params)."""
    return (a.technique, a.devices, a.params) == (b.technique, b.devices, b.params)


def remaining_options(options: Options, steps: Mapping[str, int], left: Mapping[str, int],
                      factor: Mapping[str, float] | None = None,
                      running: Mapping[str, Running] | None = None) -> dict[str, list[Option]]:
    """Every job of ``left`` (``left[job] >= 1``) with its ``options`` rescaled from
    ``steps[job]`` steps to ``left[job]`` steps (times ``factor[job]``, default 1), each keeping
    its startup; for a job in ``running``, its current choice instead costs ``running.left``
    steps and no startup. Jobs with ``left[job] < 1`` are dropped.

    Guarantee: with ``left == steps``, no factor and nothing running, the options are returned
    unchanged (``tests/test_jobs_run.py::test_remaining_options_rescale_the_steps_left``).
    Raises ``ValueError`` for a job of ``left`` that has no options or no ``steps``."""
    factor, running = factor or {}, running or {}
    out: dict[str, list[Option]] = {}
    for job, n in left.items():
        if n < 1:
            continue
        if job not in options or job not in steps:
            raise ValueError(f"job {job!r} has steps left but no options or no step count")
        f = factor.get(job, 1.0)
        now = running.get(job)
        opts = []
        for o in options[job]:
            per_step = (o.seconds - o.startup) / steps[job] * f
            if now is not None and same_choice(o, now.option):
                opts.append(Option(o.technique, o.devices, max(now.left * per_step, EPS), o.params, 0.0))
            else:
                opts.append(Option(o.technique, o.devices, o.startup + n * per_step, o.params, o.startup))
        out[job] = opts
    return out


def profiled_step(options: Options, steps: Mapping[str, int], job: str, option: Option) -> float:
    """The profiled seconds per step of ``job`` run the way ``option`` runs it (technique,
    count, params; ``option`` may be a re-planned, shortened one): ``(seconds - startup) /
    steps`` of its full option. Raises ``ValueError`` when ``options[job]`` has no such choice."""
    for o in options.get(job, ()):
        if same_choice(o, option):
            return (o.seconds - o.startup) / steps[job]
    raise ValueError(f"job {job!r} has no option {option.technique} on {option.devices}")


def drifted(factor: float, assumed: float, threshold: float) -> bool:
    """Whether a job whose steps take ``factor`` times its profile has drifted from what the
    current plan ``assumed`` (a factor too) by more than ``threshold``, a fraction:
    ``|factor / assumed - 1| > threshold``. The rule both the simulation and real runs re-plan
    on; after a re-plan the plan assumes the measured factor, so a job re-plans once per drift
    level, never again for the same pace (``tests/test_jobs_run.py::test_a_drifting_job_replans_once_with_its_measured_pace``)."""
    return abs(factor / assumed - 1) > threshold


def stays(plan: Plan, running: Mapping[str, Running]) -> set[str]:
    """The running jobs ``plan`` leaves where they are: their current choice, starting now."""
    return {a.job for a in plan.assignments
            if a.job in running and a.start <= EPS and same_choice(a.option, running[a.job].option)}


def keep_placement(plan: Plan, running: Mapping[str, Running]) -> Plan:
    """``plan`` with its device ids relabelled (one permutation of ``0..G-1`` for the whole
    plan) so that every job of ``stays(plan, running)`` holds exactly its current ids.

    A permutation keeps a plan valid (jobs overlapping in time still hold disjoint ids), and
    the staying jobs all start at 0, so their planned id sets are disjoint, as are their
    current ones. Raises ``ValueError`` if two running jobs hold one id."""
    keep = stays(plan, running)
    held = [i for j in sorted(running) for i in running[j].ids]
    if len(held) != len(set(held)):
        raise ValueError(f"running jobs hold overlapping device ids: {dict(running)}")
    by_job = plan.by_job()
    perm: dict[int, int] = {}
    for job in sorted(keep):
        perm.update(zip(sorted(by_job[job].device_ids), sorted(running[job].ids)))
    free_from = [i for i in range(plan.cluster_size) if i not in perm]
    free_to = [i for i in range(plan.cluster_size) if i not in set(perm.values())]
    perm.update(zip(free_from, free_to))
    moved = tuple(Assignment(a.job, a.option, a.start, tuple(sorted(perm[i] for i in a.device_ids)))
                  for a in plan.assignments)
    return dataclasses.replace(plan, assignments=moved)


def replan(options: Options, steps: Mapping[str, int], left: Mapping[str, int], cluster_size: int, *,
           factor: Mapping[str, float] | None = None, running: Mapping[str, Running] | None = None,
           solve_options: Mapping | None = None) -> Plan:
    """The plan for the work left: ``solve`` on ``remaining_options`` (``unpaused``: no running
    job is priced as staying unless it stays), with the jobs that stay on their current ids
    (``keep_placement``). Times are seconds from now.

    Guarantees: a valid plan of the remaining options; every running job whose current choice
    the plan keeps either starts now (it stays, on the ids it holds, never restarted) or is
    priced as a restart (startup and the steps from its checkpoint). Every other running job
    is moved (the caller stops it and restarts it from its last checkpoint). Proven in
    ``tests/test_jobs_simulate.py`` (simulated events) and ``tests/test_jobs_run.py`` (real
    runs, ``::test_a_running_job_is_never_paused_at_the_price_of_staying``)."""
    running = {j: r for j, r in (running or {}).items() if left.get(j, 0) >= 1}
    opts = remaining_options(options, steps, left, factor, running)
    plan = solve(opts, cluster_size, **(solve_options or {}))
    plan = unpaused(plan, remaining_options(options, steps, left, factor), running, solve_options)
    return keep_placement(plan, running)


def unpaused(plan: Plan, restarts: Options, running: Mapping[str, Running],
             solve_options: Mapping | None = None) -> Plan:
    """``plan`` without running jobs paused at the price of staying.

    A running job's current choice is priced as staying (no startup, its steps left from where
    it is); the solver may still place it later, after other jobs, which is really a stop and a
    restart from its checkpoint. When ``plan`` does that, two schedules are built from the
    plan's order (``greedy.in_order``, no new solve): every job kept on its current choice
    starts now (their devices are free: they hold them), or the paused ones are priced as the
    restarts they are (``restarts``: the options with no job running). The better by the
    plan's objective is returned (staying on a tie: no restart); otherwise ``plan`` itself."""
    by_job = plan.by_job()
    kept = {j for j, r in running.items() if j in by_job and same_choice(by_job[j].option, r.option)}
    paused = {j for j in kept if by_job[j].start > EPS and by_job[j].option not in restarts[j]}  # priced as staying
    if not paused:
        return plan
    order = [(a.job, a.option) for a in sorted(plan.assignments, key=lambda a: (a.start, a.job))]
    stay_now = in_order([c for c in order if c[0] in kept] + [c for c in order if c[0] not in kept], plan.cluster_size)
    restart = {j: next(o for o in restarts[j] if same_choice(o, by_job[j].option)) for j in paused}
    restarted = in_order([(j, restart.get(j, o)) for j, o in order], plan.cluster_size)
    opts = dict(solve_options or {})
    weights = opts.get("weights") or {}
    score = makespan if opts.get("objective", "makespan") == "makespan" else \
        (lambda s: sum(weights.get(j, 1.0) * (b + o.seconds) for j, o, b in s))
    best, how = (stay_now, "start now") if score(stay_now) <= score(restarted) else (restarted, "restart later")
    note = f"running jobs {sorted(paused)} were placed later at the price of staying: they {how}"
    return dataclasses.replace(plan, assignments=place(best, plan.cluster_size), notes=(*plan.notes, note))
