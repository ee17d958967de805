"""Replay across ranks: two real gloo processes on 127.0.0.1 (one subprocess for the test).

Phase 1, pipeline parallel (PP=2, 4 MoE layers, 1F1B schedule with full recompute, 3
microbatches with different routes): each stage holds 2 routers; upstream's global
``set_replay_data`` cannot take the model's routes; ``RouterReplay`` has no layer number before
0.19 unless ``megatron.router_layer_number`` records it; the driver installs only the stage's
layers (only that slice is ever int32, counted by a ``TorchDispatchMode``) and every forward
and recompute replays its own microbatch's routes.

Phase 2, virtual pipeline (PP=2 x VP=2, 4 microbatches, interleaved 1F1B with recompute): with
the stock API every chunk's forward appends to every router's FIFO on the rank, and the
recompute of microbatches 2 and 3 replays microbatches 0 and 1; the driver installs per chunk.

Phase 3, tensor parallel with sequence parallelism (TP=2, SP): each rank's routers see half of
the sequence; the driver slices the routes to it. On a pipeline stage that does not start the
model (``pre_process=False``), ``GPTModel`` does not scatter ``padding_mask`` for sequence
parallelism: the full mask makes the router's expert-bias token count raise a RuntimeError stock (a
broadcasting error: the mask's B * A entries against the rank's B * A / 2 tokens) and, with the
plugin's expert-bias fix, a ReplayDataError naming both sizes; the driver hands over the rank's
shard and the expert-bias counts match the valid tokens.
"""

from __future__ import annotations

import harness
import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(900)

B, S, K, E = 2, 8, 2, 4
LENGTHS = (6, 8)  # row 1 fills the sequence, so every microbatch has A = S (fixed p2p shapes)


def _pipeline(rank: int) -> dict:
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from replay_plugin.bench.megatron import int32_bytes_during
    from replay_plugin.megatron import replay_routes

    first, last = rank == 0, rank == 1
    kw = dict(
        num_layers=4,
        pipeline_model_parallel_size=2,
        batch_p2p_comm=False,
        moe_router_enable_expert_bias=False,
        pre_process=first,
        post_process=last,
    )
    out: dict = {}
    with harness.patch_off("megatron.router_layer_number"):
        harness.build_model(**kw)
    out["replay_layer_numbers_off"] = [
        getattr(r, "layer_number", None) for r in RouterReplay.global_router_replay_instances
    ]
    RouterReplay.global_router_replay_instances.clear()

    model = harness.build_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, **kw)
    out["replay_layer_numbers_on"] = [r.layer_number for r in RouterReplay.global_router_replay_instances]
    out["router_layer_numbers"] = [n for n, _ in harness.routers(model)]
    try:  # upstream: replay data for the model's 4 layers on a stage with 2 routers
        RouterReplay.set_replay_data([torch.zeros(B * S, K, dtype=torch.int32)] * 4)
        out["set_replay_data"] = "accepted"
    except ValueError as exc:
        out["set_replay_data"] = str(exc)
        RouterReplay.clear_global_indices()

    ids, attention, layout = harness.batch(seed=3, lengths=LENGTHS, seq=S)
    micro = [harness.distinct_routes(B, S, 4, K, E, seed=100 + i) for i in range(3)]
    spy = harness.RouteSpy(model)
    data = iter(micro)
    counted: list = []

    def forward_step(data_iterator, m):
        routes = next(data_iterator)
        replay, nbytes = int32_bytes_during(lambda: replay_routes(m, routes, ~attention, layout))
        counted.append((nbytes, replay.int32_bytes, list(replay.layer_numbers)))
        return harness.forward(m, ids, layout, padding_mask=replay.padding_mask), lambda o: (o.float().mean(), {})

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[model],
        num_microbatches=3,
        seq_length=S,
        micro_batch_size=B,
        forward_only=False,
    )
    rows = harness.valid_rows(layout)
    checks = {}
    for layer in out["router_layer_numbers"]:
        want = [harness.routing_map(harness.aligned_seq_major(r, layout, layer), E) for r in micro]
        fwd, bwd = spy.maps(layer, "REPLAY_FORWARD"), spy.maps(layer, "REPLAY_BACKWARD")
        checks[layer] = {
            "calls": [len(fwd), len(bwd)],
            "forward_ok": all(bool((f[rows] == w[rows]).all()) for f, w in zip(fwd, want)),
            "backward_ok": all(bool((b[rows] == w[rows]).all()) for b, w in zip(bwd, want)),
        }
    out["checks"] = checks
    out["int32"] = counted
    out["tokens"] = int(rows.numel())
    out["global_int32_bytes"] = int(torch.from_numpy(micro[0]).to(torch.int32).nbytes)
    return out


