"""The megatron patch pack as a whole: probes in both directions and what ``replay-plugin status``
reports on the installed megatron-core. (The scope wrapper's cost is measured, not asserted, by
``replay-plugin bench megatron``.)"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import harness
import pytest
from packaging.version import Version
from support.upstream import need

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def worker():
    need("megatron-core")
    return harness.shared_worker()


def _megatron_version() -> Version:
    return Version(importlib.metadata.version("megatron-core"))


# --------------------------------------------------------------------------------------
# stand-ins for upstream versions of the patched functions


def fixed_apply_expert_bias(self, routing_map, padding_mask=None):
    """``_apply_expert_bias`` as NVIDIA/Megatron-LM PR #6114 (main, after 0.19.2) fixes it."""
    import torch

    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & (~padding_mask).unsqueeze(-1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def unmasked_apply_expert_bias(self, routing_map, padding_mask=None):
    """A variant that ignores the mask: no crash, wrong counts."""
    import torch

    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def set_layer_number_019(self, layer_number):
    """``Router.set_layer_number`` as 0.19 (PR #5220) has it."""
    self.layer_number = layer_number
    if getattr(self, "router_replay", None) is not None:
        self.router_replay.layer_number = layer_number


def set_layer_number_016(self, layer_number):
    """``Router.set_layer_number`` as 0.16 - 0.18 have it."""
    self.layer_number = layer_number


# --------------------------------------------------------------------------------------
# probes


def test_expert_bias_probe_both_directions():
    need("megatron-core")
    from replay_plugin.megatron import expert_bias_padding_mask as eb

    installed = eb.probe(None)  # the unwrapped upstream, although our wrapper is applied here
    assert installed.needed and "raises RuntimeError" in installed.reason  # 0.16.1 and 0.19.2 both
    fixed = eb.probe_function(fixed_apply_expert_bias)
    assert not fixed.needed and "#6114" in fixed.reason
    unmasked = eb.probe_function(unmasked_apply_expert_bias)
    assert unmasked.needed and "miscounts" in unmasked.reason


def test_layer_number_probe_both_directions():
    need("megatron-core")
    from replay_plugin.megatron import router_layer_number as ln

    assert ln.probe(None).needed is (_megatron_version() < Version("0.19.0"))
    assert not ln.probe_function(set_layer_number_019).needed
    assert ln.probe_function(set_layer_number_016).needed


def scenario_registry_with_swapped_upstream(name: str, attr: str, variant: str):
    """Revert ``name``, put a stand-in upstream function in its place, let the registry apply
    the patch again (versions outside the fingerprints allowed) and report the state."""
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter

    from replay_plugin import registry, settings

    reg = registry.get()
    reg.revert(name)
    had = attr in TopKRouter.__dict__
    original = inspect.getattr_static(TopKRouter, attr)
    setattr(TopKRouter, attr, globals()[variant])
    os.environ["REPLAY_PLUGIN_ALLOW_UNSUPPORTED"] = "1"  # the stand-in's source differs from the fingerprint
    try:
        st = reg.apply(name, settings.load())
        return {"state": st.state, "reason": st.reason}
    finally:
        del os.environ["REPLAY_PLUGIN_ALLOW_UNSUPPORTED"]
        reg.revert(name)
        if had:
            setattr(TopKRouter, attr, original)
        else:
            delattr(TopKRouter, attr)


def test_registry_follows_the_probe_not_the_version(worker):
    fixed = worker.run(
        scenario_registry_with_swapped_upstream,
        name="megatron.expert_bias_padding_mask",
        attr="_apply_expert_bias",
        variant="fixed_apply_expert_bias",
    )
    assert fixed["state"] == "not-needed" and "#6114" in fixed["reason"]
    buggy = worker.run(
        scenario_registry_with_swapped_upstream,
        name="megatron.expert_bias_padding_mask",
        attr="_apply_expert_bias",
        variant="unmasked_apply_expert_bias",
    )
    assert buggy["state"] == "applied" and "miscounts" in buggy["reason"]
    new = worker.run(
        scenario_registry_with_swapped_upstream,
        name="megatron.router_layer_number",
        attr="set_layer_number",
        variant="set_layer_number_019",
    )
    assert new["state"] == "not-needed"
    old = worker.run(
        scenario_registry_with_swapped_upstream,
        name="megatron.router_layer_number",
        attr="set_layer_number",
        variant="set_layer_number_016",
    )
    assert old["state"] == "applied"


def test_status_cli_reports_every_megatron_patch():
    need("megatron-core")
    exe = os.path.join(os.path.dirname(sys.executable), "replay-plugin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    proc = subprocess.run(
        [exe, "status", "--json", "--import", "megatron.core"],
        capture_output=True,
        text=True,
        cwd="/",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["patches"] if r["name"].startswith("megatron.")}
    native_layer_numbers = _megatron_version() >= Version("0.19.0")
    assert {n: r["state"] for n, r in rows.items()} == {
        "megatron.router_replay_scope": "applied",
        "megatron.expert_bias_padding_mask": "applied",  # no release has PR #6114
        "megatron.router_layer_number": "not-needed" if native_layer_numbers else "applied",
        "megatron.replay_padding_fallback": "applied",
    }
    assert "raises RuntimeError" in rows["megatron.expert_bias_padding_mask"]["reason"]
    assert all(r["version"] == importlib.metadata.version("megatron-core") for r in rows.values())


def test_importing_the_driver_package_imports_neither_torch_nor_megatron():
    from support.procs import run_python

    proc = run_python(
        "import sys, replay_plugin.megatron as m\n"
        "names = (m.replay_routes, m.MicrobatchReplay, m.ReplayConfigError, m.clear_routes, m.replay_layers)\n"
        "heavy = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'megatron'))\n"
        "print('HEAVY', heavy)"
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


LIBRARY_PATCH = '''
"""A library that patches Megatron by replacement, as SkyRL 0.4.0's
patch_topk_router_layer_number does (``Cls.attr = plain_function``, no __wrapped__)."""
from megatron.core.transformer.moe.router import TopKRouter

_original = TopKRouter._apply_expert_bias


def patched_apply_expert_bias(self, routing_map, padding_mask=None):
    return _original(self, routing_map, padding_mask=padding_mask)


TopKRouter._apply_expert_bias = patched_apply_expert_bias
'''


def test_status_cli_says_replaced_when_a_library_replaces_a_wrapped_target(tmp_path):
    need("megatron-core")
    (tmp_path / "other_library.py").write_text(LIBRARY_PATCH)
    exe = os.path.join(os.path.dirname(sys.executable), "replay-plugin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run(
        [exe, "status", "--json", "--import", "megatron.core", "--import", "other_library"],
        capture_output=True,
        text=True,
        cwd="/",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["patches"] if r["name"].startswith("megatron.")}
    row = rows["megatron.expert_bias_padding_mask"]
    assert row["state"] == "replaced", row
    assert "TopKRouter._apply_expert_bias was replaced by other_library.patched_apply_expert_bias" in row["reason"]
    assert rows["megatron.router_replay_scope"]["state"] == "applied"  # untouched patches stay applied
