"""SkyRL 0.4.0's own vLLM server (``VLLMServerActor``, the ``/skyrl/v1/generate`` endpoint) on CPU.

Run by the tests as a subprocess: ``python skyrl_server.py MODEL PORT TOP_K`` (the plugin on or
off by the environment the test gives it). The server is SkyRL's: its config
(``SkyRLTrainConfig``), its vLLM arguments (``build_vllm_cli_args``, through which the plugin's
``skyrl.engine_support_width`` runs), its actor class instantiated directly (Ray wraps it with
``ray.remote`` only in ``ServerGroup``), an in-process ``AsyncLLMEngine`` served by uvicorn.

CPU shims of the harness, never shipped: SkyRL's ``_build_and_serve_vllm_server`` turns
``worker_cls="auto"`` into vLLM's CUDA ``gpu_worker.Worker``, so the CPU worker is named; the
tiny model's context is capped. Prints ``READY <port>`` when serving; stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def skyrl_config(model: str, top_k: int):
    from skyrl.train.config.config import SkyRLTrainConfig

    return SkyRLTrainConfig.from_cli_overrides(
        {
            "trainer.policy.model.path": model,
            "trainer.strategy": "fsdp",
            "trainer.algorithm.enable_sample_support_replay": True,
            "generator.inference_engine.enable_return_sample_support_set": True,
            "generator.inference_engine.enable_return_routed_experts": True,
            "generator.inference_engine.model_dtype": "float32",
            "generator.inference_engine.enforce_eager": True,
            "generator.inference_engine.max_num_seqs": 16,
            "generator.inference_engine.max_num_batched_tokens": 2048,
            "generator.inference_engine.enable_prefix_caching": False,
            "generator.sampling_params.top_k": top_k,
            "generator.sampling_params.temperature": 1.0,
            "trainer.placement.colocate_all": False,
        }
    )


async def serve(model: str, port: int, top_k: int) -> None:
    from skyrl.backends.skyrl_train.inference_servers.utils import build_vllm_cli_args
    from skyrl.backends.skyrl_train.inference_servers.vllm_server_actor import VLLMServerActor

    args = build_vllm_cli_args(skyrl_config(model, top_k))
    args.worker_cls = "vllm.v1.worker.cpu_worker.CPUWorker"  # CPU shim (see the docstring)
    args.max_model_len = 512
    print(f"max_logprobs {args.max_logprobs} logprobs_mode {args.logprobs_mode}", flush=True)
    actor = VLLMServerActor(args, start_port=port, distributed_executor_backend="mp", enable_ray_prometheus_stats=False)
    info = await actor.start()
    print(f"READY {info.port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await actor.shutdown()


if __name__ == "__main__":  # vLLM's engine core starts with spawn
    asyncio.run(serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
