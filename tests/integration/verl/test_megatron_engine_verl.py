"""verl 0.9.1's own Megatron engine (``MegatronEngineWithLMHead``, megatron-core 0.16.1 on gloo, CPU)
with the plugin's ``verl.megatron_support_logprobs`` (issue 31 item 3, the Megatron part), and verl's
own routed-expert replay (``router_replay.mode: R3``, verl's ``RouterReplay``) beside it.

The model is built by the harness (``verl_megatron``: verl's bridges need Transformer Engine), the
rollout is a top-k sampler over the same float32 weights (each response token's support row is the
set the sampler could draw, its logprob the sampler's); the batch goes through verl's own
``DataProto.to_tensordict`` and ``left_right_2_no_padding``, then the engine's ``infer_batch`` (the
``compute_log_prob`` path, THD packed and BSHD padded layouts, TP 1 and 2) and ``train_batch`` with
``ppo_loss`` and Megatron's own DDP and Adam. Every scenario runs in fresh interpreters (the installed
wheel active); the patch is switched off by its environment variable to show stock verl.
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
WIDTH = 6  # rows W = top_k + 2, -1 padded
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18]]
RESPONSE = 8
OFF = {
    "REPLAY_PLUGIN_VERL_MEGATRON_SUPPORT_LOGPROBS": "0",
    "REPLAY_PLUGIN_VERL_ENGINE_REPLAY_GUARD": "0",
}  # stock verl
SUPPORT_PATCH_OFF = {"REPLAY_PLUGIN_VERL_MEGATRON_SUPPORT_LOGPROBS": "0"}  # the guard on


# --------------------------------------------------------------------------- inside a rank


def _vm():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import verl_megatron

    return verl_megatron


def _batch(ve, roll, temperature: float, support=None, **fields):
    import torch

    rows = roll["support"] if support is None else support
    return ve.make_batch(
        PROMPTS, roll["responses"], pad_id=0, temperature=temperature, response_fields=("rollout_sample_support",),
        rollout_sample_support=[torch.as_tensor(r, dtype=torch.int32) for r in rows], **fields,
    )  # fmt: skip


def _ratios(ve, engine, batch, roll, temperature: float | None, **kw) -> dict:
    import torch

    got = ve.infer(engine, batch, temperature, **kw)
    lp = got["log_probs"]
    rollout = torch.zeros_like(lp)
    for i, row in enumerate(roll["logprobs"]):
        rollout[i, : len(row)] = torch.tensor(row)
    mask = batch["response_mask"].bool()
    ratio = torch.exp(lp - rollout)[mask]
    return {
        "ratio_mean": float(ratio.mean()),
        "ratio_max_dev": float((ratio - 1).abs().max()),
        "entropy": got["entropy"][mask].tolist(),
    }


def support_scenario(rank: int, world: int, model_dir: str, temperature: float, tp: int = 1) -> dict:
    """The engine's response logprobs against the sampler's, in the THD (remove-padding) and BSHD
    layouts; the full-vocabulary reference; one PPO step (Megatron's DDP and Adam) with the rollout's
    logprobs as old logprobs."""
    import torch

    vm = _vm()
    ve = vm.setup(rank, world, tp=tp)
    vm.save_model_dir(model_dir)
    sampler = vm.build_model("float32", sequence_parallel=False)
    roll = vm.rollout(sampler, PROMPTS, RESPONSE, TOP_K, WIDTH, temperature, seed=11)
    batch = _batch(ve, roll, temperature)
    full = vm.response_logprobs(sampler, PROMPTS, roll["responses"], temperature)
    model = vm.build_model("float32")  # the same weights (sequence parallel with TP, as verl)
    full_ratio = torch.cat([torch.exp(f - torch.tensor(r)) for f, r in zip(full, roll["logprobs"], strict=True)])
    out = {"full_ratio_mean": float(full_ratio.mean())}
    for layout, rmpad in (("thd", True), ("bshd", False)):
        engine = vm.build_engine(model, model_dir, use_remove_padding=rmpad, micro_batch_size=2)
        out[layout] = _ratios(ve, engine, batch, roll, temperature)
    # per-sample temperatures (a [B] tensor in the batch): each prompt sampled at its own T
    temps = [0.7, 1.0, 0.5, 1.3]
    rolls = [vm.rollout(sampler, PROMPTS, RESPONSE, TOP_K, WIDTH, t, seed=13) for t in temps]
    mixed = {key: [rolls[i][key][i] for i in range(len(PROMPTS))] for key in rolls[0]}
    per_sample = _batch(ve, mixed, 1.0)
    per_sample["temperature"] = torch.tensor(temps, dtype=torch.float32)
    engine = vm.build_engine(model, model_dir, micro_batch_size=2)
    out["per_sample"] = _ratios(ve, engine, per_sample, mixed, None)
    trainer = vm.build_model("float32")
    engine = vm.build_engine(trainer, model_dir, micro_batch_size=2, optimizer=True)
    step = ve.train_step(engine, batch, old_log_probs=roll["logprobs"], temperature=temperature)
    out["loss"], out["grad_norm"] = step["loss"], step["grad_norm"]
    out["ppo_kl"] = step["metrics"].get("actor/ppo_kl")
    return out


def routes_scenario(rank: int, world: int, model_dir: str) -> dict:
    """A bfloat16 engine scoring the float32 rollout, with the rollout's rows: the share of the
    tokens (all but each sequence's last, which verl's R3 mask leaves native) whose experts, in
    every MoE layer, are the rollout's, without and with verl's own R3, and the ratio; then a
    float32 PPO step with both replays."""
    import torch

    vm = _vm()
    ve = vm.setup(rank, world)
    vm.save_model_dir(model_dir)
    rollout_model = vm.build_model("float32", r3=True)
    roll = vm.rollout(rollout_model, PROMPTS, RESPONSE, TOP_K, WIDTH, 1.0, seed=7)
    batch = _batch(ve, roll, 1.0, routed_experts=roll["routes"])
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, roll["responses"], strict=True)]
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[torch.tensor(lengths).cumsum(0) - 1] = False
    want = torch.cat(roll["routes"]).long()
    trainer = vm.build_model("bfloat16", r3=True)
    trainer.load_state_dict(rollout_model.state_dict())
    out = {}
    for mode in ("disabled", "R3"):
        engine = vm.build_engine(trainer, model_dir, router_replay_mode=mode, micro_batch_size=len(PROMPTS))
        spy = vm.route_spy(trainer)
        try:
            out[mode] = _ratios(ve, engine, batch, roll, 1.0, enable_routing_replay=mode == "R3")
            got = spy.routes(sum(lengths))  # THD, TP 1: the packed rows in sequence order
        finally:
            spy.close()
        out[mode]["agreement"] = float((got == want).all(-1).all(-1)[keep].float().mean())
    engine = vm.build_engine(rollout_model, model_dir, router_replay_mode="R3", micro_batch_size=2, optimizer=True)
    step = ve.train_step(engine, batch, old_log_probs=roll["logprobs"], enable_routing_replay=True)
    out["loss"], out["ppo_kl"] = step["loss"], step["metrics"].get("actor/ppo_kl")
    return out


def refusal_scenario(rank: int, world: int, model_dir: str) -> dict:
    """A row without its sampled token, unsigned rows, fused kernels, and a verl whose forward
    step would not score through the patched forward function."""
    import torch
    from verl.utils import tensordict_utils as tu

    from replay_plugin.core.errors import NotReplayable, ReplayDataError

    vm = _vm()
    ve = vm.setup(rank, world)
    vm.save_model_dir(model_dir)
    model = vm.build_model("float32")
    roll = vm.rollout(model, PROMPTS, RESPONSE, TOP_K, WIDTH, 1.0, seed=5)
    engine = vm.build_engine(model, model_dir, micro_batch_size=2)
    out = {}

    def attempt(name, batch, errors=(ReplayDataError, NotReplayable), **kw):
        try:
            ve.infer(engine, batch, **kw)
            out[name] = None
        except errors as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    bad = [list(map(list, rows)) for rows in roll["support"]]
    token = roll["responses"][2][3]
    bad[2][3] = [i for i in range(TOP_K + 1) if i != token][:TOP_K] + [-1] * (WIDTH - TOP_K)
    attempt("missing", _batch(ve, roll, 1.0, support=bad))
    unsigned = ve.make_batch(
        PROMPTS, roll["responses"], pad_id=0, response_fields=("rollout_sample_support",),
        rollout_sample_support=[torch.tensor(r).to(torch.uint8) for r in roll["support"]],
    )  # fmt: skip
    attempt("unsigned", unsigned, errors=(ReplayDataError, TypeError))
    fused = _batch(ve, roll, 1.0)
    tu.assign_non_tensor(fused, use_fused_kernels=True)
    engine = vm.build_engine(model, model_dir, micro_batch_size=2, use_fused_kernels=True)
    attempt("fused", fused, errors=(Exception,))
    engine = vm.build_engine(model, model_dir, micro_batch_size=2)
    # a verl whose forward_step reached its forward function some other way: the rows would go
    # unused, and the patch says so instead of returning full-vocabulary numbers
    from verl.models.mcore import registry

    patched = registry.gptmodel_forward_model_engine
    registry.gptmodel_forward_model_engine = getattr(patched, "__wrapped__", patched)
    try:
        attempt("bypassed", _batch(ve, roll, 1.0))
    finally:
        registry.gptmodel_forward_model_engine = patched
    return out


def guard_scenario(rank: int, world: int, model_dir: str) -> dict:
    """The engine's compute_log_prob on a batch with rows: refused or scored."""
    from replay_plugin.core.errors import NotReplayable

    vm = _vm()
    ve = vm.setup(rank, world)
    vm.save_model_dir(model_dir)
    model = vm.build_model("float32")
    roll = vm.rollout(model, PROMPTS, RESPONSE, TOP_K, WIDTH, 1.0, seed=5)
    engine = vm.build_engine(model, model_dir, micro_batch_size=2)
    try:
        ve.infer(engine, _batch(ve, roll, 1.0))
        return {"refused": None}
    except NotReplayable as exc:
        return {"refused": str(exc), "setting": exc.setting}


def r3_layout_scenario(rank: int, world: int, model_dir: str, micro_batch_size: int) -> dict:
    """verl's R3 in the padded (BSHD) layout, sequences of one length: the share of tokens (all but
    each sequence's last) on the rollout's experts, read in the routers' sequence-major order."""
    from replay_plugin.core.errors import NotReplayable

    vm = _vm()
    ve = vm.setup(rank, world)
    vm.save_model_dir(model_dir)
    model = vm.build_model("float32", r3=True)
    prompts = [p[:2] for p in PROMPTS]  # one length: verl does not fail on a shape mismatch first
    roll = vm.rollout(model, prompts, RESPONSE, TOP_K, WIDTH, 1.0, seed=7)
    batch = ve.make_batch(prompts, roll["responses"], pad_id=0, routed_experts=roll["routes"])
    engine = vm.build_engine(
        model, model_dir, router_replay_mode="R3", use_remove_padding=False, micro_batch_size=micro_batch_size
    )
    spy = vm.route_spy(model)
    try:
        ve.infer(engine, batch, enable_routing_replay=True)
    except NotReplayable as exc:
        return {"refused": str(exc), "setting": exc.setting}
    finally:
        spy.close()
    seq = len(prompts[0]) + RESPONSE
    same = []
    for layer, routing_map in sorted(spy.maps.items()):  # the last micro-batch's [S * b, E]
        b = routing_map.shape[0] // seq
        got = routing_map.float().topk(vm.TOPK_EXPERTS, -1).indices.sort(-1).values.view(seq, b, -1)
        first = len(prompts) - b
        for i in range(b):
            want = roll["routes"][first + i][:, layer - 1].long()
            same += (got[: seq - 1, i] == want[: seq - 1]).all(-1).tolist()
    return {"refused": None, "agreement": sum(same) / len(same)}


def hostile_scenario(rank: int, world: int, model_dir: str) -> dict:
    """Batches no stock verl 0.9.1 pipeline makes, through the engine's compute_log_prob path
    (issue 41: F3, F6, F7, F8), each as the log-probs of sample 2 or the error (type, text,
    located fields): a loss-bearing token whose support row is all -1, an int64 id of 2**32 + 5
    (an int32 narrowing reads it as token 5; that token's row here is top-k with a member replaced
    by 2**32 + 5 and 5 not in it otherwise), a per-sample temperature tensor with a negative entry,
    and the rows as a strided nested tensor; also the full-vocabulary logprob of the blanked token
    and the supported logprob of the token with the wide id when 5 is a member instead."""
    import torch

    from replay_plugin.core.errors import NotReplayable, ReplayDataError, ReplayTypeError

    vm = _vm()
    ve = vm.setup(rank, world)
    vm.save_model_dir(model_dir)
    model = vm.build_model("float32")
    roll = vm.rollout(model, PROMPTS, RESPONSE, TOP_K, WIDTH, 1.0, seed=5)
    engine = vm.build_engine(model, model_dir, micro_batch_size=4)

    def outcome(batch, **kw) -> dict:
        try:
            return {"scored": ve.infer(engine, batch, **kw)["log_probs"][2].tolist()}
        except (ReplayDataError, ReplayTypeError) as exc:
            return {"error": type(exc).__name__, "text": str(exc), "field": exc.field,
                    "trajectory": exc.trajectory, "token": exc.token}  # fmt: skip
        except NotReplayable as exc:
            return {"error": "NotReplayable", "text": str(exc), "field": exc.setting}
        except Exception as exc:  # noqa: BLE001 - an untyped crash is what the test looks for
            import traceback

            return {"error": type(exc).__name__, "text": traceback.format_exc(), "untyped": True}

    def rows(edit=None, dtype=torch.int32):
        bad = [list(map(list, r)) for r in roll["support"]]
        if edit:
            edit(bad)
        return [torch.tensor(r, dtype=dtype) for r in bad]

    def batch(support):
        return ve.make_batch(
            PROMPTS, roll["responses"], pad_id=0, response_fields=("rollout_sample_support",),
            rollout_sample_support=support,
        )  # fmt: skip

    def blank(bad):
        bad[2][3] = [-1] * WIDTH

    token = roll["responses"][2][3]
    member = next(i for i, t in enumerate(roll["support"][2][3]) if t not in (token, -1, 5))

    def wide(bad):
        bad[2][3][member] = 2**32 + 5

    def five(bad):
        bad[2][3][member] = 5

    full = vm.response_logprobs(model, PROMPTS, roll["responses"], 1.0)
    out = {
        "full_vocab_lp": float(full[2][3]),
        "rollout_lp": roll["logprobs"][2][3],
        "five_in_row": 5 in roll["support"][2][3],
    }
    out["one_unsupported"] = outcome(batch(rows(blank)))
    out["wide_id"] = outcome(batch(rows(wide, torch.int64)))
    out["five_instead"] = outcome(batch(rows(five)))
    negative = batch(rows())
    negative["temperature"] = torch.tensor([1.0, 1.0, -1.0, 1.0])
    out["negative_temperature"] = outcome(negative, temperature=None)
    strided = batch(rows())
    strided["rollout_sample_support"] = torch.nested.nested_tensor(rows())  # strided layout
    out["strided_support"] = outcome(strided)
    return out


def zero_routes_scenario(rank: int, world: int, model_dir: str) -> dict:
    """verl's own R3 (``router_replay.mode=R3``) on a bfloat16 engine over the float32 rollout's
    batch, through ``compute_log_prob``, with the rollout's routes, with routes that are all zero for
    the whole batch (the rollout returned none: verl's agent loop fills zeros) and for sample 2
    only, and without R3: per case, each sample's share of replayed tokens (all but each sequence's
    last) on the rollout's experts in every layer, the share routed to expert 0 alone, the largest
    change of each sample's response log-probs against the captured routes' replay and expert 0's
    gate weight of the first token; or the error."""
    import torch

    from replay_plugin.core.errors import NotReplayable, ReplayDataError

    vm = _vm()
    ve = vm.setup(rank, world)
    vm.save_model_dir(model_dir)
    rollout_model = vm.build_model("float32", r3=True)
    roll = vm.rollout(rollout_model, PROMPTS, RESPONSE, TOP_K, WIDTH, 1.0, seed=7)
    lengths = torch.tensor([len(p) + len(r) for p, r in zip(PROMPTS, roll["responses"], strict=True)])
    total = int(lengths.sum())
    replayed = torch.ones(total, dtype=torch.bool)
    replayed[lengths.cumsum(0) - 1] = False  # verl's R3 mask leaves each sequence's last token native
    sample = torch.repeat_interleave(torch.arange(len(PROMPTS)), lengths)
    want = torch.cat(roll["routes"]).long()
    trainer = vm.build_model("bfloat16", r3=True)
    trainer.load_state_dict(rollout_model.state_dict())
    zero = [torch.zeros_like(r) for r in roll["routes"]]
    cases = {
        "captured": ("R3", roll["routes"]),
        "no_r3": ("disabled", roll["routes"]),
        "zero_batch": ("R3", zero),
        "zero_sample_2": ("R3", [zero[i] if i == 2 else r for i, r in enumerate(roll["routes"])]),
    }
    out: dict = {}
    log_probs = {}
    gates: list = []  # each router's gate weights [tokens, experts], in call order

    def gate_hook(module, args, output):
        gates.append(output[0].detach().float())

    routers = [m for _, m in trainer.named_modules() if hasattr(m, "router_replay") and hasattr(m, "routing")]
    for name, (mode, routes) in cases.items():
        batch = ve.make_batch(PROMPTS, roll["responses"], pad_id=0, routed_experts=routes)
        engine = vm.build_engine(trainer, model_dir, router_replay_mode=mode, micro_batch_size=len(PROMPTS))
        spy = vm.route_spy(trainer)
        gates.clear()
        hooks = [m.register_forward_hook(gate_hook) for m in routers]
        try:
            log_probs[name] = ve.infer(engine, batch, 1.0, enable_routing_replay=mode == "R3")["log_probs"]
        except (ReplayDataError, NotReplayable) as exc:
            out[name] = {"error": type(exc).__name__, "text": str(exc), "field": getattr(exc, "field", None),
                         "trajectory": getattr(exc, "trajectory", None)}  # fmt: skip
            continue
        finally:
            spy.close()
            for h in hooks:
                h.remove()
        # THD, TP 1, one micro-batch: the routers' rows are the packed tokens in sequence order
        maps = torch.stack([m[:total] for _, m in sorted(spy.maps.items())], 1)  # [T, layers, E]
        agree = (spy.routes(total) == want).all(-1).all(-1)
        expert0 = (maps.sum(-1) == 1).all(-1) & maps[:, :, 0].all(-1)
        out[name] = {
            "agreement": [float(agree[replayed & (sample == i)].float().mean()) for i in range(len(PROMPTS))],
            "expert0_alone": [float(expert0[replayed & (sample == i)].float().mean()) for i in range(len(PROMPTS))],
            "gate0": float(gates[0][0, 0]),
        }
    mask = ve.make_batch(PROMPTS, roll["responses"], pad_id=0)["response_mask"].bool()
    for name, lp in log_probs.items():
        change = (lp - log_probs["captured"]).abs()
        out[name]["dlp"] = [float(change[i][mask[i]].max()) for i in range(len(PROMPTS))]
    return out


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("verl_megatron") / "model")


