"""`replay-plugin matrix --check` and `doctor` against real installs, and what the runtime does
with an out-of-range version or a changed fingerprint."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml
from support.procs import run_python
from support.upstream import need

pytestmark = pytest.mark.timeout(600)

CLI = os.path.join(os.path.dirname(sys.executable), "replay-plugin")
PATCH = "megatron.router_replay_scope"


def cli(*args, env=None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    full.update(env or {})
    return subprocess.run([CLI, *args], env=full, capture_output=True, text=True, cwd="/")


def shipped_matrix():
    from replay_plugin import compat

    with open(compat.default_path()) as fh:
        return yaml.safe_load(fh)


def installed(dist):
    from importlib.metadata import version

    return version(dist)


def write(tmp_path, raw):
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _env_upstreams():
    return [u for u in os.environ.get("REPLAY_TEST_UPSTREAMS", "").split(",") if u]


@pytest.fixture(scope="module")
def report():
    """`matrix --check --require-tested --json` in this environment (one run for the tests below)."""
    proc = cli("matrix", "--check", "--require-tested", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)  # --json keeps stdout machine-readable even though vLLM logs on stdout


def test_matrix_check_passes_on_the_tested_environment(report):
    assert report["ok"] and report["problems"] == []
    checked = [p for p in report["patches"] if p["upstream"] in _env_upstreams() and p["state"] != "not-installed"]
    # every patch of an upstream this environment tests has fingerprints (targets and relied-on
    # code) that match, on a version CI tests, or is retired there (the matrix's reason: vLLM
    # 0.34 removed the V1 sampler that vllm.sampler_rows and vllm.cpu_logprob_ranks fix)
    matched = [p for p in checked if p["state"] == "match"]
    retired = [p for p in checked if p["state"] == "not-needed" and p["detail"].startswith("retired: ")]
    assert matched and len(matched) + len(retired) == len(checked), checked
    assert all(p["tier"] == "tested" for p in checked), checked
    tiers = {u["upstream"]: u["tier"] for u in report["upstreams"]}
    assert all(tiers[u] == "tested" for u in _env_upstreams()), tiers


def test_text_output_names_the_tested_and_source_verified_releases():
    """The text table shows, per upstream, the releases CI runs and those only read from their
    sources (transformers 5.24.0), from the shipped matrix; a version installed or not (vLLM
    0.33/0.34, read from their sources in issue 26, are tested since issue 42)."""
    proc = cli("matrix")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("upstream "))
    assert lines[header].split()[-2:] == ["tested", "source-verified"], lines[header]
    raw = shipped_matrix()["upstreams"]
    for key, up in raw.items():
        row = next(line for line in lines[header + 2 :] if line.split()[:1] == [key])
        assert ", ".join(up["tested"]) in row, (key, row)
        assert ", ".join(up.get("source_verified") or {}) in row, (key, row)
    vllm_row = next(line for line in lines[header + 2 :] if line.startswith("vllm "))
    assert "0.33.0, 0.34.0" in vllm_row, vllm_row


def test_static_fingerprints_equal_the_imported_ones(report):
    """scripts/sync.py records untested releases from their wheels' sources without importing
    them (compat.static_fingerprint); here both ways run on the installed upstreams and agree
    for every target and relied-on name (relied-on code this version does not define included)."""
    import site

    from replay_plugin import compat

    roots = site.getsitepackages()
    compared = 0
    for row in report["patches"]:
        if row["upstream"] not in _env_upstreams() or row["state"] in ("not-installed", "not-needed"):
            continue
        for name, imported in row["fingerprints"].items():
            (root,) = [r for r in roots if os.path.exists(os.path.join(r, name.partition(".")[0]))]
            assert compat.static_fingerprint(root, name, absent_ok=True) == imported, name
            compared += 1
    assert compared >= 4


def _relied_on_patch(raw):
    """A patch of this environment's first upstream that lists relied-on code."""
    upstreams = _env_upstreams()
    return next(
        (name, entry)
        for name, entry in raw["patches"].items()
        if entry["upstream"] == upstreams[0] and entry.get("relies_on")
    )


def _has(dist):
    from importlib.metadata import PackageNotFoundError

    try:
        installed(dist)
    except PackageNotFoundError:
        return False
    return True


def _imports(upstream):
    """`--import` arguments for the trigger module of every patch of ``upstream``."""
    from replay_plugin import registry

    reg = registry.get()
    reg.load_packs()
    triggers = sorted({spec.trigger for spec in reg.specs.values() if spec.upstream == upstream})
    return [arg for module in triggers for arg in ("--import", module)]


