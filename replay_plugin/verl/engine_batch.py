"""What verl's engines (FSDP and Megatron, verl 0.9.1) hand a micro-batch, read the way verl reads
it: the jagged ``input_ids`` ``[b, j]`` of its no-padding mode, the response of each sequence
(its last ``R_b`` tokens), response-aligned fields (``[B, R, ...]`` dense or ``[b, r_b, ...]``
jagged from the TransferQueue), non-tensor flags, and errors re-worded in verl's terms (the batch
field, the micro-batch row and its ``uid``, the token's index within its response).

Shared by the engine patches (``fsdp_engine``, ``megatron_engine``); imports verl only inside
functions that are handed verl's objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.errors import ReplayDataError
from .switch import SUPPORT_KEY

#: the plugin's field names of a scoring error -> the verl batch field they come from
VERL_FIELDS = {"support_ids": SUPPORT_KEY, "loss_mask": "loss_mask", "input_ids": "responses"}


def non_tensor(data: Any, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


#: ``router_replay.mode`` values that switch router replay off (verl's default, and what Hydra
#: makes of a ``null``)
REPLAY_OFF = ("disabled", "None", "none")


def replay_mode(engine: Any) -> str:
    """The engine config's ``router_replay.mode`` (an object, or the plain mapping Hydra builds
    from a ``+...router_replay.mode=R3`` override); ``"disabled"`` when absent."""
    rr = getattr(getattr(engine, "engine_config", None), "router_replay", None)
    mode = rr.get("mode") if isinstance(rr, Mapping) else getattr(rr, "mode", None)
    return str(mode or "disabled")


def uniform_temperature(micro_batch: Any) -> float | None:
    """The micro-batch's one sampling temperature (verl's ``temperature``: a number, or a tensor
    of one value per sample), or None when its samples differ (the caller divides per position)."""
    import torch

    t = micro_batch["temperature"]
    if not isinstance(t, torch.Tensor):
        return float(t)
    t = t.detach().float().reshape(-1)
    if t.numel() and bool((t == t[0]).all()):
        return float(t[0])
    return None


def batch_grid(input_ids: Any) -> tuple[Any, Any, Any, Any]:
    """``(ids [B, S] long, mask [B, S] bool, indices [nnz], lengths [B])`` of verl's jagged
    ``input_ids`` ``[b, j]``: each sequence left-justified in a ``[B, S]`` grid (``S`` the longest;
    the layout of verl's padded branch), ``indices`` its valid positions row-major, which is the
    order of ``input_ids.values()`` (the packed ``[1, nnz]`` of the remove-padding branch)."""
    import torch

    if not isinstance(input_ids, torch.Tensor) or not input_ids.is_nested:
        raise ReplayDataError("input_ids", f"got {type(input_ids).__name__}", expected="verl's jagged [b, j] input_ids")
    lengths = input_ids.offsets().diff()
    values = input_ids.values()
    batch, seq = int(lengths.numel()), int(lengths.max())
    mask = torch.arange(seq, device=lengths.device)[None, :] < lengths[:, None]
    indices = mask.reshape(-1).nonzero().squeeze(1)
    ids = torch.zeros(batch * seq, dtype=torch.long, device=values.device)
    ids.index_copy_(0, indices.to(values.device), values.long())
    return ids.view(batch, seq), mask.to(values.device), indices.to(values.device), lengths.to(values.device)


def response_lengths(micro_batch: Any, batch: int) -> Any:
    """Response length of each sequence, as verl's ``no_padding_2_padding`` reads it."""
    keys = micro_batch.keys()
    responses = micro_batch["responses"] if "responses" in keys else None
    if responses is not None and responses.is_nested:
        return responses.offsets().diff()
    if responses is not None and "prompts" in keys and "attention_mask" in keys:
        prompt_width = micro_batch["prompts"].shape[1]
        return micro_batch["attention_mask"][:, prompt_width:].sum(dim=1)
    raise ReplayDataError(
        "responses", "missing (or dense without prompts and attention_mask)", expected=f"the {batch} responses"
    )


def check_prompts(response: Any, lengths: Any) -> None:
    """Every sequence holds at least one prompt token before its response (the first response
    token is scored at the last prompt position)."""
    short = (response.to(lengths.device) >= lengths).nonzero()
    if short.numel():
        b = int(short[0, 0])
        raise ReplayDataError(
            "responses", f"{int(response[b])} response tokens in a sequence of {int(lengths[b])}", trajectory=b,
            expected="a prompt of at least one token",
        )  # fmt: skip


def response_rows(field: Any, lengths: Any, fill: int, name: str) -> Any:
    """``[B, R, ...]`` response-aligned rows (left-aligned, padded with ``fill``) of a jagged
    ``[b, r_b, ...]`` or dense ``[B, R, ...]`` field, checked against the response lengths."""
    import torch

    if field.is_nested:
        got = field.offsets().diff().to(lengths.device)
        bad = (got != lengths).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            raise ReplayDataError(
                name, f"{int(got[b])} rows for a response of {int(lengths[b])} tokens", trajectory=b,
                expected="one row per response token",
            )  # fmt: skip
        return torch.nested.to_padded_tensor(field, fill)
    if field.dim() < 2 or field.shape[0] != lengths.numel() or field.shape[1] < int(lengths.max()):
        raise ReplayDataError(
            name,
            f"shape {tuple(field.shape)}",
            expected=f"[{lengths.numel()}, >= {int(lengths.max())}, ...] response-aligned like response_mask",
        )
    return field


def response_support(micro_batch: Any, lengths: Any) -> tuple[Any, Any, Any]:
    """``(response [B], support [B, R, W], loss [B, R] bool)`` of a micro-batch whose sequences
    have ``lengths`` tokens: each response's length (checked to leave a prompt), its support rows
    (signed integers, ``-1`` padded; :data:`SUPPORT_KEY`) and its loss mask, response-aligned."""
    from ..core.inputs import as_mask, check_support_dtype

    response = response_lengths(micro_batch, int(lengths.numel())).to(lengths.device)
    check_prompts(response, lengths)
    support = response_rows(micro_batch[SUPPORT_KEY], response, -1, SUPPORT_KEY)
    if support.dim() != 3:
        raise ReplayDataError(SUPPORT_KEY, f"shape {tuple(support.shape)}", expected="[B, R, W] (jagged [b, r_b, W])")
    check_support_dtype(support.dtype, SUPPORT_KEY)
    loss = as_mask(response_rows(micro_batch["loss_mask"], response, 0, "loss_mask"), "loss_mask")
    return response, support, loss


def in_verl_terms(exc: ReplayDataError, micro_batch: Any, row: int, token: int) -> ReplayDataError:
    """``exc`` (raised on the plugin's own layout) about micro-batch row ``row``, response token
    ``token``: the verl batch field, the row and its ``uid``."""
    field = VERL_FIELDS.get(exc.field, exc.field)
    uid = non_tensor(micro_batch, "uid", None)
    where = f"micro-batch row {row}"
    if uid is not None and len(uid) > row:
        where += f", uid {getattr(uid[row], 'data', uid[row])}"
    problem = str(exc).split(": ", 1)[-1]
    return ReplayDataError(field, f"{problem} [{where}]", trajectory=row, token=token)
