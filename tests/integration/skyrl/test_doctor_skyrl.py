"""``replay-plugin doctor --skyrl-config`` reads SkyRL's overrides as SkyRL 0.4.0 reads them
(``SkyRLTrainConfig.from_cli_overrides``: ``OmegaConf.from_cli``, a ``+`` refused) and judges its
flags as SkyRL tests them (``if ie.enable_...:``, Python's truth), and names the config it cannot
read instead of a traceback (issue 41, items 7 and 8)."""

from __future__ import annotations

import functools
import math
import os
import shlex

import pytest
from support.upstream import need

SUPPORT = "generator.inference_engine.enable_return_sample_support_set"
ROUTES = "generator.inference_engine.enable_return_routed_experts"
TOP_K = "generator.sampling_params.top_k=4"


def clean_env(**env: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}, **env}


def skyrl_findings(keys: str, **env: str) -> list[tuple[str, str]]:
    from replay_plugin.skyrl import doctor

    return doctor.check(keys, clean_env(**env))


def _same(a, b) -> bool:
    """Equal values of the same type (``1`` is not ``True``), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def test_doctor_reads_overrides_as_skyrl_does():
    """Each line's keys read by the doctor equal the fields of SkyRL's own config built from the
    words a shell makes of the line (``1`` stays an int, ``yes`` is true, ``0x14`` is 20, ``inf`` a
    string, a quoted ``'false'`` a string); a ``+`` SkyRL refuses, the doctor names."""
    need("skyrl")
    from skyrl.train.config.config import SkyRLTrainConfig

    from replay_plugin import job_config
    from replay_plugin.job_config import parse_config

    lines = [
        f"{ROUTES}=1 trainer.strategy=fsdp2",
        f"{SUPPORT}=yes generator.sampling_params.top_k=0x14",
        f"{SUPPORT}=false generator.sampling_params.temperature=inf",
        f'{ROUTES}="\'false\'" trainer.run_name="my run" generator.sampling_params.top_k=1_000',
        f"{SUPPORT}=on {TOP_K} trainer.project_name=0o17 generator.sampling_params.temperature=.inf",
    ]
    for line in lines:
        cfg = SkyRLTrainConfig.from_cli_overrides(shlex.split(line))
        read = parse_config(line, "SkyRL")
        assert read.keys() == {w.partition("=")[0] for w in shlex.split(line)}, (line, read)
        for key, value in read.items():
            theirs = functools.reduce(getattr, key.split("."), cfg)
            assert _same(value, theirs), (line, key, value, theirs)
    plus = f"+{SUPPORT}=true"
    with pytest.raises(ValueError, match="The '\\+' prefix"):
        SkyRLTrainConfig.from_cli_overrides([plus])
    with pytest.raises(job_config.ConfigError, match="SkyRL refuses the '\\+' prefix"):
        parse_config(plus, "SkyRL")


def test_doctor_judges_skyrl_flags_as_skyrl_does():
    """The review's F5 rows for SkyRL: ``=1`` switches routes and the sample-support capture on
    (SkyRL tests the value's truth), so a patch that is off is a finding, as with ``=true``."""
    need("skyrl", "vllm")
    for on in ("true", "1", "yes"):
        (routes,) = skyrl_findings(f"{ROUTES}={on} trainer.strategy=fsdp2", REPLAY_PLUGIN_SKYRL_FSDP_WORKER_ROUTES="0")
        assert "captured and never replayed" in routes[0], (on, routes)
        (support,) = skyrl_findings(f"{SUPPORT}={on} {TOP_K}", REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS="0")
        assert "skyrl.sample_support_rows disabled" in support[0], (on, support)
    for off in ("false", "0", "null", "no"):
        assert skyrl_findings(f"{ROUTES}={off} {SUPPORT}={off}", REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS="0") == []
    # F11: the toggle named with the value set, never as "=0" (an empty one: named while settings read
    # it as off, no finding once an empty toggle is unset)
    (off,) = skyrl_findings(f"{SUPPORT}=1 {TOP_K}", REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS="off")
    assert "skyrl.sample_support_rows disabled: REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS=off)" in off[0], off
    for problem, _ in skyrl_findings(f"{SUPPORT}=1 {TOP_K}", REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS=""):
        assert "SAMPLE_SUPPORT_ROWS=''" in problem and "SAMPLE_SUPPORT_ROWS=0" not in problem, problem


def test_doctor_reports_a_skyrl_config_it_cannot_read(tmp_path):
    """Input SkyRL's parser rejects, and files that cannot be read: one ``skyrl-config`` finding
    naming the input, never a traceback."""
    need("skyrl")
    from replay_plugin import doctor

    (tmp_path / "adir").mkdir()
    (tmp_path / "bad.yaml").write_text("generator: {inference_engine: [1,\n")
    (tmp_path / "latin1.yaml").write_bytes(b"trainer:\n  run_name: caf\xe9\n")
    (tmp_path / "list.yaml").write_text(f"- {SUPPORT}=true\n")
    unreadable = {
        "path/skyrl.yaml": "no such file",
        str(tmp_path / "adir"): "is a directory",
        str(tmp_path / "bad.yaml"): "is not valid YAML",
        str(tmp_path / "latin1.yaml"): "is not UTF-8 text",
        str(tmp_path / "list.yaml"): "not a mapping",
        f"+{SUPPORT}=true": "SkyRL refuses the '+' prefix",
        f"~{SUPPORT}": "has no deletion",
        f"{SUPPORT}=true trainer.run_name='unclosed": "cannot be split into words",
        f"{SUPPORT}=true trainer.run_name=${{nope}}": "interpolation the doctor cannot resolve",
        f"generator.inference_engine=[1] {SUPPORT}=true": "cannot merge them",
    }
    unreadable.update({f"trainer.run_name={v}": "SkyRL's parser" for v in ("@x", "*x", "%x", "`x`", "[1,2")})
    unreadable["trainer.run_name=!!python/name:os.system"] = "SkyRL's parser"
    for config, words in unreadable.items():
        report = doctor.report(skyrl_config=config, environ=clean_env())
        found = [f for f in report["findings"] if f["check"].startswith("skyrl")]
        assert not report["ok"] and len(found) == 1, (config, found)
        assert found[0]["check"] == "skyrl-config" and words in found[0]["problem"] and found[0]["fix"], found
        assert any(found[0]["problem"].startswith(repr(w)) for w in [config, *config.split()]), found  # names it


def test_verl_doctor_without_hydra_says_so():
    """Where verl's parser (hydra-core) is not importable (this environment: SkyRL, no verl), the
    verl doctor does not guess a reading of Hydra's overrides: it names the missing parser."""
    need("skyrl")
    import importlib.util

    from replay_plugin import doctor

    if importlib.util.find_spec("hydra") is not None:
        pytest.skip("hydra-core is importable here")
    report = doctor.report(
        verl_config="+actor_rollout_ref.rollout.custom.replay_sample_support=1 actor_rollout_ref.rollout.top_k=20",
        environ=clean_env(),
    )
    (found,) = [f for f in report["findings"] if f["check"].startswith("verl")]
    assert (
        found["check"] == "verl-config"
        and "hydra-core (verl's command-line parser) is not importable" in (found["problem"])
    ), found
