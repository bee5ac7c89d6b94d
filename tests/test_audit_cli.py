"""``fsdpx audit`` through the real front door (``fsdpx.cli.main``): the report line, the exit
status that says whether the claim held, and one-line refusals naming the flag typed."""

from __future__ import annotations

import pytest

from support.threads import one_thread  # noqa: F401 - autouse fixture

from fsdpx.cli import main


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = 0
    try:
        main(["audit", *argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out.strip(), out.err.strip()


def test_the_real_step_is_consistent_with_its_claim(capsys):
    code, out, _ = _run(capsys, ["--noise-multiplier", "4", "--steps", "4"])
    assert code == 0
    assert out.startswith("audit: epsilon >= ") and out.endswith("claimed epsilon 1.993: consistent with the claim")


@pytest.mark.parametrize("broken", ["noise", "clipping"])
def test_a_step_broken_on_purpose_exceeds_the_claim_and_exits_1(capsys, broken):
    code, out, _ = _run(capsys, ["--noise-multiplier", "4", "--steps", "4", "--break", broken])
    assert code == 1
    assert "(200/200 guesses right, 1000 canaries; >= 7.257 if its privacy curve is Gaussian (f-DP)); claimed epsilon" \
        " 1.993: EXCEEDS the claim" in out


@pytest.mark.parametrize("argv, says", [
    ([], "--noise-multiplier is required"),
    (["--noise-multplier", "4"], "unknown flag --noise-multplier (did you mean --noise-multiplier?)"),
    (["--noise-multiplier", "4", "--guesses", "2000"], "--guesses 2000 must be in [1, --canaries 1000]"),
    (["--noise-multiplier", "4", "--steps", "0"], "--steps 0 must be >= 1"),
    (["--noise-multiplier", "4", "--delta", "1e-3"], "--canaries 1000 with --delta 0.001: the one-run bound needs"),
    (["--noise-multiplier", "4", "--sample-rate", "1.5"], "--sample-rate 1.5 must be in (0, 1]"),
    (["--noise-multiplier", "4", "--confidence", "1"], "--confidence 1.0 must be in (0, 1)"),
    (["--noise-multiplier", "0", "--break", "noise"], "--break noise needs a --noise-multiplier > 0"),
    (["--noise-multiplier", "4", "--break", "clip"], "invalid choice: 'clip'"),
])
def test_a_flag_that_cannot_work_is_refused_in_one_line(capsys, argv, says):
    code, out, err = _run(capsys, argv)
    assert code == 2 and out == ""
    assert err.startswith("fsdpx audit: error: ") and says in err and len(err.splitlines()) == 1