def _run(scenario, env=None, world=1, **kwargs):
    values = fsdp_harness.run_ranks(scenario, world, env=env, timeout=600, **kwargs)
    return values[0]


def test_verl_megatron_engine_scores_over_the_rollouts_support(model_dir):
    """Stock verl's Megatron engine scores the top-k rollout over the full vocabulary (the ratio
    against the sampler's logprobs is the support's mass, far below 1); with the plugin the engine's
    compute_log_prob path gives ratio 1 within 1e-5 in the THD and BSHD layouts and with the
    vocabulary split over two tensor-parallel ranks, verl's entropy is unchanged, and a PPO step
    with the rollout's logprobs as old logprobs sees no policy change and a finite loss."""
    need("verl")
    need("megatron-core")
    stock = _run(support_scenario, OFF, model_dir=model_dir, temperature=0.7)
    plugin = _run(support_scenario, model_dir=model_dir, temperature=0.7)
    tp2 = _run(support_scenario, world=2, model_dir=model_dir, temperature=0.7, tp=2)
    print(
        f"verl Megatron engine, top-{TOP_K} rollout at T=0.7: stock ratio mean {stock['thd']['ratio_mean']:.4f} "
        f"(max |r-1| {stock['thd']['ratio_max_dev']:.3f}, full-vocabulary {stock['full_ratio_mean']:.4f}), ppo_kl "
        f"{stock['ppo_kl']:.3g}; plugin THD mean {plugin['thd']['ratio_mean']:.6f} max |r-1| "
        f"{plugin['thd']['ratio_max_dev']:.2e}, BSHD {plugin['bshd']['ratio_max_dev']:.2e}, TP=2 "
        f"{tp2['thd']['ratio_max_dev']:.2e}; ppo_kl {plugin['ppo_kl']:.3g}, loss {plugin['loss']}, grad norm "
        f"{plugin['grad_norm']:.3f}"
    )
    for layout in ("thd", "bshd"):
        assert abs(stock[layout]["ratio_mean"] - stock["full_ratio_mean"]) < 1e-4  # stock: the full vocabulary
        assert stock[layout]["ratio_mean"] < 0.5 and stock[layout]["ratio_max_dev"] > 0.05
        assert plugin[layout]["ratio_max_dev"] < 1e-5 and tp2[layout]["ratio_max_dev"] < 1e-5
        assert plugin[layout]["entropy"] == pytest.approx(stock[layout]["entropy"], abs=1e-5)  # verl's own
    assert plugin["per_sample"]["ratio_max_dev"] < 1e-5 < stock["per_sample"]["ratio_max_dev"]  # per-sample T
    assert abs(plugin["ppo_kl"]) < 1e-5 < abs(stock["ppo_kl"])
    assert plugin["loss"] == plugin["loss"] and abs(plugin["loss"]) < 1e3  # finite
    assert plugin["grad_norm"] == plugin["grad_norm"] and plugin["grad_norm"] > 0


