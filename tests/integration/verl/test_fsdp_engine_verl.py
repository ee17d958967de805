"""verl 0.9.1's own FSDP engine (``FSDPEngineWithLMHead``, fsdp2 on gloo, CPU) with the plugin's
``verl.fsdp_support_logprobs`` and ``verl.fsdp_routes`` (issue 31 items 3 and 5, the engine part).

The rollout here is a top-k sampler over the same float32 weights (the plugin's contract: each
response token's support row is the set the sampler could draw, its logprob the sampler's), made
in the scenario, so that the engine's side is tested on its own; the batch goes through verl's own
``DataProto.to_tensordict`` and ``left_right_2_no_padding`` (``verl_engine.make_batch``), then the
engine's ``infer_batch`` (the ``compute_log_prob`` path) and ``train_batch`` with ``ppo_loss``.
The rows reach the engine under ``rollout_sample_support`` (``[B, R, W]``, response-aligned like
``rollout_log_probs``); routes under verl's ``routed_experts``.

Every scenario runs in a fresh interpreter (the installed wheel active, the harness's CPU platform
registered before verl's engine is imported: ``verl_engine``); the patch is switched off by its
environment variable to show stock verl.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fsdp"))

import fsdp_harness  # noqa: E402
from support.upstream import need  # noqa: E402

pytestmark = pytest.mark.timeout(900)

TOP_K = 4
WIDTH = 6  # rows W = top_k + 2: -1 padded, as the plugin's rows are wider than top_k
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18]]
RESPONSE = 8
OFF_SUPPORT = {"REPLAY_PLUGIN_VERL_FSDP_SUPPORT_LOGPROBS": "0", "REPLAY_PLUGIN_VERL_ENGINE_REPLAY_GUARD": "0"}  # stock
OFF_ROUTES = {"REPLAY_PLUGIN_VERL_FSDP_ROUTES": "0", "REPLAY_PLUGIN_VERL_ENGINE_REPLAY_GUARD": "0"}  # stock


# --------------------------------------------------------------------------- inside a rank


def _ve():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import verl_engine

    verl_engine.register_cpu_platform()
    return verl_engine


def _model(ve, directory: str):
    import torch
    from transformers import AutoModelForCausalLM

    if not os.path.exists(os.path.join(directory, "config.json")):
        ve.save_tiny_model(directory, vocab_size=128, seed=3)
        # Routers of small logits: near-ties between experts, which a bfloat16 trainer breaks
        # differently from the float32 rollout (the gap R3 closes).
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.mul_(0.05)
        model.save_pretrained(directory, safe_serialization=True)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").eval()


def _rollout(model, temperature: float, seed: int):
    """Top-k sampling, token by token: responses, the sampler's logprobs, its support rows
    (``[R, WIDTH]``, the top-k ids then -1), and the routes of the float32 forward of every
    sequence (``[P + R, L, K]``; the last token's row as the engine leaves it: zeros)."""
    import torch

    from replay_plugin.fsdp import record_routes

    g = torch.Generator().manual_seed(seed)
    out = {"responses": [], "logprobs": [], "support": [], "routes": []}
    with torch.no_grad():
        for prompt in PROMPTS:
            seq, lps, rows = list(prompt), [], []
            for _ in range(RESPONSE):
                logits = model(torch.tensor([seq])).logits[0, -1].float() / temperature
                top = torch.topk(logits, TOP_K)
                probs = torch.softmax(top.values, -1)
                j = int(torch.multinomial(probs, 1, generator=g))
                seq.append(int(top.indices[j]))
                lps.append(float(torch.log(probs[j])))
                rows.append(top.indices.tolist() + [-1] * (WIDTH - TOP_K))
            with record_routes(model) as rec:
                model(torch.tensor([seq]))
            routes = rec.routes[0].to(torch.int16).clone()
            routes[-1] = 0
            out["responses"].append(seq[len(prompt) :])
            out["logprobs"].append(lps)
            out["support"].append(rows)
            out["routes"].append(routes)
    return out


def _batch(ve, roll, temperature: float, **fields):
    import torch

    support = [torch.tensor(r, dtype=torch.int32) for r in roll["support"]]
    return ve.make_batch(
        PROMPTS, roll["responses"], pad_id=0, temperature=temperature, response_fields=("rollout_sample_support",),
        rollout_sample_support=support, **fields,
    )  # fmt: skip


def _trim(roll: dict) -> dict:
    """Sample 0 one response token shorter: an odd number of tokens, so that verl pads the packed
    batch for Ulysses SP=2 (its ``ulysses_pad``)."""
    roll["responses"][0] = roll["responses"][0][:-1]
    roll["logprobs"][0] = roll["logprobs"][0][:-1]
    roll["support"][0] = roll["support"][0][:-1]
    routes = roll["routes"][0][:-1].clone()
    routes[-1] = 0
    roll["routes"][0] = routes
    return roll


def _sp_engine_kwargs(sp: int) -> dict:
    """Ulysses SP: verl's sequence-parallel attention is its flash-attention patch, served on CPU by
    the harness's ``cpu_flash_attn``; ``attn`` overrides (sdpa: what verl does not split)."""
    if sp == 1:
        return {}
    import cpu_flash_attn

    cpu_flash_attn.install()
    return {"ulysses_sequence_parallel_size": sp, "attn_implementation": "flash_attention_2"}


def support_scenario(
    rank: int, world: int, model_dir: str, temperature: float, remove_padding: bool, sp: int = 1,
    micro_batch_size: int = 2, trim: bool = False, attn: str | None = None,
) -> dict:  # fmt: skip
    """The engine's response logprobs against the sampler's: ratio statistics over every response
    token, the entropy verl reports, and one PPO step with the rollout's logprobs as old logprobs.
    ``sp``: Ulysses sequence parallelism over ``world`` ranks (``micro_batch_size=4`` puts a sequence
    across the two ranks; ``trim`` makes verl pad the packed batch)."""
    import torch

    from replay_plugin.core.errors import NotReplayable

    ve = _ve()
    model = _model(ve, model_dir)
    roll = _rollout(model, temperature, seed=11)
    roll = _trim(roll) if trim else roll
    batch = _batch(ve, roll, temperature)
    kwargs = _sp_engine_kwargs(sp) | ({"attn_implementation": attn} if attn else {})
    engine = ve.build_engine(model_dir, use_remove_padding=remove_padding, micro_batch_size=micro_batch_size, **kwargs)
    try:
        got = ve.infer(engine, ve.log_prob_batch(batch, temperature=temperature), temperature=temperature)
    except NotReplayable as exc:
        return {"refused": f"{exc.setting}: {exc}"}
    lp, entropy = got["log_probs"], got["entropy"]
    rollout = torch.zeros_like(lp)
    for i, row in enumerate(roll["logprobs"]):
        rollout[i, : len(row)] = torch.tensor(row)
    mask = batch["response_mask"].bool()
    ratio = torch.exp(lp - rollout)[mask]
    full = ve.hf_response_logprobs(model, PROMPTS, roll["responses"], temperature)
    full_ratio = torch.cat([torch.exp(f - torch.tensor(r)) for f, r in zip(full, roll["logprobs"], strict=True)])
    step = ve.train_step(engine, batch, old_log_probs=roll["logprobs"], temperature=temperature)
    return {
        "ratio_mean": float(ratio.mean()),
        "ratio_max_dev": float((ratio - 1).abs().max()),
        "full_ratio_mean": float(full_ratio.mean()),
        "log_probs": lp[mask].tolist(),
        "entropy": entropy[mask].tolist(),
        "loss": step["loss"],
        "grad_norm": step["grad_norm"],
        "ppo_kl": step["metrics"].get("actor/ppo_kl", step["metrics"].get("ppo_kl")),
        "metric_keys": sorted(step["metrics"]),
    }


def refusal_scenario(rank: int, world: int, model_dir: str) -> dict:
    """Rows that are not the sampler's support are refused by name; R2 and R3 without routes too."""
    import torch

    from replay_plugin.core.errors import NotReplayable, ReplayDataError

    ve = _ve()
    model = _model(ve, model_dir)
    roll = _rollout(model, 1.0, seed=5)
    bad = [list(map(list, rows)) for rows in roll["support"]]
    token = roll["responses"][2][3]
    bad[2][3] = [i for i in range(TOP_K + 1) if i != token][:TOP_K] + [-1] * (WIDTH - TOP_K)
    batch = ve.make_batch(
        PROMPTS, roll["responses"], pad_id=0, response_fields=("rollout_sample_support",),
        rollout_sample_support=[torch.tensor(r, dtype=torch.int32) for r in bad],
    )  # fmt: skip
    engine = ve.build_engine(model_dir, micro_batch_size=4)
    out = {}
    try:
        ve.infer(engine, ve.log_prob_batch(batch))
        out["missing"] = None
    except ReplayDataError as exc:
        out["missing"] = str(exc)
    wide = [torch.tensor(r).to(torch.uint8) for r in roll["support"]]  # -1 wraps to 255
    batch = ve.make_batch(
        PROMPTS, roll["responses"], pad_id=0, response_fields=("rollout_sample_support",),
        rollout_sample_support=wide,
    )  # fmt: skip
    try:
        ve.infer(engine, ve.log_prob_batch(batch))
        out["unsigned"] = None
    except (ReplayDataError, TypeError) as exc:
        out["unsigned"] = f"{type(exc).__name__}: {exc}"
    plain = ve.make_batch(PROMPTS, roll["responses"], pad_id=0)
    for mode in ("R2", "R3"):
        engine = ve.build_engine(model_dir, micro_batch_size=4, router_replay_mode=mode)
        try:
            ve.infer(engine, ve.log_prob_batch(plain))
            out[mode] = None
        except NotReplayable as exc:
            out[mode] = str(exc)
    return out


def routes_scenario(
    rank: int, world: int, model_dir: str, mode: str | None, gradient_checkpointing: bool, sp: int = 1,
    trim: bool = False,
) -> dict:  # fmt: skip
    """A bfloat16 engine scoring the float32 rollout: share of the tokens (all but each sequence's
    last) whose experts, every MoE layer, are the rollout's; then one PPO step (forward and
    backward, the recompute of checkpointed layers included) with its loss, gradient norm and the
    agreement of its last recorded forward (the backward's recompute with checkpointing). With
    Ulysses ``sp`` each rank compares its own slice of the packed batch."""
    import torch

    from replay_plugin.fsdp import record_routes
    from replay_plugin.fsdp.route_replay import bound_layers

    ve = _ve()
    model = _model(ve, model_dir)
    roll = _rollout(model, 1.0, seed=7)
    roll = _trim(roll) if trim else roll
    batch = ve.make_batch(PROMPTS, roll["responses"], pad_id=0, routed_experts=roll["routes"])
    engine = ve.build_engine(
        model_dir, dtype="bfloat16", router_replay_mode=mode, micro_batch_size=len(PROMPTS),
        gradient_checkpointing=gradient_checkpointing, **_sp_engine_kwargs(sp),
    )  # fmt: skip
    want = torch.cat([r.long() for r in roll["routes"]]).sort(-1).values
    keep = torch.ones(want.shape[0], dtype=torch.bool)
    ends = torch.tensor([len(p) + len(r) for p, r in zip(PROMPTS, roll["responses"], strict=True)]).cumsum(0) - 1
    keep[ends] = False
    part = -(-want.shape[0] // sp)  # this rank's slice of the packed batch (verl pads it to sp parts)
    lo, hi = rank * part, min((rank + 1) * part, want.shape[0])

    def agreement(rec) -> float:
        got = rec.routes.reshape(-1, *rec.routes.shape[-2:]).sort(-1).values
        assert got.shape[0] == part, (got.shape, part)
        return float((got[: hi - lo] == want[lo:hi]).all(-1).all(-1)[keep[lo:hi]].float().mean())

    with record_routes(engine.module) as rec:
        ve.infer(engine, ve.log_prob_batch(batch))
    with record_routes(engine.module) as rec_step:
        step = ve.train_step(engine, batch)
    return {
        "agreement": agreement(rec),
        "step_agreement": agreement(rec_step),
        "loss": step["loss"],
        "grad_norm": step["grad_norm"],
        "bound_after": list(bound_layers()),
    }


def guard_scenario(rank: int, world: int, model_dir: str) -> dict:
    """compute_log_prob on a batch with rows (refused or scored), the guard's verdict on engine
    classes of verl that the plugin does not make score over rows (a value head needs none), and
    compute_log_prob on an engine configured for R3 with the rollout's routes in the batch (refused,
    or routed by the route patch: the share of tokens on the rollout's experts)."""
    ve = _ve()  # before verl's engine modules are imported

    import torch
    from verl.workers.engine.fsdp.fsdp_turbo_impl import FSDPTurboEngineWithLMHead
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    from replay_plugin.core.errors import NotReplayable
    from replay_plugin.fsdp import record_routes
    from replay_plugin.verl import engine_guard

    model = _model(ve, model_dir)
    roll = _rollout(model, 1.0, seed=5)
    engine = ve.build_engine(model_dir, micro_batch_size=2)
    out = {}
    try:
        ve.infer(engine, _batch(ve, roll, 1.0))
        out["infer"] = None
    except NotReplayable as exc:
        out["infer"] = f"{exc.setting}: {exc}"
    for cls in (FSDPTurboEngineWithLMHead, FSDPEngineWithValueHead):
        try:
            engine_guard.check_engine(object.__new__(cls))
            out[cls.__name__] = None
        except NotReplayable as exc:
            out[cls.__name__] = f"{exc.setting}: {exc}"
    r3 = ve.build_engine(model_dir, dtype="bfloat16", router_replay_mode="R3", micro_batch_size=len(PROMPTS))
    batch = ve.make_batch(PROMPTS, roll["responses"], pad_id=0, routed_experts=roll["routes"])
    try:
        with record_routes(r3.module) as rec:
            ve.infer(r3, ve.log_prob_batch(batch))
        want = torch.cat([r.long() for r in roll["routes"]]).sort(-1).values
        got = rec.routes.reshape(-1, *rec.routes.shape[-2:]).sort(-1).values
        out["r3"] = float((got == want).all(-1).all(-1).float().mean())
    except NotReplayable as exc:
        out["r3"] = f"{exc.setting}: {exc}"
    return out


def _outcome(call) -> dict:
    """What one hostile batch gives: the log-probs (``scored``), or the error's type, text and
    located fields (an untyped error is reported as such)."""
    from replay_plugin.core.errors import NotReplayable, ReplayDataError, ReplayTypeError

    try:
        return {"scored": call()}
    except (ReplayDataError, ReplayTypeError) as exc:
        return {"error": type(exc).__name__, "text": str(exc), "field": exc.field, "trajectory": exc.trajectory,
                "token": exc.token}  # fmt: skip
    except NotReplayable as exc:
        return {"error": "NotReplayable", "text": str(exc), "field": exc.setting}
    except Exception as exc:  # noqa: BLE001 - an untyped crash is what the test looks for
        import traceback

        return {"error": type(exc).__name__, "text": traceback.format_exc(), "untyped": True}


def hostile_scenario(rank: int, world: int, model_dir: str) -> dict:
    """Batches no stock verl 0.9.1 pipeline makes, through the engine's compute_log_prob path
    (issue 41: F3, F6, F7, F8): a loss-bearing token whose support row is all -1 (alone, twice in a
    sample), an int64 id of 2**32 + 5, a per-sample temperature tensor with a negative entry, the
    rows as a strided nested tensor, R3 with routes that are all zero (nothing captured) for the
    batch or for one sequence, and dense routes whose length is not the attention mask's. Also the
    full-vocabulary logprob of the token the first case would score (what a silent score gives)."""
    import torch

    ve = _ve()
    model = _model(ve, model_dir)
    roll = _rollout(model, 1.0, seed=5)
    engine = ve.build_engine(model_dir, micro_batch_size=4)

    def rows(dtype=torch.int32, edit=None):
        bad = [list(map(list, r)) for r in roll["support"]]
        if edit:
            edit(bad)
        return [torch.tensor(r, dtype=dtype) for r in bad]

    def batch(support, **kw):
        return ve.make_batch(
            PROMPTS, roll["responses"], pad_id=0, response_fields=("rollout_sample_support",),
            rollout_sample_support=support, **kw,
        )  # fmt: skip

    def scored(b, **kw):
        return lambda: ve.infer(engine, b, **kw)["log_probs"][2].tolist()

    def blank(*tokens):
        def edit(bad):
            for t in tokens:
                bad[2][t] = [-1] * WIDTH

        return edit

    full = ve.hf_response_logprobs(model, PROMPTS, roll["responses"], 1.0)
    out = {"full_vocab_lp": float(full[2][3]), "rollout_lp": roll["logprobs"][2][3]}
    out["one_unsupported"] = _outcome(scored(batch(rows(edit=blank(3)))))
    out["two_unsupported"] = _outcome(scored(batch(rows(edit=blank(3, 4)))))

    def wide(bad):
        bad[2][3][1] = 2**32 + 5  # an int64 id that an int32 narrowing reads as token 5

    out["wide_id"] = _outcome(scored(batch(rows(torch.int64, wide))))
    negative = batch(rows())
    negative["temperature"] = torch.tensor([1.0, 1.0, -1.0, 1.0])
    out["negative_temperature"] = _outcome(scored(negative, temperature=None))
    strided = batch(rows())
    strided["rollout_sample_support"] = torch.nested.nested_tensor(rows())  # strided layout
    out["strided_support"] = _outcome(scored(strided))

    r3 = ve.build_engine(model_dir, router_replay_mode="R3", micro_batch_size=len(PROMPTS))

    def routed(routes):
        b = ve.make_batch(PROMPTS, roll["responses"], pad_id=0, routed_experts=routes)
        return lambda: ve.infer(r3, b)["log_probs"][2].tolist()

    out["routes_all_zero"] = _outcome(routed([torch.zeros_like(r) for r in roll["routes"]]))
    one = [r.clone() for r in roll["routes"]]
    one[1].zero_()
    out["routes_one_sequence_zero"] = _outcome(routed(one))
    dense = ve.make_batch(PROMPTS, roll["responses"], pad_id=0, routed_experts=roll["routes"])
    grid = torch.nested.to_padded_tensor(dense["routed_experts"], 0)
    dense["routed_experts"] = torch.cat([grid, grid], dim=1)  # [B, 2 S, L, K]: not the attention mask's S
    out["dense_routes_wrong_length"] = _outcome(lambda: ve.infer(r3, dense)["log_probs"][2].tolist())
    out["routes_replayed"] = _outcome(routed(roll["routes"]))
    return out


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("verl_engine") / "model")


def _one(scenario, env=None, **kwargs):
    (value,) = fsdp_harness.run_ranks(scenario, 1, env=env, timeout=600, **kwargs)
    return value


def test_verl_fsdp_engine_scores_over_the_rollouts_support(model_dir):
    """Stock verl scores the top-k rollout over the full vocabulary (the importance ratio against
    the sampler's logprobs is the support's mass, well below 1); with the plugin the engine's own
    compute_log_prob path gives ratio 1 within 1e-5 (remove-padding and padded branches,
    temperature 0.7), verl's entropy is unchanged, and a PPO step on the rollout's logprobs as old
    logprobs sees no policy change (ppo_kl ~ 0) and a finite loss."""
    need("verl")
    stock = _one(support_scenario, OFF_SUPPORT, model_dir=model_dir, temperature=0.7, remove_padding=True)
    plugin = _one(support_scenario, model_dir=model_dir, temperature=0.7, remove_padding=True)
    padded = _one(support_scenario, model_dir=model_dir, temperature=0.7, remove_padding=False)
    print(
        f"verl FSDP engine, top-{TOP_K} rollout at T=0.7: stock ratio mean {stock['ratio_mean']:.4f} "
        f"(max |r-1| {stock['ratio_max_dev']:.3f}, HF full-vocabulary {stock['full_ratio_mean']:.4f}), ppo_kl "
        f"{stock['ppo_kl']}; plugin mean {plugin['ratio_mean']:.6f} max |r-1| {plugin['ratio_max_dev']:.2e} "
        f"(padded {padded['ratio_max_dev']:.2e}), ppo_kl {plugin['ppo_kl']}, loss {plugin['loss']}"
    )
    assert abs(stock["ratio_mean"] - stock["full_ratio_mean"]) < 1e-4  # stock is the full vocabulary
    assert stock["ratio_mean"] < 0.95 and stock["ratio_max_dev"] > 0.05
    assert plugin["ratio_max_dev"] < 1e-5 and padded["ratio_max_dev"] < 1e-5
    assert plugin["entropy"] == pytest.approx(stock["entropy"], abs=1e-6)  # verl's, over the vocabulary
    assert abs(plugin["ppo_kl"]) < 1e-5 < abs(stock["ppo_kl"])
    assert plugin["loss"] == plugin["loss"] and abs(plugin["loss"]) < 1e3  # finite


def test_verl_fsdp_engine_refuses_rows_it_cannot_replay(model_dir):
    """A support row without its sampled token is refused naming the field, the trajectory and
    the token; unsigned rows (a -1 pad reads as 255) too; router_replay R2 on FSDP and R3 with a
    batch without routed_experts name the setting and the fix. Stock verl returns numbers."""
    need("verl")
    out = _one(refusal_scenario, model_dir=model_dir)
    print(out)
    assert out["missing"] and "rollout_sample_support" in out["missing"] and "trajectory 2, token 3" in out["missing"]
    assert out["unsigned"] and "signed" in out["unsigned"], out
    assert out["R2"] and "R3" in out["R2"], out
    assert out["R3"] and "enable_rollout_routing_replay" in out["R3"], out
    stock = _one(refusal_scenario, {**OFF_SUPPORT, **OFF_ROUTES}, model_dir=model_dir)
    assert stock == {"missing": None, "unsigned": None, "R2": None, "R3": None}, stock


def test_verl_fsdp_engine_replays_the_rollouts_routes(model_dir):
    """verl's own router_replay.mode=R3 on its FSDP engine is accepted and ignored by stock verl: a
    bfloat16 trainer routes some tokens elsewhere than the float32 rollout. With the plugin every
    token but each sequence's last goes to the rollout's experts, also in a PPO step with gradient
    checkpointing (the recompute in backward replays too), and nothing stays bound afterwards."""
    need("verl")
    stock = _one(routes_scenario, OFF_ROUTES, model_dir=model_dir, mode="R3", gradient_checkpointing=False)
    unset = _one(routes_scenario, model_dir=model_dir, mode=None, gradient_checkpointing=False)
    plugin = _one(routes_scenario, model_dir=model_dir, mode="R3", gradient_checkpointing=True)
    print(
        f"verl FSDP engine, bf16 trainer route agreement: stock (R3 set) {100 * stock['agreement']:.1f}%, "
        f"plugin without R3 {100 * unset['agreement']:.1f}%, plugin with R3 {100 * plugin['agreement']:.1f}% "
        f"(PPO step with gradient checkpointing: loss {plugin['loss']}, grad norm {plugin['grad_norm']:.3f})"
    )
    assert stock["agreement"] < 1.0 and unset["agreement"] < 1.0
    assert plugin["agreement"] == 1.0
    assert plugin["bound_after"] == []
    assert plugin["grad_norm"] == plugin["grad_norm"] and plugin["grad_norm"] > 0


def test_other_engines_reusing_the_methods():
    """VeOmni's engine reuses forward_step and has its own R3: the route patch leaves it alone. An
    engine of another module (FSDP-Turbo, with its own parallel state) asking for R3 or support
    replay is refused by name rather than laid out as the FSDP engine's data."""
    need("verl")
    import torch
    from tensordict import TensorDict

    from replay_plugin.core.errors import NotReplayable
    from replay_plugin.verl import fsdp_engine

    def engine(module: str):
        cls = type("Engine", (), {"__module__": module})
        e = cls()
        e.engine_config = type("Cfg", (), {"router_replay": {"mode": "R3"}})()  # Hydra's plain mapping
        return e

    batch = TensorDict({"routed_experts": torch.zeros(2, 3, 1, 2, dtype=torch.int16)}, batch_size=[2])
    assert fsdp_engine.replay_mode(engine("x")) == "R3"
    assert fsdp_engine._wants_routes(engine("verl.workers.engine.veomni.transformer_impl"), batch) is False
    turbo = engine("verl.workers.engine.fsdp.fsdp_turbo_impl")
    assert fsdp_engine._wants_routes(turbo, batch) is True
    with pytest.raises(NotReplayable, match="FSDP engine .*fsdp_turbo_impl"):
        fsdp_engine.route_scope(turbo, batch)
    with pytest.raises(NotReplayable, match="sample-support replay is implemented for verl's FSDP engine"):
        fsdp_engine._check_engine(turbo, "sample-support replay")


def test_jagged_routes_must_line_up_with_each_sequence():
    """Jagged ``routed_experts`` whose total matches the tokens but whose sequences do not (rows
    shifted from one trajectory to the next) are refused naming the trajectory, not replayed
    shifted."""
    need("verl")
    import torch
    from tensordict import TensorDict

    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.verl import engine_batch

    ids = torch.nested.nested_tensor_from_jagged(torch.arange(7), offsets=torch.tensor([0, 3, 7]))
    _, _, indices, lengths = engine_batch.batch_grid(ids)
    good = torch.nested.nested_tensor_from_jagged(torch.zeros(7, 2, 2), offsets=torch.tensor([0, 3, 7]))
    shifted = torch.nested.nested_tensor_from_jagged(torch.zeros(7, 2, 2), offsets=torch.tensor([0, 4, 7]))
    rows = engine_batch.per_token_rows(TensorDict({"r": good}, batch_size=[2]), "r", indices, lengths)
    assert tuple(rows.shape) == (7, 2, 2)
    with pytest.raises(ReplayDataError, match="trajectory 0: 4 rows for a sequence of 3 tokens"):
        engine_batch.per_token_rows(TensorDict({"r": shifted}, batch_size=[2]), "r", indices, lengths)


def test_rows_in_layouts_the_engines_cannot_read():
    """Issue 41 F8, the micro-batch readers both engines share: support rows as a strided nested
    tensor (an untyped RuntimeError of torch before) and dense routes ``[B, S', L, K]`` whose S' is
    not the attention mask's (an IndexError) are refused naming the field and the expected layout;
    jagged rows and dense routes of the mask's shape are read."""
    need("verl")
    import torch
    from tensordict import TensorDict

    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.verl import engine_batch

    ids = torch.nested.nested_tensor_from_jagged(torch.arange(1, 8), offsets=torch.tensor([0, 3, 7]))
    _, mask, indices, lengths = engine_batch.batch_grid(ids)
    rows = [torch.tensor([[4, 5, -1]], dtype=torch.int32), torch.tensor([[6, 7, -1], [7, -1, -1]], dtype=torch.int32)]

    def micro_batch(support):
        responses = torch.nested.nested_tensor_from_jagged(torch.tensor([3, 6, 7]), offsets=torch.tensor([0, 1, 3]))
        loss = torch.nested.nested_tensor_from_jagged(torch.ones(3, dtype=torch.long), offsets=torch.tensor([0, 1, 3]))
        return TensorDict(
            {"input_ids": ids, "responses": responses, "loss_mask": loss, "rollout_sample_support": support},
            batch_size=[2],
        )

    jagged = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    _, support, _ = engine_batch.response_support(micro_batch(jagged), lengths)
    assert support.tolist() == [[[4, 5, -1], [-1, -1, -1]], [[6, 7, -1], [7, -1, -1]]]
    with pytest.raises(ReplayDataError, match="strided.*expected the jagged layout") as info:
        engine_batch.response_support(micro_batch(torch.nested.nested_tensor(rows)), lengths)
    assert info.value.field == "rollout_sample_support"

    attention = mask.long()  # [2, 4]
    good = TensorDict({"r": torch.zeros(2, 4, 2, 2), "attention_mask": attention}, batch_size=[2])
    assert tuple(engine_batch.per_token_rows(good, "r", indices, lengths).shape) == (7, 2, 2)
    longer = TensorDict({"r": torch.zeros(2, 9, 2, 2), "attention_mask": attention}, batch_size=[2])
    with pytest.raises(ReplayDataError, match=r"dense shape \(2, 9, 2, 2\).*\[2, 4, \.\.\.\]") as info:
        engine_batch.per_token_rows(longer, "r", indices, lengths)
    assert info.value.field == "r"


def test_partly_captured_routes_are_counted(caplog):
    """Issue 41 F7: an R3 micro-batch is checked for captured routes where they matter, the
    positions that score loss-bearing tokens: ``engine_batch.check_captured`` (one rule with the
    Megatron engine) returns (replayed, scoring), logs
    them, and warns once per process when some have no captured route (routed by the model);
    a sequence with none is refused (the engine test covers that through verl)."""
    need("verl")
    import logging

    import torch
    from tensordict import TensorDict

    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.verl import engine_batch, fsdp_engine

    ids = torch.nested.nested_tensor_from_jagged(torch.arange(1, 10), offsets=torch.tensor([0, 4, 9]))
    _, mask, _, lengths = engine_batch.batch_grid(ids)  # [2, 5]
    responses = torch.nested.nested_tensor_from_jagged(torch.arange(5), offsets=torch.tensor([0, 2, 5]))
    loss = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 1, 0, 1, 1]), offsets=torch.tensor([0, 2, 5]))
    micro_batch = TensorDict({"input_ids": ids, "responses": responses, "loss_mask": loss}, batch_size=[2])
    # scoring positions (the one before each loss-bearing token): row 0 columns 1, 2 (response tokens
    # at columns 2, 3); row 1 columns 2, 3 (response tokens at columns 2, 3, 4; the first one masked)
    no_route = ~mask
    no_route[1, 3] = True  # one of row 1's scoring positions not captured
    engine_batch._WARNED_PARTIAL.discard("verl.fsdp_routes")

    def check():
        return engine_batch.check_captured(
            micro_batch, no_route, mask, lengths, patch="verl.fsdp_routes", fate=fsdp_engine.UNCAPTURED_FATE
        )

    with caplog.at_level(logging.DEBUG, logger="replay_plugin"):
        assert check() == (3, 4)
        assert check() == (3, 4)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "replay_plugin"]
    assert len(warnings) == 1 and "1 of 4 positions scoring loss-bearing tokens have no captured route" in (
        warnings[0].getMessage()
    )
    no_route[1, 2] = True  # row 1: none left
    with pytest.raises(ReplayDataError, match="none of the 2 positions") as info:
        check()
    assert (info.value.field, info.value.trajectory) == ("routed_experts", 1)


