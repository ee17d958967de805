"""What verl's engines (FSDP and Megatron, verl 0.9.1) hand a micro-batch, read the way verl reads
it: the jagged ``input_ids`` ``[b, j]`` of its no-padding mode, the response of each sequence
(its last ``R_b`` tokens), response-aligned fields (``[B, R, ...]`` dense or ``[b, r_b, ...]``
jagged from the TransferQueue), non-tensor flags, and errors re-worded in verl's terms (the batch
field, the micro-batch row and its ``uid``, the token's index within its response).

Shared by the engine patches (``fsdp_engine``, ``megatron_engine``, ``megatron_r3_layout``);
imports verl only inside functions that are handed verl's objects.

The checks both engines make of a micro-batch with support rows live here, so that one rule holds
for both (issue 41): the rows are signed integers that fit the int32 rows the engines score (an
int64 id of ``2**32 + 5`` narrowed to int32 would read as token 5), every loss-bearing response
token has a support row (verl has no synthetic EOS: a token without support would be scored over
the full vocabulary or not at all), a per-sample temperature is finite and positive (dividing by
a negative one inverts that sample's logits), and a nested field is jagged (verl's and the
TransferQueue's layout; a strided nested tensor has no offsets).

So does the one rule for routed-expert replay (R3) on both engines (issue 41 F7): with
``router_replay.mode=R3`` a sequence none of whose positions scoring a loss-bearing token has a
captured route (``routed_experts`` rows all zero, which verl's agent loop leaves for tokens it did
not capture) is refused, naming the field, the row, its uid and the rollout setting
(:func:`check_captured`); a partial capture is counted and warned once per process. The FSDP
engine's plugin replay routes such rows by the model (R3 would be a no-op), verl's own Megatron R3
replays them as a ``[0, 0, ...]`` route (expert 0 alone). All-zero means "not captured" only for a
top-k >= 2 model, whose real routes never repeat an expert; a top-1 model's ``[0]`` row is a valid
route to expert 0 and cannot be told apart (:func:`uncaptured_rows`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..core.errors import ReplayDataError, ReplayTypeError
from .switch import BATCH_SUPPORT_KEY

#: the plugin's field names of a scoring error -> the verl batch field they come from
VERL_FIELDS = {"support_ids": BATCH_SUPPORT_KEY, "loss_mask": "loss_mask", "input_ids": "responses"}

#: the largest support id the engines' int32 rows hold (the Megatron adapter narrows to int32)
MAX_ID = 2**31 - 1

#: verl's batch field of the rollout's routed experts (``[b, j, L, K]`` jagged like input_ids)
BATCH_ROUTES_KEY = "routed_experts"

log = logging.getLogger("replay_plugin")


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
    of one value per sample), or None when its samples differ (the caller divides per position).
    A tensor is checked first (:func:`check_temperatures`); a number is checked where it is used
    (``core.inputs.check_temperature``)."""
    import torch

    t = micro_batch["temperature"]
    if not isinstance(t, torch.Tensor):
        return float(t)
    check_temperatures(micro_batch)
    t = t.detach().float().reshape(-1)
    if t.numel() and bool((t == t[0]).all()):
        return float(t[0])
    return None


def check_temperatures(micro_batch: Any) -> None:
    """Refuse a per-sample ``temperature`` tensor holding a value that is not finite and > 0,
    naming the sample. The scalar path refuses the same values (``check_temperature``); verl's own
    ``_scale_logits_by_temperature`` clamps to 1e-8 instead, which is no sampling temperature
    either: the rows were recorded at the rollout's temperature."""
    import torch

    t = micro_batch["temperature"] if "temperature" in micro_batch.keys() else None
    if not isinstance(t, torch.Tensor):
        return
    values = t.detach().reshape(-1)
    if values.is_floating_point():
        bad = ~torch.isfinite(values) | (values <= 0)
    else:
        bad = values <= 0
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise in_verl_terms(
            ReplayDataError("temperature", f"sample {b} has temperature {float(values[b])!r}"),
            micro_batch, b, None, expected="a finite sampling temperature > 0 for every sample",
        )  # fmt: skip


def batch_grid(input_ids: Any) -> tuple[Any, Any, Any, Any]:
    """``(ids [B, S] long, mask [B, S] bool, indices [nnz], lengths [B])`` of verl's jagged
    ``input_ids`` ``[b, j]``: each sequence left-justified in a ``[B, S]`` grid (``S`` the longest;
    the layout of verl's padded branch), ``indices`` its valid positions row-major, which is the
    order of ``input_ids.values()`` (the packed ``[1, nnz]`` of the remove-padding branch)."""
    import torch

    if not isinstance(input_ids, torch.Tensor) or not input_ids.is_nested:
        raise ReplayDataError("input_ids", f"got {type(input_ids).__name__}", expected="verl's jagged [b, j] input_ids")
    check_jagged(input_ids, "input_ids")
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


