"""Sampler-support replay in a whole stock ``GRPOTrainer.train()`` on TRL's HF generate path
(trl 1.16.0, transformers 5.10.4, CPU): trl.rollout_batch, trl.support_logprobs,
trl.hf_sampler_rows, trl.hf_warped_scores.

One generation of 16 completions (top_k=8, top_p=0.9, temperature 0.7, a reference model: beta
0.04) by a tiny local Qwen3-MoE, two optimizer steps. The test harness's ``SamplerProbe``
(trl_harness.py: an extra processor appended to transformers' list for the run, observing only)
records the distribution the sampler drew each token from; TRL's old-policy logprobs (the model
that just generated) are read from its batch.

- stock (``REPLAY_PLUGIN_DISABLE=1``, a subprocess): trainer/sampler ratio of an unchanged policy
  is the truncated support's mass, far from 1 (seen: mean 0.853, min 0.645; 0.739 / 0.511 at
  temperature 1);
- plugin, switch on: the trainer's logprob equals the sampler's processed logprob within 1e-5,
  and TRL's own logged metrics say so (``replay/...``);
- plugin, switch off: TRL's losses and metrics are the stock run's, value for value.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import trl_harness as H  # noqa: E402
from support.procs import run_python  # noqa: E402
from support.upstream import need  # noqa: E402

STOCK_JOB = """
import json, sys
sys.path.insert(0, {here!r})
import trl_harness as H
out = H.run_job({model!r}, {output!r}, switch=True, **{job!r})
print("RESULT " + json.dumps(out))
"""

#: the sampler's temperature (TRL divides by it in its fused head, the plugin in its support
#: logprobs) and a reference model (its pass is scored over the support too: KL on one support)
JOB = {"temperature": 0.7, "beta": 0.04}
#: what TRL logs per step that is wall-clock time (every other number must be the stock run's)
TIMING_KEYS = ("step_time",)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    need("trl")
    return H.save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3_moe")))


@pytest.fixture(scope="module")
def stock(model_dir, tmp_path_factory):
    """The job with the switch set and the plugin disabled (stock TRL ignores the switch)."""
    need("trl")
    out = str(tmp_path_factory.mktemp("stock"))
    code = STOCK_JOB.format(here=HERE, model=model_dir, output=out, job=JOB)
    proc = run_python(code, env={"REPLAY_PLUGIN_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def _steps(history: list) -> list:
    return [h for h in history if "loss" in h]


def test_support_replay_in_a_whole_grpo_run(model_dir, stock, tmp_path):
    need("trl")
    import trl.trainer.grpo_trainer  # noqa: F401

    import replay_plugin

    applied = {p["name"]: p["state"] for p in replay_plugin.status()}
    for name in ("trl.rollout_batch", "trl.support_logprobs", "trl.hf_sampler_rows", "trl.hf_warped_scores"):
        assert applied.get(name) == "applied", (name, applied.get(name))

    # stock: the trainer scores over the full vocabulary, the sampler drew from the truncated support
    assert stock["tokens"] > 40
    assert stock["ratio_mean"] < 0.9 and stock["max_abs_diff"] > 0.1, stock
    assert not any(k.startswith("replay_") for k in stock["batch_keys"])

    # plugin: the same generation (same seed, same model), scored over the sampler's support
    replay = H.run_job(model_dir, str(tmp_path / "replay"), switch=True, **JOB)
    assert replay["completion_ids"] == stock["completion_ids"]
    assert replay["max_abs_diff"] < 1e-5, replay
    assert abs(replay["ratio_mean"] - 1.0) < 1e-5
    assert "replay_support" in replay["batch_keys"]
    # what the plugin measured, in TRL's own logged metrics
    (first, *_) = _steps(replay["log_history"])
    assert first["replay/support_exact_fraction"] == 1.0
    assert first["replay/sampler_logp_difference/max"] < 1e-5
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the first step, on one support
    assert all(not k.startswith("replay/") for k in _steps(stock["log_history"])[0])
    # the replay changes what TRL trains on: the gradient of the first step (its loss is the same,
    # -advantage times a ratio of 1 both ways) and the steps after it
    got, want = _steps(replay["log_history"]), _steps(stock["log_history"])
    assert got[0]["grad_norm"] != want[0]["grad_norm"]
    assert got[1]["loss"] != want[1]["loss"]
    print(
        f"stock ratio mean {stock['ratio_mean']:.4f} min {stock['ratio_min']:.4f} max|diff| "
        f"{stock['max_abs_diff']:.3g}; replay max|diff| {replay['max_abs_diff']:.3g}, TRL-logged "
        f"{first['replay/sampler_logp_difference/max']:.3g}"
    )


def test_switch_off_is_stock(model_dir, stock, tmp_path):
    need("trl")
    plain = H.run_job(model_dir, str(tmp_path / "plain"), switch=False, **JOB)
    assert plain["completion_ids"] == stock["completion_ids"]
    assert plain["batch_keys"] == stock["batch_keys"]
    got, want = _steps(plain["log_history"]), _steps(stock["log_history"])
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key in set(g) - set(TIMING_KEYS):
            assert g[key] == w[key], (key, g[key], w[key])
    assert plain["max_abs_diff"] == stock["max_abs_diff"]
