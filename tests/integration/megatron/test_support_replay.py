"""Sampler-support replay inside a Megatron trainer (``replay_plugin.megatron.support``) on
real megatron-core (CPU, gloo).

The gap it closes: a rollout engine samples from the top-k of the model's distribution and
reports the logprob of the truncated, renormalised distribution; Megatron scores the same
token over the whole vocabulary. The multi-rank test rolls out with top-k sampling from a tiny
``GPTModel`` (vocabulary 64, sharded over TP=2) and first shows that Megatron's ordinary
logprob (``-vocab_parallel_cross_entropy``) differs from the rollout's logprob by nats, then
that the helper reproduces the rollout's logprob.

One subprocess group of two gloo ranks runs every multi-rank check:

* TP=2 (``initialize_model_parallel(2, 1)``): ``support_logprobs`` on the vocab-parallel
  logits equals the single-process core function on the gathered logits, values and
  gradients; the batch helper, unpacked and packed, equals an explicit per-token reference
  computed from the gathered full logits; the fused path (the output layer's input + its weight
  shard) equals the explicit one in values and in the hidden / weight gradients, also with
  sequence parallelism; the synthetic-EOS row gets its full-vocabulary logprob and the number of
  collectives does not change with or without it; with replay off the helper returns what
  Megatron's own ``vocab_parallel_cross_entropy`` gives.
* CP=2 (``initialize_model_parallel(1, 1, context_parallel_size=2)``). megatron-core does not
  run context parallelism on CPU: its only non-Transformer-Engine attention,
  ``DotProductAttention``, asserts ``context_parallel_size == 1`` ("Context parallelism is only
  supported by TEDotProductAttention!", 0.16.1 and 0.19.2) and also refuses
  ``packed_seq_params``. So the CP path is proven on the real packed logits of the TP phase
  (computed without CP, with a block-diagonal causal mask in place of THD attention), sharded
  the way Megatron shards a CP batch (``megatron.core.utils.get_batch_on_this_cp_rank`` per
  packed sequence: chunks ``r`` and ``2 * cp - 1 - r``): the helper on each rank's shard
  returns the unsharded result, and each rank's logits gradient is its shard of the
  unsharded gradient.

A second TP=2 run checks the support rows against the global vocabulary (64, not the 32 of a
shard): ids of the other rank's shard are members, an id past the last shard, a negative id
other than -1, a repeated id or a loss-bearing row without its token is refused by both ranks
with the same error and the same collectives as a good call; a row outside the loss without its
token scores 0.

Refusals (support without loss mask, width mismatch, controller-packed rows, ...) run in the
single-rank worker.
"""

from __future__ import annotations

import contextlib

import harness
import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(900)

V, H = 64, 16  # vocabulary (32 per TP rank), hidden size
B, S, K = 3, 12, 4  # batch rows, grid length, support width (top-k of the rollout)
LENGTHS, PROMPTS = (12, 9, 7), (5, 4, 3)  # valid tokens per row, of which prompt tokens
TEMPERATURE = 0.7
EOS = 2  # row 1's last response token is a synthetic EOS: loss-bearing, no support


# --------------------------------------------------------------------------------------
# helpers (run in the Megatron processes)


