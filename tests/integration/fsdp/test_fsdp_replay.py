"""``replay_plugin.fsdp.response_logprobs`` in an FSDP trainer's logprob function.

Multi-rank (2 real gloo ranks, one launch per environment): a tiny Qwen3-MoE checkpoint built
locally, wrapped with FSDP2 ``fully_shard`` on CPU, scored with remove-padding

* data parallel (each rank its own 2 rows), and the padded layout (no remove-padding);
* Ulysses SP = 2 over the same 2 ranks (both ranks hold the whole batch). Upstream's Ulysses
  attention needs flash-attention (absent on CPU), so each rank runs the model on the whole
  packed sequence and keeps its SP slice of the per-token logits (or hidden states), sliced by
  the upstream's own ``ulysses_pad_and_slice_inputs`` (verl 0.9.1 through the plugin's
  ``ulysses.nd_partition``; skyrl 0.4.0 natively): the same local inputs a real SP forward hands
  to the logprob function.

Every replayed logprob and every parameter gradient (FSDP-reduced, gathered with
``full_tensor``) equals the single-process, no-SP, explicit reference: the unsharded model on the
padded batch, logits gathered on the support, ``logsumexp``; synthetic-EOS rows score over the
full vocabulary; the collectives and the fallback's capacity do not depend on how many synthetic
EOS rows a batch has; no op sees ``[rows, V]`` beyond the fallback's ``[B, V]``; the hidden-state
path agrees; replay off equals the upstream's plain path (``logprobs_from_logits`` +
``gather_outputs_and_unpad`` + ``pad_input``); an SGD step changes the parameters and raises the
replayed objective.

Single-process tests (torch only): the explicit reference on random logits in both layouts, the
hidden-state path's gradients, the typed errors, and the lazy package import.
"""

from __future__ import annotations

import fsdp_harness
import pytest
from support.procs import run_python
from support.upstream import need

pytestmark = pytest.mark.timeout(400)

B, S, A, W = 4, 16, 7, 4
TEMPERATURE = 0.7
PROMPT_LENS = (3, 5, 4, 6)
#: per row: number of response tokens (the rest of the A columns is right padding), whether the
#: last one is a synthetic EOS (loss-bearing, no support row), the index of an observation token
#: (no support, not loss-bearing) or None
RESPONSES = ((7, True, None), (5, False, None), (6, True, None), (7, False, 3))


# =======================================================================================
# batch and explicit reference (shared by the scenarios and the single-process tests)


def make_batch(vocab: int, eos: int, seed: int = 0) -> dict:
    """A verl-style padded batch: prompts left-padded in the first S - A columns, responses
    right-padded in the last A; dense support rows from ``dense_support_batch``."""
    import numpy as np
    import torch

    from replay_plugin.core.support import SupportRows, dense_support_batch

    rng = np.random.default_rng(seed)
    ids = torch.full((B, S), eos, dtype=torch.int64)
    am = torch.zeros((B, S), dtype=torch.int64)
    rows, responses, masks = [], [], []
    normal = np.array([t for t in range(1, vocab) if t != eos])
    for b, (plen, (rlen, synthetic_eos, observation)) in enumerate(zip(PROMPT_LENS, RESPONSES)):
        ids[b, S - A - plen : S - A] = torch.from_numpy(rng.choice(normal, plen))
        resp = np.full(A, eos, dtype=np.int64)
        resp[:rlen] = rng.choice(normal, rlen)
        lm = np.zeros(A, dtype=np.int64)
        lm[:rlen] = 1
        support = np.full((A, W), -1, dtype=np.int32)
        for j in range(rlen):
            members = [int(resp[j])] + [int(t) for t in rng.choice(normal[normal != resp[j]], W - 1, replace=False)]
            keep = W if j % 3 else 2  # some rows narrower than W (trailing -1)
            support[j, :keep] = rng.permutation(members[:keep])
        if synthetic_eos:
            resp[rlen - 1] = eos
            support[rlen - 1] = -1
        if observation is not None:
            lm[observation] = 0
            support[observation] = -1
        ids[b, S - A :] = torch.from_numpy(resp)
        am[b, S - A - plen : S - A + rlen] = 1
        sampled = np.where((support >= 0).any(axis=1), resp, -1).astype(np.int32)
        rows.append(SupportRows(support, sampled, np.zeros(A, np.float32), (support >= 0).any(axis=1)))
        responses.append(resp)
        masks.append(lm)
    dense = dense_support_batch(rows, responses, masks, S, eos, vocab_size=vocab)
    return {
        "input_ids": ids,
        "attention_mask": am,
        "support": torch.from_numpy(dense.ids),
        "loss_mask": torch.from_numpy(dense.loss_mask[:, -A:]),
        "num_synthetic_eos": dense.num_synthetic_eos,
        "weights": torch.from_numpy(rng.uniform(0.5, 1.5, size=(B, A))).float(),
        # what dense_support_batch was given (the README's FSDP block builds the batch itself)
        "rows": rows,
        "responses": responses,
        "response_masks": masks,
    }


