"""``vllm serve`` with the plugin installed, over HTTP on 127.0.0.1 (one server for the module).

The job opts in (``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=opt-in``); requests opt in with
``vllm_xargs``. A request that does not opt in gets vLLM's own response: no ``sample_support``
and routed experts as vLLM's base64 ``.npy`` string.
"""

from __future__ import annotations

import base64
import glob
import io
import json
import os

import numpy as np
import pytest
from conftest import need, routes_supported

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["the router sends each token", "a sampler draws from the top"]
XARGS = {"replay_sample_support": 1}


def _completion(server, **body):
    body = {
        "model": server_model(server),
        "max_tokens": 12,
        "temperature": 1.0,
        "top_k": 5,
        "seed": 7,
        "return_token_ids": True,
        **body,
    }
    return server.post("/v1/completions", body)


_models: dict = {}


def server_model(server) -> str:
    if server.base not in _models:
        import urllib.request

        with urllib.request.urlopen(server.base + "/v1/models", timeout=30) as resp:
            _models[server.base] = json.load(resp)["data"][0]["id"]
    return _models[server.base]


def test_completion_choices_carry_wire_documents(server):
    need("vllm")
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice

    from replay_plugin.vllm.client import decode_choice

    code, plain, _ = _completion(server, prompt=PROMPTS)
    assert code == 200, plain
    for choice in plain["choices"]:  # stock response: no support, routes as vLLM's .npy string
        assert "sample_support" not in choice
        assert set(choice) <= set(CompletionResponseChoice.model_fields)
        if routes_supported():
            assert isinstance(choice["routed_experts"], str)
            stock_routes = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
            assert stock_routes.ndim == 3

    code, doc, raw = _completion(server, prompt=PROMPTS, n=2, vllm_xargs=XARGS)
    assert code == 200, doc
    assert len(doc["choices"]) == 4
    for choice in doc["choices"]:
        envelope = choice["sample_support"]["ids"]
        assert set(envelope) == {"data", "shape", "dtype"} and isinstance(envelope["data"], str)
        replay = decode_choice(choice)
        rows = replay.support
        tokens = np.asarray(choice["token_ids"])
        assert len(rows) == len(tokens) and rows.width == 5 + 16
        assert (rows.sampled == tokens).all() and rows.exact.all()
        assert (rows.ids == tokens[:, None]).any(axis=1).all()
        assert ((rows.ids >= 0).sum(axis=1) >= 5).all()  # top_k=5 on the tie model: 6 members
        assert choice["logprobs"] is None  # the user asked for none
        if routes_supported():
            prompt_len = len(choice["prompt_token_ids"] or []) or None
            routes = replay.routed_experts
            assert routes.dtype == np.uint8 and routes.shape[1:] == (2, 2)
            if prompt_len:
                assert routes.shape[0] == prompt_len + len(tokens) - 1
    assert b'"sample_support":{"ids":{"data":"' in raw.replace(b" ", b"")


def test_user_logprobs_are_served_as_asked(server):
    code, plain, _ = _completion(server, prompt=PROMPTS[:1], logprobs=2)
    code2, opted, _ = _completion(server, prompt=PROMPTS[:1], logprobs=2, vllm_xargs=XARGS)
    assert code == code2 == 200
    a, b = plain["choices"][0], opted["choices"][0]
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
    # Rows hold the top 2 and the sampled token; with exact ties at rank 2, which tied token is
    # listed (and so whether the sampled one is listed twice) depends on the engine step's widest
    # logprobs request, in stock vLLM too: compare the values.
    for x, y in zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"]):
        assert len(y) <= 3 and set(x.values()) == set(y.values())


def test_chat_choices_carry_wire_documents(server):
    from replay_plugin.vllm.client import decode_choice

    body = {
        "model": server_model(server),
        "messages": [{"role": "user", "content": "what is two plus two?"}],
        "max_tokens": 10,
        "temperature": 1.0,
        "top_k": 5,
        "seed": 3,
        "return_token_ids": True,
    }
    code, plain, _ = server.post("/v1/chat/completions", body)
    assert code == 200, plain
    assert "sample_support" not in plain["choices"][0]
    code, doc, _ = server.post("/v1/chat/completions", {**body, "n": 2, "vllm_xargs": XARGS})
    assert code == 200, doc
    for choice in doc["choices"]:
        rows = decode_choice(choice).support
        assert (rows.sampled == np.asarray(choice["token_ids"])).all() and rows.exact.all()


def test_refused_requests_name_the_setting(server):
    for extra, setting in (
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 1.5}, "repetition_penalty"),
    ):
        code, doc, _ = _completion(server, prompt=PROMPTS[:1], vllm_xargs=XARGS, **extra)
        assert code == 400, doc
        assert setting in json.dumps(doc)
    code, doc, _ = _completion(server, prompt=PROMPTS[:1], vllm_xargs={"replay_sample_support": "perhaps"})
    assert code == 400 and "replay_sample_support" in json.dumps(doc)
    code, _, _ = _completion(server, prompt=PROMPTS[:1], temperature=0.0)  # not opted in: served as usual
    assert code == 200


def test_every_server_process_is_activated(server):
    _completion(server, prompt=PROMPTS[:1], vllm_xargs=XARGS)
    docs = []
    for path in glob.glob(os.path.join(server.status_dir, "*.json")):
        with open(path) as fh:
            docs.append(json.load(fh))
    by_role = {}
    for d in docs:
        proc = d["process"]
        name = proc.get("process_name") or ""
        role = (
            "engine_core"
            if "EngineCore" in name
            else "worker"
            if "Worker" in name
            else "api_server"
            if any("serve" in a for a in proc.get("argv") or [])
            else name
        )
        by_role[role] = {p["name"]: p["state"] for p in d["patches"]}
    assert {"api_server", "engine_core", "worker"} <= set(by_role), (by_role, server.log_tail(2000))
    api = by_role["api_server"]
    assert api["vllm.sample_support"] == api["vllm.openai_fields"] == api["vllm.routed_experts"] == "applied"
    for role in ("engine_core", "worker"):  # activated (the pack is loaded), nothing to patch there
        assert {"vllm.sample_support", "vllm.routed_experts", "vllm.openai_fields"} <= set(by_role[role])
