"""``replay-plugin bench skyrl``: SkyRL's ``/skyrl/v1/generate`` with the plugin's exact rows
against stock SkyRL's top-k rows, on one server.

One SkyRL server in this process (its ``VLLMServerActor``, its vLLM arguments from
``build_vllm_cli_args``, an in-process ``AsyncLLMEngine`` served by uvicorn on a thread of its
own) on the tests' tie model (vocabulary tied in runs of three, ``top_k=4``: a tie at the k-th
logit at every position). The same 16 prompts and seeds, ``return_sample_support`` on, sent
concurrently (as SkyRL's generator does) and timed on the wall clock, alternately:

* *stock*: the patch ``skyrl.sample_support_rows`` reverted (``Registry.revert``): SkyRL asks
  vLLM for ``logprobs=top_k, flat_logprobs=True`` and builds its rows of width ``top_k``,
  repairing the ones that miss the sampled id;
* *plugin*: the patch applied again: the plugin's capture inside vLLM's sampler, rows of width
  ``top_k + slack``, exact.

The engine is the same for both (the plugin's ``skyrl.engine_support_width`` leaves it allowing
``top_k + slack`` logprobs, which stock requests do not use). The figure is the ratio of
generated tokens per second, plugin over stock, median over the alternations of one run (goal:
>= 0.97); ``replay-plugin bench skyrl --runs 5`` takes the median of 5 runs. Also reported: the
rows stock SkyRL returned that are not the sampler's support (the sampled id was missing and put
in by SkyRL's repair, or the row is narrower than the tied support) and the plugin's inexact rows.

On a machine without CUDA the server is given vLLM's CPU worker (``worker_cls``: SkyRL turns
``"auto"`` into the CUDA worker); nothing else of SkyRL is changed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import socket
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from replay_plugin.bench import Result

BENCH = "skyrl"
PATCH = "skyrl.sample_support_rows"
TOP_K = 4
PROMPTS = 16


def _missing(what: str) -> list[Result]:
    return [Result(BENCH, "(not available)", None, note=f"{what}: pip install 'replay-plugin[skyrl]'")]


def run(quick: bool = False) -> list[Result]:
    try:
        import skyrl  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as exc:
        return _missing(f"SkyRL and vLLM are needed ({exc})")
    import replay_plugin
    from replay_plugin.registry import get

    replay_plugin.activate()
    from skyrl.backends.skyrl_train.inference_servers import vllm_server_actor  # noqa: F401  (the patch's trigger)

    state = get().apply(PATCH).state
    if state != "applied":
        return [Result(BENCH, "(not available)", None, note=f"patch {PATCH} is {state!r}: see replay-plugin status")]
    tokens = 16 if quick else 64
    rounds = 2 if quick else 5
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with _server() as base:
        prompts = _prompts()
        _generate(base, prompts, tokens)  # warm-up (both paths compiled and cached)
        get().revert(PATCH)
        _generate(base, prompts, tokens)
        get().apply(PATCH)
        stock_tps, plugin_tps, ratios = [], [], []
        stock_bad = plugin_bad = rows = 0
        width = 0
        for _ in range(rounds):
            get().revert(PATCH)
            seconds, docs = _generate(base, prompts, tokens)
            stock_tps.append(PROMPTS * tokens / seconds)
            stock_bad += sum(_not_support(d) for d in docs)
            assert get().apply(PATCH).state == "applied"
            seconds, docs = _generate(base, prompts, tokens)
            plugin_tps.append(PROMPTS * tokens / seconds)
            plugin_bad += sum(_not_support(d) for d in docs)
            rows += sum(len(_rows(d)) for d in docs)
            width = max(width, max(_rows(d).shape[1] for d in docs))
            ratios.append(plugin_tps[-1] / stock_tps[-1])
    note = f"{PROMPTS} concurrent requests x {tokens} tokens, top_k={TOP_K}, tie model; {rounds} alternations"
    return [
        Result(BENCH, "throughput ratio plugin / stock SkyRL rows", statistics.median(ratios), "x", ">= 0.97", note),
        Result(BENCH, "stock SkyRL throughput", statistics.median(stock_tps), "tokens/s"),
        Result(BENCH, "plugin throughput", statistics.median(plugin_tps), "tokens/s"),
        Result(
            BENCH,
            "stock rows not the sampler's support",
            stock_bad / max(rows, 1),
            "share",
            note=f"width {TOP_K}: the tie at the k-th logit makes the support wider (or SkyRL repaired the row)",
        ),
        Result(BENCH, "plugin rows not exact", plugin_bad / max(rows, 1), "share", "== 0", note=f"width {width}"),
    ]


def _not_support(doc: dict) -> int:
    """Rows of one answer that cannot be the sampler's support on the tie model: the support of
    a row is a whole number of tie groups of three, cut at the k-th logit, so a row of ``top_k``
    ids (4, not a multiple of 3) or one whose ids do not fill their groups is not it."""
    n = 0
    for row in _rows(doc).tolist():
        ids = [i for i in row if i >= 0]
        groups: dict[int, int] = {}
        for i in ids:
            groups[i // 3] = groups.get(i // 3, 0) + 1
        n += any(count != 3 for count in groups.values())
    return n


def _rows(doc: dict) -> Any:
    """The ``[T, W]`` support rows of one answer, decoded as SkyRL's generator decodes them."""
    from skyrl.backends.skyrl_train.inference_servers.generate_wire import decode_packed_sample_support

    return decode_packed_sample_support(doc["choices"][0]["rollout_sample_support"])