def check_jagged(field: Any, name: str) -> None:
    """A nested tensor must be jagged (``layout=torch.jagged``: verl's nesting and the
    TransferQueue's); a strided one has no offsets to read the sequences by."""
    import torch

    if field.is_nested and field.layout != torch.jagged:
        raise ReplayDataError(
            name, f"a nested tensor of layout {field.layout} (strided)",
            expected="the jagged layout verl builds (torch.nested.as_nested_tensor(rows, layout=torch.jagged)) or a "
            "dense padded tensor",
        )  # fmt: skip


def response_rows(field: Any, lengths: Any, fill: int, name: str) -> Any:
    """``[B, R, ...]`` response-aligned rows (left-aligned, padded with ``fill``) of a jagged
    ``[b, r_b, ...]`` or dense ``[B, R, ...]`` field, checked against the response lengths."""
    import torch

    if not isinstance(field, torch.Tensor):
        raise ReplayTypeError(name, f"got {type(field).__name__}", expected="a torch tensor, dense or jagged")
    check_jagged(field, name)
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


def check_batch_rows(data: Any) -> None:
    """The support rows of a whole batch, before verl chunks it into micro-batches: a tensor, dense
    or jagged, a jagged one with one row per response token of each sample (named by its batch row
    and uid). verl 0.9.1 splits nested tensors with ``tu.chunk_tensordict``, which crashes (an
    untyped RuntimeError) on rows whose lengths are not the responses'; a strided nested tensor
    reaches the engine as such a jagged one, re-nested over its row width by
    ``BatchData.chunk`` (``chunk_tensordict``: ``ragged_idx`` defaults to the last dimension)."""
    import torch

    field = data[BATCH_SUPPORT_KEY]
    if not isinstance(field, torch.Tensor):
        raise ReplayTypeError(
            BATCH_SUPPORT_KEY, f"got {type(field).__name__}", expected="a torch tensor, dense or jagged"
        )
    check_jagged(field, BATCH_SUPPORT_KEY)
    if not field.is_nested:
        return
    batch = int(data.batch_size[0]) if len(data.batch_size) else int(field.size(0))
    response = response_lengths(data, batch)
    got = field.offsets().diff().to(response.device)
    bad = (got != response).nonzero() if got.shape == response.shape else torch.zeros(1, 1, dtype=torch.long)
    if bad.numel():
        b = int(bad[0, 0])
        raise in_verl_terms(
            ReplayDataError(BATCH_SUPPORT_KEY, f"{int(got[b])} rows for a response of {int(response[b])} tokens"),
            data, b, None, unit="batch",
            expected="one row per response token, jagged ([b, r_b, W]: torch.nested.as_nested_tensor(rows, "
            "layout=torch.jagged)) or dense [B, R, W]; a strided nested tensor reaches the engine re-nested over its "
            "row width by verl's BatchData.chunk",
        )  # fmt: skip


