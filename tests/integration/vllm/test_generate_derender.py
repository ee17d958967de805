"""Hidden reasoning: ``/inference/v1/generate`` with ``output_mode: "derender"`` (vLLM 0.33+;
streamed from 0.34), whose choices come back as chat messages parsed by the server's reasoning
parser, and ``/v1/chat/completions`` with ``include_reasoning: false`` (every supported version).

A server with a reasoning parser withholds every choice's ``token_ids``, ``logprobs`` and
``sampling_mask`` when the request's ``parse_context`` hides the reasoning
(``include_reasoning: false``): they would reveal the hidden tokens. Replay rows name every
sampled token, so they would reveal them too (``vllm.generate_fields`` fills the mask wherever vLLM
left it empty): an opted-in request is refused before compute, naming ``include_reasoning``. With
the reasoning shown, a derender choice carries its replay data like a tokens-mode one.

One ``vllm serve`` with vLLM's ``granite`` reasoning parser (it reads text markers, so it works with
any tokenizer; with a parser, vLLM hides the metadata whenever ``include_reasoning`` is false,
whatever the parser finds). vLLM 0.33 refuses a streamed derender request by itself.

Chat has the same rule (``vllm.openai_fields``): with ``include_reasoning: false`` on a server with a
parser, vLLM withholds the choices' ``token_ids`` and ``logprobs``; a request asking for the support
is refused before compute, naming ``include_reasoning``.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from support.upstream import need
from support.vllm_engines import OfflineEngine, serve

pytestmark = pytest.mark.timeout(600)

XARGS = {"replay_sample_support": True}


def _derender_supported() -> bool:
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release >= (0, 33)


def _streams_derender() -> bool:
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release >= (0, 34)


@pytest.fixture(scope="module")
def parser_server(tie_model, tmp_path_factory):
    need("vllm")
    OfflineEngine.shutdown()
    tmp = tmp_path_factory.mktemp("served-derender")
    yield from serve(tie_model, tmp, extra_args=("--reasoning-parser", "granite"))


def _body(srv, include_reasoning: bool, extra_args=None) -> dict:
    with urllib.request.urlopen(srv.base + "/v1/models", timeout=60) as resp:
        model = json.load(resp)["data"][0]["id"]
    tokens = [int(t) for t in np.random.default_rng(5).integers(10, 300, size=6)]
    params = {"top_k": 5, "temperature": 1.0, "seed": 11, "max_tokens": 8}
    if extra_args is not None:
        params["extra_args"] = extra_args
    return {
        "model": model,
        "token_ids": tokens,
        "sampling_params": params,
        "output_mode": "derender",
        "parse_context": {"include_reasoning": include_reasoning},
    }


def _needs_derender() -> None:
    if not _derender_supported():
        pytest.skip("output_mode 'derender' exists from vLLM 0.33")


def test_derender_with_the_reasoning_shown_carries_replay_data(parser_server):
    _needs_derender()
    from replay_plugin.vllm.client import decode_choice, decode_stream

    srv = parser_server
    code, stock, _ = srv.post("/inference/v1/generate", _body(srv, True))
    assert code == 200, stock
    choice = stock["choices"][0]
    assert "message" in choice and choice["sampling_mask"] is None and "sample_support" not in choice
    code, doc, _ = srv.post("/inference/v1/generate", _body(srv, True, XARGS))
    assert code == 200, doc
    choice = doc["choices"][0]
    rows = decode_choice(choice).support
    assert rows.sampled.tolist() == choice["token_ids"] and rows.exact.all()
    assert [sorted(m) for m in choice["sampling_mask"]] == choice["sampling_mask"]
    assert [set(m) for m in choice["sampling_mask"]] == [set(r[r >= 0].tolist()) for r in rows.ids]
    if _streams_derender():
        code, chunks, _ = srv.stream("/inference/v1/generate", _body(srv, True, XARGS))
        assert code == 200, chunks
        streamed = decode_stream(chunks)[0].support
        assert streamed.ids.tolist() == rows.ids.tolist() and streamed.exact.all()


def test_derender_hiding_the_reasoning_refuses_replay_requests(parser_server):
    _needs_derender()
    srv = parser_server
    code, stock, _ = srv.post("/inference/v1/generate", _body(srv, False))
    assert code == 200, stock
    choice = stock["choices"][0]  # vLLM withholds the per-token data
    assert choice["token_ids"] is None and choice["sampling_mask"] is None and choice["logprobs"] is None
    sends = [srv.post, srv.stream] if _streams_derender() else [srv.post]
    for send in sends:
        code, doc, _ = send("/inference/v1/generate", _body(srv, False, XARGS))
        text = json.dumps(doc)
        assert code == 400, (send.__name__, doc)
        assert "include_reasoning" in text and "would reveal the hidden tokens" in text, text
    code, doc, _ = srv.post("/inference/v1/generate", _body(srv, True, XARGS))  # still serving
    assert code == 200 and doc["choices"][0]["sample_support"], doc


def _chat(srv, include_reasoning: bool, xargs=None) -> dict:
    with urllib.request.urlopen(srv.base + "/v1/models", timeout=60) as resp:
        model = json.load(resp)["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "what is two plus two?"}],
        "max_tokens": 8,
        "temperature": 1.0,
        "top_k": 5,
        "seed": 4,
        "logprobs": True,
        "return_token_ids": True,
        "include_reasoning": include_reasoning,
    }
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return body


def test_chat_hiding_the_reasoning_refuses_support_requests(parser_server):
    """vLLM withholds a chat choice's token ids and logprobs when the reasoning is hidden; support rows
    would name the same tokens. Refused before compute (full and streamed); with the reasoning shown
    the rows come back and name exactly the tokens vLLM then shows."""
    from replay_plugin.vllm.client import decode_choice

    srv = parser_server
    code, stock, _ = srv.post("/v1/chat/completions", _chat(srv, False))
    assert code == 200, stock
    choice = stock["choices"][0]  # vLLM hides the per-token data of hidden reasoning
    assert choice.get("token_ids") is None and choice.get("logprobs") is None, choice
    for send in (srv.post, srv.stream):
        code, doc, _ = send("/v1/chat/completions", _chat(srv, False, XARGS))
        text = json.dumps(doc)
        assert code == 400, (send.__name__, doc)
        assert "include_reasoning" in text and "would reveal the hidden tokens" in text, text
    code, doc, _ = srv.post("/v1/chat/completions", _chat(srv, True, XARGS))  # shown: rows as usual
    assert code == 200, doc
    choice = doc["choices"][0]
    rows = decode_choice(choice).support
    assert rows.sampled.tolist() == choice["token_ids"] and rows.exact.all()
