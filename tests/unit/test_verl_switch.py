"""verl's switch keys under ``actor_rollout_ref.rollout.custom`` (pure: no verl needed)."""

from __future__ import annotations

import pytest

from replay_plugin.core.errors import NotReplayable
from replay_plugin.verl import switch


@pytest.mark.parametrize("key", ["replay_sample_suport", "Replay_Sample_Support", "replay_sample_support_slak"])
def test_a_misspelt_switch_is_refused_naming_the_key_it_resembles(key):
    """verl accepts any key under ``custom``: a misspelt switch was read as "off" by the plugin and
    ignored by verl, so the job trained over the full vocabulary without a word."""
    config = {"custom": {key: True}}
    with pytest.raises(NotReplayable) as exc:
        switch.requested(config)
    message = str(exc.value)
    assert switch.PREFIX + key in message
    assert "did you mean" in message and ("replay_sample_support" in message.split("did you mean")[1])


def test_unknown_keys_lists_only_replay_prefixed_strangers():
    config = {"custom": {"replay_sample_support": True, "replay_sample_support_slack": 4, "other": 1, "replay_x": 2}}
    (message,) = switch.unknown_keys(config)
    assert "replay_x" in message and "known: replay_sample_support, replay_sample_support_slack" in message
    assert switch.requested({"custom": {"replay_sample_support": "true", "other": 1}}) is True
    assert switch.requested({"custom": {}}) is False


def test_a_slack_above_the_vllm_packs_cap_is_refused_at_the_start_naming_the_key():
    """The vLLM pack refuses a request's slack above ``MAX_SLACK`` (2**20); the switch accepted any
    decimal, so the server started and then refused every request (issue 41, F9)."""
    from replay_plugin.vllm.options import MAX_SLACK

    assert switch.slack({"custom": {"replay_sample_support_slack": str(MAX_SLACK)}}) == MAX_SLACK
    for value in (MAX_SLACK + 1, "2000000"):
        with pytest.raises(NotReplayable) as exc:
            switch.slack({"custom": {"replay_sample_support_slack": value}})
        assert exc.value.setting == switch.PREFIX + switch.SLACK and f"[0, {MAX_SLACK}]" in str(exc.value)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), True])
def test_a_temperature_that_is_no_finite_number_is_refused_naming_the_key(temperature):
    """``temperature <= 0.01`` is False for NaN: a NaN temperature passed the server's start (F10)."""
    config = {"top_k": 4, "temperature": temperature}
    with pytest.raises(NotReplayable) as exc:
        switch.check_rollout_config(config)
    assert exc.value.setting == "actor_rollout_ref.rollout.temperature" and "finite" in str(exc.value)
    switch.check_rollout_config({"top_k": 4, "temperature": 0.7})


def test_row_memory_warning_names_the_size_and_how_to_lower_it():
    def job(prompts, n, length):
        return {
            "data": {"train_batch_size": prompts},
            "actor_rollout_ref": {"rollout": {"n": n, "response_length": length}},
        }

    # 256 prompts x 8 x 8192 tokens x W 1020 (slack 1000): 68.4 GB int32; W 20 (top_k 4 + 16): 1.3 GiB
    message = switch.row_memory_warning(job(256, 8, 8192), 1020)
    assert message is not None and "63.8 GiB" in message and switch.PREFIX + switch.SLACK in message
    assert "1.2 GiB" in switch.row_memory_warning(job(256, 8, 8192), 20)
    assert switch.row_memory_warning(job(64, 4, 1024), 20) is None  # 20 MiB
    assert switch.row_memory_warning({"data": {}}, 1020) is None  # sizes unknown: nothing said
