"""trl.replay_guard on real TRL 1.16.0: a GRPOTrainer whose switch asks for a replay the plugin
cannot make exact is refused when built, naming the setting; without the switch the same
configurations build as stock TRL builds them."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import trl_harness as H  # noqa: E402
from support.upstream import need  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    need("trl")
    return H.save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3_moe")))


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        (dict(top_k=0, top_p=1.0), "top_k"),
        (dict(top_k=1), "top_k"),
        (dict(repetition_penalty=1.1), "repetition_penalty"),
        (dict(generation_kwargs={"extra_args": {"replay_routed_experts": True}}), "use_vllm"),
        (
            dict(generation_kwargs={"extra_args": {"replay_sample_suport": True}}),
            'GRPOConfig.generation_kwargs["extra_args"]',
        ),
    ],
)
def test_refused_by_name(model_dir, tmp_path, overrides, setting):
    need("trl")
    from replay_plugin.core.errors import NotReplayable

    overrides.setdefault("generation_kwargs", H.SUPPORT)
    with pytest.raises(NotReplayable) as info:
        H.make_trainer(model_dir, str(tmp_path), **overrides)
    assert info.value.setting == setting, info.value
    # stock TRL takes the same configuration without the switch
    overrides.pop("generation_kwargs")
    H.make_trainer(model_dir, str(tmp_path), **overrides)


def test_rollout_func_refused(model_dir, tmp_path):
    need("trl")
    from trl import GRPOTrainer

    from replay_plugin.core.errors import NotReplayable

    # (tools: TRL 1.16 itself refuses a chat template that cannot render tool calls, before the guard)
    with pytest.raises(NotReplayable) as info:
        GRPOTrainer(
            model=model_dir,
            reward_funcs=H.length_reward,
            args=H.config(str(tmp_path), generation_kwargs=H.SUPPORT),
            train_dataset=H.dataset(),
            rollout_func=lambda prompts, trainer: {},
        )
    assert info.value.setting == "rollout_func"


def test_router_agreement_knob_refused_by_name(model_dir, tmp_path, monkeypatch):
    """trl.routes' knob is read when the trainer is built (not after the first generation)."""
    need("trl")
    from replay_plugin.core.errors import NotReplayable
    from replay_plugin.trl.patches import ROUTER_AGREEMENT_ENV

    monkeypatch.setenv(ROUTER_AGREEMENT_ENV, "off")
    routes = {"extra_args": {"replay_routed_experts": True}}
    with pytest.raises(NotReplayable) as info:
        H.make_trainer(model_dir, str(tmp_path), generation_kwargs=routes)
    assert info.value.setting == ROUTER_AGREEMENT_ENV, info.value
    H.make_trainer(model_dir, str(tmp_path))  # without routes asked the knob is not read


NEEDED_PATCH_OFF = """
import sys
sys.path.insert(0, {here!r})
import trl_harness as H
from replay_plugin.core.errors import NotReplayable
try:
    H.make_trainer({model!r}, {output!r}, generation_kwargs=H.SUPPORT)
except NotReplayable as exc:
    print("REFUSED", exc.setting)
    print(exc)
H.make_trainer({model!r}, {output!r})
print("STOCK BUILT")
"""


def test_needed_patch_off_refused(model_dir, tmp_path):
    """With trl.support_logprobs switched off the switch would be ignored: refused, naming the toggle."""
    need("trl")
    from support.procs import run_python

    code = NEEDED_PATCH_OFF.format(here=HERE, model=model_dir, output=str(tmp_path))
    proc = run_python(code, env={"REPLAY_PLUGIN_TRL_SUPPORT_LOGPROBS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED REPLAY_PLUGIN_TRL_SUPPORT_LOGPROBS" in proc.stdout, proc.stdout
    assert "patch trl.support_logprobs" in proc.stdout and "disabled" in proc.stdout
    assert "STOCK BUILT" in proc.stdout


def test_value_changing_processor_refused_at_generate(model_dir, tmp_path):
    """A generation setting that adds a value-changing processor to transformers' sampler
    (sequence_bias) is refused when TRL's HF generate builds its processors, naming it."""
    need("trl")
    from replay_plugin.core.errors import NotReplayable

    kwargs = {**H.SUPPORT, "sequence_bias": [[[5], 2.0]]}
    trainer = H.make_trainer(model_dir, str(tmp_path), generation_kwargs=kwargs)
    with pytest.raises(NotReplayable) as info:
        trainer.train()
    assert info.value.setting == "SequenceBiasLogitsProcessor", info.value


RLOO_JOB = """
from trl import RLOOConfig, RLOOTrainer
import sys
sys.path.insert(0, {here!r})
import trl_harness as H
args = RLOOConfig(output_dir={output!r}, use_cpu=True, bf16=False, per_device_train_batch_size=4,
                  num_generations=4, max_completion_length=8, top_k=8, report_to="none",
                  generation_kwargs=H.SUPPORT)
try:
    RLOOTrainer(model={model!r}, reward_funcs=H.length_reward, args=args, train_dataset=H.dataset())
    print("BUILT")
except Exception as exc:
    print("REFUSED", type(exc).__name__, getattr(exc, "setting", None))
    print(exc)
"""


@pytest.mark.parametrize("disabled", [True, False], ids=["plugin-disabled", "plugin"])
def test_rloo_with_the_switch_refused(model_dir, tmp_path, disabled):
    """RLOOConfig takes the same generation_kwargs: stock TRL builds (and would train) an RLOO job
    whose switch asks for replay without a word; the pack wires GRPOTrainer only, so
    trl.unwired_trainers refuses it by name."""
    need("trl")
    from support.procs import run_python

    code = RLOO_JOB.format(here=HERE, model=model_dir, output=str(tmp_path))
    proc = run_python(code, env={"REPLAY_PLUGIN_DISABLE": "1"} if disabled else {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if disabled:
        assert "BUILT" in proc.stdout, proc.stdout
    else:
        assert "REFUSED NotReplayable trainer" in proc.stdout, proc.stdout
        assert "RLOOTrainer is not wired" in proc.stdout
