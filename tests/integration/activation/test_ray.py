"""Activation in Ray actors on a real local Ray cluster (ray 2.60, 2 CPUs, no dashboard): every
actor that imports megatron-core is patched, `runtime_env={"env_vars": ...}` switches a patch off
(or the whole plugin) in one actor only, and each actor writes its own status file. The README's
"Ray" section rests on this; its block (``readme-test: ray-runtime-env``) starts the cluster."""

import glob
import json
import os
import sys

import pytest
from support.procs import run_python
from support.upstream import need, need_module

pytestmark = pytest.mark.timeout(900)

TOGGLE = "REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE"

DRIVER = r"""
import json, sys
import ray

status_dir, toggle, tests = sys.argv[1:4]
sys.path.insert(0, tests)
import readme_blocks


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
               "python": sys.executable, "env": {k: v for k, v in os.environ.items() if k.startswith("REPLAY_PLUGIN_")}}
        if out["plugin_loaded"] and s is not None:
            import replay_plugin
            from replay_plugin.patcher import patch_marker
            out["marker"] = patch_marker(inspect.getattr_static(s, "forward_backward_no_pipelining"))
            out["states"] = {r["name"]: r["state"] for r in replay_plugin.status()}
        return out


# The README's block as written starts the cluster (ray.init() without an address: a local cluster
# of its own, RAY_ADDRESS is unset) with the job's env_vars and makes the toggled actor; the other
# actors join the same job.
ns = readme_blocks.run("ray-runtime-env", {"status_dir": status_dir, "Actor": Probe})
actors = {
    "default": Probe.remote(),
    "toggled_off": ns["actor"],
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
    """One local cluster (each start costs ~20 s of CI): the README's Ray block as written makes
    it and the toggled actor; a default actor and one with REPLAY_PLUGIN_DISABLE join it."""
    need("megatron-core")
    need_module("ray")  # main's lock pins ray: there a missing ray fails, elsewhere it skips
    status_dir = tmp_path / "status"
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = run_python(DRIVER, env={"RAY_ADDRESS": ""}, args=(str(status_dir), TOGGLE, tests), timeout=800)
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
    assert default["env"] == {"REPLAY_PLUGIN_STATUS_DIR": str(status_dir)}
    # the README actor's own runtime_env switches one patch off there, and only that one; the
    # job's and the actor's env_vars both reach it (Ray merges them)
    assert off["env"] == {"REPLAY_PLUGIN_STATUS_DIR": str(status_dir), TOGGLE: "0"}, off["env"]
    assert off["marker"] is None and off["states"]["megatron.router_replay_scope"] == "disabled"
    assert off["states"]["megatron.replay_padding_fallback"] == "applied"
    # REPLAY_PLUGIN_DISABLE in the actor's runtime_env is seen at interpreter start: nothing loads,
    # not even on the import of a watched name
    assert not disabled["armed_at_start"] and not disabled["plugin_loaded"]

    # one status file per activated actor, written by that actor, with its own states; the job's
    # REPLAY_PLUGIN_STATUS_DIR reached the actor that set variables of its own too
    docs = _status_files(str(status_dir))
    assert set(docs) == {default["pid"], off["pid"]}, sorted(docs)
    for probe in (default, off):
        states = {p["name"]: p["state"] for p in docs[probe["pid"]]["patches"]}
        assert states["megatron.router_replay_scope"] == probe["states"]["megatron.router_replay_scope"]
