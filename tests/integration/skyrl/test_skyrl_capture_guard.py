"""A SkyRL job that asks for sample support where the plugin's capture is not in place is refused at
start, not trained on SkyRL's own rows (issue 41, item 2).

Where ``skyrl.sample_support_rows`` does not apply (its toggle off, a bad value of its knob, a
fingerprint drift), SkyRL's ``/skyrl/v1/generate`` serves SkyRL's own top_k rows, repaired, and the
width patches still let SkyRL take them. Each case runs SkyRL's own ``build_vllm_cli_args`` (the
seam where SkyRL starts its servers, ``skyrl.engine_support_width``) in a fresh interpreter with
the installed wheel and the case's environment; the last one runs SkyRL's own
``SkyRLGymGenerator.agent_loop`` (``skyrl.generator_support_width``) for a job whose engine-args
patch is off too. Each shows the problem (the patch's state, SkyRL's row builder unwrapped and the
repaired row it returns), then the refusal; jobs without SkyRL's key are never refused.
"""

from __future__ import annotations

import json

import pytest
import yaml
from support.procs import free_port, run_python
from support.skyrl_servers import TOP_K
from support.upstream import need

pytestmark = pytest.mark.timeout(900)

PATCH = "skyrl.sample_support_rows"
TOGGLE = "REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS"
KNOB = "REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS_ON_INEXACT"
SUPPORT_KEY = "generator.inference_engine.enable_return_sample_support_set"
SLACK = 16

JOB = r"""
import inspect, json, sys
from skyrl.train.config.config import SkyRLTrainConfig
from skyrl.backends.skyrl_train.inference_servers import utils

TOP_K = @TOP_K@


def cfg(support):
    keys = {"generator.inference_engine.enable_return_sample_support_set": support}
    return SkyRLTrainConfig.from_cli_overrides({**keys, "generator.sampling_params.top_k": TOP_K})


def outcome(call):
    try:
        result = call()
    except Exception as exc:
        return {"error": type(exc).__name__, "setting": getattr(exc, "setting", None), "message": str(exc)}
    return {"max_logprobs": getattr(result, "max_logprobs", None)}


stock = inspect.unwrap(utils.build_vllm_cli_args)
out = {
    "stock": stock(cfg(True)).max_logprobs,
    "stock_plain": stock(cfg(False)).max_logprobs,
    "support": outcome(lambda: utils.build_vllm_cli_args(cfg(True))),
    "plain": outcome(lambda: utils.build_vllm_cli_args(cfg(False))),
}

# what SkyRL's server answers where the capture is not in place: its own row builder, which puts a
# sampled id (9) missing from the top_k entries (1, 2) over the weakest one
from skyrl.backends.skyrl_train.inference_servers import vllm_server_actor as server
from vllm.logprobs import FlatLogprobs
import replay_plugin
from replay_plugin.patcher import patch_marker

flat = FlatLogprobs(start_indices=[0], end_indices=[3], token_ids=[9, 1, 2], logprobs=[-3.0, -0.5, -1.0],
                    ranks=[3, 1, 2], decoded_tokens=[None, None, None])
out["rows_wrapped_by"] = patch_marker(inspect.getattr_static(server, "_sample_support_from_flat_logprobs"))
out["skyrl_rows"] = server._sample_support_from_flat_logprobs(flat, 2)[1].tolist()

if len(sys.argv) > 1:  # SkyRL's own agent loop, against a port nothing listens on
    import asyncio
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
    from skyrl_gym.envs.registration import register
    from transformers import AutoTokenizer

    class OneTurn(BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()

        def step(self, action):
            return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, metadata={})

    register(id="replay_one_turn", entry_point=OneTurn)
    model, url = sys.argv[1], sys.argv[2]
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    c = SkyRLTrainConfig()
    c.generator.inference_engine.enable_return_sample_support_set = True
    c.generator.sampling_params.top_k = TOP_K
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model,
                                   enable_return_sample_support_set=True, tokenizer=tokenizer)
    generator = SkyRLGymGenerator(c.generator, c.environment.skyrl_gym, client, tokenizer)
    params = {"temperature": 1.0, "top_k": TOP_K, "max_tokens": 4, "logprobs": 0, "seed": 7}
    out["agent_loop"] = outcome(lambda: asyncio.run(generator.agent_loop(
        prompt=[{"role": "user", "content": "route me"}], env_class="replay_one_turn", env_extras={}, max_tokens=4,
        max_input_length=200, sampling_params=params)))

out["states"] = {r["name"]: [r["state"], r["reason"]] for r in replay_plugin.status() if r["name"].startswith("skyrl.")}
print("REPORT" + json.dumps(out))
""".replace("@TOP_K@", str(TOP_K))


