"""Which upstreams a test needs, and the per-upstream report of a test session.

Environment contract (set by scripts/envs.py test):
  REPLAY_TEST_ENV         name of the envs/envs.toml environment running the tests
  REPLAY_TEST_UPSTREAMS   matrix upstream keys this environment must provide
  REPLAY_TEST_REPORT      where tests/conftest.py writes the upstream report (below)

A test that needs an upstream this environment is not meant to have is skipped; one whose
upstream the environment should have but cannot import fails (never a silent skip).
Outside scripts/test (a developer's pytest run) importability decides. need_module() does the
same for other distributions (ray): where REPLAY_TEST_ENV's lock pins it, it must import.

Upstream report: every upstream passed to need() is attributed to the test that called it, or,
when a fixture called it, to every test using that fixture (a session fixture runs need() once,
for the first of its tests). At the end of the session the counts of passed, failed and skipped
tests per upstream are written as JSON to $REPLAY_TEST_REPORT (tests/conftest.py's hooks feed
:class:`Usage` and call :func:`write_report`); scripts/envs.py fails an environment in which a
declared upstream has no passed test (or does not appear at all). The state lives in this module
only: every test, fixture and conftest.py imports it as ``support.upstream`` (one module object).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re

import pytest
import tomllib

from support import ROOT

_IMPORT_NAMES = {
    "megatron-core": "megatron.core",
    "vllm": "vllm",
    "verl": "verl",
    "skyrl": "skyrl",
    "transformers": "transformers",
    "trl": "trl",
}


def need(*upstreams: str) -> None:
    """Skip unless this environment provides every upstream (matrix keys); records the
    upstreams for the report (module docstring) first."""
    for up in upstreams:
        if up not in _IMPORT_NAMES:
            raise ValueError(f"need({up!r}): not an upstream key of compat_matrix.yaml ({sorted(_IMPORT_NAMES)})")
    Usage.record(upstreams)
    declared = os.environ.get("REPLAY_TEST_UPSTREAMS")
    for up in upstreams:
        if declared is not None:
            if up not in declared.split(","):
                pytest.skip(f"{up} is not part of test environment {os.environ.get('REPLAY_TEST_ENV')}")
            importlib.import_module(_IMPORT_NAMES[up])  # must work: the env declares it
        elif importlib.util.find_spec(_IMPORT_NAMES[up].partition(".")[0]) is None:
            pytest.skip(f"{up} is not installed")


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(env: str) -> dict[str, str]:
    """The exact pins of test environment ``env`` of envs/envs.toml (normalised distribution name
    -> version): its lock file, or for an overlay its base's lock without ``remove`` (and a
    ``tree``'s ``over``) and with the ``overlay`` (and ``tree``) pins over it; for an environment
    that ``runs_in`` another, that one's."""
    with open(os.path.join(ROOT, "envs", "envs.toml"), "rb") as fh:
        cfg = tomllib.load(fh)
    if env not in cfg:
        raise ValueError(f"REPLAY_TEST_ENV={env!r} is not an environment of envs/envs.toml ({sorted(cfg)})")
    if "runs_in" in cfg[env]:
        return pinned(cfg[env]["runs_in"])
    entry = cfg[env]
    tree = entry.get("tree", {})
    pins = {}
    with open(os.path.join(ROOT, "envs", f"{entry.get('base', env)}.lock")) as fh:
        for line in fh:
            dist, sep, version = line.split("#", 1)[0].strip().partition("==")
            if sep:
                pins[_dist(dist)] = version
    for dist in [*entry.get("remove", []), *([tree["over"]] if tree else [])]:
        pins.pop(_dist(dist), None)
    for pin in [*entry.get("overlay", []), *entry.get("build", []), *([tree["pin"]] if tree else [])]:
        dist, _, version = pin.partition("==")
        pins[_dist(dist)] = version
    return pins


def need_module(module: str, distribution: str | None = None):
    """``pytest.importorskip(module)``, except in a test environment (REPLAY_TEST_ENV) whose pins
    hold ``distribution`` (default: the module's top-level name): there the module is declared,
    and an import that fails fails the test."""
    env = os.environ.get("REPLAY_TEST_ENV")
    if env and _dist(distribution or module.partition(".")[0]) in pinned(env):
        return importlib.import_module(module)  # must work: the environment's lock installs it
    return pytest.importorskip(module)


class Usage:
    """Which upstreams each test needed (directly or through its fixtures), and its outcome."""

    item = None  # the test running now
    fixtures: list = []  # fixture definitions being set up now (innermost last)
    item_needs: dict = {}  # nodeid -> set of upstreams
    fixture_needs: dict = {}  # FixtureDef -> set of upstreams
    outcomes: dict = {}  # nodeid -> "passed" | "failed" | "skipped"
    counts: dict = {}  # upstream -> {"passed": n, "failed": n, "skipped": n}

    @classmethod
    def record(cls, upstreams) -> None:
        if cls.fixtures:
            cls.fixture_needs.setdefault(cls.fixtures[-1], set()).update(upstreams)
        if cls.item is not None:
            cls.item_needs.setdefault(cls.item.nodeid, set()).update(upstreams)

    @classmethod
    def needs_of(cls, item) -> set:
        needs = set(cls.item_needs.pop(item.nodeid, ()))
        info = getattr(item, "_fixtureinfo", None)
        for name in getattr(item, "fixturenames", ()):
            for fixturedef in info.name2fixturedefs.get(name, ()) if info is not None else ():
                needs |= cls.fixture_needs.get(fixturedef, set())
        return needs

    @classmethod
    def count(cls, item) -> None:
        """Add the finished ``item``'s outcome to the counts of every upstream it needed."""
        outcome = cls.outcomes.pop(item.nodeid, "skipped")
        for up in cls.needs_of(item):
            counts = cls.counts.setdefault(up, {"passed": 0, "failed": 0, "skipped": 0})
            counts[outcome] += 1


def write_report(path: str, exitstatus: int) -> None:
    """The session's upstream counts as JSON at ``path`` ($REPLAY_TEST_REPORT)."""
    with open(path, "w") as fh:
        json.dump(
            {"env": os.environ.get("REPLAY_TEST_ENV"), "exitstatus": int(exitstatus), "upstreams": Usage.counts},
            fh,
            indent=1,
            sort_keys=True,
        )
