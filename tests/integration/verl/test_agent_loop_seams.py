"""``verl.rollout_support_batch`` at its two seams in the agent-loop process, on verl's own classes.

The V1 (TransferQueue) form: verl 0.9.1's
``AgentLoopWorkerTQ._agent_loop_postprocess`` stores ``AgentLoopOutput.as_dict()`` per sample and
batches the samples with ``list_of_dict_to_tensordict``. ``transferqueue`` is not installed here, so
the TransferQueue itself is not run: the test drives verl's own ``AgentLoopOutput`` and
``list_of_dict_to_tensordict`` inside a trajectory record as the agent loop leaves it (the
record's generate calls filled as ``LLMServerClient.generate`` fills it; the real server path is
``test_rollout_verl.py``), and checks what reaches the FSDP engine's reader.

``LLMServerClient.generate``: verl's own client, its server reached through a stand-in for the Ray
actor handle (``server.generate.remote``), so that which requests opt in, and what is recorded,
can be seen request by request."""

from __future__ import annotations

import numpy as np
import pytest
from support.upstream import need


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
    from replay_plugin.verl import engine_batch, turns

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
    rows = engine_batch.response_rows(field, torch.tensor([4, 2]), -1, "rollout_sample_support")
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


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Server:
    """Stands in for the Ray handle of verl's vLLMHttpServer: answers ``generate.remote`` with a
    TokenOutput of two tokens, with rows in extra_fields when asked and ``rows`` is set."""

    def __init__(self, rows: bool):
        self.rows = rows
        self.seen: list[dict] = []
        self.generate = _Remote(self._generate)

    async def _generate(self, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.seen.append(kwargs["sampling_params"])
        extra = {"global_steps": 1}
        asked = (kwargs["sampling_params"].get("extra_args") or {}).get("replay_sample_support")
        if asked and self.rows:
            extra["rollout_sample_support"] = _rows([5, 6])
        return TokenOutput(token_ids=[5, 6], log_probs=[-0.1, -0.2], extra_fields=extra)


def _client(server):
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient

    class Client(LLMServerClient):
        async def _acquire_server(self, request_id, **extra):
            return "s0", server

        def _release_server(self, server_id, request_id=None):
            return None

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}})
    return Client(config)


def test_llm_server_client_opts_in_the_trajectorys_own_requests_only():
    need("verl")
    import asyncio

    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.verl import agent_loop as al

    sampling = {"temperature": 1.0, "top_k": 4, "top_p": 1.0, "logprobs": True}
    own, teacher, bare = _Server(rows=True), _Server(rows=False), _Server(rows=False)
    own_client, teacher_client, bare_client = _client(own), _client(teacher), _client(bare)

    async def trajectory():
        record = al._Record(width=3, client=own_client)
        token = al._TRAJECTORY.set(record)
        try:
            out = await own_client.generate("r", prompt_ids=[1, 2], sampling_params=dict(sampling))
            await teacher_client.generate("r", prompt_ids=[1, 2, 5, 6], sampling_params=dict(sampling))
            await own_client.generate("r", prompt_ids=[1], sampling_params={**sampling, "temperature": 0})
            return record, out
        finally:
            al._TRAJECTORY.reset(token)

    asyncio.run(own_client.generate("v", prompt_ids=[1], sampling_params=dict(sampling)))  # no trajectory open
    assert "extra_args" not in own.seen[-1]
    record, out = asyncio.run(trajectory())
    # the trajectory's request opted in, with the job's slack (no key: this process's default, 16): a
    # server in another environment builds rows of the same width W (issue 41, F8; before, no slack was
    # sent and each server used its own REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK)
    assert own.seen[1]["extra_args"] == {"replay_sample_support": True, "replay_sample_support_slack": 16}
    assert "rollout_sample_support" not in out.extra_fields  # taken out: verl never sees the rows
    assert "extra_args" not in teacher.seen[0]  # a teacher's request is not a turn
    assert "extra_args" not in own.seen[2]  # greedy: not opted in
    assert len(record.turns) == 2 and (record.turns[0].rows == _rows([5, 6])).all() and record.turns[1].rows is None

    async def unpatched_server():  # opted in, answered without rows: refused, never trained on
        record = al._Record(width=3, client=bare_client)
        token = al._TRAJECTORY.set(record)
        try:
            await bare_client.generate("r", prompt_ids=[1], sampling_params=dict(sampling))
        finally:
            al._TRAJECTORY.reset(token)

    with pytest.raises(ReplayDataError, match="verl.rollout_support_server patch did not run"):
        asyncio.run(unpatched_server())
