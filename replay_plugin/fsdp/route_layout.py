"""Routes for replay: validated in the caller's coordinates, then laid out like the model's tokens.

:func:`check_routes` checks ``[*tokens, L, K]`` routes against the model (``L`` decoder layers,
top-k ``K``, expert ids in range and distinct in every MoE layer, naming layer, trajectory and
token) in their compact dtype. :func:`to_model_layout` maps the batch grid ``[B, S, L, K]`` to
the layout the model sees: remove-padding (``unpad_input``'s indices), a
:class:`~replay_plugin.core.layout.TokenMetadataLayout` (packed or aligned rows), then the
Ulysses partition of dim 1. Positions without a route (padding added here) are marked in the
router padding mask, so the model routes them itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.errors import ReplayDataError, ReplayTypeError
from ..core.routes import as_signed_routes, check_route_sanity
from .moe_layers import MoeModel

__all__ = ["check_routes", "device_of", "to_model_layout"]


def _as_tensor(x: Any, field: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise ReplayTypeError(field, f"got {type(x).__name__}", expected="a numpy array or torch tensor")
    return x


def check_routes(routes: Any, mask: Any, scan: MoeModel) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validated routes (compact dtype kept) and bool mask, in the caller's coordinates."""
    r = _as_tensor(routes, "routes")
    if r.dtype == torch.bool or r.is_floating_point() or r.is_complex():
        raise ReplayTypeError("routes", f"dtype {r.dtype}", expected="integer expert ids (uint8, int16, int32, int64)")
    if r.dim() < 3 or r.shape[-2] != scan.num_layers or r.shape[-1] != scan.top_k:
        raise ReplayDataError(
            "routes",
            f"shape {tuple(r.shape)}",
            expected=f"[*tokens, {scan.num_layers}, {scan.top_k}]: config.num_hidden_layers decoder layers "
            f"(dense ones included, as vLLM returns them) and top-k {scan.top_k}",
        )
    m = None
    if mask is not None:
        m = _as_tensor(mask, "router_padding_mask")
        if m.dtype != torch.bool:
            # An integer mask is most likely an attention mask (1 = valid), the opposite of this
            # one: refuse rather than guess (as the Megatron driver does).
            raise ReplayTypeError(
                "router_padding_mask",
                f"dtype {m.dtype}",
                expected="bool, True = no recorded route (an attention mask means the opposite: pass ~mask.bool())",
            )
        if tuple(m.shape) != tuple(r.shape[:-2]):
            raise ReplayDataError(
                "router_padding_mask",
                f"shape {tuple(m.shape)}",
                expected=f"bool {list(r.shape[:-2])} (True = no recorded route: the model routes the token itself)",
            )
        m = m.to(device=r.device)
    # in the compact dtype (no int64 copy); one reduction on the fast path. uint16/32/64 (no
    # comparison kernels in torch on CPU) are widened to a signed dtype first.
    r = as_signed_routes(r)
    moe = r
    if len(scan.moe_layers) != r.shape[-2]:
        moe = r.index_select(r.dim() - 2, torch.tensor(scan.moe_layers, device=r.device))  # [*tokens, L_moe, K]
    if moe.dim() in (3, 4):  # [T, L, K] or [B, S, L, K]: trajectories the sanity check can name
        check_route_sanity(moe, None if m is None else ~m, layer_names=scan.moe_layers, num_experts=scan.num_experts)
    bad = (moe >= scan.num_experts).any(-1)
    if moe.dtype.is_signed:
        bad |= (moe < 0).any(-1)
    srt = moe.sort(dim=-1).values
    dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
    if m is not None:
        keep = ~m.unsqueeze(-1)
        bad, dup = bad & keep, dup & keep
    if not bool((bad | dup).any()):
        return r, m
    for problem, flags, expected in (
        ("expert id out of range", bad, f"ids in [0, {scan.num_experts})"),
        ("the same expert twice", dup, f"{scan.top_k} distinct experts per token and layer"),
    ):
        if bool(flags.any()):
            *where, j = (int(v) for v in flags.nonzero()[0])
            row = moe[tuple(where)][j].tolist()
            trajectory, token = (where[0], where[1]) if len(where) == 2 else (None, where[-1])
            raise ReplayDataError(
                "routes",
                f"{problem} in layer {scan.moe_layers[j]}: {row}",
                trajectory=trajectory,
                token=token,
                expected=expected,
            )
    return r, m


def to_model_layout(
    routes: torch.Tensor, mask: torch.Tensor | None, *, indices: Any, layout: Any, sp_group: Any, topk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the batch grid ``[B, S, L, K]`` to the layout the model sees: remove-padding
    (``indices``) or a :class:`~replay_plugin.core.layout.TokenMetadataLayout`, then the Ulysses
    slice of dim 1 (padded to a multiple of the SP size, one contiguous part per rank)."""
    if indices is not None and layout is not None:
        raise ReplayDataError("indices", "given together with layout", expected="one of indices= and layout=")
    if indices is not None or layout is not None:
        if routes.dim() != 4:
            raise ReplayDataError(
                "routes", f"shape {tuple(routes.shape)}", expected="[B, S, L, K] with indices=/layout="
            )
        if mask is None:
            mask = torch.zeros(routes.shape[:2], dtype=torch.bool, device=routes.device)
    pad_row = torch.arange(topk, dtype=routes.dtype, device=routes.device)
    if indices is not None:
        idx = _as_tensor(indices, "indices").to(routes.device).long().reshape(-1)
        batch, seq = routes.shape[:2]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= batch * seq):
            raise ReplayDataError("indices", f"values outside [0, {batch * seq})", expected="unpad_input's indices")
        routes = routes.reshape(batch * seq, *routes.shape[2:]).index_select(0, idx).unsqueeze(0)
        assert mask is not None
        mask = mask.reshape(-1).index_select(0, idx).unsqueeze(0)
    elif layout is not None:
        routes = layout.align(routes, pad_row)
        mask = layout.align(mask, True)
    if sp_group is not None:
        sp_size = torch.distributed.get_world_size(sp_group)
        sp_rank = torch.distributed.get_rank(sp_group)
        if sp_size > 1:
            if mask is None:
                mask = torch.zeros(routes.shape[:-2], dtype=torch.bool, device=routes.device)
            routes = _ulysses_slice(routes, sp_size, sp_rank, pad_row)
            mask = _ulysses_slice(mask, sp_size, sp_rank, torch.tensor(True, device=mask.device))
    return routes, mask


def _ulysses_slice(x: torch.Tensor, sp_size: int, sp_rank: int, fill: torch.Tensor) -> torch.Tensor:
    """Pad dim 1 to a multiple of ``sp_size`` with ``fill`` and keep part ``sp_rank`` (verl's and
    skyrl's ``ulysses_pad_and_slice_inputs`` partition)."""
    n = x.shape[1]
    part = -(-n // sp_size)
    padded = torch.empty((x.shape[0], part * sp_size, *x.shape[2:]), dtype=x.dtype, device=x.device)
    padded[:, n:] = fill
    padded[:, :n] = x
    return padded[:, sp_rank * part : (sp_rank + 1) * part].contiguous()


def device_of(model: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
