"""The training loop of ``fsdpx train``: the model and data of a :class:`RunConfig` (by default
a small GPT on the embedded corpus, :mod:`fsdpx.train.sources`), privately by default.

    summary = run(RunConfig.of(steps=300, target_epsilon=8.0))

The step is built by :mod:`fsdpx.train.build` (the one place a step is chosen), a sharded run's
layout resolved once by :mod:`fsdpx.train.parallel`, the segment planned by
:mod:`fsdpx.train.resume`; this module feeds the step Poisson batches, saves checkpoints and
records what it returns through :mod:`fsdpx.train.report`. The loop starts at ``state.step``,
so a state restored from a checkpoint continues where it stopped.

Files written to ``<out>/<name>/``:

* ``config.json``: the :class:`RunConfig` tree plus what was derived from it (sample rate,
  noise multiplier, dataset and model sizes, the model and data read; in a sharded run of a
  pretrained save, ``weights_read``: the file's tensors and bytes each rank read, its blocks only),
  written before the first step; ``config.toml``: the same configuration as a file ``fsdpx train --config`` reads back.
* ``metrics.jsonl``: one object per step, every key that is a quantity named with its unit
  (:data:`METRICS` lists them; the README's "The main job" shows them too):

  - ``step``: 1-based;
  - ``loss``: mean per-example loss over this step's batch (not smoothed);
  - ``epsilon``: spent after the step, at ``delta`` (``null`` for a non-private run, which has
    no guarantee);
  - ``batch_size``: examples in this step's Poisson batch, the whole global batch on every
    layout;
  - ``clipped_fraction``, ``mean_norm``: the fraction of the batch's examples whose gradient
    norm exceeded the clip norm, and their mean gradient norm before clipping (a one-process
    plain run writes 0 and ``null``; a sharded plain run leaves them out);
  - ``step_seconds``: wall seconds since the previous step's line (this segment's loop start
    for its first): the batch, the step, epsilon, the line itself and a checkpoint's snapshot;
  - ``elapsed_seconds``: wall seconds since this segment's loop started (the sum of its
    ``step_seconds``);
  - sharded runs: ``comm_bytes`` (bytes rank 0 moved this step, by collective kind) and
    ``resident_bytes`` (rank 0's parameters, gradients and optimizer state at rest);
  - ``--offload``: ``offload_host_wait_seconds``, ``offload_host_loop_seconds``,
    ``offload_d2h_bytes``, ``offload_h2d_bytes`` (the last step's host work and traffic);
  - ``--eval-data``, on the steps evaluated (multiples of ``--eval-every`` and the last):
    ``eval_loss`` (the mean token loss on the held-out examples, nats), ``eval_ppl`` (its
    exponential, the perplexity) and ``eval_seconds`` (:mod:`fsdpx.train.evaluation`; no
    privacy budget spent).
* ``plot.png``: loss (and the held-out loss) and epsilon against step.
* ``model/``: the trained model, a directory transformers' ``from_pretrained`` loads (the
  built-in GPT: :func:`fsdpx.train.export.load_gpt`); ``--no-export`` skips it
  (:mod:`fsdpx.train.export`).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from typing import Any

from torch import Tensor

from fsdpx.sharding.comm import Comm
from fsdpx.sharding.pipeline import unshard_stages
from privacy.errors import BudgetExhaustedError
from privacy.step import sample_batch

from . import audit_run, interrupts, report
from .build import (build_step, new_read_log, offload_metrics, resolve_privacy, resolve_sample_rate, sampler_of,
                    weights_read)
from .checkpoints import checkpoint_manager, newest_checkpoint, save_failure, savable
from .config import RunConfig, to_toml
from .device import run_device, to_device
from .evaluation import EvalSet, build_eval_set, eval_batch_size, eval_loss, eval_metrics, same_file_warning
from .export import export_at_end
from .parallel import Parallel, resolve_parallel
from .preflight import check_before_writing
from .resume import SegmentPlan, plan_segment, recorded_mechanism
from .segments import BranchError, cut_back, later_digest, read_metrics, write_metrics, write_record
from .sources import Source, build_source, read_mode, sample_text

METRICS = ("step", "loss", "epsilon", "batch_size", "clipped_fraction", "mean_norm", "step_seconds",
           "elapsed_seconds", "comm_bytes", "resident_bytes", "offload_host_wait_seconds",
           "offload_host_loop_seconds", "offload_d2h_bytes", "offload_h2d_bytes", "eval_loss", "eval_ppl",
           "eval_seconds")
"""Every key a line of ``metrics.jsonl`` may hold (see the module doc): every line has ``step``,
``loss``, ``epsilon``, ``batch_size``, ``step_seconds`` and ``elapsed_seconds``; a private run's
(and a one-process plain run's) ``clipped_fraction`` and ``mean_norm``, a sharded run's
``comm_bytes`` and ``resident_bytes``, an offloaded run's the four ``offload_`` keys, an
evaluated step's ``eval_loss``, ``eval_ppl`` and ``eval_seconds``
(``tests/test_cli.py::test_private_run_writes_metrics_plot_config_and_summary``)."""


def run(config: RunConfig, *, progress: bool = True, comm: Comm | None = None) -> dict[str, Any]:
    """Train as ``config`` says (one segment of a run), write the run directory, and return the summary.

    Returns a dict with ``steps`` (the run's step count at the end, earlier segments included),
    ``start_step`` (where this segment began), ``initial_loss`` (the run's first recorded step's,
    i.e. the untrained model's) and ``initial_step``, ``final_loss`` (mean over the last
    ``SMOOTHING`` steps), ``epsilon`` spent at ``delta`` over the whole run (``inf`` for a
    non-private run), ``noise_multiplier`` (of this segment), ``sample_rate``, ``seconds`` (wall
    time of the segment), ``run_dir``, ``sample`` (text generated by the trained model),
    ``segment_starts``, ``stopped`` (why the segment ended early, or ``None``), and ``eval_loss``,
    ``eval_ppl``, ``eval_step`` of the run's latest held-out evaluation (``None`` without one;
    ``--eval-data``, :mod:`fsdpx.train.evaluation`: evaluated at multiples of ``eval_every`` and at
    ``steps``, so a run the budget stops early is last evaluated at the multiple before).

    Refusals first: on the main rank, before anything is built or written,
    :func:`fsdpx.train.preflight.check_before_writing` raises its named ``ConfigError`` for a
    checkpoint or run directory the run must not write (a file, not writable, another run's
    checkpoints, an existing run directory without ``overwrite``, ``resume`` with nothing to
    resume) (``tests/test_newcomer_refusals.py::test_the_python_entry_refuses_before_writing``).

    Segments (:func:`fsdpx.train.resume.plan_segment`): with ``resume`` or ``resume_from`` the
    run continues from a checkpoint; the noise of the steps left is planned against the privacy
    budget and the exact history, and every refusal (``fsdpx.train.segments.ResumeError``,
    ``fsdpx.train.budget.BudgetError``, ``ConfigError``, ``PrivacyError``) is raised before
    anything is written. ``metrics.jsonl`` is cut back to the starting step (a branch starts with
    its source's steps ``1..start``), ``config.json`` and the checkpoint root's ``run.json`` list
    the segments. A checkpoint already at ``steps`` trains nothing, writes nothing and says so
    in ``stopped``. A step that would exceed the budget is not taken: the run stops there.

    Interruptions and failures (``fsdpx train`` handles the signals, :mod:`fsdpx.train.interrupts`):
    asked to stop, every rank stops after the same step; on SIGTERM the step reached is saved
    (when there is a ``ckpt_dir``), on SIGINT nothing more is written; then
    :class:`fsdpx.train.interrupts.Interrupted` is raised with the line to print and the exit
    status. A checkpoint save that fails (in the background: it surfaces at the next save or at
    the end) raises :class:`fsdpx.train.errors.RunFailure` naming it, its cause and the newest
    intact checkpoint, which is kept (``tests/test_fault_injection.py``).

    Sharded (``comm`` given, every rank calls ``run``): the layout is resolved on the model once
    (:func:`fsdpx.train.parallel.resolve_parallel`) and every rank feeds the same global Poisson
    batch to its sharded step; only rank 0 writes files and shows progress."""
    main = comm is None or comm.rank == 0
    if main:  # the one rank that writes files checks where they go, before anything is built or written
        check_before_writing(config)
    start = time.perf_counter()
    # refused here, before any file: cuda without a GPU (a torchrun rank's comm already holds its device)
    device = getattr(comm, "device", None) or run_device(config.run.device)
    # built on the host (the same bits anywhere), then moved; pretrained weights: a rank reads its blocks
    source = build_source(config, read=read_mode(config, comm is not None)).to(device)
    model, params, inputs, targets = source.model, source.params, source.inputs, source.targets
    num_examples = int(inputs.shape[0])
    sample_rate = resolve_sample_rate(config, num_examples)
    dp = resolve_privacy(config, sample_rate, recorded=recorded_mechanism(config))
    parallel = resolve_parallel(config.parallelism, model, comm.mesh, inputs[:1]) if comm is not None else None
    # refused (EvalDataError) before anything is written, like the training data
    held = build_eval_set(config, source, batch_size=eval_batch_size(config, num_examples))
    read_log = new_read_log(source) if comm is not None else None
    build = dict(num_examples=num_examples, comm=comm, parallel=parallel, loss_fn=source.loss_fn,
                 weights=source.weights)
    state, step = build_step(config, model, params, dp, read_log=read_log, **build)
    reads = weights_read(read_log, comm) if comm is not None else None  # every rank: a collective
    manager = checkpoint_manager(config, comm, private=dp is not None, parallel=parallel)
    digest = later_digest(inputs, targets)  # a mapped file's hash goes on in the background
    plan = plan_segment(config, params=params, fresh=state, dp=dp, digest=digest,
                        manager=manager, world=comm.mesh.size if comm else 1, data=source.description)
    if config.checkpoints.resume_from is not None:
        check_branch(config, plan)
    if manager is not None:
        manager.run_id = plan.run_id  # retention deletes only the checkpoints this run wrote
    canaries, initial, planned = None, None, plan.dp
    if config.privacy.audit_canaries is not None:  # drawn from the noise key: the same in every segment
        planned = audit_run.with_canaries(plan.dp, config.privacy.audit_canaries, params, plan.state.key)
        canaries = planned.canaries
        fresh = full_params(plan.state, comm, parallel, source) if plan.start == 0 else None  # before any step
        initial = audit_run.starting_values(canaries, fresh, plan.earlier_run_dir)
    if planned != dp:
        if main and plan.start > 0 and plan.dp != dp:
            print(f"fsdpx train: {noise_note(config, plan)}", file=sys.stderr)
        dp = planned
        _, step = build_step(config, model, params, dp, **build)
    state = plan.state
    earlier = cut_back(read_metrics(plan.earlier_run_dir / "metrics.jsonl"), plan.start) if plan.earlier_run_dir \
        else []
    if main:
        _announce(config, plan)
        warning = same_file_warning(config)
        if warning is not None:
            print(f"fsdpx train: warning: {warning}", file=sys.stderr)
    starts = [s["start_step"] for s in plan.segments if s["start_step"] > 0]
    if plan.start >= config.run.steps:
        stopped = (f"nothing to do: the checkpoint {plan.source} is at step {plan.start} and --steps is"
                   f" {config.run.steps}; ask for more steps to train further")
        if main:
            print(f"fsdpx train: {stopped}", file=sys.stderr)
        trained = full_params(state, comm, parallel, source)
        sample = sample_text(source, trained, 100, seed=config.run.seed)
        return report.summary(config, [report.numbers(r) for r in earlier], state, dp, sample_rate, start,
                              plan.start, starts, stopped, sample=sample, files=())  # nothing written

    run_dir = report.prepare_run_dir(config.run_dir) if main else config.run_dir
    written = {
        **dataclasses.asdict(config),
        "derived": {"num_examples": num_examples, "sample_rate": sample_rate, "vocab_size": source.vocab_size,
                    "model": source.model_name, "data": source.description,
                    "world_size": comm.mesh.size if comm else 1, "mesh": repr(comm.mesh) if comm else None,
                    "noise_multiplier": dp.noise_multiplier if dp else None,
                    "num_params": sum(p.numel() for p in params.values()), "weights_read": reads},
        "segments": plan.segments,
    }

    def write_segments() -> None:  # config.json and the checkpoint root's run.json
        report.write_json(run_dir / "config.json" if main else None, written)
        if main and config.checkpoints.ckpt_dir is not None:
            write_record(config.checkpoints.ckpt_dir, {"run_dir": str(config.run_dir.resolve()),
                                                       "run_id": plan.run_id, "segments": plan.segments})

    pending = None if isinstance(digest, str) or plan.source is not None else digest

    def settle_digest(wait: bool) -> None:
        """Once the mapped file's digest is known (waited for when ``wait``: before a checkpoint
        and at the end, so that a resume always compares real digests), it replaces the new
        segment's pending one and both files are written again."""
        nonlocal pending
        if pending is not None:
            inputs.start_digest()  # after the first step: it competed with no hash
        if pending is not None and (wait or inputs.digest_ready()):
            plan.segments[-1]["fingerprint"]["data"], pending = pending(), None
            write_segments()

    write_segments()
    if main:
        (run_dir / "config.toml").write_text(to_toml(config))
        if canaries is not None:
            audit_run.write_starting_values(run_dir, canaries, initial)
        write_metrics(run_dir / "metrics.jsonl", earlier)  # cut back to the start: no step twice
    sampler = sampler_of(config, num_examples, sample_rate)

    history: list[dict[str, Any]] = [report.numbers(r) for r in earlier]
    saved_at = plan.start
    stopped, torn, signum = None, False, None
    ckpt_dir = config.checkpoints.ckpt_dir
    interrupts.on_grace_over(lambda: (state.step, ckpt_dir, _name(newest_checkpoint(manager))))
    loop_start = last = time.perf_counter()
    with report.open_log(run_dir / "metrics.jsonl", main, append=True) as log, \
            report.progress_bar(config, progress and main, initial=plan.start) as bar:
        while state.step < config.run.steps:
            signum = interrupts.agreed(comm)  # every rank stops after the same step
            if signum is not None:
                break
            try:
                # sampled on the host (the data stays there), moved as the step takes it
                batch = to_device(sample_batch((inputs, targets), sampler, state.step), device)
                state, metrics = step(state, batch)
                # The step does not report epsilon (a PLD query is not free); on the run's coarse
                # grid (accounting_interval) one query per step costs tens of milliseconds.
                epsilon = state.accountant.epsilon() if main else math.nan
                evaluated = _evaluate(config, state, comm, parallel, source, held)  # every rank, the same steps
                now = time.perf_counter()
                record = {"step": state.step, **metrics, **offload_metrics(state), "epsilon": epsilon,
                          **evaluated, "step_seconds": now - last, "elapsed_seconds": now - loop_start}
                last = now
                history.append(record)
                report.append_jsonl(log, record)
                report.update_bar(bar, history)
                settle_digest(wait=False)
                if manager is not None and manager.should_save(state.step):
                    settle_digest(wait=True)
                    # snapshot now, write in the background; the previous save's failure stops the run here
                    _save(manager, state, state.step)
                    saved_at = state.step
            except BudgetExhaustedError as err:
                stopped = str(err)
                break
            except KeyboardInterrupt:  # keep what was trained: still plot and summarise
                # The step updates the donated state in place: interrupted inside it, `state`
                # may be half old, half new, so it is not saved (the last checkpoint stands).
                stopped, torn = "interrupted", True
                signum = interrupts.requested()  # a second Ctrl-C of `fsdpx train`: no agreeing now
                break
        else:
            signum = interrupts.agreed(comm)  # a signal during the last step: the same answer on every rank
    if manager is not None:
        # SIGINT writes nothing more; SIGTERM, like the end, saves the step reached
        if saved_at != state.step and not torn and signum != signal.SIGINT:
            settle_digest(wait=True)
            _save(manager, state, state.step, force=True)
        try:
            manager.wait()
        except Exception as err:  # noqa: BLE001 - a save that failed in the background
            raise save_failure(err, state.step, manager) from err
    if signum is not None:
        # the steps done are in metrics.jsonl; a resume cuts it back to the newest checkpoint
        words = interrupts.line(state.step, ckpt_dir, _name(newest_checkpoint(manager)))
        raise interrupts.Interrupted(words, interrupts.exit_code(signum))

    settle_digest(wait=True)
    trained = full_params(state, comm, parallel, source)
    audited = (audit_run.report(canaries, initial, trained, epsilon=state.accountant.epsilon(),
                                delta=config.privacy.delta) if canaries is not None and main else None)
    if main:
        report.plot(history, run_dir / "plot.png", title=report.plot_title(config, dp, source),
                    delta=config.privacy.delta, starts=starts, note=None if audited is None else str(audited))
    # the last file: a failure to write it is one line (RunFailure) and keeps everything above
    merge = bool((config.model.lora or {}).get("merge"))
    exported = (export_at_end(source.model, trained, run_dir, main=main, comm=comm, merge=merge)
                if config.logging.export else None)
    return report.summary(config, history, state, dp, sample_rate, start, plan.start, starts, stopped,
                          sample=sample_text(source, trained, 100, seed=config.run.seed),
                          files=report.FILES + ((exported.name,) if exported else ())
                          + ((audit_run.AUDIT_FILE,) if canaries is not None else ()), audit=audited)


def _evaluate(config: RunConfig, state: Any, comm: Comm | None, parallel: Parallel | None, source: Source,
              held: EvalSet | None) -> dict[str, float]:
    """The held-out metrics of the step ``state`` reached when it is due (``EvalSettings.due``),
    else ``{}``: the whole parameters gathered (every rank), evaluated forward only
    (:mod:`fsdpx.train.evaluation`: no budget spent)."""
    if held is None or not config.eval.due(state.step, config.run.steps):
        return {}
    began = time.perf_counter()
    loss = eval_loss(source, full_params(state, comm, parallel, source), held, comm=comm)
    return eval_metrics(loss, time.perf_counter() - began)


def _name(path: Any) -> str | None:
    return None if path is None else str(path)


def _save(manager: Any, state: Any, step: int, *, force: bool = False) -> None:
    """Start the checkpoint of ``step`` in the background; a save that fails, this one or the
    previous (surfacing now), raises :func:`fsdpx.train.checkpoints.save_failure`'s
    ``RunFailure``: the run stops at ``step``, the newest intact checkpoint named
    (``tests/test_fault_injection.py``: a disk that fills up)."""
    try:
        manager.save(step, savable(state, manager), force=force, blocking=False)
    except Exception as err:  # noqa: BLE001 - ckpt.SaveError, or an OSError of a save that could not start
        raise save_failure(err, step, manager) from err


def _announce(config: RunConfig, plan: SegmentPlan) -> None:
    """The main rank's notes on how the segment starts."""
    for note in plan.notes:
        print(f"fsdpx train: note: {note}", file=sys.stderr)
    if config.checkpoints.resume_if_present and plan.source is None:
        print(f"fsdpx train: no checkpoint in {config.checkpoints.ckpt_dir} yet (--resume-if-present); starting at"
              " step 0", file=sys.stderr)
    elif plan.source is not None:
        print(f"fsdpx train: resuming at step {plan.start} from {plan.source}", file=sys.stderr)


def noise_note(config: RunConfig, plan: SegmentPlan) -> str:
    """The line saying what noise a resumed private segment's steps get, beside what the run's
    last step before the checkpoint used (its accountant's last event: the noise the run really
    had, not what a fresh run of the new ``--steps`` would have). Issue 28: "noise multiplier
    1.148 (was 0.4883)" named a fresh run's 0.4883 where the run had used 0.4689
    (``tests/test_train_segments.py::test_a_resume_names_the_noise_the_run_used``)."""
    p, new = config.privacy, plan.dp
    target = p.target_epsilon if p.budget is None else min(p.target_epsilon, p.budget)
    events = plan.state.accountant.events if plan.state.accountant is not None else ()
    left = f"for the {config.run.steps - plan.start} steps left"
    if not events:
        before = ""
    elif math.isclose(events[-1].noise_multiplier, new.noise_multiplier, rel_tol=1e-12):
        before = f", as step {plan.start} used,"
    else:
        rate = (f" at sample rate {events[-1].sample_rate:.4g}" if events[-1].sample_rate != new.sample_rate else "")
        before = f" (step {plan.start}, the last before the checkpoint, used {events[-1].noise_multiplier:.4g}{rate})"
    return (f"noise multiplier {new.noise_multiplier:.4g} {left}{before} keeps the whole run within epsilon"
            f" {target:g}")


def full_params(state: Any, comm: Comm | None, parallel: Parallel | None, source: Source) -> dict[str, Tensor]:
    """The whole parameters: ``state.params`` in one process; in a sharded run every rank's
    blocks, gathered and unsharded on the host by ``parallel``'s plan (called on every rank)."""
    if comm is None:
        return state.params
    blocks = comm.all_gather_object({k: v.cpu() for k, v in state.params.items()})  # pickled through the host
    whole = unshard_stages(blocks, parallel.plan, comm.mesh)
    return {k: whole[k].reshape(source.params[k].shape) for k in parallel.plan.params}


def check_branch(config: RunConfig, plan: SegmentPlan) -> None:
    """Raise :class:`fsdpx.train.segments.BranchError` if a branch would write into its source's
    run directory, even with ``overwrite`` (a branch writes a new run directory). Its checkpoint
    root holding checkpoints (its source's, or an earlier branch's) is refused before, by
    :func:`fsdpx.train.preflight.check_before_writing`
    (``tests/test_train_segments.py::test_a_branch_never_writes_where_its_source_lives``)."""
    if plan.earlier_run_dir is not None and plan.earlier_run_dir.resolve() == config.run_dir.resolve():
        raise BranchError(f"the branch would write into its source's run directory {config.run_dir}; give it"
                          " another --name")
