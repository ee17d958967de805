"""Route sanity at the Megatron driver's entry, and where padding tokens go under replay (real
megatron-core, CPU).

Stock ``RouterReplay`` replays whatever it is given: all-zero routes (some MoE kernels return
zeros where nothing was recorded) put every token on expert 0, a duplicated expert id weighs that
expert twice, and a batch whose routes were repeated from one token routes everything to one
expert set; each silently. The driver refuses the first two (naming the trajectory and token) and
warns about the third (naming the layer). Padding: rows without a recorded route hold the dummy
route ``[0..K-1]``; replayed as such they would all land on experts 0..K-1 (at scale: one
overloaded expert, out of memory). With ``megatron.replay_padding_fallback`` they keep the
trainer's own routing, so their per-expert counts are what a stock forward gives them.
"""

from __future__ import annotations

import contextlib

import harness
import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(600)

B, S, K, E = 2, 8, 2, 4


@pytest.fixture
def worker():
    need("megatron-core")
    return harness.shared_worker()


def _err(fn) -> dict | None:
    from replay_plugin.core.errors import ReplayDataError

    try:
        fn()
    except ReplayDataError as exc:
        return {"field": exc.field, "trajectory": exc.trajectory, "token": exc.token, "message": str(exc)}
    return None


def scenario_sanity():
    import warnings

    import numpy as np
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from replay_plugin.core.errors import RouteSanityWarning
    from replay_plugin.megatron import clear_routes, replay_routes

    model = harness.build_model(num_layers=2, moe_router_enable_expert_bias=False)
    ids, attention, layout = harness.batch(seed=23, lengths=(8, 8))
    good = harness.distinct_routes(B, S, 2, K, E, seed=81)
    out: dict = {}

    # stock: whatever set_replay_data is given is replayed, silently
    spy = harness.RouteSpy(model)
    zeros = torch.zeros(S * B, K, dtype=torch.int32)
    dup = torch.as_tensor(harness.seq_major(good, 0), dtype=torch.int32).clone()
    dup[3] = torch.tensor([2, 2])
    RouterReplay.set_replay_data([zeros, dup])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        harness.forward(model, ids, layout)
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    first, second = spy.maps(1)[0], spy.maps(2)[0]
    out["stock_zero_experts_per_token"] = sorted(set(first.sum(1).tolist()))
    out["stock_zero_experts_used"] = sorted(set(torch.nonzero(first)[:, 1].tolist()))
    out["stock_dup_row_experts"] = torch.nonzero(second[3]).flatten().tolist()

    all_zero = good.copy()
    all_zero[1] = 0
    out["all_zero"] = _err(lambda: replay_routes(model, all_zero, ~attention, layout))
    twice = good.copy()
    twice[1, 5, 1] = [2, 2]
    out["twice"] = _err(lambda: replay_routes(model, twice, ~attention, layout))
    constant = good.copy()
    constant[:, :, 1] = np.array([3, 1], dtype=np.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replay = replay_routes(model, constant, ~attention, layout)
        out["constant_installed"] = list(replay.layer_numbers)
        clear_routes(model)
        replay_routes(model, good, ~attention, layout)
        clear_routes(model)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RouteSanityWarning)]

    # issue 32: every integer dtype is a route dtype (torch has no >= for uint16/32/64 on CPU:
    # NotImplementedError on 452e6a8); a placeholder trajectory among real ones is refused
    def installed(routes):
        replay = replay_routes(model, routes, ~attention, layout)
        data = [r.router_replay.target_topk_idx.clone() for _, r in harness.routers(model)]
        clear_routes(model)
        del replay
        return data

    want = installed(good)
    out["wide_dtypes"] = {}
    for dtype in (np.uint16, np.uint32, np.uint64, np.int64):
        try:
            got = installed(good.astype(dtype))
            out["wide_dtypes"][np.dtype(dtype).name] = all(torch.equal(a, b) for a, b in zip(got, want))
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            out["wide_dtypes"][np.dtype(dtype).name] = f"{type(exc).__name__}: {exc}"
    too_big = good.astype(np.uint32)
    too_big[0, 3, 0, 0] = 70_000
    out["wide_out_of_range"] = _err(lambda: replay_routes(model, too_big, ~attention, layout))
    placeholder = good.copy()
    placeholder[1] = np.arange(K, dtype=good.dtype)
    out["placeholder"] = _err(lambda: replay_routes(model, placeholder, ~attention, layout))
    return out


