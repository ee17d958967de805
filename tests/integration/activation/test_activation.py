"""Activation from the installed wheel in fresh interpreters, on real megatron-core."""

import json
import os

import pytest
from support.procs import plugin_installed_as_wheel, run_python
from support.upstream import need

pytestmark = pytest.mark.timeout(600)

SCHED = "megatron.core.pipeline_parallel.schedules"

REPORT = r"""
import inspect, json, sys
armed = sys.__dict__.get("_replay_plugin_finder") in sys.meta_path
loaded_before = sorted(m for m in sys.modules if m.startswith("replay_plugin"))
import megatron.core
from megatron.core.pipeline_parallel import get_forward_backward_func
import megatron.core.pipeline_parallel.schedules as s
plugin_modules = sorted(m for m in sys.modules if m.startswith("replay_plugin"))
out = {"armed_at_startup": armed, "loaded_before": loaded_before, "plugin_modules": plugin_modules,
       "finder_left": sys.__dict__.get("_replay_plugin_finder") in sys.meta_path}
if plugin_modules:
    import replay_plugin
    from replay_plugin.patcher import patch_marker
    out["marker"] = patch_marker(inspect.getattr_static(s, "forward_backward_no_pipelining"))
    out["returned"] = patch_marker(get_forward_backward_func(pp_size=1, vp_size=None))
    out["status"] = {r["name"]: r for r in replay_plugin.status()}
else:
    out["wrapped"] = hasattr(s.forward_backward_no_pipelining, "__wrapped__")
print("REPORT" + json.dumps(out))
"""


def report(env=None):
    proc = run_python(REPORT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1]
    return json.loads(line[len("REPORT") :]), proc.stderr


@pytest.fixture(autouse=True)
def _megatron():
    need("megatron-core")


def test_runs_from_installed_wheel():
    if os.environ.get("REPLAY_TEST_ENV"):
        assert plugin_installed_as_wheel(), "scripts/test must install the wheel, not use the source tree"


def test_first_import_activates_and_patches():
    out, stderr = report()
    assert out["armed_at_startup"] and out["loaded_before"] == []
    assert not out["finder_left"]
    assert out["marker"] == "megatron.router_replay_scope"
    assert out["returned"] == "megatron.router_replay_scope"  # what get_forward_backward_func hands out
    st = out["status"]["megatron.router_replay_scope"]
    assert st["state"] == "applied" and st["upstream"] == "megatron-core"
    assert "replay_plugin" not in stderr  # silent on the happy path


def test_disable_imports_nothing_of_the_plugin():
    out, stderr = report({"REPLAY_PLUGIN_DISABLE": "1"})
    assert not out["armed_at_startup"]
    assert out["plugin_modules"] == []
    assert out["wrapped"] is False
    assert stderr.count("replay_plugin") == 0


LIGHT = r"""
import json, sys
import megatron  # the namespace package alone: activation happens, megatron.core stays unimported
import replay_plugin
from replay_plugin import states
print("REPORT" + json.dumps({"rows": {r["name"]: r for r in replay_plugin.status()}, "events": states.events(),
                             "core_imported": "megatron.core" in sys.modules}))
"""


def light(env):
    proc = run_python(LIGHT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:]), proc.stderr


def test_toggle_and_unknown_variable():
    out, stderr = light(
        {"REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE": "0", "REPLAY_PLUGIN_MEGATRON_EXPERT_BIAS_PADING_MASK": "0"}
    )
    assert not out["core_imported"]
    rows = out["rows"]
    assert rows["megatron.router_replay_scope"]["state"] == "disabled"
    assert rows["megatron.router_replay_scope"]["reason"] == "REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE=0"
    # the misspelt toggle switched nothing off, and is reported with the likely name
    assert rows["megatron.expert_bias_padding_mask"]["state"] != "disabled"
    assert "did you mean REPLAY_PLUGIN_MEGATRON_EXPERT_BIAS_PADDING_MASK" in stderr
    assert any("REPLAY_PLUGIN_MEGATRON_EXPERT_BIAS_PADING_MASK" in e for e in out["events"])


