"""The V1 (TransferQueue) form of ``verl.rollout_support_batch``: verl 0.9.1's
``AgentLoopWorkerTQ._agent_loop_postprocess`` stores ``AgentLoopOutput.as_dict()`` per sample and
batches the samples with ``list_of_dict_to_tensordict``. ``transferqueue`` is not installed here, so
the TransferQueue itself is not run: the test drives verl's own ``AgentLoopOutput`` and
``list_of_dict_to_tensordict`` inside a trajectory record as the agent loop leaves it (the
record's generate calls filled as ``LLMServerClient.generate`` fills it; the real server path is
``test_rollout_verl.py``), and checks what reaches the FSDP engine's reader."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import need


def _output(prompt, response, mask):
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    return AgentLoopOutput(
        prompt_ids=prompt, response_ids=response, response_mask=mask, response_logprobs=[-0.5] * len(response),
        metrics={},
    )  # fmt: skip


def _rows(ids):
    return np.array([[t, t + 1, -1] for t in ids], dtype=np.int32)


def test_as_dict_carries_the_rows_in_v1_batches():
    need("verl")
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from replay_plugin.verl import agent_loop as al
    from replay_plugin.verl import fsdp_engine, turns

    assert "rollout_sample_support" not in _output([1, 2], [5, 6], [1, 1]).as_dict()  # outside a training trajectory

    samples = []
    for response, mask, calls in (
        ([5, 6, 40, 7], [1, 1, 0, 1], [[5, 6], [7]]),  # two turns, a tool token between
        ([8, 9], [1, 1], [[8, 9]]),
    ):
        record = al._Record(width=3)
        record.turns = [turns.turn(c, _rows(c)) for c in calls]
        token = al._TRAJECTORY.set(record)
        try:
            samples.append(_output([1, 2, 3], response, mask).as_dict())
        finally:
            al._TRAJECTORY.reset(token)
    assert samples[0]["rollout_sample_support"].dtype == torch.int32
    assert samples[0]["rollout_sample_support"].tolist() == [[5, 6, -1], [6, 7, -1], [-1, -1, -1], [7, 8, -1]]

    td = list_of_dict_to_tensordict(samples)
    field = td["rollout_sample_support"]
    assert field.is_nested and field.offsets().diff().tolist() == [4, 2]  # jagged like rollout_log_probs
    rows = fsdp_engine._response_rows(field, torch.tensor([4, 2]), -1, "rollout_sample_support")
    assert rows.shape == (2, 4, 3) and rows[1, :2].tolist() == [[8, 9, -1], [9, 10, -1]]

    # a second output of the same trajectory cannot be told apart from the first: refused
    record = al._Record(width=3)
    record.turns = [turns.turn([5], _rows([5]))]
    token = al._TRAJECTORY.set(record)
    try:
        _output([1], [5], [1]).as_dict()
        with pytest.raises(ValueError, match="several outputs for one trajectory"):
            _output([1], [5], [1]).as_dict()
    finally:
        al._TRAJECTORY.reset(token)
