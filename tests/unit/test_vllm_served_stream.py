"""``served_stream.StreamReplay`` (no vLLM import): what a streamed response gets added, chunk by
chunk, from the engine outputs it tapped."""

from __future__ import annotations

import asyncio
import json
import types

import numpy as np

from replay_plugin.core.support import SupportRows
from replay_plugin.vllm.client import decode_stream
from replay_plugin.vllm.served_stream import StreamReplay


def _output(index: int, tokens: list[int]) -> types.SimpleNamespace:
    ids = np.full((len(tokens), 3), -1, np.int32)
    ids[:, 0] = tokens
    rows = SupportRows(ids, np.asarray(tokens, np.int32), np.zeros(len(tokens), np.float32), np.ones(len(tokens), bool))
    out = types.SimpleNamespace(index=index, token_ids=tokens, routed_experts=None)
    out.sample_support = rows
    return out


def _run(outputs: list, chunks: list[str]) -> list[str]:
    """Tap ``outputs`` (one engine output per item, the first with the first chunk, the rest
    before the second) while vLLM's generator yields ``chunks``."""
    replay = StreamReplay(lambda res: [(res.index, res)], routes_wanted=False, mask=True)

    async def results():
        for out in outputs:
            yield out

    async def generator():
        tapped = replay.tap(results())
        await anext(tapped)
        yield chunks[0]
        async for _ in tapped:
            pass
        for chunk in chunks[1:]:
            yield chunk

    async def collect():
        return [c async for c in replay.decorate(generator())]

    return asyncio.run(collect())


def _data(doc: dict) -> str:
    return "data: " + json.dumps(doc) + "\n\n"


def test_rows_of_a_choice_after_an_error_event_are_not_sent():
    """vLLM 0.30's streamed /inference/v1/generate with n=2: choice 0's chunk, then an error
    event when choice 1's output arrives (IndexError inside vLLM), then [DONE]. Choice 1's rows
    were sent in an extra chunk before [DONE], with no token, and decode_stream returned them."""
    chunks = [
        _data({"request_id": "r", "choices": [{"index": 0, "token_ids": [5]}]}),
        _data({"error": {"message": "list index out of range", "code": 500}}),
        "data: [DONE]\n\n",
    ]
    sent = _run([_output(0, [5]), _output(1, [7])], chunks)
    docs = [json.loads(c[6:]) for c in sent if c.startswith("data: {")]
    assert len(sent) == 3 and sent[-1] == "data: [DONE]\n\n", sent
    assert docs[0]["choices"][0]["sample_support"] and docs[0]["choices"][0]["sampling_mask"] == [[5]]
    assert "choices" not in docs[1]  # the error event, untouched; nothing of choice 1 anywhere
    assert decode_stream([d for d in docs if "choices" in d])[0].support.sampled.tolist() == [5]
    # whatever a generator yields after its error event passes through untouched
    late = _data({"request_id": "r", "choices": [{"index": 1, "token_ids": [7]}]})
    sent = _run([_output(0, [5]), _output(1, [7])], [*chunks[:2], late, chunks[2]])
    assert sent[2] == late and len(sent) == 4


def test_rows_left_at_the_end_of_a_clean_stream_still_go_out():
    """Without an error, rows no chunk took go out in one extra chunk before [DONE] (as before)."""
    chunks = [_data({"request_id": "r", "choices": [{"index": 0, "token_ids": [5]}]}), "data: [DONE]\n\n"]
    sent = _run([_output(0, [5]), _output(0, [6])], chunks)
    assert len(sent) == 3, sent
    extra = json.loads(sent[1][6:])
    assert extra["request_id"] == "r" and extra["choices"][0]["index"] == 0
    assert extra["choices"][0]["sample_support"]["sampled"]["shape"] == [1]
