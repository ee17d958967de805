"""Routed-expert replay for a Hugging Face MoE model under FSDP2 and Ulysses sequence parallelism,
2 real gloo ranks, against the single-process reference.

The model: the tiny Qwen3-MoE of ``hf_moe_models`` (layer 1 dense), identical on both ranks,
wrapped with FSDP2 ``fully_shard`` (every decoder layer, then the root) on CPU. The routes: random
distinct experts per token and layer (so a misaligned route changes the logits), uint8 ``[B, S, L,
K]`` as ``core.routes.pad_batch`` returns them, with the padding and one synthetic-EOS source token
marked in the router padding mask. The reference: the unsharded model, one process, padded
``[B, S]`` layout, the same routes replayed; a weighted next-token log-likelihood and its
gradients.

* data parallel, remove-padding: each rank scores its 2 rows as ``[1, nnz]`` (``indices=``);
  FSDP's mean of the two ranks' gradients equals half the reference's;
* Ulysses SP = 2 over the same 2 ranks (both hold the whole batch): tokens, position ids, routes
  and the router padding mask are partitioned by the upstream's own ``ulysses_pad_and_slice_inputs``
  (verl 0.9.1 through the plugin's ``ulysses.nd_partition`` for ``[1, nnz, L, K]``; skyrl 0.4.0
  natively). Each rank's MoE layers see only its slice of the tokens, as in a real SP forward: the
  test's attention function gathers keys and values of the whole sequence from both ranks (what
  Ulysses' all-to-all computes; upstream's needs flash-attention, absent on CPU), with a gradient
  that returns the other rank's share. The gathered logits equal the reference's, the experts got
  exactly the routes of their tokens, the gradients equal the reference's, the plugin's own
  ``sp_group=`` partition equals the upstream's, and routes given to the wrong rank change the
  logits (the comparison can fail).
"""

from __future__ import annotations

import os

import fsdp_harness
import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(400)

B, S = 4, 12
LENGTHS = (12, 7, 9, 5)  # valid tokens per row, left-padded
ATTENTION = "replay_test_gathered_kv"


def make_batch(vocab: int, num_layers: int, seed: int = 0) -> dict:
    import hf_moe_models as H
    import numpy as np
    import torch

    from replay_plugin.core.routes import pad_batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, S, dtype=torch.long)
    am = torch.zeros(B, S, dtype=torch.long)
    per_traj = []
    for b, n in enumerate(LENGTHS):
        ids[b, S - n :] = torch.randint(3, vocab, (n,), generator=g)
        am[b, S - n :] = 1
        rows = torch.rand(n - 1, num_layers, H.NUM_EXPERTS, generator=g).argsort(-1)[..., : H.TOP_K]
        per_traj.append(rows.to(torch.uint8).numpy())  # vLLM: no route for the last token
    routes, rpm = pad_batch(per_traj, am)
    rpm[2, S - 4] = True  # a synthetic EOS's source token: routed by the model itself
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    nxt = torch.zeros(B, S, dtype=torch.bool)
    nxt[:, :-1] = (am[:, :-1] == 1) & (am[:, 1:] == 1)  # position predicts a token of its row
    weights = torch.from_numpy(np.random.default_rng(seed).uniform(0.5, 1.5, size=(B, S))).float() * nxt
    return {"ids": ids, "am": am, "pos": pos, "routes": torch.from_numpy(routes), "rpm": rpm, "weights": weights}


def reference_loss(logits, batch: dict, rows=slice(None)):
    """Weighted next-token log-likelihood of the padded layout ``[b, S, V]``."""
    import torch

    ids, w = batch["ids"][rows], batch["weights"][rows]
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return (lp * w[:, :-1]).sum()


class _GatherSequence:
    """All-gather of ``[b, h, n, d]`` along dim 2 over a group; backward: the summed gradient's own
    slice (every rank's queries read every rank's keys and values)."""

    @staticmethod
    def build():
        import torch
        import torch.distributed as dist

        class Gather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, group):
                ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[2]
                parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, x.contiguous(), group=group)
                return torch.cat(parts, dim=2)

            @staticmethod
            def backward(ctx, grad):
                grad = grad.contiguous()
                dist.all_reduce(grad, group=ctx.group)
                return grad.narrow(2, ctx.rank * ctx.n, ctx.n), None

        return Gather


def _register_attention(state: dict) -> None:
    """``attn_implementation=ATTENTION``: this rank's queries over the whole sequence's keys and
    values (gathered from the SP group), masked to the query's own packed sequence, causal."""
    import torch
    from transformers import AttentionInterface

    gather = _GatherSequence.build()

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        k = gather.apply(key, state["group"])
        v = gather.apply(value, state["group"])
        groups = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=state["mask"], scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(ATTENTION, attention)


