"""The .pth line: stdlib only, silent, idempotent, honours REPLAY_PLUGIN_DISABLE first."""

import os
import subprocess
import sys

from replay_plugin import _pth

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import sys
line = open(sys.argv[1]).read()
before = set(sys.modules)
exec(line)
exec(line)   # venvs run .pth import lines twice (cpython#75723)
finders = [f for f in sys.meta_path if f is sys.__dict__.get("_replay_plugin_finder")]
new = sorted(m for m in set(sys.modules) - before)
print(len(finders), ",".join(new))
import json   # a non-watched import passes through untouched
print(finders[0].find_spec("json") if finders else None)
"""


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-S", "-c", PROBE, os.path.join(ROOT, "replay_plugin.pth")],
        env=env,
        capture_output=True,
        text=True,
    )


def test_committed_pth_is_generated():
    with open(os.path.join(ROOT, "replay_plugin.pth")) as fh:
        assert fh.read() == _pth.pth_line()


def test_one_line_starting_with_import():
    line = _pth.pth_line()
    assert line.count("\n") == 1 and line.startswith("import ")


def test_arms_one_finder_imports_nothing_and_prints_nothing():
    proc = _run({})
    assert proc.returncode == 0 and proc.stderr == ""
    count, new = (
        proc.stdout.splitlines()[0].split(" ", 1)
        if " " in proc.stdout.splitlines()[0]
        else (proc.stdout.splitlines()[0], "")
    )
    assert count == "1"
    assert "replay_plugin" not in new  # nothing of the package is imported at start-up
    assert proc.stdout.splitlines()[1] == "None"


def test_disable_arms_nothing():
    for value in ("1", "true", "ON"):
        proc = _run({"REPLAY_PLUGIN_DISABLE": value})
        assert proc.returncode == 0 and proc.stderr == ""
        assert proc.stdout.splitlines()[0].split(" ")[0] == "0"
