"""The TRL doctor reads a job's config as trl 1.16.0's own ``TrlParser`` does: the same words and
YAML files through both, the same values of every field the doctor judges; what the doctor
calls refused is refused by TRL; and ``replay-plugin doctor --trl-config`` end to end."""

import json
import os
import subprocess
import sys

import pytest
from support.upstream import need_module

from replay_plugin.job_config import ConfigError
from replay_plugin.trl.job_config import FIELDS, read

pytestmark = pytest.mark.timeout(300)

#: what every parse needs besides the words under test (GRPOConfig refuses bf16 without a GPU)
EXTRA = ["--output_dir", "/tmp/trl-doctor", "--use_cpu", "true"]
ON = {"extra_args": {"replay_sample_support": "true", "replay_routed_experts": 1, "replay_sample_support_slack": "4"}}


@pytest.fixture(scope="module")
def trl_parse():
    """``TrlParser((GRPOConfig,)).parse_args_and_config(words)`` (as ``trl grpo`` calls it, unknown
    YAML keys dropped) -> the GRPOConfig."""
    need_module("trl")
    from trl import GRPOConfig, TrlParser

    def parse(words, fail_with_unknown_args=False):
        saved = dict(os.environ)
        try:
            (cfg,) = TrlParser((GRPOConfig,)).parse_args_and_config(
                [*words, *EXTRA], fail_with_unknown_args=fail_with_unknown_args
            )
        finally:
            os.environ.clear()  # TrlParser exports the YAML's env: block into this process
            os.environ.update(saved)
        return cfg

    return parse


def cases(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "top_k: '8'\nuse_vllm: 1\ntemperature: 0.7\nmin_p: 0.1\nvllm_mode: server\n"
        f"generation_kwargs: {json.dumps(ON)}\nenv:\n  REPLAY_PLUGIN_STRICT: 1\nreplay_sample_support: true\n"
    )
    return [
        ["--top-k=20", "--use_vllm", "--generation_kwargs", json.dumps(ON)],
        ["--top_k", "4", "--use-vllm", "false", "--temperature", "0.5", "--top_p", "0.9"],
        ["--no_vllm_importance_sampling_correction", "--vllm_importance_sampling_mode", "token_truncate"],
        ["--use_transformers_paged", "--repetition_penalty", "-1", "--report_to", "none", "--logging_steps", "3"],
        ["--config", str(cfg)],
        ["--config", str(cfg), "--top_k", "20", "--use_vllm", "false", "--generation_kwargs", '{"top_k": 3}'],
        ["--vllm_tensor_parallel_size", "2", "--model_init_kwargs", '{"dtype": "float32"}', "--min_p", "0.05"],
    ]


def test_the_doctor_reads_what_trl_parses(trl_parse, tmp_path):
    for words in cases(tmp_path):
        cfg = trl_parse(words)
        job = read([*words, *EXTRA])
        trl_values = {name: getattr(cfg, name) for name in FIELDS}
        assert job.fields == trl_values, words
        assert read(cfg).fields == trl_values  # a GRPOConfig object, read by its attributes
    # the file's env: block is what TrlParser exported
    job = read(["--config", str(tmp_path / "cfg.yaml")])
    assert job.env == {"REPLAY_PLUGIN_STRICT": "1"}
    # the top-level replay_* key: `trl grpo` (fail_with_unknown_args=False, the fixture's) drops it
    # without a word; parse_args_and_config's default refuses it
    assert job.stray == [f"--config {tmp_path / 'cfg.yaml'}: replay_sample_support"]
    with pytest.raises(ValueError, match="replay_sample_support"):
        trl_parse(["--config", str(tmp_path / "cfg.yaml")], fail_with_unknown_args=True)
    # a generation_kwargs string that is not JSON stays a string in TRL too
    assert trl_parse(["--generation_kwargs", "extra_args"]).generation_kwargs == "extra_args"
    assert read(["--generation_kwargs", "extra_args"])["generation_kwargs"] == "extra_args"


@pytest.mark.parametrize(
    "words",
    [
        ["--top_k", "x"],
        ["--use_vllm", "maybe"],
        ["--top_k"],
        ["--use_vllm", "true", "false"],
        ["--top_k", "2", "stray"],
        ["--generation_kwargs", "{extra_args: 1}"],
        ["--no_vllm_importance_sampling_correction", "false"],
    ],
)
def test_what_the_doctor_calls_refused_trl_refuses(trl_parse, words):
    with pytest.raises(ConfigError):
        read(words)
    with pytest.raises((SystemExit, ValueError)):  # argparse exits; __post_init__ raises
        trl_parse(words)


def test_yaml_trl_refuses(trl_parse, tmp_path):
    listed, env = tmp_path / "list.yaml", tmp_path / "env.yaml"
    listed.write_text("- 1\n")
    env.write_text("env: [A]\n")
    for path in (listed, env):
        with pytest.raises(ConfigError):
            read(["--config", str(path)])
        with pytest.raises(ValueError):
            trl_parse(["--config", str(path)])
    with pytest.raises(ConfigError):
        read(["--config", str(tmp_path / "cfg.yaml"), "--config", str(listed)])
    (tmp_path / "cfg.yaml").write_text("top_k: 2\n")
    with pytest.raises(ValueError, match="not used by the HfArgumentParser"):
        trl_parse(["--config", str(tmp_path / "cfg.yaml"), "--config", str(listed)])


def test_doctor_command(tmp_path):
    cli = os.path.join(os.path.dirname(sys.executable), "replay-plugin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}

    def doctor(config):
        return subprocess.run(
            [cli, "doctor", "--json", "--trl-config", config], env=env, capture_output=True, text=True
        )

    proc = doctor(f"--top_k 1 --use_vllm true --generation_kwargs '{json.dumps(ON)}'")
    report = json.loads(proc.stdout)
    trl = [f for f in report["findings"] if f["check"] == "trl"]
    assert proc.returncode == 1 and any("'top_k'=1 is not replayable" in f["problem"] for f in trl), report
    assert any("no longer scaled by ~S^T" in note for note in report["notes"])
    proc = doctor("--top_k 20")
    assert any("switch is not set" in note for note in json.loads(proc.stdout)["notes"])
    proc = doctor(str(tmp_path / "missing.yaml"))
    bad = [f for f in json.loads(proc.stdout)["findings"] if f["check"] == "trl-config"]
    assert proc.returncode == 1 and "no such file" in bad[0]["problem"]


def test_trlparser_exports_env_after_the_plugin_activated(tmp_path):
    """Why the doctor reports REPLAY_PLUGIN_* in the YAML's env: block: importing TrlParser
    imports transformers, which activates the plugin (its settings read, its patches armed)
    before parse_args_and_config exports the block; REPLAY_PLUGIN_DISABLE=1 there does not
    disable it."""
    need_module("trl")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("env:\n  REPLAY_PLUGIN_DISABLE: '1'\n")
    code = f"""
import os
from trl import GRPOConfig, TrlParser
from replay_plugin import _bootstrap
active_before = _bootstrap.is_active()
TrlParser((GRPOConfig,)).parse_args_and_config(["--config", {str(cfg)!r}, *{EXTRA!r}])
print(active_before, os.environ["REPLAY_PLUGIN_DISABLE"], _bootstrap.is_active())
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-3:] == ["True", "1", "True"]
