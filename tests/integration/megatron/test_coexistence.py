"""Frameworks that patch Megatron's router replay themselves, with the plugin active.

* verl 0.9.1 (env ``main``, megatron-core 0.16.1): ``apply_router_replay_patch()`` replaces
  ``TopKRouter.__init__`` / ``routing`` and gives each router verl's own ``RouterReplay``; its
  engine sets ``REPLAY_FORWARD`` before the schedule, installs each microbatch's routes on the
  model's routers in ``forward_step`` (``set_router_replay_data(..., model=)``; on CPU the
  test installs the same per-router data through verl's ``RouterReplay.set_target_indices``,
  since that function moves the data to CUDA), switches them to ``REPLAY_BACKWARD`` after the
  forward and clears everything after the schedule.
* SkyRL 0.4.0 (env ``py312``, megatron-core 0.19.2): ``patch_topk_router_layer_number()``
  replaces ``TopKRouter.set_layer_number``; ``router_replay_schedule`` clears Megatron's
  ``RouterReplay`` around the schedule, ``setup_per_microbatch_replay_forward`` /
  ``..._backward`` drive it per microbatch.

Each framework runs a forward-only logprob pass (under ``no_grad``, as their inference passes
run) and a training step with full activation recompute over two microbatches, in a fresh
process per patching order: the framework first (and before that, the same flow with the
plugin deactivated: the baseline), or the plugin first. Routed experts per router call, losses,
every parameter gradient and the expert-bias counts must be identical in all three runs, and
the framework's replay must actually replay.
"""

from __future__ import annotations

import harness
import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(900)

L, K, E, S, MICRO = 2, 2, 4, 8, 2


def _recompute_model(expert_bias: bool = True):
    return harness.build_model(
        num_layers=L,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        moe_router_enable_expert_bias=expert_bias,
    )


def _observations(model, spy, losses) -> dict:
    """What must not change with the plugin: experts per router call, losses, gradients, counts."""
    import torch

    return {
        "calls": [[c["layer"], c["action"], torch.nonzero(c["map"])[:, 1].tolist()] for c in spy.calls],
        "losses": [float(x) for x in losses],
        "grads": {n: float(p.grad.double().sum()) for n, p in model.named_parameters() if p.grad is not None},
        "counts": [
            None if r.local_tokens_per_expert is None else r.local_tokens_per_expert.tolist()
            for _, r in harness.routers(model)
        ],
    }


def _run(model, step, batches, *, forward_only: bool, losses: list, wrap=None):
    """Megatron's schedule over ``batches``; ``step(model, batch)`` returns the output."""
    import contextlib

    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    it = iter(batches)

    def forward_step(data_iterator, m):
        out = step(m, next(data_iterator))

        def loss_func(output):
            loss = output.float().mean()
            losses.append(loss.detach())
            return loss, {"loss": loss.detach()}

        return out, loss_func

    outer = wrap() if wrap is not None else contextlib.nullcontext()
    with outer, torch.no_grad() if forward_only else contextlib.nullcontext():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=it,
            model=[model],
            num_microbatches=len(batches),
            seq_length=S,
            micro_batch_size=1,
            forward_only=forward_only,
        )


def _replayed(spy, batches) -> bool:
    """Every router call replayed the routes of its microbatch. Calls come in schedule order: the
    logprob pass's forwards (L per microbatch), then per training microbatch its forward and its
    recompute (2 L)."""
    import torch

    if len(spy.calls) != MICRO * L * 3:
        return False
    for index, call in enumerate(spy.calls):
        mb = index // L if index < MICRO * L else (index - MICRO * L) // (2 * L)
        if call["action"] not in ("REPLAY_FORWARD", "REPLAY_BACKWARD"):
            return False
        want = harness.routing_map(batches[mb][2][0, :, call["layer"] - 1], E)
        if not torch.equal(call["map"], want):
            return False
    return True


def _status() -> dict:
    import replay_plugin

    return {r["name"]: r["state"] for r in replay_plugin.status() if r["name"].startswith("megatron.")}


