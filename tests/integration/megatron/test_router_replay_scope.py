"""``megatron.router_replay_scope`` on real megatron-core schedules (CPU, gloo, world size 1).

Upstream's RouterReplay API is driven the way RL frameworks drive it (``set_replay_data`` +
``set_global_router_replay_action`` in ``forward_step``, ``REPLAY_BACKWARD`` after the
forward), with full activation recompute so that the backward pass pops the FIFO. Each test
runs the same scenario with the patch reverted in the Megatron process (upstream behaviour),
then applied: the leaks (a schedule's own unconsumed installs, forward-only expert-bias counts)
are gone, and what stock Megatron allows with state set up before a schedule (routes installed
once for two schedules, RECORD set once, a second model's routes) works as it does upstream.
"""

from __future__ import annotations

import contextlib

import harness
import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(600)

B, S = 2, 8
LOGPROB_EXPERTS = (2, 3)  # every token of the logprob pass replays experts 2 and 3
TRAIN_EXPERTS = (0, 1)  # every token of the training step replays experts 0 and 1


@pytest.fixture
def worker():
    need("megatron-core")
    return harness.shared_worker()


# --------------------------------------------------------------------------------------
# scenarios (run in the Megatron worker)


def _replay_step(experts, then_backward: bool):
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    def step(model, batch):
        ids, pos = batch
        n = ids.numel()
        idx = torch.tensor([list(experts)] * n, dtype=torch.int32)
        RouterReplay.set_replay_data([idx] * len(RouterReplay.global_router_replay_instances))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        out = model(ids, pos, harness.causal_mask(ids.shape[1]))
        if then_backward:
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return out

    return step


def _backward_experts(spy) -> list:
    """Per recompute call (REPLAY_BACKWARD): the sorted set of experts its tokens used."""
    import torch

    return [sorted(set(torch.nonzero(c["map"])[:, 1].tolist())) for c in spy.calls if c["action"] == "REPLAY_BACKWARD"]


def scenario_stale_fifo(patch: bool, train_seq: int = S, exception: bool = False, preinstalled: bool = False):
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    model = harness.build_model(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        moe_router_enable_expert_bias=False,
    )
    spy = harness.RouteSpy(model)
    ctx = contextlib.nullcontext() if patch else harness.patch_off("megatron.router_replay_scope")
    out: dict = {}
    with ctx:
        if exception:

            def failing(model, batch):
                _replay_step(LOGPROB_EXPERTS, False)(model, batch)
                raise RuntimeError("forward_step failed")

            try:
                harness.run_schedule(model, [harness.tokens(B, S, 1)], forward_only=False, step=failing, seq=S, mbs=B)
            except RuntimeError as exc:
                out["first_error"] = str(exc)
        else:  # a forward-only logprob pass over two microbatches
            batches = [harness.tokens(B, S, 1), harness.tokens(B, S, 2)]
            harness.run_schedule(
                model, batches, forward_only=True, step=_replay_step(LOGPROB_EXPERTS, True), seq=S, mbs=B
            )
        out["fifo_between"] = [len(r.replay_backward_list) for r in RouterReplay.global_router_replay_instances]
        out["action_between"] = [str(r.router_replay_action) for r in RouterReplay.global_router_replay_instances]
        spy.calls.clear()
        batch = harness.tokens(B, train_seq, 3)
        if preinstalled:  # the caller installs this step's data before the schedule (SkyRL style)
            n = batch[0].numel()
            RouterReplay.set_replay_data([torch.tensor([list(TRAIN_EXPERTS)] * n, dtype=torch.int32)] * 2)

            def step(model, b):
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                o = model(b[0], b[1], harness.causal_mask(b[0].shape[1]))
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                return o
        else:
            step = _replay_step(TRAIN_EXPERTS, True)
        try:
            harness.run_schedule(model, [batch], forward_only=False, step=step, seq=train_seq, mbs=B)
            out["train_error"] = None
        except Exception as exc:  # noqa: BLE001
            out["train_error"] = f"{type(exc).__name__}: {exc}"
        out["backward_experts"] = _backward_experts(spy)
        out["fifo_after"] = [len(r.replay_backward_list) for r in RouterReplay.global_router_replay_instances]
        out["action_after"] = [str(r.router_replay_action) for r in RouterReplay.global_router_replay_instances]
    return out