def _ulysses(upstream: str | None):
    """``(set_group, sp_slice(x, sp, pad_value))``: the upstream's own pad-and-slice (None: the
    test's own, what both compute: pad dimension 1 to a multiple of ``sp``, keep this rank's part)."""
    if upstream is None:
        import torch
        import torch.distributed as dist

        groups: list = []

        def own_slice(x, sp, pad_value=0):
            pad = (-x.shape[1]) % sp
            x = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), pad_value)], dim=1)
            part = x.shape[1] // sp
            rank = dist.get_rank(groups[-1])
            return x[:, rank * part : (rank + 1) * part]

        return groups.append, own_slice
    if upstream == "verl":
        import verl.utils.ulysses as U

        def sp_slice(x, sp, pad_value=0):
            return U.ulysses_pad_and_slice_inputs(x, None, sp_size=sp, pad_value=pad_value)[0]

        return U.set_ulysses_sequence_parallel_group, sp_slice
    from skyrl.backends.skyrl_train.distributed.ulysses import utils as U

    def sp_slice(x, sp, pad_value=0):
        return U.ulysses_pad_and_slice_inputs(x, sp_size=sp, input_padding_value=pad_value)[0]

    return U.set_ulysses_sequence_parallel_group, sp_slice


def fsdp_route_replay(rank: int, world: int, upstream: str | None) -> dict:
    import hf_moe_models as H
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from replay_plugin.fsdp import record_routes, replay_routes

    state: dict = {"group": None, "mask": None}
    _register_attention(state)
    set_group, sp_slice = _ulysses(upstream)
    ref = H.build("qwen3_moe", attn="sdpa")
    model = H.build("qwen3_moe", attn="sdpa")
    L = model.config.num_hidden_layers
    batch = make_batch(H.VOCAB, L)
    ids, am, pos, routes, rpm = (batch[k] for k in ("ids", "am", "pos", "routes", "rpm"))
    obs: dict = {}

    # ---- reference: one process, unsharded, padded layout, the same routes replayed
    halves = [slice(0, 2), slice(2, 4)]
    with replay_routes(ref, routes, rpm):
        ref_logits = ref(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
        names, params = zip(*ref.named_parameters())
        half_grads = [
            dict(zip(names, torch.autograd.grad(reference_loss(ref_logits[r], batch, r), params, retain_graph=True)))
            for r in halves
        ]
    ref_logits = ref_logits.detach()
    with torch.no_grad():
        stock = ref(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    valid = am.bool()
    obs["replay_changes_logits"] = float((stock - ref_logits)[valid].abs().max())

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def grad_error(scale: float) -> float:
        worst = 0.0
        for name, p in model.named_parameters():
            want = scale * (half_grads[0][name] + half_grads[1][name])
            got = p.grad.full_tensor()
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp(min=1e-12)))
        return worst

    def packed(rows):
        flat = am[rows].reshape(-1).nonzero().squeeze(1)
        return ids[rows].reshape(-1)[flat][None], pos[rows].reshape(-1)[flat][None], flat

    # ---- data parallel, remove-padding: rank r scores rows 2r, 2r+1
    mine = halves[rank]
    x, xpos, idx = packed(mine)
    with replay_routes(model, routes[mine], rpm[mine], indices=idx):
        logits = model(input_ids=x, position_ids=xpos, use_cache=False).logits
        grid = logits.new_zeros(2 * S, logits.shape[-1]).index_copy(0, idx, logits[0]).view(2, S, -1)
        reference_loss(grid, batch, mine).backward()
    obs["dp_logit_error"] = float((grid - ref_logits[mine])[am[mine].bool()].abs().max())
    obs["dp_grad_error"] = grad_error(0.5)
    model.zero_grad(set_to_none=True)

    # ---- Ulysses SP = 2: both ranks hold the whole batch, each runs its slice of the tokens
    group = dist.new_group(list(range(world)))
    set_group(group)
    state["group"] = group
    model.config._attn_implementation = ATTENTION
    x, xpos, idx = packed(slice(None))
    nnz = idx.numel()
    routes_rmpad = routes.reshape(B * S, L, -1)[idx][None]  # [1, nnz, L, K] uint8
    rpm_rmpad = rpm.reshape(-1)[idx][None]
    local_ids, local_pos = sp_slice(x, world), sp_slice(xpos, world)
    local_routes = sp_slice(routes_rmpad, world)  # the N-D path
    local_rpm = sp_slice(rpm_rmpad, world, pad_value=True)
    part = local_ids.shape[1]
    obs["local_shapes"] = [list(local_ids.shape), list(local_routes.shape), list(local_rpm.shape)]
    with replay_routes(model, routes, rpm, indices=idx, sp_group=group) as own_partition:
        # equal where a route is replayed (the padding rows' placeholders differ: [0..K-1] vs pad_value)
        keep = ~local_rpm
        obs["plugin_partition_equal"] = bool(
            torch.equal(own_partition.router_padding_mask.cpu(), local_rpm)
            and torch.equal(own_partition.routes.cpu()[keep], local_routes[keep])
        )
    # the mask of this rank's queries over the whole padded sequence (packed rows, causal)
    seq_id = torch.full((part * world,), -1, dtype=torch.long)
    seq_id[:nnz] = idx // S
    q = torch.arange(rank * part, (rank + 1) * part)
    kv = torch.arange(part * world)
    mask = (seq_id[q, None] == seq_id[None, kv]) & (kv[None] <= q[:, None]) & (seq_id[q, None] >= 0)
    state["mask"] = mask | (q[:, None] == kv[None])  # padding queries attend to themselves

    gather = _GatherSequence.build()
    with replay_routes(model, local_routes, local_rpm), record_routes(model) as rec:
        local = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits  # [1, part, V]
        full = gather.apply(local.unsqueeze(1), group)[0, 0, :nnz]  # [nnz, V]
        grid = full.new_zeros(B * S, full.shape[-1]).index_copy(0, idx, full).view(B, S, -1)
        # each rank's loss is its own positions' share: the gather's backward sums the ranks' grads
        loss = reference_loss(grid, batch) / world
        loss.backward()
    obs["sp_logit_error"] = float((grid - ref_logits)[valid].abs().max())
    moe = list(rec.layers)
    replayed = ~local_rpm[0]
    obs["sp_experts_got_local_routes"] = bool(
        torch.equal(rec.routes[0][replayed][:, moe], local_routes[0][replayed][:, moe].long())
    )
    obs["sp_moe_layers"] = moe
    obs["sp_grad_error"] = grad_error(0.5)
    model.zero_grad(set_to_none=True)

    # routes misaligned by one token: the logits move (the comparisons above can fail)
    shift = sp_slice(torch.roll(routes_rmpad, shifts=1, dims=1), world)
    with torch.no_grad():
        with replay_routes(model, shift, local_rpm):
            wrong = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits
    obs["misaligned_change"] = float((wrong - local).abs().max())
    obs["rank_logits_sum"] = float(full.detach().double().sum())
    return obs


