"""The route-replay driver (``replay_plugin.megatron.replay_routes``) on real megatron-core
(CPU, gloo, world size 1): record in one pass, replay in the next, compare the experts every
MoE layer actually used (a forward hook on each router reads its routing map).

Each test first shows what stock Megatron does (the trainer's own routing differs from the
recorded one; ``RouterReplay.set_replay_data`` cannot address one model among several, nor a
dense-first layer pattern; the padding patch reverted), then the driver's result.
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


# --------------------------------------------------------------------------------------
# helpers (run in the Megatron worker)


def _record(model, ids, layout):
    """One RECORD pass: per router, the [N, K] indices in the routers' token order."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs = harness.routers(model)
    for _, r in rs:
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    harness.forward(model, ids, layout)
    out = {n: r.router_replay.recorded_topk_idx.clone() for n, r in rs}
    for _, r in rs:
        r.router_replay.clear_router_replay_action()
    return out


def _to_batch_routes(recorded: dict, attention, num_layers: int, dtype="uint8"):
    """Recorded [N, K] (N = A * B, sequence-major over the aligned grid) -> routes [B, S, L, K]
    plus the router padding mask, the way a trainer receives them from the engine."""
    import numpy as np
    import torch

    batch, seq = attention.shape
    routes = np.zeros((batch, seq, num_layers, K), dtype=dtype)
    routes[...] = np.arange(K)
    for layer, idx in recorded.items():
        a = idx.shape[0] // batch
        grid = idx.reshape(a, batch, K).transpose(0, 1)  # [B, A, K]
        for b in range(batch):
            pos = torch.nonzero(attention[b]).squeeze(1)
            routes[b, pos.numpy(), layer - 1] = grid[b, : len(pos)].numpy()
    return routes, ~attention