def response_support(micro_batch: Any, lengths: Any) -> tuple[Any, Any, Any]:
    """``(response [B], support [B, R, W], loss [B, R] bool)`` of a micro-batch whose sequences
    have ``lengths`` tokens: each response's length (checked to leave a prompt), its support rows
    (signed integers, ``-1`` padded; :data:`BATCH_SUPPORT_KEY`) and its loss mask, response-aligned.

    Refused here, for both engines and before any compute (the batch is the same on every
    tensor-, context- and sequence-parallel rank, so all of them refuse together), naming the
    micro-batch row, its uid and the response token: a per-sample temperature that is not finite
    and > 0; an id that no int32 row holds (< -1 or >= 2**31: narrowing would wrap it into another
    id); a loss-bearing response token whose row is all -1. The rest of the rows' checks (ids
    inside the vocabulary, distinct, the token a member of its row) are the scoring's."""
    import torch

    from ..core.inputs import as_mask, check_support_dtype

    check_temperatures(micro_batch)
    response = response_lengths(micro_batch, int(lengths.numel())).to(lengths.device)
    check_prompts(response, lengths)
    support = response_rows(micro_batch[BATCH_SUPPORT_KEY], response, -1, BATCH_SUPPORT_KEY)
    if support.dim() != 3 or support.shape[-1] < 1:
        raise ReplayDataError(
            BATCH_SUPPORT_KEY, f"shape {tuple(support.shape)}", expected="[B, R, W >= 1] (jagged [b, r_b, W])"
        )
    check_support_dtype(support.dtype, BATCH_SUPPORT_KEY)
    loss = as_mask(response_rows(micro_batch["loss_mask"], response, 0, "loss_mask"), "loss_mask")
    r_max = int(response.max())
    rows, bears = support[:, :r_max], loss[:, :r_max].to(support.device)
    if support.dtype == torch.int64:  # the only signed dtype wider than the engines' int32 rows
        wide = ((rows < -1) | (rows > MAX_ID)).any(dim=-1)
        if bool(wide.any()):
            b, t = (int(v) for v in wide.nonzero()[0])
            bad = rows[b, t][(rows[b, t] < -1) | (rows[b, t] > MAX_ID)]
            raise in_verl_terms(
                ReplayDataError(
                    BATCH_SUPPORT_KEY,
                    f"row of response token {t} holds id {int(bad[0])}, which is no token id (int32 rows would read it "
                    f"as {int(bad[0].to(torch.int32))})",
                ),
                micro_batch, b, t, expected=f"token ids in [0, {MAX_ID}) and -1 padding",
            )  # fmt: skip
    unsupported = bears & (rows == -1).all(dim=-1)
    if bool(unsupported.any()):
        b, t = (int(v) for v in unsupported.nonzero()[0])
        count = int(unsupported[b].sum())
        others = f" (and {count - 1} more in this sample)" if count > 1 else ""
        raise in_verl_terms(
            ReplayDataError(
                BATCH_SUPPORT_KEY,
                f"response token {t} is loss-bearing but its support row is all -1{others}: verl has no synthetic EOS, "
                "so a token without the sampler's support would be scored over the full vocabulary, not the set it "
                "was drawn from (a turn the rollout did not opt in, e.g. greedy: temperature 0 or top_k 1)",
            ),
            micro_batch, b, t,
            expected="a support row for every loss-bearing response token, or response_mask 0 for a token without one",
        )  # fmt: skip
    return response, support, loss


def in_verl_terms(
    exc: ReplayDataError,
    micro_batch: Any,
    row: int,
    token: int | None,
    *,
    expected: str | None = None,
    unit: str = "micro-batch",
) -> ReplayDataError:
    """``exc`` (raised on the plugin's own layout) about micro-batch row ``row`` (of the engine's
    whole batch with ``unit="batch"``), response token ``token``: the verl batch field, the row and
    its ``uid``."""
    field = VERL_FIELDS.get(exc.field, exc.field)
    uid = non_tensor(micro_batch, "uid", None)
    where = f"{unit} row {row}"
    if uid is not None and len(uid) > row:
        where += f", uid {getattr(uid[row], 'data', uid[row])}"
    problem = str(exc).split(": ", 1)[-1]
    return ReplayDataError(field, f"{problem} [{where}]", trajectory=row, token=token, expected=expected)


# --------------------------------------------------------------------------- routed experts (R3)


def per_token_rows(micro_batch: Any, key: str, indices: Any, lengths: Any) -> Any:
    """``[nnz, ...]`` rows of a per-token field (one row per token of ``input_ids``): jagged like
    ``input_ids`` (verl's nesting; each sequence's rows checked against its length) or dense
    ``[B, S_pad, ...]`` next to ``attention_mask``."""
    import torch

    field = micro_batch[key]
    nnz = int(indices.numel())
    if not isinstance(field, torch.Tensor):
        raise ReplayTypeError(key, f"got {type(field).__name__}", expected="a torch tensor, jagged like input_ids")
    check_jagged(field, key)
    if field.is_nested:
        got = field.offsets().diff().to(lengths.device)
        if got.shape != lengths.shape:
            raise ReplayDataError(key, f"{got.numel()} sequences", expected=f"{lengths.numel()} like input_ids")
        bad = (got != lengths).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            raise ReplayDataError(
                key, f"{int(got[b])} rows for a sequence of {int(lengths[b])} tokens", trajectory=b,
                expected="one row per token of input_ids",
            )  # fmt: skip
        rows = field.values()
    elif "attention_mask" in micro_batch.keys() and not micro_batch["attention_mask"].is_nested:
        attention = micro_batch["attention_mask"]
        if field.dim() < 2 or tuple(field.shape[:2]) != tuple(attention.shape):
            raise ReplayDataError(
                key, f"dense shape {tuple(field.shape)}",
                expected=f"[{attention.shape[0]}, {attention.shape[1]}, ...]: one row per position of attention_mask "
                f"{list(attention.shape)} (or jagged like input_ids)",
            )  # fmt: skip
        rows = field[attention.bool()]
    else:
        raise ReplayDataError(
            key, f"dense shape {tuple(field.shape)} without a dense attention_mask", expected="jagged"
        )
    if rows.shape[0] != nnz:
        raise ReplayDataError(key, f"{rows.shape[0]} rows for {nnz} tokens", expected="one row per token of input_ids")
    return rows.to(indices.device) if isinstance(rows, torch.Tensor) else rows