@contextlib.contextmanager
def _count_collectives():
    """Counts all_reduce / all_gather calls (torch.distributed and Megatron's gather alias)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    counts = {"all_reduce": 0, "all_gather": 0}
    saved = [(dist, "all_reduce"), (dist, "all_gather"), (mappings, "dist_all_gather_func")]
    originals = [getattr(owner, name) for owner, name in saved]

    def counted(key, fn):
        def call(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return call

    for (owner, name), fn in zip(saved, originals):
        setattr(owner, name, counted("all_reduce" if name == "all_reduce" else "all_gather", fn))
    try:
        yield counts
    finally:
        for (owner, name), fn in zip(saved, originals):
            setattr(owner, name, fn)


def _batch():
    """The left-padded grid: attention [B, S], ids with random prompts, the response loss mask."""
    import torch

    g = torch.Generator().manual_seed(7)
    attention = torch.zeros(B, S, dtype=torch.bool)
    loss = torch.zeros(B, S, dtype=torch.bool)
    ids = torch.zeros(B, S, dtype=torch.long)
    for b, (n, p) in enumerate(zip(LENGTHS, PROMPTS)):
        attention[b, S - n :] = True
        loss[b, S - n + p :] = True
        ids[b, S - n : S - n + p] = torch.randint(3, V, (p,), generator=g)
    return ids, attention, loss


def _gather_vocab(x):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(x.detach())


def _rollout(model, ids, attention, layout):
    """Top-k sampling at TEMPERATURE, token by token, from the model's gathered logits (both
    ranks draw the same tokens): the ids, the support rows [B, S, K] (the top-k, most probable
    first) and the rollout's logprob of each sampled token [B, S] (NaN elsewhere)."""
    import torch

    support = torch.full((B, S, K), -1, dtype=torch.int32)
    rollout = torch.full((B, S), float("nan"), dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    ids = ids.clone()
    for j in range(max(n - p for n, p in zip(LENGTHS, PROMPTS))):
        with torch.no_grad():
            full = _gather_vocab(harness.forward(model, ids, layout)).double()  # [B, A, V]
        for b, (n, p) in enumerate(zip(LENGTHS, PROMPTS)):
            if p + j >= n:
                continue
            z = full[b, p + j - 1] / TEMPERATURE  # the aligned row starts at 0: token p + j
            top = z.topk(K).indices
            probs = torch.softmax(z[top], dim=0)
            pick = int(torch.multinomial(probs, 1, generator=g))
            s = S - n + p + j
            ids[b, s] = top[pick]
            support[b, s] = top.to(torch.int32)
            rollout[b, s] = float(torch.log(probs[pick]))
    s_eos = S - 1  # row 1's last token: replaced by an EOS appended after the engine returned
    ids[1, s_eos] = EOS
    support[1, s_eos] = -1
    rollout[1, s_eos] = float("nan")
    return ids, support, rollout


def _reference(rows, ids, attention, support, loss, *, replay: bool):
    """Explicit per-token reference [B, S - 1] (float64) from full-vocabulary logits: ``rows[b]``
    holds row b's logits [len_b, V] at its valid tokens, in order."""
    import torch

    out = torch.zeros(B, S - 1, dtype=torch.float64)
    for b in range(B):
        pos = attention[b].nonzero().squeeze(1)
        for j in range(1, len(pos)):
            s = int(pos[j])
            z = rows[b][j - 1].double() / TEMPERATURE
            y = int(ids[b, s])
            members = support[b, s][support[b, s] >= 0].long()
            if not replay or (len(members) == 0 and bool(loss[b, s])):
                out[b, s - 1] = z[y] - z.logsumexp(0)
            elif len(members):
                out[b, s - 1] = z[y] - z[members].logsumexp(0)
    return out


def _packed_forward(model, ids, attention, layout):
    """The packed [1, T] batch through the model. Local attention takes no PackedSeqParams, so
    THD attention is expressed as a block-diagonal causal mask; positions restart per sequence."""
    import torch

    x = layout.align(ids, 0)
    pos = layout.align((attention.long().cumsum(dim=1) - 1).clamp(min=0), 0)
    seg = torch.repeat_interleave(torch.arange(B), torch.tensor(layout.padded_sequence_lengths))
    i = torch.arange(x.shape[1])
    allowed = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    return model(x, pos, ~allowed[None, None])


def _capture_hidden(model):
    """A forward hook keeping the output layer's input ([s, b, H], sequence-first)."""
    box = {}
    handle = model.output_layer.register_forward_hook(lambda m, args, out: box.__setitem__("h", args[0].detach()))
    return box, handle


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _fused_vs_explicit(h, weight, call, upstream) -> dict:
    """Helper values and gradients on the fused path (hidden + weight) against the explicit one
    (Megatron's own column-parallel projection of the same hidden states, then logits)."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    from replay_plugin.megatron import replay_response_logprobs

    results = {}
    for label in ("explicit", "fused"):
        hl = h.clone().requires_grad_()
        weight.grad = None
        if label == "explicit":  # what ColumnParallelLinear does with the same input
            region = (
                gather_from_sequence_parallel_region(hl) if call.get("sp") else copy_to_tensor_model_parallel_region(hl)
            )
            out = replay_response_logprobs(F.linear(region, weight).transpose(0, 1), **call["kwargs"])
        else:
            out = replay_response_logprobs(hl, output_weight=weight, **call["kwargs"])
        (out * upstream).sum().backward()
        results[label] = (out.detach(), hl.grad.clone(), weight.grad.clone())
    (oe, he, we), (of, hf, wf) = results["explicit"], results["fused"]
    return {
        "value": _max_diff(oe, of),
        "hidden_grad": _max_diff(he, hf),
        "weight_grad": _max_diff(we, wf),
        "hidden_grad_norm": float(hf.norm()),
        "weight_grad_norm": float(wf.norm()),
        "out": of,
        "hidden_grad_sum": float(hf.double().sum()),
        "explicit_hidden_grad": he,
        "upstream": upstream,
    }


def _naive_fused_hidden_grad(h, weight, ids, support, loss, layout, rank, fused) -> float:
    """The core function fed ``copy_to_tensor_model_parallel_region(h).transpose(0, 1)`` directly:
    its hidden gradient against the explicit path's. On megatron-core 0.16 the region's backward
    all-reduce is lost for the (non-contiguous) gradient it receives."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    from replay_plugin.core import logprobs as core

    hl = h.clone().requires_grad_()
    trajectory = torch.arange(B).unsqueeze(1).expand(B, S)
    values = core.replay_logprobs(
        copy_to_tensor_model_parallel_region(hl).transpose(0, 1),
        layout.align(ids, 0, next_token=True),
        layout.align(support, -1, next_token=True),
        layout.align(loss, False, next_token=True),
        layout.align(trajectory, -1, next_token=True),
        B,
        lm_head_weight=weight,
        temperature=TEMPERATURE,
        vocab_start=rank * (V // 2),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
    ).logprobs
    (layout.restore(values, 0.0) * fused["upstream"]).sum().backward()
    weight.grad = None
    return _max_diff(hl.grad, fused["explicit_hidden_grad"])


def _cp_shard(x, layout, dim: int = 1):
    """Megatron's CP sharding of a packed tensor (sequence on ``dim``): each packed sequence through
    ``megatron.core.utils.get_batch_on_this_cp_rank`` (chunks r and 2cp-1-r), concatenated."""
    import inspect

    import torch
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = parallel_state.get_context_parallel_group()
    # 0.16: (batch, cp_group=None); 0.19: (batch, is_hybrid_cp, cp_group=None, ...), which
    # splits per sequence when the batch carries no cu_seqlens.
    hybrid = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
    cu = layout.cu_seqlens_padded.tolist()
    moved = x.movedim(dim, 1)
    parts = []
    for start, end in zip(cu[:-1], cu[1:]):
        batch = {"x": moved[:, start:end].contiguous()}
        if hybrid:
            batch = get_batch_on_this_cp_rank(batch, False, cp_group=group)
        else:
            batch = get_batch_on_this_cp_rank(batch, cp_group=group)
        parts.append(batch["x"])
    return torch.cat(parts, dim=1).movedim(1, dim)


# --------------------------------------------------------------------------------------
# the multi-rank scenario


def _tensor_parallel(rank: int) -> tuple[dict, dict]:
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from replay_plugin.core import logprobs as core
    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_response_logprobs, support_logprobs

    out: dict = {}
    model = harness.build_model(harness.dense_config(tensor_model_parallel_size=2), vocab_size=V)
    out["output_layer"] = type(model.output_layer).__name__
    prompt_ids, attention, loss = _batch()
    layout_u = TokenMetadataLayout.build(attention, packed=False, align=2)  # align = tp
    ids, support, rollout = _rollout(model, prompt_ids, attention, layout_u)
    box, hook = _capture_hidden(model)
    logits_u = harness.forward(model, ids, layout_u)  # [B, A, V/tp]
    h_u = box["h"]
    out["logits_shape"] = list(logits_u.shape)
    full_u = _gather_vocab(logits_u)
    rows_u = [full_u[b, :n] for b, n in enumerate(LENGTHS)]
    g = torch.Generator().manual_seed(5)
    upstream = torch.randn(B, S - 1, generator=g, dtype=torch.float64).float()
    kw = dict(support_ids=support, loss_mask=loss, temperature=TEMPERATURE)

    # 1. support_logprobs on this rank's vocabulary shard == the core function on gathered logits
    sampled = layout_u.align(ids, 0, next_token=True)
    sup = layout_u.align(support, -1, next_token=True)
    local = logits_u.detach().clone().requires_grad_()
    gathered = full_u.clone().requires_grad_()
    up = torch.randn(sampled.shape, generator=g)
    with _count_collectives() as counts:
        lp, valid = support_logprobs(local, sampled, sup, temperature=TEMPERATURE)
    ref, ref_valid = core.support_logprobs(gathered, sampled, sup, temperature=TEMPERATURE)
    (lp * up).sum().backward()
    (ref * up).sum().backward()
    shard = slice(rank * V // 2, (rank + 1) * V // 2)
    out["low_level"] = {
        "value": _max_diff(lp, ref),
        "valid_equal": bool((valid == ref_valid).all()),
        "grad": _max_diff(local.grad, gathered.grad[..., shard]),
        "grad_norm": float(local.grad.norm()),
        "collectives": counts,
    }

    # 2. the batch helper (unpacked) == explicit per-token reference; the problem it closes
    with _count_collectives() as with_eos:
        replayed = replay_response_logprobs(logits_u, ids, layout_u, **kw)
    no_eos = loss.clone()
    no_eos[1, S - 1] = False
    with _count_collectives() as without_eos:
        replay_response_logprobs(
            logits_u, ids, layout_u, support_ids=support, loss_mask=no_eos, temperature=TEMPERATURE
        )
    reference = _reference(rows_u, ids, attention, support, loss, replay=True)
    ordinary = replay_response_logprobs(logits_u, ids, layout_u, temperature=TEMPERATURE)  # replay off
    supported = (support >= 0).any(-1)[:, 1:] & loss[:, 1:]  # [B, S-1], by predicting position
    roll = rollout[:, 1:]
    eos = (1, S - 2)
    full_lp_eos = _reference(rows_u, ids, attention, support, loss, replay=False)[eos]
    out["unpacked"] = {
        "shape": list(replayed.shape),
        "dtype": str(replayed.dtype),
        "vs_reference": _max_diff(replayed, reference),
        "zero_off_loss": bool((replayed[~loss[:, 1:]] == 0).all()),
        "ordinary_minus_rollout_min": float((ordinary.double() - roll)[supported].abs().min()),
        "ordinary_minus_rollout_mean": float((ordinary.double() - roll)[supported].abs().mean()),
        "replayed_minus_rollout_max": float((replayed.double() - roll)[supported].abs().max()),
        "eos": [float(replayed[eos]), float(full_lp_eos), float(ordinary[eos])],
        "collectives": [with_eos, without_eos],
    }

    # 3. replay off == Megatron's own vocab_parallel_cross_entropy (and the full-vocab reference)
    ce = -vocab_parallel_cross_entropy(logits_u.detach().clone() / TEMPERATURE, sampled)  # [B, A]
    by_hand = torch.zeros(B, S - 1)
    for b, n in enumerate(LENGTHS):
        by_hand[b, S - n : S - 1] = ce[b, : n - 1]
    out["replay_off"] = {
        "vs_megatron": _max_diff(ordinary, by_hand),
        "vs_reference": _max_diff(ordinary, _reference(rows_u, ids, attention, support, loss, replay=False)),
        "logits_untouched": _max_diff(_gather_vocab(logits_u), full_u),
    }

    # 4. fused (hidden + weight shard) == explicit, values and gradients; num_actions
    weight = model.output_layer.weight
    call = {"kwargs": dict(input_ids=ids, layout=layout_u, **kw)}
    fused = _fused_vs_explicit(h_u, weight, call, upstream)
    out["fused"] = {k: v for k, v in fused.items() if k not in ("out", "explicit_hidden_grad", "upstream")}
    out["fused"]["naive_hidden_grad"] = _naive_fused_hidden_grad(h_u, weight, ids, support, loss, layout_u, rank, fused)
    out["fused"]["vs_logits_path"] = _max_diff(fused["out"], replayed)
    off = replay_response_logprobs(h_u, ids, layout_u, output_weight=weight, temperature=TEMPERATURE)
    out["fused"]["replay_off_vs_logits_path"] = _max_diff(off, ordinary)
    # 0.18+: GPTModel's output_processor hands over the output layer's input, no logits built
    import inspect

    if "output_processor" in inspect.signature(model.forward).parameters:
        x = layout_u.align(ids, 0)
        pos = torch.arange(x.shape[1]).expand_as(x).contiguous()
        hidden = model(
            x, pos, harness.causal_mask(x.shape[1]), output_processor=lambda *, hidden_states, **_: hidden_states
        )
        via = replay_response_logprobs(hidden, ids, layout_u, output_weight=weight, **kw)
        out["fused"]["output_processor"] = [list(hidden.shape), _max_diff(via, replayed)]
    actions = replay_response_logprobs(logits_u, ids, layout_u, num_actions=7, **kw)
    out["num_actions"] = {"shape": list(actions.shape), "equal": bool((actions == replayed[:, -7:]).all())}

    # 5. packed (align 4 = tp * cp * 2 for the CP phase): helper == unpacked == reference
    layout_p = TokenMetadataLayout.build(attention, packed=True, align=4)
    logits_p = _packed_forward(model, ids, attention, layout_p)  # [1, T, V/tp]
    h_p = box["h"]
    hook.remove()
    full_p = _gather_vocab(logits_p)
    cu = layout_p.cu_seqlens_padded.tolist()
    rows_p = [full_p[0, cu[b] : cu[b] + n] for b, n in enumerate(LENGTHS)]
    packed = replay_response_logprobs(logits_p, ids, layout_p, **kw)
    packed_off = replay_response_logprobs(logits_p, ids, layout_p, temperature=TEMPERATURE)
    fused_p = replay_response_logprobs(h_p, ids, layout_p, output_weight=weight, **kw)
    out["packed"] = {
        "logits_shape": list(logits_p.shape),
        "vs_reference": _max_diff(packed, _reference(rows_p, ids, attention, support, loss, replay=True)),
        "vs_unpacked": _max_diff(packed, replayed),
        "off_vs_unpacked_off": _max_diff(packed_off, ordinary),
        "fused_vs_logits": _max_diff(fused_p, packed),
    }

    # 6. sequence parallelism: the output layer's input is [A / tp, B, H]; the fused path gathers it
    import cpu_shims

    cpu_shims.allow_sequence_parallel_norm()
    sp_model = harness.build_model(
        harness.dense_config(tensor_model_parallel_size=2, sequence_parallel=True), vocab_size=V
    )
    sp_box, sp_hook = _capture_hidden(sp_model)
    sp_logits = harness.forward(sp_model, ids, layout_u)
    sp_hook.remove()
    sp_call = {"kwargs": dict(input_ids=ids, layout=layout_u, **kw), "sp": True}
    sp = _fused_vs_explicit(sp_box["h"], sp_model.output_layer.weight, sp_call, upstream)
    out["sequence_parallel"] = {k: v for k, v in sp.items() if k not in ("out", "explicit_hidden_grad", "upstream")}
    out["sequence_parallel"]["hidden_shape"] = list(sp_box["h"].shape)
    out["sequence_parallel"]["vs_logits_path"] = _max_diff(
        sp["out"], replay_response_logprobs(sp_logits, ids, layout_u, **kw)
    )

    # what the CP phase needs: unsharded packed logits / hidden / weight and the TP results
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full_weight = gather_from_tensor_model_parallel_region(weight.detach().t().contiguous()).t().contiguous()  # [V, H]
    keep = dict(
        ids=ids,
        attention=attention,
        loss=loss,
        support=support,
        layout_p=layout_p,
        full_p=full_p,
        h_p=h_p,
        weight=full_weight,
        packed=packed.detach(),
        packed_off=packed_off.detach(),
        upstream=upstream,
    )
    return out, keep


def _context_parallel(rank: int, keep: dict) -> dict:
    import torch

    from replay_plugin.core import logprobs as core
    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_response_logprobs

    harness.reinit_parallel(tp=1, cp=2)
    ids, attention, loss, support = keep["ids"], keep["attention"], keep["loss"], keep["support"]
    layout_p = keep["layout_p"]
    layout_c = TokenMetadataLayout.build(attention, packed=True, align=4, cp_size=2, cp_rank=rank)
    local = _cp_shard(keep["full_p"], layout_p).clone().requires_grad_()  # [1, T / 2, V]
    kw = dict(support_ids=support, loss_mask=loss, temperature=TEMPERATURE)
    with _count_collectives() as counts:
        sharded = replay_response_logprobs(local, ids, layout_c, **kw)
    (sharded * keep["upstream"]).sum().backward()

    # the unsharded gradient, from the core function on the full packed logits
    full = keep["full_p"].clone().requires_grad_()
    values = core.replay_logprobs(
        full,
        layout_p.align(ids, 0, next_token=True),
        layout_p.align(support, -1, next_token=True),
        layout_p.align(loss, False, next_token=True),
        layout_p.align(torch.arange(B).unsqueeze(1).expand(B, S), -1, next_token=True),
        B,
        temperature=TEMPERATURE,
    ).logprobs
    (layout_p.restore(values, 0.0) * keep["upstream"]).sum().backward()

    h_local = _cp_shard(keep["h_p"], layout_p, dim=0)  # [T / 2, 1, H]
    fused = replay_response_logprobs(h_local, ids, layout_c, output_weight=keep["weight"], **kw)
    off = replay_response_logprobs(local.detach(), ids, layout_c, temperature=TEMPERATURE)
    wrong_rank = TokenMetadataLayout.build(attention, packed=True, align=4, cp_size=2, cp_rank=1 - rank)
    try:
        replay_response_logprobs(local.detach(), ids, wrong_rank, **kw)
        refused = None
    except Exception as exc:  # noqa: BLE001
        refused = f"{type(exc).__name__}: {exc}"
    return {
        "local_shape": list(local.shape),
        "vs_tp_packed": _max_diff(sharded, keep["packed"]),
        "grad": _max_diff(local.grad, _cp_shard(full.grad, layout_p)),
        "grad_norm": float(local.grad.norm()),
        "fused_vs_tp_packed": _max_diff(fused, keep["packed"]),
        "off_vs_tp_packed_off": _max_diff(off, keep["packed_off"]),
        "collectives": counts,
        "wrong_rank": refused,
    }


def scenario_ranks(rank: int) -> dict:
    tp, keep = _tensor_parallel(rank)
    return {"tp": tp, "cp": _context_parallel(rank, keep)}


def test_support_replay_tensor_and_context_parallel():
    need("megatron-core")
    import importlib.metadata

    from packaging.version import Version

    native = Version(importlib.metadata.version("megatron-core")) >= Version("0.19.0")
    ranks = harness.run_ranks(scenario_ranks, 2, parallel={"tp": 2})
    tol = 2e-5
    for _rank, res in enumerate(ranks):
        tp = res["tp"]
        assert tp["output_layer"] == "ColumnParallelLinear"
        assert tp["logits_shape"] == [B, S, V // 2]  # batch-first [b, s, V/tp], as GPTModel returns them

        low = tp["low_level"]
        assert low["value"] < tol and low["valid_equal"] and low["grad"] < tol and low["grad_norm"] > 0.1, low
        assert low["collectives"] == {"all_reduce": 2, "all_gather": 0}

        u = tp["unpacked"]
        assert u["shape"] == [B, S - 1] and u["dtype"] == "torch.float32"
        assert u["vs_reference"] < tol and u["zero_off_loss"], u
        # the problem: Megatron's full-vocabulary logprob is nats away from the rollout's
        # top-k logprob at every response token; the helper reproduces the rollout's
        assert u["ordinary_minus_rollout_min"] > 0.1 and u["ordinary_minus_rollout_mean"] > 1.0, u
        assert u["replayed_minus_rollout_max"] < tol, u
        replayed_eos, full_eos, ordinary_eos = u["eos"]
        assert abs(replayed_eos - full_eos) < tol and abs(ordinary_eos - full_eos) < tol
        # 4 all_reduce + 1 to agree on errors, whether or not a synthetic EOS row needs the full vocabulary
        assert u["collectives"][0] == u["collectives"][1] == {"all_reduce": 5, "all_gather": 0}

        off = tp["replay_off"]
        assert off["vs_megatron"] < 1e-6 and off["vs_reference"] < tol and off["logits_untouched"] == 0.0, off

        fused = tp["fused"]
        assert fused["value"] < tol and fused["hidden_grad"] < tol and fused["weight_grad"] < tol, fused
        assert fused["hidden_grad_norm"] > 0.1 and fused["weight_grad_norm"] > 0.1
        assert fused["vs_logits_path"] < tol and fused["replay_off_vs_logits_path"] < tol, fused
        # upstream: 0.16's copy_to_tensor_model_parallel_region drops the backward all-reduce of
        # a non-contiguous gradient (fixed in 0.19); the helper is right on both
        assert (fused["naive_hidden_grad"] > 1e-3) == (not native), fused
        if native:
            assert fused["output_processor"][0] == [S, B, H] and fused["output_processor"][1] < tol, fused
        assert tp["num_actions"] == {"shape": [B, 7], "equal": True}

        packed = tp["packed"]
        assert packed["logits_shape"] == [1, sum((n + 3) // 4 * 4 for n in LENGTHS), V // 2]
        assert packed["vs_reference"] < tol and packed["vs_unpacked"] < tol, packed
        assert packed["off_vs_unpacked_off"] < tol and packed["fused_vs_logits"] < tol, packed

        sp = tp["sequence_parallel"]
        assert sp["hidden_shape"] == [S // 2, B, H]
        assert (
            sp["value"] < tol and sp["hidden_grad"] < tol and sp["weight_grad"] < tol and sp["vs_logits_path"] < tol
        ), sp

        cp = res["cp"]
        assert cp["local_shape"] == [1, packed["logits_shape"][1] // 2, V]
        assert cp["vs_tp_packed"] < tol and cp["grad"] < tol and cp["grad_norm"] > 0.1, cp
        assert cp["fused_vs_tp_packed"] < tol and cp["off_vs_tp_packed_off"] < tol, cp
        # TP = 1 here: the agreement on errors over CP, then the CP gather
        assert cp["collectives"] == {"all_reduce": 1, "all_gather": 1}
        assert cp["wrong_rank"] is not None and "context-parallel rank" in cp["wrong_rank"], cp
    # the hidden-state gradient is all-reduced over the vocabulary shards: the same on both ranks
    assert ranks[0]["tp"]["fused"]["hidden_grad_sum"] == pytest.approx(
        ranks[1]["tp"]["fused"]["hidden_grad_sum"], rel=1e-5
    )


# --------------------------------------------------------------------------------------
# context parallelism, error path: every rank raises


def scenario_cp_nan(rank: int, fused: bool) -> dict:
    """CP=2; rank 1's logits shard (or hidden states) holds NaN, rank 0's is finite."""
    import time

    import torch

    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_response_logprobs

    harness.reinit_parallel(tp=1, cp=2)
    ids, attention, loss = _batch()
    support = torch.full((B, S, K), -1, dtype=torch.int32)
    support[loss, 0] = ids[loss].int()
    support[loss, 1] = (ids[loss].int() + 1) % V
    layout = TokenMetadataLayout.build(attention, packed=True, align=4, cp_size=2, cp_rank=rank)
    _, length = layout.output_shape
    g = torch.Generator().manual_seed(rank)
    weight = torch.randn(V, H, generator=g) if fused else None
    output = torch.randn(length, 1, H, generator=g) if fused else torch.randn(1, length, V, generator=g)
    if rank == 1:
        output.fill_(float("nan"))
    start = time.monotonic()
    try:
        replay_response_logprobs(output, ids, layout, support_ids=support, loss_mask=loss, output_weight=weight)
        error = None
    except ReplayDataError as exc:
        error = {"field": exc.field, "trajectory": exc.trajectory, "token": exc.token, "message": str(exc)}
    return {"error": error, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("fused", [False, True])
def test_context_parallel_ranks_agree_before_raising(fused):
    """A NaN only in rank 1's shard: both ranks raise the same error (before, rank 1 raised after
    the tensor-parallel reductions while rank 0 waited in the context-parallel all_gather until
    the process-group timeout, or failed when the raising rank tore its process group down). The
    subprocess timeout only guards against that hang."""
    need("megatron-core")
    ranks = harness.run_ranks(scenario_cp_nan, 2, timeout=240, fused=fused)
    errors = [r["error"] for r in ranks]
    assert all(e is not None for e in errors), errors
    assert all(e["field"] == "logits" and "not finite" in e["message"] for e in errors)
    assert (errors[0]["trajectory"], errors[0]["token"]) == (errors[1]["trajectory"], errors[1]["token"])
    assert "found by another rank: ranks (1,)" in errors[0]["message"]
    assert "another rank" not in errors[1]["message"]
    # the token is the grid position of the scored token, a loss-bearing one of its trajectory
    b, s = errors[0]["trajectory"], errors[0]["token"]
    assert 0 <= b < B and S - LENGTHS[b] + PROMPTS[b] <= s < S


# --------------------------------------------------------------------------------------
# tensor parallelism: support ids are checked against the global vocabulary


def scenario_tp_support_ids(rank: int) -> dict:
    """TP=2 (vocabulary 64, 32 per rank). Support rows hold ids of both shards. Each bad row is
    refused by both ranks alike, after the same collectives as a good call (no collective of its
    own), naming the grid position; rows outside the loss without their token score 0."""
    import torch
    from megatron.core import parallel_state

    from replay_plugin.core import logprobs as core
    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_response_logprobs, support_logprobs

    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    ids, attention, loss = _batch()
    g = torch.Generator().manual_seed(21)  # the same draws on both ranks
    ids[loss] = torch.randint(3, V, (int(loss.sum()),), generator=g)
    ids[1, S - 1] = EOS
    support = torch.full((B, S, K), -1, dtype=torch.int32)
    support[loss, 0] = ids[loss].int()
    support[loss, 1] = ((ids[loss] + V // 2 + 1) % V).int()  # a member of the other half
    support[1, S - 1] = -1  # row 1's synthetic EOS: loss-bearing, no support
    layout = TokenMetadataLayout.build(attention, packed=False, align=2)
    rows, length = layout.output_shape
    shard = slice(rank * V // 2, (rank + 1) * V // 2)
    full = torch.randn(rows, length, V, generator=g)
    logits = full[..., shard].contiguous()
    hidden = torch.randn(length, rows, H, generator=g)
    weight = torch.randn(V, H, generator=g)[shard].contiguous()
    b, s = 0, S - 2  # the bad row's grid position: a loss-bearing response token
    prompt = (0, S - LENGTHS[0] + 2)  # a prompt token that is scored (outside the loss)

    def run(sup, mask, fused, tokens=ids):
        out_kw = {"output_weight": weight} if fused else {}
        source = hidden if fused else logits
        with _count_collectives() as counts:
            try:
                value = replay_response_logprobs(source, tokens, layout, support_ids=sup, loss_mask=mask, **out_kw)
                return {"value": value, "collectives": counts}
            except ReplayDataError as exc:
                err = {"field": exc.field, "trajectory": exc.trajectory, "token": exc.token, "message": str(exc)}
                return {"error": err, "collectives": counts}

    def bad(kind):
        sup, mask = support.clone(), loss.clone()
        token = int(ids[b, s])
        if kind == "beyond_vocabulary":
            sup[b, s, 2] = V
        elif kind == "beyond_vocabulary_outside_loss":
            sup[prompt] = torch.tensor([int(ids[prompt]), V, -1, -1], dtype=torch.int32)
        elif kind == "negative":
            sup[b, s, 2] = -3
        elif kind == "duplicate":
            sup[b, s, 2] = sup[b, s, 1]
        elif kind in ("not_member", "not_member_outside_loss"):
            sup[b, s, 0] = (token + 2) % V
            mask[b, s] = kind == "not_member"
        return sup, mask

    # what a good call gives: the logits path against the core function on the gathered logits,
    # the fused path against the logits path on this rank's projection of the same hidden states
    reference = core.replay_logprobs(
        full,
        layout.align(ids, 0, next_token=True),
        layout.align(support, -1, next_token=True),
        layout.align(loss, False, next_token=True),
        layout.align(torch.arange(B).unsqueeze(1).expand(B, S), -1, next_token=True),
        B,
    ).logprobs
    projected = (hidden.transpose(0, 1) @ weight.t()).contiguous()  # [rows, length, V/tp]
    via_logits = replay_response_logprobs(projected, ids, layout, support_ids=support, loss_mask=loss)
    out: dict = {}
    for fused in (False, True):
        good = run(support, loss, fused)
        expected = via_logits if fused else layout.restore(reference, 0.0)
        entry: dict = {"good_collectives": good["collectives"], "good": _max_diff(good["value"], expected)}
        for kind in (
            "beyond_vocabulary",
            "beyond_vocabulary_outside_loss",
            "negative",
            "duplicate",
            "not_member",
            "not_member_outside_loss",
        ):
            sup, mask = bad(kind)
            res = run(sup, mask, fused)
            if "value" in res:
                keep = torch.ones(B, S - 1, dtype=torch.bool)
                keep[b, s - 1] = False
                res = {
                    "at_row": float(res["value"][b, s - 1]),
                    "others_vs_good": _max_diff(res["value"][keep], good["value"][keep]),
                    "collectives": res["collectives"],
                }
            entry[kind] = res
        # row 1's synthetic EOS token in no shard (scored -logsumexp before, silently)
        eos_ids = ids.clone()
        eos_ids[1, S - 1] = V
        entry["eos_beyond_vocabulary"] = run(support, loss, fused, eos_ids)
        out["fused" if fused else "logits"] = entry

    # the low-level call on the vocab-parallel logits: the other rank's ids are members, V is not
    sampled = layout.align(ids, 0, next_token=True)
    sup = layout.align(support, -1, next_token=True)
    low, _ = support_logprobs(logits, sampled, sup)
    ref, _ = core.support_logprobs(full, sampled, sup)
    out["low_level_good"] = _max_diff(low, ref)
    sup_bad = layout.align(bad("beyond_vocabulary")[0], -1, next_token=True)
    try:
        support_logprobs(logits, sampled, sup_bad)
        out["low_level_bad"] = None
    except ReplayDataError as exc:
        out["low_level_bad"] = {"trajectory": exc.trajectory, "token": exc.token, "message": str(exc)}
    return out


def test_tensor_parallel_support_ids_are_checked_against_the_global_vocabulary():
    """Before, a support id >= V (or < -1) was dropped from the normaliser, a repeated id counted
    twice and a loss-bearing row without its token scored a difference of logits, all silently."""
    need("megatron-core")
    ranks = harness.run_ranks(scenario_tp_support_ids, 2, parallel={"tp": 2})
    b, s = 0, S - 2
    for path in ("logits", "fused"):
        per_rank = [r[path] for r in ranks]
        for rank, res in enumerate(per_rank):
            good_counts = res["good_collectives"]
            assert res["good"] < 1e-5, (path, res["good"])
            # 2 + 2 all_reduce (support, synthetic EOS) + 1 agreement on errors
            assert good_counts["all_reduce"] == 5, good_counts
            for kind, text in (
                ("beyond_vocabulary", f"largest id {V}; the vocabulary is split over 2 ranks"),
                ("negative", "support row holds id -3"),
                ("duplicate", "appears more than once"),
                ("not_member", "is not in its support row"),
            ):
                err = res[kind].get("error")
                assert err is not None, (path, rank, kind, res[kind])
                assert (err["field"], err["trajectory"], err["token"]) == ("support_ids", b, s), (path, kind, err)
                assert text in err["message"], (path, kind, err)
                assert res[kind]["collectives"] == good_counts, (path, kind)  # no collective of its own
            eos = res["eos_beyond_vocabulary"].get("error")
            assert eos is not None, (path, rank, res["eos_beyond_vocabulary"])
            assert (eos["field"], eos["trajectory"], eos["token"]) == ("sampled_ids", 1, S - 1), (path, eos)
            assert f"sampled token {V} of the loss-bearing position without support" in eos["message"], eos
            assert res["eos_beyond_vocabulary"]["collectives"] == good_counts, path
            outside = res["beyond_vocabulary_outside_loss"].get("error")
            assert outside is not None and (outside["trajectory"], outside["token"]) == (0, S - LENGTHS[0] + 2)
            masked = res["not_member_outside_loss"]
            assert masked["at_row"] == 0.0 and masked["others_vs_good"] < 1e-6, masked
        for kind in (
            "beyond_vocabulary",
            "negative",
            "duplicate",
            "not_member",
            "beyond_vocabulary_outside_loss",
            "eos_beyond_vocabulary",
        ):
            assert per_rank[0][kind]["error"] == per_rank[1][kind]["error"], kind  # every rank, the same error
    for res in ranks:
        assert res["low_level_good"] < 1e-5
        bad = res["low_level_bad"]
        assert bad is not None and f"largest id {V}" in bad["message"], bad
    assert ranks[0]["low_level_bad"] == ranks[1]["low_level_bad"]


# --------------------------------------------------------------------------------------
# process groups: the model's pg_collection, in the driver and in support replay


def scenario_custom_pg_collection(rank: int) -> dict:
    """parallel_state has CP=2; the model is built with a pg_collection whose context-parallel
    group is this rank alone (a replica): the driver and support replay must both use the model's."""
    import torch
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from replay_plugin.core import logprobs as core
    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import groups_of, replay_layers, replay_response_logprobs, replay_routes

    harness.reinit_parallel(tp=1, cp=2)
    alone = [dist.new_group([r]) for r in range(2)][rank]
    pg = ProcessGroupCollection.use_mpu_process_groups()
    for name in ("cp", "tp_cp", "dp_cp", "tp_dp_cp"):
        if hasattr(pg, name):
            setattr(pg, name, alone)
    model = harness.build_model(num_layers=2)  # parallel_state's groups
    custom = harness.build_model(num_layers=2, pg_collection=pg)
    out: dict = {
        "sources": [groups_of(model).source, groups_of(custom).source],
        "cp_sizes": [groups_of(model).cp_size, groups_of(custom).cp_size],
    }
    ids, attention, loss = _batch()
    layout = TokenMetadataLayout.build(attention, packed=True, align=4)  # the model's: no CP
    routes = harness.distinct_routes(B, S, 2, 2, 4, seed=5)
    replay_layers(custom)
    try:
        replay_routes(custom, routes, ~attention, layout)
        out["driver"] = None
    except ReplayDataError as exc:
        out["driver"] = str(exc)
    support = torch.full((B, S, K), -1, dtype=torch.int32)
    support[loss, 0] = ids[loss].int()
    support[loss, 1] = (ids[loss].int() + 1) % V
    _, length = layout.output_shape
    logits = torch.randn(1, length, V, generator=torch.Generator().manual_seed(3))
    kw = dict(support_ids=support, loss_mask=loss, temperature=TEMPERATURE)
    values = replay_response_logprobs(logits, ids, layout, model=custom, **kw)
    expected = core.replay_logprobs(
        logits,
        layout.align(ids, 0, next_token=True),
        layout.align(support, -1, next_token=True),
        layout.align(loss, False, next_token=True),
        layout.align(torch.arange(B).unsqueeze(1).expand(B, S), -1, next_token=True),
        B,
        temperature=TEMPERATURE,
    ).logprobs
    out["support_vs_single_rank"] = float((values - layout.restore(expected, 0.0)).abs().max())
    try:  # without the model: parallel_state's CP=2 does not fit the model's layout
        replay_response_logprobs(logits, ids, layout, **kw)
        out["support_without_model"] = None
    except ReplayDataError as exc:
        out["support_without_model"] = str(exc)
    return out


def test_one_source_of_process_groups():
    need("megatron-core")
    for res in harness.run_ranks(scenario_custom_pg_collection, 2):
        assert res["sources"] == ["pg_collection", "pg_collection"]
        assert res["cp_sizes"] == [2, 1]
        assert res["driver"] is None  # the router's layout check uses the model's CP group
        assert res["support_vs_single_rank"] < 1e-5
        assert res["support_without_model"] is not None and "context-parallel rank" in res["support_without_model"]


# --------------------------------------------------------------------------------------
# refusals (single rank)


def scenario_metrics() -> dict:
    """A top-k rollout from a real GPTModel (TP=1), scored with and without replay, each call
    also given the rollout's logprobs: the metrics it returns, and their float64 reference."""
    import numpy as np
    import torch

    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_response_logprobs

    model = harness.build_model(harness.dense_config(), vocab_size=V)
    prompt_ids, attention, loss = _batch()
    layout = TokenMetadataLayout.build(attention, packed=False, align=1)
    ids, support, rollout = _rollout(model, prompt_ids, attention, layout)
    with torch.no_grad():
        logits = harness.forward(model, ids, layout)
    sampled = loss & (support != -1).any(-1)  # the synthetic EOS row has no rollout logprob
    common = dict(temperature=TEMPERATURE, rollout_logprobs=rollout)
    replayed = replay_response_logprobs(logits, ids, layout, support_ids=support, loss_mask=loss, **common)
    # replay off: the caller's mask says which tokens have a rollout logprob
    stock = replay_response_logprobs(logits, ids, layout, loss_mask=sampled, **common)
    n = S - 5  # the response columns only, as a trainer's [B, num_actions]
    tail = replay_response_logprobs(
        logits, ids, layout, support_ids=support, num_actions=n, metrics_prefix="actor/",
        loss_mask=loss[:, -n:], temperature=TEMPERATURE, rollout_logprobs=rollout[:, -n:],
    )  # fmt: skip

    def reference(t, scored):
        t, q, m = t.double().numpy(), rollout[:, 1:].numpy(), scored[:, 1:].numpy()
        r = (t - q)[m]
        w = np.exp(np.clip(r, -20, 20))
        c = np.minimum(w, 2.0)
        pt, pq = np.exp(t[m]), np.exp(q[m])
        rows = [b for b in range(B) if m[b].any()]
        return {
            "rollout_corr/kl": float(np.mean(-r)),
            "rollout_corr/k3_kl": float(np.mean(np.expm1(r) - r)),
            "rollout_corr/chi2_token": float(np.mean(w**2) - 1),
            "rollout_corr/rollout_is_mean": float(np.mean(c)),
            "rollout_corr/rollout_is_eff_sample_size": float(c.sum() ** 2 / (len(c) * (c**2).sum())),
            # over every row, as verl's (an empty row counts 0; here every row has scored tokens)
            "rollout_corr/log_ppl_abs_diff": float(
                np.mean([abs(q[b][m[b]].mean() - t[b][m[b]].mean()) if b in rows else 0.0 for b in range(B)])
            ),
            "training/rollout_probs_diff_mean": float(np.mean(np.abs(pt - pq))),
            "training/rollout_probs_diff_max": float(np.max(np.abs(pt - pq))),
            "training/rollout_actor_probs_pearson_corr": float(np.corrcoef(pt, pq)[0, 1]),
        }

    return {
        "types": [type(x).__name__ for x in (replayed, stock, tail)],
        "replayed": {k: float(v) for k, v in replayed.metrics.items()},
        "stock": {k: float(v) for k, v in stock.metrics.items()},
        "tail": {k: float(v) for k, v in tail.metrics.items()},
        "tail_equals_full": bool(torch.equal(tail.logprobs, replayed.logprobs[:, -n:])),
        "reference_replayed": reference(replayed.logprobs, sampled),
        "reference_stock": reference(stock.logprobs, sampled),
    }


def test_mismatch_metrics_beside_the_logprobs():
    need("megatron-core")
    r = harness.shared_worker().run(scenario_metrics)
    assert r["types"] == ["LogprobsWithMetrics"] * 3
    for side in ("replayed", "stock"):
        for key, want in r[f"reference_{side}"].items():
            assert r[side][key] == pytest.approx(want, rel=1e-4, abs=1e-6), (side, key)
    # Megatron's full-vocabulary logprob misses the rollout's truncated distribution by nats;
    # replayed over the recorded support it is the rollout's logprob (float32 against float64)
    assert r["stock"]["rollout_corr/kl"] > 0.1 and r["stock"]["rollout_corr/rollout_is_mean"] < 0.9
    assert abs(r["replayed"]["rollout_corr/kl"]) < 1e-5
    assert r["replayed"]["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-6)
    assert r["tail_equals_full"]
    assert r["tail"] == pytest.approx({"actor/" + k: v for k, v in r["replayed"].items()}, rel=1e-5, abs=1e-7)


def scenario_refusals() -> dict:
    import numpy as np
    import torch

    from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_response_logprobs

    ids, attention, loss = _batch()
    layout = TokenMetadataLayout.build(attention, packed=False, align=1)
    logits = torch.randn(B, S, V, generator=torch.Generator().manual_seed(0))
    support = np.full((B, S, K), -1, dtype=np.int32)
    support[loss.numpy(), 0] = ids[loss].numpy()
    support[1, S - 1] = -1  # one synthetic EOS

    def refusal(**kw):
        args = dict(output=logits, input_ids=ids, layout=layout, support_ids=support, loss_mask=loss)
        args.update(kw)
        try:
            replay_response_logprobs(**args)
        except (ReplayDataError, ReplayTypeError) as exc:
            return {
                "type": type(exc).__name__,
                "field": exc.field,
                "trajectory": exc.trajectory,
                "token": exc.token,
                "message": str(exc),
            }
        return None

    two_eos = support.copy()
    two_eos[1, S - 2] = -1
    negative_row = support.copy()
    negative_row[1, S - 2] = -5  # not "no support" (all -1): bad data, in trajectory 1 with its EOS
    first_token = loss.clone()
    first_token[0, 0] = True
    two = loss.long()
    two[1, S - 3] = 2
    half = loss.double()
    half[1, S - 3] = 0.5
    rollout = torch.zeros(B, S, dtype=torch.float32)
    return {
        "ok": replay_response_logprobs(logits, ids, layout, support_ids=support, loss_mask=loss, width=K).shape[1]
        == S - 1,
        "no_loss_mask": refusal(loss_mask=None),
        "width": refusal(width=K + 1),
        "controller_packed": refusal(sub_sequence_lengths=[[12], [4, 5], [7]]),
        "sub_sequence_length": refusal(sub_sequence_lengths=[[12], [8], [7]]),
        "two_eos": refusal(support_ids=two_eos),
        "negative_row": refusal(support_ids=negative_row),
        "first_token": refusal(loss_mask=first_token),
        "support_shape": refusal(support_ids=support[:, 1:]),
        "support_dtype": refusal(support_ids=support.astype(np.float32)),
        "sequence_first": refusal(output=logits.transpose(0, 1).contiguous()),
        "cp_layout": refusal(layout=TokenMetadataLayout.build(attention, packed=True, align=4, cp_size=2, cp_rank=0)),
        "num_actions": refusal(num_actions=S),
        # issue 32: silent on 452e6a8 (255 read as a member; 2 and 0.5 read as True; NaN metrics)
        "uint8_support": refusal(support_ids=support.astype(np.uint8)),
        "mask_2": refusal(loss_mask=two),
        "mask_half": refusal(loss_mask=half),
        "narrow_rollout": refusal(rollout_logprobs=rollout[:, -2:]),
        "wide_enough_rollout": refusal(rollout_logprobs=rollout[:, 1:]),
        "temperature": refusal(temperature=np.float32(0.0)),
    }


def test_refusals():
    need("megatron-core")
    r = harness.shared_worker().run(scenario_refusals)
    assert r["ok"]
    assert r["no_loss_mask"]["field"] == "loss_mask" and "without a loss mask" in r["no_loss_mask"]["message"]
    assert r["width"]["field"] == "support_ids" and f"width {K}" in r["width"]["message"]
    assert r["controller_packed"]["field"] == "sub_sequence_lengths" and r["controller_packed"]["trajectory"] == 1
    assert "controller-packed" in r["controller_packed"]["message"]
    assert r["sub_sequence_length"]["trajectory"] == 1 and "9" in r["sub_sequence_length"]["message"]
    assert (r["two_eos"]["field"], r["two_eos"]["trajectory"], r["two_eos"]["token"]) == ("support_ids", 1, S - 1)
    neg = r["negative_row"]
    assert (neg["field"], neg["trajectory"], neg["token"]) == ("support_ids", 1, S - 2), neg
    assert "holds id -5" in neg["message"], neg  # not mistaken for a second synthetic EOS
    assert (r["first_token"]["field"], r["first_token"]["trajectory"], r["first_token"]["token"]) == ("loss_mask", 0, 0)
    assert r["support_shape"]["field"] == "support_ids"
    assert (r["support_dtype"]["type"], r["support_dtype"]["field"]) == ("ReplayTypeError", "support_ids")
    assert r["sequence_first"]["field"] == "logits" and "sequence-first" in r["sequence_first"]["message"]
    assert r["cp_layout"]["field"] == "layout"
    assert r["num_actions"]["field"] == "num_actions"
    u = r["uint8_support"]
    assert (u["type"], u["field"]) == ("ReplayTypeError", "support_ids") and "cannot hold the padding id -1" in u[
        "message"
    ]
    for key, text in (("mask_2", "holds 2"), ("mask_half", "holds 0.5")):
        m = r[key]
        assert (m["field"], m["trajectory"], m["token"]) == ("loss_mask", 1, S - 3) and text in m["message"], m
    n = r["narrow_rollout"]
    assert n["field"] == "rollout_logprobs" and "covers the last 2 of" in n["message"], n
    assert r["wide_enough_rollout"] is None  # column 0 is never loss-bearing: [B, S - 1] covers the mask
    assert (r["temperature"]["field"], r["temperature"]["type"]) == ("temperature", "ReplayDataError")


def test_package_import_stays_light():
    from support.procs import run_python

    proc = run_python(
        "import sys, replay_plugin.megatron as m\n"
        "assert {'support_logprobs', 'replay_response_logprobs'} <= set(dir(m))\n"
        "heavy = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'megatron'))\n"
        "print('HEAVY', heavy)\n"
        "print('CALLABLE', callable(m.replay_response_logprobs) and callable(m.support_logprobs))"
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout and "CALLABLE True" in proc.stdout