def scenario_forward_only_counts(patch: bool):
    """Expert-bias token counts around a forward-only schedule between two training steps."""
    model = harness.build_model()
    plain = lambda m, b: m(b[0], b[1], harness.causal_mask(b[0].shape[1]))  # noqa: E731
    ctx = contextlib.nullcontext() if patch else harness.patch_off("megatron.router_replay_scope")
    with ctx:
        harness.run_schedule(model, [harness.tokens(B, S, 1)], forward_only=False, step=plain, seq=S, mbs=B)
        after_train = harness.expert_bias_counts(model)
        harness.run_schedule(
            model, [harness.tokens(B, S, 2), harness.tokens(B, S, 3)], forward_only=True, step=plain, seq=S, mbs=B
        )
        after_logprob = harness.expert_bias_counts(model)
        harness.run_schedule(model, [harness.tokens(B, S, 4)], forward_only=False, step=plain, seq=S, mbs=B)
        after_second_train = harness.expert_bias_counts(model)
    return {"after_train": after_train, "after_logprob": after_logprob, "after_second_train": after_second_train}


def _experts_per_call(spy) -> list:
    """Per router call: (action, sorted set of experts its tokens used)."""
    import torch

    return [(c["action"], sorted(set(torch.nonzero(c["map"])[:, 1].tolist()))) for c in spy.calls]


def _recompute_model():
    return harness.build_model(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        moe_router_enable_expert_bias=False,
    )


def _plain(model, batch):
    return model(batch[0], batch[1], harness.causal_mask(batch[0].shape[1]))


def _then_backward(model, batch):
    """A training forward_step that only switches to REPLAY_BACKWARD after the forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    out = _plain(model, batch)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    return out


def _off_or_on(patch: bool):
    return contextlib.nullcontext() if patch else harness.patch_off("megatron.router_replay_scope")


def scenario_install_once_two_schedules(patch: bool):
    """Routes installed once (set_replay_data + REPLAY_FORWARD) before a forward-only logprob
    pass and a training step with full recompute whose forward_step switches to REPLAY_BACKWARD."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    model = _recompute_model()
    spy = harness.RouteSpy(model)
    batch = harness.tokens(B, S, 5)
    out: dict = {}
    with _off_or_on(patch):
        idx = torch.tensor([list(LOGPROB_EXPERTS)] * batch[0].numel(), dtype=torch.int32)
        RouterReplay.set_replay_data([idx] * len(RouterReplay.global_router_replay_instances))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        harness.run_schedule(model, [batch], forward_only=True, step=_plain, seq=S, mbs=B)
        out["logprob_calls"] = _experts_per_call(spy)
        spy.calls.clear()
        try:
            harness.run_schedule(model, [batch], forward_only=False, step=_then_backward, seq=S, mbs=B)
            out["train_error"] = None
        except Exception as exc:  # noqa: BLE001
            out["train_error"] = f"{type(exc).__name__}: {exc}"
        out["train_calls"] = _experts_per_call(spy)
        out["gate_grads"] = [r.weight.grad is not None for _, r in harness.routers(model)]
    return out


def scenario_record_across_schedules(patch: bool):
    """RECORD set once (R2 style), then two forward-only schedules over different batches."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    model = harness.build_model(moe_router_enable_expert_bias=False)
    spy = harness.RouteSpy(model)
    out: dict = {"recorded_equals_own_routing": []}
    with _off_or_on(patch):
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        for seed in (1, 2):
            spy.calls.clear()
            harness.run_schedule(model, [harness.tokens(B, S, seed)], forward_only=True, step=_plain, seq=S, mbs=B)
            recorded = RouterReplay.get_recorded_data()
            own = [c["map"] for c in spy.calls]  # one call per layer, in layer order
            out["recorded_equals_own_routing"].append(
                [rec is not None and bool(torch.equal(harness.routing_map(rec, 4), m)) for rec, m in zip(recorded, own)]
            )
        out["action_after"] = [str(r.router_replay_action) for r in RouterReplay.global_router_replay_instances]
    return out


def scenario_two_models_interleaved(patch: bool):
    """The reference model's routes are installed once; the policy's forward-only passes
    install their own per microbatch; the two models' passes interleave."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    policy = harness.build_model(seed=0, moe_router_enable_expert_bias=False)
    reference = harness.build_model(seed=1, moe_router_enable_expert_bias=False)
    spy_p, spy_r = harness.RouteSpy(policy), harness.RouteSpy(reference)
    n = B * S

    def install(model, experts):
        idx = torch.tensor([list(experts)] * n, dtype=torch.int32)
        for _, r in harness.routers(model):
            r.router_replay.set_target_indices(idx)
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def policy_step(model, batch):
        install(model, LOGPROB_EXPERTS)
        return _plain(model, batch)

    out: dict = {"reference_passes": [], "policy_passes": []}
    with _off_or_on(patch):
        install(reference, TRAIN_EXPERTS)  # once, before either model runs
        for seed in (1, 2):
            batch = harness.tokens(B, S, seed)
            spy_p.calls.clear()
            spy_r.calls.clear()
            harness.run_schedule(policy, [batch], forward_only=True, step=policy_step, seq=S, mbs=B)
            harness.run_schedule(reference, [batch], forward_only=True, step=_plain, seq=S, mbs=B)
            out["policy_passes"].append(_experts_per_call(spy_p))
            out["reference_passes"].append(_experts_per_call(spy_r))
        out["policy_fifo_after"] = [len(r.router_replay.replay_backward_list) for _, r in harness.routers(policy)]
        out["reference_fifo_after"] = [len(r.router_replay.replay_backward_list) for _, r in harness.routers(reference)]
    return out


