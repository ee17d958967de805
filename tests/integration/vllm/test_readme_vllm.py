"""The README's offline vLLM block (``readme-test: vllm-offline``) run as written on the embedded
tiny model, in a fresh interpreter (the block sets the opt-in variable and starts its own engine;
the session engine is shut down first: one engine at a time on 2 cores).

Without its first line the block is refused (``SampleSupportRefused``: the engine is in
raw-logprobs mode), which is how a user copying an earlier README met it; with it, every row is
exact and the routes come back compact.
"""

from __future__ import annotations

import json

import pytest
from support.procs import run_python
from support.upstream import need
from support.vllm_engines import NO_ROUTES_ON_CPU, OfflineEngine, routes_supported

pytestmark = pytest.mark.timeout(600)

SCRIPT = r"""
import json, sys
sys.path.insert(0, {tests!r})
import readme_blocks
from replay_plugin.demo import DEMO_MODEL
from replay_plugin.demo.tiny_model import build_tiny_moe

ns = readme_blocks.run("vllm-offline", model=build_tiny_moe(config=DEMO_MODEL))
rows, routes, out = ns["rows"], ns["routes"], ns["out"][0]
print("@@" + json.dumps({{
    "prompt": len(out.prompt_token_ids),
    "tokens": list(out.outputs[0].token_ids),
    "ids_shape": list(rows.ids.shape),
    "sampled": rows.sampled.tolist(),
    "exact": rows.exact.tolist(),
    "in_row": [int(s) in set(r.tolist()) for s, r in zip(rows.sampled, rows.ids)],
    "routes_dtype": str(routes.dtype),
    "routes_shape": list(routes.shape),
    "routes_distinct": all(len(set(r)) == len(r) for r in routes.reshape(-1, routes.shape[-1]).tolist()),
}}))
"""


def test_offline_block_runs_as_written():
    need("vllm")
    if not routes_supported():
        pytest.skip(f"the block asks for routed experts; {NO_ROUTES_ON_CPU}")
    import os

    from replay_plugin.demo import DEMO_MODEL

    OfflineEngine.shutdown()
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = run_python(SCRIPT.format(tests=tests), env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("@@")][-1][2:])
    t = len(got["tokens"])
    assert t > 0 and got["sampled"] == got["tokens"]
    assert got["ids_shape"][0] == t and got["ids_shape"][1] == 20 + 16  # top_k + default slack
    assert all(got["exact"]) and all(got["in_row"])
    cfg = DEMO_MODEL
    assert got["routes_dtype"] == "uint8"
    assert got["routes_shape"] == [got["prompt"] + t - 1, cfg.num_layers, cfg.top_k]
    assert got["routes_distinct"]  # the routers' choices (a compiled CPU model returned all expert 0)
