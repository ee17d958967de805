"""pip-installing the wheel into a fresh venv is enough: pip puts the .pth line into
site-packages and the first import of megatron.core is patched."""

import json
import os
import subprocess
import sys
import sysconfig

import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(600)


def test_fresh_venv_from_wheel(tmp_path, wheel):
    need("megatron-core")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True)
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    assert os.path.exists(os.path.join(site, "replay_plugin.pth")), "pip did not install the .pth at the site root"
    # Dependencies (wrapt, pluggy, megatron-core, torch...) come from this environment through a
    # plain path line: its own .pth files (this env's replay_plugin.pth included) are not processed.
    with open(os.path.join(site, "_deps.pth"), "w") as fh:
        fh.write(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import inspect, json, replay_plugin.patcher as r, megatron.core.pipeline_parallel.schedules as s;"
        "print(json.dumps([r.__file__, r.patch_marker(inspect.getattr_static(s, 'forward_backward_no_pipelining'))]))"
    )
    # import megatron first (the finder must trigger), then inspect
    code = "import megatron.core\n" + code.replace(";", "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, marker = json.loads(proc.stdout.strip().splitlines()[-1])
    assert path.startswith(site)
    assert marker == "megatron.router_replay_scope"