def explicit_reference(logits, batch: dict, temperature: float):
    """``[B, A]``: for each loss-bearing response token, its predicting logits (padded layout,
    ``[B, S, V]``) divided by T, gathered on the support row, minus their logsumexp; the full
    vocabulary for a row without support. 0 elsewhere. One token at a time, no plugin code."""
    import torch

    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, A, dtype=dtype)
    support, ids, lm = batch["support"], batch["input_ids"], batch["loss_mask"]
    for b in range(B):
        for j in range(A):
            if not lm[b, j]:
                continue
            s = S - A + j
            z = logits[b, s - 1].to(dtype) / temperature
            members = support[b, s][support[b, s] >= 0].long()
            out[b, j] = z[ids[b, s]] - torch.logsumexp(z[members] if members.numel() else z, dim=0)
    return out


def _packed(batch: dict, rows):

    am = batch["attention_mask"][rows]
    ids = batch["input_ids"][rows]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    idx = am.reshape(-1).nonzero().squeeze(1)
    return ids.reshape(-1)[idx].unsqueeze(0), pos.reshape(-1)[idx].unsqueeze(0), idx


# =======================================================================================
# multi-rank scenario


def _upstream_ops(upstream: str) -> dict:
    """The upstream's own Ulysses and logprob helpers (what its FSDP worker calls)."""
    import torch

    if upstream == "verl":
        import verl.utils.ulysses as U
        from verl.utils.attention_utils import pad_input, unpad_input
        from verl.utils.torch_functional import logprobs_from_logits

        def sp_slice(x, sp):
            out, _, pad = U.ulysses_pad_and_slice_inputs(x, None, sp_size=sp)
            return out, pad

        def plain(local_logits, local_labels, pad, idx, batch_size):
            lp = logprobs_from_logits(local_logits[0], local_labels[0])  # [part]
            lp = U.gather_outputs_and_unpad(lp, gather_dim=0, unpad_dim=0, padding_size=pad)
            return pad_input(lp.unsqueeze(-1), idx, batch_size, S).squeeze(-1)

        return {
            "set_group": U.set_ulysses_sequence_parallel_group,
            "sp_slice": sp_slice,
            "plain": plain,
            "unpad": lambda ids, am: unpad_input(ids.unsqueeze(-1), am)[1],
        }
    from skyrl.backends.skyrl_train.distributed.ulysses import utils as U

    def sp_slice(x, sp):
        out, _, _, pad = U.ulysses_pad_and_slice_inputs(x, sp_size=sp)
        return out, pad

    def plain(local_logits, local_labels, pad, idx, batch_size):
        # skyrl's logprobs_from_logits needs jaxtyping (not a skyrl dependency); its CPU
        # branch is log_softmax + gather, written out here.
        lp = torch.log_softmax(local_logits, dim=-1).gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
        lp = U.gather_outputs_and_unpad(lp, gather_dim=1, unpad_dim=1, padding_size=pad)
        return lp.new_zeros(batch_size * S).index_copy(0, idx, lp[0]).view(batch_size, S)

    return {
        "set_group": U.set_ulysses_sequence_parallel_group,
        "sp_slice": sp_slice,
        "plain": plain,
        "unpad": lambda ids, am: am.reshape(-1).nonzero().squeeze(1),
    }