def job(env: dict, *args: str) -> dict:
    proc = run_python(JOB, env={"FLASH_ATTENTION_TRITON_AMD_ENABLE": "TRUE", **env}, args=args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:])
    out["stderr"] = proc.stderr
    # SkyRL's own top_k rows: a sampled id missing from the top_k entries overwrites the weakest
    assert out["skyrl_rows"] == [[1, 9]]
    # a job that does not ask for sample support is SkyRL's, whatever the plugin's state
    assert out["plain"] == {"max_logprobs": out["stock_plain"]}, out["plain"]
    return out


def _refused(outcome: dict, setting: str, *words: str) -> None:
    assert outcome.get("error") == "NotReplayable", outcome
    assert outcome["setting"] == setting, outcome
    for word in words:
        assert word in outcome["message"], (word, outcome["message"])


def test_capture_switched_off_refuses_the_job():
    need("skyrl", "vllm")
    out = job({TOGGLE: "0"})
    # the problem: the capture is off, SkyRL's row builder is its own (the row above is what it serves)
    assert out["states"][PATCH][0] == "disabled" and out["rows_wrapped_by"] is None
    assert out["states"]["skyrl.engine_support_width"][0] == "applied"
    _refused(out["support"], TOGGLE, SUPPORT_KEY, f"patch {PATCH} disabled", f"unset {TOGGLE}")


def test_empty_toggle_is_unset_and_the_job_runs():
    """``REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS=`` (an empty ``$UNSET``) used to read as 0."""
    need("skyrl", "vllm")
    out = job({TOGGLE: ""})
    assert out["states"][PATCH][0] == "applied" and out["rows_wrapped_by"] == PATCH
    assert out["stock"] == TOP_K and out["support"] == {"max_logprobs": TOP_K + SLACK}


def test_bad_knob_refuses_instead_of_switching_the_capture_off():
    need("skyrl", "vllm")
    out = job({KNOB: "repiar"})
    # the capture stays in place (it used to fail to install: state error, SkyRL's rows served) ...
    assert out["states"][PATCH][0] == "applied" and out["rows_wrapped_by"] == PATCH
    assert f"{KNOB}='repiar'" in out["stderr"]  # said where it was installed
    # ... and the job is refused, naming the variable and its values
    _refused(out["support"], KNOB, f"{KNOB}='repiar'", "expected one of error, repair")


def test_fingerprint_drift_refuses_the_job(tmp_path):
    """A SkyRL 0.4.x whose server sources differ from the recorded ones (simulated with an
    alternative matrix): the capture is refused by the fingerprint check at import."""
    need("skyrl", "vllm")
    from importlib.metadata import version

    from replay_plugin import compat

    with open(compat.default_path()) as fh:
        raw = yaml.safe_load(fh)
    prints = raw["patches"][PATCH]["fingerprints"][version("skyrl")]
    prints[next(iter(prints))] = "sha256:0000000000000000"
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(yaml.safe_dump(raw))
    out = job({"REPLAY_PLUGIN_MATRIX": str(matrix)})
    assert out["states"][PATCH][0] == "error" and "fingerprint drift" in out["states"][PATCH][1]
    assert out["rows_wrapped_by"] is None
    _refused(out["support"], "skyrl", SUPPORT_KEY, "fingerprint drift", "matrix --check")


