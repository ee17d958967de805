"""compat_matrix.yaml, the patch registry, pyproject extras, the .pth line and the README agree."""

import importlib
import os
import subprocess
import sys

import tomllib
from packaging.requirements import Requirement

from replay_plugin import _pth, compat, registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def _matrix():
    return compat.parse(__import__("yaml").safe_load(open(os.path.join(ROOT, "compat_matrix.yaml"))))


def _own_specs():
    packs = _pyproject()["project"]["entry-points"]["replay_plugin.patches"]
    specs = []
    for name, module in packs.items():
        specs.extend(registry.pack_specs(importlib.import_module(module).replay_plugin_patches(), name))
    return specs


def test_registry_equals_matrix():
    matrix = _matrix()
    specs = {s.name: s for s in _own_specs()}
    assert set(specs) == set(matrix.patches), "a patch is in the code but not the matrix, or vice versa"
    for name, spec in specs.items():
        entry = matrix.patches[name]
        assert spec.targets == entry.targets, name
        assert spec.upstream == entry.upstream and spec.default == entry.default
        assert spec.trigger.partition(".")[0] == matrix.upstreams[spec.upstream].import_name


def test_extras_equal_matrix_ranges():
    extras = _pyproject()["project"]["optional-dependencies"]
    expected = {}
    for up in _matrix().upstreams.values():
        for dist, extra in up.distributions.items():
            expected[extra] = (dist, up.supported)
    assert set(extras) == set(expected)
    for extra, reqs in extras.items():
        (req,) = [Requirement(r) for r in reqs]
        dist, supported = expected[extra]
        assert req.name == dist and req.specifier == supported, extra


def test_watched_names_equal_upstream_import_names():
    assert set(_pth.WATCHED) == {up.import_name for up in _matrix().upstreams.values()}


def test_entry_points_declared():
    eps = _pyproject()["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"replay_plugin": "replay_plugin.vllm.plugin:register"}
    assert eps["replay_plugin.patches"] == {
        "megatron": "replay_plugin.megatron.patches",
        "vllm": "replay_plugin.vllm.patches",
        "fsdp": "replay_plugin.fsdp.patches",
        "skyrl": "replay_plugin.skyrl.patches",
        "verl": "replay_plugin.verl.patches",
    }


def test_generated_files_are_current():
    """replay_plugin.pth, pyproject extras and README tables equal what scripts/sync.py generates."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "sync.py"), "--check"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


def test_patch_ranges_inside_upstream_ranges():
    """Every patch covers every tested version of its upstream, or retires it on purpose (the
    upstream no longer has what it fixes: ``retired`` in the matrix, with the reason)."""
    m = _matrix()
    for p in m.patches.values():
        for v in m.upstreams[p.upstream].tested:
            covered, retired = compat.version_in(v, p.versions), compat.retired_reason(p.retired, v)
            assert covered or retired, f"{p.name} does not cover tested {p.upstream} {v}"
            assert not (covered and retired), f"{p.name} both covers and retires {p.upstream} {v}"