def scenario_stale_driver_routes(patch: bool):
    """replay_routes outside a schedule (a forward, no backward, no clear_routes), then a
    training schedule whose forward_step calls replay_routes for its own batch."""
    import warnings

    from replay_plugin.megatron import replay_routes
    from replay_plugin.megatron.router_replay_scope import StaleRoutesWarning

    model = _recompute_model()
    ids, attention, layout = harness.batch(seed=3, lengths=(8, 8))
    stale = harness.distinct_routes(B, S, 2, 2, 4, seed=71)
    fresh = harness.distinct_routes(B, S, 2, 2, 4, seed=72)
    spy = harness.RouteSpy(model)
    out: dict = {}
    with _off_or_on(patch), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replay = replay_routes(model, stale, ~attention, layout)
        harness.forward(model, ids, layout, padding_mask=replay.padding_mask)
        out["fifo_before"] = [len(r.router_replay.replay_backward_list) for _, r in harness.routers(model)]
        spy.calls.clear()

        def step(m, _batch):
            r = replay_routes(m, fresh, ~attention, layout)
            return harness.forward(m, ids, layout, padding_mask=r.padding_mask)

        harness.run_schedule(model, [None], forward_only=False, step=step, seq=S, mbs=B)
    rows = harness.valid_rows(layout)
    out["backward_replays"] = {}
    for layer in (1, 2):
        maps = spy.maps(layer, "REPLAY_BACKWARD")
        expected = {
            name: harness.routing_map(harness.aligned_seq_major(r, layout, layer), 4)
            for name, r in (("stale", stale), ("fresh", fresh))
        }
        out["backward_replays"][layer] = [
            [name for name, want in expected.items() if bool((m[rows] == want[rows]).all())] for m in maps
        ]
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, StaleRoutesWarning)]
    return out


def scenario_action_set_once(patch: bool, first: str):
    """REPLAY_FORWARD set once by the caller; then a first schedule (``first``: a training
    step, a forward-only pass, or a training step whose forward_step raises) and a training
    schedule, each forward_step installing its routes with set_replay_data and setting no action."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    model = harness.build_model(moe_router_enable_expert_bias=False)
    spy = harness.RouteSpy(model)
    out: dict = {}

    def install_only(experts, fail: bool = False):
        def step(m, batch):
            idx = torch.tensor([list(experts)] * batch[0].numel(), dtype=torch.int32)
            RouterReplay.set_replay_data([idx] * len(RouterReplay.global_router_replay_instances))
            if fail:
                raise RuntimeError("forward_step failed")
            return _plain(m, batch)

        return step

    with _off_or_on(patch):
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            harness.run_schedule(
                model,
                [harness.tokens(B, S, 1)],
                forward_only=first == "forward_only",
                step=install_only(TRAIN_EXPERTS, fail=first == "raised"),
                seq=S,
                mbs=B,
            )
        except RuntimeError as exc:
            out["first_error"] = str(exc)
        out["action_between"] = [str(r.router_replay_action) for r in RouterReplay.global_router_replay_instances]
        spy.calls.clear()
        harness.run_schedule(
            model, [harness.tokens(B, S, 2)], forward_only=False, step=install_only(LOGPROB_EXPERTS), seq=S, mbs=B
        )
        out["second_calls"] = _experts_per_call(spy)
        out["action_after"] = [str(r.router_replay_action) for r in RouterReplay.global_router_replay_instances]
    return out


def scenario_record_set_inside_forward_step(patch: bool, forward_only: bool):
    """forward_step sets RECORD (no action before the schedule); afterwards a plain forward of
    another batch outside any schedule: stock keeps recording it."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    model = harness.build_model(moe_router_enable_expert_bias=False)
    spy = harness.RouteSpy(model)
    out: dict = {}

    def step(m, batch):
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        return _plain(m, batch)

    with _off_or_on(patch):
        harness.run_schedule(model, [harness.tokens(B, S, 1)], forward_only=forward_only, step=step, seq=S, mbs=B)
        out["action_after"] = [str(r.router_replay_action) for r in RouterReplay.global_router_replay_instances]
        spy.calls.clear()
        with torch.no_grad():
            _plain(model, harness.tokens(B, S, 2))
        recorded = RouterReplay.get_recorded_data()
        own = [c["map"] for c in spy.calls]  # the later forward's own routing, one call per layer
        out["later_forward_recorded"] = [
            rec is not None and bool(torch.equal(harness.routing_map(rec, 4), m)) for rec, m in zip(recorded, own)
        ]
    return out