def test_broken_routes_are_refused_or_reported(worker):
    out = worker.run(scenario_sanity)
    # stock: all-zero routes put every token on expert 0 alone, a duplicated id drops a slot
    assert out["stock_zero_experts_per_token"] == [1] and out["stock_zero_experts_used"] == [0]
    assert out["stock_dup_row_experts"] == [2]

    z = out["all_zero"]
    assert z["field"] == "routes" and z["trajectory"] == 1
    assert "every recorded route of the trajectory is expert 0 (8 tokens x 2 layers x top-2)" in z["message"]
    t = out["twice"]
    assert (t["trajectory"], t["token"]) == (1, 5) and "the same expert twice in layer 2: [2, 2]" in t["message"]
    assert out["constant_installed"] == [1, 2]  # a warning, not a refusal
    assert out["warnings"] == [
        "replay_plugin: routes: layer 2 routes all 16 valid tokens of the batch to experts [1, 3]: recorded routes "
        "repeated for a whole batch, or a collapsed router"
    ]
    assert out["wide_dtypes"] == {"uint16": True, "uint32": True, "uint64": True, "int64": True}
    big = out["wide_out_of_range"]
    assert (big["trajectory"], big["token"]) == (0, 3) and "expert id 70000" in big["message"]
    p = out["placeholder"]
    assert (p["field"], p["trajectory"]) == ("routes", 1) and "placeholder [0, 1]" in p["message"]


def scenario_padding(fallback_patch: bool):
    """Two trajectories of 4 and 10 tokens in a grid aligned to 8 (16 columns): 18 padding rows
    holding the dummy route, marked in the router padding mask. Per layer: the experts the
    padding rows were dispatched to, and (first layer) those of a stock forward of the same grid."""
    import torch

    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import clear_routes, replay_routes

    model = harness.build_model(num_layers=2, moe_router_enable_expert_bias=False)
    seq = 16
    ids, attention, _ = harness.batch(seed=29, lengths=(4, 10), seq=seq)
    layout = TokenMetadataLayout.build(attention, packed=False, align=8)
    routes = harness.distinct_routes(B, seq, 2, K, E, seed=83)
    routes[~attention.numpy()] = [0, 1]  # pad_batch's placeholder rows
    padding = ~harness.valid_rows(layout)  # [N] sequence-major
    spy = harness.RouteSpy(model)
    with torch.no_grad():
        harness.forward(model, ids, layout)  # stock: no replay
    stock_first = spy.maps(1)[0][padding]
    spy.calls.clear()
    ctx = contextlib.nullcontext() if fallback_patch else harness.patch_off("megatron.replay_padding_fallback")
    with ctx, torch.no_grad():
        replay = replay_routes(model, routes, ~attention, layout)
        harness.forward(model, ids, layout, padding_mask=replay.padding_mask)
        clear_routes(model)
    maps = [spy.maps(n, "REPLAY_FORWARD")[0][padding] for n in (1, 2)]
    return {
        "padding_rows": int(padding.sum()),
        "padding_counts": [m.sum(0).tolist() for m in maps],
        "stock_first_counts": stock_first.sum(0).tolist(),
        "first_equals_stock": bool(torch.equal(maps[0], stock_first)),
    }


def test_padding_rows_keep_their_own_routing_and_stay_balanced(worker):
    off = worker.run(scenario_padding, fallback_patch=False)
    p = off["padding_rows"]
    assert p == 18
    # without the fallback every padding row is replayed onto the dummy experts 0 and 1
    assert off["padding_counts"] == [[p, p, 0, 0]] * 2

    on = worker.run(scenario_padding, fallback_patch=True)
    assert on["first_equals_stock"]  # the first layer's padding rows: exactly a stock forward's routing
    for counts in on["padding_counts"]:
        assert sum(counts) == p * K
        assert max(counts) < p and min(counts) > 0  # spread (measured [6, 16, 8, 6], [10, 13, 10, 3])
    assert on["padding_counts"][0] == on["stock_first_counts"]
