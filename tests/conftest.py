"""Shared test helpers.

Environment contract (set by scripts/envs.py test):
  REPLAY_TEST_ENV         name of the envs/envs.toml environment running the tests
  REPLAY_TEST_UPSTREAMS   matrix upstream keys this environment must provide
  REPLAY_TEST_WHEEL       the plugin wheel installed into the environment

A test that needs an upstream this environment is not meant to have is skipped; one whose
upstream the environment should have but cannot import fails (never a silent skip).
Outside scripts/test (a developer's pytest run) importability decides.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_IMPORT_NAMES = {"megatron-core": "megatron.core", "vllm": "vllm", "verl": "verl", "skyrl": "skyrl",
                 "transformers": "transformers"}


def need(*upstreams: str) -> None:
    """Skip unless this environment provides every upstream (matrix keys)."""
    declared = os.environ.get("REPLAY_TEST_UPSTREAMS")
    for up in upstreams:
        if declared is not None:
            if up not in declared.split(","):
                pytest.skip(f"{up} is not part of test environment {os.environ.get('REPLAY_TEST_ENV')}")
            importlib.import_module(_IMPORT_NAMES[up])  # must work: the env declares it
        elif importlib.util.find_spec(_IMPORT_NAMES[up].partition(".")[0]) is None:
            pytest.skip(f"{up} is not installed")


def plugin_installed_as_wheel() -> bool:
    import replay_plugin

    return "site-packages" in (replay_plugin.__file__ or "")


def run_python(code: str, env: dict | None = None, python: str | None = None, timeout: float = 600,
               args: tuple = ()) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment with a clean REPLAY_PLUGIN_* set."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    base.pop("PYTHONPATH", None)
    base.update(env or {})
    return subprocess.run([python or sys.executable, "-c", code, *args], env=base, cwd=os.path.dirname(ROOT),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> str:
    """The plugin wheel (the one scripts/test installed, else freshly built)."""
    path = os.environ.get("REPLAY_TEST_WHEEL")
    if path and os.path.exists(path):
        return path
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), ROOT], check=True)
    return glob.glob(str(out / "replay_plugin-*.whl"))[0]
