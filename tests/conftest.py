"""Session-wide hooks and fixtures of the tests. The shared helpers are modules of
``tests/support/`` (``from support.upstream import need``, ...; see its ``__init__``).

The hooks below feed the per-upstream report of ``support.upstream`` (its docstring has the
environment contract with scripts/envs.py): which upstreams each test needed, directly or
through its fixtures, and each test's outcome; at the end of the session the counts go to
$REPLAY_TEST_REPORT. The ``wheel`` fixture is the wheel scripts/envs.py installed
($REPLAY_TEST_WHEEL), else one built from the checkout.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
from support import ROOT
from support.upstream import Usage, write_report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    Usage.item = item
    try:
        yield
    finally:
        Usage.item = None
    Usage.count(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    Usage.fixtures.append(fixturedef)
    try:
        yield
    finally:
        Usage.fixtures.pop()


def pytest_runtest_logreport(report):
    """A test passed when its call passed (not an xpass) and no phase failed."""
    if report.failed:
        Usage.outcomes[report.nodeid] = "failed"
    elif report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
        Usage.outcomes.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("REPLAY_TEST_REPORT")
    if path:
        write_report(path, exitstatus)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> str:
    """The plugin wheel (the one scripts/test installed, else freshly built)."""
    path = os.environ.get("REPLAY_TEST_WHEEL")
    if path and os.path.exists(path):
        return path
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), ROOT],
        check=True,
    )
    return glob.glob(str(out / "replay_plugin-*.whl"))[0]
