"""Patch ``vllm.sample_support``: the exact sampler support of every generated token, from stock vLLM.

The gap (vLLM 0.30-0.32, V1 model runner; every runner a CPU can run): nothing returns the set
of token ids the sampler could have drawn. The closest stock output, ``logprobs=top_k`` rows,
is not that set: the PyTorch top-k keeps *every* token tied with the k-th logit (the support is
then wider than ``top_k``, research/vllm.md section 5), an approximate Triton pivot (0.17+, GPU)
can keep a different count, and in the default ``raw_logprobs`` mode the rows rank the logits
before temperature, penalties and top-k/top-p/min-p. The seeds overwrote the weakest member of
such rows with the sampled token and recorded a wrong support. vLLM >= 0.28 has an exact native
``return_sampling_mask``, but only on Model Runner V2 (GPU with Triton).

Capture route (chosen over a worker-side hook on the sampler's processed logits): the support
is every id with a finite *processed* logprob, and vLLM already ships processed logprobs from
the worker to the API server. An opted-in request asks the engine, internally, for
``N = W = top_k + slack`` logprob entries per token (``W`` capped at the vocabulary); the patch
reads those rows as numpy arrays in the API-server process, before vLLM turns them into Python
objects, and keeps only what the user asked for. Everything happens in the API-server process:
no worker or engine-core code is touched, so every executor and process layout (in-process,
multiprocess, Ray, several API servers) works unchanged, and FlashInfer/aiter samplers, which
never materialise processed logits, are switched off by vLLM itself in processed mode. A row
is *exact* when it provably holds the whole support: one of the ``N`` entries is ``-inf`` (so
``topk`` saw every finite one) or the seen probabilities sum to 1 within
``core.support.DEFAULT_MASS_TOLERANCE``, it contains the sampled token and it fits in ``W``.
Rows that cannot be proven exact (more than ``W`` tied or surviving tokens) are kept as seen,
flagged ``exact=False`` and counted (:func:`capture_stats`, a warning when the count grows);
they are never repaired silently. With the default slack (16) ties of up to 17 tokens at the
k-th logit are exact.

What each target does:

``EngineArgs.create_engine_config``
    only for a job that opted in (``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=opt-in|all``):
    ``logprobs_mode -> "processed_logprobs"`` and ``max_logprobs >= MAX_WIDTH`` (default 128),
    logged at WARNING and noted in the status file. The caller's ``EngineArgs`` object is left
    as it was. Other jobs get the configuration they asked for, untouched.
``InputProcessor.process_inputs``
    after vLLM resolved the request (generation-config defaults merged, params cloned):
    requests that opt in are checked with ``core.sampler.check_replayable`` against the engine
    configuration and refused *before any compute* with :class:`SampleSupportRefused` (a
    ``VLLMValidationError``, so HTTP 400, and a ``ValueError``) naming the setting; accepted
    ones get ``logprobs = max(user's, W)`` on vLLM's private clone and a plan under
    ``extra_args[options.PLAN_KEY]``.
``LogprobsProcessor.from_new_request``
    the request's logprob container is rebuilt from the *user's* ``logprobs``: none asked, none
    returned (``logprobs`` and ``cumulative_logprob`` stay None, as in stock vLLM).
``LogprobsProcessor._update_sample_logprobs``
    keeps a copy of the ``[positions, N+1]`` id and logprob arrays, then hands vLLM the first
    ``user + 1`` columns only (vLLM itself truncates wider batch rows to a request's own
    ``logprobs`` the same way), or nothing when the user asked none.
``RequestState._new_completion_output``
    sets ``CompletionOutput.sample_support`` (a ``core.support.SupportRows``, one row per token
    in ``token_ids``: all of them, or the new ones in ``DELTA`` mode).
``RequestOutput.add``
    when ``AsyncLLM`` merges ``DELTA`` outputs a slow consumer did not collect yet, the merged
    output's ``sample_support`` is concatenated too (vLLM merges only its own fields).

Native sampling mask: when the engine runs with ``return_sampling_mask`` (vLLM >= 0.28, Model
Runner V2; the plugin never switches it on), rows come from ``CompletionOutput.sampling_mask``
(:func:`rows_from_sampling_mask`) and the internal logprobs request is only ``max(user's, 0)``
(for the sampled token's processed logprob). Not runnable on CPU: the conversion is unit-tested
on vLLM's real classes; the wiring is untested (see compat_matrix.yaml).

Not covered: requests sent as pre-built ``EngineCoreRequest`` objects (deprecated in vLLM; they
bypass ``process_inputs``), logits processors installed through the ``vllm.logits_processors``
entry-point group (invisible to the replayability check), speculative decoding (refused).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import numpy as np

from .. import status
from ..core.sampler import check_replayable
from ..core.support import PAD, SupportRows, support_from_flat_logprobs, support_from_sampling_mask
from ..registry import Patcher
from . import options

log = logging.getLogger("replay_plugin")

CREATE_ENGINE_CONFIG = "vllm.engine.arg_utils:EngineArgs.create_engine_config"
PROCESS_INPUTS = "vllm.v1.engine.input_processor:InputProcessor.process_inputs"
NEW_LOGPROBS_PROCESSOR = "vllm.v1.engine.logprobs:LogprobsProcessor.from_new_request"
UPDATE_SAMPLE_LOGPROBS = "vllm.v1.engine.logprobs:LogprobsProcessor._update_sample_logprobs"
NEW_COMPLETION_OUTPUT = "vllm.v1.engine.output_processor:RequestState._new_completion_output"
REQUEST_OUTPUT_ADD = "vllm.outputs:RequestOutput.add"
TARGETS = (
    CREATE_ENGINE_CONFIG,
    PROCESS_INPUTS,
    NEW_LOGPROBS_PROCESSOR,
    UPDATE_SAMPLE_LOGPROBS,
    NEW_COMPLETION_OUTPUT,
    REQUEST_OUTPUT_ADD,
)

#: The ``CompletionOutput`` attribute that carries the rows.
OUTPUT_ATTR = "sample_support"
_CAPTURE_ATTR = "_replay_plugin_capture"
PROCESSED = "processed_logprobs"


# --------------------------------------------------------------------------- public helpers


def sample_support(output: Any) -> Optional[SupportRows]:
    """The ``SupportRows`` vLLM returned on a ``CompletionOutput`` (None when not captured)."""
    return getattr(output, "__dict__", {}).get(OUTPUT_ATTR)


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
            bad, total, rows.width, options.SLACK_ENV, options.SLACK_KEY,
        )


class SampleSupportRefused(ValueError):
    """A request opted into support capture with settings that cannot be replayed.

    ``setting`` names the sampler or engine setting (``temperature``, ``top_k``,
    ``logprobs_mode``...). The class actually raised also derives from vLLM's
    ``VLLMValidationError`` so that the OpenAI server answers HTTP 400.
    """

    setting: Optional[str] = None


_refusal_class: Optional[type] = None


def _refusal(message: str, setting: Optional[str], value: Any = None) -> SampleSupportRefused:
    global _refusal_class
    if _refusal_class is None:  # vLLM is imported by now: this code runs inside its front end
        from vllm.exceptions import VLLMValidationError

        class Refused(SampleSupportRefused, VLLMValidationError):
            def __init__(self, message: str, *, parameter: Optional[str] = None, value: Any = None) -> None:
                VLLMValidationError.__init__(self, message, parameter=parameter, value=value)
                self.setting = parameter

        Refused.__name__ = Refused.__qualname__ = "SampleSupportRefused"
        _refusal_class = Refused
    return _refusal_class(message, parameter=setting, value=value)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("replay_plugin: %s", message)
        status.note(message)


# --------------------------------------------------------------------------- engine configuration


def _fit_engine(wrapped, instance, args, kwargs):
    try:
        mode = options.job_mode()
        max_width = options.job_max_width() if mode else 0
    except options.OptionError as exc:
        log.warning("replay_plugin: vllm.sample_support: %s; engine configuration left unchanged", exc)
        mode = ""
    if not mode:
        return wrapped(*args, **kwargs)
    saved: dict[str, Any] = {}
    changes: list[str] = []
    current_mode = getattr(instance, "logprobs_mode", None)
    if str(getattr(current_mode, "value", current_mode)) != PROCESSED:
        saved["logprobs_mode"] = current_mode
        instance.logprobs_mode = PROCESSED
        changes.append(f"logprobs_mode {current_mode!s} -> {PROCESSED}")
    current_max = getattr(instance, "max_logprobs", None)
    if isinstance(current_max, int) and current_max != -1 and current_max < max_width:
        saved["max_logprobs"] = current_max
        instance.max_logprobs = max_width
        changes.append(f"max_logprobs {current_max} -> {max_width}")
    try:
        config = wrapped(*args, **kwargs)
    finally:
        for name, value in saved.items():
            setattr(instance, name, value)
    if changes:
        message = (
            f"vllm.sample_support: {options.REQUESTS_ENV}={mode}: engine configuration changed: "
            + ", ".join(changes)
        )
        log.warning("replay_plugin: %s (logprobs of every request are now processed logprobs)", message)
        status.note(message)
    return config


# --------------------------------------------------------------------------- admission


def plan_request(params: Any, vllm_config: Any) -> Optional[dict]:
    """The capture plan of a resolved ``SamplingParams``, or None when it does not opt in.

    Raises ``SampleSupportRefused`` (naming the setting) when it opts in but cannot be replayed.
    """
    extra = params.extra_args
    try:
        wanted = options.wants_support(extra)
    except options.OptionError as exc:
        if exc.key != options.REQUESTS_ENV:  # the request's own key: refuse it
            raise _refusal(f"replay_plugin: {exc}", exc.key) from None
        _warn_once(f"vllm.sample_support: {exc}; requests that do not set {options.SUPPORT_KEY!r} "
                   "are not captured")  # a typo in the job's knob must not fail every request
        wanted = False
    if not wanted:
        return None
    try:
        slack = options.request_slack(extra)
    except options.OptionError as exc:
        raise _refusal(f"replay_plugin: {exc}", exc.key) from None
    model_config = getattr(vllm_config, "model_config", None)
    where = f"request opted into sample-support capture ({options.SUPPORT_KEY!r} or {options.REQUESTS_ENV}=all)"
    # vLLM 0.30/0.32 ``Sampler.forward``: when any request of a step sets logprob_token_ids, the
    # step's logprob rows of *every* request are the listed-id rows ("prefer
    # logprob_token_ids"); a request of our own cannot be captured then. Other requests that
    # set it make our rows lack their members: caught by the exactness proof (flagged, counted).
    if getattr(params, "logprob_token_ids", None):
        raise _refusal(
            f"{where} but sampler setting 'logprob_token_ids' is not replayable with it: vLLM "
            "then replaces the top-k logprob rows of the whole batch by the listed ids",
            "logprob_token_ids",
        )
    top_k = params.top_k
    width = None
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 1:
        width = top_k + slack
        vocab = model_config.get_vocab_size() if model_config is not None else None
        if vocab:
            width = min(width, int(vocab))
    try:
        check_replayable(params, vllm_config, width=width)
    except ValueError as exc:  # NotReplayable names the setting; anything else is refused unnamed
        setting = getattr(exc, "setting", None)
        hint = ""
        if setting in ("logprobs_mode", "max_logprobs"):
            hint = (f" (set {options.REQUESTS_ENV}=opt-in before the engine starts and the plugin "
                    "fits the engine)")
        if setting == "max_logprobs":
            hint = f" (W = top_k {top_k} + slack {slack})" + hint
        raise _refusal(f"{where} but {exc}{hint}", setting) from None
    assert width is not None  # check_replayable refuses top_k <= 1
    user = params.logprobs
    native = bool(getattr(model_config, "return_sampling_mask", False))
    if user == -1:
        internal = -1
    elif native:
        internal = 0 if user is None else user
    else:
        internal = width if user is None else max(user, width)
    return {"width": int(width), "user_logprobs": user, "internal_logprobs": internal, "native": native}


def _admit(wrapped, instance, args, kwargs):
    request = wrapped(*args, **kwargs)
    params = getattr(request, "sampling_params", None)
    if params is None:
        return request
    plan = plan_request(params, instance.vllm_config)
    if plan is None:
        return request
    # ``params`` is vLLM's private copy (process_inputs clones the caller's params; with
    # ``skip_clone`` a shallow copy, so extra_args is replaced, never mutated).
    params.logprobs = plan["internal_logprobs"]
    params.extra_args = {**(params.extra_args or {}), options.PLAN_KEY: plan}
    with _stats_lock:
        _stats["requests"] += 1
    return request


# --------------------------------------------------------------------------- capture


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
    return SupportRows(rows.ids[start:stop], rows.sampled[start:stop], rows.sampled_logprob[start:stop],
                       rows.exact[start:stop])


def _rows_from_arrays(ids: list[np.ndarray], lps: list[np.ndarray], width: int) -> SupportRows:
    """Rows from vLLM's per-step ``[positions, N+1]`` arrays (``N`` may differ between steps:
    it is the batch's largest ``logprobs``)."""
    if len(ids) == 1:
        a, b = ids[0], lps[0]
        t, c = a.shape
        start = np.arange(t, dtype=np.int64) * c
        return support_from_flat_logprobs(
            {"start_indices": start, "end_indices": start + c, "token_ids": a.reshape(-1),
             "logprobs": b.reshape(-1)}, width)
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