def _perturb_routers(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, r in harness.routers(model):
            r.weight.copy_(torch.randn(r.weight.shape, generator=g))


def _maps_equal(spy, layer: int, expected_idx, rows, action="REPLAY_FORWARD") -> bool:
    maps = spy.maps(layer, action)
    want = harness.routing_map(expected_idx, E)
    return bool(maps) and all(bool((m[rows] == want[rows]).all()) for m in maps)


# --------------------------------------------------------------------------------------
# scenarios


def scenario_record_then_replay():
    from replay_plugin.bench.megatron import int32_bytes_during
    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_routes

    model = harness.build_model(num_layers=3)
    ids, attention, layout = harness.batch()
    recorded = _record(model, ids, layout)
    # The routers' token order, checked independently of the driver: row s * B + b of the
    # batched record equals row s of recording trajectory b alone (causal attention).
    order_ok = True
    for b in range(B):
        alone = _record(model, ids[b : b + 1], TokenMetadataLayout.build(attention[b : b + 1], packed=False, align=1))
        for layer, idx in recorded.items():
            for s in range(layout.sequence_lengths[b]):
                order_ok &= sorted(idx[s * B + b].tolist()) == sorted(alone[layer][s].tolist())
    routes, padding = _to_batch_routes(recorded, attention, 3)
    _perturb_routers(model, seed=11)  # the trainer's router now disagrees with the engine's
    rows = harness.valid_rows(layout)
    spy = harness.RouteSpy(model)

    harness.forward(model, ids, layout)  # upstream: no replay
    own_differs = {n: not _maps_equal(spy, n, recorded[n], rows, action=None) for n in recorded}
    spy.calls.clear()

    replay, int32_bytes = int32_bytes_during(lambda: replay_routes(model, routes, padding, layout))
    out = harness.forward(model, ids, layout, padding_mask=replay.padding_mask)
    out.float().mean().backward()
    return {
        "token_order_sequence_major": order_ok,
        "own_routing_differs": own_differs,
        "replayed_equal": {n: _maps_equal(spy, n, recorded[n], rows) for n in recorded},
        "gate_grad_norms": [float(r.weight.grad.norm()) for _, r in harness.routers(model)],
        "padding_mask": replay.padding_mask.tolist(),
        "layer_numbers": list(replay.layer_numbers),
        "int32_bytes_counted": int32_bytes,
        "int32_bytes_reported": replay.int32_bytes,
        "tokens": int(rows.numel()),
        "actions_after_forward": [r.router_replay.router_replay_action.name for _, r in harness.routers(model)],
    }


def scenario_compact_dtypes():
    import torch

    from replay_plugin.megatron import clear_routes, replay_routes

    model = harness.build_model(num_layers=2, num_moe_experts=E)
    ids, attention, layout = harness.batch(seed=3)
    base = harness.distinct_routes(B, S, 2, K, E, seed=5)
    results = {}
    for dtype in ("uint8", "int16", "int32"):
        routes = base.astype(dtype)
        replay = replay_routes(model, routes, ~attention, layout)
        logits = harness.forward(model, ids, layout, padding_mask=replay.padding_mask).detach()
        results[dtype] = (torch.stack([t for t in replay.replay_data]), logits, replay.replay_data[0].dtype)
        clear_routes(model)
    ref_data, ref_logits, _ = results["uint8"]
    return {
        dtype: {
            "same_data": bool(torch.equal(d, ref_data)),
            "same_logits": bool(torch.equal(lg, ref_logits)),
            "replay_dtype": str(dt),
        }
        for dtype, (d, lg, dt) in results.items()
    }


def scenario_packed():
    """The packed (THD) layout: sequences back to back in one row, each padded to 4."""
    import torch

    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_routes

    model = harness.build_model(num_layers=2)
    ids, attention, _ = harness.batch(seed=23)
    layout = TokenMetadataLayout.build(attention, packed=True, align=4)
    routes = harness.distinct_routes(B, S, 2, K, E, seed=71)
    spy = harness.RouteSpy(model)
    replay = replay_routes(model, routes, ~attention, layout)
    x = layout.align(ids, 0)  # [1, T]
    t = x.shape[1]
    model(x, torch.arange(t)[None], harness.causal_mask(t), padding_mask=replay.padding_mask)
    real = layout.align(attention, False).reshape(-1)
    want = {n: layout.align(torch.as_tensor(routes[:, :, n - 1]).long(), torch.arange(K)).reshape(t, K) for n in (1, 2)}
    return {
        "shape": list(replay.padding_mask.shape),
        "padding_mask": replay.padding_mask.tolist(),
        "replayed_equal": [_maps_equal(spy, n, want[n], real) for n in (1, 2)],
    }


def scenario_schedule_with_recompute():
    """Two microbatches through the real schedule with full recompute: each microbatch's
    recompute (REPLAY_BACKWARD) replays its own routes; the forward hook did the switch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from replay_plugin.megatron import replay_routes

    model = harness.build_model(
        num_layers=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    spy = harness.RouteSpy(model)
    ids, attention, layout = harness.batch(seed=7)
    micro = [harness.distinct_routes(B, S, 2, K, E, seed=s) for s in (21, 22)]
    data = iter(micro)

    def forward_step(data_iterator, m):
        routes = next(data_iterator)
        replay = replay_routes(m, routes, ~attention, layout)
        return harness.forward(m, ids, layout, padding_mask=replay.padding_mask), lambda o: (o.float().mean(), {})

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[model],
        num_microbatches=2,
        seq_length=S,
        micro_batch_size=B,
        forward_only=False,
    )
    rows = harness.valid_rows(layout)
    out = {}
    for layer in (1, 2):
        fwd, bwd = spy.maps(layer, "REPLAY_FORWARD"), spy.maps(layer, "REPLAY_BACKWARD")
        want = [harness.routing_map(harness.aligned_seq_major(r, layout, layer), E) for r in micro]
        out[layer] = {
            "forward_calls": len(fwd),
            "backward_calls": len(bwd),
            "forward_ok": all(bool((f[rows] == w[rows]).all()) for f, w in zip(fwd, want)),
            "backward_ok": all(bool((b[rows] == w[rows]).all()) for b, w in zip(bwd, want)),
        }
    out["fifo_after"] = [len(r.router_replay.replay_backward_list) for _, r in harness.routers(model)]
    return out


def scenario_two_models():
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from replay_plugin.megatron import replay_routes

    policy = harness.build_model(num_layers=2, seed=0)
    reference = harness.build_model(num_layers=2, seed=1)
    ids, attention, layout = harness.batch(seed=9)
    rows = harness.valid_rows(layout)
    x = harness.distinct_routes(B, S, 2, K, E, seed=31)
    y = harness.distinct_routes(B, S, 2, K, E, seed=32)
    out = {"registry": len(RouterReplay.global_router_replay_instances)}
    try:  # upstream: one global list, no way to address one model
        RouterReplay.set_replay_data([torch.as_tensor(harness.aligned_seq_major(x, layout, n)).int() for n in (1, 2)])
        out["set_replay_data"] = "accepted"
    except ValueError as exc:
        out["set_replay_data"] = str(exc)

    spy_p, spy_r = harness.RouteSpy(policy), harness.RouteSpy(reference)
    harness.forward(reference, ids, layout)  # the reference model's own routing, nothing replayed
    own_ref = {n: spy_r.maps(n, None)[0] for n in (1, 2)}
    spy_r.calls.clear()

    rp = replay_routes(policy, x, ~attention, layout)  # install on the policy only
    harness.forward(reference, ids, layout)  # the reference runs while the policy holds replay data
    out["reference_untouched"] = all(bool(torch.equal(spy_r.maps(n, None)[0], own_ref[n])) for n in (1, 2))
    harness.forward(policy, ids, layout, padding_mask=rp.padding_mask)
    out["policy_replays_x"] = all(_maps_equal(spy_p, n, harness.aligned_seq_major(x, layout, n), rows) for n in (1, 2))
    spy_p.calls.clear()
    spy_r.calls.clear()

    rp = replay_routes(policy, x, ~attention, layout)  # both installed before either forward
    rr = replay_routes(reference, y, ~attention, layout)
    harness.forward(policy, ids, layout, padding_mask=rp.padding_mask)
    harness.forward(reference, ids, layout, padding_mask=rr.padding_mask)
    out["both_policy_x"] = all(_maps_equal(spy_p, n, harness.aligned_seq_major(x, layout, n), rows) for n in (1, 2))
    out["both_reference_y"] = all(_maps_equal(spy_r, n, harness.aligned_seq_major(y, layout, n), rows) for n in (1, 2))
    return out


def scenario_dense_first(layer_number_patch: bool):
    """Layer 1 dense, layers 2 and 3 MoE (``moe_layer_freq=[0, 1, 1]``)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from replay_plugin.megatron import clear_routes, replay_routes

    ctx = contextlib.nullcontext() if layer_number_patch else harness.patch_off("megatron.router_layer_number")
    with ctx:
        model = harness.build_model(num_layers=3, moe_layer_freq=[0, 1, 1])
    ids, attention, layout = harness.batch(seed=13)
    rows = harness.valid_rows(layout)
    routes = harness.distinct_routes(B, S, 3, K, E, seed=41)
    out = {
        "patch_state": harness.patch_state("megatron.router_layer_number"),
        "router_layer_numbers": [n for n, _ in harness.routers(model)],
        "replay_layer_numbers": [
            getattr(rr, "layer_number", None) for rr in RouterReplay.global_router_replay_instances
        ],
    }
    spy = harness.RouteSpy(model)
    # Positional mapping (the instance list has 2 entries for 3 layers): layers 1 and 2's data.
    RouterReplay.set_replay_data([harness.aligned_seq_major(routes, layout, n).int() for n in (1, 2)])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    harness.forward(model, ids, layout)
    out["positional_layer2_gets"] = [
        n for n in (1, 2, 3) if _maps_equal(spy, 2, harness.aligned_seq_major(routes, layout, n), rows)
    ]
    clear_routes(model)
    spy.calls.clear()

    replay = replay_routes(model, routes, ~attention, layout)
    harness.forward(model, ids, layout, padding_mask=replay.padding_mask)
    out["driver_layers"] = list(replay.layer_numbers)
    out["driver_ok"] = all(_maps_equal(spy, n, harness.aligned_seq_major(routes, layout, n), rows) for n in (2, 3))
    return out


def scenario_padding_rows(fallback_patch: bool):
    """Rows marked in the router padding mask (a synthetic EOS source): with the fallback
    patch the trainer's own router routes them, without it they replay the dummy route."""
    import torch

    from replay_plugin.megatron import replay_routes

    model = harness.build_model(num_layers=2)
    for _, r in harness.routers(model):
        r.expert_bias[2] = r.expert_bias[3] = 10.0  # the trainer's own router picks experts 2 and 3
    ids, attention, layout = harness.batch(seed=17, lengths=(8, 8))
    routes = harness.distinct_routes(B, S, 2, K, E, seed=51)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, 6] = True  # the source of a synthetic EOS: no recorded route
    routes[1, 6] = [0, 1]  # its placeholder: the dummy route
    spy = harness.RouteSpy(model)
    ctx = contextlib.nullcontext() if fallback_patch else harness.patch_off("megatron.replay_padding_fallback")
    with ctx:
        replay = replay_routes(model, routes, padding, layout)
        harness.forward(model, ids, layout, padding_mask=replay.padding_mask).float().mean().backward()
    row = 6 * B + 1  # sequence-major index of (b=1, s=6)
    others = torch.ones(S * B, dtype=torch.bool)
    others[row] = False
    return {
        "marked_row_experts": [
            sorted(torch.nonzero(spy.maps(n, "REPLAY_FORWARD")[0][row]).squeeze(1).tolist()) for n in (1, 2)
        ],
        "other_rows_replayed": all(
            _maps_equal(spy, n, harness.aligned_seq_major(routes, layout, n), others) for n in (1, 2)
        ),
        "own_rows": int(replay.own_rows.sum()),
    }


