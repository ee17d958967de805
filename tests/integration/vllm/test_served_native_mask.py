"""``vllm serve --return-sampling-mask`` on Model Runner V2: served replay from vLLM's own mask.

The server a user runs on a GPU to get vLLM's ``sampling_mask``: the plugin then builds rows
from the masks vLLM sampled from (its native path), on every endpoint and in every chunk of a
stream. vLLM attaches masks to a request's last output only (0.30/0.31, and ``CUMULATIVE``
outputs, which the OpenAI server's non-streamed path uses), so streamed chunks and an
``AsyncLLM``'s outputs before the last carried empty, inexact rows before the plugin read the
request's masks each step. Runs in the MRV2 environments only (envs/envs.toml).

A server with ``return_sampling_mask`` refuses requests without ``top_k`` (vLLM bounds the mask
by it): ``--override-generation-config`` gives every request a default ``top_k``.
"""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest
from support.upstream import need
from support.vllm_engines import OfflineEngine, routes_supported, serve
from test_served import XARGS, _chunk_rows, _completion, _generate_body, _same_rows, server_model

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def mask_server(tie_model, tmp_path_factory):
    need("vllm")
    if os.environ.get("REPLAY_TEST_MRV2") != "1":
        pytest.skip("Model Runner V2 runs only in the MRV2 test environments (REPLAY_TEST_MRV2=1)")
    OfflineEngine.shutdown()
    yield from serve(
        tie_model,
        tmp_path_factory.mktemp("served-native-mask"),
        extra_args=("--return-sampling-mask", "--override-generation-config", json.dumps({"top_k": 7})),
    )


def _mask_sets(mask) -> list[set]:
    return [set(m) for m in mask]


def _row_sets(rows) -> list[set]:
    return [set(int(i) for i in row if i >= 0) for row in rows.ids]


def test_completions_streamed_and_not(mask_server):
    """Every chunk of a streamed completion carries exact rows of its own tokens; concatenated,
    they equal the unstreamed response's (same seeds), which are exact and hold top_k ids."""
    from replay_plugin.vllm.client import decode_choice, decode_stream

    body = dict(prompt=["the router sends each token"], n=2, max_tokens=6, top_k=5, seed=11, return_token_ids=True)
    code, chunks, _ = mask_server.stream(
        "/v1/completions", {"model": server_model(mask_server), **body, "vllm_xargs": XARGS}
    )
    assert code == 200
    per_chunk = _chunk_rows(chunks)
    assert len(per_chunk) >= 6
    for tokens, rows in per_chunk:
        assert rows is not None and rows.sampled.tolist() == tokens and rows.exact.all(), rows
    streamed = decode_stream(chunks)
    code, doc, _ = _completion(mask_server, **body, vllm_xargs=XARGS)
    assert code == 200, doc
    for choice in doc["choices"]:
        whole = decode_choice(choice).support
        assert whole.exact.all() and whole.sampled.tolist() == choice["token_ids"]
        assert ((whole.ids >= 0).sum(axis=1) == 5).all()  # MRV2's top-k keeps k ids, ties or not
        _same_rows(streamed[choice["index"]].support, whole)


def test_chat_stream(mask_server):
    from replay_plugin.vllm.client import decode_choice, decode_stream

    body = {
        "model": server_model(mask_server),
        "messages": [{"role": "user", "content": "what is two plus two?"}],
        "max_tokens": 6,
        "top_k": 4,
        "seed": 5,
        "return_token_ids": True,
        "vllm_xargs": XARGS,
    }
    code, chunks, _ = mask_server.stream("/v1/chat/completions", body)
    assert code == 200
    for tokens, rows in _chunk_rows(chunks):
        assert rows is not None and rows.sampled.tolist() == tokens and rows.exact.all(), rows
    code, doc, _ = mask_server.post("/v1/chat/completions", body)
    assert code == 200, doc
    _same_rows(decode_stream(chunks)[0].support, decode_choice(doc["choices"][0]).support)


def test_generate_endpoint_rows_equal_vllms_own_mask(mask_server):
    """/inference/v1/generate: vLLM fills ``sampling_mask`` itself here (MRV2 with the engine's
    mask on); the opted-in rows hold exactly its ids at every position, streamed or not."""
    from replay_plugin.vllm.client import decode_choice, decode_stream

    code, plain, _ = mask_server.post("/inference/v1/generate", _generate_body(mask_server))
    assert code == 200, plain
    assert plain["choices"][0]["sampling_mask"] and "sample_support" not in plain["choices"][0]

    routes_on = routes_supported()  # serve() starts the engine with routes where the CPU build returns them
    body = _generate_body(mask_server, extra_args={"replay_sample_support": True, "replay_routed_experts": routes_on})
    code, doc, _ = mask_server.post("/inference/v1/generate", body)
    assert code == 200, doc
    choice = doc["choices"][0]
    assert choice["sampling_mask"] == plain["choices"][0]["sampling_mask"]  # same seed: vLLM's own
    replay = decode_choice(choice)
    rows = replay.support
    assert rows.exact.all() and rows.sampled.tolist() == choice["token_ids"]
    assert _row_sets(rows) == _mask_sets(choice["sampling_mask"])
    routes = replay.routed_experts
    if routes_on:
        # routes through MRV2 (the AuxOutput connector from 0.31), compact, one row per scored position
        scored = len(body["token_ids"]) + len(choice["token_ids"]) - 1
        assert routes.dtype == np.uint8 and routes.shape == (scored, 2, 2)
        stock_routes = plain["choices"][0]["routed_experts"]
        assert isinstance(stock_routes, str)  # vLLM's own base64 .npy of the same request
        assert np.array_equal(np.load(io.BytesIO(base64.b64decode(stock_routes)), allow_pickle=False), routes)
    else:  # 0.29: the CPU MoE refuses routes at engine start (routes_supported)
        assert routes is None

    code, chunks, _ = mask_server.stream("/inference/v1/generate", body)
    assert code == 200
    for tokens, chunk_rows in _chunk_rows(chunks):
        assert chunk_rows is not None and chunk_rows.sampled.tolist() == tokens and chunk_rows.exact.all()
    streamed = decode_stream(chunks)[0]
    _same_rows(streamed.support, rows)
    if routes_on:
        assert np.array_equal(streamed.routed_experts, routes)
    else:
        assert streamed.routed_experts is None
    streamed_mask = [m for ch in chunks for c in ch["choices"] for m in (c.get("sampling_mask") or [])]
    assert streamed_mask == choice["sampling_mask"]
    assert np.asarray(choice["token_ids"]).size == len(streamed_mask)
