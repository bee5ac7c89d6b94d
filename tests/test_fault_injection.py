"""Issue 28, items 2-4: faults at random steps, delivered for real to the real command line.

A run of ``fsdpx train`` (a process of its own running the real command line: forked by
``support.cli_zygote``, which paid the imports once; each chain's last segment a fresh
``python -m fsdpx``) meets a chain of faults, each at a
step drawn from a fixed seed (``FSDPX_FAULT_SEED``, default 28, so CI is reproducible): SIGKILL,
SIGTERM (preemption), SIGINT (Ctrl-C) and a disk that fills up (its ``--ckpt-dir`` is a small
tmpfs this test mounts; a filler file takes the rest). After each fault the test checks what
the user sees (the exit status and the one line) and what is on disk (the newest checkpoint
intact, no checkpoint or file of the user's changed), then continues the run with ``--resume``
(``--resume-if-present`` while there is no checkpoint yet). Once the chain is done the run is
finished and compared with one never interrupted: every step's metrics once, equal, and the
final checkpoint's tensors and accountant equal bit for bit. A sharded chain (``--strategy
zero2 --nproc 2``, gloo) does the same with SIGTERM and SIGINT to the launcher and SIGKILL to a
worker, which is named within a bounded time. A refusal in the workers is one line, the first
failing rank's, with the one-process exit status.

Every process the test starts dies with it (``PR_SET_PDEATHSIG``; the launcher's workers die
with the launcher). About 40 s for the one-process chain and 100 s for the sharded one on two
busy cores; ``FSDPX_FAULT_SEED`` draws other steps and kinds.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
import fsdpx.runtime.sharded_state  # noqa: F401 - registers ShardedState: a sharded checkpoint loads whole
import privacy  # noqa: F401 - registers the Accountant, so a checkpoint loads whole
from ckpt.flatten import flatten
from fsdpx.sharding import Mesh
from fsdpx.train.launch import LAUNCHER_PID, die_with_parent
from fsdpx.train.reports import Report, choose

from support.processes import python_env

SEED = int(os.environ.get("FSDPX_FAULT_SEED", "28"))
STEPS = 40
EVERY = 3
ARGS = ["--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8", "--corpus-chars", "4000",
        "--batch-size", "16", "--noise-multiplier", "1", "--steps", str(STEPS), "--ckpt-every", str(EVERY),
        "--no-progress"]
SHARDED_STEPS = 16
SHARDED = ["--strategy", "zero2", "--nproc", "2", "--steps", str(SHARDED_STEPS)]  # the later --steps wins
ONE_PROCESS_FAULTS = 17
DEADLINE = 150  # seconds any one process may take to reach its step or to end
BOUND = 60  # seconds from a worker's SIGKILL to the launcher's line


# --------------------------------------------------------------------------- processes and files


def start(ws: Path, *argv: str, zygote: "Zygote | None" = None, env: dict | None = None) -> "subprocess.Popen | Forked":
    """``fsdpx train ARGS ARGV`` from ``ws``, dying with this process: forked by ``zygote`` when
    given (the same command line in a process of its own, without the imports), else a fresh
    ``python -m fsdpx``."""
    argv = ["train", *ARGS, *argv]
    if zygote is not None:
        return zygote.fork(ws, argv, env or {})
    return subprocess.Popen([sys.executable, "-m", "fsdpx", *argv], cwd=ws,
                            env=python_env(OMP_NUM_THREADS="1", **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)


class Zygote:
    """``support.cli_zygote``: forks ``fsdpx train`` processes on request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "support.cli_zygote"], env=python_env(OMP_NUM_THREADS="1"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=die_with_parent)
        assert self.proc.stdout.readline().strip() == "ready"
        self.count = 0

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def fork(self, ws: Path, argv: list[str], env: dict[str, str]) -> "Forked":
        self.count += 1
        out, err = ws.parent / f"out_{self.count}.txt", ws.parent / f"err_{self.count}.txt"
        pid = int(self.ask(json.dumps({"argv": argv, "cwd": str(ws), "out": str(out), "err": str(err), "env": env})))
        return Forked(self, pid, err)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Forked:
    """A forked ``fsdpx train``, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, zygote: Zygote, pid: int, err: Path) -> None:
        self.zygote, self.pid, self.err, self.returncode = zygote, pid, err, None
        self.stderr = self  # .stderr.read(), as a Popen's pipe

    def read(self) -> str:
        return self.err.read_text() if self.err.exists() else ""

    def poll(self) -> int | None:
        if self.returncode is None:
            answer = self.zygote.ask(f"poll {self.pid}")
            self.returncode = None if answer == "running" else int(answer)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self.zygote.ask(f"reap {self.pid}"))
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = time.monotonic() + (timeout or 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return "", self.read()


def finish(proc: subprocess.Popen, timeout: float = DEADLINE) -> tuple[int, str]:
    """``proc``'s exit status and stderr (killed, and the test failed, after ``timeout``)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s: {err[-3000:]}")
    return proc.returncode, err