def scenario_refusals():
    """Typed errors for configurations where replay would do nothing and for bad inputs."""
    import numpy as np
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import clear_routes, replay_layers, replay_routes

    ids, attention, layout = harness.batch(seed=19)
    good = harness.distinct_routes(B, S, 2, K, E, seed=61)
    out: dict = {}

    def err(fn):
        try:
            fn()
        except (ReplayDataError, ReplayTypeError) as exc:
            return {
                "type": type(exc).__name__,
                "field": exc.field,
                "trajectory": exc.trajectory,
                "token": exc.token,
                "message": str(exc),
            }
        return None

    # sinkhorn: upstream ignores RouterReplay silently
    sink = harness.build_model(
        num_layers=2,
        moe_router_load_balancing_type="sinkhorn",
        moe_router_topk=1,
        moe_router_score_function="softmax",
        moe_router_enable_expert_bias=False,
    )
    spy = harness.RouteSpy(sink)
    forced = torch.full((S * B, 1), 3, dtype=torch.int32)
    RouterReplay.set_replay_data([forced, forced])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    harness.forward(sink, ids, layout)
    out["sinkhorn_upstream_replayed"] = bool(spy.maps(1, "REPLAY_FORWARD")[0][:, 3].all())
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    out["sinkhorn"] = err(lambda: replay_layers(sink))

    fused = harness.build_model(num_layers=2)
    fused.config.moe_router_fusion = True  # shared with every router
    out["fusion"] = err(lambda: replay_routes(fused, good, ~attention, layout))
    out["no_replay"] = err(lambda: replay_layers(harness.build_model(num_layers=2, moe_enable_routing_replay=False)))

    model = harness.build_model(num_layers=2)
    bad_id = good.copy()
    bad_id[1, 5, 1, 0] = 9
    out["expert_id"] = err(lambda: replay_routes(model, bad_id, ~attention, layout))
    out["layers"] = err(lambda: replay_routes(model, good[:, :, :1], ~attention, layout))
    out["topk"] = err(lambda: replay_routes(model, np.concatenate([good, good[..., :1]], -1), ~attention, layout))
    out["float"] = err(lambda: replay_routes(model, good.astype(np.float32), ~attention, layout))
    out["int_mask"] = err(lambda: replay_routes(model, good, (~attention).int(), layout))
    out["shape"] = err(lambda: replay_routes(model, good[:1], ~attention[:1], layout))
    cp_layout = TokenMetadataLayout.build(attention, packed=True, align=4, cp_size=2, cp_rank=0)
    out["cp"] = err(lambda: replay_routes(model, good, ~attention, cp_layout))
    neg = good.astype(np.int16)
    neg[0, 0] = -1  # row 0 is left-padded: position 0 carries no token
    neg_mask = ~attention
    neg_mask[1, 7] = True  # a row without a recorded route holding -1 placeholders
    neg[1, 7] = -1
    out["negative_in_rows_without_route"] = err(
        lambda: (replay_routes(model, neg, neg_mask, layout), clear_routes(model))
    )
    neg[1, 6, 0, 1] = -1
    out["negative_in_a_route"] = err(lambda: replay_routes(model, neg, neg_mask, layout))
    replay_routes(model, good, ~attention, layout)  # installed, but the model never runs
    out["pending"] = err(lambda: replay_routes(model, good, ~attention, layout))
    clear_routes(model)
    out["after_clear"] = err(lambda: replay_routes(model, good, ~attention, layout))
    return out