# --------------------------------------------------------------------------------------
# tests


def test_stale_backward_fifo_of_a_forward_only_pass(worker):
    off = worker.run(scenario_stale_fifo, patch=False)
    # upstream: the logprob pass leaves one FIFO entry per microbatch per router, and the
    # training recompute replays the logprob pass's experts instead of its own
    assert off["fifo_between"] == [2, 2]
    assert off["train_error"] is None
    assert off["backward_experts"] and all(e == list(LOGPROB_EXPERTS) for e in off["backward_experts"])

    on = worker.run(scenario_stale_fifo, patch=True)
    assert on["fifo_between"] == [0, 0]
    assert on["train_error"] is None
    assert len(on["backward_experts"]) == 2 and all(e == list(TRAIN_EXPERTS) for e in on["backward_experts"])
    assert on["fifo_after"] == [0, 0] and on["action_after"] == ["None", "None"]


def test_stale_fifo_with_a_different_token_count_fails_upstream(worker):
    off = worker.run(scenario_stale_fifo, patch=False, train_seq=6)
    # 16 stale indices against 12 tokens' scores
    assert off["train_error"] is not None and "RuntimeError" in off["train_error"]
    on = worker.run(scenario_stale_fifo, patch=True, train_seq=6)
    assert on["train_error"] is None
    assert all(e == list(TRAIN_EXPERTS) for e in on["backward_experts"])


def test_exception_inside_forward_step(worker):
    off = worker.run(scenario_stale_fifo, patch=False, exception=True)
    assert off["first_error"] == "forward_step failed"
    assert off["fifo_between"] == [1, 1] and "REPLAY_FORWARD" in off["action_between"][0]
    assert off["backward_experts"] and all(e == list(LOGPROB_EXPERTS) for e in off["backward_experts"])

    on = worker.run(scenario_stale_fifo, patch=True, exception=True)
    assert on["first_error"] == "forward_step failed"
    assert on["fifo_between"] == [0, 0] and on["action_between"] == ["None", "None"]
    assert all(e == list(TRAIN_EXPERTS) for e in on["backward_experts"])


def test_data_installed_before_the_schedule_is_kept(worker):
    """Stale entries go, what the caller installed for this schedule stays (a blanket clear
    before the schedule would break callers that set replay data first)."""
    off = worker.run(scenario_stale_fifo, patch=False, preinstalled=True)
    assert all(e == list(LOGPROB_EXPERTS) for e in off["backward_experts"])  # upstream: stale first
    on = worker.run(scenario_stale_fifo, patch=True, preinstalled=True)
    assert on["train_error"] is None
    assert len(on["backward_experts"]) == 2 and all(e == list(TRAIN_EXPERTS) for e in on["backward_experts"])


def test_forward_only_schedule_leaves_expert_bias_counts(worker):
    off = worker.run(scenario_forward_only_counts, patch=False)
    # upstream: the logprob pass (grad enabled, forward_only=True) adds 2 microbatches x 16 tokens x top-2
    assert [sum(c) for c in off["after_logprob"]] == [sum(c) + 64 for c in off["after_train"]]

    on = worker.run(scenario_forward_only_counts, patch=True)
    assert on["after_logprob"] == on["after_train"]
    # training schedules still count (the patch does not switch counting off)
    assert [sum(c) for c in on["after_second_train"]] == [sum(c) + 32 for c in on["after_train"]]


