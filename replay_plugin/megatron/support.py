"""Sampler-support replay for Megatron trainers: score rollout tokens over their recorded support.

With top-k / top-p / min-p the engine draws from a truncated, renormalised distribution while a
Megatron trainer scores over the full vocabulary (``vocab_parallel_cross_entropy``); the log of
the kept mass is the train-inference gap this module closes. :func:`replay_response_logprobs`
is the call for a trainer's loss function (logits, or the output layer's input and weight for
the fused path; unpacked, packed or context-parallel layouts); without support it returns
Megatron's own full-vocabulary logprobs. :func:`support_logprobs` is the low-level call on
vocab-parallel logits.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any, TypeAlias, overload

import numpy as np
import torch
import torch.nn.functional as F

from replay_plugin.core import logprobs as core
from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.inputs import as_mask, check_support_dtype, check_temperature
from replay_plugin.core.layout import TokenMetadataLayout
from replay_plugin.core.metrics import LogprobsWithMetrics, mismatch_metrics
from replay_plugin.megatron.groups import Groups, groups_of

__all__ = ["cp_loss_scale", "replay_response_logprobs", "support_logprobs"]

TensorLike: TypeAlias = "torch.Tensor | np.ndarray"


# ---------------------------------------------------------------------------------------
# Megatron's process groups: groups_of (the model's pg_collection, else parallel_state), as the
# route driver uses them.


def _reduce(group: Any, size: int) -> Any | None:
    return group if size > 1 else None


def _vocab_start(local_vocab: int, rank: int, size: int) -> int:
    from megatron.core.tensor_parallel.utils import VocabUtility

    return int(VocabUtility.vocab_range_from_per_partition_vocab_size(local_vocab, rank, size)[0])


# ---------------------------------------------------------------------------------------
# low level


def support_logprobs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    model: Any = None,
    pg_collection: Any = None,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Support-renormalised logprobs on Megatron's vocab-parallel logits.

    Args:
        logits: ``[b, s, V/tp]`` (any ``[..., V/tp]``) this rank's vocabulary shard, raw (not
            divided by the temperature), any float dtype: what ``GPTModel`` returns with
            ``labels=None``.
        sampled_ids: ``[b, s]`` integer global token ids, aligned to the logits' positions
            (position ``p`` scores ``sampled_ids[p]``: already next-token shifted).
        support_ids: ``[b, s, W]`` integer (int32 by contract) global ids, ``-1`` padding,
            aligned like ``sampled_ids``.
        temperature: ``T > 0``; the gathered logits are divided by it.
        model, pg_collection: where the tensor-parallel group comes from: ``pg_collection``,
            else the model's (``GPTModel(..., pg_collection=)``), else ``parallel_state``.
        loss_mask: ``[b, s]`` bool, the rows whose sampled token must be in their support row
            (default: every row with support); rows with support outside it whose token is not
            in the row score 0 with ``valid`` False.

    Returns:
        ``(logprobs, valid)``: float32 ``[b, s]`` and bool ``[b, s]`` (False where the row has
        no support; logprob 0 there). Values, and the gradient of this rank's logits shard,
        equal :func:`replay_plugin.core.logprobs.support_logprobs` on the logits gathered over
        the tensor-parallel group. Two ``all_reduce`` calls when ``tp > 1``.

    Raises:
        ReplayDataError naming the row (``trajectory`` = batch row, ``token`` = position) and
        the id: a support id outside the global vocabulary (``V/tp`` times the tensor-parallel
        size: a member must lie in some rank's shard), a negative id other than ``-1``, an id
        twice in a row, a required row without its sampled token. Checked on the device with
        one host sync, after the two all-reduces, identically on every tensor-parallel rank.
    """
    g = groups_of(model, pg_collection)
    return core.support_logprobs(
        logits,
        sampled_ids,
        support_ids,
        temperature=temperature,
        vocab_start=_vocab_start(logits.shape[-1], g.tp_rank, g.tp_size),
        tp_group=_reduce(g.tp, g.tp_size),
        loss_mask=loss_mask,
    )


# ---------------------------------------------------------------------------------------
# batch level