def scenario_fifo_bounded(forward_only: bool, recompute: bool, microbatches: int = 4):
    """Per microbatch, the FIFO lengths when forward_step starts and the storages of the
    installed data; and whether each recompute replayed its own microbatch."""
    import contextlib as _contextlib

    import torch

    from replay_plugin.megatron import replay_routes

    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    model = harness.build_model(num_layers=2, **extra)
    spy = harness.RouteSpy(model)
    ids, attention, layout = harness.batch(seed=7)
    micro = [harness.distinct_routes(B, S, 2, K, E, seed=80 + i) for i in range(microbatches)]
    out: dict = {"fifo_at_start": [], "own_storage": []}

    def step(m, routes):
        out["fifo_at_start"].append([len(r.router_replay.replay_backward_list) for _, r in harness.routers(m)])
        replay = replay_routes(m, routes, ~attention, layout)
        ptrs = {t.untyped_storage().data_ptr() for t in replay.replay_data}
        out["own_storage"].append(
            len(ptrs) == len(replay.replay_data)
            and all(t.untyped_storage().nbytes() == t.numel() * 4 for t in replay.replay_data)
        )
        return harness.forward(m, ids, layout, padding_mask=replay.padding_mask)

    with torch.no_grad() if forward_only else _contextlib.nullcontext():
        harness.run_schedule(model, micro, forward_only=forward_only, step=step, seq=S, mbs=B)
    rows = harness.valid_rows(layout)
    out["backward_ok"] = all(
        bool((m[rows] == harness.routing_map(harness.aligned_seq_major(r, layout, layer), E)[rows]).all())
        for layer in (1, 2)
        for m, r in zip(spy.maps(layer, "REPLAY_BACKWARD"), micro)
    )
    out["backward_calls"] = len(spy.maps(1, "REPLAY_BACKWARD"))
    out["fifo_after"] = [len(r.router_replay.replay_backward_list) for _, r in harness.routers(model)]
    return out


