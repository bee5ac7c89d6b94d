"""Fixtures shared by the test modules of ``tests/`` (pytest hands them to a test by name)."""

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