@overload
def replay_response_logprobs(
    output: torch.Tensor,
    input_ids: TensorLike,
    layout: TokenMetadataLayout,
    *,
    rollout_logprobs: None = None,
    metrics_prefix: str = "",
    support_ids: TensorLike | None = None,
    loss_mask: TensorLike | None = None,
    output_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    num_actions: int | None = None,
    width: int | None = None,
    sub_sequence_lengths: Sequence[Sequence[int]] | None = None,
    chunk_size: int = core.DEFAULT_CHUNK_SIZE,
    model: Any = None,
    pg_collection: Any = None,
) -> torch.Tensor: ...


@overload
def replay_response_logprobs(
    output: torch.Tensor,
    input_ids: TensorLike,
    layout: TokenMetadataLayout,
    *,
    rollout_logprobs: TensorLike,
    metrics_prefix: str = "",
    support_ids: TensorLike | None = None,
    loss_mask: TensorLike | None = None,
    output_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    num_actions: int | None = None,
    width: int | None = None,
    sub_sequence_lengths: Sequence[Sequence[int]] | None = None,
    chunk_size: int = core.DEFAULT_CHUNK_SIZE,
    model: Any = None,
    pg_collection: Any = None,
) -> LogprobsWithMetrics: ...


def replay_response_logprobs(
    output: torch.Tensor,
    input_ids: TensorLike,
    layout: TokenMetadataLayout,
    *,
    rollout_logprobs: TensorLike | None = None,
    metrics_prefix: str = "",
    support_ids: TensorLike | None = None,
    loss_mask: TensorLike | None = None,
    output_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
    num_actions: int | None = None,
    width: int | None = None,
    sub_sequence_lengths: Sequence[Sequence[int]] | None = None,
    chunk_size: int = core.DEFAULT_CHUNK_SIZE,
    model: Any = None,
    pg_collection: Any = None,
) -> torch.Tensor | LogprobsWithMetrics:
    """Per-token logprobs of one microbatch, support-renormalised where support was recorded.

    Call it in the trainer's loss / logprob function on the model output of the microbatch.

    Args:
        output: the model output on this rank, in the layout's input layout (``rows, length =
            layout.output_shape``: ``[B, A]`` unpacked, ``[1, T / cp]`` packed):

            * logits ``[rows, length, V/tp]`` (batch-first, as ``GPTModel`` returns them
              with ``labels=None``), any float dtype; or
            * with ``output_weight``: the output layer's input ``[length, rows, H]``
              (sequence-first), or its sequence-parallel shard ``[length / tp, rows, H]``
              (gathered here with Megatron's ``gather_from_sequence_parallel_region``). Without
              sequence parallelism it goes through ``copy_to_tensor_model_parallel_region``,
              as ``ColumnParallelLinear`` does, so its gradient is all-reduced over the
              vocabulary shards.
        input_ids: ``[B, S]`` integer token ids of the batch grid (the grid of
            ``layout.attention_mask``; usually left-padded).
        layout: the microbatch's layout, built with this process's context-parallel size and
            rank (``packed=True, align=tp * cp * 2`` with CP; ``tp`` otherwise).
        support_ids: ``[B, S, W]`` integer (int32) support rows in the same grid:
            ``support_ids[b, s]`` is the support the sampler had for token
            ``input_ids[b, s]``, ``-1`` padding, all ``-1`` where none (prompt, padding,
            synthetic EOS): ``DenseSupport.ids`` of
            :func:`replay_plugin.core.support.dense_support_batch`. None = replay off. Member
            ids lie in the global vocabulary (``V/tp`` times the tensor-parallel size), are
            distinct within a row, and a loss-bearing row contains its token; rows outside the
            loss mask that lack their token (``on_inexact="mask"``) score 0.
        loss_mask: response loss mask, required with ``support_ids``: bool or 0/1,
            ``[B, S]`` in the grid (``DenseSupport.loss_mask``), or ``[B, n]`` with
            ``n < S`` for the last ``n`` columns of the grid (a trainer's
            ``[B, num_actions]`` response mask). Ignored with replay off.
        output_weight: ``[V/tp, H]`` the output layer's weight shard
            (``model.output_layer.weight``, or ``model.shared_embedding_or_output_weight()``
            with tied embeddings): selects the fused path.
        temperature: the rollout's sampling temperature ``T > 0``; logits are divided by it.
        num_actions: when given, return only the last ``num_actions`` columns
            (``[B, num_actions]``, the trainer's response logprobs).
        width: the expected support width ``W`` (e.g. the sampler's configured width); a batch
            of another width is refused.
        sub_sequence_lengths: per batch row, the lengths of the sub-sequences a controller
            packed into it, if the trainer's controller packs; every row must hold one
            trajectory.
        chunk_size: (token, candidate) pairs per chunk of the fused projection.
        rollout_logprobs: the engine's logprob of each token, float ``[B, S]`` in the grid
            (``rollout_logprobs[b, s]`` for token ``input_ids[b, s]``) or ``[B, n]`` for the
            last ``n`` columns, like ``loss_mask``: also return the step's train-inference
            mismatch metrics (:func:`replay_plugin.metrics.mismatch_metrics`, verl's key names)
            of the result against them over ``loss_mask`` (required then, replay on or off),
            less the synthetic EOS rows with replay on (the engine never sampled them). Values
            outside those tokens are never read.
        metrics_prefix: prepended to every metric key (e.g. ``"actor/"``).
        model, pg_collection: where the tensor- and context-parallel groups come from:
            ``pg_collection``, else the model chunk's (``GPTModel(..., pg_collection=)``), else
            Megatron's ``parallel_state``; pass the model built with a custom
            ``pg_collection`` (the route driver takes its groups from the same place).

    Returns:
        With ``rollout_logprobs``: ``LogprobsWithMetrics(logprobs, metrics)``, the logprobs below
        and a dict of 0-d tensors (no host synchronisation; the same on every tensor- and
        context-parallel rank). Otherwise the logprobs:
        float32 ``[B, S - 1]`` (or ``[B, num_actions]``), on the layout's device; position ``s``
        holds the logprob of the token that follows the token at ``s`` in its row (token
        ``s + 1`` in a left-padded grid), 0 at padding and at each row's last token. Replay on:
        support-renormalised where the token
        has support, the full-vocabulary logprob at each trajectory's synthetic EOS, 0 for
        tokens without support outside the loss mask. Replay off: the full-vocabulary logprob
        of every token, computed by Megatron's ``vocab_parallel_cross_entropy``. The result is
        the same on every context-parallel rank; its backward sends each rank the gradient of
        its own shard's positions only (as the sum of per-shard losses would).

    Raises:
        ReplayDataError / ReplayTypeError naming field, trajectory (batch row) and token
        (grid position): support without a loss mask, a support width other than ``width``,
        controller-packed rows, a loss-bearing token without a predecessor or at a padding
        position, a trajectory with more than one loss-bearing token without support, shapes
        that do not match the layout (e.g. sequence-first logits), a layout built for another
        context-parallel rank; and, from :func:`replay_plugin.core.logprobs.replay_logprobs`,
        on the rows this rank scores: a support id outside the global vocabulary, a negative
        id other than ``-1``, an id twice in a row, a loss-bearing row without its token, a
        synthetic EOS whose token id is in no vocabulary shard (field ``sampled_ids``), a
        logprob that is not finite. The input checks run before any collective on inputs every
        tensor- and context-parallel rank holds whole (the batch grid); the data-dependent ones
        (the support rows of a rank's slots, found on the device in the host sync that was
        there already) are agreed over both groups before raising, so every rank raises the
        same error instead of one rank raising while its peers wait in the context-parallel
        gather.

    Loss scaling under context parallelism: the result covers the whole microbatch, identical
    on every context-parallel rank, while its backward reaches only this rank's shard. Megatron
    treats each CP rank's loss as that rank's share: without ``calculate_per_token_loss`` the
    3-tuple ``(loss, num_tokens, ...)`` a loss function returns is divided by ``num_tokens`` and
    the gradients are averaged over the data- and context-parallel ranks; with it, they are
    divided by ``num_tokens`` summed over those ranks. A loss summed from this result therefore
    gets gradients scaled by ``1 / cp`` unless it is multiplied by the CP size: return
    ``(loss_sum * cp_loss_scale(model), num_tokens, ...)`` with ``num_tokens`` the whole
    microbatch's loss-bearing tokens (the same on every CP rank), which is right in both modes.
    (The 2-tuple legacy form is multiplied by the CP size by Megatron itself; nothing to do
    there.)
    """
    if not isinstance(layout, TokenMetadataLayout):
        raise ReplayTypeError(
            "layout", f"got {type(layout).__name__}", expected="a replay_plugin.core.layout.TokenMetadataLayout"
        )
    temperature = check_temperature(temperature)
    attention = layout.attention_mask
    device = attention.device
    batch, seq = attention.shape
    ids = _grid(input_ids, "input_ids", (batch, seq), device, integer=True)
    _check_sub_sequences(sub_sequence_lengths, layout)
    if num_actions is not None and (
        isinstance(num_actions, bool) or not isinstance(num_actions, int) or not 0 < num_actions <= seq - 1
    ):
        raise ReplayDataError("num_actions", f"got {num_actions!r}", expected=f"an int in [1, {seq - 1}]")

    g = groups_of(model, pg_collection)
    cp_size, cp_rank = g.cp_size, g.cp_rank
    if layout.cp_size != cp_size or layout.cp_rank != cp_rank:
        raise ReplayDataError(
            "layout",
            f"built for context-parallel rank {layout.cp_rank} of {layout.cp_size}",
            expected=f"rank {cp_rank} of {cp_size}, this process's: "
            f"TokenMetadataLayout.build(..., cp_size={cp_size}, cp_rank={cp_rank})",
        )
    rows, length = layout.output_shape
    source = _source(output, output_weight, rows, length, g)

    sampled = layout.align(ids, 0, next_token=True)  # [rows, length]: the token each slot predicts
    if support_ids is None:
        values = _megatron_logprobs(source, sampled, output_weight, temperature, g)
    else:
        values = _support_logprobs_of_slots(
            source,
            sampled,
            layout,
            support_ids,
            loss_mask,
            output_weight,
            temperature,
            width,
            chunk_size,
            g,
        )
    if cp_size > 1:
        values = layout.unshard(list(_GatherShards.apply(values, g.cp, cp_rank, cp_size).unbind(0)))
    out = layout.restore(values, 0.0)  # [B, S - 1]
    result = out if num_actions is None else out[:, seq - 1 - num_actions :]
    if rollout_logprobs is None:
        return result
    # The metrics compare each scored column with the rollout's logprob of the same token: the
    # result's column s scores token s + 1 of the grid.
    if loss_mask is None:
        raise ReplayDataError(
            "loss_mask",
            "rollout_logprobs were given without a loss mask: the metrics need the response tokens",
            expected="the response loss mask, [B, S] (DenseSupport.loss_mask) or [B, num_actions]",
        )
    rollout_grid = _rollout_grid(rollout_logprobs, (batch, seq), device)
    scored = _loss_grid(loss_mask, (batch, seq), device)
    _check_rollout_covers(rollout_logprobs, scored)
    rollout = rollout_grid[:, 1:]
    if support_ids is not None:  # a synthetic EOS (no support) was never sampled: no rollout logprob
        scored = scored & (_as_tensor(support_ids, "support_ids", device) != -1).any(-1)
    scored = scored[:, 1:]
    if num_actions is not None:
        rollout, scored = rollout[:, -num_actions:], scored[:, -num_actions:]
    return LogprobsWithMetrics(result, mismatch_metrics(result, rollout, scored, prefix=metrics_prefix))