def _check(results: list) -> None:
    for r in results:
        assert r["replay_changes_logits"] > 1e-2, r  # the routes are not the model's own
        assert r["dp_logit_error"] < 1e-4 and r["sp_logit_error"] < 1e-4, r
        assert r["dp_grad_error"] < 1e-4 and r["sp_grad_error"] < 1e-4, r
        assert r["plugin_partition_equal"], r
        assert r["sp_experts_got_local_routes"] and r["sp_moe_layers"] == [0, 2], r
        assert r["misaligned_change"] > 1e-2, r
        part = r["local_shapes"][0][1]
        assert r["local_shapes"] == [[1, part], [1, part, 3, 2], [1, part]], r
    assert results[0]["rank_logits_sum"] == results[1]["rank_logits_sum"]  # both ranks gathered the same


def test_fsdp2_route_replay_verl_ulysses():
    need("verl", "transformers")
    _check(fsdp_harness.run_ranks(fsdp_route_replay, 2, upstream="verl"))


def test_fsdp2_route_replay_skyrl_ulysses():
    need("skyrl", "transformers")
    _check(fsdp_harness.run_ranks(fsdp_route_replay, 2, upstream="skyrl"))


def test_fsdp2_route_replay_ulysses_without_a_framework():
    """The same where neither verl nor skyrl is installed (the transformers 5.25 environment: skyrl
    0.4.0 pins transformers<=5.16.1, verl 0.9.1 <5.11), with the test's own pad-and-slice; where
    one of them is, its variant above runs this path."""
    need("transformers")
    import importlib.util

    declared = os.environ.get("REPLAY_TEST_UPSTREAMS")
    present = (
        [u for u in ("verl", "skyrl") if u in declared.split(",")]
        if declared is not None
        else [u for u in ("verl", "skyrl") if importlib.util.find_spec(u) is not None]
    )
    if present:
        pytest.skip(f"{', '.join(present)} installed: its variant covers this path")
    _check(fsdp_harness.run_ranks(fsdp_route_replay, 2, upstream=None))
