"""Activation in Ray actors on a real local Ray cluster (ray 2.60, 2 CPUs, no dashboard): every
actor that imports megatron-core is patched, `runtime_env={"env_vars": ...}` switches a patch off
(or the whole plugin) in one actor only, and each actor writes its own status file. The README's
"Ray" section rests on this."""

import glob
import json
import os
import sys

import pytest
from conftest import need, run_python

pytestmark = pytest.mark.timeout(900)

TOGGLE = "REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE"

DRIVER = r"""
import json, sys
import ray

status_dir = sys.argv[1]
# address="local": a new cluster of our own, never one another job started on this machine. The
# job-level runtime_env reaches every worker the job starts; actors add their own variables.
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"REPLAY_PLUGIN_STATUS_DIR": status_dir}})


@ray.remote(num_cpus=0)
class Probe:
    def run(self, core=True):
        import importlib, inspect, os
        armed = sys.__dict__.get("_replay_plugin_finder") in sys.meta_path
        # `megatron` (a namespace package, no torch) is enough to fire the finder; the schedules
        # (torch, ~10 s) only where a patch is to be seen
        importlib.import_module("megatron.core.pipeline_parallel.schedules" if core else "megatron")
        s = sys.modules.get("megatron.core.pipeline_parallel.schedules")
        out = {"pid": os.getpid(), "armed_at_start": armed, "plugin_loaded": "replay_plugin" in sys.modules,
               "python": sys.executable}
        if out["plugin_loaded"] and s is not None:
            import replay_plugin
            from replay_plugin.patcher import patch_marker
            out["marker"] = patch_marker(inspect.getattr_static(s, "forward_backward_no_pipelining"))
            out["states"] = {r["name"]: r["state"] for r in replay_plugin.status()}
        return out


actors = {
    "default": Probe.remote(),
    "toggled_off": Probe.options(runtime_env={"env_vars": {sys.argv[2]: "0"}}).remote(),
    "disabled": Probe.options(runtime_env={"env_vars": {"REPLAY_PLUGIN_DISABLE": "1"}}).remote(),
}
calls = [a.run.remote(name != "disabled") for name, a in actors.items()]
results = dict(zip(actors, ray.get(calls, timeout=600)))
print("REPORT" + json.dumps({"driver_plugin_loaded": "replay_plugin" in sys.modules, "actors": results}))
ray.shutdown()
"""


def _status_files(directory):
    docs = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as fh:
            doc = json.load(fh)
        docs[doc["process"]["pid"]] = doc
    return docs


def test_actors_activate_toggle_and_write_status_files(tmp_path):
    need("megatron-core")
    pytest.importorskip("ray")
    status_dir = tmp_path / "status"
    proc = run_python(DRIVER, env={"RAY_ADDRESS": ""}, args=(str(status_dir), TOGGLE), timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:])
    actors = report["actors"]
    assert not report["driver_plugin_loaded"]  # the driver imported ray only: nothing to patch there
    assert len({a["pid"] for a in actors.values()}) == 3, actors  # three worker processes
    assert all(a["python"] == sys.executable for a in actors.values())

    default, off, disabled = actors["default"], actors["toggled_off"], actors["disabled"]
    # activated by the .pth finder in a worker process the raylet started
    assert default["armed_at_start"] and default["marker"] == "megatron.router_replay_scope"
    assert default["states"]["megatron.router_replay_scope"] == "applied"
    # the actor's own runtime_env switches one patch off there, and only that one
    assert off["marker"] is None and off["states"]["megatron.router_replay_scope"] == "disabled"
    assert off["states"]["megatron.replay_padding_fallback"] == "applied"
    # REPLAY_PLUGIN_DISABLE in the actor's runtime_env is seen at interpreter start: nothing loads,
    # not even on the import of a watched name
    assert not disabled["armed_at_start"] and not disabled["plugin_loaded"]

    # one status file per activated actor, written by that actor, with its own states; the job's
    # REPLAY_PLUGIN_STATUS_DIR reached the actors that set variables of their own too (Ray merges
    # job and actor env_vars)
    docs = _status_files(str(status_dir))
    assert set(docs) == {default["pid"], off["pid"]}, sorted(docs)
    for probe in (default, off):
        states = {p["name"]: p["state"] for p in docs[probe["pid"]]["patches"]}
        assert states["megatron.router_replay_scope"] == probe["states"]["megatron.router_replay_scope"]


README_DRIVER = r"""
import json, sys
import ray

sys.path.insert(0, sys.argv[2])
import readme_blocks


@ray.remote(num_cpus=0)
class Actor:
    def run(self):
        import os
        import megatron.core.pipeline_parallel.schedules  # noqa: F401 - fires the plugin's finder
        import replay_plugin
        env = {k: v for k, v in os.environ.items() if k.startswith("REPLAY_PLUGIN_")}
        return {"pid": os.getpid(), "env": env, "states": {r["name"]: r["state"] for r in replay_plugin.status()}}


ns = readme_blocks.run("ray-runtime-env", {"status_dir": sys.argv[1], "Actor": Actor})
print("REPORT" + json.dumps(ray.get(ns["actor"].run.remote(), timeout=600)))
ray.shutdown()
"""


def test_readme_ray_block(tmp_path):
    """The README's Ray block as written (a local cluster of its own: no RAY_ADDRESS): the job's
    and the actor's env_vars both reach the actor, its toggle switches the patch off there, and it
    writes its status file into the job's directory."""
    need("megatron-core")
    pytest.importorskip("ray")
    status_dir = tmp_path / "status"
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = run_python(README_DRIVER, env={"RAY_ADDRESS": ""}, args=(str(status_dir), tests), timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:])
    assert out["env"] == {"REPLAY_PLUGIN_STATUS_DIR": str(status_dir), TOGGLE: "0"}, out["env"]
    assert out["states"]["megatron.router_replay_scope"] == "disabled"
    assert out["states"]["megatron.replay_padding_fallback"] == "applied"
    assert set(_status_files(str(status_dir))) == {out["pid"]}