def _virtual_pipeline(rank: int) -> dict:
    """PP=2 x VP=2: each rank holds two model chunks of one layer each (rank 0: layers 1 and 3,
    rank 1: layers 2 and 4); all four share one RouterReplay registry per process."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from replay_plugin.megatron import replay_routes

    harness.reinit_parallel(pp=2, vp=2)
    RouterReplay.global_router_replay_instances.clear()
    chunks = [
        harness.build_model(
            num_layers=4,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            batch_p2p_comm=False,
            moe_router_enable_expert_bias=False,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
            vp_stage=v,
            pre_process=rank == 0 and v == 0,
            post_process=rank == 1 and v == 1,
        )
        for v in (0, 1)
    ]
    ids, attention, layout = harness.batch(seed=4, lengths=LENGTHS, seq=S)
    micro = [harness.distinct_routes(B, S, 4, K, E, seed=300 + i) for i in range(4)]
    rows = harness.valid_rows(layout)
    mine = [[n for n, _ in harness.routers(c)] for c in chunks]

    def upstream_step(data_iterator, m):  # the stock API: all of this rank's layers, every chunk
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routes = next(data_iterator)
        RouterReplay.set_replay_data([harness.aligned_seq_major(routes, layout, n[0]).int() for n in mine])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        out = harness.forward(m, ids, layout)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return out, lambda o: (o.float().mean(), {})

    def driver_step(data_iterator, m):
        routes = next(data_iterator)
        replay = replay_routes(m, routes, ~attention, layout)
        return harness.forward(m, ids, layout, padding_mask=replay.padding_mask), lambda o: (o.float().mean(), {})

    out: dict = {"chunk_layers": mine}
    for label, step in (("upstream", upstream_step), ("driver", driver_step)):
        spies = [harness.RouteSpy(c) for c in chunks]
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(micro), iter(micro)],
            model=chunks,
            num_microbatches=4,
            seq_length=S,
            micro_batch_size=B,
            forward_only=False,
        )
        checks = {}
        for spy, chunk in zip(spies, chunks):
            for layer, _ in harness.routers(chunk):
                want = [harness.routing_map(harness.aligned_seq_major(r, layout, layer), E) for r in micro]
                fwd, bwd = spy.maps(layer, "REPLAY_FORWARD"), spy.maps(layer, "REPLAY_BACKWARD")
                checks[layer] = {
                    "calls": [len(fwd), len(bwd)],
                    "forward_ok": [bool((f[rows] == w[rows]).all()) for f, w in zip(fwd, want)],
                    "backward_ok": [bool((b[rows] == w[rows]).all()) for b, w in zip(bwd, want)],
                }
            spy.remove()
        out[label] = checks
    return out


def _sequence_parallel(rank: int) -> dict:
    import contextlib
    import traceback

    import cpu_shims
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_routes

    cpu_shims.allow_sequence_parallel_norm()
    harness.reinit_parallel(tp=2)
    RouterReplay.global_router_replay_instances.clear()
    sp = dict(num_layers=2, tensor_model_parallel_size=2, sequence_parallel=True)
    ids, attention, _ = harness.batch(seed=5, lengths=(5, 8), seq=S)
    layout = TokenMetadataLayout.build(attention, packed=False, align=2)  # align = tp
    routes = harness.distinct_routes(B, S, 2, K, E, seed=200)
    out: dict = {}

    # the first stage: GPTModel scatters padding_mask itself
    model = harness.build_model(**sp)
    spy = harness.RouteSpy(model)
    replay = replay_routes(model, routes, ~attention, layout)
    harness.forward(model, ids, layout, padding_mask=replay.padding_mask)
    a = layout.output_shape[1]
    half = slice(rank * a // 2, (rank + 1) * a // 2)
    local_rows = _local(harness.valid_rows(layout), a, half)
    out["first_stage_mask_shape"] = list(replay.padding_mask.shape)
    out["first_stage_ok"] = all(
        bool(
            (
                spy.maps(n, "REPLAY_FORWARD")[0][local_rows]
                == harness.routing_map(_local(harness.aligned_seq_major(routes, layout, n), a, half), E)[local_rows]
            ).all()
        )
        for n in (1, 2)
    )
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()

    # a later stage (pre_process=False): hidden states arrive already sharded [A / tp, B, H]
    later = harness.build_model(pre_process=False, **sp)
    hidden = torch.randn(a // 2, B, 16, generator=torch.Generator().manual_seed(rank))

    def counts_after(mask) -> list:
        for _, r in harness.routers(later):
            r.local_tokens_per_expert.zero_()
        later.set_input_tensor(hidden)
        later(None, None, harness.causal_mask(a), padding_mask=mask).float().mean().backward()
        return [float(r.local_tokens_per_expert.sum()) for _, r in harness.routers(later)]

    # The full [B, A] mask against the rank's [A / 2, B] tokens: stock upstream (every plugin patch
    # off), then with the plugin's expert-bias fix (megatron.expert_bias_padding_mask) applied.
    # Only the expected errors are caught (stock: RuntimeError; the fix: ReplayDataError); any
    # other exception fails this rank.
    from replay_plugin.core.errors import ReplayDataError

    full = layout.align(~attention, True)
    for label, off in (("upstream_full_mask", harness.MEGATRON_PATCHES), ("full_mask_bias_fixed", ())):
        try:
            with contextlib.ExitStack() as stack:
                for name in off:
                    stack.enter_context(harness.patch_off(name))
                out[label] = {"error": None, "counts": counts_after(full)}
        except (RuntimeError, ReplayDataError) as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            out[label] = {
                "error": type(exc).__name__,
                "message": str(exc),
                "raised_in": [frame.filename.split("site-packages/")[-1], frame.name],
            }
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()

    replay = replay_routes(later, routes, ~attention, layout)
    out["driver_mask"] = {"mask_shape": list(replay.padding_mask.shape), "counts": counts_after(replay.padding_mask)}
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    out["local_valid_tokens"] = int(local_rows.sum())
    return out


def _local(seq_major, a: int, half: slice):
    """Rows of the sequence positions ``half`` from sequence-major ``[A * B, ...]``."""
    t = seq_major.reshape(a, B, *seq_major.shape[1:])[half]
    return t.reshape(-1, *seq_major.shape[1:]) if seq_major.dim() > 1 else t.reshape(-1)


def scenario_ranks(rank: int) -> dict:
    return {
        "pipeline": _pipeline(rank),
        "virtual_pipeline": _virtual_pipeline(rank),
        "sequence_parallel": _sequence_parallel(rank),
    }


def test_pipeline_and_sequence_parallel():
    need("megatron-core")
    import importlib.metadata

    from packaging.version import Version

    native = Version(importlib.metadata.version("megatron-core")) >= Version("0.19.0")
    ranks = harness.run_ranks(scenario_ranks, 2, parallel={"pp": 2})
    for rank, res in enumerate(ranks):
        pp = res["pipeline"]
        mine = [1, 2] if rank == 0 else [3, 4]
        assert pp["router_layer_numbers"] == mine
        assert pp["replay_layer_numbers_off"] == (mine if native else [None, None])
        assert pp["replay_layer_numbers_on"] == mine
        assert "does not match instances (2)" in pp["set_replay_data"]
        for layer in mine:
            assert pp["checks"][str(layer)] == {"calls": [3, 3], "forward_ok": True, "backward_ok": True}, (rank, layer)
        # only this stage's 2 of 4 layers are ever int32: tokens x 2 x top-k x 4 bytes per microbatch
        for counted, reported, layers in pp["int32"]:
            assert layers == mine
            assert counted == reported == pp["tokens"] * 2 * K * 4 == pp["global_int32_bytes"] // 2

        vp = res["virtual_pipeline"]
        assert vp["chunk_layers"] == ([[1], [3]] if rank == 0 else [[2], [4]])
        for layer in (1, 3) if rank == 0 else (2, 4):
            # upstream: every chunk's forward appends to both chunks' FIFOs, so with 4 microbatches
            # (in groups of 2) each recompute of microbatches 2 and 3 pops microbatch 0's and 1's routes
            assert vp["upstream"][str(layer)]["backward_ok"] == [True, True, False, False], (rank, layer)
            assert vp["driver"][str(layer)] == {"calls": [4, 4], "forward_ok": [True] * 4, "backward_ok": [True] * 4}

        sp = res["sequence_parallel"]
        assert sp["first_stage_mask_shape"] == [B, S] and sp["first_stage_ok"]
        # The full [B, A] mask (B * S entries) against the rank's B * S / 2 tokens. Stock upstream
        # raises in the router's expert-bias token count (``routing_map & ~padding_mask``); on the
        # released 0.16-0.19 on the expert dimension ("tensor a (4) ... dimension 1": the [tokens]
        # mask is not broadcast over experts, the bug megatron.expert_bias_padding_mask fixes), so
        # only the mask's size is asserted. With that fix the mask is refused by size (16 flags for
        # the rank's 8 tokens).
        stock, fixed = sp["upstream_full_mask"], sp["full_mask_bias_fixed"]
        assert stock["error"] == "RuntimeError", stock
        assert f"must match the size of tensor b ({B * S})" in stock["message"], stock
        assert stock["raised_in"][0].endswith("megatron/core/transformer/moe/router.py"), stock
        assert stock["raised_in"][1] == "_apply_expert_bias", stock
        assert fixed["error"] == "ReplayDataError", fixed
        tokens, entries = B * S // 2, B * S
        assert f"shape [{entries}] for a routing map of {tokens} tokens" in fixed["message"], fixed
        assert fixed["raised_in"][1] == "_apply_expert_bias", fixed  # the plugin's wrapper
        assert sp["driver_mask"]["mask_shape"] == [B, S // 2]
        assert sp["driver_mask"]["counts"] == [sp["local_valid_tokens"] * K] * 2