def test_status_cli_json_is_clean_json():
    import subprocess
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "replay-plugin")
    proc = subprocess.run(
        [exe, "status", "--json", "--import", "megatron.core"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # stdout holds the document and nothing else
    assert set(doc) == {"patches"}
    rows = {r["name"]: r for r in doc["patches"]}
    assert rows["megatron.router_replay_scope"]["state"] == "applied"
    assert set(rows["megatron.router_replay_scope"]) >= {"name", "upstream", "version", "state", "reason"}


DOUBLE = r"""
import inspect, json, wrapt
import replay_plugin
import megatron.core.pipeline_parallel.schedules as s
from replay_plugin.patcher import patch_marker

def layers():
    obj, n = inspect.getattr_static(s, "forward_backward_no_pipelining"), 0
    while patch_marker(obj) is not None:
        if type(obj).__name__ == "PluginWrapper":
            n += 1
        obj = obj.__wrapped__
    return n

original = inspect.getattr_static(s, "forward_backward_no_pipelining").__wrapped__
out = {"after_import": layers()}
replay_plugin.activate(); replay_plugin.activate()
out["after_activate_twice"] = layers()
replay_plugin.deactivate()
out["after_deactivate"] = layers()
out["restored"] = inspect.getattr_static(s, "forward_backward_no_pipelining") is original
out["state_after_deactivate"] = {r["name"]: r["state"] for r in replay_plugin.status()}["megatron.router_replay_scope"]
replay_plugin.activate()
out["after_reactivate"] = layers()
wrapt.wrap_function_wrapper(s, "forward_backward_no_pipelining", lambda w, i, a, k: w(*a, **k))
replay_plugin.deactivate()
row = {r["name"]: r for r in replay_plugin.status()}["megatron.router_replay_scope"]
out["foreign_state"], out["foreign_reason"] = row["state"], row["reason"]
out["still_wrapped"] = layers()
print("REPORT" + json.dumps(out))
"""


def test_double_activation_revert_and_foreign_wrapper():
    proc = run_python(DOUBLE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:])
    assert out["after_import"] == 1
    assert out["after_activate_twice"] == 1  # applying twice is a no-op
    assert out["after_deactivate"] == 0 and out["restored"]
    assert out["state_after_deactivate"] == "reverted"
    assert out["after_reactivate"] == 1
    # someone wrapped on top of us: revert refuses instead of tearing their layer out
    assert out["foreign_state"] == "applied" and "wrapped on top" in out["foreign_reason"]
    assert out["still_wrapped"] == 1
    assert "revert refused" in proc.stderr


FAULTY_PACK = """
from packaging.specifiers import SpecifierSet
from replay_plugin.hooks import hookimpl
from replay_plugin.spec import PatchSpec

def boom(patcher):
    raise RuntimeError("faulty pack exploded")

@hookimpl
def replay_plugin_patches():
    return [PatchSpec(name="faulty.pack_patch", upstream="megatron-core",
                      targets=("megatron.core.parallel_state:initialize_model_parallel",),
                      versions=SpecifierSet(">=0"), default=True, why="test", fix="-", remove_when="-",
                      install=boom, trigger="megatron.core")]
"""


def _pack_dir(tmp_path, entry_points):
    (tmp_path / "faulty_pack.py").write_text(FAULTY_PACK)
    (tmp_path / "broken_pack.py").write_text("raise ImportError('broken pack cannot import')\n")
    info = tmp_path / "faulty_pack-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-pack\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[replay_plugin.patches]\n" + entry_points)
    return str(tmp_path)


@pytest.fixture
def faulty_pack(tmp_path):
    """A pack whose apply raises and a pack that cannot even be imported."""
    return _pack_dir(tmp_path, "faulty = faulty_pack\nbroken = broken_pack\n")


@pytest.fixture
def faulty_apply_only(tmp_path):
    (tmp_path / "apply_only").mkdir()
    return _pack_dir(tmp_path / "apply_only", "faulty = faulty_pack\n")


CHECK_FAULTY = r"""
import json
import megatron.core
import replay_plugin
from replay_plugin import states
rows = {r["name"]: r for r in replay_plugin.status()}
scope = rows["megatron.router_replay_scope"]["state"]
print("REPORT" + json.dumps({"faulty": rows["faulty.pack_patch"], "scope": scope, "events": states.events()}))
"""


def test_faulty_pack_does_not_break_the_import(faulty_pack):
    proc = run_python(CHECK_FAULTY, env={"PYTHONPATH": faulty_pack})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:])
    assert out["faulty"]["state"] == "error" and "faulty pack exploded" in out["faulty"]["reason"]
    assert out["scope"] == "applied"  # other patches unaffected
    assert any("broken" in e and "cannot import" in e for e in out["events"])
    assert "faulty.pack_patch" in proc.stderr  # logged once


def test_strict_mode_raises_in_the_import(faulty_pack, faulty_apply_only):
    proc = run_python("import megatron", env={"PYTHONPATH": faulty_pack, "REPLAY_PLUGIN_STRICT": "1"})
    assert proc.returncode != 0 and "PatchError: patch pack broken" in proc.stderr
    proc = run_python("import megatron.core", env={"PYTHONPATH": faulty_apply_only, "REPLAY_PLUGIN_STRICT": "1"})
    assert proc.returncode != 0 and "PatchApplyError" in proc.stderr and "faulty pack exploded" in proc.stderr