def _prompts() -> list[list[int]]:
    return [[11 + 7 * i, 40 + i, 90 + 3 * i, 5] for i in range(PROMPTS)]


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(
        base + "/skyrl/v1/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _generate(base: str, prompts: list[list[int]], tokens: int) -> tuple[float, list[dict]]:
    bodies = [
        {
            "token_ids": p,
            "return_sample_support": True,
            "sampling_params": {
                "max_tokens": tokens,
                "temperature": 1.0,
                "top_k": TOP_K,
                "seed": 100 + i,
                "ignore_eos": True,
            },
        }
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        docs = list(pool.map(lambda b: _post(base, b), bodies))
    return time.perf_counter() - start, docs


@contextlib.contextmanager
def _server() -> Iterator[str]:
    """SkyRL's server on a thread of its own; yields its base URL."""
    from replay_plugin.demo.tiny_model import TinyMoEConfig, build_tiny_moe

    model = build_tiny_moe(config=TinyMoEConfig(tie_group_size=3, router_scale=8.0))
    loop = asyncio.new_event_loop()
    ready: concurrent.futures.Future[str] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def serve() -> None:
        try:
            actor = _actor(model)
            info = await actor.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            ready.set_exception(exc)
            return
        ready.set_result(f"http://127.0.0.1:{info.port}")
        await stop.wait()
        await actor.shutdown()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), name="skyrl-bench-server", daemon=True)
    thread.start()
    try:
        yield ready.result(timeout=900)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=120)


def _actor(model: str) -> Any:
    import torch
    from skyrl.backends.skyrl_train.inference_servers.utils import build_vllm_cli_args
    from skyrl.backends.skyrl_train.inference_servers.vllm_server_actor import VLLMServerActor
    from skyrl.train.config.config import SkyRLTrainConfig

    cfg = SkyRLTrainConfig.from_cli_overrides(
        {
            "trainer.policy.model.path": model,
            "trainer.strategy": "fsdp",
            "trainer.algorithm.enable_sample_support_replay": True,
            "generator.inference_engine.enable_return_sample_support_set": True,
            "generator.inference_engine.model_dtype": "float32",
            "generator.inference_engine.enforce_eager": True,
            "generator.inference_engine.max_num_seqs": PROMPTS,
            "generator.inference_engine.max_num_batched_tokens": 2048,
            "generator.inference_engine.enable_prefix_caching": False,
            "generator.sampling_params.top_k": TOP_K,
            "trainer.placement.colocate_all": False,
        }
    )
    args = build_vllm_cli_args(cfg)
    if not torch.cuda.is_available():
        args.worker_cls = "vllm.v1.worker.cpu_worker.CPUWorker"
    args.max_model_len = 512
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return VLLMServerActor(args, start_port=port, distributed_executor_backend="mp", enable_ray_prometheus_stats=False)