class _OpSizes:
    """Largest input (elements) of every exp / logsumexp / (log_)softmax call while active."""

    def __init__(self):
        import torch
        from torch.overrides import TorchFunctionMode

        watched = {
            torch.exp,
            torch.Tensor.exp,
            torch.logsumexp,
            torch.Tensor.logsumexp,
            torch.log_softmax,
            torch.Tensor.log_softmax,
            torch.nn.functional.log_softmax,
            torch.softmax,
            torch.Tensor.softmax,
            torch.nn.functional.softmax,
        }
        sizes = self.sizes = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in watched and args and isinstance(args[0], torch.Tensor):
                    sizes.append(args[0].numel())
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _max_rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def fsdp_replay(rank: int, world: int, upstream: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from replay_plugin.demo.tiny_model import build_tiny_moe
    from replay_plugin.fsdp import replay as R
    from replay_plugin.fsdp import response_logprobs

    torch.manual_seed(0)
    ops = _upstream_ops(upstream)
    if rank == 0:
        build_tiny_moe()  # one builder; the other rank reuses the cached checkpoint
    dist.barrier()
    directory = build_tiny_moe()

    def load():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")

    ref, model = load(), load()
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = make_batch(vocab, eos)
    ids, am, support, lm, w = (batch[k] for k in ("input_ids", "attention_mask", "support", "loss_mask", "weights"))
    obs: dict = {"num_synthetic_eos": batch["num_synthetic_eos"], "vocab": vocab}

    # ---- the single-process, no-SP explicit reference (unsharded model, padded batch)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    ref_logits = ref(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    ref_lp = explicit_reference(ref_logits, batch, TEMPERATURE)
    halves = [slice(0, 2), slice(2, 4)]
    half_grads = []
    for rows in halves:
        loss = -(w[rows] * ref_lp[rows]).sum()
        names, params = zip(*ref.named_parameters())
        half_grads.append(dict(zip(names, torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))))
    ref_lp = ref_lp.detach()

    def grad_error(expected: dict) -> float:
        worst = 0.0
        for name, p in model.named_parameters():
            got = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape)
            want = expected[name] if expected[name] is not None else torch.zeros(p.shape)
            if want.abs().max() > 0:
                worst = max(worst, _max_rel(got, want))
            elif got.abs().max() > 0:
                worst = float("inf")
        return worst

    def combine(scale: float) -> dict:
        return {
            n: None if half_grads[0][n] is None else scale * (half_grads[0][n] + half_grads[1][n])
            for n in half_grads[0]
        }

    def forward_packed(rows):
        packed, ppos, idx = _packed(batch, rows)
        assert torch.equal(idx, ops["unpad"](ids[rows], am[rows]))
        return model(input_ids=packed, position_ids=ppos, use_cache=False).logits, packed, ppos, idx

    # ---- data parallel, remove-padding: rank r scores rows 2r, 2r+1 (FSDP averages the two)
    mine = halves[rank]
    # transformers 5.x finds packed sequences from position_ids only with attention_mask=None
    # and no cache: without use_cache=False the model builds a DynamicCache and the packed rows
    # attend to each other silently.
    logits, _, _, idx = forward_packed(mine)
    lp = response_logprobs(
        logits,
        ids[mine],
        am[mine],
        A,
        support_ids=support[mine],
        loss_mask=lm[mine],
        indices=idx,
        temperature=TEMPERATURE,
    )
    obs["dp_logprob_error"] = float(((lp - ref_lp[mine]) * lm[mine]).abs().max())
    (-(w[mine] * lp * lm[mine]).sum()).backward()
    obs["dp_grad_error"] = grad_error(combine(0.5))
    model.zero_grad(set_to_none=True)

    # ---- data parallel, padded layout (no remove-padding)
    with torch.no_grad():
        logits = model(input_ids=ids[mine], attention_mask=am[mine], position_ids=pos[mine], use_cache=False).logits
        lp = response_logprobs(
            logits, ids[mine], am[mine], A, support_ids=support[mine], loss_mask=lm[mine], temperature=TEMPERATURE
        )
    obs["padded_logprob_error"] = float(((lp - ref_lp[mine]) * lm[mine]).abs().max())

    # ---- Ulysses SP = 2 over both ranks, remove-padding: the whole batch on each rank
    sp = world
    group = dist.new_group(list(range(world)))
    ops["set_group"](group)
    everything = slice(0, B)
    logits_full, packed, ppos, idx = forward_packed(everything)
    local, pad = ops["sp_slice"](logits_full, sp)
    obs["sp_local_shape"] = list(local.shape)
    gathers: list = []
    fallback_calls: list = []
    real_gather, real_fallback = R._all_gather, R.full_vocab_logprobs_fixed_capacity

    def counting_gather(parts, tensor, group):
        gathers.append(list(tensor.shape))
        return real_gather(parts, tensor, group)

    def recording_fallback(source, sampled, need, traj, capacity, **kwargs):
        fallback_calls.append({"capacity": capacity, "needed": int(need.sum()), "rows": list(source.shape[:-1])})
        return real_fallback(source, sampled, need, traj, capacity, **kwargs)

    R._all_gather, R.full_vocab_logprobs_fixed_capacity = counting_gather, recording_fallback
    try:
        with _OpSizes() as sizes:
            lp = response_logprobs(
                local,
                ids,
                am,
                A,
                support_ids=support,
                loss_mask=lm,
                indices=idx,
                sp_group=group,
                temperature=TEMPERATURE,
            )
        obs["sp_replay_gathers"], obs["sp_replay_fallback"] = list(gathers), list(fallback_calls)
        obs["sp_replay_max_op"] = max(sizes.sizes)
        obs["sp_logprob_error"] = float(((lp - ref_lp) * lm).abs().max())
        # the synthetic EOS rows (last response token of rows 0 and 2): full-vocabulary values
        obs["eos_values"] = [float(lp[0, A - 1]), float(lp[2, RESPONSES[2][0] - 1])]
        obs["eos_reference"] = [float(ref_lp[0, A - 1]), float(ref_lp[2, RESPONSES[2][0] - 1])]
        (-(w * lp * lm).sum()).backward()
        obs["sp_grad_error"] = grad_error(combine(1.0))

        # the same batch without synthetic EOS in the loss: same collectives, same capacity
        gathers.clear()
        fallback_calls.clear()
        no_eos = lm.clone()
        no_eos[0, A - 1] = False
        no_eos[2, RESPONSES[2][0] - 1] = False
        with torch.no_grad():
            response_logprobs(
                local,
                ids,
                am,
                A,
                support_ids=support,
                loss_mask=no_eos,
                indices=idx,
                sp_group=group,
                temperature=TEMPERATURE,
            )
        obs["sp_no_eos_gathers"], obs["sp_no_eos_fallback"] = list(gathers), list(fallback_calls)

        # replay off: the ordinary full-vocabulary path, as the upstream's worker computes it
        gathers.clear()
        with torch.no_grad(), _OpSizes() as sizes:
            plain = response_logprobs(
                local, ids, am, A, indices=idx, sp_group=group, temperature=TEMPERATURE, replay=False
            )
        obs["plain_gathers"] = list(gathers)
        obs["plain_max_op"] = max(sizes.sizes)
    finally:
        R._all_gather, R.full_vocab_logprobs_fixed_capacity = real_gather, real_fallback
    with torch.no_grad():
        labels_local, _ = ops["sp_slice"](torch.roll(packed, shifts=-1, dims=1), sp)
        upstream_plain = ops["plain"](local / TEMPERATURE, labels_local, pad, idx, B)[:, S - A - 1 : S - 1]
    # Compared where the target is a token of the same row: the upstream's packed path scores a
    # row's last token against the next row's first token (skyrl says so in a comment); that
    # slot predicts padding and is never in a loss mask; response_logprobs returns 0 there.
    has_target = am[:, S - A :].bool()
    obs["plain_error"] = float(((plain - upstream_plain) * has_target).abs().max())
    obs["plain_masked_zero"] = bool((plain[~has_target] == 0).all())

    # hidden states + LM-head weight (the unsharded reference model), SP-sliced the same way
    with torch.no_grad():
        hidden_full = ref.model(input_ids=packed, position_ids=ppos, use_cache=False).last_hidden_state
        hidden_local, _ = ops["sp_slice"](hidden_full, sp)
        lp_h = response_logprobs(
            hidden_local,
            ids,
            am,
            A,
            support_ids=support,
            loss_mask=lm,
            indices=idx,
            sp_group=group,
            temperature=TEMPERATURE,
            lm_head_weight=ref.lm_head.weight,
        )
    obs["hidden_logprob_error"] = float(((lp_h - ref_lp) * lm).abs().max())

    # ---- an SGD step on the SP gradients changes the parameters and raises the objective
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    objective = float((w * lp * lm).sum())
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach().full_tensor(), before[n])]
    obs["sgd_changed"] = len(changed)
    obs["sgd_params"] = len(before)
    obs["sgd_lm_head_changed"] = "lm_head.weight" in changed
    with torch.no_grad():
        logits_full, _, _, _ = forward_packed(everything)
        local, _ = ops["sp_slice"](logits_full, sp)
        lp_after = response_logprobs(
            local, ids, am, A, support_ids=support, loss_mask=lm, indices=idx, sp_group=group, temperature=TEMPERATURE
        )
    obs["objective_before"], obs["objective_after"] = objective, float((w * lp_after * lm).sum())
    return obs