def test_verl_megatron_r3_and_support_replay_together(model_dir):
    """verl's own R3 on its Megatron engine runs beside the plugin (its Megatron patches and the
    support patch applied): a bfloat16 trainer routes some tokens elsewhere than the float32
    rollout without R3 and none with it, while the support patch keeps the ratio at 1 up to the
    bfloat16 rounding; a float32 PPO step with both replays has a finite loss and ppo_kl ~ 0."""
    need("verl")
    need("megatron-core")
    out = _run(routes_scenario, model_dir=model_dir)
    print(
        f"verl Megatron engine, bf16 trainer: route agreement without R3 {100 * out['disabled']['agreement']:.1f}%, "
        f"with verl's R3 {100 * out['R3']['agreement']:.1f}%; ratio mean {out['R3']['ratio_mean']:.5f} "
        f"(max |r-1| {out['R3']['ratio_max_dev']:.3g}); PPO step loss {out['loss']}, ppo_kl {out['ppo_kl']:.3g}"
    )
    assert out["disabled"]["agreement"] < 1.0
    assert out["R3"]["agreement"] == 1.0
    assert abs(out["R3"]["ratio_mean"] - 1) < 0.01 and out["R3"]["ratio_max_dev"] < 0.05
    assert out["loss"] == out["loss"] and abs(out["ppo_kl"]) < 1e-5


