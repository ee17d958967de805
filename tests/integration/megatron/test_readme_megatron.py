"""The README's Megatron blocks run as written on real megatron-core (CPU, gloo, world size 1):
``megatron-batch`` batches vLLM-shaped routes and support rows on the host, ``megatron-forward-step``
defines the ``forward_step`` that Megatron's own schedule (``get_forward_backward_func``, full
activation recompute) then runs. The routers replay the given routes in the forward and in the
recompute; the logprobs equal an explicit reference over the support rows (a one-member support
gives 0); gradients reach the model.
"""

from __future__ import annotations

import harness
import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(600)

K, E, T = 2, 4, 3  # top-k, experts, response tokens per trajectory
LENGTHS, SEQ = (6, 8), 8


@pytest.fixture
def worker():
    need("megatron-core")
    return harness.shared_worker()


def _support_rows(ids, rng):
    """Per trajectory: rows for its last T tokens; the first row holds the sampled token alone."""
    import numpy as np

    from replay_plugin.core.support import SupportRows

    rows, responses = [], []
    for b in range(ids.shape[0]):
        resp = ids[b, -T:].numpy().astype(np.int32)
        support = np.full((T, 4), -1, dtype=np.int32)
        for j, tok in enumerate(resp):
            others = rng.choice([t for t in range(harness.VOCAB) if t != tok], 3, replace=False)
            support[j] = [tok, *others] if j else [tok, -1, -1, -1]
        rows.append(SupportRows(support, resp, np.zeros(T, np.float32), np.ones(T, bool)))
        responses.append(resp)
    return rows, responses


