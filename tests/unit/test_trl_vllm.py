"""The pure parts of the TRL pack's vLLM colocate patches (``trl.vllm_engine_args``,
``trl.vllm_rows``): the engine arguments fitted for the switch, and vLLM completions turned into
the rollout's completions (rows and routes checked). No trl, no vLLM: outputs are plain objects
with the attributes vLLM's ``CompletionOutput`` / ``RequestOutput`` have."""

from __future__ import annotations

import types

import numpy as np
import pytest

from replay_plugin.core.errors import NotReplayable, ReplayDataError
from replay_plugin.core.support import SupportRows
from replay_plugin.trl import rollout, vllm_engine, vllm_rows
from replay_plugin.trl.switch import Ask
from replay_plugin.vllm.client import ReplayDataMissing

LLM_KWARGS = {"model": "m", "logprobs_mode": "processed_logprobs", "max_num_batched_tokens": 4096}


def _rows(tokens, width=3):
    ids = np.full((len(tokens), width), -1, np.int32)
    ids[:, 0] = tokens
    return SupportRows(ids, np.asarray(tokens, np.int32), np.zeros(len(tokens), np.float32), np.ones(len(tokens), bool))


def _output(tokens, *, rows=True, routes=None):
    out = types.SimpleNamespace(token_ids=list(tokens), routed_experts=routes)
    if rows:
        out.sample_support = _rows(tokens)
    return out


def test_support_width_is_top_k_plus_slack_capped_at_the_vocabulary(monkeypatch):
    monkeypatch.delenv("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK", raising=False)
    assert vllm_engine.support_width(8, Ask(support=True)) == 24  # the job's default slack, 16
    assert vllm_engine.support_width(8, Ask(support=True, slack=2)) == 10
    assert vllm_engine.support_width(8, Ask(support=True), vocabulary=20) == 20
    monkeypatch.setenv("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK", "4")
    assert vllm_engine.support_width(8, Ask(support=True)) == 12
    for top_k in (0, 1, -1, None, True, 8.0):
        with pytest.raises(NotReplayable, match="GRPOConfig.top_k") as info:
            vllm_engine.support_width(top_k, Ask(support=True))
        assert info.value.setting == "top_k"


def test_engine_kwargs_raise_max_logprobs_and_ask_for_routes():
    fitted, changes = vllm_engine.engine_kwargs(LLM_KWARGS, Ask(support=True), 24)
    assert fitted == {**LLM_KWARGS, "max_logprobs": 24}
    assert changes == ["max_logprobs default (20) -> 24"]
    assert "max_logprobs" not in LLM_KWARGS  # a new dict
    # never lowered; -1 (no limit) kept
    for current in (-1, 24, 100):
        fitted, changes = vllm_engine.engine_kwargs({**LLM_KWARGS, "max_logprobs": current}, Ask(support=True), 24)
        assert fitted["max_logprobs"] == current and changes == []
    fitted, changes = vllm_engine.engine_kwargs({**LLM_KWARGS, "max_logprobs": 5}, Ask(support=True), 24)
    assert fitted["max_logprobs"] == 24 and changes == ["max_logprobs 5 -> 24"]
    # routes alone: the engine returns routed experts, max_logprobs untouched
    fitted, changes = vllm_engine.engine_kwargs(LLM_KWARGS, Ask(routes=True), None)
    assert fitted == {**LLM_KWARGS, "enable_return_routed_experts": True}
    assert changes == ["enable_return_routed_experts -> True"]
    fitted, _ = vllm_engine.engine_kwargs(LLM_KWARGS, Ask(support=True, routes=True), 24)
    assert fitted["max_logprobs"] == 24 and fitted["enable_return_routed_experts"] is True
    assert "enforce_eager" not in fitted
    # vLLM's CPU platform: routes need the eager model (the compiled one returns expert 0)
    fitted, changes = vllm_engine.engine_kwargs(LLM_KWARGS, Ask(routes=True), None, cpu=True)
    assert fitted["enforce_eager"] is True and changes[-1].startswith("enforce_eager -> True")
    fitted, _ = vllm_engine.engine_kwargs(LLM_KWARGS, Ask(support=True), 24, cpu=True)
    assert "enforce_eager" not in fitted  # rows alone: the compiled model is fine


def test_engine_kwargs_refuse_an_engine_without_processed_logprobs():
    with pytest.raises(NotReplayable, match="processed_logprobs") as info:
        vllm_engine.engine_kwargs({**LLM_KWARGS, "logprobs_mode": "raw_logprobs"}, Ask(support=True), 24)
    assert info.value.setting == "logprobs_mode"
    # routes alone do not need processed logprobs
    vllm_engine.engine_kwargs({**LLM_KWARGS, "logprobs_mode": "raw_logprobs"}, Ask(routes=True), None)


def test_the_clone_calls_the_bound_llm_and_leaves_the_module_alone():
    seen = []

    def init_vllm(self):
        self.llm = LLM(model="m", logprobs_mode="processed_logprobs")  # noqa: F821 - bound by the clone

    clone = vllm_engine._with_llm(init_vllm, lambda **kwargs: seen.append(kwargs) or "engine")
    holder = types.SimpleNamespace()
    clone(holder)
    assert holder.llm == "engine" and seen == [{"model": "m", "logprobs_mode": "processed_logprobs"}]
    assert "LLM" not in globals()


