"""The TRL doctor (``replay-plugin doctor --trl-config``): TrlParser's reading of a job's YAML and
flags (compared with trl's own parser in tests/integration/trl/test_doctor_trl.py), and the
findings. Pure: no trl; the patch states are given."""

import json

import pytest

from replay_plugin.job_config import ConfigError
from replay_plugin.trl import doctor
from replay_plugin.trl.job_config import read

ON = {"extra_args": {"replay_sample_support": True, "replay_routed_experts": True}}
SWITCH = ["--generation_kwargs", json.dumps(ON)]
CLEAN = ["--top_k", "20", "--use_vllm", "true", *SWITCH]


def applies(name):
    return True, "applies"


def findings(config, patch_state=applies, environ=None):
    return [p for p, _ in doctor.check(config, environ or {}, patch_state).findings]


def test_flags_read_as_trl_reads_them(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "top_k: '8'\nuse_vllm: 1\ntemperature: 0.7\ngeneration_kwargs:\n  extra_args: {replay_sample_support: true}\n"
        "env:\n  REPLAY_PLUGIN_STRICT: 1\n"
    )
    job = read(
        [
            "accelerate",
            "launch",
            "--num_processes",
            "2",
            "train.py",
            "--config",
            str(cfg),
            "--top-k=20",
            "--use_transformers_paged",
            "--no_vllm_importance_sampling_correction",
            "--min_p",
            "0.05",
            "--report_to",
            "wandb",
            "tensorboard",
            "--repetition_penalty",
            "-1",
        ]  # fmt: skip
    )
    assert job["top_k"] == 20  # the flag wins over the file (argparse defaults)
    assert job["use_vllm"] == 1 and job["temperature"] == 0.7  # a non-string default is not converted
    assert job["generation_kwargs"] == {"extra_args": {"replay_sample_support": True}}
    assert job["use_transformers_continuous_batching"] is True  # the deprecated flag sets it
    assert job["vllm_importance_sampling_correction"] is False
    assert job["min_p"] == 0.05 and job["repetition_penalty"] == -1.0  # a negative number is a value
    assert job.env == {"REPLAY_PLUGIN_STRICT": "1"}
    assert read(["--config", str(cfg)])["top_k"] == 8  # a string default gets the option's type
    # a dict field on the command line: JSON, then transformers' _convert_str_dict
    kwargs = read(["--generation_kwargs", '{"extra_args": {"replay_sample_support": "true", "x": "7"}}'])
    assert kwargs["generation_kwargs"] == {"extra_args": {"replay_sample_support": True, "x": 7}}
    assert read("trl grpo --use_vllm --vllm_mode server")["vllm_mode"] == "server"
    assert read(str(cfg))["top_k"] == 8 and read('{"top_k": 4}')["top_k"] == 4 and read({"top_k": 3})["top_k"] == 3


@pytest.mark.parametrize(
    "config, words",
    [
        (["--top_k", "x"], "invalid int value 'x'"),
        (["--use_vllm", "maybe"], "invalid bool value"),
        (["--top_k"], "expects one value"),
        (["--use_vllm", "true", "false"], "expects one value"),
        (["train"], "no such file"),
        (["--top_k", "2", "stray"], "expects one value"),
        (["--config"], "needs the file's path"),
        (["--generation_kwargs", "{extra_args: 1}"], "json.loads"),
        ('--top_k "20', "cannot be split"),
        ("[1, 2]", "no positional argument"),
        ("{a: [}", "not a YAML/JSON mapping"),
    ],
)
def test_input_trl_refuses_is_named(config, words):
    with pytest.raises(ConfigError) as info:
        read(config)
    assert words in info.value.problem


