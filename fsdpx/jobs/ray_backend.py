"""Attempts on a Ray cluster (``fsdpx jobs run --backend ray``): the local backend's worker,
placed by Ray. Needs the optional ``ray`` package (``pip install fsdpx[ray]``).

Each attempt is one Ray actor, a worker process of its own, reserving the attempt's devices as
Ray resources (``resources``: ``num_cpus`` = the device count on a CPU, ``num_gpus`` on GPUs).
The actor forks the attempt exactly as the local backend does (``LocalHandle``: its own process
group, dying with the actor) and answers ``poll`` and ``stop``; so what runs is the same
``run_attempt`` with the technique object registered in the driver (shipped with the attempt:
its class must be importable on the cluster, e.g. through ``runtime_env``).

Devices on the node (``on_this_node``): GPUs are the ones Ray gave the actor; CPU cores are the
runner's cores when the node has them all (a local cluster), else the attempt is not pinned and
Ray's ``num_cpus`` accounting alone keeps jobs apart.

Nothing outlives ``stop``: the actor kills the attempt's process group (the attempt, torchrun
and its workers) and waits for the attempt, then the actor is killed. If the driver dies, Ray
kills the actors it owns; an attempt dies with its actor, torchrun with the attempt and its
workers with torchrun (``PR_SET_PDEATHSIG`` at each link).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Collection, Mapping

from . import techniques
from .backends import Attempt, LocalHandle

STOP_SECONDS = 30.0
"""How long ``stop`` waits for the actor to kill the attempt's processes before killing the actor."""


class RayNotInstalledError(ImportError):
    """The Ray backend was asked for, but the ``ray`` package is not installed."""


def require_ray():
    """The ``ray`` module; raises :class:`RayNotInstalledError` (an ``ImportError``) naming the
    extra to install when it is missing (``tests/test_jobs_ray.py::test_without_ray_the_backend_is_a_named_error``)."""
    try:
        import ray
    except ImportError as e:
        raise RayNotInstalledError("the Ray backend needs the ray package: pip install fsdpx[ray]") from e
    return ray


def resources(attempt: Attempt) -> dict[str, float]:
    """The Ray resources an attempt reserves: ``{"num_cpus": n}`` for ``n`` CPU devices, or
    ``{"num_cpus": 0, "num_gpus": n}`` for ``n`` GPUs (Ray then sets the actor's
    ``CUDA_VISIBLE_DEVICES`` to the GPUs it chose)."""
    n = attempt.devices.count
    return {"num_cpus": 0, "num_gpus": n} if attempt.devices.kind == "cuda" else {"num_cpus": n}


def on_this_node(attempt: Attempt, gpus: Collection[int], cores: Collection[int]) -> Attempt:
    """``attempt`` with its device ids as they are on the node that runs it: the ``gpus`` Ray
    assigned (sorted), or the runner's CPU core ids when every one of them is in ``cores`` (the
    node's), else None (not pinned). Raises ``ValueError`` when Ray assigned another number of
    GPUs than the attempt has devices (``tests/test_jobs_ray.py::test_devices_on_the_node``)."""
    d = attempt.devices
    if d.kind == "cuda":
        if len(gpus) != d.count:
            raise ValueError(f"Ray assigned GPUs {sorted(gpus)} to an attempt on {d.count}")
        ids: tuple[int, ...] | None = tuple(sorted(gpus))
    else:
        ids = d.ids if d.ids is not None and set(d.ids) <= set(cores) else None
    return dataclasses.replace(attempt, devices=d.group(d.count, ids))