def cp_loss_scale(model: Any = None, pg_collection: Any = None) -> int:
    """The factor (the context-parallel size) to multiply a loss summed from
    :func:`replay_response_logprobs` by before handing Megatron's schedule the 3-tuple
    ``(loss, num_tokens, ...)``: every CP rank holds the whole microbatch's loss, and Megatron
    averages (or token-normalises) gradients over the CP ranks as if each held its shard's share.
    See "Loss scaling under context parallelism" in :func:`replay_response_logprobs`. Groups come
    from ``pg_collection``, the model's, or ``parallel_state`` (1 without any)."""
    return groups_of(model, pg_collection).cp_size


# ---------------------------------------------------------------------------------------
# pieces


def _support_logprobs_of_slots(
    source: torch.Tensor,
    sampled: torch.Tensor,
    layout: TokenMetadataLayout,
    support_ids: TensorLike,
    loss_mask: TensorLike | None,
    output_weight: torch.Tensor | None,
    temperature: float,
    width: int | None,
    chunk_size: int,
    g: Groups,
) -> torch.Tensor:
    """Replay on: float32 ``[rows, length]`` logprobs of this rank's slots, from the checked
    support ``[B, S, W]`` and loss mask of the batch grid moved to the slots that predict them;
    ``sampled`` ``[rows, length]`` is the token each slot predicts. Errors found in this rank's
    slots are agreed over the tensor- and context-parallel groups and name the grid position."""
    attention = layout.attention_mask
    device = attention.device
    batch, seq = attention.shape
    support = _grid(support_ids, "support_ids", (batch, seq), device, integer=True, trailing=1)
    check_support_dtype(support.dtype)  # a uint8 -1 pad would read as id 255
    if support.shape[2] < 1 or (width is not None and support.shape[2] != width):
        raise ReplayDataError(
            "support_ids",
            f"width {support.shape[2]}",
            expected=f"width {width} (the configured support width)" if width is not None else "width >= 1",
        )
    mask = _loss_grid(loss_mask, (batch, seq), device)
    _check_targets(attention, mask, support)
    trajectory = torch.arange(batch, device=device).unsqueeze(1).expand(batch, seq)
    column = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    v_local = source.shape[-1] if output_weight is None else output_weight.shape[0]
    return core.replay_logprobs(
        source,
        sampled,
        layout.align(support, -1, next_token=True),
        layout.align(mask, False, next_token=True),
        layout.align(trajectory, -1, next_token=True),
        batch,
        lm_head_weight=output_weight,
        temperature=temperature,
        vocab_start=_vocab_start(v_local, g.tp_rank, g.tp_size),
        tp_group=_reduce(g.tp, g.tp_size),
        chunk_size=chunk_size,
        agree_groups=(_reduce(g.tp, g.tp_size), _reduce(g.cp, g.cp_size)),
        token_index=layout.align(column, -1, next_token=True),  # the grid column of the scored token
    ).logprobs


