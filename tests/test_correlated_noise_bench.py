"""The correlated-noise benchmark's BLT rows (``benchmarks/correlated_noise.py --blt-buffers``):
the loop's BLT mechanism and noise multiplier, its promised noise, and the SGD path's ledger."""

from __future__ import annotations

import math

import pytest

from support.benchmarks import load_benchmark

bench = load_benchmark("correlated_noise")

SMALL = ["--steps", "8", "--corpus-chars", "4000", "--batch-size", "8", "--optimizer", "sgd", "--momentum", "0.9"]


@pytest.fixture(scope="module")
def plan():
    return bench.main([*SMALL, "--bands", "2", "--blt-buffers", "2", "--min-separation", "1", "2", "--plan"])["plan"]


def test_blt_plan_rows_carry_the_loops_noise_multiplier(plan):
    from fsdpx.train import RunConfig
    from fsdpx.train.build import resolve_privacy

    rows = {bench.label(bench.mech_of(r)): r for r in plan}
    assert set(rows) == {"independent", "banded b=2", "blt D=2 sep=1", "blt D=2 sep=2"}
    for sep in (1, 2):
        row = rows[f"blt D=2 sep={sep}"]
        config = RunConfig.of(**bench.MODEL, steps=8, corpus_chars=4000, batch_size=8.0, target_epsilon=8.0,
                              noise_mechanism="blt", buffers=2, min_separation=sep, accounting_interval=1e-2)
        dp = resolve_privacy(config, row["sample_rate"])
        assert row["noise_multiplier"] == dp.noise_multiplier
        assert row["strategy"] == {"decays": list(dp.mechanism.decays), "scales": list(dp.mechanism.scales)}
    # every step may hold an example and nothing is amplified: more noise than DP-SGD's
    assert rows["blt D=2 sep=1"]["noise_multiplier"] > rows["independent"]["noise_multiplier"]


def test_blt_promised_noise_is_its_sigma_ratio_when_its_strategy_is_the_identity(plan):
    row = next(r for r in plan if r["mechanism"] == "blt" and r["min_separation"] == 1)
    base = plan[0]
    if max(row["strategy"]["scales"]) < 1e-9:  # the optimum at min separation 1 on a short run: C = I
        assert row["noise_rmse_vs_independent"] == pytest.approx(
            row["noise_multiplier"] / base["noise_multiplier"], rel=1e-6)
    assert all(math.isfinite(r["noise_rmse_vs_independent"]) and r["noise_rmse_vs_independent"] > 0 for r in plan)


def test_blt_sgd_runs_spend_at_most_the_target_epsilon_on_the_blt_ledger():
    result = bench.main([*SMALL, "--bands", "--blt-buffers", "2", "--min-separation", "2", "--seeds", "0"])
    blt = [r for r in result["runs"] if r["mechanism"] == "blt"]
    assert [(r["buffers"], r["min_separation"]) for r in blt] == [(2, 2)]
    assert 7.0 < blt[0]["epsilon"] <= 8.0 + 1e-9  # calibrated to the target on the BLT's own ledger
    assert math.isfinite(blt[0]["held_out_loss"])
    assert set(result["summary"]) == {"independent", "blt D=2 sep=2"}


def test_adamw_runs_of_every_mechanism_and_rate_get_their_own_run_directory():
    result = bench.main(["--steps", "2", "--corpus-chars", "4000", "--batch-size", "8", "--seeds", "0", "--bands", "2",
                         "--blt-buffers", "2", "--min-separation", "1", "2", "--lrs", "0.01", "0.02"])
    assert len(result["runs"]) == 8  # 4 mechanisms x 2 rates, none refused as an existing run
    assert len({bench.run_name(bench.mech_of(r), r["lr"], r["seed"]) for r in result["runs"]}) == 8