def test_verl_megatron_engine_refuses_rows_it_cannot_replay(model_dir):
    """A support row without its sampled token is refused naming the field, the micro-batch row,
    its uid and the response token; unsigned rows (a -1 pad reads as 255) and fused kernels too; a
    micro-batch whose rows the forward path did not use is refused rather than scored over the full
    vocabulary. Stock verl returns numbers for the others (its fused forward does not run on CPU)."""
    need("verl")
    need("megatron-core")
    out = _run(refusal_scenario, model_dir=model_dir)
    print(out)
    assert out["missing"] and "'rollout_sample_support', trajectory 0, token 3" in out["missing"], out
    assert "uid uid-2" in out["missing"] and "micro-batch row 0" in out["missing"], out
    assert out["unsigned"] and "signed" in out["unsigned"], out
    assert out["fused"] and out["fused"].startswith("NotReplayable") and "use_fused_kernels=false" in out["fused"]
    assert out["bypassed"] and "was not scored" in out["bypassed"], out
    stock = _run(refusal_scenario, OFF, model_dir=model_dir)
    assert stock["missing"] is None and stock["unsigned"] is None and stock["bypassed"] is None, stock


def test_rows_no_patch_scores_are_refused(model_dir):
    """verl.engine_replay_guard: with the Megatron support patch switched off, verl's engine would
    score the batch's rows over the full vocabulary, silently; the guard refuses it naming the
    variable. (Stock verl with both off returns numbers: the stock runs above.)"""
    need("verl")
    need("megatron-core")
    out = _run(guard_scenario, SUPPORT_PATCH_OFF, model_dir=model_dir)
    print(out)
    assert out["refused"] and out["setting"] == "REPLAY_PLUGIN_VERL_MEGATRON_SUPPORT_LOGPROBS", out
    assert "is disabled" in out["refused"] and "full vocabulary" in out["refused"], out
    assert _run(guard_scenario, model_dir=model_dir) == {"refused": None}