def _megatron_logprobs(
    source: torch.Tensor, sampled: torch.Tensor, weight: torch.Tensor | None, temperature: float, g: Groups
) -> torch.Tensor:
    """Megatron's own full-vocabulary logprob (replay off): ``[rows, length]`` float32, over
    the tensor-parallel group of ``g``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = source if weight is None else F.linear(source, weight)
    if g.source == "none":  # a single-process model without Megatron's groups
        scaled = logits / temperature
        return torch.log_softmax(scaled.float(), dim=-1).gather(-1, sampled.long().unsqueeze(-1)).squeeze(-1)
    if "tp_group" in inspect.signature(vocab_parallel_cross_entropy).parameters:  # 0.17+
        # A new tensor on purpose: vocab_parallel_cross_entropy works in place on its input.
        return -vocab_parallel_cross_entropy(logits / temperature, sampled.long(), tp_group=g.tp).float()
    if g.tp_size == ps.get_tensor_model_parallel_world_size() and (
        g.tp_size == 1 or g.tp is ps.get_tensor_model_parallel_group()
    ):
        return -vocab_parallel_cross_entropy(logits / temperature, sampled.long()).float()
    # megatron-core 0.16.x: vocab_parallel_cross_entropy always reduces over parallel_state's
    # tensor-parallel group; a model built with another pg_collection gets the same math over its own
    # (check_targets=False: like Megatron's, a target in no shard scores -logsumexp; replay off keeps
    # Megatron's semantics).
    return core.full_vocab_logprobs(
        logits,
        sampled,
        temperature=temperature,
        vocab_start=_vocab_start(logits.shape[-1], g.tp_rank, g.tp_size),
        tp_group=_reduce(g.tp, g.tp_size),
        check_targets=False,
    )


def _source(output: Any, weight: torch.Tensor | None, rows: int, length: int, g: Groups) -> torch.Tensor:
    """The model output as ``[rows, length, V/tp]`` logits or ``[rows, length, H]`` hidden states
    ready for the fused projection (gathered / copied into the tensor-parallel region)."""
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        got = f"dtype {output.dtype}" if isinstance(output, torch.Tensor) else f"type {type(output).__name__}"
        raise ReplayTypeError("output", got, expected="a floating-point torch tensor (logits or hidden states)")
    if weight is None:
        if output.dim() != 3 or tuple(output.shape[:2]) != (rows, length):
            hint = ""
            if output.dim() == 3 and tuple(output.shape[:2]) == (length, rows):
                hint = (
                    "; these look sequence-first [s, b, V/tp]: pass GPTModel's output (labels=None), "
                    "which is batch-first"
                )
            raise ReplayDataError(
                "logits",
                f"shape {tuple(output.shape)}{hint}",
                expected=f"[{rows}, {length}, V/tp]: the layout's output shape ([B, A] unpacked, [1, T / cp] packed)",
            )
        return output
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 2
        or output.dim() != 3
        or weight.shape[1] != output.shape[2]
    ):
        raise ReplayDataError(
            "output_weight",
            f"shape {tuple(getattr(weight, 'shape', ()))} for hidden states {tuple(output.shape)}",
            expected="[V/tp, H] with hidden states [s, b, H]",
        )
    tp_size = g.tp_size
    sharded = tp_size > 1 and length % tp_size == 0 and output.shape[0] == length // tp_size
    if output.shape[1] != rows or not (output.shape[0] == length or sharded):
        raise ReplayDataError(
            "output",
            f"hidden states of shape {tuple(output.shape)}",
            expected=f"[{length}, {rows}, H] (sequence-first, the output layer's input) or its sequence-parallel "
            f"shard [{length} / tp, {rows}, H]",
        )
    if sharded:
        # Sequence parallelism: gather the sequence; backward reduce-scatters the partial sums.
        hidden = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=True, group=g.tp)
    elif tp_size > 1:
        # Identity forward, all-reduce of the per-shard partial gradients in backward.
        hidden = copy_to_tensor_model_parallel_region(output, group=g.tp)
    else:
        return output.transpose(0, 1)
    # The gradient reaching the region is the transpose of a [rows, length, H] gradient, i.e.
    # not contiguous, and megatron-core 0.16.x's _reduce all-reduces `input_.contiguous()` but
    # returns `input_`: a non-contiguous gradient silently stays unreduced (0.19 returns the
    # reduced copy). Hand the region a contiguous gradient on every version.
    return _ContiguousGrad.apply(hidden).transpose(0, 1)  # [rows, length, H]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _GatherShards(torch.autograd.Function):
    """All-gather of the context-parallel shards ``[1, T / cp]`` into ``[cp, 1, T / cp]``; the
    backward returns this rank's own slice of the gradient (no reduction)."""

    @staticmethod
    def forward(ctx, shard, group, rank, size):
        shard = shard.contiguous()
        parts = [torch.empty_like(shard) for _ in range(size)]
        torch.distributed.all_gather(parts, shard, group=group)
        ctx.rank = rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None, None, None


