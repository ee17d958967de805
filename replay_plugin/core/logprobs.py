"""Support-renormalised logprobs for sampler-support replay.

For a token ``y`` drawn from the recorded support ``S`` the trainer scores
``logp(y) = z_y / T - logsumexp_{s in S} z_s / T`` (``z`` the logits, ``T`` the temperature):
from logits (``support_logprobs``), from hidden states and the LM-head weight without forming
``[tokens, vocab]`` (``support_logprobs_from_hidden``), the full-vocabulary logprob of rows
without support for a fixed number of rows (``full_vocab_logprobs_fixed_capacity``), and all
of them combined for a trainer backend (``replay_logprobs``). Support ids are global, ``-1``
pads; outputs are float32. With ``tp_group`` the vocabulary is sharded, every call makes a
fixed number of all-reduces whatever the data, and the hidden-state gradient is this rank's
partial sum: feed ``hidden`` through ``copy_to_tensor_model_parallel_region`` as
``ColumnParallelLinear`` does.

Support rows are checked on the device at every entry that takes them (what the math relies
on, nothing more): members are ids of the vocabulary (under tensor parallelism the global one:
every member must lie in some rank's shard), ``-1`` is the only negative id, no id appears
twice in a row (it would count twice in the normaliser), and a row with support contains its
sampled token where one is required (else the value is no log-probability: it can be
positive). Where ``-1`` sits in a row and the order of the members do not change the result (a
row is a set here), so rows with ``-1`` between members are accepted. The checks cost one host
sync per call (shared with the existing one in ``replay_logprobs``); the details of a failure
are looked up only then, and a ``ReplayDataError`` names the position and the offending id.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed
import torch.nn.functional as F

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.inputs import (
    as_mask,
    check_index,
    check_same_device,
    check_support_dtype,
    check_temperature,
    check_tensor,
    mask_flags,
)

#: Default (token, candidate) pairs per chunk of the gather projection path: its temporaries are
#: ``[chunk, H]`` in float32 (32 MiB at H = 1024).
DEFAULT_CHUNK_SIZE = 8192

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- public API


def support_logprobs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: torch.distributed.ProcessGroup | None = None,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each sampled token renormalised over its recorded support.

    Args:
        logits: ``[..., V_local]`` raw logits (not yet divided by the temperature), any float
            dtype; this rank's vocabulary shard when ``tp_group`` is given.
        sampled_ids: ``[...]`` integer, the token each position is scored for (global ids).
        support_ids: ``[..., W]`` integer (int32 by contract), global ids, ``-1`` padding; the
            same on every rank of ``tp_group``.
        temperature: ``T > 0``; the gathered logits are divided by it. Pass 1.0 when the logits
            were already divided.
        vocab_start: first global id of this rank's shard.
        tp_group: tensor-parallel group sharding the vocabulary, or None.
        loss_mask: ``[...]`` bool (or 0/1), the rows whose sampled token must be a member of
            their support: the loss-bearing ones. None (default): every row with support. A row
            with support outside it whose token is not a member (e.g. a row
            ``dense_support_batch(on_inexact="mask")`` took out of the loss) gets logprob 0 and
            ``valid`` False.

    Returns:
        ``(logprobs, valid)``: float32 ``[...]`` and bool ``[...]``; ``valid`` is False for rows
        without any member, whose logprob is 0. Gradients flow to ``logits`` only at the support
        and sampled positions.

    Raises:
        ReplayDataError (field ``support_ids``; ``trajectory`` = the position's first index and
        ``token`` = its index within it, for ``[..., W]`` of more than one leading dimension):
        a member id outside the vocabulary (under ``tp_group``: in no rank's shard), a negative
        id other than ``-1``, an id twice in a row, a required row without its sampled token.
        Checked on the device, one host sync; under ``tp_group`` after the two all-reduces,
        identically on every rank.
    """
    temperature, vocab_start = _check_common(logits, sampled_ids, support_ids, temperature, vocab_start)
    required, mask_values = _required(loss_mask, sampled_ids)
    lp, valid, check = _support_logprobs(
        logits,
        sampled_ids,
        support_ids,
        temperature=temperature,
        vocab_start=vocab_start,
        tp_group=tp_group,
        required=required,
        check=True,
        mask_values=mask_values,
    )
    assert check is not None
    check.flag_nonfinite(lp, valid)
    check.raise_first(sampled_ids.shape)
    return lp, valid


def _support_logprobs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    *,
    temperature: float,
    vocab_start: int,
    tp_group,
    required: torch.Tensor | None,
    check: bool,
    mask_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, _RowCheck | None]:
    """:func:`support_logprobs` after the input checks; ``check=False`` skips the support-row
    checks (for callers that validated the rows, or score compact inputs whose target is not a
    member on purpose, as ``replay_plugin.fsdp.replay`` does) and returns no :class:`_RowCheck`.
    ``mask_values`` (flat ``[N]``, from :func:`_required`): an integer loss mask's values, checked
    to be 0/1."""
    v_local = logits.shape[-1]
    prefix = sampled_ids.shape
    sup, member, valid, local_m, local_sup, y_local, ly = _localise(sampled_ids, support_ids, vocab_start, v_local)
    rows = (
        _RowCheck(sup, sampled_ids, member, local_m, required, vocab_start, v_local, tp_group, mask_values)
        if check
        else None
    )
    cdt = _compute_dtype(logits.dtype)
    w = local_sup.shape[1]
    # One gather for members and target, on the logits as given (no reshape copy of a strided
    # input); its backward writes one dense [..., V_local] gradient and keeps nothing of the
    # logits alive until then (see _GatherLast).
    cand = torch.cat([local_sup, ly.unsqueeze(1)], dim=1)
    values = _GatherLast.apply(logits, cand.view(*prefix, w + 1)).reshape(-1, w + 1).to(cdt) / temperature
    y_values = torch.where(y_local, values[:, w], 0.0)
    lp, counted = _renormalise(
        values[:, :w], local_m, y_values, valid, tp_group, count=None if rows is None else rows.local_count
    )
    if rows is not None:
        rows.finish(counted)
        valid = rows.scored(valid)
        lp = torch.where(valid, lp, 0.0)
    return lp.float().reshape(prefix), valid.reshape(prefix), rows


