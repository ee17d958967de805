"""Sampler-support replay for FSDP trainers (HF models, remove-padding, Ulysses SP).

:func:`response_logprobs` replaces a trainer's ``logprobs_from_logits`` + gather + unpad +
``pad_input`` + response slice: it moves sampled ids, support rows and loss mask to the
positions that predict them (padded or remove-padding layout, Ulysses SP slice), scores each
over its recorded support (``replay_plugin.core.logprobs``), gives a synthetic EOS its
full-vocabulary logprob, and returns ``[B, num_actions]``. With ``replay=False`` it is the
ordinary full-vocabulary path. One all-gather over ``sp_group`` per call whatever the data;
every check that can reject data runs where all SP ranks reject together.
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np
import torch
import torch.distributed

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.inputs import as_mask, check_support_dtype, check_temperature
from replay_plugin.core.logprobs import (
    DEFAULT_CHUNK_SIZE,
    _support_logprobs,
    _support_logprobs_from_hidden,
    full_vocab_logprobs_fixed_capacity,
)
from replay_plugin.core.metrics import LogprobsWithMetrics, mismatch_metrics

__all__ = ["response_logprobs"]

#: Rows per chunk of the plain (replay-off) path: its temporaries are ``[rows, V]``.
PLAIN_CHUNK_ROWS = 1024


@overload
def response_logprobs(
    source: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_actions: int,
    *,
    rollout_logprobs: None = None,
    metrics_prefix: str = "",
    support_ids: Any | None = None,
    loss_mask: Any | None = None,
    replay: bool = True,
    lm_head_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    indices: torch.Tensor | None = None,
    sp_group: torch.distributed.ProcessGroup | None = None,
    grad_scaler: bool = True,
    width: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor: ...


@overload
def response_logprobs(
    source: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_actions: int,
    *,
    rollout_logprobs: Any,
    metrics_prefix: str = "",
    support_ids: Any | None = None,
    loss_mask: Any | None = None,
    replay: bool = True,
    lm_head_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    indices: torch.Tensor | None = None,
    sp_group: torch.distributed.ProcessGroup | None = None,
    grad_scaler: bool = True,
    width: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> LogprobsWithMetrics: ...


def response_logprobs(
    source: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_actions: int,
    *,
    rollout_logprobs: Any | None = None,
    metrics_prefix: str = "",
    support_ids: Any | None = None,
    loss_mask: Any | None = None,
    replay: bool = True,
    lm_head_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    indices: torch.Tensor | None = None,
    sp_group: torch.distributed.ProcessGroup | None = None,
    grad_scaler: bool = True,
    width: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor | LogprobsWithMetrics:
    """Response logprobs ``[B, num_actions]`` of one microbatch, replayed over the recorded support.

    Args:
        source: the model's per-position output on this rank, logits ``[..., V]`` (raw, not yet
            divided by the temperature) or, with ``lm_head_weight``, the final hidden states
            ``[..., H]``. Leading shape ``[B, S]`` (padded layout), or ``[1, n]`` / ``[n]``
            with ``indices`` (``n = nnz``); with ``sp_group`` this rank's slice,
            ``ceil(n / sp)`` positions of dim 1.
        input_ids: ``[B, S]`` the full token batch (the same on every SP rank).
        attention_mask: ``[B, S]`` bool or 0/1, valid tokens.
        num_actions: response length ``A``: the result scores tokens ``S - A .. S - 1``.
        support_ids: ``[B, S, W]`` integer support rows at each token's own position, ``-1``
            padding (``replay_plugin.core.support.dense_support_batch(...).ids``; numpy or
            torch). Required when ``replay``.
        loss_mask: ``[B, A]`` response loss mask (nonzero = loss-bearing), right-aligned to the
            ``S`` columns; use ``DenseSupport.loss_mask[:, -A:]`` when the batch came from
            ``dense_support_batch``. Required when ``replay``.
        replay: False gives the ordinary full-vocabulary logprobs; support and loss mask are then
            ignored.
        lm_head_weight: ``[V, H]`` the full (unsharded) LM-head weight when ``source`` holds
            hidden states: only (token, candidate) pairs are projected.
        temperature: sampling temperature ``T > 0`` the logits are divided by (pass 1.0 when
            ``source`` already is ``logits / T``).
        indices: ``[nnz]`` remove-padding indices into the flattened ``[B * S]`` batch
            (``unpad_input``'s second output: the valid positions in row-major order).
        sp_group: the Ulysses sequence-parallel group, or None.
        grad_scaler: with SP, multiply the gradient of the gathered result by the SP size in
            backward, as verl's and skyrl's ``gather_outputs_and_unpad`` do by default: every
            SP rank computes the same loss, and FSDP's mean over ``dp * sp`` ranks then equals
            the mean over data-parallel groups.
        width: when given, the support width ``W`` the caller expects (e.g. its ``top_k``).
        chunk_size: (token, candidate) pairs per chunk of the hidden-state path.
        rollout_logprobs: ``[B, A]`` float, the engine's logprob of each response token (aligned
            like ``loss_mask``): also return the step's train-inference mismatch metrics
            (:func:`replay_plugin.metrics.mismatch_metrics`, verl's key names) of the result
            against them over ``loss_mask`` (required then, replay on or off), less the
            synthetic EOS rows with replay on (the engine never sampled them). Values outside
            those tokens are never read.
        metrics_prefix: prepended to every metric key (e.g. ``"actor/"``).

    Returns:
        With ``rollout_logprobs``: ``LogprobsWithMetrics(logprobs, metrics)``, the logprobs below
        and a dict of 0-d tensors (no host synchronisation; the same on every SP rank).
        Otherwise float32 ``[B, A]``; column ``j`` scores token ``S - A + j`` with the output of the
        position that predicts it. With ``replay``: renormalised over the support where the
        target has a support row, the full-vocabulary logprob for a loss-bearing target without
        one (at most one per trajectory: the synthetic EOS), 0 elsewhere (e.g. padding).
        Differentiable with respect to ``source`` (and ``lm_head_weight``).

    Raises:
        ReplayDataError / ReplayTypeError naming the field (and trajectory, token index within
        the response where it applies): replay on without ``support_ids`` or ``loss_mask``;
        shapes or width that disagree; support ids outside the vocabulary or negative other
        than ``-1``, or an id twice in one row (any row, loss-bearing or not); ``indices`` that
        are not the attention mask's valid positions; a loss-bearing token that has no
        predicting position, that has a support row not containing it, whose id is outside the
        vocabulary (field ``input_ids``), or that is its trajectory's second loss-bearing token
        without support; a supported logprob that is not
        finite. A row outside the loss mask whose token is not in it (``on_inexact="mask"``)
        scores 0.
    """
    temperature = check_temperature(temperature)
    if not isinstance(source, torch.Tensor) or not source.is_floating_point():
        raise ReplayTypeError("source", f"got {_describe(source)}", expected="a floating-point tensor")
    device = source.device
    input_ids = _int_tensor(input_ids, "input_ids", device)
    if input_ids.dim() != 2:
        raise ReplayDataError("input_ids", f"shape {tuple(input_ids.shape)}", expected="[B, S]")
    batch, seq = input_ids.shape
    mask = _bool_tensor(attention_mask, "attention_mask", device)
    if tuple(mask.shape) != (batch, seq):
        raise ReplayDataError("attention_mask", f"shape {tuple(mask.shape)}", expected=f"{(batch, seq)} like input_ids")
    if isinstance(num_actions, bool) or not isinstance(num_actions, (int, np.integer)) or not 1 <= num_actions < seq:
        raise ReplayDataError(
            "num_actions", f"got {num_actions!r} for {seq} columns", expected=f"an int in [1, {seq - 1}]"
        )
    num_actions = int(num_actions)
    sp_size, sp_rank = _sp(sp_group)

    # Target of every layout position as a flat index into [B * S] (-1: no target), [b_l, n].
    target, predictor_of = _targets(mask, indices, device)
    n = target.shape[1]
    part = -(-n // sp_size)
    local_target = _slice(target, sp_size, sp_rank, part)  # [b_l, part]
    src = _local_source(source, local_target.shape, indices is not None, lm_head_weight)

    vocab = lm_head_weight.shape[0] if lm_head_weight is not None else src.shape[-1]
    if replay:
        support, tmask = _replay_metadata(
            input_ids, mask, num_actions, support_ids, loss_mask, width, predictor_of, vocab, device
        )
        values, valid = _replay_local(
            src, local_target, input_ids, support, tmask, batch, seq, lm_head_weight, temperature, chunk_size
        )
        # One all-gather for values and validity together (gradients flow through the values).
        both = _gather(torch.stack([values, valid.to(values.dtype)], dim=-1), sp_group, sp_size, grad_scaler)
        gathered, valid_all = both[..., 0], both[..., 1].detach() != 0
        _check_finite(gathered, valid_all, target, seq, num_actions)
    else:
        _check_scored_ids(input_ids, predictor_of, vocab, num_actions)
        values = _plain_logprobs(src, local_target, input_ids, lm_head_weight, temperature)
        gathered = _gather(values, sp_group, sp_size, grad_scaler)
    result = _restore(gathered[:, :n], indices, batch, seq, num_actions)
    if rollout_logprobs is None:
        return result
    if loss_mask is None:
        raise ReplayDataError(
            "loss_mask",
            "rollout_logprobs were given without a loss mask: the metrics need the response tokens",
            expected=f"[{batch}, {num_actions}] response loss mask",
        )
    rollout = _as_tensor(rollout_logprobs, "rollout_logprobs", device)
    scored = _bool_tensor(loss_mask, "loss_mask", device)
    if not rollout.is_floating_point():
        raise ReplayTypeError("rollout_logprobs", f"dtype {rollout.dtype}", expected="a floating-point tensor")
    for field, t in (("rollout_logprobs", rollout), ("loss_mask", scored)):
        if tuple(t.shape) != (batch, num_actions):
            raise ReplayDataError(
                field, f"shape {tuple(t.shape)}", expected=f"[{batch}, {num_actions}] like the result"
            )
    if replay:  # a synthetic EOS (no support) was never sampled: no rollout logprob
        scored = scored & (support[:, seq - num_actions :] != -1).any(-1)
    return LogprobsWithMetrics(result, mismatch_metrics(result, rollout, scored, prefix=metrics_prefix))


# --------------------------------------------------------------------------- inputs


def _describe(x: Any) -> str:
    return f"{type(x).__name__} of dtype {x.dtype}" if hasattr(x, "dtype") else type(x).__name__


def _as_tensor(x: Any, field: str, device: torch.device) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise ReplayTypeError(field, f"got {type(x).__name__}", expected="a torch tensor or numpy array")
    return x.to(device)


def _int_tensor(x: Any, field: str, device: torch.device) -> torch.Tensor:
    t = _as_tensor(x, field, device)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ReplayTypeError(field, f"got dtype {t.dtype}", expected="an integer tensor")
    return t


def _bool_tensor(x: Any, field: str, device: torch.device) -> torch.Tensor:
    """A token-selecting mask as bool: bool, or integers 0/1 (``core.inputs``; before, ``!= 0``
    read 0.5 and 2 as True)."""
    return as_mask(_as_tensor(x, field, device), field)


def _sp(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _targets(mask: torch.Tensor, indices: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``target [b_l, n]``: flat ``[B * S]`` index of the token each layout position predicts
    (-1 for none); ``predictor_of [B, S]``: True where a token has a predicting position."""
    batch, seq = mask.shape
    flat = torch.arange(batch * seq, device=device).view(batch, seq)
    if indices is None:
        target = torch.full((batch, seq), -1, dtype=torch.long, device=device)
        target[:, :-1] = flat[:, 1:]
        predictor_of = torch.zeros_like(mask)
        predictor_of[:, 1:] = True
        return target, predictor_of
    idx = _int_tensor(indices, "indices", device).long().reshape(-1)
    expected = mask.reshape(-1).nonzero().squeeze(1)
    if idx.shape != expected.shape or not bool(torch.equal(idx, expected)):
        raise ReplayDataError(
            "indices",
            f"{idx.numel()} indices that are not the attention mask's {expected.numel()} valid positions",
            expected="unpad_input's indices for this attention_mask (valid positions, row-major)",
        )
    row = idx // max(seq, 1)
    nxt = torch.full_like(idx, -1)
    same_row = row[1:] == row[:-1]
    nxt[:-1] = torch.where(same_row, idx[1:], -1)
    predictor_of = torch.zeros(batch * seq, dtype=torch.bool, device=device)
    predictor_of[nxt[nxt >= 0]] = True
    return nxt.unsqueeze(0), predictor_of.view(batch, seq)


def _slice(target: torch.Tensor, sp_size: int, sp_rank: int, part: int) -> torch.Tensor:
    """The Ulysses partition of dim 1: pad to ``sp_size * part`` with -1, keep slice ``sp_rank``."""
    if sp_size == 1:
        return target
    padded = torch.full((target.shape[0], sp_size * part), -1, dtype=target.dtype, device=target.device)
    padded[:, : target.shape[1]] = target
    return padded[:, sp_rank * part : (sp_rank + 1) * part]


def _local_source(source: torch.Tensor, shape, packed: bool, lm_head_weight) -> torch.Tensor:
    b_l, part = shape
    lead = tuple(source.shape[:-1])
    if packed and lead == (part,):
        source = source.unsqueeze(0)
    elif lead != (b_l, part):
        kind = "hidden states" if lm_head_weight is not None else "logits"
        want = f"[{part}, D] or [1, {part}, D]" if packed else f"[{b_l}, {part}, D]"
        raise ReplayDataError(
            "source",
            f"{kind} of shape {tuple(source.shape)}",
            expected=f"{want} for this rank's positions of the {'remove-padding' if packed else 'padded'} layout",
        )
    if lm_head_weight is not None and (lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != source.shape[-1]):
        raise ReplayDataError(
            "lm_head_weight",
            f"shape {tuple(lm_head_weight.shape)} for hidden size {source.shape[-1]}",
            expected="[V, H], the full LM-head weight",
        )
    return source


def _replay_metadata(input_ids, mask, num_actions, support_ids, loss_mask, width, predictor_of, vocab, device):
    """Validated ``support [B, S, W]`` (long) and target loss mask ``[B, S]`` (bool).

    Everything here depends only on the batch, identical on every SP rank: a rejection happens
    on all of them, before any collective.
    """
    batch, seq = input_ids.shape
    if support_ids is None:
        raise ReplayDataError(
            "support_ids",
            "replay is on but no recorded support was given",
            expected="the dense support batch [B, S, W] (core.support.dense_support_batch) or replay=False",
        )
    if loss_mask is None:
        raise ReplayDataError(
            "loss_mask",
            "replay is on but no loss mask was given",
            expected=f"the response loss mask [{batch}, {num_actions}]",
        )
    support = _int_tensor(support_ids, "support_ids", device)
    check_support_dtype(support.dtype)
    if support.dim() != 3 or tuple(support.shape[:2]) != (batch, seq):
        raise ReplayDataError(
            "support_ids",
            f"shape {tuple(support.shape)} for input_ids {(batch, seq)}",
            expected=f"[{batch}, {seq}, W]: one support row per token",
        )
    w = support.shape[2]
    if w < 1 or (width is not None and w != width):
        raise ReplayDataError(
            "support_ids",
            f"rows have width {w}",
            expected=f"width {width}" if width is not None else "width >= 1",
        )
    lm = _bool_tensor(loss_mask, "loss_mask", device)
    if tuple(lm.shape) != (batch, num_actions):
        raise ReplayDataError(
            "loss_mask", f"shape {tuple(lm.shape)}", expected=f"[{batch}, {num_actions}] (batch, num_actions)"
        )
    tmask = torch.zeros((batch, seq), dtype=torch.bool, device=device)
    tmask[:, seq - num_actions :] = lm
    support = support.long()
    _check_support_rows(support, tmask, input_ids, mask, predictor_of, vocab, num_actions)
    return support, tmask


def _check_support_rows(support, tmask, input_ids, mask, predictor_of, vocab, num_actions) -> None:
    """Reject, naming trajectory and response token: support ids ``[B, S, W]`` outside the
    vocabulary or repeated in a row, loss-bearing tokens (``tmask`` ``[B, S]``) without a
    predicting position, loss-bearing rows that lack their token, and a second unsupported
    loss-bearing token in a row. One host sync; rows are located only on failure."""
    seq = input_ids.shape[1]
    supported = (support >= 0).any(dim=2)
    contains = (support == input_ids.unsqueeze(2).long()).any(dim=2)
    no_predictor = tmask & ~(predictor_of & mask)
    not_member = tmask & supported & ~contains
    unsupported = tmask & ~supported
    extra = unsupported & (unsupported.cumsum(dim=1) > 1)
    outside = (support >= vocab).any(dim=2) | (support < -1).any(dim=2)
    srt = support.sort(dim=2).values  # a repeated member would count twice in the normaliser
    repeated = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(dim=2)
    # (flags [B, S], field, problem at (b, s), expected), in the order they are reported
    cases = (
        (
            outside,
            "support_ids",
            lambda b, s: f"row {support[b, s].tolist()} holds ids outside the vocabulary of {vocab}",
            f"ids in [0, {vocab}) and -1 padding",
        ),
        (
            repeated,
            "support_ids",
            lambda b, s: f"row {support[b, s].tolist()} holds an id twice (it would count twice in the normaliser)",
            "distinct ids in each support row",
        ),
        _scored_ids_case(input_ids, predictor_of, tmask, vocab),
        (
            no_predictor,
            "loss_mask",
            lambda b, s: (
                "loss-bearing token has no predicting position (it is its row's first valid token, or a "
                "padding position)"
            ),
            "loss only on valid tokens that follow another valid token",
        ),
        (
            not_member,
            "support_ids",
            lambda b, s: f"support row {support[b, s].tolist()} does not contain its token {int(input_ids[b, s])}",
            "every loss-bearing support row to contain its sampled token",
        ),
    )
    found = torch.stack([flags.any() for flags, *_ in cases] + [extra.any()]).tolist()  # one host sync
    if not any(found):
        return
    first = seq - num_actions
    _raise_first_case(cases, found, first)
    b = int(extra.nonzero()[0, 0])
    columns = unsupported[b].nonzero().squeeze(1).tolist()
    # Named by the first one's index (``token``, which a caller with another layout re-maps) and
    # distances, never by grid columns: those are response tokens only in a right-aligned grid.
    later = ", ".join(f"+{c - columns[0]}" for c in columns[1:])
    others = f"{len(columns) - 1} later token(s) of this trajectory (at {later})"
    raise ReplayDataError(
        "support_ids",
        f"loss-bearing without a support row, as are {others}",
        trajectory=b,
        token=columns[0] - first,
        expected="support for every loss-bearing token but one synthetic EOS per trajectory",
    )


def _scored_ids_case(input_ids, predictor_of, tmask, vocab):
    """The check case (see :func:`_check_support_rows`) of token ids outside ``[0, vocab)`` at a
    position some layout position predicts, loss-bearing or not: scoring gathers the logit of
    every such id (an index error on CPU, a device-side assert on CUDA) and a synthetic EOS
    scored from hidden states would get ``-logsumexp``."""
    bad = predictor_of & ((input_ids < 0) | (input_ids >= vocab))

    def problem(b: int, s: int) -> str:
        what = "loss-bearing token" if tmask is not None and bool(tmask[b, s]) else "token"
        return f"{what} id {int(input_ids[b, s])} is outside the vocabulary of {vocab}"

    return bad, "input_ids", problem, f"token ids in [0, {vocab}) wherever a position predicts them"


def _raise_first_case(cases, found, first: int) -> None:
    """Raise for the first case whose flag is set (``found``: one bool per case), naming the
    trajectory and the response token (a prompt or padding column is named in the message: it
    has no response index)."""
    for (flags, field, problem, expected), hit in zip(cases, found):
        if hit:
            b, s = (int(v) for v in flags.nonzero()[0])
            text = problem(b, s)
            if s < first:
                text += f" (at column {s} of input_ids, before the response)"
            raise ReplayDataError(field, text, trajectory=b, token=s - first if s >= first else None, expected=expected)


def _check_scored_ids(input_ids, predictor_of, vocab: int, num_actions: int) -> None:
    """The replay-off path's only data check (one host sync): ids inside the vocabulary."""
    case = _scored_ids_case(input_ids, predictor_of, None, vocab)
    if bool(case[0].any()):
        _raise_first_case([case], [True], input_ids.shape[1] - num_actions)


# --------------------------------------------------------------------------- scoring


def _gather_rows(values: torch.Tensor, target: torch.Tensor, pad) -> torch.Tensor:
    """``values.flat[target]`` over the trailing dims, ``pad`` where ``target < 0``."""
    trail = values.shape[2:]
    flat = values.reshape(-1, *trail)
    picked = flat.index_select(0, target.reshape(-1).clamp(min=0)).view(*target.shape, *trail)
    missing = (target < 0).view(*target.shape, *([1] * len(trail)))
    return torch.where(missing, torch.full((), pad, dtype=values.dtype, device=values.device), picked)


def _replay_local(src, target, input_ids, support, tmask, batch, seq, lm_head_weight, temperature, chunk_size):
    """Replayed logprobs and validity of this rank's positions ``[b_l, part]``."""
    sampled = _gather_rows(input_ids.long(), target, 0)
    sup = _gather_rows(support, target, -1)
    need_mask = _gather_rows(tmask, target, False)
    traj = torch.where(target >= 0, target // seq, -1)
    if lm_head_weight is not None:
        # The rows were checked on the whole batch (_check_support_rows): no second check here.
        lp, valid, _ = _support_logprobs_from_hidden(
            src,
            lm_head_weight,
            sampled,
            sup,
            temperature=temperature,
            chunk_size=chunk_size,
            vocab_start=0,
            tp_group=None,
            required=None,
            check=False,
        )
        # A row outside the loss whose token is not in it (on_inexact="mask") has no logprob.
        valid = valid & ((sup == sampled.unsqueeze(-1)).any(dim=-1) | need_mask)
        lp = torch.where(valid, lp, 0.0)
        # Fixed capacity B on every rank: the same work and no data-dependent branch, wherever
        # the synthetic EOS rows fall (their uniqueness per trajectory was checked on the batch).
        full, selected = full_vocab_logprobs_fixed_capacity(
            src,
            sampled,
            need_mask & ~valid,
            traj,
            batch,
            lm_head_weight=lm_head_weight,
            temperature=temperature,
            check_targets=False,  # the loss-bearing ids were checked on the batch
        )
        return torch.where(valid, lp, full), valid | selected
    return _replay_from_logits(src, sampled, sup, need_mask, traj, batch, temperature)


def _replay_from_logits(logits, sampled, sup, need_mask, traj, batch, temperature):
    """The logits path with one ``[N, V]`` gradient buffer.

    Calling the core functions on the logits directly costs two dense ``[N, V]`` gradients (the
    support gather's and the fallback rows' index_select's) plus their sum; measured 0.8 x
    ``[N, V]`` more than the plain path at the peak of a step. Here one autograd function reads
    the candidates ``[N, W + 1]`` (support members and the sampled id) and the fallback rows
    ``[B, V]``, and writes both gradients into one buffer; the core functions score those
    compact inputs (support ids renumbered to columns, the sampled id in column W; one row per
    trajectory). It saves no ``[N, V]`` tensor, so the caller's logits can be freed before the
    backward.
    """
    shape = sampled.shape
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    n, w = flat.shape[0], sup.shape[-1]
    device = flat.device
    y = sampled.reshape(-1)
    rows_sup = sup.reshape(n, w)
    member = rows_sup >= 0
    valid = member.any(dim=1)
    need = need_mask.reshape(-1) & ~valid
    # The row of each trajectory's synthetic EOS (at most one per trajectory, checked on the whole
    # batch); slot `batch` collects everything else.
    slot = torch.where(need, traj.reshape(-1), batch)
    positions = torch.arange(n, device=device)
    rows = torch.zeros(batch + 1, dtype=torch.long, device=device).scatter_(0, slot, positions)[:batch]
    has = torch.zeros(batch + 1, dtype=torch.bool, device=device).scatter_(0, slot, torch.ones_like(need))[:batch]
    rows = torch.where(has, rows, 0)
    cand = torch.cat([rows_sup.long().clamp(min=0), y.unsqueeze(1)], dim=1)
    compact, picked = _SelectLogits.apply(flat, cand, rows)
    columns = torch.where(member, torch.arange(w, device=device), -1)
    # Column w (the sampled id's logit) is never a member of `columns`: score it unchecked.
    lp, _, _ = _support_logprobs(
        compact,
        torch.full_like(y, w),
        columns,
        temperature=temperature,
        vocab_start=0,
        tp_group=None,
        required=None,
        check=False,
    )
    # A row outside the loss whose token is not in it (on_inexact="mask") has no logprob.
    valid = valid & ((rows_sup == y.unsqueeze(1)).any(dim=1) | need_mask.reshape(-1))
    full, _ = full_vocab_logprobs_fixed_capacity(
        picked,
        y.index_select(0, rows),
        has,
        torch.arange(batch, device=device),
        batch,
        temperature=temperature,
        check_targets=False,  # the loss-bearing ids were checked on the batch
    )
    target = torch.where(has, rows, n)
    fallback = torch.zeros(n + 1, dtype=full.dtype, device=device).scatter_add(0, target, torch.where(has, full, 0.0))
    selected = torch.zeros(n + 1, dtype=torch.bool, device=device).scatter_(0, target, torch.ones_like(has))
    out = torch.where(valid, lp, fallback[:n])
    return out.view(shape), (valid | selected[:n]).view(shape)


class _SelectLogits(torch.autograd.Function):
    """``(logits.gather(1, cand), logits.index_select(0, rows))`` for ``logits [N, V]``,
    ``cand [N, K]``, ``rows [R]``; backward writes one ``[N, V]`` gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, cand: torch.Tensor, rows: torch.Tensor):
        ctx.save_for_backward(cand, rows)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return logits.gather(1, cand), logits.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad_cand: torch.Tensor, grad_rows: torch.Tensor):
        cand, rows = ctx.saved_tensors
        grad = torch.zeros(ctx.shape, dtype=ctx.dtype, device=cand.device)
        if grad_cand is not None:
            grad.scatter_add_(1, cand, grad_cand.to(ctx.dtype))
        if grad_rows is not None:
            grad.index_add_(0, rows, grad_rows.to(ctx.dtype))
        return grad, None, None


def _plain_logprobs(src, target, input_ids, lm_head_weight, temperature) -> torch.Tensor:
    """The ordinary full-vocabulary logprob of every position's target (0 without one), float32,
    ``logit_y / T - logsumexp(logits / T)`` in row chunks of ``PLAIN_CHUNK_ROWS``."""
    sampled = _gather_rows(input_ids.long(), target, 0).reshape(-1)
    flat = src.reshape(-1, src.shape[-1])
    parts = []
    for start in range(0, flat.shape[0], PLAIN_CHUNK_ROWS):
        rows = flat[start : start + PLAIN_CHUNK_ROWS]
        logits = rows if lm_head_weight is None else rows @ lm_head_weight.t()
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if temperature != 1.0:
            logits = logits / temperature
        y = sampled[start : start + PLAIN_CHUNK_ROWS]
        parts.append(logits.gather(1, y.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1))
    out = torch.cat(parts) if parts else flat.new_zeros(0)
    out = torch.where(target.reshape(-1) >= 0, out, 0.0)
    return out.float().view(target.shape)


def _check_finite(values: torch.Tensor, valid: torch.Tensor, target: torch.Tensor, seq: int, num_actions: int) -> None:
    """Raise on a valid, non-finite logprob (same gathered values on every SP rank)."""
    n = target.shape[1]
    bad = valid[:, :n] & ~torch.isfinite(values[:, :n].detach())
    if bool(bad.any()):
        pos = bad.nonzero()[0]
        flat = int(target[pos[0], pos[1]])
        b, s = divmod(flat, seq)
        raise ReplayDataError(
            "logits",
            "the replayed logprob is not finite: the logits are NaN or infinite, or -inf at every member of the row",
            trajectory=b,
            token=s - (seq - num_actions),
            expected="support ids inside the vocabulary and finite logits",
        )


# --------------------------------------------------------------------------- SP gather and restore


def _all_gather(parts: list, tensor: torch.Tensor, group) -> None:
    # Looked up on the module at call time so tests can count calls.
    torch.distributed.all_gather(parts, tensor, group=group)


class _GatherSequence(torch.autograd.Function):
    """All-gather of ``[b, part, ...]`` slices along dim 1; backward keeps this rank's slice
    (times ``scale``)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, scale: float) -> torch.Tensor:
        world = torch.distributed.get_world_size(group)
        ctx.rank = torch.distributed.get_rank(group)
        ctx.part = local.shape[1]
        ctx.scale = scale
        parts = [torch.empty_like(local) for _ in range(world)]
        _all_gather(parts, local.contiguous(), group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.narrow(1, ctx.rank * ctx.part, ctx.part)
        if ctx.scale != 1:
            g = g * ctx.scale
        return g.contiguous(), None, None


def _gather(local: torch.Tensor, group, sp_size: int, grad_scaler: bool) -> torch.Tensor:
    """``[b, part, ...]`` slices of every SP rank, concatenated along dim 1."""
    if sp_size == 1:
        return local
    return _GatherSequence.apply(local, group, float(sp_size) if grad_scaler else 1.0)


def _restore(values: torch.Tensor, indices, batch: int, seq: int, num_actions: int) -> torch.Tensor:
    """Layout values ``[b_l, n]`` at the predicting positions of ``[B, S]``, response columns."""
    if indices is None:
        grid = values
    else:
        idx = indices.to(values.device).long().reshape(-1)
        grid = values.new_zeros(batch * seq).index_copy(0, idx, values.reshape(-1)).view(batch, seq)
    return grid[:, seq - num_actions - 1 : seq - 1]
