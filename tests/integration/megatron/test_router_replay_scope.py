"""``megatron.router_replay_scope`` on real megatron-core schedules (CPU, gloo, world size 1).

Upstream's RouterReplay API is driven the way RL frameworks drive it (``set_replay_data`` +
``set_global_router_replay_action`` in ``forward_step``, ``REPLAY_BACKWARD`` after the
forward), with full activation recompute so that the backward pass pops the FIFO. Each test
runs the same scenario with the patch reverted in the Megatron process (upstream behaviour),
then applied.
"""

from __future__ import annotations

import contextlib

import harness
import pytest
from conftest import need

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