def rows_from_sampling_mask(mask: Any, token_ids: Any, width: int,
                            sampled_logprobs: Optional[np.ndarray] = None) -> SupportRows:
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
    per_position = per_position[len(per_position) - t:]
    lp = None
    if sampled_logprobs is not None and len(sampled_logprobs) >= t:
        lp = np.asarray(sampled_logprobs, dtype=np.float32)[len(sampled_logprobs) - t:]
    return support_from_sampling_mask(per_position, np.asarray(list(token_ids), dtype=np.int64), width,
                                      sampled_logprobs=lp)


def _new_processor(wrapped, instance, args, kwargs):
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


def _missing_rows(token_ids: np.ndarray, width: int) -> SupportRows:
    return SupportRows(
        ids=np.full((len(token_ids), width), PAD, dtype=np.int32),
        sampled=token_ids.astype(np.int32),
        sampled_logprob=np.full(len(token_ids), np.nan, dtype=np.float32),
        exact=np.zeros(len(token_ids), dtype=np.bool_),
    )


def _output_rows(capture: _Capture, output: Any, delta: bool) -> SupportRows:
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
            log.error("replay_plugin: vllm.sample_support: %d support rows for %d generated tokens; "
                      "the missing rows are empty and inexact", len(rows), n)
            rows = SupportRows.concat([rows, _missing_rows(tokens[len(rows):], capture.width)])
    misaligned = rows.sampled.astype(np.int64) != tokens
    if misaligned.any():
        log.error("replay_plugin: vllm.sample_support: %d support rows were captured for other tokens "
                  "than the output's; flagged inexact", int(misaligned.sum()))
        rows = SupportRows(np.where(misaligned[:, None], PAD, rows.ids), tokens.astype(np.int32),
                           np.where(misaligned, np.nan, rows.sampled_logprob), rows.exact & ~misaligned)
    return rows


