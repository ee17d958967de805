"""Subprocesses of the tests: fresh interpreters of the test environment, free ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from support import ROOT


def plugin_installed_as_wheel() -> bool:
    import replay_plugin

    return "site-packages" in (replay_plugin.__file__ or "")


def run_python(
    code: str, env: dict | None = None, python: str | None = None, timeout: float = 600, args: tuple = ()
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment with a clean REPLAY_PLUGIN_* set."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    base.pop("PYTHONPATH", None)
    base.update(env or {})
    return subprocess.run(
        [python or sys.executable, "-c", code, *args],
        env=base,
        cwd=os.path.dirname(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
