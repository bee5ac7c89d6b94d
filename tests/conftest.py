"""Fixtures shared by the test modules of ``tests/`` (pytest hands them to a test by name), and
the ``alone`` phase of ``make test``."""

import os

import pytest

import fsdpx.jobs as jobs
from fsdpx.jobs import techniques

from support.counting_technique import CountingTechnique


@pytest.fixture
def counting():
    """The user techniques "counting", "raising" (raises in ``execute``) and "exiting" (exits
    its process there), registered for the test and unregistered after it."""
    for name, fail in (("counting", None), ("raising", "raise"), ("exiting", "exit")):
        jobs.register(name, CountingTechnique(fail=fail), replace=True)
    yield
    for name in ("counting", "raising", "exiting"):
        techniques.unregister(name)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``alone`` assert a timing that other tests on the same cores would falsify.
    With ``FSDPX_TESTS=alone`` only they run (``make test``'s first command, one process); on
    pytest-xdist workers (``-n N``, N > 0) they are left out for that phase; a plain ``pytest``
    runs everything."""
    alone = [item for item in items if item.get_closest_marker("alone") is not None]
    if os.environ.get("FSDPX_TESTS") == "alone":
        drop = [item for item in items if item.get_closest_marker("alone") is None]
    elif (config.getoption("numprocesses", None) or 0) > 0 or os.environ.get("PYTEST_XDIST_WORKER"):
        drop = alone
    else:
        return
    if drop:
        keep = set(map(id, drop))
        items[:] = [item for item in items if id(item) not in keep]
        config.hook.pytest_deselected(items=drop)