def test_routes_installed_once_replay_in_two_schedules(worker):
    """Stock: the logprob forward, the training forward and its recompute all replay the
    routes installed once. Stock behaviour is the reference; the patch must not change it."""
    off = worker.run(scenario_install_once_two_schedules, patch=False)
    replayed = list(LOGPROB_EXPERTS)
    assert off["train_error"] is None
    assert [c for c in off["logprob_calls"]] == [["REPLAY_FORWARD", replayed]] * 2
    train_actions = sorted(a for a, _ in off["train_calls"])
    assert train_actions == ["REPLAY_BACKWARD"] * 2 + ["REPLAY_FORWARD"] * 2  # forward + recompute, 2 layers
    assert all(e == replayed for _, e in off["train_calls"])

    on = worker.run(scenario_install_once_two_schedules, patch=True)
    assert on == off


def test_record_set_once_records_every_schedule(worker):
    off = worker.run(scenario_record_across_schedules, patch=False)
    assert off["recorded_equals_own_routing"] == [[True, True], [True, True]]
    assert off["action_after"] == ["RouterReplayAction.RECORD"] * 2
    on = worker.run(scenario_record_across_schedules, patch=True)
    assert on == off


def test_two_models_interleaving_forward_only_passes(worker):
    off = worker.run(scenario_two_models_interleaved, patch=False)
    # stock: the reference replays what was installed for it in both of its passes
    assert off["reference_passes"] == [[["REPLAY_FORWARD", list(TRAIN_EXPERTS)]] * 2] * 2
    assert off["policy_passes"] == [[["REPLAY_FORWARD", list(LOGPROB_EXPERTS)]] * 2] * 2
    assert off["policy_fifo_after"] == [2, 2]  # the policy's per-microbatch installs leak
    on = worker.run(scenario_two_models_interleaved, patch=True)
    assert on["reference_passes"] == off["reference_passes"]
    assert on["policy_passes"] == off["policy_passes"]
    assert on["policy_fifo_after"] == [0, 0]  # its own installs end with each schedule
    assert on["reference_fifo_after"] == off["reference_fifo_after"] == [1, 1]  # installed before: left as is


def test_stale_routes_from_outside_a_schedule_are_dropped_with_a_warning(worker):
    off = worker.run(scenario_stale_driver_routes, patch=False)
    assert off["fifo_before"] == [1, 1]
    # stock: the recompute pops the routes replayed outside the schedule: a silent wrong backward
    assert off["backward_replays"] == {"1": [["stale"]], "2": [["stale"]]}
    assert off["warnings"] == []
    on = worker.run(scenario_stale_driver_routes, patch=True)
    assert on["backward_replays"] == {"1": [["fresh"]], "2": [["fresh"]]}
    assert len(on["warnings"]) == 1 and "installed before this schedule" in on["warnings"][0]


@pytest.mark.parametrize("first", ["train", "forward_only", "raised"])
def test_a_replay_action_the_caller_set_survives_a_schedule_that_installs_routes(worker, first):
    """The caller sets REPLAY_FORWARD once and its forward_step only installs routes: stock
    replays them in every schedule. The patch drops each schedule's unconsumed routes and gives
    the routers back the action they had when the schedule started, not none."""
    replayed = [["REPLAY_FORWARD", list(LOGPROB_EXPERTS)]] * 2  # 2 layers, no recompute
    off = worker.run(scenario_action_set_once, patch=False, first=first)
    assert off.get("first_error") == ("forward_step failed" if first == "raised" else None)
    assert off["action_between"] == ["RouterReplayAction.REPLAY_FORWARD"] * 2
    assert off["second_calls"] == replayed

    on = worker.run(scenario_action_set_once, patch=True, first=first)
    assert on == off


@pytest.mark.parametrize("forward_only", [True, False])
def test_record_set_inside_forward_step_keeps_recording_after_the_schedule(worker, forward_only):
    off = worker.run(scenario_record_set_inside_forward_step, patch=False, forward_only=forward_only)
    assert off["action_after"] == ["RouterReplayAction.RECORD"] * 2
    assert off["later_forward_recorded"] == [True, True]
    on = worker.run(scenario_record_set_inside_forward_step, patch=True, forward_only=forward_only)
    assert on == off