def scenario_non_reentrant_checkpoint():
    """The whole model under torch's non-reentrant checkpoint: the router runs with grad enabled
    in the forward and is still recomputed, so its FIFO entry must stay for the backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from replay_plugin.megatron import replay_routes

    model = harness.build_model(num_layers=2)
    spy = harness.RouteSpy(model)
    ids, attention, layout = harness.batch(seed=8)
    routes = harness.distinct_routes(B, S, 2, K, E, seed=90)
    replay = replay_routes(model, routes, ~attention, layout)
    out = checkpoint(lambda: harness.forward(model, ids, layout, padding_mask=replay.padding_mask), use_reentrant=False)
    fifo_after_forward = [len(r.router_replay.replay_backward_list) for _, r in harness.routers(model)]
    error = None
    try:
        out.float().mean().backward()
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    rows = harness.valid_rows(layout)
    return {
        "fifo_after_forward": fifo_after_forward,
        "error": error,
        "recompute_ok": [
            _maps_equal(spy, n, harness.aligned_seq_major(routes, layout, n), rows, "REPLAY_BACKWARD") for n in (1, 2)
        ],
        "grad_enabled_in_forward": torch.is_grad_enabled(),
    }


def scenario_combined_1f1b(patch: bool):
    """``overlap_moe_expert_parallel_comm`` set on a model the driver replays on: forward-only
    schedules run the plain path; a training schedule would run combined 1F1B."""
    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.megatron import replay_routes

    model = harness.build_model(num_layers=2)
    ids, attention, layout = harness.batch(seed=9)
    routes = harness.distinct_routes(B, S, 2, K, E, seed=91)
    calls = []

    def step(m, _):
        calls.append(1)
        replay = replay_routes(m, routes, ~attention, layout)
        return harness.forward(m, ids, layout, padding_mask=replay.padding_mask)

    out: dict = {}
    ctx = contextlib.nullcontext() if patch else harness.patch_off("megatron.router_replay_scope")
    with ctx:
        harness.run_schedule(model, [None], forward_only=True, step=step, seq=S, mbs=B)
        # Set after construction: TransformerConfig refuses the setting without expert
        # parallelism, which the CPU tests cannot run.
        model.config.overlap_moe_expert_parallel_comm = True
        try:
            harness.run_schedule(model, [None], forward_only=True, step=step, seq=S, mbs=B)
            out["forward_only"] = None
        except Exception as exc:  # noqa: BLE001
            out["forward_only"] = f"{type(exc).__name__}: {exc}"
        calls.clear()
        try:
            harness.run_schedule(model, [None, None], forward_only=False, step=step, seq=S, mbs=B)
            out["training"] = None
        except ReplayDataError as exc:
            out["training"] = {"type": type(exc).__name__, "field": exc.field, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the combined-1F1B schedule itself (needs CUDA)
            out["training"] = {"type": type(exc).__name__, "field": None, "message": str(exc)[:200]}
        out["forward_steps_run"] = len(calls)
    return out


def scenario_mtp_router_numbers():
    """A model with one MTP depth: the routers' layer numbers, and the ones the driver replays."""
    import inspect

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from replay_plugin.megatron import replay_layers

    cfg = harness.config(num_layers=2, mtp_num_layers=1)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    kw = (
        {"use_transformer_engine": False}
        if "use_transformer_engine" in inspect.signature(get_gpt_mtp_block_spec).parameters
        else {}
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=harness.VOCAB,
        max_sequence_length=harness.MAX_SEQ,
        mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, **kw),
    )
    return {
        "routers": {
            name: m.layer_number
            for name, m in model.named_modules()
            if hasattr(m, "router_replay") and hasattr(m, "routing")
        },
        "replayed": list(replay_layers(model)),
    }


