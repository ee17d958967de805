"""Support rows of a multi-turn trajectory, aligned with its response token by token.

verl's agent loops build a sample's response from several ``generate`` calls (the turns of a
tool or interaction loop, the resumed attempts of a partial rollout) and the context between
them (tool responses, chat-template scaffolding: ``response_mask`` 0). Continuous-token merges
(``verl/utils/tokenizer/continuous_token.py``, 0.9.1) append a turn's tokens verbatim with mask
1, but may trim the tail of the stream before appending context (``removed_prefix_token_count``)
and insert boundary tokens (mask 0); the response is finally cut at ``response_length``. So the
model-generated tokens of a response, read as runs of mask 1, are the turns' tokens in order,
where a run may end inside a turn (its tail was trimmed or cut) and may span several turns.

:func:`align` assigns each mask-1 token its turn's row and checks every token id on the way; a
token it cannot place is refused with the response position, never guessed. Inputs are checked
before any conversion (:func:`token_ids`, :func:`turn`): numpy would truncate a float id (7.9 -> 7),
wrap an int64 row id into int32 (2**32 + 5 -> 5) or fail untyped (None, ``"a"``, 2**70, ragged
rows); each is refused naming the field and the position. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import ReplayDataError, ReplayTypeError
from .switch import BATCH_SUPPORT_KEY

PAD = -1
_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)


def _items(values: Any) -> list:
    """Python scalars of a sequence, an array or a tensor (``tolist``), without converting them."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def token_ids(values: Any, field: str, *, trajectory: int | None = None) -> np.ndarray:
    """``values`` as ``int64`` token ids, each checked first: an int (not a bool) in ``[0, 2**63)``.

    Raises:
        ReplayTypeError: an id that is not an int (None, a float, a string, a nested list),
            naming ``field`` and its position (``token``).
        ReplayDataError: an id below 0 or beyond int64.
    """
    items = _items(values)
    for i, value in enumerate(items):
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
            raise ReplayTypeError(
                field,
                f"token id {value!r} at position {i} is a {type(value).__name__}",
                trajectory=trajectory,
                token=i,
                expected="int token ids",
            )
        if not 0 <= value <= _INT64_MAX:
            raise ReplayDataError(
                field,
                f"token id {value} at position {i} is not a token id",
                trajectory=trajectory,
                token=i,
                expected="ids in [0, 2**63)",
            )
    return np.asarray(items, dtype=np.int64).reshape(-1)


def _mask(values: Any, size: int, trajectory: int | None) -> np.ndarray:
    items = _items(values)
    if len(items) != size:
        raise ReplayDataError(
            "response_mask", f"{len(items)} entries for {size} response tokens", trajectory=trajectory
        )
    for i, value in enumerate(items):
        if not isinstance(value, (int, float, np.number)) or value not in (0, 1):
            raise ReplayDataError(
                "response_mask", f"entry {value!r} at position {i}", trajectory=trajectory, token=i, expected="0 or 1"
            )
    return np.asarray(items, dtype=np.int64).reshape(-1)


class Turn(NamedTuple):
    """One ``generate`` call: the tokens it returned and their rows (None: not captured, e.g. a
    greedy request; its tokens get rows of padding, which the trainer refuses to score)."""

    token_ids: np.ndarray
    rows: np.ndarray | None


def turn(ids: Sequence[int], rows: Any) -> Turn:
    """One ``generate`` call's token ids (``TokenOutput.token_ids``) and rows, checked: ids as
    :func:`token_ids`, rows an int ``[T, W]`` array of ids in ``[-1, 2**31)`` (what the int32
    support field can hold without wrapping)."""
    tokens = token_ids(ids, "token_ids")
    if rows is not None:
        try:
            rows = np.asarray(rows)
        except ValueError as exc:  # ragged rows (numpy refuses an inhomogeneous list)
            raise ReplayDataError(
                BATCH_SUPPORT_KEY,
                f"rows for {tokens.size} generated tokens that are not one array ({exc})",
                expected="int [T, W], one row per generated token",
            ) from None
        if rows.ndim != 2 or rows.shape[0] != tokens.shape[0] or rows.dtype.kind not in "iu":
            raise ReplayDataError(
                BATCH_SUPPORT_KEY,
                f"rows of shape {rows.shape} / dtype {rows.dtype} for {tokens.shape[0]} generated tokens",
                expected="int [T, W], one row per generated token",
            )
        if rows.size:
            bad = np.flatnonzero(((rows < PAD) | (rows > _INT32_MAX)).any(axis=1))
            if bad.size:
                t = int(bad[0])
                raise ReplayDataError(
                    BATCH_SUPPORT_KEY,
                    f"the row of generated token {t} holds {rows[t].tolist()[:8]}: ids outside [-1, 2**31) that the "
                    "int32 field would wrap into other ids",
                    token=t,
                    expected="token ids, -1 as padding",
                )
    return Turn(tokens, rows)


def align(
    response_ids: Sequence[int],
    response_mask: Sequence[int],
    turns: Sequence[Turn],
    width: int,
    *,
    trajectory: int | None = None,
) -> np.ndarray:
    """``int32 [len(response_ids), W]``: each model-generated response token's support row, ``-1``
    for context and padding tokens; ``W`` is the widest row (at least ``width``).

    Raises:
        ReplayDataError: a mask-1 token that no turn produced at that point (more generated tokens
            than the turns returned, or a different id), naming the response position.
    """
    ids = token_ids(response_ids, "response_ids", trajectory=trajectory)
    mask = _mask(response_mask, ids.size, trajectory)
    w = max([width] + [t.rows.shape[1] for t in turns if t.rows is not None])
    out = np.full((ids.size, w), PAD, dtype=np.int32)
    live = [t for t in turns if t.token_ids.size]
    j, offset = 0, 0  # next turn, tokens of it already placed
    generated = np.flatnonzero(mask != 0)
    if generated.size == 0:
        return out
    # runs of mask 1: [start, end)
    breaks = np.flatnonzero(np.diff(generated) != 1)
    starts = np.concatenate([generated[:1], generated[breaks + 1]])
    ends = np.concatenate([generated[breaks] + 1, generated[-1:] + 1])
    for start, end in zip(starts.tolist(), ends.tolist()):
        p = start
        while p < end:
            if j >= len(live):
                raise ReplayDataError(
                    BATCH_SUPPORT_KEY,
                    f"response token {p} is model-generated (response_mask 1) but the trajectory's {len(live)} "
                    "generate calls returned no token for it",
                    trajectory=trajectory,
                    token=p,
                    expected="every mask-1 token produced by a generate call of the agent loop",
                )
            t = live[j]
            m = min(t.token_ids.size - offset, end - p)
            got, want = ids[p : p + m], t.token_ids[offset : offset + m]
            if not np.array_equal(got, want):
                k = int(np.flatnonzero(got != want)[0])
                raise ReplayDataError(
                    BATCH_SUPPORT_KEY,
                    f"response token {p + k} is id {int(got[k])}, generate call {j} returned id {int(want[k])} there",
                    trajectory=trajectory,
                    token=p + k,
                    expected="the agent loop's response to hold each turn's tokens in order (mask 1)",
                )
            if t.rows is not None:
                rows = t.rows[offset : offset + m]
                out[p : p + m, : rows.shape[1]] = rows
            p += m
            offset += m
            if offset == t.token_ids.size:
                j, offset = j + 1, 0
        if offset:  # the run ended inside a turn: its tail was trimmed (merge) or cut
            j, offset = j + 1, 0
    return out