def test_verl_r3_in_the_padded_layout(model_dir):
    """verl.megatron_r3_layout: verl's own R3 with use_remove_padding=false replays other tokens'
    routes when a micro-batch holds several sequences (upstream, patch off: far from 100% of the
    tokens on their experts); the patch refuses it naming the key; one sequence per micro-batch
    replays every token and passes."""
    need("verl")
    need("megatron-core")
    upstream = _run(r3_layout_scenario, {"REPLAY_PLUGIN_VERL_MEGATRON_R3_LAYOUT": "0"}, model_dir=model_dir,
                    micro_batch_size=4)  # fmt: skip
    plugin = _run(r3_layout_scenario, model_dir=model_dir, micro_batch_size=4)
    single = _run(r3_layout_scenario, model_dir=model_dir, micro_batch_size=1)
    print(
        f"verl R3, BSHD, 4 sequences per micro-batch: {100 * upstream['agreement']:.1f}% of tokens on their experts "
        f"(patch off); patch: {plugin['refused']}; one per micro-batch: {100 * single['agreement']:.1f}%"
    )
    assert upstream["agreement"] < 0.5
    assert plugin["setting"] == "actor_rollout_ref.model.use_remove_padding", plugin
    assert single["refused"] is None and single["agreement"] == 1.0