def last_line(text: str) -> str:
    lines = text.splitlines()
    return lines[-1] if lines else ""


def last_step(metrics: Path) -> int:
    rows = [r for r in _rows(metrics)]
    return rows[-1]["step"] if rows else 0


def _rows(metrics: Path) -> list[dict]:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written, or torn by SIGKILL
            break
    return out


def reach(proc: subprocess.Popen, metrics: Path, step: int, old: int | None) -> None:
    """Wait until ``proc`` has logged ``step`` (in a ``metrics.jsonl`` of its own: each segment
    replaces the file, cut back to its start, before its first step). ``old``: the file's inode
    read BEFORE ``proc`` started (read after, a process forked from the zygote may already have
    replaced the file: then its own file would look old and the wait would outlast the run)."""
    deadline = time.monotonic() + DEADLINE
    while _inode(metrics) == old or last_step(metrics) < step:
        if proc.poll() is not None:
            pytest.fail(f"ended (status {proc.returncode}) before step {step}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"step {step} not reached in {DEADLINE} s"
        time.sleep(0.02)


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def checkpoints(ck: Path) -> dict[str, bytes]:
    """The files of the committed checkpoints ``step_<N>/`` under ``ck``."""
    return {k: v for k, v in files(ck).items() if re.match(r"step_\d+/", k)}


def newest(ck: Path) -> int | None:
    steps = ckpt.CheckpointManager(ck).steps()
    return steps[-1] if steps else None


def final_state(ck: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """The tree and tensors of the newest intact checkpoint under ``ck``, loaded whole."""
    path = ckpt.CheckpointManager(ck).latest()
    return flatten(ckpt.load(path, mesh=Mesh(dp=1), strategy=None, private=True))


def workers(launcher: int) -> dict[int, int]:
    """The torchrun workers of ``launcher``: rank -> pid (read from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = dict(e.split(b"=", 1) for e in (entry / "environ").read_bytes().split(b"\0") if b"=" in e)
            except OSError:
                continue
            if env.get(LAUNCHER_PID.encode()) == str(launcher).encode() and b"LOCAL_RANK" in env:
                found[int(env[b"RANK"])] = int(entry.name)
    return found


class Filler:
    """Another writer that fills ``directory``'s file system and keeps it full until
    :meth:`stop`: space a run frees (its retention deleting an old checkpoint) is taken again at
    once, so the run's next save cannot fit into it. (Filled only once, a save could reuse the
    space its retention had just freed, and the run finished with exit 0: a flaky test.)"""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "filler"
        self._file = open(self.path, "wb", buffering=0)
        self._stop = threading.Event()
        self._fill()  # full before the run's next write
        self._thread = threading.Thread(target=self._keep_full, daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            while True:
                self._file.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == 28, e

    def _keep_full(self) -> None:
        while not self._stop.wait(0.002):
            self._fill()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._file.close()
        self.path.unlink()


def where(ck: str, newest_step: int | None) -> str:
    """How a stopped run names its newest checkpoint."""
    return f"newest checkpoint {ck}/step_{newest_step} (continue with --resume)" if newest_step is not None \
        else f"newest checkpoint: none in {ck}"


def interrupted_line(step: int, ck: str, newest_step: int | None) -> str:
    return f"fsdpx train: interrupted at step {step}; {where(ck, newest_step)}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """A 2 MiB tmpfs (``mount -t tmpfs``; root only), or ``None`` where mounting is not allowed."""
    where = tmp_path_factory.mktemp("tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        yield None, f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}"
        return
    yield where, None
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def workspace(tmp_path: Path, ck: Path | None = None) -> Path:
    """A user's directory: ``notes.txt`` of theirs, and ``ck`` (a mount point, if given) holding
    ``ck/notes.txt``."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("mine\n")
    if ck is not None:
        (ws / "ck").symlink_to(ck)
    (ws / "ck").mkdir(exist_ok=True)
    (ws / "ck" / "notes.txt").write_text("mine too\n")
    return ws


# --------------------------------------------------------------------------- the chains


def resume(ck: Path) -> list[str]:
    """How the user continues: ``--resume`` from the newest checkpoint; ``--resume-if-present``
    while there is none (the run directory exists, the run starts again)."""
    return ["--resume"] if newest(ck) is not None else ["--resume-if-present"]


def run_chain(ws: Path, kinds: list[str], rng: random.Random, *extra: str, steps: int = STEPS,
              zygote: Zygote | None = None) -> list[str]:
    """Faults ``kinds`` in order, each at a random step of its own segment, then the run
    finished; returns what was done (for the failure message). Checks each fault's status, line
    and files (see the module doc)."""
    ck, metrics = ws / "ck", ws / "runs" / "private" / "metrics.jsonl"
    user = {"notes.txt": (ws / "notes.txt").read_bytes(), "ck/notes.txt": (ck / "notes.txt").read_bytes()}
    log = []
    for kind in kinds:
        start_step = newest(ck) or 0
        if start_step >= steps - 5:
            break
        at = start_step + rng.randint(1, 3)
        before, old = checkpoints(ck), _inode(metrics)
        proc = start(ws, "--ckpt-dir", "ck", *resume(ck), *extra, zygote=zygote)
        try:
            reach(proc, metrics, at, old)
            log.append(f"{kind}@{at}")
            t0 = time.monotonic()
            if kind == "kill" and "--nproc" in extra:
                ranks = workers(proc.pid)
                victim = rng.choice(sorted(ranks))
                os.kill(ranks[victim], signal.SIGKILL)
                code, err = finish(proc)
                assert time.monotonic() - t0 < BOUND, f"the dead rank was named after {time.monotonic() - t0:.0f} s"
                assert (code, last_line(err)) == (1, f"fsdpx train: error: rank {victim}: killed by SIGKILL"), err
            elif kind == "kill":
                proc.kill()
                code, err = finish(proc)
                assert code == -signal.SIGKILL, err
            elif kind in ("term", "int"):
                proc.send_signal(signal.SIGTERM if kind == "term" else signal.SIGINT)
                code, err = finish(proc)
                step = last_step(metrics)
                want = interrupted_line(step, "ck", step if kind == "term" else newest(ck))
                assert (code, last_line(err)) == (143 if kind == "term" else 130, want), (log, code, err)
                assert err.count("interrupted") == 1 and "Traceback" not in err, err
            else:  # the disk fills up: the next save fails, the run stops with one line
                filler = Filler(ck)
                full_at = last_step(metrics)
                try:
                    code, err = finish(proc)
                finally:
                    filler.stop()
                pattern = (r"fsdpx train: error: checkpoint ck/step_\d+ not saved: .*No space left on device;"
                           rf" stopped at step (\d+); {re.escape(where('ck', newest(ck)))}")
                found = re.fullmatch(pattern, last_line(err))
                assert code == 1 and found, (log, err)
                # a save started once the disk was full fails; the next save (or the end) says so
                assert int(found.group(1)) <= min(full_at + 2 * EVERY, STEPS), (log, full_at, err)
                assert "Traceback" not in err, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log[-1] += f" ({time.monotonic() - t0:.1f} s to end)"
        # nothing lost, nothing rewritten: the newest checkpoint is intact, no checkpoint and no
        # file of the user's changed
        assert ckpt.CheckpointManager(ck).latest() == (ck / f"step_{newest(ck)}" if newest(ck) is not None else None)
        after = checkpoints(ck)
        assert {k: v for k, v in after.items() if k in before} == {k: v for k, v in before.items() if k in after}
        assert {k: (ws / k).read_bytes() for k in user} == user
    proc = start(ws, "--ckpt-dir", "ck", *resume(ck), *extra)  # the real entry, `python -m fsdpx`
    code, err = finish(proc)
    assert code == 0, (log, err[-3000:])
    print("faults:", ", ".join(log))
    return log


def assert_same_run(ws: Path, reference: Path, log: list[str], steps: int = STEPS) -> None:
    """Every step's metrics once and equal to the uninterrupted run's; the final checkpoints equal."""
    got, want = _rows(ws / "runs" / "private" / "metrics.jsonl"), _rows(reference / "runs" / "ref" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1)), log
    keys = ("loss", "epsilon", "batch_size", "clipped_fraction", "mean_norm")
    assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in want], log
    (tree, tensors), (ref_tree, ref_tensors) = final_state(ws / "ck"), final_state(reference / "ref_ck")
    assert tree == ref_tree and tensors.keys() == ref_tensors.keys(), log
    assert all(torch.equal(tensors[k], ref_tensors[k]) for k in tensors), log


