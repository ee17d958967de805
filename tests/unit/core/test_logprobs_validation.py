"""Support rows are checked at every entry that takes them (issue 25, item 4).

Before, ``support_logprobs``, ``support_logprobs_from_hidden`` and ``replay_logprobs`` scored raw
support ids unchecked: a member ``>= V`` or a negative id other than ``-1`` was dropped from the
normaliser, a repeated id counted twice, and a sampled token outside its row gave a difference
of logits (possibly positive) instead of a logprob -- all silently. Each bad input below is now
a ``ReplayDataError`` naming the field, the trajectory and token, and the offending id; rows
outside the loss mask whose token is not a member score 0 (no logprob exists there); where
``-1`` sits in a row does not matter to the math and stays accepted. The tensor-parallel case
(the vocabulary is the sum of the shards) is in ``test_logprobs_tp.py``.
"""

from __future__ import annotations

import pytest
import torch

from replay_plugin.core import logprobs as lp_mod
from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.logprobs import (
    full_vocab_logprobs,
    full_vocab_logprobs_fixed_capacity,
    replay_logprobs,
    support_logprobs,
    support_logprobs_from_hidden,
)

B, S, W, V, H = 2, 4, 4, 12, 6
BAD = (1, 2)  # the (trajectory, token) every bad row is put at


def _case():
    """Hidden states, LM head, sampled ids, support rows that contain their token (distinct ids,
    -1 trailing), the loss mask (trajectory 1 ends in a synthetic EOS: loss-bearing, no support)
    and the trajectory ids."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    support = torch.full((B, S, W), -1, dtype=torch.int32)
    sampled = torch.empty(B, S, dtype=torch.long)
    for b in range(B):
        for s in range(S):
            k = 1 + (b + s) % W
            ids = torch.randperm(V, generator=g)[:k]
            support[b, s, :k] = ids.int()
            sampled[b, s] = ids[(b * s) % k]
    support[1, S - 1] = -1  # synthetic EOS
    loss = torch.ones(B, S, dtype=torch.bool)
    traj = torch.arange(B).unsqueeze(1).expand(B, S)
    return hidden, weight, sampled, support, loss, traj


def _call(entry: str, support, *, sampled=None, loss_mask=None, monkeypatch=None):
    """``(logprobs, valid)`` of one public entry on the case's data with ``support`` (and
    ``sampled`` / ``loss_mask`` when given; the support entries get ``loss_mask`` only then)."""
    hidden, weight, case_sampled, _, loss, traj = _case()
    sampled = case_sampled if sampled is None else sampled
    logits = hidden @ weight.t()
    if entry in ("hidden_sparse", "hidden_gather"):
        method = entry.split("_")[1]
        monkeypatch.setattr(lp_mod, "_projection_method", lambda h, w: method)
    kw = {} if loss_mask is None else {"loss_mask": loss_mask}
    if entry == "logits":
        return support_logprobs(logits, sampled, support, temperature=0.8, **kw)
    if entry.startswith("hidden"):
        return support_logprobs_from_hidden(hidden, weight, sampled, support, temperature=0.8, **kw)
    extra = {"lm_head_weight": weight} if entry == "replay_hidden" else {}
    source = hidden if entry == "replay_hidden" else logits
    res = replay_logprobs(source, sampled, support, loss if loss_mask is None else loss_mask, traj, B, **extra)
    return res.logprobs, res.valid


ENTRIES = ["logits", "hidden_sparse", "hidden_gather", "replay_logits", "replay_hidden"]


def _bad_row(kind: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The case's support and sampled ids with row BAD made bad in one way, and a piece of the
    expected message."""
    _, _, sampled, support, _, _ = _case()
    y = int(sampled[BAD])
    others = [i for i in range(V) if i != y]
    support, sampled = support.clone(), sampled.clone()
    if kind == "out_of_vocabulary":
        row, text = [y, V + 3, others[0], -1], f"support id {V + 3} is outside the vocabulary [0, {V})"
    elif kind == "out_of_vocabulary_only_member":  # the sampled token is that id too
        row, text = [V, -1, -1, -1], f"support id {V} is outside the vocabulary [0, {V})"
        sampled[BAD] = V
    elif kind == "negative":
        row, text = [y, -5, -1, -1], "support row holds id -5"
    elif kind == "duplicate":
        row, text = [y, others[1], others[1], -1], f"support id {others[1]} appears more than once"
    elif kind == "sampled_is_padding":  # -1 pads the row but is no member
        row, text = [others[0], -1, -1, -1], "sampled token -1 is not in its support row"
        sampled[BAD] = -1
    else:  # the sampled token is not in its row
        row, text = [others[0], others[1], -1, -1], f"sampled token {y} is not in its support row"
    support[BAD] = torch.tensor(row, dtype=torch.int32)
    return support, sampled, text