def test_replay_no_patch_serves_is_refused(model_dir):
    """verl.engine_replay_guard: with the FSDP support patch switched off, verl's engine would
    score the batch's rows over the full vocabulary, silently: refused naming the variable. An
    engine class the plugin does not make score over rows (FSDP-Turbo) is refused naming it; a
    value head (the critic) passes. With the route patch switched off, verl accepts
    router_replay.mode=R3 on its FSDP engine and the bfloat16 routers route for themselves (the
    guard off: some tokens on other experts than the rollout's); the guard refuses it, naming the
    variable; with the patch on every token (the sequences' last excepted: no route) is replayed."""
    need("verl")
    routes_off = {"REPLAY_PLUGIN_VERL_FSDP_ROUTES": "0"}
    out = _one(guard_scenario, {"REPLAY_PLUGIN_VERL_FSDP_SUPPORT_LOGPROBS": "0", **routes_off}, model_dir=model_dir)
    stock = _one(guard_scenario, OFF_ROUTES, model_dir=model_dir)
    plugin = _one(guard_scenario, model_dir=model_dir)
    print(f"guard: {out}; R3 route agreement stock {stock['r3']}, plugin {plugin['r3']}")
    assert out["infer"] and out["infer"].startswith("REPLAY_PLUGIN_VERL_FSDP_SUPPORT_LOGPROBS:"), out
    assert "is disabled" in out["infer"], out
    assert out["FSDPTurboEngineWithLMHead"] and "strategy fsdp / fsdp2" in out["FSDPTurboEngineWithLMHead"], out
    assert out["FSDPEngineWithValueHead"] is None
    assert isinstance(out["r3"], str) and out["r3"].startswith("REPLAY_PLUGIN_VERL_FSDP_ROUTES:"), out
    assert "router_replay.mode=R3" in out["r3"] and "is disabled" in out["r3"], out
    assert isinstance(stock["r3"], float) and stock["r3"] < plugin["r3"], (stock, plugin)
    assert plugin["infer"] is None
    n_tokens = sum(len(p) + RESPONSE for p in PROMPTS)
    assert plugin["r3"] == pytest.approx((n_tokens - len(PROMPTS)) / n_tokens), plugin