def _check_fsdp_replay(results: list) -> None:
    for r in results:
        assert r["num_synthetic_eos"] == 2
        assert r["dp_logprob_error"] < 2e-5, r
        assert r["padded_logprob_error"] < 2e-5, r
        assert r["sp_logprob_error"] < 2e-5, r
        assert r["hidden_logprob_error"] < 2e-5, r
        assert r["dp_grad_error"] < 1e-4 and r["sp_grad_error"] < 1e-4, r
        # synthetic EOS: the full-vocabulary logprob of the reference (a support of one member
        # would give 0, any renormalisation a value closer to 0)
        assert all(v < -1e-3 for v in r["eos_reference"]), r
        assert r["eos_values"] == pytest.approx(r["eos_reference"], abs=1e-4)
        # one all-gather of [1, part, 2] per call, and B fallback rows, with or without synthetic EOS
        part = r["sp_local_shape"][1]
        assert r["sp_replay_gathers"] == [[1, part, 2]] == r["sp_no_eos_gathers"]
        assert (
            [c["capacity"] for c in r["sp_replay_fallback"]] == [B] == [c["capacity"] for c in r["sp_no_eos_fallback"]]
        )
        assert r["sp_no_eos_fallback"][0]["needed"] == 0
        # never [rows, V] in replay: the largest exp/logsumexp input is the fallback's [B, V]
        # (the plain path's is [part, V], more than B rows)
        assert part > B
        assert r["sp_replay_max_op"] <= max(B * r["vocab"], part * (W + 1)), r
        assert r["plain_max_op"] >= part * r["vocab"]
        assert r["plain_gathers"] == [[1, part]]
        assert r["plain_error"] < 2e-5 and r["plain_masked_zero"], r
        assert r["sgd_lm_head_changed"] and r["sgd_changed"] > r["sgd_params"] // 2, r
        assert r["objective_after"] > r["objective_before"], r
    # SP ranks agree on every gathered value
    assert results[0]["eos_values"] == results[1]["eos_values"]
    assert results[0]["objective_before"] == results[1]["objective_before"]