def _fresh_megatron_state() -> None:
    """As harness.reset_state before each scenario: one model's routers in the registry, no
    leftover aux-loss scale."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.global_router_replay_instances.clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def _reapply_plugin() -> dict:
    """Apply the megatron patches again (after the framework patched); their states and reasons."""
    from replay_plugin import registry

    out = {}
    for name in harness.MEGATRON_PATCHES:
        st = registry.get().apply(name)
        out[name] = [st.state, st.reason]
    return out


# --------------------------------------------------------------------------------------
# verl 0.9.1


def _verl_flow() -> dict:
    """verl's MegatronEngine.forward_backward_batch / forward_step replay logic, R3 mode."""
    import torch
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (
        RouterReplayHelper,
        iter_model_routers,
        set_model_router_replay_action,
    )

    _fresh_megatron_state()
    RouterReplay.router_instances.clear()
    model = _recompute_model()
    spy = harness.RouteSpy(model)
    batches = []
    for i in range(MICRO):
        ids, pos = harness.tokens(1, S, 10 + i)
        routes = torch.as_tensor(harness.distinct_routes(1, S, L, K, E, seed=20 + i)).long()  # [1, S, L, K]
        batches.append((ids, pos, routes))

    def step(m, batch):
        ids, pos, routes = batch
        if RouterReplayHelper.is_replay_backward_action(m.config, 0, model=m):
            set_model_router_replay_action(m, RouterReplayAction.REPLAY_FORWARD)
        if RouterReplayHelper.is_replay_forward_action(m.config, 0, model=m):
            # What set_router_replay_data(routes, attention, config, model=m) installs for one
            # full-length row (its packing and `.to(device_name)` need CUDA): per router of the
            # model, its layer's [S, K] routes, through verl's RouterReplay.set_target_indices.
            for layer_number, router in iter_model_routers(m):
                router.set_target_indices(routes[0, :, layer_number - 1].to(torch.int64), replay_mask=None)
        out = m(ids, pos, harness.causal_mask(S))
        if RouterReplayHelper.is_replay_forward_action(m.config, 0, model=m):
            set_model_router_replay_action(m, RouterReplayAction.REPLAY_BACKWARD)
        return out

    def schedule(forward_only: bool, losses: list) -> None:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        _run(model, step, batches, forward_only=forward_only, losses=losses)
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()

    losses: list = []
    schedule(True, losses)
    schedule(False, losses)
    out = _observations(model, spy, losses)
    out["replayed"] = _replayed(spy, batches)
    out["router_replay_class"] = type(harness.routers(model)[0][1].router_replay).__module__
    return out


def scenario_verl(rank: int, order: str) -> dict:
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    import replay_plugin

    out: dict = {}
    if order == "verl_first":
        replay_plugin.deactivate()
        apply_router_replay_patch()
        out["plugin_off"] = _verl_flow()
        out["reapplied"] = _reapply_plugin()
    else:
        apply_router_replay_patch()
    out["plugin_on"] = _verl_flow()
    out["status"] = _status()
    return out


def test_verl_router_replay_with_the_plugin_either_order():
    need("megatron-core", "verl")
    verl_first = harness.run_ranks(scenario_verl, 1, order="verl_first")[0]
    plugin_first = harness.run_ranks(scenario_verl, 1, order="plugin_first")[0]
    baseline = verl_first["plugin_off"]
    assert baseline["replayed"] and baseline["router_replay_class"].startswith("verl.")
    assert len(baseline["calls"]) == MICRO * L * 3  # logprob forwards, training forwards, recomputes
    assert verl_first["plugin_on"] == baseline
    assert plugin_first["plugin_on"] == baseline
    for result in (verl_first, plugin_first):
        # verl replaces TopKRouter.__init__ / routing, none of the plugin's targets
        assert all(s in ("applied", "not-needed") for s in result["status"].values()), result["status"]


# --------------------------------------------------------------------------------------
# SkyRL 0.4.0


