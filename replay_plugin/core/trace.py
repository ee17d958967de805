"""Token-aligned traces that accumulate per-token metadata across the turns of a trajectory.

Each engine call of a multi-turn trajectory returns metadata for some of its tokens; a trace
appends them in token order and checks every call's row count, so the final array lines up with
the trajectory's tokens. :class:`TokenMetadataTrace` holds rows of a fixed schema;
:class:`RoutedExpertTrace` holds routed experts across turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.routes import ROUTE_DTYPES, TrajectoryRoutes, compact

__all__ = ["TokenMetadataTrace", "RoutedExpertTrace"]


def _count(value: Any, field: str, trajectory: int | None, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ReplayTypeError(field, f"got {type(value).__name__}", trajectory=trajectory, expected="an int")
    if value < minimum:
        raise ReplayDataError(field, f"got {value}", trajectory=trajectory, expected=f">= {minimum}")
    return int(value)


class TokenMetadataTrace:
    """Accumulates ``[rows, *row_shape]`` chunks of one schema across turns.

    The first :meth:`append` fixes the schema: ``row_shape`` and dtype (with
    ``promote_dtypes=True`` only ``row_shape``; :meth:`finalize` then casts every chunk to
    ``np.result_type`` of all chunks, for dtypes that widen across turns like compact
    routes). Each chunk is copied on append, so later changes to the caller's array do not
    leak in.

    Args:
        field: name used in error messages (e.g. ``"routed_experts"``).
        trajectory: trajectory index used in error messages.
        promote_dtypes: allow chunks of different dtypes (see above).
    """

    def __init__(self, field: str = "rows", *, trajectory: int | None = None, promote_dtypes: bool = False) -> None:
        self.field = field
        self.trajectory = trajectory
        self.promote_dtypes = promote_dtypes
        self._chunks: list[np.ndarray] = []
        self._rows = 0
        self._row_shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None
        self._finalized = False

    @property
    def num_rows(self) -> int:
        """Rows appended so far (the token index the next chunk starts at)."""
        return self._rows

    @property
    def finalized(self) -> bool:
        """Whether :meth:`finalize` has run."""
        return self._finalized

    def _live(self, action: str) -> None:
        if self._finalized:
            raise RuntimeError(f"{self.field} trace (trajectory {self.trajectory}): {action} after finalize()")

    def append(self, rows: np.ndarray, *, expected_rows: int) -> None:
        """Append one turn's rows.

        Args:
            rows: ``[expected_rows, *row_shape]`` numpy array (copied; any strides).
            expected_rows: how many rows this turn must contribute (0 allowed).

        Raises:
            ReplayTypeError: ``rows`` not a numpy array; a dtype that differs from the
                first chunk's (without ``promote_dtypes``).
            ReplayDataError: wrong row count (names the token the chunk starts at), a
                ``row_shape`` that differs from the first chunk's, a 0-d array.
            RuntimeError: after :meth:`finalize`.
        """
        self._live("append()")
        expected_rows = _count(expected_rows, "expected_rows", self.trajectory)
        if not isinstance(rows, np.ndarray):
            raise ReplayTypeError(
                self.field, f"got {type(rows).__name__}", trajectory=self.trajectory, expected="a numpy array"
            )
        if rows.ndim == 0:
            raise ReplayDataError(self.field, "0-d array", trajectory=self.trajectory, expected="[rows, ...]")
        if rows.shape[0] != expected_rows:
            raise ReplayDataError(
                self.field,
                f"{rows.shape[0]} rows",
                trajectory=self.trajectory,
                token=self._rows,
                expected=f"{expected_rows} rows for this turn",
            )
        if self._row_shape is None:
            self._row_shape, self._dtype = tuple(rows.shape[1:]), rows.dtype
        elif tuple(rows.shape[1:]) != self._row_shape:
            raise ReplayDataError(
                self.field,
                f"row shape {list(rows.shape[1:])}",
                trajectory=self.trajectory,
                token=self._rows,
                expected=f"{list(self._row_shape)} as in the first turn",
            )
        elif rows.dtype != self._dtype and not self.promote_dtypes:
            raise ReplayTypeError(
                self.field,
                f"dtype {rows.dtype}",
                trajectory=self.trajectory,
                token=self._rows,
                expected=f"{self._dtype} as in the first turn",
            )
        self._chunks.append(np.array(rows, order="C", copy=True))
        self._rows += expected_rows

    def finalize(self, *, expected_rows: int) -> np.ndarray:
        """Concatenate every chunk, once.

        Args:
            expected_rows: the total the trajectory must have.

        Returns:
            ``[expected_rows, *row_shape]``, a new C-contiguous array (the promoted dtype with
            ``promote_dtypes``).

        Raises:
            ReplayDataError: nothing was appended (no schema), or a total that differs.
            RuntimeError: called twice.
        """
        self._live("finalize()")
        expected_rows = _count(expected_rows, "expected_rows", self.trajectory)
        if not self._chunks:
            raise ReplayDataError(
                self.field,
                "nothing was appended",
                trajectory=self.trajectory,
                expected="at least one append() to fix the row schema",
            )
        if self._rows != expected_rows:
            raise ReplayDataError(
                self.field, f"{self._rows} rows in total", trajectory=self.trajectory, expected=f"{expected_rows}"
            )
        dtype = np.result_type(*self._chunks) if self.promote_dtypes else self._dtype
        out = (
            np.concatenate(self._chunks, axis=0, dtype=dtype)
            if len(self._chunks) > 1
            else self._chunks[0].astype(dtype, copy=False)
        )
        self._finalized = True
        self._chunks = []
        return out


class RoutedExpertTrace:
    """Routed experts of one trajectory across generation turns.

    Usage per turn::

        start = trace.prompt_start                   # send as routed_experts_prompt_start
        ...engine call with prompt_ids, returns generated ids and routes...
        trace.record_generation(prompt_token_count=len(prompt_ids),
                                generated_token_count=len(generated),
                                routed_experts=routes)   # [len(prompt) - start + len(gen) - 1, L, K]

    and once at the end ``trace.finalize(token_count, loss_mask)``.

    **Synthetic EOS.** A framework may append an EOS token after the engine returned (the
    engine stopped on length, or a stop string). That EOS is a loss-bearing target whose
    source position, the last generated token, was never fed through the engine, so no
    route exists for it. Replaying a dummy route there would compute the EOS logprob from a
    hidden state the engine never produced, silently. :meth:`finalize` therefore raises
    unless the caller declares ``synthetic_eos=True``; then the source row is a padding row
    and ``router_padding_mask`` is True there: the trainer's own router routes that one
    token (the contract of ``router_padding_mask``, see :mod:`replay_plugin.core.routes`),
    like the unreplayed trainer would. Its logprob then carries the ordinary routing
    mismatch of one token, which is the best any replay can do without a route.

    Args:
        trajectory: index used in error messages.
    """

    def __init__(self, *, trajectory: int | None = None) -> None:
        self.trajectory = trajectory
        self._rows = TokenMetadataTrace("routed_experts", trajectory=trajectory, promote_dtypes=True)

    @property
    def prompt_start(self) -> int:
        """Tokens with a captured route so far; the next turn asks the engine to skip them."""
        return self._rows.num_rows

    def record_generation(
        self,
        *,
        prompt_token_count: int,
        generated_token_count: int,
        routed_experts: Any,
    ) -> None:
        """Record one engine call.

        Args:
            prompt_token_count: tokens in this call's prompt (the whole history so far,
                including the ``prompt_start`` tokens the engine skipped).
            generated_token_count: tokens the engine generated, >= 1.
            routed_experts: ``[prompt_token_count - prompt_start + generated_token_count - 1,
                L, K]`` non-negative integer array or tensor, as the engine returned it
                (compacted here).

        Raises:
            ReplayDataError: the prompt is shorter than what was already recorded (the
                history was rewritten), no generated token, a row count or ``[L, K]`` that
                does not match, bad expert ids.
            RuntimeError: after :meth:`finalize`.
        """
        self._rows._live("record_generation()")
        prompt_token_count = _count(prompt_token_count, "prompt_token_count", self.trajectory)
        generated_token_count = _count(generated_token_count, "generated_token_count", self.trajectory, minimum=1)
        if prompt_token_count < self.prompt_start:
            raise ReplayDataError(
                "prompt_token_count",
                f"{prompt_token_count} tokens but {self.prompt_start} are already routed",
                trajectory=self.trajectory,
                expected=f">= prompt_start {self.prompt_start} (the prompt must extend the recorded history)",
            )
        routes = compact(routed_experts, trajectory=self.trajectory)
        expected = prompt_token_count - self.prompt_start + generated_token_count - 1
        self._rows.append(routes, expected_rows=expected)

    def finalize(
        self,
        token_count: int,
        loss_mask: Sequence[Any] | np.ndarray | Any,
        *,
        synthetic_eos: bool = False,
    ) -> TrajectoryRoutes:
        """Routes for every token of the trajectory, and which rows carry no route.

        Token ``t`` is scored from the logits at ``t - 1``, which depend on the routes of
        every position ``< t``. Since captured rows are a prefix, every loss-bearing target
        is covered exactly when ``loss_mask[t]`` is False for every ``t - 1 >=
        prompt_start``.

        Args:
            token_count: tokens in the trajectory (prompt and response), >= ``prompt_start``.
            loss_mask: ``[token_count]`` bool or 0/1 over the same tokens (True = the token
                is a loss-bearing target); list, numpy or CPU tensor.
            synthetic_eos: the last token is an EOS appended after the engine returned.
                Its source row (token ``token_count - 2``) must then be uncaptured (else the
                declaration is wrong and raises); it gets a padding row and True in the mask
                so that the trainer routes it itself (see the class docstring).

        Returns:
            :class:`~replay_plugin.core.routes.TrajectoryRoutes` with ``routes`` ``[token_count,
            L, K]`` (captured rows, then padding rows ``[0..K-1]``; the widest dtype seen
            across turns) and ``router_padding_mask`` ``[token_count]`` bool, True for
            every row from ``prompt_start`` on.

        Raises:
            ReplayDataError: a loss-bearing target without a captured source route (names
                the target token), a mask of the wrong length or values, more rows than
                tokens, a wrong synthetic-EOS declaration, nothing recorded.
            RuntimeError: called twice.
        """
        self._rows._live("finalize()")
        tr = self.trajectory
        token_count = _count(token_count, "token_count", tr)
        if not isinstance(synthetic_eos, bool):
            raise ReplayTypeError(
                "synthetic_eos", f"got {type(synthetic_eos).__name__}", trajectory=tr, expected="a bool"
            )
        mask = _loss_mask(loss_mask, token_count, tr)
        captured = self.prompt_start
        if captured > token_count:
            raise ReplayDataError(
                "token_count",
                f"{token_count} tokens but {captured} routed rows",
                trajectory=tr,
                expected=f">= {captured}",
            )
        if synthetic_eos:
            if token_count < 2 or captured > token_count - 2:
                raise ReplayDataError(
                    "synthetic_eos",
                    f"declared, but the last token's source (token {token_count - 2}) has a captured route",
                    trajectory=tr,
                    token=token_count - 1,
                    expected=(
                        "the EOS appended after the engine's last generated token (then prompt_start <= "
                        "token_count - 2)"
                    ),
                )
        # Targets t with an uncaptured source t - 1 >= captured, i.e. t in [captured + 1, token_count).
        targets = mask[captured + 1 : token_count].copy()
        if synthetic_eos:
            targets[-1] = False
        missing = np.flatnonzero(targets)
        if missing.size:
            t = int(missing[0]) + captured + 1
            raise ReplayDataError(
                "routed_experts",
                f"missing routed-expert row for loss-bearing target token {t} (its source token {t - 1} was never "
                f"routed by the engine; {captured} rows captured)",
                trajectory=tr,
                token=t,
                expected=(
                    "routes for every source of a loss-bearing token; if the last token is an EOS "
                    "appended after generation, pass synthetic_eos=True"
                ),
            )
        routes = self._rows.finalize(expected_rows=captured)
        num_layers, topk = routes.shape[1:]
        dtype = routes.dtype
        while topk - 1 > np.iinfo(dtype).max:  # padding ids must fit (only when 0 rows were captured)
            dtype = ROUTE_DTYPES[ROUTE_DTYPES.index(dtype) + 1]
        out = np.empty((token_count, num_layers, topk), dtype=dtype)
        out[:captured] = routes
        out[captured:] = np.arange(topk, dtype=dtype)
        padding = np.zeros(token_count, dtype=bool)
        padding[captured:] = True
        return TrajectoryRoutes(routes=out, router_padding_mask=padding)


def _loss_mask(loss_mask: Any, token_count: int, trajectory: int | None) -> np.ndarray:
    if type(loss_mask).__module__.startswith("torch"):
        loss_mask = loss_mask.detach().cpu().numpy()
    if isinstance(loss_mask, (str, bytes)):
        raise ReplayTypeError(
            "loss_mask", f"got {type(loss_mask).__name__}", trajectory=trajectory, expected="a sequence of 0/1"
        )
    try:
        m = np.asarray(loss_mask)
    except (TypeError, ValueError) as exc:
        raise ReplayTypeError("loss_mask", f"{exc}", trajectory=trajectory, expected="a sequence of 0/1") from None
    if m.ndim != 1 or m.shape[0] != token_count:
        raise ReplayDataError(
            "loss_mask", f"shape {m.shape}", trajectory=trajectory, expected=f"[{token_count}] (one entry per token)"
        )
    if m.dtype == np.bool_:
        return m
    if m.size == 0:
        return m.astype(bool)
    if not (np.issubdtype(m.dtype, np.integer) or np.issubdtype(m.dtype, np.floating)):
        raise ReplayTypeError("loss_mask", f"dtype {m.dtype}", trajectory=trajectory, expected="bool or 0/1")
    bad = (m != 0) & (m != 1)
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise ReplayDataError("loss_mask", f"value {m[t].item()!r}", trajectory=trajectory, token=t, expected="0 or 1")
    nonzero: np.ndarray = m != 0
    return nonzero
