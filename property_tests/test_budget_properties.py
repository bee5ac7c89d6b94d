"""Random sequences of segments of one private run (issue 15, section 1): more steps, another
sample rate, a fixed noise multiplier or the target's calibration, another clip norm. Whatever
the sequence, the run never ends above its target, its epsilon is dp_accounting's over the
events it recorded, those events are the segments' recorded noise, and a refused segment
changes nothing on disk. Runs the real ``fsdpx.train.run`` on a tiny model (a few steps each)."""

import tempfile
from pathlib import Path

import dp_accounting
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import ckpt
from fsdpx.train import RunConfig, run
from fsdpx.train.budget import BudgetError
from fsdpx.train.segments import read_record
from privacy.accounting import Accountant, Event

TINY = dict(n_layer=1, n_embd=8, n_head=1, block_size=8, corpus_chars=2000, ckpt_every=3, name="r")

segment = st.fixed_dictionaries({
    "more": st.integers(1, 4),
    "sample_rate": st.sampled_from([0.03, 0.06]),
    "noise": st.one_of(st.none(), st.floats(0.7, 2.0)),  # None: calibrated to the target
    "clip_norm": st.sampled_from([0.5, 1.0]),
    "max_noise": st.sampled_from([0.7, 10.0]),  # 0.7: some targets need more: refused
})


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _dp_accounting_epsilon(events, delta, interval):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
    for e in events:
        step = dp_accounting.PoissonSampledDpEvent(e.sample_rate, dp_accounting.GaussianDpEvent(e.noise_multiplier))
        acc.compose(dp_accounting.SelfComposedDpEvent(step, e.steps))
    return acc.get_epsilon(delta)


@settings(max_examples=10)
@example(target=1.0, segments=[  # calibrated; then refused (needs more than 0.7); then a fixed noise stopped by the budget
    dict(more=3, sample_rate=0.06, noise=None, clip_norm=1.0, max_noise=10.0),
    dict(more=4, sample_rate=0.06, noise=None, clip_norm=1.0, max_noise=0.7),
    dict(more=4, sample_rate=0.03, noise=0.7, clip_norm=0.5, max_noise=10.0)])
@given(target=st.floats(1.0, 6.0), segments=st.lists(segment, min_size=1, max_size=3))
def test_any_sequence_of_segments_ends_within_the_target_and_refusals_write_nothing(target, segments):
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = dict(TINY, out=str(root), ckpt_dir=str(root / "ck"))
        steps = 0
        for i, seg in enumerate(segments):
            privacy = ({"noise_multiplier": seg["noise"], "epsilon_budget": target} if seg["noise"] is not None
                       else {"target_epsilon": target})
            config = RunConfig.of(steps=steps + seg["more"], sample_rate=seg["sample_rate"], clip_norm=seg["clip_norm"],
                               max_noise_multiplier=seg["max_noise"], resume=i > 0, **privacy, **base)
            before = _snapshot(root)
            try:
                summary = run(config, progress=False)
            except BudgetError:
                event("a segment refused")
                assert _snapshot(root) == before
                continue
            event("stopped by the budget" if summary["stopped"] else "segment trained")
            assert summary["epsilon"] <= target
            steps = summary["steps"]
        newest = ckpt.CheckpointManager(root / "ck").latest()
        if newest is None:  # every segment refused
            return
        state = ckpt.load(newest, mesh=ckpt.CheckpointManager(root / "ck").mesh, strategy=None, private=True)
        acc = state.accountant
        assert acc.epsilon() <= target
        assert acc.epsilon() == _dp_accounting_epsilon(acc.events, acc.delta, acc.value_discretization_interval)
        recorded = read_record(root / "ck")["segments"]
        ends = [s["start_step"] for s in recorded[1:]] + [state.step]
        from_record = [Event(s["derived"]["noise_multiplier"], s["derived"]["sample_rate"], end - s["start_step"])
                       for s, end in zip(recorded, ends)]
        assert acc.events == Accountant(events=tuple(from_record), delta=acc.delta).events  # canonical form
