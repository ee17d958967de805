"""One generation's replay data, from TRL's generation backend to its batch dict.

``GRPOTrainer._generate_and_score_completions`` runs one generation for the local batch: TRL's
backend (HF generate, vLLM colocate, vLLM server) returns completions in TRL's order, TRL pads
them into ``completion_ids [B, C]`` and scores them. The plugin's backend seams hand what they
captured to the :class:`Rollout` that the scoring seam opened (:func:`collecting`), in the same
order as TRL's completions (:meth:`Rollout.deliver`); the trainer seams read it back padded to
TRL's grid (:meth:`Rollout.support_grid`, :meth:`Rollout.routes_grid`).

The contract between the seams:

- one :class:`Completion` per completion TRL returns, in TRL's order, after any slicing TRL does
  (tensor-parallel slices, ``process_slice``): ``len(rollout.completions) == B`` once generation
  is done;
- ``Completion.rows``: the completion's :class:`~replay_plugin.core.support.SupportRows`, one row
  per completion token TRL keeps (``rows.sampled == completion_ids``), or None where the job did
  not ask for support;
- ``Completion.routes``: routed experts ``[P + T, L, K]`` over the prompt and completion tokens
  (TRL's unpadded ``prompt_ids + completion_ids``; a position without a route is a row of the
  ``router_padding`` mask), or None where the job did not ask for routes.

Pure but for numpy: imports neither trl nor torch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import ReplayDataError
from ..core.support import SupportRows
from .switch import Ask


@dataclass
class Completion:
    """What the plugin captured for one completion."""

    rows: SupportRows | None = None
    routes: np.ndarray | None = None  # [P + T, L, K] integer expert ids
    router_padding: np.ndarray | None = None  # bool [P + T]: True where no route was recorded


@dataclass
class Rollout:
    """The replay data of one generation (one ``_generate_and_score_completions`` call)."""

    ask: Ask
    completions: list[Completion] = field(default_factory=list)
    #: TRL's unpadded prompt / completion lengths, set by the batch seam once generation is done
    prompt_lengths: list[int] | None = None
    completion_lengths: list[int] | None = None
    #: what the trainer seams derive from this generation (padded grids, measurements), by name
    cache: dict = field(default_factory=dict)

    def deliver(self, completions: Sequence[Completion]) -> None:
        """Appends ``completions`` (TRL's order) to this generation's."""
        self.completions.extend(completions)

    def check(self, completion_ids: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]] | None = None) -> None:
        """Checks the delivered data against TRL's completions (count, tokens, widths; with
        ``prompt_ids``, the routes' lengths too) and records the lengths.

        Raises:
            ReplayDataError: another number of completions, rows for other tokens or another
                number of tokens, a row that is not the sampler's exact support (the trainer would
                renormalise over another support without a word), routes of another length; naming
                the completion (and token).
        """
        if len(self.completions) != len(completion_ids):
            raise ReplayDataError(
                "completions",
                f"the plugin captured {len(self.completions)} completions, TRL returned {len(completion_ids)}",
            )
        for i, (got, token_ids) in enumerate(zip(self.completions, completion_ids)):
            ids = np.asarray(list(token_ids), dtype=np.int64)
            if self.ask.support:
                if got.rows is None:
                    raise ReplayDataError("replay_support", f"completion {i}: no support rows were captured")
                sampled = np.asarray(got.rows.sampled, dtype=np.int64)
                if sampled.shape[0] != ids.shape[0]:
                    raise ReplayDataError(
                        "replay_support",
                        f"completion {i}: {sampled.shape[0]} rows for {ids.shape[0]} completion tokens",
                    )
                bad = np.flatnonzero(sampled != ids)
                if bad.size:
                    t = int(bad[0])
                    raise ReplayDataError(
                        "replay_support",
                        f"completion {i}, token {t}: the row was captured for token {int(sampled[t])}, "
                        f"TRL's completion has {int(ids[t])}",
                    )
                inexact = np.flatnonzero(~np.asarray(got.rows.exact, dtype=bool))
                if inexact.size:
                    t = int(inexact[0])
                    raise ReplayDataError(
                        "replay_support",
                        f"completion {i}: {inexact.size} of {len(ids)} rows are not the sampler's exact support "
                        f"(token {t}: more tokens tie at the top_k-th logit than the {got.rows.ids.shape[1]} ids of "
                        "a row hold, or the row lacks the sampled token)",
                        trajectory=i,
                        token=t,
                        expected="exact rows: raise replay_sample_support_slack in the switch "
                        f"(row width top_k + slack = {got.rows.ids.shape[1]})",
                    )
            if self.ask.routes and prompt_ids is not None:
                if got.routes is None:
                    raise ReplayDataError("replay_routes", f"completion {i}: no routed experts were captured")
                want = len(prompt_ids[i]) + ids.shape[0]
                if got.routes.ndim != 3 or got.routes.shape[0] != want:
                    raise ReplayDataError(
                        "replay_routes",
                        f"completion {i}: routes of shape {tuple(got.routes.shape)} for {len(prompt_ids[i])} prompt "
                        f"and {ids.shape[0]} completion tokens",
                        expected=f"[{want}, layers, top_k]",
                    )
        self.completion_lengths = [len(ids) for ids in completion_ids]
        if prompt_ids is not None:
            self.prompt_lengths = [len(ids) for ids in prompt_ids]


_CURRENT: contextvars.ContextVar[Rollout | None] = contextvars.ContextVar("replay_plugin_trl_rollout", default=None)


def current() -> Rollout | None:
    """The generation being collected, or None outside one."""
    return _CURRENT.get()


@contextlib.contextmanager
def collecting(ask: Ask) -> Iterator[Rollout]:
    """Opens the :class:`Rollout` the backend seams deliver into."""
    rollout = Rollout(ask)
    token = _CURRENT.set(rollout)
    try:
        yield rollout
    finally:
        _CURRENT.reset(token)


def support_grid(rollout: Rollout, width_c: int) -> np.ndarray:
    """Rows ``int32 [B, C, W]`` on TRL's right-padded completion grid (``C = width_c``,
    ``completion_ids.size(1)``); ``-1`` pads rows past a completion's end and the row width."""
    rows = [c.rows for c in rollout.completions]
    width = max((r.ids.shape[1] for r in rows if r is not None), default=1)
    grid = np.full((len(rows), width_c, width), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        if r is None:
            continue
        t = r.ids.shape[0]
        if t > width_c:
            raise ReplayDataError("replay_support", f"completion {i}: {t} rows for a grid of {width_c} tokens")
        grid[i, :t, : r.ids.shape[1]] = r.ids
    return grid


def exact_grid(rollout: Rollout, width_c: int) -> np.ndarray:
    """``bool [B, C]``: True where a captured row is the sampler's exact support."""
    grid = np.zeros((len(rollout.completions), width_c), dtype=bool)
    for i, c in enumerate(rollout.completions):
        if c.rows is not None:
            grid[i, : c.rows.exact.shape[0]] = c.rows.exact
    return grid


def sampled_logprob_grid(rollout: Rollout, width_c: int) -> np.ndarray:
    """``float32 [B, C]``: the sampler's processed logprob of each completion token (NaN where
    none was captured and past a completion's end)."""
    grid = np.full((len(rollout.completions), width_c), np.nan, dtype=np.float32)
    for i, c in enumerate(rollout.completions):
        if c.rows is not None:
            grid[i, : c.rows.sampled_logprob.shape[0]] = c.rows.sampled_logprob
    return grid


def routes_grid(rollout: Rollout, width_p: int, width_c: int) -> tuple[np.ndarray, np.ndarray]:
    """Routes ``[B, P + C, L, K]`` (the captured dtype) and the router padding mask ``bool
    [B, P + C]`` on TRL's grid: prompts left-padded to ``P = width_p``, completions right-padded
    to ``C = width_c``. Positions without a route (padding, an uncaptured position) hold the
    dummy experts ``0 .. K-1`` and are True in the mask. Needs :meth:`Rollout.check` with
    ``prompt_ids`` first (the lengths)."""
    if rollout.prompt_lengths is None or rollout.completion_lengths is None:
        raise ReplayDataError("replay_routes", "the rollout was not checked against TRL's prompts and completions")
    shapes = {c.routes.shape[1:] for c in rollout.completions if c.routes is not None}
    if len(shapes) != 1:
        raise ReplayDataError(
            "replay_routes", f"completions carry routes of shapes {sorted(shapes)}", expected="one [L, K]"
        )
    (lk,) = shapes
    dtype = np.result_type(*[c.routes.dtype for c in rollout.completions if c.routes is not None])
    b, s = len(rollout.completions), width_p + width_c
    routes = np.broadcast_to(np.arange(lk[1], dtype=dtype), (b, s, *lk)).copy()
    padding = np.ones((b, s), dtype=bool)
    for i, c in enumerate(rollout.completions):
        p, t = rollout.prompt_lengths[i], rollout.completion_lengths[i]
        if p > width_p or t > width_c:
            raise ReplayDataError(
                "replay_routes",
                f"completion {i}: {p} prompt + {t} completion tokens for a grid of {width_p} + {width_c}",
            )
        if c.routes is None:
            continue
        routes[i, width_p - p : width_p] = c.routes[:p]
        routes[i, width_p : width_p + t] = c.routes[p : p + t]
        pad = np.zeros(p + t, dtype=bool) if c.router_padding is None else np.asarray(c.router_padding, dtype=bool)
        padding[i, width_p - p : width_p] = pad[:p]
        padding[i, width_p : width_p + t] = pad[p : p + t]
    return routes, padding
