"""SkyRL's own vLLM server (``tests/integration/skyrl/skyrl_server.py``) in a subprocess, and the
requests the SkyRL tests send it (tests/integration/skyrl/conftest.py's fixtures start it).

The model is the tiny Qwen3-MoE with the vocabulary tied in runs of three ids: ``top_k=4`` cuts a
tie at the k-th logit at every position, so the sampler's support is wider than ``top_k``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from support import ROOT
from support.procs import free_port, plugin_installed_as_wheel

SERVER_SCRIPT = os.path.join(ROOT, "tests", "integration", "skyrl", "skyrl_server.py")

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


def start_server(model: str, tmp, *, plugin: bool, extra_env: dict | None = None):
    """SkyRL's server (``skyrl_server.py``) in a subprocess; yields a ``SkyRLServer`` once it serves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    if plugin_installed_as_wheel():
        env.pop("PYTHONPATH", None)
    if not plugin:
        env["REPLAY_PLUGIN_DISABLE"] = "1"
    env.update(VLLM_CPU_KVCACHE_SPACE="1", **(extra_env or {}))
    log_path = str(tmp / "server.log")
    log = open(log_path, "w")
    script = SERVER_SCRIPT
    proc = subprocess.Popen(
        [sys.executable, script, model, str(free_port()), str(TOP_K)],
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