@pytest.mark.parametrize(
    "kind",
    ["out_of_vocabulary", "out_of_vocabulary_only_member", "negative", "duplicate", "not_member", "sampled_is_padding"],
)
@pytest.mark.parametrize("entry", ENTRIES)
def test_bad_support_rows_are_refused_naming_trajectory_token_and_id(entry, kind, monkeypatch):
    support, sampled, text = _bad_row(kind)
    with pytest.raises(ReplayDataError) as err:
        _call(entry, support, sampled=sampled, monkeypatch=monkeypatch)
    e = err.value
    assert (e.field, e.trajectory, e.token) == ("support_ids", *BAD), str(e)
    assert text in str(e), str(e)
    assert e.expected


@pytest.mark.parametrize("target", [V, V + 7, -1, -3])
@pytest.mark.parametrize("entry", ["replay_logits", "replay_hidden"])
def test_a_synthetic_eos_token_outside_the_vocabulary_is_refused(entry, target, monkeypatch):
    """Trajectory 1's last token has no support and is loss-bearing: its synthetic EOS, scored
    over the full vocabulary. Its sampled id outside [0, V) has no logprob; before, it got
    ``-logsumexp`` of the row (the target's logit read as 0), silently."""
    _, _, sampled, support, _, _ = _case()
    sampled = sampled.clone()
    sampled[1, S - 1] = target
    with pytest.raises(ReplayDataError) as err:
        _call(entry, support, sampled=sampled, monkeypatch=monkeypatch)
    e = err.value
    assert (e.field, e.trajectory, e.token) == ("sampled_ids", 1, S - 1), str(e)
    assert f"sampled token {target} of the loss-bearing position without support" in str(e), str(e)
    assert f"outside the vocabulary [0, {V})" in str(e), str(e)
    # The last id is fine, and equals the plain log-softmax.
    sampled[1, S - 1] = V - 1
    lp, valid = _call(entry, support, sampled=sampled, monkeypatch=monkeypatch)
    hidden, weight = _case()[:2]
    ref = torch.log_softmax(hidden[1, S - 1] @ weight.t(), -1)[V - 1]
    assert bool(valid[1, S - 1])
    torch.testing.assert_close(lp[1, S - 1].double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use_hidden", [False, True])
def test_full_vocabulary_entries_refuse_ids_outside_the_vocabulary(use_hidden):
    """``full_vocab_logprobs`` and ``full_vocab_logprobs_fixed_capacity`` (public): an id in no
    shard is refused naming its position; ``check_targets=False`` returns what Megatron's
    ``vocab_parallel_cross_entropy`` returns there, ``-logsumexp`` (not a logprob)."""
    hidden, weight, sampled, _, loss, traj = _case()
    logits = hidden @ weight.t()
    y = sampled.clone()
    y[1, 2] = V + 2
    with pytest.raises(ReplayDataError) as err:
        full_vocab_logprobs(logits, y)
    assert (err.value.field, err.value.trajectory, err.value.token) == ("sampled_ids", 1, 2), str(err.value)
    unchecked = full_vocab_logprobs(logits, y, check_targets=False)
    torch.testing.assert_close(unchecked[1, 2].double(), -torch.logsumexp(logits[1, 2], -1))
    need = torch.zeros(B, S, dtype=torch.bool)
    need[1, 2] = need[0, 3] = True
    kw = {"lm_head_weight": weight} if use_hidden else {}
    source = hidden if use_hidden else logits
    with pytest.raises(ReplayDataError) as err:
        full_vocab_logprobs_fixed_capacity(source, y, need, traj, B, **kw)
    assert (err.value.field, err.value.trajectory, err.value.token) == ("sampled_ids", 1, 2), str(err.value)
    out, selected = full_vocab_logprobs_fixed_capacity(source, y, need, traj, B, check_targets=False, **kw)
    assert bool(selected[1, 2]) and bool(selected[0, 3])
    torch.testing.assert_close(out[1, 2].double(), -torch.logsumexp(logits[1, 2], -1))
    # rows not selected are not checked: the same id where nothing is scored passes
    need[1, 2] = False
    out, selected = full_vocab_logprobs_fixed_capacity(source, y, need, traj, B, **kw)
    assert not bool(selected[1, 2])
    torch.testing.assert_close(out[0, 3].double(), torch.log_softmax(logits[0, 3], -1)[int(y[0, 3])])


@pytest.mark.parametrize("entry", ENTRIES)
def test_rows_outside_the_loss_without_their_token_score_zero(entry, monkeypatch):
    """A row on_inexact="mask" took out of the loss keeps its ids and may lack its token: it is
    exempt from the membership check and gets no logprob (0, not valid); the others are as
    before."""
    good = _case()[3]
    support, _, _ = _bad_row("not_member")
    loss = torch.ones(B, S, dtype=torch.bool)
    loss[BAD] = False
    lp, valid = _call(entry, support, loss_mask=loss, monkeypatch=monkeypatch)
    ref_lp, ref_valid = _call(entry, good, loss_mask=loss, monkeypatch=monkeypatch)
    assert float(lp[BAD]) == 0.0 and not bool(valid[BAD])
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[BAD] = False
    assert torch.equal(valid[keep], ref_valid[keep])
    torch.testing.assert_close(lp[keep], ref_lp[keep])
    # the same row, loss-bearing: refused
    with pytest.raises(ReplayDataError, match="not in its support row"):
        _call(entry, support, loss_mask=torch.ones(B, S, dtype=torch.bool), monkeypatch=monkeypatch)


def test_a_sampled_token_outside_its_row_is_refused_not_scored():
    """What the membership check prevents: scored unchecked (as ``replay_plugin.fsdp`` scores its
    compact columns on purpose), the value is z_y - logsumexp(z_S), here positive: the engine
    could not have sampled y from S at all."""
    logits = torch.zeros(1, 6)
    logits[0, 5] = 4.0
    support = torch.tensor([[0, 1, -1]], dtype=torch.int32)
    sampled = torch.tensor([5])
    lp, _, _ = lp_mod._support_logprobs(
        logits, sampled, support, temperature=1.0, vocab_start=0, tp_group=None, required=None, check=False
    )
    assert float(lp[0]) > 3.0
    with pytest.raises(ReplayDataError, match="sampled token 5 is not in its support row"):
        support_logprobs(logits, sampled, support)


@pytest.mark.parametrize("entry", ENTRIES)
def test_padding_position_and_member_order_do_not_matter(entry, monkeypatch):
    """The math treats a row as a set: -1 between members and any member order give the same
    result as the contract's form (members first, -1 trailing), so such rows are accepted."""
    _, _, sampled, support, _, _ = _case()
    y = int(sampled[BAD])
    a, b = [i for i in range(V) if i != y][:2]
    rows = [[y, a, b, -1], [a, -1, y, b], [-1, b, a, y], [-1, -1, -1, y]]
    results = []
    for row in rows:
        sup = support.clone()
        sup[BAD] = torch.tensor(row, dtype=torch.int32)
        results.append(_call(entry, sup, monkeypatch=monkeypatch))
    for lp, valid in results[1:3]:
        torch.testing.assert_close(lp, results[0][0])
        assert torch.equal(valid, results[0][1])
    assert float(results[3][0][BAD]) == 0.0  # the sampled token alone: probability 1


def test_synthetic_eos_and_rows_without_support_keep_working():
    """Rows without support (prompt, padding: outside the loss; the synthetic EOS: loss-bearing)
    pass the checks whatever their sampled id; the EOS row gets the full-vocabulary logprob."""
    hidden, weight, sampled, support, loss, traj = _case()
    logits = hidden @ weight.t()
    sampled = sampled.clone()
    support = support.clone()
    support[0, 0] = -1  # a prompt-like row: no support, outside the loss, any sampled id
    sampled[0, 0] = -7
    loss = loss.clone()
    loss[0, 0] = False
    res = replay_logprobs(logits, sampled, support, loss, traj, B)
    assert bool(res.full_vocab[1, S - 1]) and int(res.full_vocab.sum()) == 1
    eos = torch.log_softmax(logits[1, S - 1], dim=-1)[sampled[1, S - 1]]
    torch.testing.assert_close(res.logprobs[1, S - 1].double(), eos, rtol=1e-6, atol=1e-6)
    assert not bool(res.valid[0, 0]) and float(res.logprobs[0, 0]) == 0.0
    lp, valid = support_logprobs(logits, sampled, support)
    assert not bool(valid[0, 0]) and not bool(valid[1, S - 1])


def test_loss_mask_argument_is_checked():
    hidden, weight, sampled, support, _, _ = _case()
    logits = hidden @ weight.t()
    with pytest.raises(ReplayDataError) as err:
        support_logprobs(logits, sampled, support, loss_mask=torch.ones(B, S + 1, dtype=torch.bool))
    assert err.value.field == "loss_mask"
    with pytest.raises(ReplayTypeError) as terr:
        support_logprobs_from_hidden(hidden, weight, sampled, support, loss_mask=torch.ones(B, S).numpy())
    assert terr.value.field == "loss_mask"
    # 0/1 numbers are a mask (core.inputs), integer or float
    for ones in (torch.ones(B, S, dtype=torch.int64), torch.ones(B, S)):
        lp, _ = support_logprobs(logits, sampled, support, loss_mask=ones)
        torch.testing.assert_close(lp, support_logprobs(logits, sampled, support)[0])


def test_leading_dimensions_locate_the_row():
    """[n] positions name only the token; [a, b, c] name the first index and the index within it."""
    hidden, weight, sampled, support, _, _ = _case()
    logits = hidden @ weight.t()
    bad, _, _ = _bad_row("duplicate")
    with pytest.raises(ReplayDataError) as err:
        support_logprobs(logits.reshape(B * S, V), sampled.reshape(-1), bad.reshape(B * S, W))
    assert (err.value.trajectory, err.value.token) == (None, BAD[0] * S + BAD[1])
    with pytest.raises(ReplayDataError) as err:
        support_logprobs(logits.reshape(B, 2, 2, V), sampled.reshape(B, 2, 2), bad.reshape(B, 2, 2, W))
    assert (err.value.trajectory, err.value.token) == BAD


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor value by the host (``bool(t)``, ``int(t)``, ``t.item()``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("entry", ENTRIES)
def test_checks_cost_one_host_sync(entry, monkeypatch):
    """The happy path reads one value from the device per call: the support entries their checks'
    ``any()``; replay_logprobs its one error check, which the support checks joined (the other
    read is of the CPU error table it builds, not of the device)."""
    support = _case()[3]
    with _HostSyncs() as syncs:
        _call(entry, support, monkeypatch=monkeypatch)
    assert syncs.count == (2 if entry.startswith("replay") else 1), syncs.count


def _fsdp_batch():
    """A left-padded batch for ``replay_plugin.fsdp.response_logprobs`` (single process): logits
    [B, S, V], ids, attention, support rows at each response token's own position, loss mask
    [B, A]."""
    g = torch.Generator().manual_seed(9)
    seq, actions = 6, 3
    ids = torch.randint(0, V, (B, seq), generator=g)
    attention = torch.ones(B, seq, dtype=torch.bool)
    attention[1, 0] = False
    support = torch.full((B, seq, W), -1, dtype=torch.int32)
    for b in range(B):
        for s in range(seq - actions, seq):
            others = [i for i in torch.randperm(V, generator=g).tolist() if i != int(ids[b, s])]
            support[b, s, :3] = torch.tensor([int(ids[b, s]), others[0], others[1]], dtype=torch.int32)
    loss = torch.ones(B, actions, dtype=torch.bool)
    logits = torch.randn(B, seq, V, generator=g, dtype=torch.float64)
    return logits, ids, attention, actions, support, loss


@pytest.mark.parametrize("hidden", [False, True])
def test_fsdp_entry_refuses_duplicates_and_zeroes_masked_rows_without_their_token(hidden):
    from replay_plugin.fsdp.replay import response_logprobs

    logits, ids, attention, actions, support, loss = _fsdp_batch()
    seq = ids.shape[1]
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    source = torch.randn(B, seq, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    if not hidden:
        source, weight = source @ weight.t(), None

    def call(sup, lm):
        return response_logprobs(source, ids, attention, actions, support_ids=sup, loss_mask=lm, lm_head_weight=weight)

    good = call(support, loss)
    dup = support.clone()
    dup[0, seq - 2, 2] = dup[0, seq - 2, 1]
    with pytest.raises(ReplayDataError) as err:
        call(dup, loss)
    assert (err.value.field, err.value.trajectory, err.value.token) == ("support_ids", 0, 1)
    assert "twice" in str(err.value)
    # a synthetic EOS (loss-bearing, no support) whose id is outside the vocabulary: before,
    # an index error from the logits path, -logsumexp from hidden states
    eos = support.clone()
    eos[0, seq - 1] = -1
    bad_ids = ids.clone()
    bad_ids[0, seq - 1] = V + 1
    with pytest.raises(ReplayDataError) as err:
        response_logprobs(source, bad_ids, attention, actions, support_ids=eos, loss_mask=loss, lm_head_weight=weight)
    assert (err.value.field, err.value.trajectory, err.value.token) == ("input_ids", 0, actions - 1)
    assert f"token id {V + 1} is outside the vocabulary of {V}" in str(err.value)
    # a row outside the loss without its token: 0 there, the rest unchanged
    masked = support.clone()
    masked[1, seq - 1, 0] = (int(ids[1, seq - 1]) + 1) % V
    masked[1, seq - 1, 1:] = -1
    lm = loss.clone()
    lm[1, actions - 1] = False
    out = call(masked, lm)
    assert float(out[1, actions - 1]) == 0.0
    keep = torch.ones_like(lm)
    keep[1, actions - 1] = False
    torch.testing.assert_close(out[keep], good[keep])


@pytest.mark.parametrize("seed", range(4))
def test_row_checks_match_a_plain_reference_on_random_rows(seed):
    """The device checks (one sort per row, neighbour counts, a binary search) give each row the
    same first problem as a plain per-row reading of the contract, on rows with ids below -1,
    past the vocabulary, repeats, -1 anywhere, sampled ids in and out of the row (also -1)."""
    g = torch.Generator().manual_seed(seed)
    n, w, v = 400, 6, 9
    sup = torch.randint(-3, v + 3, (n, w), generator=g)
    sup = torch.where(torch.rand(n, w, generator=g) < 0.3, -1, sup)  # plenty of padding, anywhere
    sup[: n // 4] = torch.stack([torch.randperm(v, generator=g)[:w] for _ in range(n // 4)])  # clean rows
    sampled = torch.where(
        torch.rand(n, generator=g) < 0.6, sup[torch.arange(n), torch.randint(0, w, (n,), generator=g)], -1
    )
    sampled = torch.where(torch.rand(n, generator=g) < 0.2, torch.randint(-1, v + 2, (n,), generator=g), sampled)
    required = torch.rand(n, generator=g) < 0.7
    sup[0], sampled[0] = torch.tensor([-1, -1, -1, -1, -1, -1]), 4  # no support: fine
    sup[1], sampled[1] = torch.tensor([3, -1, 5, -1, -1, -1]), -1  # -1 is padding, not a member
    required[1] = True
    member = sup >= 0
    local_m = member & (sup < v)
    check = lp_mod._RowCheck(sup, sampled, member, local_m, required, 0, v, None)
    check.finish(check.local_count.double())

    def reference(row, y, req):
        ids = [int(i) for i in row]
        members = [i for i in ids if i >= 0]
        if any(i < -1 for i in ids):
            return lp_mod._BAD_ID
        if any(i >= v for i in members):
            return lp_mod._OUT_OF_VOCAB
        if len(set(members)) != len(members):
            return lp_mod._DUPLICATE
        if members and req and int(y) not in members:
            return lp_mod._NOT_MEMBER
        return 0

    expected = [reference(r, y, q) for r, y, q in zip(sup, sampled, required)]
    assert check.code.tolist() == expected
    kinds = {lp_mod._BAD_ID, lp_mod._OUT_OF_VOCAB, lp_mod._DUPLICATE, lp_mod._NOT_MEMBER, 0}
    assert expected[1] == lp_mod._NOT_MEMBER and kinds <= set(expected)