def reference_run(tmp_path: Path, *extra: str, zygote: Zygote | None = None) -> tuple[object, Path]:
    """The same run, never interrupted (started now, waited for later)."""
    where = tmp_path / "reference" / "ws"
    where.mkdir(parents=True)
    return start(where, "--name", "ref", "--ckpt-dir", "ref_ck", *extra, zygote=zygote), where


def test_a_run_survives_faults_at_random_steps_and_ends_as_an_uninterrupted_run(tmp_path, small_disk, zygote):
    """Seventeen faults of the four kinds at random steps of one-process segments (the disk
    fills up only where a tmpfs can be mounted), each checked, then the run ends bit for bit as
    one never interrupted."""
    disk, why = small_disk
    rng = random.Random(SEED)
    kinds = ["kill", "term", "int"] + (["disk_full"] if disk is not None else [])
    chain = (kinds * ONE_PROCESS_FAULTS)[:ONE_PROCESS_FAULTS]
    rng.shuffle(chain)
    ref, where = reference_run(tmp_path, zygote=zygote)
    ws = workspace(tmp_path, disk)
    log = run_chain(ws, chain, rng, zygote=zygote)
    assert finish(ref)[0] == 0
    assert len(log) >= 15 and {k.split("@")[0] for k in log} == set(kinds), log
    assert_same_run(ws, where, log)
    if disk is None:
        pytest.skip(f"the disk-full faults did not run: {why}")