def test_tier_and_relied_on_drift_are_reported(tmp_path):
    """The installed version declared source-verified instead of tested (as vLLM 0.33 is) and one
    relied-on fingerprint changed: `matrix --check` names the relied-on drift and prints the
    evidence, `--require-tested` adds the tier as a problem, and at run time the patch still
    applies (only targets are compared there), reported as source-verified."""
    raw = shipped_matrix()
    name, entry = _relied_on_patch(raw)
    key = entry["upstream"]
    up = raw["upstreams"][key]
    v = next(installed(d) for d in up["distributions"] if _has(d))
    up["tested"] = [t for t in up["tested"] if t != v]
    assert up["tested"], "the matrix tests more than one version of every upstream with relied-on code"
    up["source_verified"] = {v: "sources read from the wheel, compared with the tested release"}
    relied = entry["relies_on"][-1]
    entry["fingerprints"][v][relied] = "sha256:0000000000000000"
    env = {"REPLAY_PLUGIN_MATRIX": write(tmp_path, raw)}

    proc = cli("matrix", "--check", "--require-tested", "--upstream", key, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"note: {key} {v} is source-verified, never run in CI: sources read from the wheel" in proc.stdout
    fails = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL ")]
    assert fails == [
        f"FAIL {key} {v} is source-verified, not tested in CI (--require-tested)",
        f"FAIL {name}: relied-on {relied} differs from the fingerprint recorded for {v}",
    ], proc.stdout

    proc = cli("status", "--json", *_imports(key), env=env)
    rows = [r for r in json.loads(proc.stdout)["patches"] if r["upstream"] == key]
    assert rows and all(r["version"] == v and r["tier"] == "source-verified" for r in rows), rows
    by_name = {r["name"]: r for r in rows}
    assert by_name[name]["state"] in ("applied", "not-needed"), by_name[name]
    applied = [r for r in rows if r["state"] == "applied"]
    assert applied and all("source-verified: sources read, never run in CI" in r["reason"] for r in applied)


def test_matrix_check_fails_on_an_out_of_range_version(tmp_path):
    need("megatron-core")
    raw = shipped_matrix()
    v = installed("megatron-core")
    entry = raw["patches"][PATCH]
    entry["versions"] = f"!={v}"
    entry["fingerprints"] = {k: p for k, p in (entry.get("fingerprints") or {}).items() if k != v}
    proc = cli("matrix", "--check", "--upstream", "megatron-core", env={"REPLAY_PLUGIN_MATRIX": write(tmp_path, raw)})
    assert proc.returncode == 1
    assert f"FAIL {PATCH}: megatron-core {v} is outside the supported range" in proc.stdout


def test_matrix_check_passes_on_a_retired_version(tmp_path):
    """A version outside the patch's range on purpose (``retired``: the upstream no longer has
    what it fixes, as vLLM 0.34 for vllm.sampler_rows) is no problem: ``not-needed``, the reason
    shown; outside both it still fails (above)."""
    need("megatron-core")
    raw = shipped_matrix()
    v = installed("megatron-core")
    entry = raw["patches"][PATCH]
    entry["versions"] = f"!={v}"
    entry["retired"] = {f"=={v}": "the code it fixes was removed (test)"}
    entry["fingerprints"] = {k: p for k, p in (entry.get("fingerprints") or {}).items() if k != v}
    env = {"REPLAY_PLUGIN_MATRIX": write(tmp_path, raw)}
    proc = cli("matrix", "--check", "--json", "--upstream", "megatron-core", env=env)
    assert proc.returncode == 0, proc.stdout
    row = next(r for r in json.loads(proc.stdout)["patches"] if r["patch"] == PATCH)
    assert row["state"] == "not-needed" and row["detail"] == "retired: the code it fixes was removed (test)", row


def test_matrix_check_fails_on_a_changed_fingerprint(tmp_path):
    need("megatron-core")
    raw = shipped_matrix()
    v = installed("megatron-core")
    prints = raw["patches"][PATCH]["fingerprints"][v]
    target = next(iter(prints))
    prints[target] = "sha256:0000000000000000"
    proc = cli("matrix", "--check", "--upstream", "megatron-core", env={"REPLAY_PLUGIN_MATRIX": write(tmp_path, raw)})
    assert proc.returncode == 1
    assert f"FAIL {PATCH}: source of {target} differs from the fingerprint recorded for {v}" in proc.stdout


STATE = (
    "import megatron.core, json, replay_plugin; "
    "print('REPORT' + json.dumps({r['name']: r for r in replay_plugin.status()}))"
)


def _state(env):
    proc = run_python(STATE, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:])[PATCH], proc


def test_runtime_skips_out_of_range_unless_allowed(tmp_path):
    need("megatron-core")
    raw = shipped_matrix()
    v = installed("megatron-core")
    entry = raw["patches"][PATCH]
    entry["versions"] = f"!={v}"
    entry["fingerprints"] = {}
    path = write(tmp_path, raw)
    row, proc = _state({"REPLAY_PLUGIN_MATRIX": path})
    assert row["state"] == "skipped-version" and v in row["reason"]
    assert "not applied" in proc.stderr  # logged, once
    row, _ = _state({"REPLAY_PLUGIN_MATRIX": path, "REPLAY_PLUGIN_ALLOW_UNSUPPORTED": "1"})
    assert row["state"] == "applied" and "ALLOW_UNSUPPORTED" in row["reason"]
    proc = run_python("import megatron.core", env={"REPLAY_PLUGIN_MATRIX": path, "REPLAY_PLUGIN_STRICT": "1"})
    assert proc.returncode != 0 and "UnsupportedVersionError" in proc.stderr