# --------------------------------------------------------------------------------------
# tests


def test_record_then_replay_every_layer(worker):
    out = worker.run(scenario_record_then_replay)
    assert out["token_order_sequence_major"]  # routers see [seq, batch]: token n = s * B + b
    # upstream, no replay: the perturbed trainer routes differently from what was recorded
    assert all(out["own_routing_differs"].values())
    # replayed experts equal the recorded ones in every MoE layer, on every real token
    assert out["replayed_equal"] == {"1": True, "2": True, "3": True}
    assert out["layer_numbers"] == [1, 2, 3]
    assert all(g > 0 for g in out["gate_grad_norms"])  # gate weights still get gradients
    assert out["padding_mask"][0] == [False] * 5 + [True] * 3 and out["padding_mask"][1] == [False] * 8
    # only the int32 block the routers take is materialised: tokens x layers x topk x 4 bytes
    assert out["int32_bytes_counted"] == out["int32_bytes_reported"] == out["tokens"] * 3 * K * 4
    assert out["actions_after_forward"] == ["REPLAY_BACKWARD"] * 3  # switched by the forward hook


def test_compact_dtypes_give_identical_results(worker):
    out = worker.run(scenario_compact_dtypes)
    for dtype in ("uint8", "int16", "int32"):
        assert out[dtype] == {"same_data": True, "same_logits": True, "replay_dtype": "torch.int32"}, dtype


