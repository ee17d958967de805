"""The client helpers of ``replay_plugin.vllm.client`` (pure: no vLLM import) refuse to return
nothing for a request that asked for replay data."""

from __future__ import annotations

import types

import numpy as np
import pytest

from replay_plugin.core.errors import ReplayDataError
from replay_plugin.core.support import SupportRows
from replay_plugin.core.wire import encode_array
from replay_plugin.vllm.client import ReplayDataMissing, decode_choice, decode_stream, support_for, support_of


def _rows(tokens, width=3):
    ids = np.full((len(tokens), width), -1, np.int32)
    ids[:, 0] = tokens
    return SupportRows(ids, np.asarray(tokens, np.int32), np.zeros(len(tokens), np.float32), np.ones(len(tokens), bool))


def _doc(rows):
    return {k: encode_array(getattr(rows, k)) for k in ("ids", "sampled", "sampled_logprob", "exact")}


def test_support_of_raises_when_an_output_carries_no_rows():
    output = types.SimpleNamespace(token_ids=[1, 2])
    with pytest.raises(ReplayDataMissing, match=r"replay-plugin status --import vllm") as info:
        support_of(output)
    assert isinstance(info.value, ReplayDataError) and info.value.field == "sample_support"
    assert support_of(output, required=False) is None
    output.sample_support = _rows([1, 2])
    assert support_of(output).sampled.tolist() == [1, 2]
    output._replay_plugin_refused = "engine core 0 cannot capture ...: logprobs_mode='raw_logprobs'"
    with pytest.raises(ReplayDataMissing, match="the engine refused the request: engine core 0"):
        support_of(output, required=False)  # a refusal is never silent


def test_support_for_checks_the_rows_against_the_tokens_handed_on():
    """What verl's server and SkyRL's endpoint hand on: one row per returned token, for that
    token, with a finite sampled logprob; else an error naming the caller's field (and token)."""
    output = types.SimpleNamespace(sample_support=_rows([4, 5, 6]))
    assert support_for(output, [4, 5, 6], "rollout_sample_support").sampled.tolist() == [4, 5, 6]
    with pytest.raises(ReplayDataError, match="3 captured rows for 2 generated tokens") as info:
        support_for(output, [4, 5], "rollout_sample_support")
    assert info.value.field == "rollout_sample_support"
    with pytest.raises(ReplayDataError, match="rows captured for other tokens"):
        support_for(output, [4, 7, 6])
    output.sample_support.sampled_logprob[1] = np.nan
    with pytest.raises(ReplayDataError, match="not finite") as info:
        support_for(output, np.array([4, 5, 6]))
    assert info.value.token == 1
    with pytest.raises(ReplayDataMissing):
        support_for(types.SimpleNamespace(), [4])


def test_decode_choice_requires_the_support_unless_told_otherwise():
    with pytest.raises(ReplayDataMissing, match="served choice carries no support rows"):
        decode_choice({"index": 0, "text": "hi"})
    assert decode_choice({"index": 0}, require_support=False).support is None
    assert decode_choice({"sample_support": _doc(_rows([4]))}).support.sampled.tolist() == [4]


def test_decode_stream_concatenates_each_choices_chunks():
    a, b = _rows([5, 6]), _rows([7])
    routes = np.arange(8, dtype=np.uint8).reshape(2, 2, 2)
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "token_ids": [5, 6], "sample_support": _doc(a)}]},
        {"choices": [{"index": 1, "token_ids": [9], "sample_support": _doc(_rows([9]))}]},
        {
            "choices": [
                {"index": 0, "token_ids": [7], "sample_support": _doc(b), "routed_experts": encode_array(routes)}
            ]
        },
        {"choices": [], "usage": {"completion_tokens": 4}},
    ]
    out = decode_stream(chunks)
    assert out[0].support.sampled.tolist() == [5, 6, 7] and np.array_equal(out[0].routed_experts, routes)
    assert out[1].support.sampled.tolist() == [9] and out[1].routed_experts is None
    with pytest.raises(ReplayDataError, match="choice 0, chunk 0 carries 2 support rows for 3 token_ids"):
        decode_stream([{"choices": [{"index": 0, "token_ids": [5, 6, 7], "sample_support": _doc(a)}]}])
    with pytest.raises(ReplayDataMissing, match="streamed choice 0"):
        decode_stream([{"choices": [{"index": 0, "token_ids": [5]}]}])
    assert decode_stream([{"choices": [{"index": 0, "text": "x"}]}], require_support=False)[0].support is None


def test_decode_stream_checks_each_chunks_rows_against_its_own_tokens():
    """Rows are per chunk: a chunk's rows are those of its own token_ids (count and ids), even
    where the totals of the stream agree; the error names the choice and the chunk."""
    with pytest.raises(ReplayDataError, match=r"choice 0, chunk 0 carries 2 support rows for 1 token_ids") as info:
        decode_stream(
            [
                {"choices": [{"index": 0, "token_ids": [5], "sample_support": _doc(_rows([5, 6]))}]},
                {"choices": [{"index": 0, "token_ids": [6, 7], "sample_support": _doc(_rows([7]))}]},
            ]
        )
    assert info.value.trajectory == 0
    with pytest.raises(ReplayDataError, match=r"choice 1, chunk 0: the rows' sampled ids \[8\] are not .* \[9\]"):
        decode_stream([{"choices": [{"index": 1, "token_ids": [9], "sample_support": _doc(_rows([8]))}]}])


def test_decode_stream_refuses_rows_without_tokens_in_a_stream_with_token_ids():
    """vLLM 0.30's /inference/v1/generate stream with n=2 failed at the second choice (an error
    event, then [DONE]) and the plugin then sent choice 1's rows in an extra chunk without
    token_ids: decode_stream returned them as choice 1's replay data. They are rows of tokens
    the client never received."""
    chunks = [
        {"request_id": "r", "choices": [{"index": 0, "token_ids": [5], "sample_support": _doc(_rows([5]))}]},
        {"request_id": "r", "choices": [{"index": 1, "sample_support": _doc(_rows([7, 8]))}]},
    ]
    with pytest.raises(ReplayDataError, match=r"choice 1, chunk 1 carries 2 support rows and no token_ids"):
        decode_stream(chunks)
    # a stream without token ids at all (no return_token_ids) cannot be checked per chunk
    plain = [{"choices": [{"index": 0, "text": "a", "sample_support": _doc(_rows([5, 6]))}]}]
    assert decode_stream(plain)[0].support.sampled.tolist() == [5, 6]
