"""Errors in the user's words: a message that names a setting by its field name (``data_path``,
``ckpt_dir``) is printed with the name the user gave it, the flag ``--data-path`` when typed on
the command line, the key ``[data] path`` when read from the ``--config`` file.

The configuration's checks raise :class:`fsdpx.train.errors.ConfigError` with field names, as a
Python caller of ``RunConfig.of(data_path=...)`` spells them; only the command line knows how each
value was given, so it rewords the message as it prints it (:func:`as_given`) instead of every
check carrying both spellings.

    as_given("resume needs ckpt_dir", {"resume": "--resume", "ckpt_dir": "--ckpt-dir"})
    # '--resume needs --ckpt-dir'
"""

from __future__ import annotations

import re
from typing import Collection, Mapping

from .config import FIELDS, short_name


def spellings(flags: Mapping[str, str], typed: Collection[str], file: Collection[str] | None) -> dict[str, str]:
    """``{field: how the user gave it}`` for every setting: its flag (``flags[field]``, e.g.
    ``--data-path``) when typed, its key (``[data] path``) when the config file set it; a setting
    given neither way is named as the user gives settings in this command: a key when there is a
    config file (``file`` not None), else its flag. A setting without a flag keeps its field name
    when a flag would be due."""
    out = {}
    for field, (section, _) in FIELDS.items():
        key = f"[{section}] {short_name(section, field)}"
        by_file = field in (file or ()) or (file is not None and field not in typed)
        out[field] = key if by_file else flags.get(field, field)
    return out


_BRACES = re.compile(r"(\{[^{}]*\})")  # an inline table's keys are not the run's settings


def as_given(message: str, spelling: Mapping[str, str]) -> str:
    """``message`` with each setting it names spelled as in ``spelling`` (:func:`spellings`).

    A name with an underscore (``data_path``) is a setting wherever it stands as a word (not
    inside a path, a dotted name or a ``{...}`` table); a one-word name (``data``, ``steps``,
    ``tp``), which is also an English word, only where it is plainly the setting: first in the
    message, or before ``=``, ``<`` or ``>`` (``data = "text"``, ``tp=2``, ``tp > 1``).
    ``name = value`` becomes ``--name value`` for a flag, ``[section] key = value`` for a key.
    Proven by ``tests/test_fast_feedback.py::test_errors_name_the_flags_or_keys_the_user_gave``."""
    parts = _BRACES.split(message)
    return "".join(p if _BRACES.fullmatch(p) else _reword(p, spelling, first=i == 0) for i, p in enumerate(parts))


def _reword(text: str, spelling: Mapping[str, str], first: bool) -> str:
    names = sorted(spelling, key=len, reverse=True)  # the longest first: batch_size before size
    pattern = re.compile(r"(?<![\w./\-\[])(" + "|".join(map(re.escape, names)) + r")(?![\w./\-])( ?=(?!=) ?)?")

    def one(m: re.Match) -> str:
        name, equals = m.group(1), m.group(2)
        compared = re.match(r" ?[<>]", text[m.end():]) is not None
        plain = "_" in name or equals or compared or (first and m.start() == 0)
        if not plain:
            return m.group(0)
        given = spelling[name]
        if equals and given.startswith("--"):
            return given + ("=" if equals == "=" else " ")
        return given + (equals or "")

    return pattern.sub(one, text)