def uncaptured_rows(routes: Any) -> Any:
    """``[...]`` bool of ``routes [..., L, K]``: the rows that are all zero, which mean "not
    captured" (verl's agent loop fills them for tokens without a route). Only a top-k >= 2 model
    can be told: its real rows never repeat an expert; a top-1 model's ``[0]`` is a valid route to
    expert 0, so nothing counts as uncaptured there (K == 1: all False)."""
    import torch

    if routes.shape[-1] < 2:
        return torch.zeros(routes.shape[:-2], dtype=torch.bool, device=routes.device)
    return ~routes.flatten(-2).any(-1)  # a reduction: no temporary the size of the routes


def loss_positions(micro_batch: Any, mask: Any, lengths: Any) -> Any:
    """``[B, S]`` bool: the grid positions whose output scores a loss-bearing response token (the
    position before it); without a loss mask in the micro-batch, every position the engine ran
    that predicts a token (all but each sequence's last)."""
    import torch

    from ..core.inputs import as_mask

    batch, seq = mask.shape
    device = mask.device
    keys = micro_batch.keys()
    if "loss_mask" not in keys or "responses" not in keys:
        scoring = mask.clone()
        scoring[torch.arange(batch, device=device), lengths - 1] = False
        return scoring
    response = response_lengths(micro_batch, batch).to(device)
    check_prompts(response, lengths)
    loss = as_mask(response_rows(micro_batch["loss_mask"], response, 0, "loss_mask"), "loss_mask")
    r_max = int(response.max())
    t = torch.arange(r_max, device=device)
    inside = t[None, :] < response[:, None]
    columns = ((lengths - response)[:, None] + t[None, :])[inside]
    rows_of = torch.arange(batch, device=device)[:, None].expand(batch, r_max)[inside]
    scoring = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    scoring[rows_of, columns - 1] = loss[:, :r_max].to(device)[inside]
    return scoring


#: the patches that have warned of a partial capture in this process (once each)
_WARNED_PARTIAL: set[str] = set()


def check_captured(
    batch: Any, no_route: Any, mask: Any, lengths: Any, *, patch: str, fate: str, unit: str = "micro-batch"
) -> tuple[int, int]:
    """Refuse a sequence of an R3 batch none of whose positions that score a loss-bearing token
    carries a captured route (``no_route [B, S]``: True where there is none, e.g.
    :func:`uncaptured_rows`): R3 was asked for and would not replay the rollout there (verl's
    FSDP engine with the plugin: a no-op, measured in issue 41 as route agreement equal to no
    replay; verl's own Megatron R3: every token on expert 0 alone). The likely cause is a rollout
    that returned no routes. Returns ``(replayed, scoring)`` counts, logged per call at debug
    level; a partial capture is warned once per process and ``patch``. ``fate`` says what the engine
    does with uncaptured rows (a verb phrase: "are routed by the model itself"), ``unit`` what a row
    is a row of ("micro-batch", or "batch" before verl splits it)."""
    import torch

    scoring = loss_positions(batch, mask, lengths)
    replayed = scoring & ~no_route
    missing = scoring.any(dim=1) & ~replayed.any(dim=1)
    counts = torch.stack([replayed.sum(), scoring.sum(), missing.long().argmax(), missing.any().long()])
    n_replayed, n_scoring, first, refuse = counts.tolist()  # one host sync
    if refuse:
        raise in_verl_terms(
            ReplayDataError(
                BATCH_ROUTES_KEY,
                f"router_replay.mode=R3, but none of the {int(scoring[first].sum())} positions scoring this sequence's "
                f"loss-bearing tokens has a captured route (all-zero rows mean not captured; such rows {fate}): R3 "
                "would replay none of the rollout's routes for it. The rollout most likely returned no routes",
            ),
            batch, first, None, unit=unit,
            expected="the rollout's routed experts: actor_rollout_ref.rollout.enable_rollout_routing_replay=true "
            "(vLLM's enable_return_routed_experts), or router_replay.mode=disabled",
        )  # fmt: skip
    log.debug("%s: %d of %d positions scoring loss-bearing tokens replayed", patch, n_replayed, n_scoring)
    if n_replayed < n_scoring and patch not in _WARNED_PARTIAL:
        _WARNED_PARTIAL.add(patch)
        log.warning(
            "%s: %d of %d positions scoring loss-bearing tokens have no captured route (all-zero rows); such rows "
            "%s; logged once per process",
            patch,
            n_scoring - n_replayed,
            n_scoring,
            fate,
        )
    return n_replayed, n_scoring