def test_verl_megatron_engine_refuses_hostile_batches(model_dir):
    """Issue 41 (F3, F6, F7, F8) on verl's Megatron engine with the plugin, each case a silent wrong
    number or an untyped crash before: a loss-bearing token whose support row is all -1 (verl has no
    synthetic EOS) is refused naming the field, the micro-batch row, its uid and the response token;
    an int64 id of 2**32 + 5, which the int32 narrowing turned into token 5 (the token scored as if
    5 were a member), is refused naming the id; a per-sample temperature tensor with a negative entry
    is refused naming the sample; rows as a strided nested tensor are refused naming the layout."""
    need("verl")
    need("megatron-core")
    out = _run(hostile_scenario, model_dir=model_dir)
    print(out)
    assert not out["five_in_row"] and "scored" in out["five_instead"], out  # 5 as a member: a valid row
    assert abs(out["full_vocab_lp"] - out["rollout_lp"]) > 0.5, out  # what a full-vocabulary score gives
    one = out["one_unsupported"]
    assert one.get("error") == "ReplayDataError", one
    assert (one["field"], one["trajectory"], one["token"]) == ("rollout_sample_support", 2, 3), one
    assert "uid uid-2" in one["text"] and "response token 3" in one["text"], one
    wide = out["wide_id"]
    assert wide.get("error") == "ReplayDataError", wide
    assert (wide["field"], wide["trajectory"], wide["token"]) == ("rollout_sample_support", 2, 3), wide
    assert str(2**32 + 5) in wide["text"], wide
    temp = out["negative_temperature"]
    assert temp.get("error") == "ReplayDataError" and temp["field"] == "temperature", temp
    assert temp["trajectory"] == 2 and "-1.0" in temp["text"], temp
    strided = out["strided_support"]
    assert strided.get("error") == "ReplayDataError" and strided["field"] == "rollout_sample_support", strided
    assert "strided" in strided["text"], strided