class AttemptActor:
    """The actor behind one attempt (created by :class:`RayBackend` with ``ray.remote``): forks
    the attempt on construction, then ``poll`` and ``stop`` it like a ``LocalHandle``."""

    def __init__(self, attempt: Attempt, technique: Any):
        import ray

        gpus = [int(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.handle = LocalHandle(on_this_node(attempt, gpus, cores), technique)

    def pids(self) -> tuple[int, int]:
        """``(actor pid, attempt pid)``: the attempt's pid is its process group's id."""
        return os.getpid(), self.handle.process.pid

    def poll(self) -> tuple[str, Any] | None:
        return self.handle.poll()

    def stop(self) -> None:
        self.handle.stop()


class _Refused:
    """A handle for an attempt the cluster can never place: it fails at once with ``error``."""

    def __init__(self, error: str):
        self.error = error

    def poll(self) -> tuple[str, Any]:
        return "error", self.error

    def stop(self) -> None:
        pass


class RayHandle:
    """A running attempt on Ray; ``poll`` never blocks (one poll of the actor in flight at a time)."""

    def __init__(self, ray, actor):
        self._ray, self.actor = ray, actor
        self.pids = actor.pids.remote()  # ready once the actor has forked the attempt
        self._pending = None
        self._result: tuple[str, Any] | None = None

    def poll(self) -> tuple[str, Any] | None:
        """None while running (or waiting for Ray to place it); then ``("ok", result)`` or
        ``("error", text)`` -- an actor that died (its node lost, killed) is an error."""
        if self._result is not None:
            return self._result
        if self._pending is None:
            self._pending = self.actor.poll.remote()
        ready, _ = self._ray.wait([self._pending], timeout=0)
        if not ready:
            return None
        ref, self._pending = self._pending, None
        try:
            msg = self._ray.get(ref)
        except self._ray.exceptions.RayError as e:
            msg = ("error", f"the job's Ray actor failed: {type(e).__name__}: {e}")
        if msg is None:
            return None
        self._result = msg
        self._ray.kill(self.actor, no_restart=True)  # the attempt has ended: free its resources now
        return msg

    def stop(self) -> None:
        """Kill the attempt's process group from inside the actor (so on any node), wait for it,
        then kill the actor. An actor not placed yet has started nothing and is just killed
        (one constructing right now takes its attempt with it: ``PR_SET_PDEATHSIG``)."""
        ray = self._ray
        if self._result is None and ray.wait([self.pids], timeout=0)[0]:
            try:
                ray.get(self.actor.stop.remote(), timeout=STOP_SECONDS)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass  # the actor is gone (its attempt with it) or stuck: killed below
        ray.kill(self.actor, no_restart=True)


class RayBackend:
    """Attempts as Ray actors (see the module doc), with the interface of ``LocalBackend``.

    ``RayBackend()`` joins the Ray instance already initialised in this process, else calls
    ``ray.init(address)``: ``address`` None means ``RAY_ADDRESS`` when set, else a new local
    cluster (``init_kwargs`` go to ``ray.init``; by default no dashboard and no worker logs
    on the driver's stderr, where the live table is). ``close`` shuts down only a Ray it
    started. ``runtime_env`` is given to every attempt's actor (e.g. ``{"py_modules": [...]}``
    for a user technique's module the cluster cannot import).

    Guarantees (``tests/test_jobs_ray.py``): a plan runs to completion with the same results
    as the local backend; a technique that raises is reported failed, the others complete;
    after ``stop`` neither the attempt nor a process it started is alive. An attempt needing
    more CPUs or GPUs than the whole cluster has fails at once with that error (Ray would
    leave it pending forever). Raises :class:`RayNotInstalledError` without ``ray``."""

    name = "ray"

    def __init__(self, address: str | None = None, *, runtime_env: Mapping[str, Any] | None = None,
                 **init_kwargs: Any):
        ray = require_ray()
        self._ray, self._owns = ray, False
        self.runtime_env = dict(runtime_env) if runtime_env else None
        if not ray.is_initialized():
            ray.init(address=address, **{"include_dashboard": False, "log_to_driver": False, **init_kwargs})
            self._owns = True
        self._actor_class = ray.remote(AttemptActor)

    def start(self, attempt: Attempt) -> RayHandle | _Refused:
        """Place ``attempt`` on the cluster; returns its handle at once (Ray may still be
        waiting for its resources to be free)."""
        need = resources(attempt)
        kind, n = ("GPU", need["num_gpus"]) if "num_gpus" in need else ("CPU", need["num_cpus"])
        have = self._ray.cluster_resources().get(kind, 0)
        if have < n:
            return _Refused(f"the job needs {n} {kind}s; the Ray cluster has {have:g}")
        options: dict[str, Any] = {**need, "max_restarts": 0}
        if self.runtime_env:
            options["runtime_env"] = self.runtime_env
        technique = techniques.get(attempt.technique)
        return RayHandle(self._ray, self._actor_class.options(**options).remote(attempt, technique))

    def close(self) -> None:
        """Shut Ray down if this backend started it."""
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns = False
