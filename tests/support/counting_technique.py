"""A user technique for the jobs tests: it counts steps instead of training, in the built-ins'
file layout, so a runner can plan, run, stop, move and resume it in a fraction of a second."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class CountingTechnique:
    """A user technique that follows the built-ins' file conventions: one line per step in
    ``<dir>/run/metrics.jsonl``, a ``ckpt/step_<N>`` directory every ``every`` steps, resuming
    from the newest one. Its "loss" is a function of the step, so a resumed run logs the same.
    With ``clock`` it logs its own ``elapsed_seconds`` too (since the attempt began), as the built-ins do."""

    def __init__(self, seconds_per_step: float = 0.05, every: int = 5, fail: str | None = None, clock: bool = False,
                 linger: float = 0.0):
        self.dt, self.every, self.fail, self.clock, self.linger = seconds_per_step, every, fail, clock, linger

    def feasible(self, task, devices):
        return True

    def search(self, task, devices):
        return {}

    def execute(self, task, devices, params, steps, ckpt_dir):
        if self.fail == "raise":
            raise RuntimeError(f"{task.name} cannot run here")
        if self.fail == "exit":
            os._exit(3)
        ckpt_dir = Path(ckpt_dir)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        done = max((int(p.name[5:]) for p in ckpt_dir.glob("step_*")), default=0)
        log = ckpt_dir.parent / "run" / "metrics.jsonl"
        log.parent.mkdir(exist_ok=True)
        kept = log.read_text().splitlines()[:done] if log.exists() else []
        log.write_text("".join(f"{r}\n" for r in kept))
        began = time.perf_counter()
        with open(log, "a") as f:
            for s in range(done + 1, steps + 1):
                time.sleep(self.dt / devices.count)
                clock = {"elapsed_seconds": time.perf_counter() - began} if self.clock else {}
                f.write(json.dumps({"step": s, "loss": 1.0 / s, "epsilon": None, **clock}) + "\n")
                f.flush()
                if s % self.every == 0:
                    (ckpt_dir / f"step_{s}").mkdir()
        time.sleep(self.linger)  # what a run does after its last step (the built-ins: a sample, a plot)
        return {"cores": sorted(os.sched_getaffinity(0)), "devices": devices.count}