@pytest.mark.slow
def test_a_sharded_run_stops_once_on_signals_and_names_a_dead_rank(tmp_path, zygote):
    """zero2 on two gloo processes: SIGTERM and SIGINT to the launcher stop every rank after
    the same step with the one-process line and status; SIGKILL to a worker is named within
    ``BOUND`` seconds, one line; resumed, the run ends as one never interrupted. A refusal in the
    workers (a resume into another model's shapes) is the one-process line, once, with its rank."""
    rng = random.Random(SEED + 1)
    ref, where = reference_run(tmp_path, *SHARDED, zygote=zygote)  # the launcher forked; torchrun and workers fresh
    ws = workspace(tmp_path)
    log = run_chain(ws, ["term", "kill", "int"], rng, *SHARDED, steps=SHARDED_STEPS, zygote=zygote)
    assert finish(ref)[0] == 0
    assert len(log) == 3, log
    assert_same_run(ws, where, log, SHARDED_STEPS)

    refusal = start(ws, "--ckpt-dir", "ck", "--resume", "--n-embd", "16", *SHARDED, "--steps",
                    str(SHARDED_STEPS + 2), zygote=zygote)
    code, err = finish(refusal)
    assert code == 2 and re.fullmatch(r"fsdpx train: error: rank [01]: checkpoint tensor params/\S+ has shape .*",
                                      last_line(err)), err
    assert "Traceback" not in err and "ChildFailedError" not in err and err.count("error") == 1, err