def test_packed_layout(worker):
    out = worker.run(scenario_packed)
    # lengths 5 and 8, each padded to a multiple of 4: [5 tokens, 3 pad, 8 tokens]
    assert out["shape"] == [1, 16]
    assert out["padding_mask"] == [[False] * 5 + [True] * 3 + [False] * 8]
    assert out["replayed_equal"] == [True, True]


def test_backward_recompute_replays_each_microbatch(worker):
    out = worker.run(scenario_schedule_with_recompute)
    for layer in ("1", "2"):
        assert out[layer] == {"forward_calls": 2, "backward_calls": 2, "forward_ok": True, "backward_ok": True}
    assert out["fifo_after"] == [0, 0]


def test_two_models_do_not_cross_talk(worker):
    out = worker.run(scenario_two_models)
    assert out["registry"] == 4
    assert "does not match instances (4)" in out["set_replay_data"]  # upstream cannot address one model
    assert out["reference_untouched"] and out["policy_replays_x"]
    assert out["both_policy_x"] and out["both_reference_y"]


def test_dense_first_then_moe(worker):
    import importlib.metadata

    from packaging.version import Version

    native = Version(importlib.metadata.version("megatron-core")) >= Version("0.19.0")
    off = worker.run(scenario_dense_first, layer_number_patch=False)
    assert off["router_layer_numbers"] == [2, 3]
    # without the patch RouterReplay has no layer identity before 0.19 (PR #5220)
    assert off["replay_layer_numbers"] == ([2, 3] if native else [None, None])
    # position in the instance list is not the layer: router 2 got layer 1's (dense) data
    assert off["positional_layer2_gets"] == [1]
    assert off["driver_layers"] == [2, 3] and off["driver_ok"]

    on = worker.run(scenario_dense_first, layer_number_patch=True)
    assert on["patch_state"] == ("not-needed" if native else "applied")
    assert on["replay_layer_numbers"] == [2, 3]
    assert on["driver_ok"]


def test_padding_rows_use_the_trainers_own_routing(worker):
    off = worker.run(scenario_padding_rows, fallback_patch=False)
    assert off["marked_row_experts"] == [[0, 1], [0, 1]]  # upstream: the dummy route is replayed
    assert off["other_rows_replayed"]
    on = worker.run(scenario_padding_rows, fallback_patch=True)
    assert on["marked_row_experts"] == [[2, 3], [2, 3]]  # the trainer's own top-k
    assert on["other_rows_replayed"] and on["own_rows"] == 1