def _as_tensor(x: Any, field: str, device: torch.device) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            x = np.array(x)
        try:
            x = torch.from_numpy(x)
        except TypeError as exc:
            raise ReplayTypeError(field, f"dtype {x.dtype}: {exc}", expected="a dtype torch supports") from None
    if not isinstance(x, torch.Tensor):
        raise ReplayTypeError(field, f"got {type(x).__name__}", expected="a torch tensor or numpy array")
    return x.to(device)


def _grid(
    x: Any, field: str, shape: tuple[int, int], device: torch.device, *, integer: bool, trailing: int = 0
) -> torch.Tensor:
    t = _as_tensor(x, field, device)
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ReplayTypeError(field, f"dtype {t.dtype}", expected="an integer tensor")
    if t.dim() != 2 + trailing or tuple(t.shape[:2]) != shape:
        dims = ", ".join(map(str, shape)) + (", W" if trailing else "")
        raise ReplayDataError(field, f"shape {tuple(t.shape)}", expected=f"[{dims}] like the layout's attention_mask")
    return t


def _rollout_grid(rollout_logprobs: Any, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The rollout's logprobs as float ``[B, S]`` in the grid (a ``[B, n]`` array fills the last
    n columns; the others hold NaN, never read: the loss mask is False there)."""
    r = _as_tensor(rollout_logprobs, "rollout_logprobs", device)
    if not r.is_floating_point():
        raise ReplayTypeError("rollout_logprobs", f"dtype {r.dtype}", expected="a floating-point tensor")
    batch, seq = shape
    if r.dim() != 2 or r.shape[0] != batch or not 0 < r.shape[1] <= seq:
        raise ReplayDataError(
            "rollout_logprobs",
            f"shape {tuple(r.shape)}",
            expected=f"[{batch}, {seq}] or [{batch}, n <= {seq}] like loss_mask",
        )
    if r.shape[1] == seq:
        return r
    full = torch.full(shape, math.nan, dtype=r.dtype, device=device)
    full[:, seq - r.shape[1] :] = r
    return full


def _check_rollout_covers(rollout_logprobs: Any, scored: torch.Tensor) -> None:
    """A ``[B, n]`` rollout array narrower than the grid must cover every loss-bearing column:
    the columns before it read as NaN, and a metric over a loss-bearing NaN is NaN (before, it
    was returned so, silently). One host sync, only for a narrower array."""
    n = int(rollout_logprobs.shape[1])
    seq = scored.shape[1]
    if n < seq and bool(scored[:, : seq - n].any()):
        b, s = (int(v) for v in scored[:, : seq - n].nonzero()[0])
        raise ReplayDataError(
            "rollout_logprobs",
            f"covers the last {n} of {seq} columns, but the token at column {s} is loss-bearing",
            trajectory=b,
            token=s,
            expected=f"[B, {seq}] in the grid, or [B, n] with n covering every loss-bearing column (like loss_mask)",
        )


def _loss_grid(loss_mask: Any, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The loss mask as bool ``[B, S]`` in the grid (a ``[B, n]`` mask fills the last n columns)."""
    if loss_mask is None:
        raise ReplayDataError(
            "loss_mask",
            "support_ids were given without a loss mask: synthetic EOS rows (loss-bearing, no support) "
            "cannot be told from prompt and padding rows",
            expected="the response loss mask, [B, S] (DenseSupport.loss_mask) or [B, num_actions]",
        )
    m = _as_tensor(loss_mask, "loss_mask", device)
    batch, seq = shape
    if m.dim() != 2 or m.shape[0] != batch or not 0 < m.shape[1] <= seq:
        raise ReplayDataError(
            "loss_mask", f"shape {tuple(m.shape)}", expected=f"[{batch}, {seq}] or [{batch}, num_actions <= {seq}]"
        )
    m = as_mask(m, "loss_mask")  # bool, or 0/1 numbers (core.inputs)
    if m.shape[1] == seq:
        return m
    full = torch.zeros(shape, dtype=torch.bool, device=device)
    full[:, seq - m.shape[1] :] = m
    return full