def test_a_refusal_in_the_run_exits_2_with_one_line(tmp_path, zygote):
    """One process, the same refusal as the sharded test's: status 2, one line, no traceback."""
    ws = workspace(tmp_path)
    code, err = finish(start(ws, "--ckpt-dir", "ck", "--steps", "3", zygote=zygote))
    assert code == 0, err
    code, err = finish(start(ws, "--ckpt-dir", "ck", "--resume", "--steps", "5", "--n-embd", "16", zygote=zygote))
    assert code == 2 and re.fullmatch(r"fsdpx train: error: checkpoint tensor params/\S+ has shape .*",
                                      last_line(err)), err
    assert "Traceback" not in err, err


def test_a_stop_that_outlasts_the_grace_period_ends_it_there(tmp_path, zygote):
    """SIGTERM with a grace period shorter than any step (``FSDPX_GRACE_SECONDS=0.001``): the
    watchdog ends the run before the step finishes, still status 143 and one line saying so, the
    newest checkpoint intact (an abandoned save leaves nothing under its name)."""
    ws = workspace(tmp_path)
    metrics = ws / "runs" / "private" / "metrics.jsonl"
    old = _inode(metrics)
    proc = start(ws, "--ckpt-dir", "ck", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", zygote=zygote,
                 env={"FSDPX_GRACE_SECONDS": "0.001"})
    reach(proc, metrics, 4, old)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, timeout=30)
    pattern = (r"fsdpx train: interrupted at step (\d+) \(grace period over: FSDPX_GRACE_SECONDS=0.001\);"
               rf" {re.escape(where('ck', newest(ws / 'ck')))}")
    assert code == 143 and re.fullmatch(pattern, last_line(err)), (code, err)
    last = newest(ws / "ck")
    assert ckpt.CheckpointManager(ws / "ck").latest() == (None if last is None else ws / "ck" / f"step_{last}")


def test_the_launcher_names_the_first_failing_rank():
    """:func:`fsdpx.train.reports.choose`, pure: a rank's own failure before a peer's report of
    it; a rank killed without a word before the ranks that saw it die; rank 0's interruption
    line when the launcher was signalled; nothing when torchrun succeeded."""
    own = Report(1, "refusal", 2, "the budget", time=2.0)
    seen = Report(0, "failure", 1, "rank(s) [1] failed or did not answer: x", time=1.0, secondary=True)
    assert choose([seen, own], None, None, 1) == ("fsdpx train: error: rank 1: the budget", 2, None)
    killed = {"first": 0, "failures": [{"rank": 0, "exitcode": 1, "signal": ""},
                                       {"rank": 1, "exitcode": -9, "signal": "SIGKILL"}]}
    assert choose([seen], killed, None, 1) == ("fsdpx train: error: rank 1: killed by SIGKILL", 1, None)
    assert choose([seen], None, None, 1) == (f"fsdpx train: error: rank 0: {seen.detail}", 1, None)
    stop = [Report(r, "interrupted", 143, "interrupted at step 4; newest checkpoint ck/step_4", 1.0) for r in (1, 0)]
    assert choose(stop, None, signal.SIGTERM, 1) == ("fsdpx train: interrupted at step 4; newest checkpoint ck/step_4",
                                                     143, None)
    assert choose([], None, None, 0) is None
    bug = Report(1, "failure", 1, "ValueError: x", 3.0, traceback="Traceback ...\n")
    assert choose([bug], None, None, 1) == ("fsdpx train: error: rank 1: ValueError: x", 1, "Traceback ...\n")
