"""Stock SkyRL 0.4.0 jobs with the plugin installed: SkyRL's own ``/skyrl/v1/generate`` on a real
vLLM engine returns exact support rows, and SkyRL's own FSDP model wrapper scores them to the
rollout's logprobs and replays the rollout's routes (issue 30).

Each test shows the upstream problem first (the stock server, the unpatched function, the
forward without routes), then its absence with the plugin.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from support.skyrl_servers import SLACK, TOKENS, TOP_K
from support.upstream import need

pytestmark = pytest.mark.timeout(1500)


def _rows(choice) -> np.ndarray:
    from skyrl.backends.skyrl_train.inference_servers.generate_wire import decode_packed_sample_support

    return decode_packed_sample_support(choice["rollout_sample_support"])


def _routes(choice) -> np.ndarray:
    from skyrl.backends.skyrl_train.inference_servers.generate_wire import decode_packed_routed_experts

    return decode_packed_routed_experts(choice["routed_experts"])


def _reference_supports(model_dir: str, runs: list[dict]) -> list[list[set]]:
    """Per run and generated token, the ids whose float32 logit is at least the k-th largest (the
    sampler's top-k support with every tie kept, temperature 1, no top-p), from the Hugging Face
    model teacher-forced on the prompt and the response."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for run in runs:
        ids = run["prompt"] + run["choice"]["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        p = len(run["prompt"])
        rows = []
        for t in range(len(run["choice"]["token_ids"])):
            z = logits[p - 1 + t]
            kth = torch.topk(z, TOP_K).values[-1]
            rows.append(set(torch.nonzero(z >= kth - 1e-4).flatten().tolist()))
        out.append(rows)
    return out


def test_skyrl_endpoint_rows_are_the_samplers_support(stock, patched, tie_model):
    """Stock SkyRL: rows of width top_k that cut the tie at the k-th logit, and repairs (SkyRL
    overwrites the weakest member with the sampled id); with the plugin: rows of width
    top_k + slack, never repaired, each the sampler's whole support (checked against the model's
    own logits), the same sampled tokens."""
    need("skyrl", "vllm")
    stock_runs, runs = stock["runs"], patched["runs"]
    reference = _reference_supports(tie_model, runs)
    n = len(runs) * TOKENS
    stock_wrong = plugin_wrong = 0
    for s_run, p_run, ref in zip(stock_runs, runs, reference):
        assert s_run["choice"]["token_ids"] == p_run["choice"]["token_ids"]  # the plugin changes no sample
        s_rows, p_rows = _rows(s_run["choice"]), _rows(p_run["choice"])
        assert s_rows.shape == (TOKENS, TOP_K) and p_rows.shape == (TOKENS, TOP_K + SLACK)
        for t, token in enumerate(p_run["choice"]["token_ids"]):
            stock_set = {int(i) for i in s_rows[t] if i >= 0}
            plugin_set = {int(i) for i in p_rows[t] if i >= 0}
            stock_wrong += stock_set != ref[t]
            plugin_wrong += plugin_set != ref[t]
            assert token in plugin_set
    print(
        f"stock SkyRL: {stock['repaired']} repaired rows, {stock_wrong}/{n} rows not the support; "
        f"plugin: {patched['repaired']} repaired, {plugin_wrong}/{n} not the support"
    )
    assert stock["repaired"] > 0 and stock_wrong > 0.5 * n  # every row cuts a tie group at top_k=4
    assert patched["repaired"] == 0 and plugin_wrong == 0
    assert "had the sampled id absent" not in patched["log"]


def _batch(runs, rows_of):
    """A SkyRL training batch built by SkyRL's own preprocessing from the rollouts (two left-padded
    lengths), with routes and the router padding mask as SkyRL's trainer makes them."""
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors, make_router_padding_mask

    prompts, responses, supports, lps, routes = [], [], [], [], []
    for i, run in enumerate(runs):
        keep = TOKENS if i % 2 == 0 else TOKENS // 2  # ragged responses
        choice = run["choice"]
        prompts.append(run["prompt"])
        responses.append(choice["token_ids"][:keep])
        supports.append(np.ascontiguousarray(rows_of(run)[:keep]))
        lps.append([c["logprob"] for c in choice["logprobs"]["content"]][:keep])
        routes.append(np.ascontiguousarray(_routes(choice)[: len(run["prompt"]) + keep - 1]))
    seq, attn, _, _, loss, rollout_lp, packed_routes, support = convert_prompts_responses_to_batch_tensors(
        0,
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        [[1] * len(r) for r in responses],
        logprobs=lps,
        rollout_expert_indices=routes,
        rollout_sample_support=supports,
    )
    rpm = make_router_padding_mask(attn, [len(r) for r in routes])
    return dict(
        sequences=seq,
        attention_mask=attn,
        loss_mask=loss,
        rollout_logprobs=rollout_lp,
        routes=packed_routes,
        router_padding_mask=rpm,
        sample_support=support,
    )


def _wrapper(model_dir: str, bf16: bool = False):
    import torch
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

    torch.manual_seed(0)
    wrapper = HFModelWrapper(model_dir, use_flash_attention_2=False, bf16=bf16)  # sdpa, CPU
    return wrapper.eval()


def test_skyrl_fsdp_wrapper_scores_the_rollouts_logprobs(stock, patched, tie_model):
    """SkyRL's HFModelWrapper.forward (float32, CPU) with SkyRL's own sample-support replay: on the
    stock rows the importance ratio against the rollout's logprobs is off (repaired, cut rows);
    on the plugin's rows it is 1 within 1e-5 on every loss-bearing token. Without replay (the
    full vocabulary) it is the kept mass."""
    need("skyrl", "vllm")
    import torch

    wrapper = _wrapper(tie_model)
    ratios = {}
    for name, runs in (("stock", stock["runs"]), ("plugin", patched["runs"])):
        b = _batch(runs, lambda run: _rows(run["choice"]))
        num_actions = b["loss_mask"].shape[1]
        with torch.no_grad():
            lp = wrapper(
                b["sequences"],
                num_actions,
                attention_mask=b["attention_mask"],
                temperature=1.0,
                sample_support=b["sample_support"],
                loss_mask=b["loss_mask"],
                enable_sample_support_replay=True,
            )
            full = wrapper(b["sequences"], num_actions, attention_mask=b["attention_mask"], temperature=1.0)
        m = b["loss_mask"].bool()
        ratios[name] = torch.exp(lp - b["rollout_logprobs"])[m]
        ratios["full"] = torch.exp(full - b["rollout_logprobs"])[m]
    dev = {k: float((v - 1).abs().max()) for k, v in ratios.items()}
    print({k: (round(float(v.mean()), 6), dev[k]) for k, v in ratios.items()})
    assert dev["stock"] > 1e-2
    assert dev["plugin"] < 1e-5
    assert float(ratios["full"].mean()) < 0.9


def _agreement(wrapper, b, **kwargs) -> float:
    """Share of the loss-bearing tokens' sources whose experts (what the experts modules received,
    every layer) are the rollout's."""
    import torch

    from replay_plugin.core.routes import pad_batch
    from replay_plugin.fsdp import record_routes

    with torch.no_grad(), record_routes(wrapper.model) as rec:
        wrapper(b["sequences"], b["loss_mask"].shape[1], attention_mask=b["attention_mask"], temperature=1.0, **kwargs)
    values, cu = b["routes"].values, b["routes"].cu_seqlens.tolist()
    want, mask = pad_batch([values[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)], b["attention_mask"])
    got = rec.routes.sort(-1).values
    want = torch.as_tensor(want).long().sort(-1).values
    scored = ~(mask | b["router_padding_mask"])
    same = (got == want).all(-1).all(-1)[scored]
    return float(same.float().mean())


def test_skyrl_fsdp_wrapper_replays_the_rollouts_routes(patched, tie_model):
    """A bfloat16 trainer routes some tokens to other experts than the float32 engine; with the
    rollout's routes (``rollout_expert_indices`` / ``router_padding_mask`` as SkyRL's batch holds
    them) every recorded token goes to the engine's experts, and stock SkyRL's forward takes no
    routes at all."""
    need("skyrl", "vllm")
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

    wrapper = _wrapper(tie_model, bf16=True)
    b = _batch(patched["runs"], lambda run: _rows(run["choice"]))
    stock_forward = inspect.unwrap(HFModelWrapper.forward)
    assert "rollout_expert_indices" not in inspect.signature(stock_forward).parameters
    off = _agreement(wrapper, b)
    on = _agreement(wrapper, b, rollout_expert_indices=b["routes"], router_padding_mask=b["router_padding_mask"])
    print(f"bf16 trainer route agreement: {100 * off:.1f}% without replay, {100 * on:.1f}% with")
    assert off < 1.0
    assert on == 1.0


def test_skyrl_fsdp_worker_replays_with_skyrls_r3_keys(patched, tie_model, monkeypatch):
    """SkyRL's own FSDP policy worker method (``_forward_micro_batch``, the old-logprob pass) on a
    batch from SkyRL's trainer fields: with ``moe_enable_routing_replay`` it replays the routes,
    without it (or stock) it does not. The worker hard-codes CUDA devices: the harness names the
    CPU (``torch.cuda.current_device``), nothing else of SkyRL is replaced."""
    need("skyrl", "vllm")
    import torch
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
    from skyrl.train.config.config import SkyRLTrainConfig

    from replay_plugin.fsdp import record_routes

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # CPU shim of the harness
    b = _batch(patched["runs"], lambda run: _rows(run["choice"]))
    wrapper = _wrapper(tie_model, bf16=True)
    batch = TrainingInputBatch(
        {
            "sequences": b["sequences"],
            "attention_mask": b["attention_mask"],
            "rollout_expert_indices": b["routes"],
            "router_padding_mask": b["router_padding_mask"],
        }
    )
    batch.metadata = {"response_length": b["loss_mask"].shape[1]}
    results = {}
    for replay in (False, True):
        cfg = SkyRLTrainConfig()
        cfg.trainer.policy.megatron_config.moe_enable_routing_replay = replay
        worker = object.__new__(FSDPPolicyWorkerBase)  # the worker's state the method reads, no Ray actor
        worker.model, worker.cfg = wrapper, cfg.trainer
        with record_routes(wrapper.model) as rec:
            worker._forward_micro_batch(batch)
        got = rec.routes.sort(-1).values
        from replay_plugin.core.routes import pad_batch

        values, cu = b["routes"].values, b["routes"].cu_seqlens.tolist()
        want, mask = pad_batch([values[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)], b["attention_mask"])
        want = torch.as_tensor(want).long().sort(-1).values
        scored = ~(mask | b["router_padding_mask"])
        results[replay] = float((got == want).all(-1).all(-1)[scored].float().mean())
    print(f"worker _forward_micro_batch route agreement: {results}")
    assert results[False] < 1.0 and results[True] == 1.0


def test_skyrl_config_accepts_r3_on_fsdp():
    """SkyRL refuses routes unless trainer.strategy is megatron; with the plugin the fsdp strategy
    passes, and SkyRL's other R3 checks stay (the mp executor, moe_enable_routing_replay), as
    typed refusals naming the key: SkyRL's own are asserts, and so were the plugin's, which
    ``python -O`` strips (issue 41, F11; shown in a fresh interpreter below)."""
    need("skyrl")
    from skyrl.train.config.config import SkyRLTrainConfig
    from skyrl.train.utils import utils

    from replay_plugin.core.errors import NotReplayable

    def cfg(**over):
        c = SkyRLTrainConfig()
        c.trainer.strategy = "fsdp"
        c.generator.inference_engine.enable_return_routed_experts = True
        c.generator.inference_engine.distributed_executor_backend = over.get("backend", "mp")
        c.trainer.policy.megatron_config.moe_enable_routing_replay = over.get("replay", True)
        return c

    stock = inspect.unwrap(utils.validate_inference_engine_cfg)
    with pytest.raises(AssertionError, match="only supported with Megatron training backend"):
        stock(cfg())
    utils.validate_inference_engine_cfg(cfg())
    with pytest.raises(NotReplayable, match="use the vLLM mp backend") as refused:
        utils.validate_inference_engine_cfg(cfg(backend="ray"))
    assert refused.value.setting == "generator.inference_engine.distributed_executor_backend"
    with pytest.raises(NotReplayable, match="moe_enable_routing_replay must be True") as refused:
        utils.validate_inference_engine_cfg(cfg(replay=False))
    assert refused.value.setting == "trainer.policy.megatron_config.moe_enable_routing_replay"
    assert cfg().generator.inference_engine.enable_return_routed_experts  # the flag is restored

    # under python -O (asserts stripped) both still refuse
    from support.procs import run_python

    code = (
        "from skyrl.train.config.config import SkyRLTrainConfig\n"
        "from skyrl.train.utils import utils\n"
        "assert False, 'asserts run'\n"  # stripped: proves -O is in effect
        "for backend, replay in (('ray', True), ('mp', False)):\n"
        "    c = SkyRLTrainConfig(); c.trainer.strategy = 'fsdp'\n"
        "    c.generator.inference_engine.enable_return_routed_experts = True\n"
        "    c.generator.inference_engine.distributed_executor_backend = backend\n"
        "    c.trainer.policy.megatron_config.moe_enable_routing_replay = replay\n"
        "    try:\n"
        "        utils.validate_inference_engine_cfg(c)\n"
        "        print('ACCEPTED', backend, replay)\n"
        "    except Exception as exc:\n"
        "        print('REFUSED', backend, replay, type(exc).__name__)\n"
    )
    proc = run_python(code, env={"PYTHONOPTIMIZE": "1", "FLASH_ATTENTION_TRITON_AMD_ENABLE": "TRUE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ACCEPTED", "REFUSED"))]
    assert lines == ["REFUSED ray True NotReplayable", "REFUSED mp False NotReplayable"], proc.stdout[-2000:]


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _two_turn_env():
    """A user's environment (SkyRL's registry, SkyRL's base class): two turns, one observation."""
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
    from skyrl_gym.envs.registration import register, registry

    class TwoTurns(BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()
            self.turn = 0

        def step(self, action):
            self.turn += 1
            done = self.turn >= 2
            observations = [] if done else [{"role": "user", "content": "once more"}]
            return BaseTextEnvStepOutput(observations=observations, reward=0.0, done=done, metadata={})

    if "replay_two_turns" not in registry:
        register(id="replay_two_turns", entry_point=TwoTurns)
    return "replay_two_turns"


def test_skyrl_generator_takes_the_wider_rows_over_turns(patched_server, tie_model):
    """SkyRL's own agent loop (``SkyRLGymGenerator.agent_loop``, multi-turn, SkyRL's
    ``RemoteInferenceClient`` against SkyRL's server): stock, it reads rows as top_k wide and
    refuses the plugin's; patched, every generated token has its row (the sampled token in it),
    observation tokens have empty rows, SkyRL's ``SampleSupportTrace`` lines them up with the
    tokens over both turns, and SkyRL's preprocessing and FSDP wrapper score the trajectory to the
    rollout's logprobs."""
    need("skyrl", "vllm")
    import asyncio

    import torch
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from skyrl.train.config.config import SkyRLTrainConfig
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from transformers import AutoTokenizer

    env_class = _two_turn_env()
    tokenizer = AutoTokenizer.from_pretrained(tie_model)
    tokenizer.chat_template = CHAT_TEMPLATE  # the tiny model's tokenizer has none
    cfg = SkyRLTrainConfig()
    cfg.generator.max_turns = 2
    cfg.generator.inference_engine.enable_return_sample_support_set = True
    cfg.generator.sampling_params.top_k = TOP_K
    client = RemoteInferenceClient(
        proxy_url=patched_server.base,
        server_urls=[patched_server.base],
        data_parallel_size=1,
        model_name=tie_model,
        enable_return_sample_support_set=True,
        tokenizer=tokenizer,
    )
    generator = SkyRLGymGenerator(cfg.generator, cfg.environment.skyrl_gym, client, tokenizer)
    params = {"temperature": 1.0, "top_k": TOP_K, "max_tokens": 8, "logprobs": 0, "ignore_eos": True, "seed": 7}
    call = dict(
        prompt=[{"role": "user", "content": "route me"}],
        env_class=env_class,
        env_extras={},
        max_tokens=8,
        max_input_length=400,
        sampling_params=params,
    )

    stock_loop = inspect.unwrap(SkyRLGymGenerator.agent_loop)
    with pytest.raises(ValueError, match="Sample support has .* rows for 8 tokens"):
        asyncio.run(stock_loop(generator, **call))

    out = asyncio.run(generator.agent_loop(**call))
    rows, loss = np.asarray(out.rollout_sample_support), np.asarray(out.loss_mask)
    assert rows.shape == (len(out.response_ids), TOP_K + SLACK)
    generated = loss == 1
    assert generated.sum() == 16  # two turns of 8 tokens
    assert all(out.response_ids[t] in rows[t] for t in np.flatnonzero(generated))
    assert (rows[~generated] == -1).all() and (~generated).sum() > 0  # the observation and turn tokens

    seq, attn, _, _, loss_t, rollout_lp, _, support = convert_prompts_responses_to_batch_tensors(
        0, [out.prompt_ids], [out.response_ids], [[0.0] * len(out.response_ids)], [out.loss_mask],
        logprobs=[out.rollout_logprobs], rollout_sample_support=[rows],
    )  # fmt: skip
    wrapper = _wrapper(tie_model)
    with torch.no_grad():
        lp = wrapper(seq, loss_t.shape[1], attention_mask=attn, temperature=1.0, sample_support=support,
                     loss_mask=loss_t, enable_sample_support_replay=True)  # fmt: skip
    m = loss_t.bool()
    assert float((torch.exp(lp - rollout_lp)[m] - 1).abs().max()) < 1e-5


def test_doctor_names_the_silent_skyrl_cases(tmp_path):
    """``replay-plugin doctor --skyrl-config``: SkyRL's config asks for sample support while the
    plugin's capture is off (a patch toggled off, the plugin disabled) is reported, naming the
    patch; with the defaults nothing SkyRL-related is."""
    need("skyrl", "vllm")
    import json
    import os
    import subprocess
    import sys

    keys = "generator.inference_engine.enable_return_sample_support_set=true generator.sampling_params.top_k=4"

    def findings(env):
        base = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
        proc = subprocess.run(
            [sys.executable, "-m", "replay_plugin.cli", "doctor", "--json", "--skyrl-config", keys],
            env={**base, **env}, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        )  # fmt: skip
        return [f for f in json.loads(proc.stdout)["findings"] if f["check"] == "skyrl"]

    assert findings({}) == []
    off = findings({"REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS": "0"})
    assert len(off) == 1 and "skyrl.sample_support_rows disabled" in off[0]["problem"], off
    off = findings({"REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT": "0"})
    assert len(off) == 1 and "vllm.sample_support disabled" in off[0]["problem"], off
    # ON_INEXACT read by the server's own rule (capture_guard.on_inexact): empty is the default
    # (error), a typo refuses the job at start, so the doctor names it
    knob = "REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS_ON_INEXACT"
    assert findings({knob: ""}) == []
    typo = findings({knob: "repiar"})
    assert len(typo) == 1 and "'repiar'" in typo[0]["problem"] and "error, repair" in typo[0]["problem"], typo


def test_skyrl_ray_workers_keep_the_route_patches():
    """SkyRL's FSDP workers are Ray actors (``PolicyWorker = ray.remote(...)(FSDPPolicyWorkerBase)``,
    likewise ``RefWorker``): Ray prepares the class in the driver (its tracing injection keeps each
    method as looked up on the class) and ships it by value. The patched ``_forward_micro_batch``
    must arrive as the plugin's wrapper, not as SkyRL's function (what cloudpickle made of a wrapt
    proxy before the patcher pickled its wrappers by reference; the wrapt case itself is shown in
    tests/integration/verl/test_ray_actor_patches.py)."""
    need("skyrl")
    from ray import cloudpickle
    from ray.actor import _modify_class
    from ray.util.tracing.tracing_helper import _inject_tracing_into_class
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    from replay_plugin.patcher import patch_marker

    for cls, name in (
        (fsdp_worker.FSDPPolicyWorkerBase, "_forward_micro_batch"),
        (fsdp_worker.FSDPPolicyWorkerBase, "_forward_backward_micro"),
        (fsdp_worker.FSDPRefWorkerBase, "_forward_micro_batch"),
    ):
        shipped = _inject_tracing_into_class(_modify_class(cls))
        loaded = cloudpickle.loads(cloudpickle.dumps(shipped))
        method = loaded.__dict__.get(name) or getattr(loaded, name)
        captured = [c.cell_contents for c in (getattr(method, "__closure__", None) or ())]
        assert any(patch_marker(obj) == "skyrl.fsdp_worker_routes" for obj in captured + [method]), (cls, name)
