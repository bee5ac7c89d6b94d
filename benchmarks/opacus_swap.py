"""Opacus' own tests with the import swapped: which pass through ``privacy.opacus``.

Opacus ships its tests inside the installed package (``opacus/tests``). This script copies that
folder into a temporary package (so the tests' relative imports, ``from .utils import ...``, still
resolve to Opacus' own helpers), rewrites in each chosen file ONLY the import lines that bring in
``PrivacyEngine`` or ``BatchMemoryManager``::

    from opacus import PrivacyEngine                               -> from privacy.opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager -> from privacy.opacus import BatchMemoryManager

and runs pytest on each file (CPU only; GPU and multi-GPU files are not chosen) with a timeout,
once as Opacus ships it (``--baseline``, to tell what this machine lacks, e.g. torchvision, from
what the swap breaks) and once swapped. The installed package is never edited.

    PYTHONPATH=. .venv/bin/python benchmarks/opacus_swap.py                  # swapped, table on stdout
    PYTHONPATH=. .venv/bin/python benchmarks/opacus_swap.py --baseline       # + the same files unswapped
    PYTHONPATH=. .venv/bin/python benchmarks/opacus_swap.py --files batch_memory_manager_test.py

Printed: per file, tests passed / failed / skipped / errors; then every distinct failure reason
(the first line of its message), grouped by kind (:func:`kind`), with the tests that hit it.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import opacus

FILES = ["privacy_engine_validation_test.py", "batch_memory_manager_test.py", "gradient_accumulation_test.py",
         "accounting_noise_multiplier_test.py", "randomness_test.py", "privacy_engine_test.py"]
SWAPS = [
    (re.compile(r"^(\s*)from opacus import PrivacyEngine\s*$", re.M), r"\1from privacy.opacus import PrivacyEngine"),
    (re.compile(r"^(\s*)from opacus\.utils\.batch_memory_manager import BatchMemoryManager\s*$", re.M),
     r"\1from privacy.opacus import BatchMemoryManager"),
]
KINDS = [  # (kind, pattern in the failure's whole text); the first that matches names the group
    ("refused by name (PrivacyError)", r"PrivacyError"),
    ("needs torchvision (not installed here)", r"No module named 'torchvision'"),
    ("reads Opacus internals (functorch fallback, p.grad_sample, GradSampleModule)",
     r"ft_compute_sample_grad|\.grad_sample\b|summed_grad|GradSampleModule|is not an instance of <class 'opacus\."),
    ("Opacus refuses it (expanded weights on a module they do not cover); fsdpx trains it",
     r"RuntimeError not raised"),
]


def kind(text: str) -> str:
    """The group a failure belongs to: the first of :data:`KINDS` whose pattern occurs in its
    text, else "other (read it: a bug or a missing behaviour)"."""
    for name, pattern in KINDS:
        if re.search(pattern, text):
            return name
    return "other (read it: a bug or a missing behaviour)"


def swapped(source: str) -> tuple[str, int]:
    """``source`` with the PrivacyEngine / BatchMemoryManager imports pointed at privacy.opacus,
    and how many lines changed."""
    count = 0
    for pattern, repl in SWAPS:
        source, n = pattern.subn(repl, source)
        count += n
    return source, count


def copy_tests(root: Path, files: list[str], swap: bool) -> Path:
    """Opacus' tests folder copied to ``root/opacus_tests`` (a package), the chosen files
    swapped when ``swap``."""
    dest = root / "opacus_tests"
    shutil.copytree(Path(opacus.__file__).parent / "tests", dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name in files:
        path = dest / name
        text, n = swapped(path.read_text()) if swap else (path.read_text(), 0)
        if swap and n == 0:
            print(f"warning: {name} has no import to swap", file=sys.stderr)
        path.write_text(text)
    return dest


def run_file(dest: Path, name: str, timeout: int) -> dict:
    """pytest on one file; its counts and failures from the junit report."""
    report = dest / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={report}", f"opacus_tests/{name}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [str(dest.parent), os.environ.get("PYTHONPATH", "")])}
    try:
        subprocess.run(cmd, cwd=dest.parent, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"timeout": True, "passed": 0, "failed": 0, "skipped": 0, "errors": 0, "reasons": []}
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "reasons": [], "timeout": False}
    if not report.exists():
        counts["errors"] = 1
        counts["reasons"].append(("collection", "no report written", ""))
        return counts
    for case in ET.parse(report).getroot().iter("testcase"):
        test = case.get("name", "?")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            counts["skipped"] += 1
        elif bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            counts["reasons"].append((test, first_line(bad), bad.text or ""))
        else:
            counts["passed"] += 1
    return counts


def first_line(element: ET.Element) -> str:
    """The failure's first informative line: the exception line of its traceback (``E   ...``),
    else its message attribute."""
    text = element.text or ""
    for line in text.splitlines():
        if line.startswith("E   ") and line[4:].strip():
            return line[4:].strip()[:200]
    return (element.get("message") or "?").splitlines()[0][:200]


def table(results: dict[str, dict], title: str) -> str:
    rows = [f"### {title}", "", "| file | passed | failed | skipped | errors |", "|---|---:|---:|---:|---:|"]
    for name, c in results.items():
        if c["timeout"]:
            rows.append(f"| {name} | timed out | | | |")
        else:
            rows.append(f"| {name} | {c['passed']} | {c['failed']} | {c['skipped']} | {c['errors']} |")
    groups: dict[str, dict[str, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for name, c in results.items():
        for test, reason, text in c["reasons"]:
            groups[kind(reason + "\n" + text)][reason].append(f"{name}::{test}")
    for group, reasons in groups.items():
        rows += ["", f"**{group}**", ""]
        for reason, tests in reasons.items():
            shown = ", ".join(t.split("::")[1] for t in tests[:4]) + (" ..." if len(tests) > 4 else "")
            rows.append(f"- `{reason}` ({len(tests)}: {shown})")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", default=FILES)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per file")
    parser.add_argument("--baseline", action="store_true", help="also run the files as Opacus ships them")
    args = parser.parse_args()
    runs = [("swapped: privacy.opacus", True)] + ([("baseline: opacus as shipped", False)] if args.baseline else [])
    for title, swap in runs:
        with tempfile.TemporaryDirectory() as tmp:
            dest = copy_tests(Path(tmp), args.files, swap)
            results = {}
            for name in args.files:
                print(f"[{title}] {name} ...", file=sys.stderr, flush=True)
                results[name] = run_file(dest, name, args.timeout)
            print(table(results, title) + "\n", flush=True)


if __name__ == "__main__":
    main()
