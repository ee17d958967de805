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