def test_generator_refuses_when_the_engine_args_patch_did_not_check(tie_model):
    """Both the capture and ``skyrl.engine_support_width`` off: ``build_vllm_cli_args`` is SkyRL's
    (max_logprobs = top_k, no check), and SkyRL's agent loop, through the generator patch, would
    take SkyRL's top_k rows; it refuses before the first request."""
    need("skyrl", "vllm")
    url = f"http://127.0.0.1:{free_port()}"
    out = job({TOGGLE: "0", "REPLAY_PLUGIN_SKYRL_ENGINE_SUPPORT_WIDTH": "0"}, tie_model, url)
    assert out["states"]["skyrl.generator_support_width"][0] == "applied"
    assert out["support"] == {"max_logprobs": out["stock"]}  # the gap the generator's check covers
    _refused(out["agent_loop"], TOGGLE, SUPPORT_KEY, f"patch {PATCH} disabled")


def test_server_refuses_support_requests_while_the_knob_is_bad(monkeypatch):
    """In SkyRL's server the patch stays applied with a bad knob value and refuses each request
    that asks for support, naming the variable, before the engine runs (SkyRL's own
    ``_add_custom_endpoints`` on a FastAPI app; the engine stand-in fails if it is reached)."""
    need("skyrl", "vllm")
    from argparse import Namespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from skyrl.backends.skyrl_train.inference_servers.vllm_server_actor import VLLMServerActor

    class Unreached:
        async def generate(self, *args, **kwargs):
            raise AssertionError("the engine was reached")
            yield  # an async generator, as vLLM's

    app = FastAPI()
    VLLMServerActor._add_custom_endpoints(app, Unreached(), Namespace(enable_lora=False))
    client = TestClient(app, raise_server_exceptions=False)
    body = {"token_ids": [1, 2], "return_sample_support": True, "sampling_params": {"top_k": TOP_K, "max_tokens": 2}}
    monkeypatch.setenv(KNOB, "repiar")
    resp = client.post("/skyrl/v1/generate", json=body)
    assert resp.status_code == 500, resp.text
    assert f"{KNOB}='repiar'" in resp.json()["detail"] and "error, repair" in resp.json()["detail"]
    monkeypatch.setenv(KNOB, "repair")  # a good value: the request goes on to the engine
    with pytest.raises(AssertionError, match="the engine was reached"):
        TestClient(app).post("/skyrl/v1/generate", json=body)


def test_repair_fills_a_padding_slot_or_overwrites_the_last_member(monkeypatch, caplog):
    """``ON_INEXACT=repair`` as README "SkyRL" words it: a sampled id missing from an inexact row goes
    into the row's first padding slot, or overwrites its last member when the row is full; the
    server's log counts both (vLLM's own output and flat-logprob types, the plugin's rows on it)."""
    need("skyrl", "vllm")
    import logging

    import numpy as np
    from vllm.logprobs import FlatLogprobs
    from vllm.outputs import CompletionOutput, RequestOutput

    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.core.support import SupportRows
    from replay_plugin.skyrl.generate_endpoint import support_rows

    completion = CompletionOutput(index=0, text="", token_ids=[9, 9], cumulative_logprob=None, logprobs=None)
    completion.sample_support = SupportRows(
        ids=np.array([[5, 6, 7], [5, -1, -1]], np.int32),
        sampled=np.array([9, 9], np.int32),
        sampled_logprob=np.array([-1.0, -1.0], np.float32),
        exact=np.array([False, False]),
    )
    output = RequestOutput("r", None, [1], None, [completion], finished=True)
    flat = FlatLogprobs(start_indices=[0, 1], end_indices=[1, 2], token_ids=[9, 9], logprobs=[-1.0, -1.0],
                        ranks=[1, 1], decoded_tokens=[None, None])  # fmt: skip
    with pytest.raises(ReplayDataError, match="2 of 2 rows are not the sampler's exact support") as refused:
        support_rows(output, flat, 2)  # the default policy
    assert refused.value.token == 0
    monkeypatch.setenv(KNOB, "repair")
    with caplog.at_level(logging.WARNING, logger="replay_plugin"):
        content, ids = support_rows(output, flat, 2)
    assert ids.tolist() == [[5, 6, 9], [5, 9, -1]]
    assert content == [{"logprob": -1.0}, {"logprob": -1.0}]
    assert "1 got it in a padding slot, 1 had their last member overwritten by it" in caplog.text