def scenario_readme_blocks():
    import os
    import sys

    import numpy as np
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    sys.path.insert(0, os.path.dirname(os.path.dirname(harness.HERE)))
    import readme_blocks

    from replay_plugin.megatron import clear_routes, replay_routes

    model = harness.build_model(
        num_layers=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    ids, attention, layout = harness.batch(seed=3, lengths=LENGTHS, seq=SEQ)
    rng = np.random.default_rng(0)
    route_arrays = [harness.distinct_routes(1, n - 1, 2, K, E, seed=50 + b)[0] for b, n in enumerate(LENGTHS)]
    rows, responses = _support_rows(ids, rng)
    host = readme_blocks.run(
        "megatron-batch",
        {
            "route_arrays": route_arrays,  # vLLM: [P + T - 1, L, K] per trajectory
            "attention_mask": attention,
            "rows": rows,
            "response_ids": responses,
            "loss_masks": [np.ones(T, np.int64) for _ in LENGTHS],
            "S": SEQ,
            "eos": 0,
            "V": harness.VOCAB,
        },
    )
    seen = {}

    def policy_loss(logprobs, mb):
        seen["logprobs"] = logprobs.detach().clone()
        return -logprobs.sum()

    step = readme_blocks.run(
        "megatron-forward-step",
        {"tp_size": 1, "pad_id": 0, "sampling_temperature": 1.0, "num_actions": T, "policy_loss": policy_loss},
    )
    mb = {k: host[k] for k in ("routes", "router_padding_mask", "support")}
    mb.update(input_ids=ids, attention_mask=attention)
    spy = harness.RouteSpy(model)
    losses = get_forward_backward_func()(
        forward_step_func=step["forward_step"],
        data_iterator=iter([mb]),
        model=[model],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=len(LENGTHS),
        forward_only=False,
    )
    spy.remove()

    routes, rpm = host["routes"], host["router_padding_mask"]
    replayed = harness.valid_rows(layout) & ~layout.align(rpm.long(), 1).bool().transpose(0, 1).reshape(-1)
    out = {"loss": float(losses[0]["loss"]), "replayed_rows": int(replayed.sum())}
    for layer in (1, 2):
        want = harness.routing_map(harness.aligned_seq_major(routes, layout, layer), E)[replayed]
        fwd, bwd = spy.maps(layer, "REPLAY_FORWARD"), spy.maps(layer, "REPLAY_BACKWARD")
        out[f"forward_{layer}"] = len(fwd) == 1 and bool((fwd[0][replayed] == want).all())
        out[f"recompute_{layer}"] = len(bwd) == 1 and bool((bwd[0][replayed] == want).all())
    out["grad_norm"] = float(sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5)

    # explicit reference: the same replayed forward, each response token's predicting logits
    # gathered on its support row (token at column n - T + j of the [B, A] grid, logits at the
    # column before), minus their logsumexp
    with torch.no_grad():
        replay = replay_routes(model, routes, rpm, layout)
        x = layout.align(ids, 0)
        logits = model(x, torch.arange(x.shape[1]).expand_as(x), None, padding_mask=replay.padding_mask)
        clear_routes(model)
    support = torch.from_numpy(host["support"].ids)
    ref = torch.zeros(len(LENGTHS), T)
    for b, n in enumerate(LENGTHS):
        for j in range(T):
            members = support[b, SEQ - T + j]
            members = members[members >= 0].long()
            z = logits[b, n - T + j - 1].float()
            ref[b, j] = z[int(x[b, n - T + j])] - torch.logsumexp(z[members], 0)
    got = seen["logprobs"]
    out["shape"] = list(got.shape)
    out["max_err"] = float((got - ref).abs().max())
    out["one_member_rows"] = got[:, 0].abs().max().item()
    out["others_negative"] = bool((got[:, 1:] < 0).all())
    return out


def test_readme_megatron_blocks_run_in_megatrons_schedule(worker):
    out = worker.run(scenario_readme_blocks)
    assert out["replayed_rows"] == sum(n - 1 for n in LENGTHS)
    assert all(out[f"{p}_{layer}"] for p in ("forward", "recompute") for layer in (1, 2)), out
    assert out["shape"] == [len(LENGTHS), T]
    assert out["max_err"] < 1e-5, out
    assert out["one_member_rows"] < 1e-6 and out["others_negative"], out
    assert out["grad_norm"] > 0 and out["loss"] == out["loss"]


ADDING_A_PATCH = r"""
import json, sys
sys.path.insert(0, {tests!r})
import readme_blocks
import megatron.core.transformer.moe.router as router
from replay_plugin import registry
from replay_plugin.patcher import Patcher, PluginWrapper

stock = router.TopKRouter.__dict__["_apply_expert_bias"]
reg = registry.get()
reg.load_packs()
spec = reg.specs["megatron.expert_bias_padding_mask"]
ns = readme_blocks.run("adding-a-patch", {{"Patcher": Patcher}})
patcher = Patcher(spec)
ns["install"](patcher)
wrapped = router.TopKRouter.__dict__["_apply_expert_bias"]
out = {{"stock_plain": type(stock) is not PluginWrapper,
       "wrapped": type(wrapped) is PluginWrapper and wrapped._self_wrapper is ns["_fixed"]}}
patcher.revert()
out["reverted"] = router.TopKRouter.__dict__["_apply_expert_bias"] is stock
try:
    patcher.wrap("TopKRouter.routing", ns["_fixed"])
except Exception as exc:
    out["undeclared"] = type(exc).__name__
print("@@" + json.dumps(out))
"""


def test_adding_a_patch_block_wraps_a_declared_target():
    """The "Adding a patch" fragment's ``install`` wraps the matrix target it names through the
    Patcher the registry hands to a patch (its own patch switched off here, so the target is
    stock), and the revert restores it; a target the matrix does not list is refused."""
    need("megatron-core")
    import json
    import os

    from support.procs import run_python

    tests = os.path.dirname(os.path.dirname(harness.HERE))
    proc = run_python(
        ADDING_A_PATCH.format(tests=tests), env={"REPLAY_PLUGIN_MEGATRON_EXPERT_BIAS_PADDING_MASK": "0"}, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("@@")][-1][2:])
    assert out == {"stock_plain": True, "wrapped": True, "reverted": True, "undeclared": "UndeclaredTargetError"}
