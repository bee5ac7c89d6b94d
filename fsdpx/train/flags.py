"""The command lines' parser: argparse, except that a mistake is one line naming the flag typed
(and the closest real one), exit status 2, never a usage block.

    parser = FlagParser(prog="fsdpx train")
    parser.add_argument("--steps", type=int)
    parser.parse_args(["--stepz", "3"])
    # stderr: fsdpx train: error: unknown flag --stepz (did you mean --steps?); fsdpx train --help lists them

Every ``fsdpx`` command (train, jobs, schedule, export) builds its parser from :class:`FlagParser`;
sub-commands inherit it (``add_subparsers`` makes parsers of the parent's class). This module
imports no torch: ``--help`` and a refusal answer at once (``tests/test_fast_feedback.py``).
"""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn, Sequence


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, and that takes no abbreviation of a flag
    (``--resume-f X`` is not ``--resume-from X``: a prefix typed by mistake is refused, not
    guessed) (``tests/test_cli.py::test_a_mistyped_flag_is_one_line_naming_it``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE; PROG --help lists them`` on one line and exit 2."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; {self.prog} --help lists the flags\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                   ) -> argparse.Namespace:
        """As argparse's, except that leftover arguments are refused by the (sub-)command that
        was typed, naming the first unknown flag and the closest flag that command has."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = getattr(parsed, "command_parser", None) or self
            owner.error(unknown_message(extras, owner))
        return parsed


def unknown_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """``unknown flag --stepz (did you mean --steps?)`` for the first of ``extras`` that looks
    like a flag (``--x=1`` is named ``--x``; the flag meant: the shortest that starts with what
    was typed, else the closest by spelling), or ``unexpected argument 'x'`` when none does;
    ``(and N more)`` when there are more."""
    flags = [a for a in extras if a.startswith("-")]
    if not flags:
        more = f" (and {len(extras) - 1} more)" if len(extras) > 1 else ""
        return f"unexpected argument {extras[0]!r}{more}"
    typed = flags[0].split("=", 1)[0]
    known = [s for action in parser._actions for s in action.option_strings]
    started = sorted((k for k in known if k.startswith(typed)), key=len)  # a flag cut short
    close = started[:1] or difflib.get_close_matches(typed, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    more = f" (and {len(flags) - 1} more)" if len(flags) > 1 else ""
    return f"unknown flag {typed}{hint}{more}"