def _skyrl_flow() -> dict:
    """SkyRL's MegatronModelWrapper replay logic: router_replay_schedule around the schedule,
    setup_per_microbatch_replay_forward / _backward in forward_step."""
    import torch
    from skyrl.backends.skyrl_train.distributed.megatron.token_metadata import build_token_metadata_layout
    from skyrl.backends.skyrl_train.utils.packed_tensor import PackedTensor
    from skyrl.backends.skyrl_train.utils.replay_utils import (
        router_replay_schedule,
        setup_per_microbatch_replay_backward,
        setup_per_microbatch_replay_forward,
    )

    _fresh_megatron_state()
    # No expert bias: SkyRL passes padding_mask to the model, and stock 0.19.2 then crashes in
    # TopKRouter._apply_expert_bias during training (the bug megatron.expert_bias_padding_mask
    # fixes), so there would be no plugin-off baseline to compare with.
    model = _recompute_model(expert_bias=False)
    spy = harness.RouteSpy(model)
    attention = torch.ones(1, S, dtype=torch.bool)
    batches = []
    for i in range(MICRO):
        ids, pos = harness.tokens(1, S, 10 + i)
        routes = torch.as_tensor(harness.distinct_routes(1, S, L, K, E, seed=20 + i)).long()
        batches.append((ids, pos, routes))

    def step(m, batch):
        ids, pos, routes = batch
        layout = build_token_metadata_layout(attention, ids.device, packed=False, fp8_enabled=False)
        packed = PackedTensor(routes[0], torch.tensor([0, S], dtype=torch.int32))
        kwargs = setup_per_microbatch_replay_forward(packed, ~attention, attention, m, m.config, layout)
        out = m(ids, pos, harness.causal_mask(S), **kwargs)
        setup_per_microbatch_replay_backward()
        return out

    losses: list = []
    _run(model, step, batches, forward_only=True, losses=losses, wrap=lambda: router_replay_schedule(True))
    _run(model, step, batches, forward_only=False, losses=losses, wrap=lambda: router_replay_schedule(True))
    out = _observations(model, spy, losses)
    out["replayed"] = _replayed(spy, batches)
    return out


def scenario_skyrl(rank: int, order: str) -> dict:
    from skyrl.backends.skyrl_train.utils.replay_utils import patch_topk_router_layer_number

    import replay_plugin

    out: dict = {}
    if order == "skyrl_first":
        replay_plugin.deactivate()
        patch_topk_router_layer_number()
        out["plugin_off"] = _skyrl_flow()
        out["reapplied"] = _reapply_plugin()
    else:
        patch_topk_router_layer_number()
    out["plugin_on"] = _skyrl_flow()
    out["status"] = _status()
    return out


def test_skyrl_megatron_replay_with_the_plugin_either_order():
    need("megatron-core", "skyrl")
    skyrl_first = harness.run_ranks(scenario_skyrl, 1, order="skyrl_first")[0]
    plugin_first = harness.run_ranks(scenario_skyrl, 1, order="plugin_first")[0]
    baseline = skyrl_first["plugin_off"]
    assert baseline["replayed"]
    assert len(baseline["calls"]) == MICRO * L * 3
    assert skyrl_first["plugin_on"] == baseline
    assert plugin_first["plugin_on"] == baseline
    # SkyRL replaces TopKRouter.set_layer_number, which 0.19 does not need patched (probe says
    # so when the plugin comes first). Applied after SkyRL's replacement, the patch refuses the
    # foreign source and says whose it is.
    assert plugin_first["status"]["megatron.router_layer_number"] == "not-needed"
    state, reason = skyrl_first["reapplied"]["megatron.router_layer_number"]
    assert state == "error" and "fingerprint drift" in reason
    assert "TopKRouter.set_layer_number is now skyrl." in reason and "replaced by another library" in reason
    for result in (skyrl_first, plugin_first):
        others = {n: st for n, st in result["status"].items() if n != "megatron.router_layer_number"}
        assert all(st == "applied" for st in others.values()), result["status"]
