"""Profiling runs and their on-disk cache (the impure edge of profiles).

A measurement is cached in ``<root>/<key>.json``, the key a hash of the job's identity (its
functions' qualified names, parameter shapes, hparams, batch size and privacy), the
technique, its params, the device count and the hardware fingerprint: a profile is reused
only for the same job on the same hardware.

``profile_side_by_side`` measures jobs the way a plan runs them: each profile pinned to its own
group of devices, as many side by side as the devices allow, so that a profile shares the
machine (memory bandwidth, caches, the disk, and on a CPU whatever else runs on the cores) as
its job will when the plan runs jobs next to each other. A job's startup (processes, imports,
model build: seconds on a CPU) is most of a small job's time, and the time it takes depends on
what runs beside it; measured alone on an idle machine it is short of what a plan sees.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from . import techniques
from .devices import Devices, hardware_fingerprint
from .memory import model_shape
from .profile import Measurement
from .task import Task


CACHE_VERSION = 4
"""Bumped when cached measurements change meaning (2: ``startup_seconds``; 3: measured pinned,
side by side; 4: startup from the whole attempt's wall time, after a warm-up): older entries
are not reused."""


def job_hash(task: Task) -> str:
    """A hash of what a job's step time depends on (not its name or step count)."""
    fn = lambda f: f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"  # noqa: E731
    text = json.dumps({"fns": [fn(task.model_fn), fn(task.data_fn), fn(task.loss_fn)],
                       "shapes": sorted(model_shape(task).param_shapes.items()), "hparams": sorted(task.hparams.items()),
                       "batch": task.batch_size, "privacy": repr(task.privacy)}, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_key(task: Task, technique: str, params: Mapping[str, Any], devices: Devices) -> str:
    text = json.dumps([CACHE_VERSION, job_hash(task), technique, sorted(params.items()), devices.count,
                       hardware_fingerprint(devices)], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cached(task: Task, technique: str, devices: Devices, root: Path) -> tuple[Path, dict, Measurement | None]:
    """``(cache path, the technique's params on devices, the cached measurement or None)``."""
    params = dict(techniques.get(technique).search(task, devices))
    path = Path(root) / f"{cache_key(task, technique, params, devices)}.json"
    if not path.exists():
        return path, params, None
    d = json.loads(path.read_text())
    return path, params, Measurement(d["step_seconds"], d["peak_bytes"], True, tuple(sorted(params.items())),
                                     d["startup_seconds"])


def _measure(result: Any, task: Task, technique: str, devices: Devices, params: dict, path: Path,
             wall: float) -> Measurement:
    """The measurement of a profiling run's ``result`` that took ``wall`` seconds from its start
    to its end as the caller saw them (see ``profile``), written to ``path``."""
    from .execute import step_seconds

    if not getattr(result, "ok", False):
        raise RuntimeError(f"profiling {task.name!r} with {technique} on {devices.count}: "
                           f"{getattr(result, 'error', result)}")
    times = step_seconds(result.run_dir)
    step = statistics.median(times[1:] or times)
    m = Measurement(step, max(result.peak_bytes), True, tuple(sorted(params.items())),
                    max(0.0, max(wall, result.seconds) - step * len(times)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step_seconds": m.step_seconds, "peak_bytes": m.peak_bytes,
                                "startup_seconds": m.startup_seconds, "job": task.name,
                                "technique": technique, "devices": devices.count, "params": params}))
    return m


def profile(task: Task, technique: str, devices: Devices, *, root: Path, steps: int = 4) -> Measurement:
    """The cached measurement of ``task`` under ``technique`` on ``devices``, or a new one: the
    technique's ``execute`` runs ``min(steps, task.steps)`` real steps in a scratch directory;
    step time is the median of the steps after the first (the first one warms up), peak
    bytes the worst rank's, startup the run's wall time beyond ``steps x`` that median (so
    ``startup + steps x step`` is the profiled run's wall time: all of ``execute``, as a plan
    waits for it, including what the technique does before its processes start, such as a
    private job's noise calibration). Raises ``RuntimeError`` with
    the run's error when it fails (nothing is cached then)."""
    path, params, m = cached(task, technique, devices, root)
    if m is not None:
        return m
    import time

    with tempfile.TemporaryDirectory() as scratch:
        began = time.perf_counter()
        result = techniques.get(technique).execute(task, devices, params, min(steps, task.steps),
                                                   Path(scratch) / "ckpt")
        return _measure(result, task, technique, devices, params, path, time.perf_counter() - began)


Request = tuple[Task, str, int]
"""``(task, technique, device count)`` to profile."""


def profile_side_by_side(requests: Sequence[Request], cluster: Devices, *, root: Path, steps: int = 4,
                         poll: float = 0.05, progress: Callable[[str], None] | None = None
                         ) -> dict[tuple[str, str, int], Measurement]:
    """``profile`` for every request (``{(job, technique, count): Measurement}``), the ones not
    cached run as a plan runs jobs: count by count (widest first), the devices this machine
    gives the cluster (``min(cluster.count, local devices)``) cut into ``k = max(1, that //
    count)`` groups, device ``i`` on ``devices.physical_ids``; each group runs one profile at a
    time, pinned to it, in its own process group (``LocalBackend``), the next request starting
    as soon as a group is free -- so profiles share the machine as planned jobs do. Before a
    count's profiles, each technique not yet run gets one untimed step on its smallest job
    (``_warm_ups``): on a fresh install the first process compiles the numba kernels and the
    bytecode that every later one loads, and a profile that paid that would overstate the
    startup of every run of the plan (issue 13's makespan check: 14.7 s planned, 11.5 s run, in
    a fresh clone).

    ``progress`` (e.g. a print to stderr) gets a line saying what will run, then one per
    profile as it is read from the cache or its run ends, with its times (:func:`done_line`):
    profiling takes minutes on a CPU, and the planner says nothing else meanwhile.

    Guarantees: the measurements ``profile`` defines, cached the same way (a cached one is never
    rerun); the groups running at once hold disjoint devices. Raises ``RuntimeError`` naming the
    job when a run fails, after stopping the others (nothing of theirs is cached)
    (``tests/test_jobs_profile.py::test_profiles_run_side_by_side_on_disjoint_cores``).
    The lines: ``tests/test_jobs_profile.py::test_profiling_says_what_it_runs_and_each_result``."""
    from .backends import LocalBackend
    from .devices import local_devices, physical_ids

    say = progress or (lambda line: None)
    out: dict[tuple[str, str, int], Measurement] = {}
    todo: dict[int, list] = {}
    for task, technique, n in requests:
        devices = cluster.group(n)
        path, params, m = cached(task, technique, devices, root)
        if m is not None:
            out[(task.name, technique, n)] = m
        else:
            todo.setdefault(n, []).append((task, technique, params, path))
    usable = min(cluster.count, local_devices().count)
    runs = sum(map(len, todo.values()))
    say(f"profiling {runs} of {len(requests)} (job, technique, device count) with up to {steps} real steps each,"
        f" on {usable} device(s) here; {len(out)} from the cache {root}" if runs else
        f"all {len(requests)} profiles from the cache {root}")
    for i, ((job, technique, n), m) in enumerate(out.items(), 1):
        say(done_line(job, technique, n, m, None, i, len(requests)))
    backend = LocalBackend()
    warmed: set[str] = set()
    for n in sorted(todo, reverse=True):
        groups = [physical_ids(cluster, range(i * n, (i + 1) * n)) for i in range(max(1, usable // n))]
        first = _warm_ups(todo[n], warmed)
        if first:
            say(f"warming up {', '.join(t for _, t, _, _ in first)} on {n} device{'s' * (n != 1)}: one step each,"
                " not measured (a fresh install's first run compiles kernels and bytecode later runs reuse)")
            _run_in_groups(backend, first, groups, cluster, n, 1, lambda req, result, seconds: None, poll)

        def measured(req, result, seconds, n=n):
            task, technique, params, path = req
            m = out[(task.name, technique, n)] = _measure(result, task, technique, cluster.group(n), params, path,
                                                          seconds)
            say(done_line(task.name, technique, n, m, seconds, len(out), len(requests)))

        _run_in_groups(backend, todo[n], groups, cluster, n, steps, measured, poll)
    return out


def _warm_ups(queue: Sequence[tuple], warmed: set[str]) -> list[tuple]:
    """For each technique in ``queue`` not in ``warmed`` (which it adds to), its request with the
    smallest model: the run that compiles what the technique's runs use before any is timed."""
    from .memory import model_shape

    size = lambda req: sum(math.prod(s) for s in model_shape(req[0]).param_shapes.values())  # noqa: E731
    first = {}
    for req in sorted(queue, key=size):
        if req[1] not in warmed:
            first.setdefault(req[1], req)
    warmed.update(first)
    return list(first.values())


def _run_in_groups(backend, queue: Sequence[tuple], groups: list, cluster: Devices, n: int, steps: int,
                   done: Callable[[tuple, Any, float], None], poll: float = 0.05) -> None:
    """Run every ``(task, technique, params, path)`` of ``queue`` for ``min(steps, task.steps)``
    steps, one at a time in each device group (pinned, in its own process group), the next
    starting as soon as a group is free; ``done(request, result, wall seconds)`` as each ends.
    Returns when all have ended. Raises ``RuntimeError`` naming the job when a run fails, after
    stopping the others."""
    import time

    from .backends import Attempt

    queue = list(queue)
    running: dict[int, tuple] = {}  # group index -> (handle, request, scratch, start)
    try:
        while queue or running:
            for g in range(len(groups)):
                if g not in running and queue:
                    task, technique, params, path = req = queue.pop(0)
                    scratch = tempfile.TemporaryDirectory()
                    attempt = Attempt(task, technique, cluster.group(n, groups[g]), params, min(steps, task.steps),
                                      Path(scratch.name) / "ckpt")
                    running[g] = (backend.start(attempt), req, scratch, time.perf_counter())
            for g, (handle, req, scratch, began) in list(running.items()):
                msg = handle.poll()
                if msg is None:
                    continue
                del running[g]
                with scratch:
                    if msg[0] != "ok":
                        raise RuntimeError(f"profiling {req[0].name!r} with {req[1]} on {n}: {msg[1]}")
                    done(req, msg[1], time.perf_counter() - began)
            time.sleep(poll)
    finally:
        for handle, _, scratch, _ in running.values():
            handle.stop()
            scratch.cleanup()


def done_line(job: str, technique: str, devices: int, m: Measurement, seconds: float | None, done: int,
              total: int) -> str:
    """One profile's line for ``profile_side_by_side``'s ``progress``: its step and startup
    times, and the wall ``seconds`` its run took (``None``: read from the cache)."""
    how = f"in {seconds:.1f} s" if seconds is not None else "from the cache"
    return (f"[{done}/{total}] {job} / {technique} on {devices} device{'s' * (devices != 1)}: {m.step_seconds:.3g} s"
            f" a step, {m.startup_seconds:.3g} s to start ({how})")