class _GatherLast(torch.autograd.Function):
    """``source.gather(-1, index)`` whose backward scatters into a fresh zero gradient.

    Autograd's own ``gather`` saves its whole input for the backward (torch 2.x,
    ``derivatives.yaml``: ``gather_backward(grad, self, ...)`` reads only its shape), which keeps
    the caller's ``[..., V_local]`` logits alive until the backward (with the synthetic-EOS
    rows' second dense gradient, see :class:`_GatherCandidatesAndRows`, replay from logits
    peaked at 1.32x the memory of Megatron's ``vocab_parallel_cross_entropy`` at TP=2). This
    saves the index and the shape only; the backward allocates the one dense gradient the
    logits need and scatter-adds into it in place.
    """

    @staticmethod
    def forward(ctx, source, index):
        ctx.save_for_backward(index)
        ctx.shape, ctx.dtype, ctx.device = source.shape, source.dtype, source.device
        return source.gather(-1, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        out.scatter_add_(-1, index, grad.to(ctx.dtype))
        return out, None


def support_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_start: int = 0,
    tp_group: torch.distributed.ProcessGroup | None = None,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``support_logprobs`` fused with the LM head: only (token, candidate) pairs are projected.

    Args:
        hidden: ``[..., H]`` LM-head input (replicated over ``tp_group``).
        lm_head_weight: ``[V_local, H]`` this rank's LM-head rows (no bias).
        sampled_ids, support_ids, temperature, vocab_start, tp_group, loss_mask: as
            ``support_logprobs`` (the temperature is applied inside the projection).
        chunk_size: (token, candidate) pairs per chunk of the gather path.

    Returns:
        ``(logprobs, valid)`` as ``support_logprobs``; equal to it on ``hidden @ W.T`` up to
        rounding, and so are the gradients of ``hidden`` and ``lm_head_weight``.

    Raises:
        ReplayDataError: the support-row checks of ``support_logprobs`` (the vocabulary is the
        LM-head's rows, summed over ``tp_group``).

    The projection is a custom autograd Function that saves only the inputs and ``[N, W+1]``
    index tensors; nothing of size ``[pairs, H]`` outlives a chunk. Two implementations:

    - sparse (float32/float64 on CPU, hidden and weight of one dtype): the candidates of each
      row, sorted and de-duplicated, form a CSR pattern; ``torch.sparse.sampled_addmm`` computes
      the dot products without materialising gathered rows; ``embedding_bag`` with per-sample
      weights gives the hidden gradient, and gives the weight gradient as one bag per vocabulary
      row over the pairs sorted by id (every weight row is summed once however many tokens
      share it, and the dense gradient is written once). Temporaries are ``O(pairs)`` scalars.
    - gather (bf16/fp16, other devices): chunks of ``chunk_size`` pairs gather weight rows,
      upcast to float32 and project with ``bmm``; backward re-gathers per chunk. The weight
      gradient walks the pairs sorted by vocabulary id, sums each chunk's rows in float32 and
      adds each distinct row once per chunk.
    """
    temperature, vocab_start = _check_common(
        hidden, sampled_ids, support_ids, temperature, vocab_start, source_field="hidden"
    )
    required, mask_values = _required(loss_mask, sampled_ids)
    lp, valid, check = _support_logprobs_from_hidden(
        hidden,
        lm_head_weight,
        sampled_ids,
        support_ids,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_start=vocab_start,
        tp_group=tp_group,
        required=required,
        check=True,
        mask_values=mask_values,
    )
    assert check is not None
    check.flag_nonfinite(lp, valid)
    check.raise_first(sampled_ids.shape)
    return lp, valid


def _support_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    *,
    temperature: float,
    chunk_size: int,
    vocab_start: int,
    tp_group,
    required: torch.Tensor | None,
    check: bool,
    mask_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, _RowCheck | None]:
    """:func:`support_logprobs_from_hidden` after the common input checks; ``check`` and
    ``mask_values`` as in :func:`_support_logprobs`."""
    _check_weight(lm_head_weight, hidden)
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ReplayDataError(
            "lm_head_weight",
            f"has shape {tuple(lm_head_weight.shape)} for hidden size {hidden.shape[-1]}",
            expected="[V_local, H]",
        )
    chunk = _check_chunk(chunk_size)
    v_local = lm_head_weight.shape[0]
    prefix = sampled_ids.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    sup, member, valid, local_m, local_sup, y_local, ly = _localise(sampled_ids, support_ids, vocab_start, v_local)
    rows = (
        _RowCheck(sup, sampled_ids, member, local_m, required, vocab_start, v_local, tp_group, mask_values)
        if check
        else None
    )
    w = local_sup.shape[1]
    cand = torch.cat([local_sup, ly.unsqueeze(1)], dim=1)
    local = torch.cat([local_m, y_local.unsqueeze(1)], dim=1)
    z = _CandidateProjection.apply(
        flat_h,
        lm_head_weight,
        cand,
        local,
        1.0 / temperature,
        chunk,
        _projection_method(flat_h, lm_head_weight),
    )
    lp, counted = _renormalise(
        z[:, :w], local_m, z[:, w], valid, tp_group, count=None if rows is None else rows.local_count
    )
    if rows is not None:
        rows.finish(counted)
        valid = rows.scored(valid)
        lp = torch.where(valid, lp, 0.0)
    return lp.float().reshape(prefix), valid.reshape(prefix), rows


def full_vocab_logprobs_fixed_capacity(
    source: torch.Tensor,
    sampled_ids: torch.Tensor,
    needs_full_vocab: torch.Tensor,
    trajectory_ids: torch.Tensor,
    capacity: int,
    *,
    lm_head_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: torch.distributed.ProcessGroup | None = None,
    check_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ordinary full-vocabulary logprob for at most one flagged row per trajectory.

    Args:
        source: logits ``[..., V_local]``, or hidden ``[..., H]`` when ``lm_head_weight``
            (``[V_local, H]``) is given.
        sampled_ids: ``[...]`` the token each position is scored for.
        needs_full_vocab: ``[...]`` bool, rows to score (e.g. ``loss_mask & ~valid``).
        trajectory_ids: ``[...]`` integer trajectory index of each row in ``[0, capacity)``;
            anything else (e.g. -1 for padding) is never scored.
        capacity: number of trajectories. Exactly ``capacity`` rows are scored whatever the
            data: the first flagged row of each trajectory, row 0 (discarded) for the others.
        lm_head_weight, temperature, vocab_start, tp_group: as in ``support_logprobs_from_hidden``.
        check_targets: refuse a selected row whose sampled id is outside the vocabulary (one
            host sync). False for callers that checked the ids already.

    Returns:
        ``(logprobs, selected)``: float32 ``[...]`` (0 where not selected) and bool ``[...]``.
        A trajectory's second flagged row is not selected; ``replay_logprobs`` reports it.

    Raises:
        ReplayDataError (field ``sampled_ids``): with ``check_targets``, a selected row's id is
        negative or in no rank's vocabulary shard (its "logprob" would be ``-logsumexp``).

    Memory is ``[capacity, V_local]``. From hidden states in bf16/fp16 the projection runs in the
    input dtype (as the trainer's own LM head would) and the softmax in float32.
    """
    lp, selected, outside = _full_vocab_fixed_capacity(
        source,
        sampled_ids,
        needs_full_vocab,
        trajectory_ids,
        capacity,
        lm_head_weight=lm_head_weight,
        temperature=temperature,
        vocab_start=vocab_start,
        tp_group=tp_group,
    )
    if check_targets:
        _raise_target_outside(outside, sampled_ids, trajectory_ids)
    return lp, selected


def _full_vocab_fixed_capacity(
    source: torch.Tensor,
    sampled_ids: torch.Tensor,
    needs_full_vocab: torch.Tensor,
    trajectory_ids: torch.Tensor,
    capacity: int,
    *,
    lm_head_weight: torch.Tensor | None,
    temperature: float,
    vocab_start: int,
    tp_group,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`full_vocab_logprobs_fixed_capacity` without the host sync: also returns
    ``outside`` ``[...]`` bool, the selected rows whose sampled id is in no vocabulary shard."""
    temperature = check_temperature(temperature)
    vocab_start = check_index(vocab_start, "vocab_start")
    cap = check_index(capacity, "capacity")
    source_field = "logits" if lm_head_weight is None else "hidden"
    check_tensor(source, source_field)
    if not source.is_floating_point():
        raise ReplayTypeError(source_field, f"got dtype {source.dtype}", expected="a floating-point tensor")
    if lm_head_weight is not None:
        _check_weight(lm_head_weight, source)
    _check_ids(sampled_ids, "sampled_ids", source, source_field)
    traj = _check_ids(trajectory_ids, "trajectory_ids", source, source_field)
    check_tensor(needs_full_vocab, "needs_full_vocab")
    check_same_device(needs_full_vocab, "needs_full_vocab", source, source_field)
    dim = source.shape[-1]
    prefix = sampled_ids.shape
    if source.shape[:-1] != prefix or needs_full_vocab.shape != prefix or traj.shape != prefix:
        raise ReplayDataError(
            "sampled_ids",
            f"shapes {tuple(source.shape)}, {tuple(prefix)}, {tuple(needs_full_vocab.shape)}, "
            f"{tuple(traj.shape)} disagree",
            expected="source [..., D] and [...] for the rest",
        )
    needs_full_vocab = as_mask(needs_full_vocab, "needs_full_vocab")
    device = source.device
    out_dtype = _compute_dtype(source.dtype if lm_head_weight is None else lm_head_weight.dtype)
    if cap == 0:
        none = torch.zeros(prefix, dtype=torch.bool, device=device)
        return torch.zeros(prefix, dtype=torch.float32, device=device), none, none
    plan = _FallbackPlan(needs_full_vocab, traj, sampled_ids, cap)
    picked = source.new_zeros(cap, dim) if plan.n == 0 else _select_rows(source, plan.rows)
    return plan.scores(picked, lm_head_weight, out_dtype, temperature, vocab_start, tp_group)


class _FallbackPlan:
    """Which rows :func:`full_vocab_logprobs_fixed_capacity` scores: per trajectory its first
    flagged row (``first``, ``has``), row 0 (discarded) for the others (``rows`` ``[cap]``), and
    their targets ``y_rows``. Needs no logits, so the logits path can gather these rows together
    with the support candidates (one dense gradient)."""

    def __init__(self, need: torch.Tensor, trajectory_ids: torch.Tensor, sampled_ids: torch.Tensor, cap: int) -> None:
        device = sampled_ids.device
        self.prefix = sampled_ids.shape
        self.n = int(math.prod(self.prefix))
        self.first, self.has = _first_flagged_rows(
            need.reshape(-1).to(torch.bool), trajectory_ids.reshape(-1).long(), cap, device
        )
        self.rows = torch.where(self.has, self.first, 0)
        if self.n == 0:
            self.y_rows = torch.zeros(cap, dtype=torch.long, device=device)
        else:
            self.y_rows = sampled_ids.reshape(-1).long().index_select(0, self.rows)

    def scores(
        self,
        picked: torch.Tensor,
        lm_head_weight: torch.Tensor | None,
        out_dtype: torch.dtype,
        temperature: float,
        vocab_start: int,
        tp_group,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logprobs, selected, outside)`` ``[...]`` from the picked rows ``[cap, D]`` (logits,
        or hidden states projected by ``lm_head_weight``); ``outside``: selected rows whose
        sampled id is in no vocabulary shard (their value is ``-logsumexp``, not a logprob)."""
        if lm_head_weight is None:
            logits = picked
        else:
            dim = picked.shape[-1]
            if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != dim:
                raise ReplayDataError(
                    "lm_head_weight",
                    f"has shape {tuple(lm_head_weight.shape)} for hidden size {dim}",
                    expected="[V_local, H]",
                )
            logits = picked.to(lm_head_weight.dtype) @ lm_head_weight.t()
        lp, found = _full_vocab_logprob(logits, self.y_rows, out_dtype, temperature, vocab_start, tp_group)
        n, has, first = self.n, self.has, self.first
        target = torch.where(has, first, n)
        out = torch.zeros(n + 1, dtype=lp.dtype, device=lp.device).scatter_add(0, target, torch.where(has, lp, 0.0))
        hits = torch.zeros(n + 1, dtype=torch.long, device=lp.device).scatter_add(0, target, has.long())
        misses = torch.zeros(n + 1, dtype=torch.long, device=lp.device).scatter_add(0, target, (has & ~found).long())
        return (
            out[:n].float().reshape(self.prefix),
            (hits[:n] > 0).reshape(self.prefix),
            (misses[:n] > 0).reshape(self.prefix),
        )


def _select_rows(source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``source.reshape(-1, D)[rows]`` (``[R, D]``) without copying a strided ``source`` whole."""
    if source.is_contiguous() or source.dim() <= 2:
        return source.reshape(-1, source.shape[-1]).index_select(0, rows)
    return source[torch.unravel_index(rows, source.shape[:-1])]


def _first_flagged_rows(
    need: torch.Tensor, traj: torch.Tensor, cap: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per trajectory ``[cap]``: the index of its first flagged row among the ``N`` rows
    (``need`` bool ``[N]``, ``traj`` int64 ``[N]``), ``N`` when it has none, and whether it has one."""
    n = need.shape[0]
    positions = torch.arange(n, device=device)
    in_range = (traj >= 0) & (traj < cap)
    candidate = torch.where(need & in_range, positions, n)
    first = torch.full((cap,), n, dtype=torch.long, device=device).scatter_reduce(
        0, traj.clamp(0, cap - 1), candidate, reduce="amin", include_self=True
    )
    return first, first < n


def _full_vocab_logprob(
    logits: torch.Tensor,
    y_rows: torch.Tensor,
    out_dtype: torch.dtype,
    temperature: float,
    vocab_start: int,
    tp_group: torch.distributed.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprob, found)`` ``[R]``: the logprob (``out_dtype``) of the global ids ``y_rows``
    ``[R]`` over the whole (possibly TP-sharded) vocabulary, from raw logits ``[R, V_local]``,
    and whether some shard holds the id (counted in the renormalisation's SUM all-reduce). An id
    no shard holds gets ``-logsumexp``, which is not a logprob: callers refuse it."""
    v_local = logits.shape[-1]
    z = logits.to(out_dtype) / temperature
    ly = y_rows - vocab_start
    y_local = (ly >= 0) & (ly < v_local)
    y_values = z.gather(1, ly.clamp(0, max(v_local - 1, 0)).unsqueeze(1)).squeeze(1)
    y_values = torch.where(y_local, y_values, 0.0)
    lp, counted = _renormalise(z, None, y_values, torch.ones_like(y_local), tp_group, count=y_local)
    assert counted is not None
    return lp, counted > 0.5


def full_vocab_logprobs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: torch.distributed.ProcessGroup | None = None,
    check_targets: bool = True,
) -> torch.Tensor:
    """The ordinary full-vocabulary logprob of ``sampled_ids`` ``[...]`` at every position: float32
    ``[...]`` from raw logits ``[..., V_local]`` (this rank's shard when ``tp_group`` is given;
    one MAX and one SUM all-reduce then). For trainers whose vocabulary-parallel cross entropy
    cannot take their tensor-parallel group.

    Raises:
        ReplayDataError (field ``sampled_ids``): with ``check_targets`` (one host sync), an id
        that is negative or in no rank's vocabulary shard, whose value would be
        ``-logsumexp``. ``check_targets=False`` returns that value, as Megatron's
        ``vocab_parallel_cross_entropy`` does (its targets outside a shard are masked to 0).
    """
    temperature = check_temperature(temperature)
    vocab_start = check_index(vocab_start, "vocab_start")
    check_tensor(logits, "logits")
    if not logits.is_floating_point():
        raise ReplayTypeError("logits", f"got dtype {logits.dtype}", expected="a floating-point tensor")
    _check_ids(sampled_ids, "sampled_ids", logits, "logits")
    if logits.shape[:-1] != sampled_ids.shape:
        raise ReplayDataError(
            "sampled_ids",
            f"shape {tuple(sampled_ids.shape)} for logits {tuple(logits.shape)}",
            expected="logits [..., V_local], sampled_ids [...]",
        )
    prefix = sampled_ids.shape
    flat = logits.reshape(-1, logits.shape[-1])
    lp, found = _full_vocab_logprob(
        flat, sampled_ids.reshape(-1).long(), _compute_dtype(logits.dtype), temperature, vocab_start, tp_group
    )
    if check_targets:
        _raise_target_outside(~found.reshape(prefix), sampled_ids, None)
    return lp.float().reshape(prefix)


class ReplayLogprobs(NamedTuple):
    """Result of ``replay_logprobs``; all ``[...]`` like the inputs' positions."""

    #: float32; support-renormalised, full-vocabulary for ``full_vocab`` rows, 0 elsewhere.
    logprobs: torch.Tensor
    #: bool; a logprob was computed (the row has support, or is a ``full_vocab`` row).
    valid: torch.Tensor
    #: bool; loss-bearing rows without support scored over the full vocabulary (synthetic EOS).
    full_vocab: torch.Tensor


def replay_logprobs(
    source: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    trajectory_ids: torch.Tensor,
    num_trajectories: int,
    *,
    lm_head_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: torch.distributed.ProcessGroup | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    agree_groups: Sequence[torch.distributed.ProcessGroup | None] = (),
    token_index: torch.Tensor | None = None,
) -> ReplayLogprobs:
    """Replayed logprobs for one microbatch: the helper trainer backends call.

    All per-position inputs are already aligned to the positions of ``source`` (after the
    backend's next-token shift, packing, context-parallel or Ulysses slicing): position ``p``
    of ``source`` predicts ``sampled_ids[p]``, whose recorded support is ``support_ids[p]``.
    Shapes: ``source [..., V_local]`` (logits) or ``[..., H]`` (hidden, with
    ``lm_head_weight [V_local, H]``); ``sampled_ids``, ``loss_mask``, ``trajectory_ids`` ``[...]``;
    ``support_ids [..., W]``. ``[...]`` is typically ``[b, s]`` or flattened ``[n]``.

    Args:
        source: logits or hidden states.
        sampled_ids: integer target ids.
        support_ids: int32 support rows (``-1`` padding; all ``-1`` = no support).
        loss_mask: bool, loss-bearing positions.
        trajectory_ids: integer, the trajectory (sample) index of each position in
            ``[0, num_trajectories)``, ``-1`` for padding.
        num_trajectories: number of trajectories the positions can belong to (identical on all
            ranks of ``tp_group``): the fixed capacity of the full-vocabulary fallback.
        lm_head_weight, temperature, vocab_start, tp_group, chunk_size: as
            ``support_logprobs_from_hidden``. ``temperature`` is applied to logits too: pass 1.0
            if the caller already divided them.
        agree_groups: process groups, pairwise orthogonal (e.g. the tensor- and the
            context-parallel group), whose ranks must all raise when any of them finds bad
            data: ranks holding different positions (context-parallel shards) that run
            collectives after this call would otherwise wait for a rank that raised. One
            ``all_reduce`` of a ``[ranks, 5]`` int64 table per group, whatever the data.
        token_index: ``[...]`` integer, the token index an error names for each position (e.g.
            its column in the batch grid); default: the position's index among its
            trajectory's positions on this rank.

    Returns:
        ``ReplayLogprobs(logprobs, valid, full_vocab)``.

    Raises:
        ReplayDataError: the support-row checks of ``support_logprobs`` (a member outside the
            vocabulary, a negative id other than ``-1``, an id twice in a row, a loss-bearing
            row with support that lacks its sampled token); a loss-bearing position has no
            support and is not its trajectory's first such position (only one synthetic EOS per
            trajectory can be scored), or its trajectory id is outside
            ``[0, num_trajectories)``; a supported row's logprob is not finite (non-finite
            logits); or (field ``sampled_ids``) a synthetic EOS's token id is in no vocabulary
            shard (its full-vocabulary "logprob" would be ``-logsumexp``). Raised after all
            collectives (one host sync) on every rank of ``agree_groups``, naming the
            trajectory, the token, the offending id and (when another rank found it) that
            rank. Rows with support outside ``loss_mask`` whose sampled token is not a member
            get logprob 0 and ``valid`` False.
    """
    # Every input check before any collective: every rank checks inputs of the same kind.
    source_field = "logits" if lm_head_weight is None else "hidden"
    temperature, vocab_start = _check_common(
        source, sampled_ids, support_ids, temperature, vocab_start, source_field=source_field
    )
    required, mask_values = _required(loss_mask, sampled_ids, optional=False)
    assert required is not None  # optional=False
    _check_ids(trajectory_ids, "trajectory_ids", source, source_field)
    if trajectory_ids.shape != sampled_ids.shape:
        raise ReplayDataError(
            "trajectory_ids", f"has shape {tuple(trajectory_ids.shape)}", expected=f"{tuple(sampled_ids.shape)}"
        )
    num_trajectories = check_index(num_trajectories, "num_trajectories")
    if token_index is not None:
        _check_ids(token_index, "token_index", source, source_field)
    check: _RowCheck | None
    if lm_head_weight is None:
        lp, valid, need, fallback, selected, outside, check = _replay_from_logits(
            source,
            sampled_ids,
            support_ids,
            required,
            mask_values,
            trajectory_ids,
            num_trajectories,
            temperature=temperature,
            vocab_start=vocab_start,
            tp_group=tp_group,
        )
    else:
        lp, valid, check = _support_logprobs_from_hidden(
            source,
            lm_head_weight,
            sampled_ids,
            support_ids,
            temperature=temperature,
            chunk_size=chunk_size,
            vocab_start=vocab_start,
            tp_group=tp_group,
            required=required,
            check=True,
            mask_values=mask_values,
        )
        need = required.view(sampled_ids.shape) & ~valid
        fallback, selected, outside = _full_vocab_fixed_capacity(
            source,
            sampled_ids,
            need,
            trajectory_ids,
            num_trajectories,
            lm_head_weight=lm_head_weight,
            temperature=temperature,
            vocab_start=vocab_start,
            tp_group=tp_group,
        )
    uncovered = need & ~selected
    # Both kinds of value: a support logprob, and a synthetic EOS's full-vocabulary one (NaN
    # logits reach it too; before, it was returned as NaN with valid True).
    nonfinite = (valid & ~torch.isfinite(lp)) | (selected & ~torch.isfinite(fallback))
    assert check is not None
    local = _first_error(check, uncovered, nonfinite, outside, trajectory_ids, sampled_ids, token_index)
    groups = [g for g in agree_groups if g is not None and _tp_size(g) > 1]
    if groups:
        table, here, sizes = _agree(local, groups)
        failing = torch.nonzero(table[:, 0]).flatten().tolist()
        if failing:
            first = failing[0]
            # Tensor-parallel ranks find the same problems (the reduced counts): a rank whose own
            # row is the reported one found it itself.
            other = None if torch.equal(table[first], table[here]) else _coords(first, sizes)
            _raise_error(table[first].tolist(), check.vocab, num_trajectories=num_trajectories, other=other)
    elif int(local[0]):
        _raise_error(local.tolist(), check.vocab, num_trajectories=num_trajectories)
    logprobs = torch.where(valid, lp, fallback)
    return ReplayLogprobs(logprobs, valid | selected, selected)


def _replay_from_logits(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    required: torch.Tensor,
    mask_values: torch.Tensor | None,
    trajectory_ids: torch.Tensor,
    num_trajectories: int,
    *,
    temperature: float,
    vocab_start: int,
    tp_group,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, _RowCheck]:
    """:func:`support_logprobs` and :func:`full_vocab_logprobs_fixed_capacity` on the same logits
    with one gather (:class:`_GatherCandidatesAndRows`): the logits get one dense gradient, not
    one per function plus their sum. Inputs checked by :func:`replay_logprobs` (``required``:
    the flat bool loss mask, ``mask_values`` an integer mask's values). Returns ``(lp, valid, need,
    fallback, selected, outside, check)``."""
    prefix = sampled_ids.shape
    cap = num_trajectories
    v_local = logits.shape[-1]
    sup, member, valid, local_m, local_sup, y_local, ly = _localise(sampled_ids, support_ids, vocab_start, v_local)
    rows_check = _RowCheck(sup, sampled_ids, member, local_m, required, vocab_start, v_local, tp_group, mask_values)
    cdt = _compute_dtype(logits.dtype)
    w = local_sup.shape[1]
    need = required.view(prefix) & ~valid.reshape(prefix)
    plan = _FallbackPlan(need, trajectory_ids, sampled_ids, cap) if cap else None
    rows = plan.rows if plan is not None and plan.n else torch.zeros(0, dtype=torch.long, device=logits.device)
    cand = torch.cat([local_sup, ly.unsqueeze(1)], dim=1)
    gathered, picked = _GatherCandidatesAndRows.apply(logits, cand.view(*prefix, w + 1), rows)
    values = gathered.reshape(-1, w + 1).to(cdt) / temperature
    y_values = torch.where(y_local, values[:, w], 0.0)
    lp, counted = _renormalise(values[:, :w], local_m, y_values, valid, tp_group, count=rows_check.local_count)
    rows_check.finish(counted)
    valid = rows_check.scored(valid)
    lp = torch.where(valid, lp, 0.0).float().reshape(prefix)
    if plan is None:
        fallback = torch.zeros(prefix, dtype=torch.float32, device=logits.device)
        selected = outside = torch.zeros(prefix, dtype=torch.bool, device=logits.device)
    else:
        if not plan.n:
            picked = logits.new_zeros(cap, v_local)
        fallback, selected, outside = plan.scores(picked, None, cdt, temperature, vocab_start, tp_group)
    return lp, valid.reshape(prefix), need, fallback, selected, outside, rows_check


class _GatherCandidatesAndRows(torch.autograd.Function):
    """``(logits.gather(-1, index), logits.reshape(-1, V)[rows])``, with one dense gradient.

    ``logits`` ``[..., V]``, ``index`` ``[..., M]`` long, ``rows`` ``[R]`` long (flat row
    indices). Saves the indices and the shape only (see :class:`_GatherLast`); the backward
    allocates one zero ``[..., V]`` gradient, scatter-adds the candidates' gradient and
    index-adds the rows' into it.
    """

    @staticmethod
    def forward(ctx, logits, index, rows):
        ctx.save_for_backward(index, rows)
        ctx.shape, ctx.dtype, ctx.device = logits.shape, logits.dtype, logits.device
        return logits.gather(-1, index), _select_rows(logits, rows)

    @staticmethod
    def backward(ctx, grad_values, grad_rows):
        index, rows = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        if grad_values is not None:
            out.scatter_add_(-1, index, grad_values.to(ctx.dtype))
        if grad_rows is not None and rows.numel():
            out.view(-1, ctx.shape[-1]).index_add_(0, rows, grad_rows.to(ctx.dtype))
        return out, None, None


# --------------------------------------------------------------------------- errors

# What can be wrong at one position, in the order errors are reported: the lowest kind found
# anywhere, at its first position.
_BAD_MASK, _BAD_ID, _OUT_OF_VOCAB, _DUPLICATE, _NOT_MEMBER, _UNCOVERED, _NONFINITE, _TARGET_OUTSIDE = range(1, 9)
#: One row of the error table: (kind, trajectory, token, target id, offending id, count).
_ERROR_FIELDS = 6
#: The offending value of a _BAD_MASK row that is no integer (0.5, NaN).
_NOT_INTEGRAL = -(2**62)


class _Vocab(NamedTuple):
    """This rank's vocabulary shard, for messages."""

    start: int
    size: int
    tp_size: int


class _RowCheck:
    """The support-row checks of one call, on the device, without a host sync.

    Built from the flat rows ``sup [N, W]`` (long) before the renormalisation; ``local_count``
    (``[N]``, members in this rank's shard) rides along the renormalisation's SUM all-reduce,
    and :meth:`finish` compares the reduced count with the row's members: a member in no rank's
    shard is outside the (global) vocabulary, without a collective of its own and without
    knowing the other shards. ``code`` (int64 ``[N]``, 0 = fine) then holds each row's first
    problem. Nothing here depends on where ``-1`` sits in a row or on the members' order: the
    math treats a row as a set.
    """

    def __init__(
        self,
        sup: torch.Tensor,
        sampled_ids: torch.Tensor,
        member: torch.Tensor,
        local_m: torch.Tensor,
        required: torch.Tensor | None,
        vocab_start: int,
        v_local: int,
        tp_group,
        mask_values: torch.Tensor | None = None,
    ) -> None:
        self.sup, self.member, self.local_m = sup, member, local_m
        # An integer loss mask's values ([N]); one other than 0/1 is reported before everything
        # else (what the mask selects decides the other checks).
        self.mask_values = mask_values
        self.bad_mask = None if mask_values is None else (mask_values != 0) & (mask_values != 1)
        self.y = sampled_ids.reshape(-1).long()
        self.vocab = _Vocab(int(vocab_start), int(v_local), _tp_size(tp_group))
        w = sup.shape[1]
        # One sort per row (rows are short, W ~ 20-64) answers three questions without a
        # reduction over W each: the smallest id, repeated ids, and (binary search) membership.
        # On CPU torch's bool any(dim=1) costs ~5x a sum(dim=1) (torch 2.13), so none is used.
        srt = sup.sort(dim=1).values
        self.member_count = member.sum(dim=1)
        self.local_count = local_m.sum(dim=1)
        self.bad_id = srt[:, 0] < -1
        # Equal neighbours are repeated members or the -1 padding (its count - 1 pairs); a row
        # with other negative ids is reported as a bad id first.
        pairs = (srt[:, 1:] == srt[:, :-1]).sum(dim=1)
        self.duplicate = pairs > (w - 1 - self.member_count).clamp(min=0)
        at = torch.searchsorted(srt, self.y.unsqueeze(1)).clamp(max=w - 1)
        self.contains = (srt.gather(1, at).squeeze(1) == self.y) & (self.y >= 0)
        self.required = required
        self.not_member = (self.member_count > 0) & ~self.contains
        if required is not None:
            self.not_member &= required
        self.code = torch.zeros_like(self.local_count)

    def finish(self, counted: torch.Tensor | None) -> None:
        """Per-row codes, given ``counted`` ``[N]``: the members found in a shard, summed over
        the tensor-parallel ranks (floats of small integers, exact)."""
        assert counted is not None
        self.outside = self.member_count != counted.round().long()
        self.code = torch.where(
            self.bad_id,
            _BAD_ID,
            torch.where(
                self.outside,
                _OUT_OF_VOCAB,
                torch.where(self.duplicate, _DUPLICATE, torch.where(self.not_member, _NOT_MEMBER, 0)),
            ),
        )
        if self.bad_mask is not None:
            self.code = torch.where(self.bad_mask, _BAD_MASK, self.code)

    def flag_nonfinite(self, lp: torch.Tensor, valid: torch.Tensor) -> None:
        """Mark valid rows whose logprob is not finite (NaN logits, or members whose logits are all
        ``-inf``): no row with ``valid`` True may carry NaN (one rule with the FSDP path)."""
        bad = valid.reshape(-1) & ~torch.isfinite(lp.reshape(-1))
        self.code = torch.where((self.code == 0) & bad, _NONFINITE, self.code)

    def scored(self, valid: torch.Tensor) -> torch.Tensor:
        """``valid`` without the rows outside ``required`` whose sampled token is not a member:
        no logprob exists there (the value would be a difference of logits, possibly > 0)."""
        if self.required is None:
            return valid
        return valid & (self.contains | self.required)

    def detail(self, kind: int, pos: int) -> tuple[int, int]:
        """``(offending id, count)`` of row ``pos`` for ``kind`` (failure path only)."""
        row = self.sup[pos]
        if kind == _BAD_MASK:
            assert self.mask_values is not None
            value = float(self.mask_values[pos])
            # The error table holds integers: a fractional or NaN value travels as a marker.
            return (int(value), 0) if value.is_integer() and abs(value) < 2**62 else (_NOT_INTEGRAL, 0)
        if kind == _BAD_ID:
            return int(row[row < -1][0]), 0
        if kind == _OUT_OF_VOCAB:
            if self.vocab.tp_size == 1:  # this shard is the vocabulary: the exact ids are known
                outside = row[self.member[pos] & ~self.local_m[pos]]
                return int(outside[0]), int(outside.numel())
            return int(row.max()), 0  # another rank may hold some of them: name the largest
        if kind == _DUPLICATE:
            srt = row.sort().values
            dup = (srt[1:] == srt[:-1]) & (srt[1:] >= 0)
            return int(srt[1:][dup][0]), 0
        return 0, 0

    def raise_first(self, prefix: torch.Size) -> None:
        """Raise for the first problem, located by its index in ``prefix`` (one host sync)."""
        if not bool(self.code.any()):
            return
        kind = int(self.code[self.code > 0].min())
        pos = int(torch.nonzero(self.code == kind)[0, 0])
        trajectory, token = _grid_position(pos, prefix)
        value, count = self.detail(kind, pos)
        _raise_error([kind, trajectory, token, int(self.y[pos]), value, count], self.vocab)


def _required(
    loss_mask: Any, sampled_ids: torch.Tensor, *, optional: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``loss_mask`` as flat bool ``[N]`` and, for an integer mask, its flat values ``[N]`` (None
    for a bool mask; :class:`_RowCheck` flags those other than 0/1 in its error table, so every
    rank raises together), shape-, dtype- and device-checked without a host sync. None stays
    None where ``optional``."""
    if loss_mask is None and optional:
        return None, None
    flat, bad = mask_flags(loss_mask, "loss_mask")
    check_same_device(loss_mask, "loss_mask", sampled_ids, "sampled_ids")
    if loss_mask.shape != sampled_ids.shape:
        raise ReplayDataError(
            "loss_mask", f"has shape {tuple(loss_mask.shape)}", expected=f"{tuple(sampled_ids.shape)}"
        )
    return flat.reshape(-1), None if bad is None else loss_mask.reshape(-1).to(torch.float64)


def _first_error(
    check: _RowCheck,
    uncovered: torch.Tensor,
    nonfinite: torch.Tensor,
    outside: torch.Tensor,
    trajectory_ids: torch.Tensor,
    sampled_ids: torch.Tensor,
    token_index: torch.Tensor | None,
) -> torch.Tensor:
    """int64 ``[6]``: ``(kind, trajectory, token, target id, offending id, count)`` of this rank's
    first problem (kind 0 = none): the lowest kind found, at its first position. One host sync."""
    later = torch.where(
        uncovered.reshape(-1),
        _UNCOVERED,
        torch.where(nonfinite.reshape(-1), _NONFINITE, torch.where(outside.reshape(-1), _TARGET_OUTSIDE, 0)),
    )
    code = torch.where(check.code > 0, check.code, later)
    if not bool(code.any()):
        return torch.zeros(_ERROR_FIELDS, dtype=torch.int64)
    kind = int(code[code > 0].min())
    traj = trajectory_ids.reshape(-1).long()
    pos = int(torch.nonzero(code == kind)[0, 0])
    tid = int(traj[pos])
    token = int(token_index.reshape(-1)[pos]) if token_index is not None else int((traj[:pos] == tid).sum())
    value, count = check.detail(kind, pos)
    target = int(sampled_ids.reshape(-1)[pos])
    return torch.tensor([kind, tid, token, target, value, count], dtype=torch.int64)


def _agree(local: torch.Tensor, groups: list) -> tuple[torch.Tensor, int, list[int]]:
    """Every rank's :func:`_first_error` row, on every rank of the (orthogonal) ``groups``: a
    ``[prod(sizes), 6]`` table, this rank's row set, summed over each group in turn. Returns the
    table, this rank's row and the group sizes (row = ranks in the groups, mixed radix)."""
    sizes = [torch.distributed.get_world_size(g) for g in groups]
    ranks = [torch.distributed.get_rank(g) for g in groups]
    here = 0
    for size, rank in zip(sizes, ranks):
        here = here * size + rank
    table = torch.zeros((math.prod(sizes), _ERROR_FIELDS), dtype=torch.int64, device=_device_of(groups[0]))
    table[here] = local.to(table.device)
    for g in groups:
        _all_reduce(table, torch.distributed.ReduceOp.SUM, g)
    return table.cpu(), here, sizes


def _coords(row: int, sizes: list[int]) -> tuple[int, ...]:
    """The per-group ranks of table row ``row`` (inverse of the mixed-radix index of :func:`_agree`)."""
    out = []
    for size in reversed(sizes):
        row, rank = divmod(row, size)
        out.append(rank)
    return tuple(reversed(out))


def _device_of(group) -> torch.device:
    """Where a collective of ``group`` runs: NCCL needs CUDA tensors, gloo takes CPU ones."""
    try:
        backend = torch.distributed.get_backend(group)
    except Exception:  # noqa: BLE001
        backend = "gloo"
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raise_error(
    row: list, vocab: _Vocab, *, num_trajectories: int | None = None, other: tuple[int, ...] | None = None
) -> None:
    """Raise the ``ReplayDataError`` of an error-table row (trajectory -1: not known)."""
    kind, tid, token, target, value, count = (int(v) for v in row[:_ERROR_FIELDS])
    if kind == _BAD_MASK:
        problem = "holds a fractional or NaN value" if value == _NOT_INTEGRAL else f"holds {value}"
        expected = "0 or 1 (1 = loss-bearing), or a bool mask"
    elif kind == _BAD_ID:
        problem = f"support row holds id {value}"
        expected = "member ids >= 0 and -1 as the only padding id"
    elif kind == _OUT_OF_VOCAB:
        if vocab.tp_size == 1:
            problem = f"support id {value} is {_outside_text(vocab)}"
            if count > 1:
                problem += f" ({count} of the row's ids are)"
            expected = "member ids inside the vocabulary (the logits' last dimension, the LM head's rows)"
        else:
            problem = (
                f"support row holds ids in no tensor-parallel rank's vocabulary shard (largest id {value}; the "
                f"vocabulary is split over {vocab.tp_size} ranks)"
            )
            expected = "member ids in [0, V), V the vocabulary summed over the tensor-parallel shards"
    elif kind == _DUPLICATE:
        problem = f"support id {value} appears more than once in the row (it would count twice in the normaliser)"
        expected = "distinct ids in each support row"
    elif kind == _NOT_MEMBER:
        problem = (
            f"sampled token {target} is not in its support row: its renormalised logprob does not exist "
            "(the value would be a difference of logits, possibly positive)"
        )
        expected = (
            "the sampled token in every loss-bearing support row (dense_support_batch's on_inexact policies "
            "ensure it; rows outside the loss mask are exempt)"
        )
    elif kind == _UNCOVERED:
        problem = (
            f"loss-bearing position without support (target id {target}) is not its trajectory's "
            f"only one, or its trajectory id is outside [0, {num_trajectories})"
        )
        expected = "support for every loss-bearing position but one synthetic EOS per trajectory"
    elif kind == _NONFINITE:
        problem = (
            f"logprob of target id {target} is not finite (support-renormalised, or over the full vocabulary for a "
            "synthetic EOS): the logits are NaN or infinite, or -inf at every member of the row"
        )
        expected = "finite logits"
    else:
        problem = (
            f"sampled token {target} of the loss-bearing position without support (the trajectory's synthetic "
            f"EOS, scored over the full vocabulary) is {_outside_text(vocab)}"
        )
        expected = "a token id in [0, V), V the vocabulary (summed over the tensor-parallel shards)"
    if other is not None:
        problem += f" (found by another rank: ranks {other} in agree_groups)"
    field = {_TARGET_OUTSIDE: "sampled_ids", _BAD_MASK: "loss_mask", _NONFINITE: "logits"}.get(kind, "support_ids")
    raise ReplayDataError(field, problem, trajectory=None if tid < 0 else tid, token=token, expected=expected)


def _outside_text(vocab: _Vocab) -> str:
    if vocab.tp_size == 1:
        return f"outside the vocabulary [{vocab.start}, {vocab.start + vocab.size})"
    return f"in no tensor-parallel rank's vocabulary shard (the vocabulary is split over {vocab.tp_size} ranks)"


def _grid_position(pos: int, prefix: torch.Size) -> tuple[int, int]:
    """``(trajectory, token)`` of flat position ``pos`` in ``prefix``: its first index and its
    index within it, or ``(-1, pos)`` for a 1-D ``prefix`` (trajectory not known)."""
    if len(prefix) >= 2:
        trajectory, token = divmod(pos, int(math.prod(prefix[1:])))
        return trajectory, token
    return -1, pos


def _raise_target_outside(
    outside: torch.Tensor, sampled_ids: torch.Tensor, trajectory_ids: torch.Tensor | None
) -> None:
    """Raise for the first True of ``outside`` ``[...]`` (one host sync): a scored id no
    vocabulary shard holds. Located by ``trajectory_ids`` when given (the token is the
    position's index among its trajectory's), else by the position's index in ``[B, ...]``."""
    if not bool(outside.any()):
        return
    pos = int(torch.nonzero(outside.reshape(-1))[0, 0])
    prefix = outside.shape
    if trajectory_ids is not None:
        traj = trajectory_ids.reshape(-1).long()
        tid = int(traj[pos])
        trajectory, token = tid, int((traj[:pos] == tid).sum())
    else:
        trajectory, token = _grid_position(pos, prefix)
    raise ReplayDataError(
        "sampled_ids",
        f"token id {int(sampled_ids.reshape(-1)[pos])} is negative or in no vocabulary shard: its full-vocabulary "
        "logprob does not exist",
        trajectory=None if trajectory < 0 else trajectory,
        token=token,
        expected="token ids in [0, V), V the vocabulary (summed over the tensor-parallel shards)",
    )


# --------------------------------------------------------------------------- shared math


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    # Looked up on the module at call time so tests can count calls.
    torch.distributed.all_reduce(tensor, op=op, group=group)


def _tp_size(tp_group) -> int:
    if tp_group is None:
        return 1
    return torch.distributed.get_world_size(tp_group)


def _renormalise(
    values: torch.Tensor,
    member: torch.Tensor | None,
    y_values: torch.Tensor,
    valid: torch.Tensor,
    tp_group,
    count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y - logsumexp(values[member]), count summed)`` per row, summed over the vocabulary shards.

    ``values [N, M]`` (this rank's candidates, any value where ``member`` is False; ``member``
    None = all), ``y_values [N]`` (0 where the target is not on this rank), ``valid [N]``;
    ``count [N]`` (optional, small integers) is summed over the shards in the same all-reduce
    and returned (None without it). One MAX and one SUM all-reduce when the group has more than
    one rank. The SUM is applied in the straight-through form ``reduced + local -
    local.detach()``: the value is the global sum, the gradient reaches this rank's own terms
    only, as the unsharded computation's would.
    """
    masked = values if member is None else torch.where(member, values, _NEG_INF)
    if masked.shape[1] == 0:
        row_max = torch.full(masked.shape[:1], _NEG_INF, dtype=masked.dtype, device=masked.device)
    else:
        row_max = masked.detach().amax(dim=1)
    distributed = _tp_size(tp_group) > 1
    if distributed:
        _all_reduce(row_max, torch.distributed.ReduceOp.MAX, tp_group)
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    exp = torch.exp(masked - shift.unsqueeze(1))
    parts = [exp.sum(dim=1), y_values]
    if count is not None:
        parts.append(count.to(exp.dtype))
    stats = torch.stack(parts)
    if distributed:
        reduced = stats.detach().clone()
        _all_reduce(reduced, torch.distributed.ReduceOp.SUM, tp_group)
        stats = reduced + (stats - stats.detach())
    denom = torch.where(valid, stats[0], 1.0)
    lp = stats[1] - shift - torch.log(denom)
    return torch.where(valid, lp, 0.0), None if count is None else stats[2].detach()


def _localise(sampled_ids, support_ids, vocab_start: int, v_local: int):
    w = support_ids.shape[-1]
    sup = support_ids.reshape(-1, w).long()
    if w == 0:
        sup = torch.full((sup.shape[0], 1), -1, dtype=torch.long, device=sup.device)
    y = sampled_ids.reshape(-1).long()
    member = sup >= 0
    valid = member.any(dim=1)
    shifted = sup - vocab_start
    local_m = member & (shifted >= 0) & (shifted < v_local)
    local_sup = torch.where(local_m, shifted, 0)
    ly = y - vocab_start
    y_local = (y >= 0) & (ly >= 0) & (ly < v_local)
    ly = torch.where(y_local, ly, 0)
    return sup, member, valid, local_m, local_sup, y_local, ly


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_chunk(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ReplayDataError("chunk_size", f"got {chunk_size!r}", expected="an int >= 1")
    return chunk_size


def _check_common(
    source: Any,
    sampled_ids: Any,
    support_ids: Any,
    temperature: Any,
    vocab_start: Any,
    *,
    source_field: str = "logits",
) -> tuple[float, int]:
    """The checks every entry taking support rows makes before any computation or collective
    (``core.inputs`` rules): tensors, dtypes (support ids signed: ``-1`` must stay ``-1``), shapes
    (width >= 1), one device. Returns the temperature and ``vocab_start`` as numbers."""
    t = check_temperature(temperature)
    start = check_index(vocab_start, "vocab_start")
    check_tensor(source, source_field)
    if not source.is_floating_point():
        raise ReplayTypeError(source_field, f"got dtype {source.dtype}", expected="a floating-point tensor")
    for name, x in (("sampled_ids", sampled_ids), ("support_ids", support_ids)):
        check_tensor(x, name)
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ReplayTypeError(name, f"got dtype {x.dtype}", expected="an integer tensor")
        check_same_device(x, name, source, source_field)
    check_support_dtype(support_ids.dtype)
    if support_ids.dim() < 1 or source.shape[:-1] != sampled_ids.shape or support_ids.shape[:-1] != sampled_ids.shape:
        raise ReplayDataError(
            "support_ids",
            f"shapes {tuple(source.shape)}, {tuple(sampled_ids.shape)}, {tuple(support_ids.shape)} disagree",
            expected="source [..., D], sampled_ids [...], support_ids [..., W]",
        )
    if support_ids.shape[-1] < 1:
        raise ReplayDataError(
            "support_ids", "rows have width 0", expected="width W >= 1 (rows without support are all -1)"
        )
    return t, start


def _check_weight(lm_head_weight: Any, hidden: torch.Tensor) -> None:
    check_tensor(lm_head_weight, "lm_head_weight", "[V_local, H]")
    if not lm_head_weight.is_floating_point():
        raise ReplayTypeError("lm_head_weight", f"got dtype {lm_head_weight.dtype}", expected="a floating-point tensor")
    check_same_device(lm_head_weight, "lm_head_weight", hidden, "hidden")


def _check_ids(x: Any, field: str, source: torch.Tensor, source_field: str) -> torch.Tensor:
    """``x``, an integer tensor on ``source``'s device (trajectory and token ids)."""
    check_tensor(x, field)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ReplayTypeError(field, f"got dtype {x.dtype}", expected="an integer tensor")
    check_same_device(x, field, source, source_field)
    return x


# --------------------------------------------------------------------------- fused projection


def _projection_method(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """``"sparse"`` where its kernels exist and were measured (float32/64 on CPU), else ``"gather"``."""
    if (
        hidden.device.type == "cpu"
        and weight.device.type == "cpu"
        and hidden.dtype == weight.dtype
        and hidden.dtype in (torch.float32, torch.float64)
    ):
        return "sparse"
    return "gather"


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size) -> torch.Tensor:
    with warnings.catch_warnings():
        # "Sparse CSR tensor support is in beta state": the ops used here are covered by tests.
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=False)


class _CandidateProjection(torch.autograd.Function):
    """``z[n, j] = hidden[n] . weight[cand[n, j]] * inv_t`` where ``local[n, j]``, else 0.

    ``hidden [N, H]``, ``weight [V, H]``, ``cand [N, K]`` long in ``[0, V)``, ``local [N, K]``;
    output ``[N, K]`` float32 (float64 for float64 inputs).
    """

    @staticmethod
    def forward(ctx, hidden, weight, cand, local, inv_t, chunk_size, method):
        n, k = cand.shape
        v = weight.shape[0]
        cdt = _compute_dtype(weight.dtype)
        ctx.inv_t, ctx.chunk_size, ctx.method = inv_t, chunk_size, method
        if n == 0 or k == 0 or v == 0:
            ctx.save_for_backward(hidden, weight, cand, local)
            ctx.empty = True
            return torch.zeros((n, k), dtype=cdt, device=hidden.device)
        ctx.empty = False
        if method == "sparse":
            hidden = hidden.contiguous()
            key = torch.where(local, cand, v)
            skey, perm = key.sort(dim=1)
            svalid = skey < v
            new = torch.ones_like(svalid)
            new[:, 1:] = skey[:, 1:] != skey[:, :-1]
            first = svalid & new
            cols = torch.arange(k, device=cand.device).expand(n, k)
            run_start = torch.where(new, cols, 0).cummax(dim=1).values
            crow = torch.zeros(n + 1, dtype=torch.long, device=cand.device)
            torch.cumsum(first.sum(dim=1), dim=0, out=crow[1:])
            col = skey[first]
            zs = torch.zeros((n, k), dtype=cdt, device=hidden.device)
            if col.numel():
                pattern = _csr(crow, col, torch.zeros(col.numel(), dtype=hidden.dtype, device=hidden.device), (n, v))
                vals = torch.sparse.sampled_addmm(pattern, hidden, weight.t(), beta=0.0, alpha=inv_t).values()
                zs[first] = vals.to(cdt)
            zs = torch.where(svalid, zs.gather(1, run_start), 0.0)
            out = torch.empty_like(zs).scatter_(1, perm, zs)
            ctx.save_for_backward(hidden, weight, skey, perm, first, svalid, run_start)
            return out
        out = torch.empty((n, k), dtype=cdt, device=hidden.device)
        rows_per_chunk = max(1, chunk_size // k)
        for s in range(0, n, rows_per_chunk):
            e = min(n, s + rows_per_chunk)
            gathered = weight.index_select(0, cand[s:e].reshape(-1)).view(e - s, k, -1).to(cdt)
            out[s:e] = torch.bmm(gathered, hidden[s:e].to(cdt).unsqueeze(-1)).squeeze(-1) * inv_t
        out = torch.where(local, out, 0.0)
        ctx.save_for_backward(hidden, weight, cand, local)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.empty:
            hidden, weight, _, _ = ctx.saved_tensors
            return (
                torch.zeros_like(hidden) if need_h else None,
                torch.zeros_like(weight) if need_w else None,
                None,
                None,
                None,
                None,
                None,
            )
        if ctx.method == "sparse":
            return (*_sparse_backward(ctx, grad_out, need_h, need_w), None, None, None, None, None)
        return (*_gather_backward(ctx, grad_out, need_h, need_w), None, None, None, None, None)


def _sparse_backward(ctx, grad_out, need_h, need_w):
    hidden, weight, skey, perm, first, svalid, run_start = ctx.saved_tensors
    n, k = skey.shape
    v = weight.shape[0]
    grad_sorted = torch.where(svalid, grad_out.gather(1, perm), 0.0)
    # Duplicated candidates share one projected value: fold their gradients onto its first copy.
    grad_pairs = torch.zeros_like(grad_sorted).scatter_add_(1, run_start, grad_sorted) * ctx.inv_t
    grad_h = grad_w = None
    if need_h:
        grad_h = F.embedding_bag(
            skey.clamp(max=v - 1), weight, per_sample_weights=grad_pairs.to(weight.dtype), mode="sum"
        ).to(hidden.dtype)
    if need_w:
        # Pairs sorted by vocabulary id; one embedding bag per vocabulary row (empty bags give
        # zeros), so the dense gradient is written once and each row summed once, however many
        # tokens share it.
        rows = torch.arange(n, device=skey.device).unsqueeze(1).expand(n, k)[first]
        cols = skey[first]
        vals = grad_pairs[first].to(hidden.dtype)
        order = torch.argsort(cols, stable=True)
        offsets = torch.zeros(v, dtype=torch.long, device=skey.device)
        torch.cumsum(torch.bincount(cols, minlength=v)[:-1], dim=0, out=offsets[1:])
        grad_w = F.embedding_bag(
            rows.index_select(0, order), hidden, offsets, per_sample_weights=vals.index_select(0, order), mode="sum"
        ).to(weight.dtype)
    return grad_h, grad_w


def _gather_backward(ctx, grad_out, need_h, need_w):
    hidden, weight, cand, local = ctx.saved_tensors
    n, k = cand.shape
    cdt = grad_out.dtype
    grad = torch.where(local, grad_out, 0.0) * ctx.inv_t
    grad_h = grad_w = None
    chunk = ctx.chunk_size
    if need_h:
        grad_h = torch.empty_like(hidden)
        rows_per_chunk = max(1, chunk // k)
        for s in range(0, n, rows_per_chunk):
            e = min(n, s + rows_per_chunk)
            gathered = weight.index_select(0, cand[s:e].reshape(-1)).view(e - s, k, -1).to(cdt)
            grad_h[s:e] = torch.bmm(grad[s:e].unsqueeze(1), gathered).squeeze(1).to(hidden.dtype)
    if need_w:
        grad_w = torch.zeros_like(weight)
        pair = torch.nonzero(local.reshape(-1)).squeeze(1)
        ids = cand.reshape(-1).index_select(0, pair)
        order = torch.argsort(ids, stable=True)
        ids = ids.index_select(0, order)
        pair = pair.index_select(0, order)
        rows = torch.div(pair, k, rounding_mode="floor")
        g = grad.reshape(-1).index_select(0, pair)
        for s in range(0, ids.numel(), chunk):
            e = min(ids.numel(), s + chunk)
            uniq, inverse = torch.unique_consecutive(ids[s:e], return_inverse=True)
            contrib = hidden.index_select(0, rows[s:e]).to(cdt) * g[s:e].unsqueeze(1)
            acc = torch.zeros((uniq.numel(), hidden.shape[1]), dtype=cdt, device=hidden.device)
            acc.index_add_(0, inverse, contrib)
            grad_w.index_add_(0, uniq, acc.to(weight.dtype))
    return grad_h, grad_w