def _attach(wrapped, instance, args, kwargs):
    output = wrapped(*args, **kwargs)
    processor = instance.logprobs_processor
    capture = processor.__dict__.get(_CAPTURE_ATTR) if processor is not None else None
    if capture is None:
        return output
    from vllm.sampling_params import RequestOutputKind

    try:
        output.__dict__[OUTPUT_ATTR] = _output_rows(capture, output, instance.output_kind == RequestOutputKind.DELTA)
    except Exception:  # noqa: BLE001 - never take the engine's output loop down
        log.exception("replay_plugin: vllm.sample_support: could not build the support rows of "
                      "request %s; the output carries none", getattr(instance, "request_id", "?"))
    return output


def _merge_deltas(wrapped, instance, args, kwargs):
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
                log.error("replay_plugin: vllm.sample_support: merging a delta output into one "
                          "without support rows; the merged output carries none")
                continue
            target.__dict__[OUTPUT_ATTR] = SupportRows.concat([previous, rows])
    return result


def install(patcher: Patcher) -> None:
    patcher.wrap(CREATE_ENGINE_CONFIG, _fit_engine)
    patcher.wrap(PROCESS_INPUTS, _admit)
    patcher.wrap(NEW_LOGPROBS_PROCESSOR, _new_processor)
    patcher.wrap(UPDATE_SAMPLE_LOGPROBS, _capture_step)
    patcher.wrap(NEW_COMPLETION_OUTPUT, _attach)
    patcher.wrap(REQUEST_OUTPUT_ADD, _merge_deltas)
