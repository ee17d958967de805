"""Routed experts (R3): compact per-trajectory arrays, batch padding, per-stage replay data.

Per trajectory the engine returns ``[T_captured, L, K]`` expert ids for its first
``T_captured`` valid tokens. Routes stay in a compact dtype (uint8 / int16 / int32, the
narrowest that holds every id); only a pipeline stage's own layers are widened to int32, at the
very end (:func:`local_replay_data`). A padding row is the dummy route ``[0..K-1]`` (K distinct
experts keep Megatron's dropless invariant), marked True in the router padding mask ``[B, S]``:
it is a placeholder, never a replayed route. numpy only at import; torch inside the functions
that return tensors.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError, RouteSanityWarning

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROUTE_DTYPES",
    "TrajectoryRoutes",
    "compact",
    "RouteGap",
    "uncaptured_route",
    "padding_rows",
    "pad_batch",
    "select_layers",
    "split_for_replay",
    "local_replay_data",
    "check_route_sanity",
    "as_signed_routes",
]

#: The compact route dtypes, narrowest first.
ROUTE_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.int32))
# Largest expert id each compact dtype holds (int16/int32 keep the sign bit unused so that a
# torch conversion never sees a value it could read as negative).
_ROUTE_MAX = {np.dtype(np.uint8): 2**8 - 1, np.dtype(np.int16): 2**15 - 1, np.dtype(np.int32): 2**31 - 1}

ArrayLike = Union[np.ndarray, "torch.Tensor"]


@dataclasses.dataclass(frozen=True, eq=False)
class TrajectoryRoutes:
    """One trajectory's routes over all its tokens, with the rows that carry no route.

    Attributes:
        routes: ``[T, L, K]`` compact dtype; rows where ``router_padding_mask`` is True are
            padding rows ``[0..K-1]``.
        router_padding_mask: ``[T]`` bool, True where the engine captured no route.

    :func:`pad_batch` takes these as well as plain captured-prefix arrays.
    """

    routes: np.ndarray
    router_padding_mask: np.ndarray

    @property
    def captured_rows(self) -> int:
        """Number of rows with a captured route."""
        return int(np.count_nonzero(~self.router_padding_mask))


# ---------------------------------------------------------------------------------------
# helpers


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "device")


def _host_array(arr: Any, field: str, trajectory: int | None = None) -> np.ndarray:
    """numpy view of a numpy array or a (possibly CUDA) tensor; lists are refused."""
    if isinstance(arr, np.ndarray):
        return arr
    if _is_tensor(arr):
        host: np.ndarray = arr.detach().cpu().numpy()
        return host
    raise ReplayTypeError(
        field,
        f"got {type(arr).__name__}",
        trajectory=trajectory,
        expected="a numpy array or torch tensor [tokens, layers, topk]",
    )


def _compact_dtype(max_id: int) -> np.dtype:
    for dtype in ROUTE_DTYPES:
        if max_id <= _ROUTE_MAX[dtype]:
            return dtype
    raise AssertionError("unreachable")  # pragma: no cover - callers check < 2**31 first


def _check_route_values(a: np.ndarray, field: str, trajectory: int | None) -> int:
    """Validate dtype and range of expert ids; return the maximum id (0 when empty)."""
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ReplayTypeError(
            field, f"dtype {a.dtype} holds no expert ids", trajectory=trajectory, expected="an integer dtype"
        )
    if a.size == 0:
        return 0
    lo, hi = a.min(), a.max()
    if lo < 0:
        bad = int(np.argmax(a.reshape(a.shape[0], -1).min(axis=1) < 0))
        raise ReplayDataError(
            field, f"negative expert id {int(lo)}", trajectory=trajectory, token=bad, expected="ids >= 0"
        )
    if hi >= 2**31:
        bad = int(np.argmax(a.reshape(a.shape[0], -1).max(axis=1) >= 2**31))
        raise ReplayDataError(
            field, f"expert id {int(hi)} does not fit int32", trajectory=trajectory, token=bad, expected="ids < 2**31"
        )
    return int(hi)


def _check_int(value: Any, field: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ReplayTypeError(field, f"got {type(value).__name__}", expected="an int")
    if value < minimum:
        raise ReplayDataError(field, f"got {value}", expected=f">= {minimum}")
    return int(value)


# ---------------------------------------------------------------------------------------
# compact arrays


def compact(arr: ArrayLike, *, trajectory: int | None = None) -> np.ndarray:
    """Routes ``[T, L, K]`` in the smallest safe dtype, C-contiguous.

    Args:
        arr: ``[T, L, K]`` non-negative integer expert ids; a numpy array or a torch tensor
            (moved to the host). Lists are refused (their dtype would be a guess).
        trajectory: index used in error messages.

    Returns:
        ``[T, L, K]`` uint8 (max id < 2**8), int16 (< 2**15) or int32 (< 2**31),
        C-contiguous. When ``arr`` already is exactly that, it is returned as is (no copy,
        same writeability); otherwise a new array.

    Raises:
        ReplayTypeError: not an array; bool or float dtype.
        ReplayDataError: ndim != 3; a negative id; an id >= 2**31 (names the token).
    """
    a = _host_array(arr, "routed_experts", trajectory)
    if a.ndim != 3:
        raise ReplayDataError(
            "routed_experts", f"shape {a.shape}", trajectory=trajectory, expected="[tokens, layers, topk]"
        )
    dtype = _compact_dtype(_check_route_values(a, "routed_experts", trajectory))
    if a.dtype == dtype and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class RouteGap:
    """The first route row of an engine's routes that no router can have chosen.

    Attributes:
        token: row index in the routes (``[T, L, K]``'s first axis).
        layer: layer index (second axis).
        row: the row's expert ids.
        all_zero: every row of every layer is expert 0 (nothing was captured at all).
    """

    token: int
    layer: int
    row: tuple[int, ...]
    all_zero: bool


def uncaptured_route(routes: np.ndarray) -> RouteGap | None:
    """The first row of engine routes ``[T, L, K]`` that names an expert twice, where top-k >= 2.

    A router's top-k experts of a token are distinct, so such a row was never chosen by a router:
    the engine's capture buffer (zero-filled) was not written for it, e.g. by a MoE kernel that
    bypasses the router's capture hook (vLLM #54730). Layers whose every row is all expert 0 are
    taken for dense (MLP) layers, whose rows the engine leaves zero, as long as another layer holds
    captured routes; when every layer is all zero the routes are refused (a model has at least one
    MoE layer). Vectorised (one sort along K); None when nothing is wrong, for top-k < 2 (nothing
    to see) and for empty routes.

    Args:
        routes: ``[T, L, K]`` integer expert ids (as :func:`compact` returns them).
    """
    if routes.ndim != 3 or routes.shape[2] < 2 or routes.size == 0:
        return None
    srt = np.sort(routes, axis=2)
    dup = (srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2)  # [T, L]
    if not dup.any():
        return None
    zero_layer = ~np.asarray(routes.any(axis=(0, 2)))  # [L]: no nonzero id in the layer
    all_zero = bool(zero_layer.all())
    if not all_zero:
        dup &= ~zero_layer[None, :]
        if not dup.any():
            return None
    token, layer = (int(i) for i in np.unravel_index(int(np.argmax(dup)), dup.shape))
    return RouteGap(token, layer, tuple(int(e) for e in routes[token, layer]), all_zero)


def padding_rows(n: int, num_layers: int, topk: int, dtype: Any = np.uint8) -> np.ndarray:
    """``n`` padding rows: ``[n, num_layers, topk]`` with every row ``[0, 1, ..., topk-1]``.

    Args:
        n, num_layers, topk: non-negative sizes.
        dtype: a route dtype (uint8, int16, int32) that can hold ``topk - 1``.

    Returns:
        A new, writable, C-contiguous ``[n, num_layers, topk]`` array of ``dtype``.

    Raises:
        ReplayTypeError: a size that is not an int; a dtype outside the route dtypes.
        ReplayDataError: a negative size; ``topk - 1`` does not fit ``dtype``.
    """
    n = _check_int(n, "n")
    num_layers = _check_int(num_layers, "num_layers")
    topk = _check_int(topk, "topk")
    dt = np.dtype(dtype)
    if dt not in _ROUTE_MAX:
        raise ReplayTypeError("dtype", f"got {dt}", expected="uint8, int16 or int32")
    if topk - 1 > _ROUTE_MAX[dt]:
        raise ReplayDataError("topk", f"{topk} dummy experts do not fit {dt}", expected="a wider dtype")
    out = np.empty((n, num_layers, topk), dtype=dt)
    out[...] = np.arange(topk, dtype=dt)
    return out


def _mask_host(attention_mask: Any) -> np.ndarray:
    if _is_tensor(attention_mask):
        attention_mask = attention_mask.detach().cpu().numpy()
    if not isinstance(attention_mask, np.ndarray):
        raise ReplayTypeError(
            "attention_mask", f"got {type(attention_mask).__name__}", expected="a [batch, seq] array or tensor"
        )
    if attention_mask.ndim != 2:
        raise ReplayDataError("attention_mask", f"shape {attention_mask.shape}", expected="[batch, seq]")
    if attention_mask.dtype == np.bool_:
        return attention_mask
    if not np.issubdtype(attention_mask.dtype, np.integer):
        raise ReplayTypeError("attention_mask", f"dtype {attention_mask.dtype}", expected="bool or 0/1 integers")
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bad.any():
        b, s = np.argwhere(bad)[0]
        raise ReplayDataError(
            "attention_mask", f"value {attention_mask[b, s]}", trajectory=int(b), token=int(s), expected="0 or 1"
        )
    return attention_mask.astype(bool)


def pad_batch(
    route_arrays: Sequence[ArrayLike | TrajectoryRoutes],
    attention_mask: ArrayLike,
) -> tuple[np.ndarray, torch.Tensor]:
    """Batch ragged per-trajectory routes onto a padded ``[B, S]`` token grid.

    Trajectory ``i``'s rows go, in order, to the first ``len(rows)`` valid positions of
    ``attention_mask[i]`` (valid = True/1; a left-padded batch puts them at
    ``[S - len_i, S - len_i + rows)``). Every other position gets a padding row and True in
    the mask.

    Args:
        route_arrays: ``B`` entries, each either a captured-prefix array ``[T_i, L, K]``
            (numpy or tensor, any non-negative integer dtype; ``T_i`` may be 0) or a
            :class:`TrajectoryRoutes` (its mask is kept per token). All share ``[L, K]``.
        attention_mask: ``[B, S]`` bool or 0/1 (numpy or tensor).

    Returns:
        ``routes``: ``[B, S, L, K]`` numpy in the widest dtype among the inputs (uint8 <
        int16 < int32), widened further only if ``K - 1`` does not fit;
        ``router_padding_mask``: ``[B, S]`` bool torch tensor on the CPU, True where no
        captured route exists (padding, uncaptured suffix, rows a TrajectoryRoutes marks).

    Raises:
        ReplayTypeError / ReplayDataError: naming the trajectory, for more rows than valid
        tokens, mismatched ``[L, K]``, wrong ndim, invalid ids or a bad mask; also for a
        batch size that differs from ``len(route_arrays)`` or an empty batch.
    """
    import torch

    mask = _mask_host(attention_mask)
    if isinstance(route_arrays, (np.ndarray, str, bytes)) or _is_tensor(route_arrays):
        raise ReplayTypeError(
            "route_arrays", f"got {type(route_arrays).__name__}", expected="a sequence of per-trajectory arrays"
        )
    batch, seq = mask.shape
    if len(route_arrays) != batch:
        raise ReplayDataError(
            "route_arrays", f"{len(route_arrays)} trajectories for attention_mask of {batch} rows", expected=f"{batch}"
        )
    if batch == 0:
        raise ReplayDataError("route_arrays", "empty batch", expected="at least one trajectory (it fixes [L, K])")

    rows: list[np.ndarray] = []
    row_masks: list[np.ndarray | None] = []
    lk: tuple[int, int] | None = None
    widest = ROUTE_DTYPES[0]
    valid_counts = mask.sum(axis=1)
    for i, entry in enumerate(route_arrays):
        a, m = _trajectory_rows(entry, i, int(valid_counts[i]), lk)
        if lk is None:
            lk = (a.shape[1], a.shape[2])
        if a.dtype.itemsize > widest.itemsize:
            widest = a.dtype
        rows.append(a)
        row_masks.append(m)
    assert lk is not None
    num_layers, topk = lk
    while topk - 1 > _ROUTE_MAX[widest]:
        widest = ROUTE_DTYPES[ROUTE_DTYPES.index(widest) + 1]
    out, padding = _scatter_to_grid(rows, row_masks, mask, (num_layers, topk), widest)
    return out, torch.from_numpy(padding)


def _trajectory_rows(
    entry: ArrayLike | TrajectoryRoutes, i: int, valid_count: int, lk: tuple[int, int] | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Trajectory ``i``'s routes ``[T_i, L, K]`` on the host in a compact dtype, checked against
    its ``valid_count`` valid tokens and the batch's ``[L, K]`` (None for the first), and its
    per-row padding mask ``[T_i]`` (None for a plain array)."""
    if isinstance(entry, TrajectoryRoutes):
        a, m = _host_array(entry.routes, "routed_experts", i), np.asarray(entry.router_padding_mask)
        if m.dtype != np.bool_ or m.shape != a.shape[:1]:
            raise ReplayDataError(
                "router_padding_mask",
                f"shape {m.shape} dtype {m.dtype}",
                trajectory=i,
                expected=f"bool [{a.shape[0] if a.ndim else '?'}]",
            )
    else:
        a, m = _host_array(entry, "routed_experts", i), None
    if a.ndim != 3:
        raise ReplayDataError("routed_experts", f"shape {a.shape}", trajectory=i, expected="[tokens, layers, topk]")
    if lk is not None and a.shape[1:] != lk:
        raise ReplayDataError(
            "routed_experts", f"[L, K] = {list(a.shape[1:])}", trajectory=i, expected=f"{list(lk)} like trajectory 0"
        )
    if a.shape[0] > valid_count:
        raise ReplayDataError(
            "routed_experts",
            f"{a.shape[0]} route rows for {valid_count} valid tokens",
            trajectory=i,
            expected=f"at most {valid_count} rows",
        )
    if a.shape[0] < valid_count - 1:
        # vLLM routes every token it ran: the prompt and every generated token but the last,
        # P + T - 1 rows for P + T tokens. Fewer rows would leave valid tokens to the trainer's
        # own router without anyone saying so (the row-count mismatch of a truncated capture, or
        # of routes and tokens of different turns).
        raise ReplayDataError(
            "routed_experts",
            f"{a.shape[0]} route rows for {valid_count} valid tokens: tokens {a.shape[0]}..{valid_count - 2} would be "
            "routed by the trainer's own router",
            trajectory=i,
            expected=f"{valid_count - 1} rows (every valid token but the last, as vLLM returns them) or {valid_count}; "
            "rows without a recorded route (a synthetic EOS's source token, an uncaptured turn) belong in a "
            "TrajectoryRoutes whose router_padding_mask marks them",
        )
    if a.dtype not in _ROUTE_MAX:
        a = compact(a, trajectory=i)  # e.g. int64 from a caller: validate and narrow
    elif a.dtype != np.uint8:
        _check_route_values(a, "routed_experts", i)  # signed: rule out negative ids
    return a, m


def _scatter_to_grid(
    rows: list[np.ndarray],
    row_masks: list[np.ndarray | None],
    mask: np.ndarray,
    lk: tuple[int, int],
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """Routes ``[B, S, L, K]`` (``dtype``; the dummy route ``[0..K-1]`` where no row goes) and
    the padding mask bool ``[B, S]``: trajectory ``i``'s rows fill the first valid positions of
    ``mask[i]`` (bool ``[B, S]``) in order."""
    batch, seq = mask.shape
    num_layers, topk = lk
    out = np.empty((batch, seq, num_layers, topk), dtype=dtype)
    out[...] = np.arange(topk, dtype=dtype)
    padding = np.ones((batch, seq), dtype=bool)
    for i, (a, m) in enumerate(zip(rows, row_masks)):
        n = a.shape[0]
        if n == 0:
            continue
        positions = np.flatnonzero(mask[i])[:n]
        first = positions[0]
        if positions[-1] - first == n - 1:  # contiguous (the left-padded case): one slice copy
            out[i, first : first + n] = a
            padding[i, first : first + n] = False if m is None else m
        else:
            out[i, positions] = a
            padding[i, positions] = False if m is None else m
    return out, padding


# ---------------------------------------------------------------------------------------
# pipeline-stage replay data


def _layer_index_array(layer_indices: Any, num_layers: int) -> np.ndarray:
    if _is_tensor(layer_indices):
        layer_indices = layer_indices.detach().cpu().numpy()
    if isinstance(layer_indices, (str, bytes)) or not isinstance(layer_indices, (Sequence, np.ndarray, range)):
        raise ReplayTypeError(
            "layer_indices", f"got {type(layer_indices).__name__}", expected="a sequence of global layer indices"
        )
    idx = np.asarray(layer_indices)
    if idx.size == 0:
        idx = idx.astype(np.int64)
    if idx.ndim != 1 or idx.dtype == np.bool_ or not np.issubdtype(idx.dtype, np.integer):
        raise ReplayTypeError(
            "layer_indices", f"{idx.dtype} array of shape {idx.shape}", expected="a 1-D sequence of ints"
        )
    if idx.size:
        bad = (idx < 0) | (idx >= num_layers)
        if bad.any():
            raise ReplayDataError(
                "layer_indices",
                f"index {int(idx[bad][0])} out of range",
                expected=f"0 <= index < {num_layers} (the routes' layer count)",
            )
        if np.unique(idx).size != idx.size:
            raise ReplayDataError(
                "layer_indices", f"duplicates in {idx.tolist()}", expected="distinct layers (one per router)"
            )
    return idx.astype(np.int64, copy=False)


def _check_routes(routes: Any) -> None:
    if isinstance(routes, np.ndarray):
        ok = routes.dtype != np.bool_ and np.issubdtype(routes.dtype, np.integer)
    elif _is_tensor(routes):
        import torch

        ok = routes.dtype not in (torch.bool,) and not routes.dtype.is_floating_point and not routes.dtype.is_complex
    else:
        raise ReplayTypeError("routes", f"got {type(routes).__name__}", expected="a numpy array or torch tensor")
    if not ok:
        raise ReplayTypeError("routes", f"dtype {routes.dtype}", expected="integer expert ids")
    if routes.ndim not in (3, 4):
        raise ReplayDataError("routes", f"shape {tuple(routes.shape)}", expected="[tokens, L, K] or [batch, seq, L, K]")


def select_layers(routes: ArrayLike, layer_indices: Sequence[int] | ArrayLike) -> ArrayLike:
    """The layers of one pipeline stage, in the compact dtype.

    Args:
        routes: ``[B, S, L, K]`` or ``[T, L, K]`` (numpy or tensor, any device).
        layer_indices: ``[L_local]`` distinct global layer indices in ``[0, L)`` (the
            routers' global layer numbers minus one, in the order of the stage's routers).

    Returns:
        ``[B, S, L_local, K]`` / ``[T, L_local, K]``, same type, dtype and device as
        ``routes`` (a new array/tensor; the input is unchanged).

    Raises:
        ReplayTypeError / ReplayDataError: bad ``routes`` shape or dtype; an index out of
        range or repeated.
    """
    _check_routes(routes)
    idx = _layer_index_array(layer_indices, int(routes.shape[-2]))
    if isinstance(routes, np.ndarray):
        return np.take(routes, idx, axis=routes.ndim - 2)
    import torch

    return routes.index_select(routes.dim() - 2, torch.from_numpy(idx).to(routes.device))


def _as_torch(x: ArrayLike) -> torch.Tensor:
    import torch

    if isinstance(x, np.ndarray):
        with warnings.catch_warnings():
            # Read-only arrays (e.g. decoded from bytes) are only read here.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(x)
    return x


def _layers_first_int32(routes: torch.Tensor, layers: Sequence[int]) -> list[torch.Tensor]:
    """Copy ``routes[..., layer, :]`` for each layer into its own int32 ``[N, K]`` tensor.

    One allocation per layer, not views of one ``[L_local, N, K]`` block: Megatron keeps each
    layer's tensor in that router's backward FIFO until its recompute pops it, and a view would
    keep the whole block alive for as long as any one layer's entry is.
    """
    import torch

    k = routes.shape[-1]
    tokens = int(np.prod(routes.shape[:-2]))
    flat = routes.reshape(tokens, routes.shape[-2], k)
    out = []
    for layer in layers:
        t = torch.empty((tokens, k), dtype=torch.int32, device=routes.device)
        t.copy_(flat[:, layer, :])  # the only widening copy, one pass per local layer
        out.append(t)
    return out


def split_for_replay(routes_local: ArrayLike) -> list[torch.Tensor]:
    """Per-layer int32 replay data, as Megatron's ``RouterReplay.set_replay_data`` takes it.

    Args:
        routes_local: ``[B, T, L_local, K]`` or ``[T, L_local, K]`` expert ids of the local
            layers (numpy or tensor, any integer dtype, any device).

    Returns:
        ``L_local`` tensors ``[B*T, K]`` int32, each contiguous with its own storage, on the
        input's device.
    """
    _check_routes(routes_local)
    t = _as_torch(routes_local)
    return _layers_first_int32(t, range(int(t.shape[-2])))


def local_replay_data(routes: ArrayLike, layer_indices: Sequence[int] | ArrayLike) -> list[torch.Tensor]:
    """:func:`select_layers` + int32 + :func:`split_for_replay` in one pass.

    Only the selected layers are read and widened: no intermediate copy of the selection,
    and never an int32 copy of all ``L`` layers.

    Args:
        routes: ``[B, S, L, K]`` or ``[T, L, K]`` compact routes (numpy or tensor, any device).
        layer_indices: ``[L_local]`` distinct global layer indices of this stage's routers,
            in router order.

    Returns:
        ``L_local`` contiguous int32 tensors ``[B*S, K]`` (or ``[T, K]``), each with its own
        storage, on the device of ``routes``, entry ``j`` for global layer ``layer_indices[j]``.
    """
    _check_routes(routes)
    idx = _layer_index_array(layer_indices, int(routes.shape[-2]))
    return _layers_first_int32(_as_torch(routes), idx.tolist())


#: From this many valid tokens on, a layer that routes every one of them to the same experts is
#: reported (fewer can agree by chance in a small test batch).
CONSTANT_LAYER_MIN_TOKENS = 16
#: From this many (token, layer) rows on, a trajectory whose every row is the placeholder route
#: ``[0, 1, ..., K-1]`` is refused; below, reported. A real router picks that exact ordered tuple
#: with probability at most ``1 / (E (E - 1))`` per row (``K < E``; 1/6 for ``E = 3``), so 16 rows
#: of it happen by chance with probability below 1e-12.
PLACEHOLDER_MIN_ROWS = 16

_UNSIGNED_WIDE = ("torch.uint16", "torch.uint32", "torch.uint64")


def as_signed_routes(routes: torch.Tensor) -> torch.Tensor:
    """``routes`` in a dtype torch can compare: uint16 -> int32, uint32 / uint64 -> int64 (uint8
    and signed dtypes unchanged). torch 2.13 has no ``>=``, ``max`` or ``nonzero`` for uint16/32/64
    on CPU (``NotImplementedError: "ge_cpu" not implemented for 'UInt16'``), and the routes
    contract admits any integer dtype. A uint64 id of 2**63 or more reads as negative afterwards,
    which the range checks refuse."""
    import torch

    if str(routes.dtype) not in _UNSIGNED_WIDE:
        return routes
    return routes.to(torch.int32 if routes.dtype == torch.uint16 else torch.int64)


def check_route_sanity(
    routes: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    layer_names: Sequence[Any] | None = None,
    field: str = "routes",
    num_experts: int | None = None,
) -> None:
    """Refuse or report recorded routes that are well-formed but look broken, before replay.

    Failures users report from RL stacks (verl, SkyRL, vLLM issues): a MoE kernel that returns
    zeros where it recorded nothing, placeholder rows replayed as if recorded, and capture that
    repeats one token's routes for a whole batch. Checked on ``routes``' device with one host sync
    when nothing is found:

    - a trajectory whose every valid token has expert 0 in every slot of every layer: refused
      (``ReplayDataError`` naming the trajectory) when top-k >= 2, since a token's K experts are
      distinct; reported (``RouteSanityWarning``) when top-k is 1;
    - a trajectory whose every valid token has the placeholder route ``[0, 1, ..., K-1]`` (what
      :func:`pad_batch` writes where no route exists) in every layer, top-k >= 2: refused from
      :data:`PLACEHOLDER_MIN_ROWS` (token, layer) rows on, reported below. These are rows without
      a recorded route: mark them in the router padding mask so the model routes them itself;
    - a layer in which every valid token of the batch (at least
      :data:`CONSTANT_LAYER_MIN_TOKENS` of them) has the same set of experts: reported
      (``RouteSanityWarning`` naming the layer and the experts); a collapsed router does this too.

    With ``num_experts`` given and top-k >= ``num_experts``, every token necessarily routes to
    every expert: the placeholder and constant-layer checks are skipped.

    Args:
        routes: ``[B, S, L, K]`` (or ``[T, L, K]``: one trajectory) integer expert ids, any
            integer dtype.
        valid: ``[B, S]`` (``[T]``) **bool**, True = the row carries a recorded route (padding and
            placeholder rows are not checked); None = every row. An integer mask is refused: 0/1
            masks come in both polarities (an attention mask is 1 where a router padding mask,
            the negation of this, is 0).
        layer_names: per layer of ``routes``, how messages name it (default: its index).
        field: the argument name used in messages.
        num_experts: the model's number of routed experts, when known.

    Raises:
        ReplayTypeError: ``routes`` or ``valid`` not a tensor, ``routes`` not integer, ``valid``
            not bool.
        ReplayDataError: shapes that disagree; the refusals above.
    """
    import torch

    if not isinstance(routes, torch.Tensor):
        raise ReplayTypeError(field, f"got {type(routes).__name__}", expected="a torch tensor [B, S, L, K]")
    if routes.dtype == torch.bool or routes.is_floating_point() or routes.is_complex():
        raise ReplayTypeError(field, f"dtype {routes.dtype}", expected="integer expert ids")
    if routes.dim() not in (3, 4):
        raise ReplayDataError(field, f"shape {tuple(routes.shape)}", expected="[B, S, L, K] or [T, L, K]")
    one = routes.dim() == 3
    r = as_signed_routes(routes.unsqueeze(0) if one else routes)  # [B, S, L, K]
    b, s, layers, k = r.shape
    if valid is not None:
        if not isinstance(valid, torch.Tensor):
            raise ReplayTypeError("valid", f"got {type(valid).__name__}", expected="a bool tensor or None")
        if valid.dtype != torch.bool:
            raise ReplayTypeError(
                "valid",
                f"dtype {valid.dtype}",
                expected="bool, True = the row carries a recorded route (from a router padding mask: ~mask; "
                "from an attention mask: mask.bool())",
            )
        if valid.numel() != b * s:
            raise ReplayDataError(
                "valid", f"shape {tuple(valid.shape)}", expected=f"{list(r.shape[:2]) if not one else [s]}"
            )
    if r.numel() == 0:
        return
    v = torch.ones(b, s, dtype=torch.bool, device=r.device) if valid is None else valid.reshape(b, s).to(r.device)
    all_experts = num_experts is not None and k >= num_experts
    zero_rows = (r == 0).flatten(2).all(-1)  # [B, S]
    all_zero = (zero_rows | ~v).all(1) & v.any(1)  # [B]
    placeholder = torch.arange(k, dtype=r.dtype, device=r.device)
    placeholder_rows = (r == placeholder).flatten(2).all(-1)  # [B, S]
    all_placeholder = (placeholder_rows | ~v).all(1) & v.any(1) & ~all_zero  # [B] (K = 1: all-zero's case)
    if all_experts or k < 2:
        all_placeholder = torch.zeros_like(all_placeholder)
    flat = r.sort(dim=-1).values.reshape(b * s, layers, k)
    vflat = v.reshape(-1)
    first = flat[vflat.to(torch.uint8).argmax()]  # [L, K]: the first valid row (any row if none)
    differs = ((flat != first).any(-1) & vflat[:, None]).any(0)  # [L]
    constant = ~differs & (vflat.sum() >= CONSTANT_LAYER_MIN_TOKENS) & (not all_experts)
    found = torch.cat([all_zero, all_placeholder, constant])
    if not bool(found.any()):
        return
    names = list(layer_names) if layer_names is not None else list(range(layers))
    for traj in all_zero.nonzero().flatten().tolist():
        problem = (
            f"every recorded route of the trajectory is expert 0 ({int(v[traj].sum())} tokens x {layers} layers "
            f"x top-{k}): MoE kernels that return zeros where no route was recorded produce this"
        )
        if k >= 2:
            raise ReplayDataError(
                field,
                problem,
                trajectory=None if one else traj,
                expected=f"{k} distinct experts per token and layer, as the engine's router chose them",
            )
        where = "" if one else f"trajectory {traj}: "
        warnings.warn(f"replay_plugin: {field}: {where}{problem}", RouteSanityWarning, stacklevel=2)
    for traj in all_placeholder.nonzero().flatten().tolist():
        rows = int(v[traj].sum()) * layers
        problem = (
            f"every recorded route of the trajectory is the placeholder {placeholder.tolist()} ({int(v[traj].sum())} "
            f"tokens x {layers} layers), the route padding_rows/pad_batch write where no route exists"
        )
        if rows >= PLACEHOLDER_MIN_ROWS:
            raise ReplayDataError(
                field,
                problem,
                trajectory=None if one else traj,
                expected="the engine's routes, or True in the router padding mask on rows without a route (the model "
                "then routes them itself)",
            )
        where = "" if one else f"trajectory {traj}: "
        warnings.warn(f"replay_plugin: {field}: {where}{problem}", RouteSanityWarning, stacklevel=2)
    for j in constant.nonzero().flatten().tolist():
        experts = first[j].tolist()
        warnings.warn(
            f"replay_plugin: {field}: layer {names[j]} routes all {int(vflat.sum())} valid tokens of the batch to "
            f"experts {experts}: recorded routes repeated for a whole batch, or a collapsed router",
            RouteSanityWarning,
            stacklevel=2,
        )