def test_verl_megatron_r3_refuses_routes_that_were_not_captured(model_dir):
    """Issue 41 F7 on verl's Megatron engine: all-zero routed_experts (the rollout returned none;
    verl's agent loop fills zeros) under verl's own R3. verl (the check off) is no no-op here: it
    replays each zero row as the route [0, 0], every replayed token of those sequences goes to
    expert 0 alone (none on the rollout's experts) and their log-probs move against the captured
    routes' replay, without a word, for the whole batch and for one sample alike (the others are
    untouched). With verl.megatron_r3_layout the batch is refused before compute naming
    routed_experts, the first such sample (batch row, uid) and enable_rollout_routing_replay;
    captured routes replay as before. (A top-1 model's [0] is a valid route: not refused, not
    tested.)"""
    need("verl")
    need("megatron-core")
    verl = _run(zero_routes_scenario, {"REPLAY_PLUGIN_VERL_MEGATRON_R3_LAYOUT": "0"}, model_dir=model_dir)
    plugin = _run(zero_routes_scenario, model_dir=model_dir)

    def r(values):
        return [round(v, 3) for v in values]

    print(
        f"verl's Megatron R3, bf16 engine, tokens on the rollout's experts per sample: captured routes "
        f"{r(verl['captured']['agreement'])}, no R3 {r(verl['no_r3']['agreement'])}, all-zero routes "
        f"{r(verl['zero_batch']['agreement'])} (on expert 0 alone {r(verl['zero_batch']['expert0_alone'])}, its gate "
        f"{verl['zero_batch']['gate0']:.3f}; max |d logprob| vs the captured replay {r(verl['zero_batch']['dlp'])}), "
        f"sample 2 zero {r(verl['zero_sample_2']['agreement'])} (max |d logprob| {r(verl['zero_sample_2']['dlp'])}); "
        f"plugin: {plugin['zero_batch'].get('text')}; {plugin['zero_sample_2'].get('text')}"
    )
    assert verl["captured"]["agreement"] == [1.0] * 4 and min(verl["no_r3"]["agreement"]) < 1.0, verl
    zero_batch, zero_one = verl["zero_batch"], verl["zero_sample_2"]
    assert zero_batch["agreement"] == [0.0] * 4 and zero_batch["expert0_alone"] == [1.0] * 4, zero_batch
    assert min(zero_batch["dlp"]) > 0.05, zero_batch  # every sample's log-probs moved
    assert zero_one["agreement"] == [1.0, 1.0, 0.0, 1.0] and zero_one["expert0_alone"][2] == 1.0, zero_one
    assert zero_one["dlp"][2] > 0.05 and max(zero_one["dlp"][i] for i in (0, 1, 3)) < 1e-6, zero_one

    assert plugin["captured"]["agreement"] == [1.0] * 4 and plugin["captured"]["dlp"] == [0.0] * 4, plugin
    for case, row in (("zero_batch", 0), ("zero_sample_2", 2)):
        got = plugin[case]
        assert got.get("error") == "ReplayDataError", (case, got)
        assert (got["field"], got["trajectory"]) == ("routed_experts", row), (case, got)
        assert f"[batch row {row}, uid uid-{row}]" in got["text"], (case, got)
        assert "enable_rollout_routing_replay=true" in got["text"] and "expert 0 alone" in got["text"], (case, got)


