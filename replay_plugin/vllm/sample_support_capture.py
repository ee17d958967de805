"""``vllm.sample_support``, capture: read each admitted request's logprob rows as support rows.

Part of the ``vllm.sample_support`` patch (``sample_support.py`` installs it). Stock vLLM
returns no sampler support on the V1 runner; this keeps the processed-logprob arrays of
opted-in requests, hands vLLM only the columns the user asked for, and puts
``core.support.SupportRows`` on each ``CompletionOutput``. Remove with the patch (see
compat_matrix.yaml).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from ..core.support import PAD, SupportRows, support_from_flat_logprobs, support_from_sampling_mask
from . import options

log = logging.getLogger("replay_plugin")


#: The ``CompletionOutput`` attribute that carries the rows.
OUTPUT_ATTR = "sample_support"
_CAPTURE_ATTR = "_replay_plugin_capture"


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
    global _warned_at
    inexact = int(np.count_nonzero(~rows.exact))
    with _stats_lock:
        _stats["rows"] += len(rows)
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
            rows.width,
            options.SLACK_ENV,
            options.SLACK_KEY,
        )


# --------------------------------------------------------------------------- per-request buffer


class _Capture:
    """Per request (per child of ``n > 1``): logprob arrays not converted yet, and converted rows
    not handed out yet (``DELTA``) or all rows (other output kinds)."""

    __slots__ = ("width", "native", "_ids", "_lps", "_rows", "_sampled_lp")

    def __init__(self, width: int, native: bool) -> None:
        self.width = width
        self.native = native
        self._ids: list[np.ndarray] = []
        self._lps: list[np.ndarray] = []
        self._rows: list[SupportRows] = []
        self._sampled_lp: list[np.ndarray] = []

    def add(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        # Copies: vLLM's arrays are views of the whole batch's step arrays, which a long request
        # would otherwise keep alive for every step.
        if self.native:
            self._sampled_lp.append(np.array(logprobs[:, 0], dtype=np.float32))
        else:
            self._ids.append(np.array(ids))
            self._lps.append(np.array(logprobs))

    def take(self, n: int, delta: bool) -> SupportRows:
        """The first ``n`` rows not handed out yet (``delta``: they are consumed) or, otherwise,
        the first ``n`` rows of the request. Pending arrays are converted once, vectorised;
        ``DELTA`` streams never re-copy rows they already returned."""
        if self._ids:
            new = _rows_from_arrays(self._ids, self._lps, self.width)
            self._ids, self._lps = [], []
            _count_rows(new)
            self._rows.append(new)
        if len(self._rows) > 1:
            self._rows = [SupportRows.concat(self._rows)]
        rows = self._rows[0] if self._rows else SupportRows.empty(0, self.width)
        if delta:
            self._rows = [_slice(rows, n, len(rows))] if len(rows) > n else []
        return _slice(rows, 0, n)

    def sampled_logprobs(self) -> np.ndarray:
        if len(self._sampled_lp) > 1:
            self._sampled_lp = [np.concatenate(self._sampled_lp)]
        return self._sampled_lp[0] if self._sampled_lp else np.zeros(0, np.float32)


def _slice(rows: SupportRows, start: int, stop: int) -> SupportRows:
    if start == 0 and stop >= len(rows):
        return rows
    return SupportRows(
        rows.ids[start:stop], rows.sampled[start:stop], rows.sampled_logprob[start:stop], rows.exact[start:stop]
    )


# --------------------------------------------------------------------------- conversion


def _rows_from_arrays(ids: list[np.ndarray], lps: list[np.ndarray], width: int) -> SupportRows:
    """Rows from vLLM's per-step ``[positions, N+1]`` arrays (``N`` may differ between steps:
    it is the batch's largest ``logprobs``)."""
    if len(ids) == 1:
        a, b = ids[0], lps[0]
        t, c = a.shape
        start = np.arange(t, dtype=np.int64) * c
        return support_from_flat_logprobs(
            {"start_indices": start, "end_indices": start + c, "token_ids": a.reshape(-1), "logprobs": b.reshape(-1)},
            width,
        )
    counts = np.fromiter((a.shape[0] for a in ids), np.int64, len(ids))
    cols = np.fromiter((a.shape[1] for a in ids), np.int64, len(ids))
    lens = np.repeat(cols, counts)
    end = np.cumsum(lens)
    flat = {
        "start_indices": end - lens,
        "end_indices": end,
        "token_ids": np.concatenate([a.reshape(-1) for a in ids]),
        "logprobs": np.concatenate([b.reshape(-1) for b in lps]),
    }
    return support_from_flat_logprobs(flat, width)


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
    rows that are missing or were captured for another token are empty and inexact."""
    tokens = np.asarray(list(output.token_ids), dtype=np.int64)
    n = len(tokens)
    if capture.native:
        mask = getattr(output, "sampling_mask", None)
        if mask is None:
            return _missing_rows(tokens, capture.width) if n else SupportRows.empty(0, capture.width)
        rows = rows_from_sampling_mask(mask, tokens, capture.width, capture.sampled_logprobs())
        if delta or output.finished():  # cumulative outputs repeat earlier rows: count them once
            _count_rows(rows)
    else:
        rows = capture.take(n, delta)
        if len(rows) < n:
            log.error(
                "replay_plugin: vllm.sample_support: %d support rows for %d generated tokens; "
                "the missing rows are empty and inexact",
                len(rows),
                n,
            )
            rows = SupportRows.concat([rows, _missing_rows(tokens[len(rows) :], capture.width)])
    misaligned = rows.sampled.astype(np.int64) != tokens
    if misaligned.any():
        log.error(
            "replay_plugin: vllm.sample_support: %d support rows were captured for other tokens "
            "than the output's; flagged inexact",
            int(misaligned.sum()),
        )
        rows = SupportRows(
            np.where(misaligned[:, None], PAD, rows.ids),
            tokens.astype(np.int32),
            np.where(misaligned, np.nan, rows.sampled_logprob),
            rows.exact & ~misaligned,
        )
    return rows


# --------------------------------------------------------------------------- wrappers


def _new_processor(wrapped, instance, args, kwargs):
    """``LogprobsProcessor.from_new_request``: the request's logprob container follows the
    *user's* ``logprobs`` (none asked, none returned); a planned request gets a ``_Capture``."""
    processor = wrapped(*args, **kwargs)
    request = kwargs["request"] if "request" in kwargs else args[1]
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    plan = extra.get(options.PLAN_KEY) if extra else None
    if plan is None:
        return processor
    user = plan["user_logprobs"]
    if user is None:
        processor.logprobs = None
        processor.cumulative_logprob = None
    processor.num_logprobs = user
    processor.__dict__[_CAPTURE_ATTR] = _Capture(int(plan["width"]), bool(plan.get("native")))
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


def _attach(wrapped, instance, args, kwargs):
    """``RequestState._new_completion_output``: set ``CompletionOutput.sample_support``."""
    output = wrapped(*args, **kwargs)
    processor = instance.logprobs_processor
    capture = processor.__dict__.get(_CAPTURE_ATTR) if processor is not None else None
    if capture is None:
        return output
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
