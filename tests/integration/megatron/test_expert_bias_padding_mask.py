"""``megatron.expert_bias_padding_mask`` on a real tiny MoE GPTModel (CPU).

Upstream (0.16.0 - 0.19.2, NVIDIA/Megatron-LM #6111): a training forward with a padding mask
and aux-loss-free expert bias crashes when tokens != experts, and miscounts when tokens ==
experts. Each test shows that with the patch reverted in the Megatron process, then the
correct count (valid tokens x top-k, equal to what the routers chose for the valid tokens)
with it applied.
"""

from __future__ import annotations

import contextlib
import json

import harness
import pytest
from support.procs import run_python
from support.upstream import need

pytestmark = pytest.mark.timeout(600)

TOPK = 2


@pytest.fixture
def worker():
    need("megatron-core")
    return harness.shared_worker()


# --------------------------------------------------------------------------------------
# scenarios (run in the Megatron worker)


def _ctx(patch: bool):
    return contextlib.nullcontext() if patch else harness.patch_off("megatron.expert_bias_padding_mask")


def scenario_forward_backward(
    patch: bool, batch: int, seq: int, experts: int, recompute: bool = False, favour: tuple = ()
):
    """One forward + backward with a padding mask; counts vs what the routers chose."""
    import torch

    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    model = harness.build_model(num_moe_experts=experts, **kw)
    for _, router in harness.routers(model):
        for e in favour:  # a large bias makes every token choose these experts
            router.expert_bias[e] = 10.0
    spy = harness.RouteSpy(model)
    ids, pos = harness.tokens(batch, seq, 5)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[0, : seq // 2] = True  # True = padding
    out: dict = {"error": None}
    with _ctx(patch):
        try:
            model(ids, pos, harness.causal_mask(seq), padding_mask=mask).float().mean().backward()
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"{type(exc).__name__}: {exc}"
    valid = ~mask.transpose(0, 1).reshape(-1)  # the routers' token order is [seq, batch]
    out["counts"] = harness.expert_bias_counts(model)
    out["expected"] = [
        sum(
            (c["map"][valid].sum(0).float() for c in spy.calls if c["layer"] == layer and c["grad"]),
            torch.zeros(experts),
        ).tolist()
        for layer, _ in harness.routers(model)
    ]
    out["router_calls_with_grad"] = sum(1 for c in spy.calls if c["grad"])
    out["valid_tokens"] = int(valid.sum())
    return out


def scenario_wrong_length_mask(patch: bool):
    """``TopKRouter._apply_expert_bias`` called through the class with masks that are not one
    flag per token: ``[1]`` (broadcast over every token) and ``[experts]``."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    model = harness.build_model(num_moe_experts=4)
    _, router = harness.routers(model)[0]
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]] * 4)  # 16 tokens, 4 experts
    routing_map = torch.zeros(16, 4, dtype=torch.bool).scatter(1, idx, True)
    out: dict = {}
    with _ctx(patch):
        for name, mask in (("one", torch.tensor([True])), ("experts", torch.tensor([True, True, False, False]))):
            router.local_tokens_per_expert.zero_()
            try:
                with torch.enable_grad():
                    TopKRouter._apply_expert_bias(router, routing_map, padding_mask=mask)
                out[name] = router.local_tokens_per_expert.tolist()
            except Exception as exc:  # noqa: BLE001
                out[name] = f"{type(exc).__name__}: {exc}"
    return out


COMPILED = r"""
import json, torch
import megatron.core
from megatron.core.transformer.moe.router import TopKRouter
from replay_plugin import registry

# A TopKRouter-typed object with just what _apply_expert_bias reads (no process groups needed),
# so the call binds through the class attribute exactly as inside TopKRouter.routing.
router = TopKRouter.__new__(TopKRouter)
torch.nn.Module.__init__(router)
router.enable_expert_bias = True
router.register_buffer("local_tokens_per_expert", torch.zeros(4))
idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]] * 4)  # 16 tokens, 4 experts
routing_map = torch.zeros(16, 4, dtype=torch.bool).scatter(1, idx, True)
mask = torch.tensor([True] * 6 + [False] * 10)
out = {"expected": routing_map[~mask].sum(0).float().tolist(),
       "compiled": hasattr(TopKRouter._apply_expert_bias, "__wrapped__")}