def test_yaml_trlparser_refuses(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    env = tmp_path / "env.yaml"
    env.write_text("env: [A]\n")
    for path, words in [
        (listed, "must contain a YAML mapping"),
        (env, "`env` must be a mapping"),
        (tmp_path, "directory"),
    ]:
        with pytest.raises(ConfigError) as info:
            read(["--config", str(path)])
        assert words in info.value.problem
    with pytest.raises(ConfigError, match="first `--config PATH`"):
        good = tmp_path / "good.yaml"
        good.write_text("top_k: 2\n")
        read(["--config", str(good), "--config", "x.yaml"])


def test_an_object_is_read_by_its_attributes():
    from types import SimpleNamespace

    cfg = SimpleNamespace(top_k=20, use_vllm=True, generation_kwargs={"replay_routed_experts": True}, other=1)
    job = read(cfg)
    assert job["top_k"] == 20 and job["use_vllm"] is True and job["temperature"] == 1.0
    assert job.stray == ["generation_kwargs: replay_routed_experts"]


def test_a_replayable_config_is_clean_and_no_switch_is_a_note():
    assert findings(CLEAN) == []
    assert findings(["--top_k", "20", *SWITCH[:1], json.dumps({"extra_args": {"replay_sample_support": True}})]) == []
    report = doctor.check(["--top_k", "20"], {}, applies)
    assert report.findings == [] and "not set" in report.notes[0]


@pytest.mark.parametrize(
    "config, words",
    [
        (["--use_vllm", *SWITCH], "top_k (TRL's default): sampler setting 'top_k'=0"),
        ([*CLEAN, "--top_k", "1"], "GRPOConfig.top_k: sampler setting 'top_k'=1"),
        ([*CLEAN, "--repetition_penalty", "1.1"], "'repetition_penalty'=1.1"),
        (
            [*CLEAN[:4], "--generation_kwargs", json.dumps({**ON, "temperature": 0.7})],
            "scores at GRPOConfig.temperature=1.0",
        ),
        ([*CLEAN, "--temperature", "0.001"], "'temperature'=0.001"),
        (
            ["--top_k", "20", "--use_vllm", "--generation_kwargs", json.dumps({**ON, "top_k": -1})],
            "generation_kwargs.top_k",
        ),
        (
            ["--top_k", "20", "--use_vllm", "--generation_kwargs", json.dumps({**ON, "presence_penalty": 0.5})],
            "presence_penalty",
        ),
        (["--top_k", "20", *SWITCH], "HF generate path returns no routes"),
        (["--top_k", "20", "--generation_kwargs", json.dumps({**ON, "sequence_bias": {"1": 2}})], "sequence_bias"),
        ([*CLEAN, "--vllm_mode", "server", "--use_cpu"], "refuses any device but CUDA"),
        (
            ["--top_k", "0", "--use_vllm", "--generation_kwargs", json.dumps({**ON, "top_k": 20})],
            "overrides GRPOConfig.top_k=0 for the sampler only",
        ),
        ([*CLEAN, "--use_transformers_continuous_batching", "true"], "use_transformers_continuous_batching"),
        ([*CLEAN, "--replay_sample_support", "true"], "the command line: --replay_sample_support is not read"),
        (
            ["--top_k", "20", "--generation_kwargs", '{"replay_sample_support": true}'],
            "generation_kwargs: replay_sample_support",
        ),
        (
            ["--generation_kwargs", '{"extra_args": {"replay_sample_suport": true}}'],
            "did you mean replay_sample_support?",
        ),
        (
            ["--generation_kwargs", '{"extra_args": {"Replay-Sample-Support": true}}'],
            "did you mean replay_sample_support?",
        ),
        (["--generation_kwargs", '{"extra_args": {"replay_sample_support": "perhaps"}}'], "expected true/false"),
        (["--generation_kwargs", '{"extra_args": [1]}'], "expected a dict"),
        ({"generation_kwargs": "extra_args=1"}, "not a mapping"),
    ],
)
def test_each_setting_that_silences_or_breaks_replay_is_found(config, words):
    found = findings(config)
    assert any(words in p for p in found), found


def test_both_sampler_problems_are_reported():
    found = findings([*CLEAN, "--top_k", "0", "--repetition_penalty", "1.2"])
    assert len(found) == 2 and "top_k" in found[0] and "repetition_penalty" in found[1]


def test_env_block_variables_are_found(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("env:\n  REPLAY_PLUGIN_DISABLE: '1'\n  WANDB_MODE: offline\n")
    found = findings(["--config", str(cfg)])
    assert len(found) == 1 and "sets REPLAY_PLUGIN_DISABLE:" in found[0]


def test_patches_the_backend_needs_are_named():
    asked = []

    def off(name):
        asked.append(name)
        return name != "trl.vllm_rows", "disabled: REPLAY_PLUGIN_TRL_VLLM_ROWS=0"

    found = findings(CLEAN, off)
    assert len(found) == 1 and "trl.vllm_rows disabled: REPLAY_PLUGIN_TRL_VLLM_ROWS=0" in found[0]
    assert "the trainer's guard (trl.replay_guard) refuses the job" in found[0]
    assert {
        "trl.rollout_batch",
        "trl.support_logprobs",
        "trl.routes",
        "vllm.sample_support",
        "vllm.routed_experts",
    } <= set(asked)
    asked.clear()
    findings(["--top_k", "20", "--generation_kwargs", json.dumps({"extra_args": {"replay_sample_support": 1}})], off)
    assert "trl.hf_sampler_rows" in asked and not any(n.startswith("vllm.") for n in asked)
    asked.clear()
    findings([*CLEAN, "--vllm_mode", "server"], off)
    assert "trl.vllm_rows" in asked and not any(n.startswith("vllm.") for n in asked)  # capture: the server's

    def missing(name):
        return False, "trl is not installed here" if name.startswith("trl.") else "applies"

    assert (
        findings(CLEAN, missing) == [findings(CLEAN, missing)[0]]
        and "trl is not installed in" in findings(CLEAN, missing)[0]
    )
    unregistered = findings(CLEAN, lambda name: (False, "not registered (the plugin's pack did not load)"))
    assert (
        len(unregistered) == 1
        and "trl.replay_guard, trl.rollout_batch, trl.support_logprobs" in unregistered[0]
        and "vllm.routed_experts not registered" in unregistered[0]
        and "silently" in unregistered[0]
        and unregistered[0].count("not registered") == 1
    )


def test_notes_name_the_changes_to_know():
    notes = doctor.check([*CLEAN, "--top_p", "0.9"], {}, applies).notes
    text = "\n".join(notes)
    assert "top_p=0.9" in text and "no longer scaled by ~S^T" in text and "bfloat16" in text and "tools" in text
    token = "\n".join(doctor.check([*CLEAN, "--vllm_importance_sampling_mode", "token_truncate"], {}, applies).notes)
    assert "~S, the kept mass per token" in token
    server = "\n".join(doctor.check([*CLEAN, "--vllm_mode", "server"], {}, applies).notes)
    assert "server's own environment" in server and "bfloat16" not in server


def test_doctor_report_carries_trl_findings_and_notes(tmp_path):
    from replay_plugin import doctor as top

    found, _ = top.check_trl(["--config", str(tmp_path / "missing.yaml")], {})
    assert [f.check for f in found] == ["trl-config"] and "no such file" in found[0].problem
    found, notes = top.check_trl(["--top_k", "20"], {})
    assert found == [] and "not set" in notes[0]


def test_the_patches_the_doctor_requires_are_the_guards_and_the_matrix_patches():
    """The doctor asks about the patches the trainer's guard requires (its own list) and the vLLM
    capture of a colocated engine; every trl patch of the matrix is one of them for some backend
    (a new one: does a switched-on job need it?), every vllm one a patch of the matrix."""
    from types import SimpleNamespace

    from replay_plugin import compat
    from replay_plugin.trl import guard
    from replay_plugin.trl.switch import Ask

    both = Ask(support=True, routes=True)
    everything = set()
    for words in (CLEAN, [*CLEAN, "--vllm_mode", "server"], ["--top_k", "20"]):
        job = read(words)
        names = doctor.needed_patches(job, both)
        use_vllm = bool(job["use_vllm"])
        trl_names = [n for n in names if n.startswith("trl.")]
        assert trl_names == [doctor.GUARD, *guard.needed_patches(SimpleNamespace(use_vllm=use_vllm), both)]
        everything |= set(names)
    assert {n for n in everything if n.startswith("vllm.")} == {*guard_capture()}
    matrix = compat.load()
    assert {n for n in everything if n.startswith("vllm.")} <= set(matrix.patches)
    # trl.unwired_trainers refuses RLOOTrainer jobs with the switch: no GRPO job needs it
    trl_patches = {n for n in matrix.patches if n.startswith("trl.")} - {"trl.unwired_trainers"}
    assert trl_patches <= everything, sorted(trl_patches - everything)


def guard_capture():
    from replay_plugin.trl import vllm_engine

    return (*vllm_engine.SUPPORT_CAPTURE, *vllm_engine.ROUTES_CAPTURE)