def test_verl_fsdp_engine_with_ulysses_sequence_parallelism(model_dir):
    """Ulysses SP=2 on verl's FSDP engine (two gloo ranks; verl's own all-to-all attention, served
    on CPU by the harness's flash-attention shim), one sequence across the two ranks and verl's SP
    pad: stock, the ratio is the support's mass as at SP=1; with the plugin 1 within 1e-5 and the
    log-probs those of SP=1; the bfloat16 trainer routes some tokens elsewhere than the rollout
    stock, none with R3 (infer and the PPO step's checkpoint recompute). With sdpa verl does not
    split attention over the ranks (wrong log-probs, silently): replay is refused, naming the
    setting."""
    need("verl")
    sp2 = dict(model_dir=model_dir, temperature=0.7, remove_padding=True, micro_batch_size=4, trim=True)
    sp1 = _one(support_scenario, **sp2)
    plugin = fsdp_harness.run_ranks(support_scenario, 2, timeout=600, sp=2, **sp2)
    stock = fsdp_harness.run_ranks(support_scenario, 2, env=OFF_SUPPORT, timeout=600, sp=2, **sp2)
    sdpa = fsdp_harness.run_ranks(support_scenario, 2, timeout=600, sp=2, attn="sdpa", **sp2)
    routes = dict(model_dir=model_dir, mode="R3", gradient_checkpointing=True, sp=2, trim=True)
    r_stock = fsdp_harness.run_ranks(routes_scenario, 2, env=OFF_ROUTES, timeout=600, **routes)
    r_plugin = fsdp_harness.run_ranks(routes_scenario, 2, timeout=600, **routes)
    diff = max(abs(a - b) for a, b in zip(plugin[0]["log_probs"], sp1["log_probs"], strict=True))
    print(
        f"verl FSDP engine, Ulysses SP=2: stock ratio mean {stock[0]['ratio_mean']:.4f} (SP=1 stock is the "
        f"support's mass, {sp1['full_ratio_mean']:.4f}); plugin max |r-1| {plugin[0]['ratio_max_dev']:.2e}, "
        f"max |lp(SP=2) - lp(SP=1)| {diff:.2e}, grad norm {plugin[0]['grad_norm']} (SP=1 {sp1['grad_norm']}); "
        f"bf16 routes stock {[round(100 * r['agreement'], 1) for r in r_stock]}%, R3 "
        f"{[round(100 * r['agreement'], 1) for r in r_plugin]}% (step {[r['step_agreement'] for r in r_plugin]})"
    )
    assert abs(stock[0]["ratio_mean"] - sp1["full_ratio_mean"]) < 1e-4 and stock[0]["ratio_max_dev"] > 0.05
    for rank in plugin:
        assert rank["ratio_max_dev"] < 1e-5 and rank["log_probs"] == pytest.approx(sp1["log_probs"], abs=1e-5)
    assert plugin[0]["grad_norm"] == pytest.approx(sp1["grad_norm"], rel=1e-4)
    assert all(r["refused"].startswith("attn_implementation:") for r in sdpa), sdpa
    assert min(r["agreement"] for r in r_stock) < 1.0
    assert all(r["agreement"] == 1.0 and r["step_agreement"] == 1.0 and r["bound_after"] == [] for r in r_plugin)