def _check_targets(attention: torch.Tensor, mask: torch.Tensor, support: torch.Tensor) -> None:
    """Every loss-bearing token has a predecessor in its row; at most one per trajectory lacks
    support (its synthetic EOS). One host sync; located only on failure."""
    predecessor = attention & (attention.long().cumsum(dim=1) >= 2)
    orphan = mask & ~predecessor
    # All -1 = no support. A row of other negative ids is not "no support" but bad data, which
    # core.replay_logprobs names as such (here it would pass for a second synthetic EOS).
    unsupported = mask & (support == -1).all(dim=-1)
    extra = unsupported & (unsupported.long().cumsum(dim=1) >= 2)
    if not bool((orphan | extra).any()):
        return
    if bool(orphan.any()):
        b, s = (int(v) for v in orphan.nonzero()[0])
        where = (
            "a padding position" if not bool(attention[b, s]) else "the first token of its row (nothing predicts it)"
        )
        raise ReplayDataError(
            "loss_mask",
            f"loss-bearing token at {where}",
            trajectory=b,
            token=s,
            expected="loss only on tokens after the first valid token of the row",
        )
    b, s = (int(v) for v in extra.nonzero()[0])
    first = int(unsupported[b].nonzero()[0])
    raise ReplayDataError(
        "support_ids",
        f"second loss-bearing token without support (the first is at position {first})",
        trajectory=b,
        token=s,
        expected="support for every loss-bearing token but one synthetic EOS per trajectory",
    )


def _check_sub_sequences(lengths: Any, layout: TokenMetadataLayout) -> None:
    if lengths is None:
        return
    batch = layout.attention_mask.shape[0]
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__") or len(lengths) != batch:
        size = len(lengths) if hasattr(lengths, "__len__") else "?"
        raise ReplayDataError(
            "sub_sequence_lengths",
            f"got {type(lengths).__name__} of length {size}",
            expected=f"one entry per batch row ({batch})",
        )
    for b, entry in enumerate(lengths):
        row = list(entry) if hasattr(entry, "__len__") else [entry]
        if len(row) > 1:
            raise ReplayDataError(
                "sub_sequence_lengths",
                f"row holds {len(row)} controller-packed sub-sequences {row}",
                trajectory=b,
                expected="one trajectory per row: next-token targets, support rows and the synthetic-EOS fallback are "
                "per trajectory; unpack the rows (or let Megatron pack with packed=True layouts)",
            )
        if row and int(row[0]) != layout.sequence_lengths[b]:
            raise ReplayDataError(
                "sub_sequence_lengths",
                f"length {int(row[0])}",
                trajectory=b,
                expected=f"{layout.sequence_lengths[b]}, the row's valid tokens in attention_mask",
            )