def test_fsdp2_replay_verl_ulysses():
    need("verl")
    _check_fsdp_replay(fsdp_harness.run_ranks(fsdp_replay, 2, upstream="verl"))


def test_fsdp2_replay_skyrl_ulysses():
    need("skyrl")
    _check_fsdp_replay(fsdp_harness.run_ranks(fsdp_replay, 2, upstream="skyrl"))


# =======================================================================================
# single process, torch only


@pytest.fixture(scope="module")
def toy():
    """Random float64 logits for a make_batch batch (vocab 50, eos 0)."""
    import torch

    batch = make_batch(50, 0, seed=1)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, S, 50, generator=g, dtype=torch.float64) * 3).requires_grad_()
    return batch, logits


def _call(batch, source, **kw):
    from replay_plugin.fsdp import response_logprobs

    args = dict(support_ids=batch["support"], loss_mask=batch["loss_mask"], temperature=TEMPERATURE)
    args.update(kw)
    return response_logprobs(source, batch["input_ids"], batch["attention_mask"], A, **args)


def test_explicit_reference_padded_and_remove_padding(toy):
    import torch

    batch, logits = toy
    ref = explicit_reference(logits.double(), batch, TEMPERATURE).double()
    lm = batch["loss_mask"]
    idx = batch["attention_mask"].reshape(-1).nonzero().squeeze(1)
    packed = logits.reshape(B * S, -1)[idx]
    want = torch.autograd.grad((ref * lm * batch["weights"]).sum(), logits)[0]
    for source, kw in ((logits, {}), (packed, {"indices": idx}), (packed.unsqueeze(0), {"indices": idx})):
        lp = _call(batch, source, **kw)
        assert lp.shape == (B, A) and lp.dtype == torch.float32
        assert torch.allclose((lp * lm).double(), ref.detach() * lm, atol=1e-6)
        got = torch.autograd.grad((lp * lm * batch["weights"]).sum(), logits, retain_graph=True)[0]
        assert torch.allclose(got, want, atol=1e-6)
        # the synthetic EOS rows are full-vocabulary logprobs
        z = logits[0, S - 2].detach() / TEMPERATURE
        assert float(lp[0, A - 1].detach()) == pytest.approx(float(z[0] - torch.logsumexp(z, 0)), abs=1e-5)