def test_runtime_refuses_drifted_source(tmp_path):
    need("megatron-core")
    raw = shipped_matrix()
    v = installed("megatron-core")
    prints = raw["patches"][PATCH]["fingerprints"][v]
    prints[next(iter(prints))] = "sha256:0000000000000000"
    path = write(tmp_path, raw)
    row, _ = _state({"REPLAY_PLUGIN_MATRIX": path})
    assert row["state"] == "error" and "fingerprint drift" in row["reason"]
    proc = run_python("import megatron.core", env={"REPLAY_PLUGIN_MATRIX": path, "REPLAY_PLUGIN_STRICT": "1"})
    assert proc.returncode != 0 and "FingerprintDriftError" in proc.stderr


def test_doctor():
    proc = cli("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "doctor: no problems found" in proc.stdout
    proc = cli("doctor", env={"VLLM_PLUGINS": "some_other_plugin"})
    if importlib.util.find_spec("vllm") is not None:
        assert proc.returncode == 1 and "VLLM_PLUGINS='some_other_plugin' excludes 'replay_plugin'" in proc.stdout
    else:  # the vLLM rules run only where vLLM is installed
        assert proc.returncode == 0 and "VLLM_PLUGINS" not in proc.stdout
    proc = cli("doctor", env={"REPLAY_PLUGIN_STRCT": "1"})
    assert proc.returncode == 1 and "did you mean REPLAY_PLUGIN_STRICT" in proc.stdout
    proc = cli("doctor", "--json", env={"REPLAY_PLUGIN_DISABLE": "1"})
    report = json.loads(proc.stdout)
    assert any("REPLAY_PLUGIN_DISABLE" in n for n in report["notes"])


def test_doctor_ray_cluster_variables():
    proc = cli("doctor", env={"RAY_ADDRESS": "10.0.0.1:6379", "REPLAY_PLUGIN_STRICT": "1"})
    assert proc.returncode == 1 and "[ray]" in proc.stdout and "runtime_env" in proc.stdout
    assert cli("doctor", env={"REPLAY_PLUGIN_STRICT": "1"}).returncode == 0  # no cluster to miss them


def test_doctor_vllm_engine_arguments(tmp_path):
    """The settings users get wrong most, read from the job's own `vllm serve` arguments by vLLM's
    parser: opt-in variable vs the engine's logprobs mode, max_logprobs vs top_k + slack, the Ray
    executor's variable allowlist. The command once; its variants through the report it prints
    (``doctor.report`` with the environment it would see: each command pays vLLM's ~10 s import)."""
    need("vllm")
    from replay_plugin import doctor

    args = ["doctor", "--json", "--vllm-args", "/models/m --max-logprobs 20", "--top-k", "20"]
    proc = cli(*args)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1

    def problems(report):
        return " | ".join(f["problem"] + " -> " + f["fix"] for f in report["findings"])

    def doctor_report(vllm_args="/models/m --max-logprobs 20", top_k=20, **env):
        environ = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
        return doctor.report(vllm_args=vllm_args, top_k=top_k, environ={**environ, **env})

    assert not report["ok"]
    text = problems(report)
    assert "logprobs_mode=raw_logprobs" in text and "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=opt-in" in text
    assert "width 36" in text and "--max-logprobs >= 36" in text
    assert problems(doctor_report()) == text  # in-process, the same report as the command's
    fitted = {"REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS": "opt-in"}
    assert doctor_report(**fitted)["ok"]  # the plugin fits the engine: max_logprobs 128
    narrow = dict(fitted, REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_MAX_WIDTH="30")
    assert "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_MAX_WIDTH to >= 36" in problems(doctor_report(**narrow))
    ray = doctor_report("/models/m --distributed-executor-backend ray", None, **fitted)
    assert not ray["ok"] and "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY=REPLAY_PLUGIN_" in problems(ray)
    forwarded = dict(fitted, VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY="REPLAY_PLUGIN_")
    assert doctor_report("/models/m --distributed-executor-backend ray", None, **forwarded)["ok"]
    bad = doctor_report(None, None, REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS="sometimes")
    assert not bad["ok"] and "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS" in problems(bad)


def test_doctor_megatron_config(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({"model": {"num_moe_experts": 8, "moe_router_fusion": True}}))
    proc = cli("doctor", "--megatron-config", str(path))
    assert proc.returncode == 1
    assert "moe_enable_routing_replay" in proc.stdout and "moe_router_fusion" in proc.stdout
    path.write_text(yaml.safe_dump({"num_moe_experts": 8, "moe_enable_routing_replay": True}))
    assert cli("doctor", "--megatron-config", str(path)).returncode == 0
