"""``vllm.sample_support``, capture: read each admitted request's logprob rows as support rows.

Part of the ``vllm.sample_support`` patch (``sample_support.py`` installs it). Stock vLLM
returns no sampler support on the V1 runner; this keeps the processed-logprob arrays of
opted-in requests, hands vLLM only the columns the user asked for, and puts
``core.support.SupportRows`` on each ``CompletionOutput``. Remove with the patch (see
compat_matrix.yaml).
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from typing import Any

import numpy as np

from ..core.support import (
    DEFAULT_MASS_TOLERANCE,
    INT32_MAX,
    PAD,
    UNREACHABLE_LOGPROB,
    SupportRows,
    _rows_unchecked,
    support_from_flat_logprobs,
    support_from_sampling_mask,
)
from . import options
from .client import REFUSED_FIELD as REFUSED_ATTR  # the attribute with the engine core's refusal
from .client import SUPPORT_FIELD as OUTPUT_ATTR  # the CompletionOutput attribute of the rows
from .refusal import engine_refusal, refusal

log = logging.getLogger("replay_plugin")


_CAPTURE_ATTR = "_replay_plugin_capture"
#: The front ends' ``sample_support_log.RowLog`` objects of this process (each adds itself).
ROW_LOGS: weakref.WeakSet = weakref.WeakSet()
#: Shared step references a request keeps before copying its rows (see ``_Capture``).
_COMPACT_AT = 64


def sample_support(output: Any) -> SupportRows | None:
    """The ``SupportRows`` vLLM returned on a ``CompletionOutput`` (None when not captured)."""
    return getattr(output, "__dict__", {}).get(OUTPUT_ATTR)


# --------------------------------------------------------------------------- capture stats


_stats_lock = threading.Lock()
_stats = {"requests": 0, "rows": 0, "inexact": 0}
_warned_at = 0


def capture_stats() -> dict:
    """Counts in this process: opted-in ``requests``, captured ``rows``, ``inexact`` rows."""
    with _stats_lock:
        return dict(_stats)


def reset_capture_stats() -> None:
    global _warned_at
    with _stats_lock:
        for key in _stats:
            _stats[key] = 0
        _warned_at = 0


def count_request() -> None:
    """Count one admitted (opted-in) request."""
    with _stats_lock:
        _stats["requests"] += 1


def _count_rows(rows: SupportRows) -> None:
    _count(len(rows), int(np.count_nonzero(~rows.exact)), rows.width)


def _count(count: int, inexact: int, width: int) -> None:
    global _warned_at
    with _stats_lock:
        _stats["rows"] += count
        _stats["inexact"] += inexact
        total, bad = _stats["rows"], _stats["inexact"]
        warn = inexact and bad >= 2 * _warned_at
        if warn:
            _warned_at = bad
    if warn:
        log.warning(
            "replay_plugin: vllm.sample_support: %d of %d captured support rows are inexact (the "
            "support was wider than the row width W=%d, e.g. more tokens tied at the k-th logit); "
            "they are flagged exact=False. Raise %s or the request's %r.",
            bad,
            total,
            width,
            options.SLACK_ENV,
            options.SLACK_KEY,
        )


# --------------------------------------------------------------------------- per-request buffer


class _RowBuffer:
    """Support rows of one request in arrays that grow by doubling: appending ``k`` rows costs
    ``O(k)`` amortised and :meth:`view` is ``O(1)``, so a ``CUMULATIVE`` output (all rows so far,
    every step) costs the same per step at token 16 and at token 2,048. Rows already handed out
    are never written again; views are read-only."""

    __slots__ = ("ids", "sampled", "sampled_logprob", "exact", "size")

    def __init__(self, width: int, capacity: int = 64) -> None:
        self.ids = np.empty((capacity, width), dtype=np.int32)
        self.sampled = np.empty(capacity, dtype=np.int32)
        self.sampled_logprob = np.empty(capacity, dtype=np.float32)
        self.exact = np.empty(capacity, dtype=np.bool_)
        self.size = 0

    def _reserve(self, end: int) -> None:
        if end > self.sampled.shape[0]:
            capacity = max(end, 2 * self.sampled.shape[0])
            for name in self.__slots__[:4]:
                old = getattr(self, name)
                grown = np.empty((capacity, *old.shape[1:]), dtype=old.dtype)
                grown[: self.size] = old[: self.size]
                setattr(self, name, grown)

    def append_row(self, members: list[int], sampled: int, sampled_logprob: float, exact: bool) -> None:
        n = self.size
        self._reserve(n + 1)
        row = self.ids[n]
        row[: len(members)] = members
        row[len(members) :] = PAD
        self.sampled[n] = sampled
        self.sampled_logprob[n] = sampled_logprob
        self.exact[n] = exact
        self.size = n + 1

    def append(self, rows: SupportRows) -> None:
        k = len(rows)
        end = self.size + k
        self._reserve(end)
        self.ids[self.size : end] = rows.ids
        self.sampled[self.size : end] = rows.sampled
        self.sampled_logprob[self.size : end] = rows.sampled_logprob
        self.exact[self.size : end] = rows.exact
        self.size = end

    def view(self, start: int, stop: int) -> SupportRows:
        parts = []
        for name in self.__slots__[:4]:
            part = getattr(self, name)[start:stop]
            part.flags.writeable = False
            parts.append(part)
        return _rows_unchecked(*parts)


class _Capture:
    """Per request (per child of ``n > 1``): the logprob rows not converted yet and the
    converted rows. ``DELTA`` outputs take the rows not handed out yet; other output kinds
    (``CUMULATIVE``, ``FINAL_ONLY``) view the first ``n`` rows. ``checked`` counts the rows
    already compared with the output's tokens (each row is compared once).

    Rows not converted yet are ``(ids, logprobs, start, stop)``: rows ``start:stop`` of a pair
    of ``[positions, N+1]`` arrays, either the request's own copy (:meth:`add`) or one engine
    step's arrays shared by every request of the step (:meth:`add_shared`, from a batch of
    ``vllm.batch_rows``: one copy per step instead of two per request). A request keeps at most
    ``_COMPACT_AT`` shared references: then its rows are copied into arrays of its own, so a
    long request never keeps more than that many steps' arrays alive.

    A capture the front end's ``sample_support_log.RowLog`` took in (``log`` set, ``slot`` its
    number there) keeps no rows itself: every row it gets goes to the log, and it reads them
    back from the log when it converts (then the log forgets it)."""

    __slots__ = (
        "width",
        "native",
        "_pending",
        "_loose",
        "buffer",
        "_handed",
        "checked",
        "_sampled_lp",
        "log",
        "slot",
        "masks_seen",
    )

    def __init__(self, width: int, native: bool) -> None:
        self.width = width
        self.native = native
        self._pending: list[tuple[np.ndarray, np.ndarray, int, int]] = []
        self._loose = 0  # entries appended since the last compaction
        self.buffer = _RowBuffer(width)
        self._handed = 0
        self.checked = 0
        self._sampled_lp: list[np.ndarray] = []
        self.log: Any = None
        self.slot = -1
        self.masks_seen = 0  # native: the request state's sampling-mask chunks already converted

    def add(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        # Copies: vLLM's arrays are views of the whole batch's step arrays, which a long request
        # would otherwise keep alive for every step.
        if self.native:
            self._sampled_lp.append(np.array(logprobs[:, 0], dtype=np.float32))
        elif self.log is not None:
            self.log.append_rows(self.slot, np.array(ids), np.array(logprobs))
        else:
            self._pending.append((np.array(ids), np.array(logprobs), 0, ids.shape[0]))
            self._loose += 1

    def add_shared(self, ids: np.ndarray, logprobs: np.ndarray, row: int) -> None:
        """Row ``row`` of a step's arrays that other requests share (not copied, not changed)."""
        if self.native:
            self._sampled_lp.append(np.array(logprobs[row : row + 1, 0], dtype=np.float32))
            return
        if self.log is not None:
            self.log.append_rows(self.slot, ids[row : row + 1], logprobs[row : row + 1])
            return
        self._pending.append((ids, logprobs, row, row + 1))
        self._loose += 1
        if self._loose >= _COMPACT_AT:
            self._compact()

    def _compact(self) -> None:
        """The entries since the last compaction copied into one pair of arrays of this request
        (each row is copied once: earlier chunks are left as they are)."""
        tail = self._pending[-self._loose :]
        if any(a.shape[1] != tail[0][0].shape[1] for a, _, _, _ in tail):
            self._convert()  # the step's largest ``logprobs`` changed: convert instead
            return
        a = np.concatenate([a[s:e] for a, _, s, e in tail])
        b = np.concatenate([b[s:e] for _, b, s, e in tail])
        self._pending[-self._loose :] = [(a, b, 0, a.shape[0])]
        self._loose = 0

    def parts(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The rows not converted yet, as views, in order."""
        if self.log is not None:
            return self.log.parts(self.slot)
        return [a[s:e] for a, _, s, e in self._pending], [b[s:e] for _, b, s, e in self._pending]

    def take_converted(self, rows: SupportRows) -> None:
        """``rows`` converted from :meth:`parts` (by :func:`convert_finishing`, with other requests')."""
        if self.log is not None:
            self.log.release(self.slot)
        self._pending = []
        self._loose = 0
        self.buffer.append(rows)

    def _convert(self) -> None:
        """Pending arrays -> rows, once, vectorised over every step since the last output (one
        row, the common case of streamed outputs, takes a scalar path that is ~6x faster)."""
        if self.log is not None:
            ids_parts, lps_parts = self.parts()
            if not ids_parts:
                self.log.release(self.slot)
                return
            new = _rows_from_arrays(ids_parts, lps_parts, self.width)
            _count_rows(new)
            self.take_converted(new)
            return
        pending = self._pending
        if not pending:
            return
        if len(pending) == 1 and pending[0][3] - pending[0][2] == 1:
            ids, lps, row, _ = pending[0]
            one = _one_row(ids[row], lps[row], self.width)
            if one is not None:
                self._pending = []
                self._loose = 0
                _count(1, 0 if one[3] else 1, self.width)
                self.buffer.append_row(*one)
                return
        ids_parts, lps_parts = self.parts()
        new = _rows_from_arrays(ids_parts, lps_parts, self.width)
        _count_rows(new)
        self.take_converted(new)

    def span(self, n: int, delta: bool) -> tuple[int, int]:
        """The buffer range of an output's rows: ``delta``, the next ``n`` rows not handed out
        yet (then handed out); otherwise the first ``n`` rows. Shorter when fewer were captured."""
        if delta and self._handed == self.buffer.size and self._handed > 4096:
            self.buffer = _RowBuffer(self.width)  # a long DELTA stream keeps no rows it handed out
            self._handed = 0
        self._convert()
        start = self._handed if delta else 0
        stop = min(start + n, self.buffer.size)
        if delta:
            self._handed = stop
        return start, stop

    def fill(self, tokens: np.ndarray, delta: bool) -> None:
        """Empty, inexact rows for generated ``tokens`` that have none (never expected)."""
        self.buffer.append(_missing_rows(tokens, self.width))
        if delta:
            self._handed = self.buffer.size

    def align(self, start: int, tokens: np.ndarray) -> None:
        """Rows ``start..`` must be those of ``tokens``: a row captured for another token is
        emptied and flagged inexact (never expected; logged)."""
        b = self.buffer
        stop = start + len(tokens)
        bad = b.sampled[start:stop] != tokens
        if bad.any():
            log.error(
                "replay_plugin: vllm.sample_support: %d support rows were captured for other "
                "tokens than the output's; flagged inexact",
                int(bad.sum()),
            )
            where = np.flatnonzero(bad) + start
            b.ids[where] = PAD
            b.sampled[where] = tokens[bad]
            b.sampled_logprob[where] = np.nan
            b.exact[where] = False

    def sampled_logprobs(self) -> np.ndarray:
        if len(self._sampled_lp) > 1:
            self._sampled_lp = [np.concatenate(self._sampled_lp)]
        return self._sampled_lp[0] if self._sampled_lp else np.zeros(0, np.float32)


# --------------------------------------------------------------------------- conversion


def _rows_from_arrays(ids: list[np.ndarray], lps: list[np.ndarray], width: int) -> SupportRows:
    """Rows from vLLM's per-step ``[positions, N+1]`` arrays (``N`` may differ between steps:
    it is the batch's largest ``logprobs``)."""
    cols = np.fromiter((a.shape[1] for a in ids), np.int64, len(ids))
    if (cols == cols[0]).all():  # one width (the usual case): stacked without flattening each
        a, b = np.concatenate(ids), np.concatenate(lps)
        start = np.arange(a.shape[0], dtype=np.int64) * a.shape[1]
        return support_from_flat_logprobs(
            {
                "start_indices": start,
                "end_indices": start + a.shape[1],
                "token_ids": a.reshape(-1),
                "logprobs": b.reshape(-1),
            },
            width,
        )
    counts = np.fromiter((a.shape[0] for a in ids), np.int64, len(ids))
    lens = np.repeat(cols, counts)
    end = np.cumsum(lens)
    flat = {
        "start_indices": end - lens,
        "end_indices": end,
        "token_ids": np.concatenate([a.reshape(-1) for a in ids]),
        "logprobs": np.concatenate([b.reshape(-1) for b in lps]),
    }
    return support_from_flat_logprobs(flat, width)


def convert_finishing(outputs: Any, states: dict) -> None:
    """The rows of the step's captured requests that finish now (``outputs``: vLLM's
    ``EngineCoreOutput`` list of one step, ``states`` its ``OutputProcessor.request_states``)
    converted in one call per row width before vLLM builds their outputs. An RL batch finishes
    its requests together, and one conversion of all their rows costs a fraction of one per
    request (numpy's per-call cost dominates at a request's few hundred rows). Requests left
    out convert their own rows when their output is built, as always."""
    reasons = [out.finish_reason for out in outputs]
    if reasons.count(None) == len(reasons):
        return  # most steps: nothing finishes (FinishReason.STOP is 0: compare with None)
    groups: dict[tuple[int, int], list[_Capture]] = {}
    for out, reason in zip(outputs, reasons):
        if reason is None:
            continue
        state = states.get(out.request_id)
        processor = getattr(state, "logprobs_processor", None)
        capture = processor.__dict__.get(_CAPTURE_ATTR) if processor is not None else None
        if capture is None or capture.native:
            continue
        if capture.log is not None:  # its rows are in the front end's log: any widths
            groups.setdefault((capture.width, -1), []).append(capture)
            continue
        if not capture._pending:
            continue
        columns = {a.shape[1] for a, _, _, _ in capture._pending}
        if len(columns) == 1:
            groups.setdefault((capture.width, columns.pop()), []).append(capture)
    for (width, _), captures in groups.items():
        if len(captures) < 2:
            continue
        ids_parts: list[np.ndarray] = []
        lps_parts: list[np.ndarray] = []
        counts = []
        for capture in captures:
            a, b = capture.parts()
            ids_parts += a
            lps_parts += b
            counts.append(sum(x.shape[0] for x in a))
        if not ids_parts:
            continue  # no rows at all: each converts (to nothing) on its own
        rows = _rows_from_arrays(ids_parts, lps_parts, width)
        start = 0
        for capture, n in zip(captures, counts):
            stop = start + n
            capture.take_converted(
                _rows_unchecked(
                    rows.ids[start:stop],
                    rows.sampled[start:stop],
                    rows.sampled_logprob[start:stop],
                    rows.exact[start:stop],
                )
            )
            start = stop
        _count_rows(rows)


def _one_row(ids: np.ndarray, logprobs: np.ndarray, width: int) -> tuple[list[int], int, float, bool] | None:
    """One position ``[sampled, top1..topN]`` -> ``(members, sampled, sampled logprob, exact)``
    by the rule of ``core.support.support_from_flat_logprobs`` (which the tests hold it to), in
    plain Python: for one row the numpy path costs ~70 us of per-call overhead. None when the
    row needs the general path (entries not in descending order, NaN or +inf, ids outside
    int32): that path validates, reorders and raises as documented there."""
    id_list = ids.tolist()
    lp_list = logprobs.tolist()
    if min(id_list) < 0 or max(id_list) > INT32_MAX:
        return None
    members: list[int] = []
    mass = 0.0
    closed = False
    previous = math.inf
    for token, lp in zip(id_list[1:], lp_list[1:]):
        if not lp <= previous or lp == math.inf:  # NaN, +inf or an ascent
            return None
        previous = lp
        if lp > UNREACHABLE_LOGPROB:
            members.append(token)
        else:  # -inf, or too improbable to be drawn: everything after it is too
            closed = True
    if not closed:  # the mass test, in the core's arithmetic (float32 exp, float64 sum)
        mass = float(np.exp(logprobs[1 : 1 + len(members)]).sum(dtype=np.float64))
    sampled, sampled_lp = id_list[0], lp_list[0]
    kept = members[:width]
    exact = (
        (closed or mass >= 1.0 - DEFAULT_MASS_TOLERANCE)
        and sampled in kept
        and len(members) <= width
        and math.isfinite(sampled_lp)
    )
    return kept, sampled, sampled_lp, exact


def rows_from_sampling_mask(
    mask: Any, token_ids: Any, width: int, sampled_logprobs: np.ndarray | None = None
) -> SupportRows:
    """Rows from vLLM's native ``SamplingMask`` (``token_ids: list[list[int]]``, one list per
    generated token) for the generated ``token_ids`` of one output.

    vLLM 0.28-0.30 attach the mask of *every* position to the final output even in ``DELTA``
    mode (0.32 sends per-delta masks): a mask longer than ``token_ids`` is aligned to its last
    ``len(token_ids)`` positions. A shorter one cannot be aligned: ``ValueError``.
    """
    per_position = list(mask.token_ids)
    t = len(token_ids)
    if len(per_position) < t:
        raise ValueError(f"sampling mask has {len(per_position)} positions for {t} generated tokens")
    per_position = per_position[len(per_position) - t :]
    lp = None
    if sampled_logprobs is not None and len(sampled_logprobs) >= t:
        lp = np.asarray(sampled_logprobs, dtype=np.float32)[len(sampled_logprobs) - t :]
    return support_from_sampling_mask(
        per_position, np.asarray(list(token_ids), dtype=np.int64), width, sampled_logprobs=lp
    )


def _missing_rows(token_ids: np.ndarray, width: int) -> SupportRows:
    return SupportRows(
        ids=np.full((len(token_ids), width), PAD, dtype=np.int32),
        sampled=token_ids.astype(np.int32),
        sampled_logprob=np.full(len(token_ids), np.nan, dtype=np.float32),
        exact=np.zeros(len(token_ids), dtype=np.bool_),
    )


def _output_rows(capture: _Capture, output: Any, delta: bool) -> SupportRows:
    """One row per token of ``output.token_ids`` (all of them, or the new ones with ``delta``);
    rows that are missing or were captured for another token are empty and inexact. Costs
    ``O(new tokens)`` per output in every output kind: ``CUMULATIVE`` outputs view the rows of
    one growing buffer and compare only the new rows with their tokens. Native captures fill the
    same buffer from vLLM's sampling masks (:func:`_take_masks`)."""
    token_ids = output.token_ids
    n = len(token_ids)
    start, stop = capture.span(n, delta)
    if stop < start + n:
        log.error(
            "replay_plugin: vllm.sample_support: %d support rows for %d generated tokens; "
            "the missing rows are empty and inexact",
            stop - start,
            n,
        )
        capture.fill(np.asarray(token_ids[stop - start :], dtype=np.int64), delta)
    first = 0 if delta else capture.checked
    # One new row of the right token (the common streamed case) is checked without numpy.
    one_right = first == n - 1 and capture.buffer.sampled[start + first] == token_ids[first]
    if first < n and not one_right:
        capture.align(start + first, np.asarray(token_ids[first:n], dtype=np.int64))
    if not delta:
        capture.checked = n
    return capture.buffer.view(start, start + n)


def _take_masks(capture: _Capture, state: Any) -> None:
    """Native capture: the sampling masks the request's state (vLLM's ``RequestState``) received
    since the last output, converted into rows of the request's buffer, before vLLM builds the
    output. Read from the state, not from ``CompletionOutput.sampling_mask``, because vLLM puts a
    mask on an output only when the request finishes (0.30, 0.31: every output kind; 0.32+:
    ``CUMULATIVE`` and ``FINAL_ONLY``), so the outputs of a stream before the last, and every
    ``AsyncLLM`` output before the last in its default ``CUMULATIVE`` kind, carry none (seen on
    MRV2: their rows were empty and inexact). 0.32+ clears the state's chunks after a ``DELTA``
    output (``masks_seen`` is reset after the call); 0.30/0.31 keep one chunk per position,
    0.32+ one per engine step (CSR offsets when a step has several positions)."""
    chunks = getattr(state, "sampling_mask_chunks", None)
    if not chunks or len(chunks) <= capture.masks_seen:
        return
    tokens = state.detokenizer.output_token_ids
    lps = capture.sampled_logprobs()
    for chunk in chunks[capture.masks_seen :]:
        offsets = getattr(chunk, "offsets", None)
        start = capture.buffer.size
        stop = start + (1 if offsets is None else len(offsets) - 1)
        if stop > len(tokens):  # never expected: _output_rows fills what is missing, inexact
            log.error(
                "replay_plugin: vllm.sample_support: sampling masks for %d positions, %d tokens generated",
                stop,
                len(tokens),
            )
            break
        rows = support_from_sampling_mask(
            chunk,
            np.asarray(tokens[start:stop], dtype=np.int64),
            capture.width,
            sampled_logprobs=lps[start:stop] if len(lps) >= stop else None,
        )
        _count_rows(rows)
        capture.buffer.append(rows)


# --------------------------------------------------------------------------- wrappers


def _new_processor(wrapped, instance, args, kwargs):
    """``LogprobsProcessor.from_new_request``: the request's logprob container follows the
    *user's* ``logprobs`` (none asked, none returned); a planned request gets a ``_Capture``."""
    processor = wrapped(*args, **kwargs)
    request = kwargs["request"] if "request" in kwargs else args[1]
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    plan = extra.get(options.PLAN_KEY) if extra else None
    if not isinstance(plan, dict):  # only the plugin's admission sets it (clients are refused)
        return processor
    user = plan["user_logprobs"]
    if user is None:
        processor.logprobs = None
        processor.cumulative_logprob = None
    processor.num_logprobs = user
    processor.__dict__[_CAPTURE_ATTR] = _Capture(int(plan["width"]), bool(plan.get("native")))
    if ROW_LOGS:  # a request id used again: no log may read the new request's rows under the old slot
        rid = getattr(request, "request_id", None)
        for row_log in list(ROW_LOGS):
            row_log.forget(rid)
    return processor


def _capture_step(wrapped, instance, args, kwargs):
    """``LogprobsProcessor._update_sample_logprobs``: keep a copy of the step's ``[positions,
    N+1]`` id and logprob arrays, hand vLLM the user's ``logprobs + 1`` columns (or nothing)."""
    capture = instance.__dict__.get(_CAPTURE_ATTR)
    if capture is None:
        return wrapped(*args, **kwargs)
    lists = args[0] if args else kwargs["logprobs_lists"]
    ids, lps = lists[0], lists[1]
    capture.add(ids, lps)
    user = instance.num_logprobs
    if user is None:
        return None
    # vLLM computes one top-N for the whole engine step (N = the step's largest ``logprobs``)
    # and each request keeps its first ``logprobs + 1`` columns (vLLM 0.30/0.32,
    # ``Sampler.gather_logprobs``, ``append_logprobs_for_next_position``). Trimming here is that
    # same truncation. Surprise: CPU ``torch.topk`` orders exactly tied ids differently for
    # different N, so which tied id fills a user's last rank already depends, in stock vLLM, on
    # which other requests shared the step; the plugin makes N at least W, nothing else changes.
    if user != -1 and ids.shape[1] > user + 1:
        lists = type(lists)(ids[:, : user + 1], lps[:, : user + 1], *tuple(lists)[2:])
    return wrapped(lists)


_final_only: Any = None


def loggable(state: Any) -> _Capture | None:
    """The capture of a request (vLLM's ``RequestState``) that can keep its rows in the front
    end's ``RowLog``: processed rows (not native), the user asked no logprobs, the output kind
    is ``FINAL_ONLY`` (rows read once, at the end) and it has no rows of its own yet."""
    global _final_only
    processor = getattr(state, "logprobs_processor", None)
    capture = processor.__dict__.get(_CAPTURE_ATTR) if processor is not None else None
    if (
        processor is None
        or capture is None
        or capture.native
        or capture.log is not None
        or processor.num_logprobs is not None
        or capture._pending
        or capture.buffer.size
    ):
        return None
    if _final_only is None:
        from vllm.sampling_params import RequestOutputKind

        _final_only = RequestOutputKind.FINAL_ONLY
    return capture if getattr(state, "output_kind", None) == _final_only else None


def take_row(processor: Any, ids: np.ndarray, logprobs: np.ndarray, row: int) -> bool:
    """What :func:`_capture_step` does with an output's one row when the request's user asked no
    logprobs (keep it; vLLM gets none), for ``vllm.batch_rows``'s front end: ``ids`` and
    ``logprobs`` are one engine step's arrays, shared by the step's requests (row ``row`` is
    this request's). False (nothing done) when the request is not captured or its user wants
    logprob rows: the output then gets its rows as before."""
    capture = processor.__dict__.get(_CAPTURE_ATTR) if processor is not None else None
    if capture is None or processor.num_logprobs is not None:
        return False
    if capture.native or capture.log is not None:
        capture.add_shared(ids, logprobs, row)
        return True
    # add_shared's common case inlined: this runs for every captured request on every step
    capture._pending.append((ids, logprobs, row, row + 1))
    capture._loose += 1
    if capture._loose >= _COMPACT_AT:
        capture._compact()
    return True


def _attach(wrapped, instance, args, kwargs):
    """``RequestState._new_completion_output``: set ``CompletionOutput.sample_support``."""
    processor = instance.logprobs_processor
    capture = processor.__dict__.get(_CAPTURE_ATTR) if processor is not None else None
    if capture is None:
        return wrapped(*args, **kwargs)
    if capture.native:
        try:
            _take_masks(capture, instance)
        except Exception:  # the rows it did not convert are filled empty and inexact below
            log.exception(
                "replay_plugin: vllm.sample_support: could not read the sampling masks of request %s",
                getattr(instance, "request_id", "?"),
            )
    output = wrapped(*args, **kwargs)
    if capture.native:
        capture.masks_seen = len(getattr(instance, "sampling_mask_chunks", None) or ())
    from vllm.sampling_params import RequestOutputKind

    try:
        output.__dict__[OUTPUT_ATTR] = _output_rows(capture, output, instance.output_kind == RequestOutputKind.DELTA)
    except Exception:
        log.exception(
            "replay_plugin: vllm.sample_support: could not build the support rows of "
            "request %s; the output carries none",
            getattr(instance, "request_id", "?"),
        )
    return output


def _engine_refusal(wrapped, instance, args, kwargs):
    """``RequestState.make_request_output``: a request the engine core refused
    (``vllm.engine_admission``: it finishes with ``error`` and the reason in ``stop_reason``)
    raises ``SampleSupportRefused`` from ``AsyncLLM.generate`` (HTTP 400 with the reason when
    served); an ``LLMEngine`` output carries the reason, which ``support_of`` raises."""
    finish_reason = args[2] if len(args) > 2 else kwargs.get("finish_reason")
    stop_reason = args[3] if len(args) > 3 else kwargs.get("stop_reason")
    refused = engine_refusal(finish_reason, stop_reason)
    if refused is None:
        return wrapped(*args, **kwargs)
    setting, message = refused
    log.error("replay_plugin: request %s refused by the engine core: %s", getattr(instance, "request_id", "?"), message)
    if getattr(instance, "queue", None) is not None:
        return refusal(message, setting)  # AsyncLLM: put in the request's queue, raised by generate()
    output = wrapped(*args, **kwargs)
    for completion in getattr(output, "outputs", None) or ():
        completion.__dict__[REFUSED_ATTR] = message
    return output


def _merge_deltas(wrapped, instance, args, kwargs):
    """``RequestOutput.add``: when ``AsyncLLM`` merges ``DELTA`` outputs a slow consumer did not
    collect yet, concatenate their ``sample_support`` too (vLLM merges only its own fields)."""
    next_output = args[0] if args else kwargs["next_output"]
    aggregate = args[1] if len(args) > 1 else kwargs.get("aggregate", False)
    before = {c.index: c for c in instance.outputs} if aggregate else {}
    result = wrapped(*args, **kwargs)
    if aggregate:
        for completion in next_output.outputs:
            rows = getattr(completion, "__dict__", {}).get(OUTPUT_ATTR)
            target = before.get(completion.index)
            if rows is None or target is None or target is completion:
                continue
            previous = target.__dict__.get(OUTPUT_ATTR)
            if previous is None:
                log.error(
                    "replay_plugin: vllm.sample_support: merging a delta output into one "
                    "without support rows; the merged output carries none"
                )
                continue
            target.__dict__[OUTPUT_ATTR] = SupportRows.concat([previous, rows])
    return result
