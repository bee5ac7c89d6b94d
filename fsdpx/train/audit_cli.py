"""``fsdpx audit``: one-run privacy audit of the private step, from the command line.

    fsdpx audit --noise-multiplier 4 --steps 4                 # the real mechanism: consistent
    fsdpx audit --noise-multiplier 4 --steps 4 --break noise   # noise off on purpose: EXCEEDS

Trains Dirac canaries (each in with probability 1/2, drawn from ``--seed``) through
``privacy.make_private_step`` with the given settings, guesses membership from their scores
and prints the one-run epsilon lower bound (Steinke, Nasr, Jagielski 2023) beside the epsilon
the accountant claims for those settings (``privacy.audit.audit_private_step``). ``--break
noise`` or ``--break clipping`` runs a step broken on purpose (no noise; a clip norm out of
reach, with the meant noise) against the meant run's claim: the audit must catch it. Exit
status 0 when the bound is at or below the claim, 1 when it exceeds it, 2 for a bad flag.
"""

from __future__ import annotations

import argparse

# Only the parser here: ``--help`` and a bad flag answer before torch is imported.
from .flags import FlagParser

BREAKS = ("noise", "clipping")
CLIP_OUT_OF_REACH = 1e6  # ``--break clipping``: clip norms this large clip no canary


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="fsdpx audit", description=__doc__.splitlines()[0])
    p.add_argument("--noise-multiplier", type=float, default=None, metavar="SIGMA",
                   help="noise std / clip norm of the audited step (required)")
    p.add_argument("--clip-norm", type=float, default=1.0, metavar="C")
    p.add_argument("--sample-rate", type=float, default=1.0, metavar="Q", help="Poisson sampling rate (default 1)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--canaries", type=int, default=1000, metavar="M", help="canaries, each in with probability 1/2")
    p.add_argument("--guesses", type=int, default=200, metavar="R",
                   help="membership guesses: half 'in' on the highest scores, half 'out' on the lowest")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="the canaries' draw, the sampler's and the noise's key")
    p.add_argument("--break", dest="broken", choices=BREAKS, default=None,
                   help="audit a step broken on purpose against the claim of the one meant")
    return p


def refusal(args: argparse.Namespace) -> str | None:
    """The first flag whose value cannot work, as a one-line message naming it, else None."""
    if args.noise_multiplier is None:
        return "--noise-multiplier is required: the sigma of the step to audit"
    if not args.noise_multiplier >= 0:
        return f"--noise-multiplier {args.noise_multiplier} must be >= 0"
    if not 0 < args.clip_norm < CLIP_OUT_OF_REACH:
        return f"--clip-norm {args.clip_norm} must be > 0 and < {CLIP_OUT_OF_REACH:g}"
    if not 0 < args.sample_rate <= 1:
        return f"--sample-rate {args.sample_rate} must be in (0, 1]"
    if args.steps < 1:
        return f"--steps {args.steps} must be >= 1"
    if not 0 < args.delta < 1:
        return f"--delta {args.delta} must be in (0, 1)"
    if args.canaries < 2:
        return f"--canaries {args.canaries} must be >= 2"
    if 2 * args.canaries * args.delta > 1:
        return (f"--canaries {args.canaries} with --delta {args.delta}: "
                "the one-run bound needs 2 * canaries * delta <= 1")
    if not 1 <= args.guesses <= args.canaries:
        return f"--guesses {args.guesses} must be in [1, --canaries {args.canaries}]"
    if not 0 < args.confidence < 1:
        return f"--confidence {args.confidence} must be in (0, 1)"
    if args.broken == "noise" and args.noise_multiplier == 0:
        return "--break noise needs a --noise-multiplier > 0 to claim (the audited step has none)"
    return None


def main(argv: list[str]) -> None:
    """Run ``fsdpx audit`` on ``argv`` (the words after ``audit``): print the one-line report;
    exit 1 when the lower bound exceeds the claim, 2 for a flag that cannot work (before any
    training) (``tests/test_audit_cli.py``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    message = refusal(args)
    if message:
        parser.error(message)
    from privacy.audit import audit_private_step
    from privacy.step import DPConfig

    meant = DPConfig(clip_norm=args.clip_norm, noise_multiplier=args.noise_multiplier,
                     sample_rate=args.sample_rate, delta=args.delta)
    run = meant
    if args.broken == "noise":
        run = DPConfig(clip_norm=args.clip_norm, noise_multiplier=0.0, sample_rate=args.sample_rate, delta=args.delta)
    elif args.broken == "clipping":  # the meant noise std, a clip that lets every canary through
        run = DPConfig(clip_norm=CLIP_OUT_OF_REACH, noise_multiplier=meant.noise_std / CLIP_OUT_OF_REACH,
                       sample_rate=args.sample_rate, delta=args.delta)
    report = audit_private_step(run, steps=args.steps, claimed=meant, canaries=args.canaries, guesses=args.guesses,
                                seed=args.seed, confidence=args.confidence)
    print(report)
    if report.verdict == "exceeds":
        raise SystemExit(1)