def test_verl_fsdp_engine_refuses_hostile_batches(model_dir):
    """Issue 41 (F3, F6, F7, F8), verl's FSDP engine with the plugin, each case a silent wrong number
    or an untyped crash before:

    - a loss-bearing token whose support row is all -1: verl has no synthetic EOS, yet one such
      token per sequence was scored over the full vocabulary (here far from the rollout's logprob);
      refused naming the field, the micro-batch row, its uid and the response token; two in one
      sample name the first response token (not grid columns);
    - an int64 support id of 2**32 + 5: refused before any narrowing, naming the id;
    - a per-sample temperature tensor with a negative entry (the logits of that sample were
      inverted): refused naming the sample;
    - rows as a strided nested tensor (an untyped RuntimeError) and dense routes longer than the
      attention mask (an IndexError): typed, naming the field and the expected layout;
    - router_replay.mode=R3 with routes that are all zero (nothing captured: R3 was a no-op):
      refused naming the sequence and the setting that captures routes; captured routes replay."""
    need("verl")
    out = _one(hostile_scenario, model_dir=model_dir)
    print(out)
    # what a silent score of the first case gives: the full-vocabulary logprob, not the rollout's
    assert abs(out["full_vocab_lp"] - out["rollout_lp"]) > 0.5, out
    for case in ("one_unsupported", "two_unsupported"):
        got = out[case]
        assert got.get("error") == "ReplayDataError", (case, got)
        assert (got["field"], got["trajectory"], got["token"]) == ("rollout_sample_support", 2, 3), (case, got)
        assert "uid uid-2" in got["text"] and "response token 3" in got["text"], (case, got)
        assert "[7, 8]" not in got["text"], got
    wide = out["wide_id"]
    assert wide.get("error") == "ReplayDataError" and (wide["trajectory"], wide["token"]) == (2, 3), wide
    assert str(2**32 + 5) in wide["text"] and wide["field"] == "rollout_sample_support", wide
    temp = out["negative_temperature"]
    assert temp.get("error") == "ReplayDataError" and temp["field"] == "temperature", temp
    assert temp["trajectory"] == 2 and "-1.0" in temp["text"] and "uid uid-2" in temp["text"], temp
    strided = out["strided_support"]
    assert strided.get("error") == "ReplayDataError" and strided["field"] == "rollout_sample_support", strided
    assert "strided" in strided["text"] and "jagged" in strided["text"], strided
    dense = out["dense_routes_wrong_length"]
    assert dense.get("error") == "ReplayDataError" and dense["field"] == "routed_experts", dense
    assert "attention_mask" in dense["text"], dense
    for case, row in (("routes_all_zero", 0), ("routes_one_sequence_zero", 1)):
        got = out[case]
        assert got.get("error") == "ReplayDataError" and got["field"] == "routed_experts", (case, got)
        assert got["trajectory"] == row and f"uid uid-{row}" in got["text"], (case, got)
        assert "enable_rollout_routing_replay" in got["text"], (case, got)
    assert "scored" in out["routes_replayed"], out["routes_replayed"]
