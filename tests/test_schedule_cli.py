"""``fsdpx schedule``: the command prints what ``schedule`` + ``simulate`` give, draws the chart,
and names bad input with exit status 2."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from fsdpx.sharding.private_sim import simulate_private
from fsdpx.sharding.schedule import schedule
from fsdpx.sharding.schedule_sim import Transfer, simulate
from fsdpx.cli import main
from fsdpx.train.schedule_cli import describe, parse_costs

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv: str) -> str:
    main(["schedule", *argv])
    return capsys.readouterr().out


def test_it_prints_the_simulated_timeline_and_the_exact_bubble(capsys):
    out = run(capsys, "1f1b", "--ranks", "4", "--microbatches", "8")
    assert out.strip() == describe(simulate(schedule("1f1b", 4, 8)))
    assert "bubble 3/11 = 27.3%" in out  # (p - 1) / (m + p - 1)
    assert out.splitlines()[3].startswith("rank 3 | .  .  . F0 B0 W0 F1")
    assert "peak microbatches in flight per rank: 4 3 2 1" in out


def test_shared_cores_costs_and_transit_reach_the_simulator(capsys):
    out = run(capsys, "gpipe", "--ranks", "2", "--microbatches", "2", "--cores", "1")
    assert "makespan 12" in out and "rank 0 |F0 F1 F1" in out  # F1 shares the core with rank 1's F0
    out = run(capsys, "zero_bubble", "--ranks", "3", "--microbatches", "5", "--costs", "F=1, b=2,W=0.5",
              "--transit", "1/4")
    expected = simulate(schedule("zero_bubble", 3, 5), {"F": 1, "B": 2, "W": Fraction(1, 2)},
                        transfer=Transfer(latency=Fraction(1, 4)))
    assert out.strip() == describe(expected)
    assert "rank 0 |" not in out  # fractional times: no text timeline


def test_private_places_each_w_after_its_norms(capsys):
    out = run(capsys, "1f1b", "--ranks", "4", "--microbatches", "8", "--costs", "B=2", "--private")
    assert out.strip() == describe(simulate_private(schedule("1f1b", 4, 8), {"B": 2}))
    assert "bubble 3/19" in out  # W's on the path (B=3, W=0) would leave 3/11
    assert out.splitlines()[0].endswith("B4 B4 W0 B5 B5 W1 B6 B6 W2 B7 B7 W3 W4 W5 W6 W7")
    late = run(capsys, "1f1b", "--ranks", "2", "--microbatches", "2", "--private", "--norms", "5/2")
    assert late.strip() == describe(simulate_private(schedule("1f1b", 2, 2), norms=Fraction(5, 2)))


def test_png_draws_the_chart_for_fractional_times(capsys, tmp_path):
    path = tmp_path / "t.png"
    out = run(capsys, "interleaved_1f1b", "--ranks", "2", "--microbatches", "4", "--virtual", "2",
              "--costs", "W=1/3", "--png", str(path))
    assert f"wrote {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["interleaved_1f1b", "--ranks", "4", "--microbatches", "6", "--virtual", "2"], "multiple of num_stages"),
    (["1f1b", "--ranks", "0", "--microbatches", "4"], "num_stages must be at least 1"),
    (["1f1b", "--ranks", "2", "--microbatches", "4", "--costs", "X=1"], "cost 'X=1'"),
    (["1f1b", "--ranks", "2", "--microbatches", "4", "--costs", "F=-1"], "must be >= 0"),
    (["1f1b", "--ranks", "2", "--microbatches", "4", "--costs", "F=abc"], "is not a number"),
    (["1f1b", "--ranks", "2", "--microbatches", "4", "--cores", "0"], "cores must be a positive int"),
    (["1f1b", "--ranks", "2", "--microbatches", "4", "--transit", "-1"], "delay must be >= 0"),
    (["1f1b", "--ranks", "2", "--microbatches", "4", "--norms", "1"], "--norms needs --private"),
    (["1f1b", "--ranks", "2", "--microbatches", "4", "--private", "--norms", "-1"], "all-reduce time must be >= 0"),
])
def test_bad_input_exits_2_naming_the_problem(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["schedule", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_costs_reads_exact_fractions():
    assert parse_costs("F=1,B=2,W=1/2") == {"F": 1, "B": 2, "W": Fraction(1, 2)}
    assert parse_costs(" send_f = 0.25 ,") == {"SEND_F": Fraction(1, 4)}
    assert parse_costs("") == {}


def test_python_dash_m_fsdpx_dispatches_to_it():
    out = subprocess.run([sys.executable, "-m", "fsdpx", "schedule", "gpipe", "--ranks", "2", "--microbatches", "1"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "bubble 1/2" in out  # (p - 1) / (m + p - 1)