def test_replay_off_is_the_plain_path_and_needs_no_support(toy):
    import torch

    batch, logits = toy
    plain = _call(batch, logits, replay=False, support_ids=None, loss_mask=None)
    z = torch.log_softmax(logits.detach() / TEMPERATURE, dim=-1)
    want = z[:, :-1].gather(2, batch["input_ids"][:, 1:, None]).squeeze(2)[:, -A:]
    assert torch.allclose(plain.double(), want, atol=1e-6)


def test_mismatch_metrics_beside_the_logprobs(toy):
    """Given the rollout's logprobs, the call also returns the step's mismatch metrics over the
    loss-bearing tokens the engine sampled (the synthetic EOS rows have no rollout logprob),
    equal to a float64 computation written here; replay off compares the plain logprobs."""
    import numpy as np
    import torch

    batch, logits = toy
    ref = explicit_reference(logits.detach().double(), batch, TEMPERATURE).numpy()
    sampled = (batch["loss_mask"] != 0) & (batch["support"][:, -A:] != -1).any(-1)
    rollout = torch.from_numpy(ref + np.random.default_rng(3).normal(0, 0.05, ref.shape))
    rollout[~sampled] = float("nan")  # never read
    out = _call(batch, logits, rollout_logprobs=rollout, metrics_prefix="actor/")
    assert type(out).__name__ == "LogprobsWithMetrics"
    assert torch.equal(out.logprobs, _call(batch, logits))
    m = sampled.numpy()
    r = (out.logprobs.detach().double().numpy() - rollout.numpy())[m]
    c = np.minimum(np.exp(r), 2.0)
    want = {
        "actor/rollout_corr/kl": np.mean(-r),
        "actor/rollout_corr/k3_kl": np.mean(np.expm1(r) - r),
        "actor/rollout_corr/chi2_token": np.mean(np.exp(2 * r)) - 1,
        "actor/rollout_corr/rollout_is_eff_sample_size": c.sum() ** 2 / (len(c) * (c**2).sum()),
        "actor/rollout_corr/rollout_is_ratio_fraction_high": np.mean(np.exp(r) > 2.0),
    }
    for key, value in want.items():
        assert float(out.metrics[key]) == pytest.approx(float(value), rel=1e-4, abs=1e-7), key
    assert 5e-4 < float(out.metrics["actor/rollout_corr/k3_kl"]) < 5e-3  # ~ sigma**2 / 2 of the noise, not NaN

    plain = _call(batch, logits, replay=False, support_ids=None, rollout_logprobs=rollout, loss_mask=sampled)
    z = torch.log_softmax(logits.detach() / TEMPERATURE, dim=-1)
    t = z[:, :-1].gather(2, batch["input_ids"][:, 1:, None]).squeeze(2)[:, -A:].numpy()
    assert float(plain.metrics["rollout_corr/kl"]) == pytest.approx(float(np.mean((rollout.numpy() - t)[m])), rel=1e-4)
    with pytest.raises(ValueError, match="'loss_mask'.*rollout_logprobs were given without a loss mask"):
        _call(batch, logits, replay=False, support_ids=None, loss_mask=None, rollout_logprobs=rollout)