for patch in (False, True):
    reg = registry.get()
    reg.apply("megatron.expert_bias_padding_mask") if patch else reg.revert("megatron.expert_bias_padding_mask")
    router.local_tokens_per_expert.zero_()
    try:
        with torch.enable_grad():
            router._apply_expert_bias(routing_map, padding_mask=mask)
        out[str(patch)] = router.local_tokens_per_expert.tolist()
    except Exception as exc:
        out[str(patch)] = type(exc).__name__ + ": " + str(exc)[:300]
print("REPORT" + json.dumps(out))
"""


# --------------------------------------------------------------------------------------
# tests


def test_padding_mask_crash_then_correct_counts(worker):
    off = worker.run(scenario_forward_backward, patch=False, batch=2, seq=8, experts=4)
    assert off["error"] is not None and "must match the size of tensor" in off["error"]

    on = worker.run(scenario_forward_backward, patch=True, batch=2, seq=8, experts=4)
    assert on["error"] is None
    assert on["counts"] == on["expected"]
    assert [sum(c) for c in on["counts"]] == [on["valid_tokens"] * TOPK] * 2  # 12 valid tokens x top-2


def test_tokens_equal_experts_miscounts_silently(worker):
    # 1 x 4 tokens, 4 experts; every token chooses experts 0 and 1; tokens 0 and 1 are padding
    off = worker.run(scenario_forward_backward, patch=False, batch=1, seq=4, experts=4, favour=(0, 1))
    assert off["error"] is None  # no crash: the [4] mask broadcasts over the 4 expert columns
    assert off["expected"] == [[2.0, 2.0, 0.0, 0.0]] * 2
    assert off["counts"] == [[0.0, 0.0, 0.0, 0.0]] * 2  # experts 0 and 1 masked instead of tokens 0 and 1

    on = worker.run(scenario_forward_backward, patch=True, batch=1, seq=4, experts=4, favour=(0, 1))
    assert on["counts"] == on["expected"] == [[2.0, 2.0, 0.0, 0.0]] * 2


def test_under_activation_recompute(worker):
    off = worker.run(scenario_forward_backward, patch=False, batch=2, seq=8, experts=4, recompute=True)
    assert off["error"] is not None and "must match the size of tensor" in off["error"]  # raised in the recompute

    on = worker.run(scenario_forward_backward, patch=True, batch=2, seq=8, experts=4, recompute=True)
    assert on["error"] is None
    # counted once: the checkpointed forward runs without grad, the recompute with it
    assert on["router_calls_with_grad"] == 2
    assert on["counts"] == on["expected"]
    assert [sum(c) for c in on["counts"]] == [on["valid_tokens"] * TOPK] * 2


def test_compiled_function():
    """``jit_fuser`` is ``torch.compile`` (torch >= 2.2): the patch wraps the compiled class
    attribute, and the compiled original only counts. A fresh process with dynamo enabled."""
    need("megatron-core")
    proc = run_python(COMPILED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:])
    assert out["compiled"]
    assert out["False"].startswith("TorchRuntimeError") and "broadcast" in out["False"]
    assert out["True"] == out["expected"] == [5.0, 4.0, 5.0, 6.0]


def test_a_mask_that_is_not_one_flag_per_token_is_refused(worker):
    off = worker.run(scenario_wrong_length_mask, patch=False)
    # upstream: a [1] mask broadcasts over all 16 tokens and zeroes every count, silently; a
    # [experts] one masks expert columns (the bug the patch fixes)
    assert off["one"] == [0.0, 0.0, 0.0, 0.0]
    assert off["experts"] == [0.0, 0.0, 8.0, 8.0]
    on = worker.run(scenario_wrong_length_mask, patch=True)
    for name, shape in (("one", "[1]"), ("experts", "[4]")):
        assert on[name].startswith("ReplayDataError: field 'padding_mask'"), on[name]
        assert f"shape {shape} for a routing map of 16 tokens" in on[name] and "expected [16]" in on[name]
