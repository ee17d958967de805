"""``vllm serve`` whose ``/inference/v1/generate`` cannot return replay data
(``vllm.generate_fields`` not serving: a vLLM outside its range, or toggled off as here; on vLLM
0.24 its twin ``vllm.generate_fields_disagg``) keeps
replay data on completions and chats and refuses it on that endpoint alone.

Before, ``vllm.request_guard`` counted ``vllm.generate_fields`` among the patches every served
request needs once the generate module is loaded, so such a server refused every opted-in
request (HTTP 400 on ``/v1/completions`` too): no served replay at all on vLLM 0.33/0.34 while
that patch stopped before 0.33.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from support.upstream import need
from support.vllm_engines import OfflineEngine, serve, served_patch
from test_served import XARGS, _completion, _generate_body

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server_without_generate_fields(tie_model, tmp_path_factory):
    need("vllm")
    OfflineEngine.shutdown()
    toggle = "REPLAY_PLUGIN_" + served_patch("vllm.generate_fields").upper().replace(".", "_")
    yield from serve(tie_model, tmp_path_factory.mktemp("served-gen-off"), {toggle: "0"})


def _api_states(server) -> dict:
    for path in glob.glob(os.path.join(server.status_dir, "*.json")):
        with open(path) as fh:
            doc = json.load(fh)
        states = {p["name"]: p["state"] for p in doc["patches"]}
        if states.get(served_patch("vllm.served_endpoints")) == "applied":  # the API server's
            return states
    raise AssertionError(f"no API server status in {server.status_dir}: {server.log_tail(2000)}")


def test_completions_keep_replay_data_and_generate_refuses_naming_the_patch(server_without_generate_fields):
    from replay_plugin.vllm.client import decode_choice

    srv = server_without_generate_fields
    code, doc, _ = _completion(srv, prompt="the router sends each token", vllm_xargs=XARGS)
    assert code == 200, doc  # before: 400 from vllm.request_guard ("vllm.generate_fields is disabled")
    choice = doc["choices"][0]
    rows = decode_choice(choice).support
    assert rows is not None and rows.sampled.tolist() == choice["token_ids"] and rows.exact.all()
    chat = {
        "model": doc["model"],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "top_k": 5,
        "vllm_xargs": XARGS,
    }
    code, doc, _ = srv.post("/v1/chat/completions", chat)
    assert code == 200, doc
    assert decode_choice(doc["choices"][0]).support is not None

    states = _api_states(srv)
    generate, endpoints = served_patch("vllm.generate_fields"), served_patch("vllm.served_endpoints")
    assert states[generate] == "disabled" and states[endpoints] == "applied", states

    # the endpoint that cannot return it refuses before compute, naming the patch, its state and
    # the fix, streamed or not
    body = _generate_body(srv, extra_args={"replay_sample_support": True})
    for send in (srv.post, srv.stream):
        code, doc, _ = send("/inference/v1/generate", body)
        text = json.dumps(doc)
        assert code == 400, (send.__name__, doc)
        assert "/inference/v1/generate cannot return it" in text and f"{generate} is disabled" in text, text
        assert "REPLAY_PLUGIN_" + generate.upper().replace(".", "_") in text, text
    # not opted in: served as stock vLLM serves it
    code, doc, _ = srv.post("/inference/v1/generate", _generate_body(srv))
    assert code == 200, doc
    # .get: vLLM 0.24-0.27's GenerateResponseChoice has no sampling_mask field (0.28 added it)
    assert doc["choices"][0].get("sampling_mask") is None and "sample_support" not in doc["choices"][0]
    # and the server keeps serving replay data on completions
    code, doc, _ = _completion(srv, prompt="a sampler draws from the top", vllm_xargs=XARGS)
    assert code == 200 and decode_choice(doc["choices"][0]).support is not None, doc