def test_megatron_r3_capture_check_reads_verls_route_layouts(caplog):
    """verl.megatron_r3_layout's capture check on the engine's whole batch, before verl splits it
    (one rule with the FSDP engine, ``engine_batch.check_captured``): routes one row short of the
    sequence (verl's ``align_r3_router_replay_data`` accepts them: the last row is never replayed)
    are read; a partial capture is counted and warned once per process, naming what verl's R3 does
    with the rows (expert 0 alone); a sequence with none is refused naming the batch row and uid; a
    top-1 model's [0] rows are valid routes (nothing refused); routes verl itself will refuse (two
    rows short) and batches verl does not replay (enable_routing_replay false) pass unchecked."""
    need("verl")
    import logging

    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.verl import engine_batch, megatron_r3_layout

    engine = type("Engine", (), {})()
    engine.engine_config = type("Cfg", (), {"router_replay": {"mode": "R3"}})()

    def jagged(values, lengths):
        return torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, *lengths]).cumsum(0))

    def batch(routes, route_lengths=(3, 5), replay=True):
        td = TensorDict(
            {
                "input_ids": jagged(torch.arange(1, 10), (4, 5)),
                "responses": jagged(torch.arange(5), (2, 3)),
                "loss_mask": jagged(torch.tensor([1, 1, 0, 1, 1]), (2, 3)),
                "routed_experts": jagged(routes, route_lengths),
            },
            batch_size=[2],
        )
        tu.assign_non_tensor(td, enable_routing_replay=replay, uid=["u0", "u1"])
        return td

    # scoring positions (the one before each loss-bearing token): sequence 0 positions 1, 2;
    # sequence 1 positions 2, 3 (its first response token carries no loss)
    routes = torch.tensor([[1, 2], [3, 4], [0, 0], [5, 6], [6, 7], [1, 3], [2, 4], [0, 0]]).view(8, 1, 2)
    engine_batch._WARNED_PARTIAL.discard("verl.megatron_r3_layout")
    with caplog.at_level(logging.DEBUG, logger="replay_plugin"):
        assert megatron_r3_layout.check_captured_routes(engine, batch(routes)) == (3, 4)
        assert megatron_r3_layout.check_captured_routes(engine, batch(routes)) == (3, 4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "replay_plugin"]
    assert len(warnings) == 1 and "1 of 4 positions" in warnings[0] and "expert 0 alone" in warnings[0], warnings
    none = routes.clone()
    none[5:7] = 0  # sequence 1's positions 2 and 3
    with pytest.raises(ReplayDataError, match=r"none of the 2 positions.*\[batch row 1, uid u1\]") as info:
        megatron_r3_layout.check_captured_routes(engine, batch(none))
    assert (info.value.field, info.value.trajectory) == ("routed_experts", 1)
    assert "enable_rollout_routing_replay=true" in str(info.value)
    assert megatron_r3_layout.check_captured_routes(engine, batch(torch.zeros(8, 1, 1, dtype=torch.long))) == (4, 4)
    assert megatron_r3_layout.check_captured_routes(engine, batch(none[:7], route_lengths=(2, 5))) is None
    assert megatron_r3_layout.check_captured_routes(engine, batch(none, replay=False)) is None