def test_refusals_name_the_field(worker):
    out = worker.run(scenario_refusals)
    assert out["sinkhorn_upstream_replayed"] is False  # upstream ignores replay silently
    assert (
        out["sinkhorn"]["type"] == "ReplayConfigError" and out["sinkhorn"]["field"] == "moe_router_load_balancing_type"
    )
    assert out["fusion"]["field"] == "moe_router_fusion" and "do nothing" in out["fusion"]["message"]
    assert out["no_replay"]["field"] == "moe_enable_routing_replay"
    assert out["expert_id"]["field"] == "routes" and (out["expert_id"]["trajectory"], out["expert_id"]["token"]) == (
        1,
        5,
    )
    assert "layer 2" in out["expert_id"]["message"] and "[0, 4)" in out["expert_id"]["message"]
    assert out["layers"]["field"] == "routes" and "1 layers" in out["layers"]["message"]
    assert out["topk"]["field"] == "routes" and "moe_router_topk = 2" in out["topk"]["message"]
    assert out["float"]["type"] == "ReplayTypeError"
    assert out["int_mask"]["type"] == "ReplayTypeError" and out["int_mask"]["field"] == "router_padding_mask"
    assert out["shape"]["field"] == "routes"
    assert out["cp"]["field"] == "layout" and "context-parallel" in out["cp"]["message"]
    assert out["negative_in_rows_without_route"] is None  # replaced by the dummy route
    assert (out["negative_in_a_route"]["trajectory"], out["negative_in_a_route"]["token"]) == (1, 6)
    assert "expert id -1 in layer 1" in out["negative_in_a_route"]["message"]
    assert out["pending"]["field"] == "model" and "REPLAY_BACKWARD" in out["pending"]["message"]
    assert out["after_clear"] is None


@pytest.mark.parametrize("forward_only, recompute", [(True, False), (False, False), (False, True)])
def test_route_memory_bounded_by_microbatches_in_flight(worker, forward_only, recompute):
    out = worker.run(scenario_fifo_bounded, forward_only=forward_only, recompute=recompute)
    assert all(out["own_storage"])  # each layer's entry owns its rows (no shared [L, N, K] block)
    # no entry of an earlier microbatch is still queued when the next one starts: forward-only and
    # no-recompute entries are released when the forward returns, recomputed ones when popped
    assert out["fifo_at_start"] == [[0, 0]] * 4
    assert out["fifo_after"] == [0, 0]
    assert out["backward_calls"] == (4 if recompute else 0) and out["backward_ok"]


def test_non_reentrant_checkpoint_keeps_the_entry_for_its_recompute(worker):
    out = worker.run(scenario_non_reentrant_checkpoint)
    assert out["grad_enabled_in_forward"]
    assert out["fifo_after_forward"] == [1, 1]  # saved-tensor hooks active: a recompute will pop it
    assert out["error"] is None and out["recompute_ok"] == [True, True]


def test_combined_1f1b_is_refused_before_the_schedule_runs(worker):
    on = worker.run(scenario_combined_1f1b, patch=True)
    assert on["forward_only"] is None  # forward-only schedules never take the combined path
    assert on["training"]["type"] == "ReplayConfigError"
    assert on["training"]["field"] == "overlap_moe_expert_parallel_comm"
    assert "switch_to_backward" not in on["training"]["message"]
    assert on["forward_steps_run"] == 0  # refused up front, nothing installed
    # Without the scope patch the schedule is unknown to the driver: replay_routes refuses even a
    # forward-only pass (on CPU the training schedule itself then fails creating CUDA streams)
    off = worker.run(scenario_combined_1f1b, patch=False)
    assert off["forward_only"] is not None and "overlap_moe_expert_parallel_comm" in off["forward_only"]


def test_mtp_routers_numbered_per_version_and_not_replayed(worker):
    import importlib.metadata

    from packaging.version import Version

    out = worker.run(scenario_mtp_router_numbers)
    mtp = {n: v for n, v in out["routers"].items() if n.startswith("mtp.")}
    decoder = sorted(v for n, v in out["routers"].items() if n.startswith("decoder."))
    assert decoder == [1, 2] and len(mtp) == 1
    # 0.16.x: num_layers + depth; from 0.17.0 (is_mtp_layer, no layer offset): the depth itself,
    # colliding with decoder layer 1
    native = Version(importlib.metadata.version("megatron-core")) >= Version("0.17.0")
    assert list(mtp.values()) == ([1] if native else [3])
    assert out["replayed"] == [1, 2]