def test_completion_of_checks_rows_and_pads_routes_for_the_last_token():
    routes = np.arange(6 * 2 * 2).reshape(3 + 4 - 1, 2, 2) % 8  # P + T - 1 rows, as vLLM returns
    completion = vllm_rows.completion_of(
        _output([4, 5, 6, 7], routes=routes), [1, 2, 3], Ask(support=True, routes=True), 0
    )
    assert completion.rows.sampled.tolist() == [4, 5, 6, 7]
    assert completion.routes.shape == (7, 2, 2) and completion.routes.dtype == np.uint8
    np.testing.assert_array_equal(completion.routes[:6], routes)
    np.testing.assert_array_equal(completion.routes[6], [[0, 1], [0, 1]])  # padding row
    assert completion.router_padding.tolist() == [False] * 6 + [True]
    # all P + T rows: nothing padded
    full = vllm_rows.completion_of(_output([4], routes=np.zeros((4, 2, 2), np.uint8)), [1, 2, 3], Ask(routes=True), 0)
    assert full.rows is None and full.router_padding.tolist() == [False] * 4


def test_completion_of_refuses_missing_or_wrong_data_naming_the_completion():
    with pytest.raises(ReplayDataMissing, match="replay-plugin status") as info:
        vllm_rows.completion_of(_output([4, 5], rows=False), [1], Ask(support=True), 3)
    assert info.value.field == "replay_support" and info.value.trajectory == 3
    out = _output([4, 5])
    out.token_ids = [4, 9]
    with pytest.raises(ReplayDataError, match="rows captured for other tokens") as info:
        vllm_rows.completion_of(out, [1], Ask(support=True), 2)
    assert info.value.trajectory == 2
    with pytest.raises(ReplayDataMissing, match="enable_return_routed_experts"):
        vllm_rows.completion_of(_output([4, 5]), [1], Ask(support=True, routes=True), 0)
    with pytest.raises(ReplayDataError, match=r"routes of shape \(1, 2, 2\)") as info:
        vllm_rows.completion_of(_output([4, 5], routes=np.zeros((1, 2, 2), np.uint8)), [1], Ask(routes=True), 5)
    assert info.value.field == "replay_routes" and info.value.trajectory == 5


def test_completions_of_keeps_trls_order_and_check_tokens_compares_with_trls_ids():
    requests = [
        types.SimpleNamespace(prompt_token_ids=[1], outputs=[_output([4, 5])]),
        types.SimpleNamespace(prompt_token_ids=[2], outputs=[_output([6]), _output([7, 8, 9])]),
    ]
    completions = vllm_rows.completions_of(requests, Ask(support=True))
    assert [c.rows.sampled.tolist() for c in completions] == [[4, 5], [6], [7, 8, 9]]
    vllm_rows.check_tokens(completions, [[4, 5], [6], [7, 8, 9]])
    with pytest.raises(ReplayDataError, match="3 completions captured"):
        vllm_rows.check_tokens(completions, [[4, 5], [6]])
    with pytest.raises(ReplayDataError, match="tensor-parallel slice") as info:
        vllm_rows.check_tokens(completions, [[4, 5], [7], [7, 8, 9]])
    assert info.value.trajectory == 1
    # delivered as is: the rollout's own check agrees
    target = rollout.Rollout(Ask(support=True))
    target.deliver(completions)
    target.check([[4, 5], [6], [7, 8, 9]])


def test_served_generation_kwargs_move_the_plugins_keys_to_vllm_xargs():
    assert vllm_rows.served_generation_kwargs(None) == {}
    assert vllm_rows.served_generation_kwargs({"seed": 1}) == {"seed": 1}
    gk = {
        "seed": 1,
        "extra_args": {"replay_sample_support": True, "replay_routed_experts": False, "other": "x"},
        "vllm_xargs": {"mine": 2},
    }
    served = vllm_rows.served_generation_kwargs(gk)
    assert served == {
        "seed": 1,
        "extra_args": {"other": "x"},  # not the plugin's: left where the user put it
        "vllm_xargs": {"mine": 2, "replay_sample_support": 1, "replay_routed_experts": 0},
    }
    assert gk["extra_args"]["replay_sample_support"] is True  # TRL's dict is not changed
    served = vllm_rows.served_generation_kwargs({"extra_args": {"replay_sample_support_slack": 4}})
    assert served == {"vllm_xargs": {"replay_sample_support_slack": 4}}


def test_completions_of_choices_decode_and_check_the_served_fields():
    from replay_plugin.core.wire import encode_array

    def doc(rows):
        return {k: encode_array(getattr(rows, k)) for k in ("ids", "sampled", "sampled_logprob", "exact")}

    routes = np.ones((2 + 3 - 1, 2, 2), np.uint8)
    choices = [
        {"prompt_token_ids": [1, 2], "token_ids": [4, 5, 6], "sample_support": doc(_rows([4, 5, 6])),
         "routed_experts": encode_array(routes)},
        {"prompt_token_ids": [1, 2], "token_ids": [7], "sample_support": doc(_rows([7])),
         "routed_experts": encode_array(np.ones((2, 2, 2), np.uint8))},
    ]  # fmt: skip
    completions = vllm_rows.completions_of_choices(choices, Ask(support=True, routes=True))
    assert [c.rows.sampled.tolist() for c in completions] == [[4, 5, 6], [7]]
    assert [c.routes.shape[0] for c in completions] == [5, 3]
    assert [int(c.router_padding.sum()) for c in completions] == [1, 1]
    with pytest.raises(ReplayDataMissing):  # the server's plugin did not capture
        vllm_rows.completions_of_choices([{"token_ids": [4]}], Ask(support=True))
    choices[1]["token_ids"] = [8]
    with pytest.raises(ReplayDataError, match="rows captured for other tokens") as info:
        vllm_rows.completions_of_choices(choices, Ask(support=True))
    assert info.value.trajectory == 1