def test_hidden_state_path_values_and_gradients():
    import torch

    batch = make_batch(60, 0, seed=2)
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(B, S, 8, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(60, 8, generator=g, dtype=torch.float64).requires_grad_()
    lm, wts = batch["loss_mask"], batch["weights"].double()
    fused = _call(batch, hidden, lm_head_weight=weight)
    explicit = _call(batch, hidden @ weight.t())
    assert torch.allclose(fused, explicit, atol=1e-6)
    g_fused = torch.autograd.grad((fused * lm * wts).sum(), (hidden, weight))
    g_explicit = torch.autograd.grad((explicit * lm * wts).sum(), (hidden, weight))
    for a, b in zip(g_fused, g_explicit):
        assert torch.allclose(a, b, atol=1e-5)


def test_errors_name_what_is_missing(toy):
    import torch

    from replay_plugin.core.errors import ReplayDataError, ReplayTypeError

    batch, logits = toy

    def error(**kw):
        with pytest.raises((ReplayDataError, ReplayTypeError)) as info:
            _call(batch, logits.detach(), **kw)
        return info.value

    e = error(support_ids=None)
    assert e.field == "support_ids" and "no recorded support" in str(e)
    e = error(loss_mask=None)
    assert e.field == "loss_mask" and "no loss mask" in str(e)
    e = error(width=W + 1)
    assert e.field == "support_ids" and f"width {W}" in str(e) and f"expected width {W + 1}" in str(e)
    e = error(support_ids=batch["support"][:, :-1])
    assert e.field == "support_ids" and "one support row per token" in str(e)
    e = error(loss_mask=batch["loss_mask"][:, 1:])
    assert e.field == "loss_mask" and f"[{B}, {A}]" in str(e)
    e = error(support_ids=batch["support"].float())
    assert isinstance(e, ReplayTypeError) and e.field == "support_ids"
    # a second loss-bearing token without support in trajectory 0 (whose last token is a synthetic EOS)
    support = batch["support"].clone()
    support[0, S - A + 2] = -1
    e = error(support_ids=support)
    assert (e.field, e.trajectory, e.token) == ("support_ids", 0, 2) and f"(at +{A - 1 - 2})" in str(e)
    # a loss-bearing support row without its token
    support = batch["support"].clone()
    token = int(batch["input_ids"][3, S - A + 1])
    support[3, S - A + 1] = torch.where(support[3, S - A + 1] == token, (token + 1) % 50, support[3, S - A + 1])
    e = error(support_ids=support)
    assert (e.field, e.trajectory, e.token) == ("support_ids", 3, 1) and "does not contain its token" in str(e)
    # loss on a padding position
    lm = batch["loss_mask"].clone()
    lm[1, A - 1] = True
    e = error(loss_mask=lm)
    assert (e.field, e.trajectory, e.token) == ("loss_mask", 1, A - 1)
    # support ids outside the vocabulary (any row, loss-bearing or not)
    support = batch["support"].clone()
    support[2, S - A, 0] = 10_000
    e = error(support_ids=support, loss_mask=torch.where(torch.arange(A) == 0, False, batch["loss_mask"]))
    assert (e.field, e.trajectory, e.token) == ("support_ids", 2, 0) and "outside the vocabulary of 50" in str(e)
    # non-finite logits at a supported position: found after the (SP) gather, on every rank alike
    bad = logits.detach().clone()
    bad[2, S - A - 1] = float("nan")
    with pytest.raises(ReplayDataError) as info:
        _call(batch, bad)
    e = info.value
    assert (e.field, e.trajectory, e.token) == ("logits", 2, 0) and "not finite" in str(e)
    # remove-padding indices that do not match the attention mask, logits of the wrong layout
    e = error(indices=torch.arange(5))
    assert e.field == "indices"
    e = error(indices=batch["attention_mask"].reshape(-1).nonzero().squeeze(1))
    assert e.field == "source" and "remove-padding" in str(e)
    with pytest.raises(ValueError, match="temperature"):
        _call(batch, logits.detach(), temperature=0.0)


def test_unsupported_tokens_are_named_in_any_layout():
    """Issue 41 F11: two loss-bearing tokens without support in a left-justified grid (verl's
    engines lay sequences out so, num_actions = S - 1) were named by grid columns minus S -
    num_actions ("response tokens [1, 2]"), which are response tokens only in a right-aligned grid.
    The error names the first by ``token`` (the caller re-maps it to its layout, as verl's adapter
    does) and the others by their distance from it."""
    import torch

    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.fsdp import response_logprobs

    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    mask = ids != 0
    support = torch.full((2, 6, 3), -1)
    support[:, :, 0] = ids  # every token supported by itself ...
    support[1, 2:4] = -1  # ... but the two response tokens of row 1 (columns 2 and 3)
    loss = torch.zeros(2, 5, dtype=torch.bool)  # [B, S - 1]: column c - 1 for token c
    loss[0, 2:] = True
    loss[1, 1:3] = True
    logits = torch.randn(2, 6, 20, dtype=torch.float64)
    with pytest.raises(ReplayDataError) as info:
        response_logprobs(logits, ids, mask, 5, support_ids=support, loss_mask=loss)
    e = info.value
    assert (e.field, e.trajectory, e.token) == ("support_ids", 1, 1), e  # column 2 - (S - num_actions)
    assert "as are 1 later token(s) of this trajectory (at +1)" in str(e), e
    assert "response tokens [1, 2]" not in str(e), e


def test_hostile_ids_and_masks_get_typed_errors(toy):
    """Issue 32 item 9. On 452e6a8: a prompt (non-loss) token id >= V with replay on, and any
    id >= V with replay off, crashed with torch's index error; a prompt-row error named a negative
    token index; loss masks of 0.5 and 2 were read as True (here: refused, as everywhere)."""
    import torch

    from replay_plugin.core.errors import ReplayDataError, ReplayTypeError

    batch, logits = toy
    ids = batch["input_ids"].clone()
    prompt_col = S - A - 2  # a valid prompt token of row 1 (prompt length 5), not loss-bearing
    ids[1, prompt_col] = 50
    for replay in (True, False):
        kw = {} if replay else {"replay": False, "support_ids": None, "loss_mask": None}
        with pytest.raises(ReplayDataError) as info:
            from replay_plugin.fsdp import response_logprobs

            response_logprobs(
                logits.detach(),
                ids,
                batch["attention_mask"],
                A,
                temperature=TEMPERATURE,
                **{"support_ids": batch["support"], "loss_mask": batch["loss_mask"], **kw},
            )
        e = info.value
        assert (e.field, e.trajectory, e.token) == ("input_ids", 1, None), replay
        assert f"token id 50 is outside the vocabulary of 50 (at column {prompt_col} of input_ids" in str(e)
    # a response token id >= V with replay off names its response index
    ids = batch["input_ids"].clone()
    ids[0, S - A + 3] = 77
    with pytest.raises(ReplayDataError) as info:
        _call({**batch, "input_ids": ids}, logits.detach(), replay=False, support_ids=None, loss_mask=None)
    assert (info.value.field, info.value.trajectory, info.value.token) == ("input_ids", 0, 3)
    # a bad support row in the prompt: no negative token index
    support = batch["support"].clone()
    support[2, 3, 0] = 10_000
    with pytest.raises(ReplayDataError) as info:
        _call(batch, logits.detach(), support_ids=support)
    assert (info.value.field, info.value.trajectory, info.value.token) == ("support_ids", 2, None)
    assert "at column 3 of input_ids, before the response" in str(info.value)
    # masks: one rule (bool, or 0/1 numbers)
    lm = batch["loss_mask"]
    want = _call(batch, logits.detach())
    assert torch.equal(_call(batch, logits.detach(), loss_mask=lm.float()), want)
    for value, text in ((0.5, "holds 0.5"), (2.0, "holds 2")):
        bad = lm.float()
        bad[0, 1] = value
        with pytest.raises(ReplayDataError, match=text) as info:
            _call(batch, logits.detach(), loss_mask=bad)
        assert (info.value.field, info.value.trajectory, info.value.token) == ("loss_mask", 0, 1)
    am = batch["attention_mask"].clone()
    am[3, 0] = 2
    with pytest.raises(ReplayDataError, match="holds 2") as info:
        _call({**batch, "attention_mask": am}, logits.detach())
    assert info.value.field == "attention_mask"
    # unsigned support ids: the -1 padding is gone
    with pytest.raises(ReplayTypeError, match="cannot hold the padding id -1"):
        _call(batch, logits.detach(), support_ids=batch["support"].to(torch.uint8))


def test_package_import_is_lazy():
    code = (
        "import sys, replay_plugin.fsdp as f\n"
        "before = sorted(m for m in ('torch', 'verl', 'skyrl') if m in sys.modules)\n"
        "f.response_logprobs\n"
        "print(before, 'torch' in sys.modules, 'verl' in sys.modules or 'skyrl' in sys.modules)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True", "False"]
