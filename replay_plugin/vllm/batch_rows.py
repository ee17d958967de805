"""Patch ``vllm.batch_rows``: the logprob rows of a step's captured requests travel as one batch.

Gap (vLLM 0.30-0.33, ``v1/core/sched/scheduler.py`` ``Scheduler.update_from_output``): the
engine core slices the step's logprob arrays per request and every request's
``EngineCoreOutput`` carries its own ``LogprobsLists`` (three numpy arrays), which vLLM's msgpack
transport encodes in the engine core and decodes in the front end one array at a time, through
Python hooks. Support capture asks for logprobs on every step of every opted-in request, so this
per-request plumbing was most of its engine-core and front-end cost: measured with vLLM's own
encoder and decoder on an idle 2-core machine, 32 requests x one step cost +270-300 us to build
and encode and +185-290 us to decode with per-request rows, against +7-30 and +2-10 us for the
same rows sent as one batch.

Here, in the engine core, the rows of the step's outputs whose requests the front end planned
for capture with ``"batch": True`` (``vllm.sample_support``'s admission sets it: that patch holds
the front-end half, :func:`unpack_outputs`) go in one ``LogprobsLists`` on the first such
output; the others carry none. Its ``cu_num_generated_tokens`` (vLLM's field for per-request
offsets, which are never negative) holds the layout: ``[MAGIC, d_0, end_0, d_1, end_1, ...]``,
where ``d_j`` is the output's distance from the carrier in the step's output list and
``rows[end_{j-1}:end_j]`` its rows. When every request of the step that asks for rows is planned
(an RL job that opts every request in), vLLM slices none: the carrier is gathered from the step's
arrays directly (see ``_pack``). The front end gives every listed output its own rows back
before vLLM reads them, across ``AsyncLLM``'s chunking of a step's outputs
(``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``); a captured request whose user asked no logprobs takes its
row straight from the carrier (one copy of the carrier per step, see
``sample_support_capture.take_row``), and the requests that finish in the step have their rows
converted in one call (``convert_finishing``). Outputs of requests that did not opt in are never touched
(byte for byte stock); without this patch in the engine core the rows travel per request as in
stock vLLM, and the front end handles both. Remove when vLLM sends a step's logprob rows as one
batch.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np

from ..patcher import Patcher
from . import options
from . import sample_support_capture as capture

log = logging.getLogger("replay_plugin")

#: First element of a carrier's ``cu_num_generated_tokens`` (vLLM's own are offsets >= 0).
MAGIC = -0x52335250
#: The plan key that lets the engine core batch a request's rows (set by the front end's admission).
BATCH_KEY = "batch"
_PENDING = "_replay_plugin_batch_rows"

_stats = {"packed": 0, "unpacked": 0}
#: Whether this process planned a request whose rows may come back batched: only a front end that
#: did looks at its outputs for carriers (the others' ``process_outputs`` runs as stock).
_expecting = False


def expect_batches() -> None:
    """Called by the admission when it plans a request with ``"batch": True`` in this process."""
    global _expecting
    _expecting = True


def batch_stats() -> dict:
    """Counts in this process: outputs whose rows this engine core packed into a batch
    (``packed``), outputs this front end gave their rows back from one (``unpacked``)."""
    return dict(_stats)


# --------------------------------------------------------------------------- engine core


def _batched(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    plan = extra.get(options.PLAN_KEY) if extra else None
    return isinstance(plan, dict) and plan.get(BATCH_KEY) is True


def pack_outputs(outputs: list, requests: dict) -> bool:
    """Move the rows of ``outputs`` (one client's ``EngineCoreOutput`` list of a step) whose
    request in ``requests`` is planned for batching into one carrier; True when it did. Fewer
    than two such outputs, rows of different widths or multi-token layouts are left as they are,
    and so is an output with no rows.
    Nothing is changed until the carrier is built."""
    picked: list[int] = []
    parts: list[Any] = []
    for i, out in enumerate(outputs):
        lists = out.new_logprobs
        if lists is None or lists.logprob_token_ids.shape[0] == 0:
            continue  # vLLM slices rows for an output without new tokens too (e.g. a stop)
        request = requests.get(out.request_id)
        if request is None or not _batched(request):
            continue  # not planned, or already freed (its final output): travels on its own
        picked.append(i)
        parts.append(lists)
    if len(picked) < 2:
        return False
    columns = parts[0].logprob_token_ids.shape[1]
    if any(p.cu_num_generated_tokens is not None or p.logprob_token_ids.shape[1] != columns for p in parts):
        return False
    ids = np.concatenate([p.logprob_token_ids for p in parts])
    logprobs = np.concatenate([p.logprobs for p in parts])
    ranks = np.concatenate([p.sampled_token_ranks for p in parts])
    layout = [MAGIC]
    end = 0
    first = picked[0]
    for i, part in zip(picked, parts):
        end += part.logprob_token_ids.shape[0]
        layout += [i - first, end]
    outputs[first].new_logprobs = type(parts[0])(ids, logprobs, ranks, layout)
    for i in picked[1:]:
        outputs[i].new_logprobs = None
    _stats["packed"] += len(picked)
    return True


def _wanted_rows(scheduler_output: Any, requests: dict) -> set | None:
    """The step's requests vLLM would slice logprob rows for (``num_logprobs`` set), when every
    one of them is planned for batching: then vLLM need not slice any (None otherwise)."""
    wanted = set()
    for req_id in getattr(scheduler_output, "num_scheduled_tokens", None) or ():
        request = requests.get(req_id)
        params = getattr(request, "sampling_params", None)
        if params is None or params.num_logprobs is None:
            continue
        if not _batched(request):
            return None
        wanted.add(req_id)
    return wanted


def gather_outputs(outputs: list, lists: Any, index: dict, wanted: set) -> None:
    """Give the ``wanted`` outputs of one client's step their rows of the step's ``lists``
    (rows of ``index[request_id]``, one per new token, as vLLM slices them), batched into one
    carrier gathered with one fancy index per array when there are two or more with rows."""
    picked: list[int] = []
    rows: list[int] = []
    layout = [MAGIC]
    for i, out in enumerate(outputs):
        at = index.get(out.request_id)
        if at is None or out.request_id not in wanted:
            continue  # not asking for rows, or not computed this step (an error output)
        n = len(out.new_token_ids)
        if n == 0:
            out.new_logprobs = lists.slice_request(at, 0)  # as vLLM: an empty slice, own output
            continue
        layout.append(i - picked[0] if picked else 0)
        picked.append(i)
        rows.extend(range(at, at + n))
        layout.append(len(rows))
    if len(picked) == 1:
        outputs[picked[0]].new_logprobs = lists.slice_request(rows[0], len(rows))
    elif picked:
        take = np.asarray(rows, dtype=np.intp)
        outputs[picked[0]].new_logprobs = type(lists)(
            lists.logprob_token_ids[take], lists.logprobs[take], lists.sampled_token_ranks[take], layout
        )
        _stats["packed"] += len(picked)


def _pack(wrapped, instance, args, kwargs):
    """``Scheduler.update_from_output``: batch the captured rows of each client's outputs.

    When every request of the step that asks for logprob rows is planned for batching (an RL
    job that opted every request in), vLLM is handed the step without its logprob rows, so it
    slices none (vLLM reads ``model_runner_output.logprobs`` only to slice it per request, 0.30
    to 0.33), and each client's rows are gathered into its carrier at once: per output one dict
    lookup instead of vLLM's slice and this patch's re-concatenation. Otherwise vLLM slices as
    stock and :func:`pack_outputs` batches the planned outputs' slices."""
    scheduler_output = args[0] if args else kwargs.get("scheduler_output")
    runner_output = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
    requests = getattr(instance, "requests", None)
    lists = getattr(runner_output, "logprobs", None)
    wanted = None
    if (
        requests is not None
        and lists is not None
        and lists.cu_num_generated_tokens is None  # one row per request (no speculative tokens)
        and isinstance(getattr(runner_output, "req_id_to_index", None), dict)
    ):
        wanted = _wanted_rows(scheduler_output, requests)
    if wanted:  # vLLM slices nothing; the rows are gathered below
        runner_output.logprobs = None
    try:
        result = wrapped(*args, **kwargs)
    finally:
        if wanted:
            runner_output.logprobs = lists
    if isinstance(result, dict) and requests is not None:
        for engine_outputs in result.values():
            outputs = getattr(engine_outputs, "outputs", None)
            if outputs and wanted:
                gather_outputs(outputs, lists, runner_output.req_id_to_index, wanted)
            elif outputs and len(outputs) > 1:
                pack_outputs(outputs, requests)
    return result


def install(patcher: Patcher) -> None:
    patcher.wrap("Scheduler.update_from_output", _pack)


# --------------------------------------------------------------------------- front end


class _Pending:
    """A carrier being unpacked: its arrays, the ``(distance, start, end)`` entries not handed
    out yet, and how many outputs from the carrier on were seen (chunks continue the count)."""

    __slots__ = ("lists", "entries", "seen", "_owned")

    def __init__(self, lists: Any) -> None:
        layout = lists.cu_num_generated_tokens
        rows = lists.logprob_token_ids.shape[0]
        if (
            len(layout) < 3
            or len(layout) % 2 == 0
            or lists.logprobs.shape[0] != rows
            or lists.sampled_token_ranks.shape[0] != rows
        ):
            raise ValueError(f"malformed batch layout of {len(layout)} entries for {rows} rows")
        entries: deque = deque()
        start = previous = 0
        for k in range(1, len(layout), 2):
            distance, end = layout[k], layout[k + 1]
            if not (isinstance(distance, int) and isinstance(end, int)):
                raise ValueError("batch layout entries must be integers")
            if (entries and distance <= previous) or distance < 0 or not start < end <= rows:
                raise ValueError(f"batch layout entry {(distance, end)} out of order or range ({rows} rows)")
            entries.append((distance, start, end))
            start, previous = end, distance
        if start != rows or entries[0][0] != 0:
            raise ValueError(f"batch layout covers {start} of {rows} rows")
        self.lists = lists
        self.entries = entries
        self.seen = 0
        self._owned: tuple[np.ndarray, np.ndarray] | None = None

    def owned(self) -> tuple[np.ndarray, np.ndarray]:
        """The carrier's ids and logprobs copied once (the decoded arrays may be views of the
        transport's buffers), for rows that outlive this step."""
        if self._owned is None:
            self._owned = (np.array(self.lists.logprob_token_ids), np.array(self.lists.logprobs))
        return self._owned


def _lost(pending: _Pending) -> None:
    log.error(
        "replay_plugin: vllm.batch_rows: %d batched support-row entries were never handed out; "
        "their tokens' rows are inexact",
        len(pending.entries),
    )


def _is_carrier(lists: Any) -> bool:
    layout = lists.cu_num_generated_tokens
    return bool(layout) and layout[0] == MAGIC


def unpack_outputs(outputs: Any, pending: _Pending | None, take: Any = None) -> _Pending | None:
    """Give every output a carrier lists its own rows (``LogprobsLists`` views of the carrier's
    arrays), in place; returns the carrier still pending when ``outputs`` is one chunk of a step
    and its later entries are in the next chunk. A malformed carrier is dropped (logged): its
    outputs then have no rows, and capture flags their tokens' rows inexact.

    ``take(output, ids, logprobs, row)``, when given, is offered each one-row entry first, with
    a copy of the carrier's arrays made once per carrier: True means it kept the row (the
    support capture of a request whose user asked no logprobs) and the output is left without
    rows, as vLLM would leave it after the capture took them; per output one call instead of a
    view, vLLM's logprob update and the capture's wrapper and copies."""
    for out in outputs:
        lists = out.new_logprobs
        if lists is not None and _is_carrier(lists):
            if pending is not None:
                _lost(pending)
            try:
                pending = _Pending(lists)
            except ValueError as exc:
                log.error("replay_plugin: vllm.batch_rows: dropped a batch of support rows: %s", exc)
                out.new_logprobs = None
                pending = None
                continue
        if pending is None:
            continue
        distance, start, end = pending.entries[0]
        if distance == pending.seen:
            pending.entries.popleft()
            rows = pending.lists
            if take is not None and end - start == 1 and take(out, *pending.owned(), start):
                out.new_logprobs = None
            else:
                out.new_logprobs = type(rows)(
                    rows.logprob_token_ids[start:end],
                    rows.logprobs[start:end],
                    rows.sampled_token_ranks[start:end],
                    None,
                )
            _stats["unpacked"] += 1
            if not pending.entries:
                pending = None
                continue
        pending.seen += 1
    return pending


def _taker(states: dict) -> Any:
    """``take`` for :func:`unpack_outputs` over ``states`` (vLLM's
    ``OutputProcessor.request_states``): the support capture of the output's request keeps a
    one-row entry itself when that request's user asked no logprobs
    (``sample_support_capture.take_row``)."""

    def take(out: Any, ids: Any, logprobs: Any, row: int) -> bool:
        state = states.get(out.request_id)
        return state is not None and capture.take_row(state.logprobs_processor, ids, logprobs, row)

    return take


def _unpack(wrapped, instance, args, kwargs):
    """``OutputProcessor.process_outputs``: per-request rows back before vLLM reads them. The
    chunks of one step share its ``engine_core_timestamp``: a carrier still pending when the
    next step arrives is dropped (logged), never applied to another step's outputs."""
    if not _expecting:
        return wrapped(*args, **kwargs)
    outputs = args[0] if args else kwargs.get("engine_core_outputs")
    stamp = args[1] if len(args) > 1 else kwargs.get("engine_core_timestamp")
    pending, pending_stamp = instance.__dict__.pop(_PENDING, (None, None))
    if pending is not None and stamp != pending_stamp:
        _lost(pending)
        pending = None
    states = getattr(instance, "request_states", None)
    states = states if isinstance(states, dict) else None
    # AsyncLLM passes numpy object arrays (np.array_split chunks): no truth value, only len()
    if outputs is not None and len(outputs):
        try:
            pending = unpack_outputs(outputs, pending, _taker(states) if states is not None else None)
        except Exception:
            log.exception("replay_plugin: vllm.batch_rows: could not unpack batched support rows")
            pending = None
        if pending is not None:
            instance.__dict__[_PENDING] = (pending, stamp)
        if states is not None:
            try:
                capture.convert_finishing(outputs, states)
            except Exception:  # the rows stay pending: each request converts its own
                log.exception("replay_plugin: vllm.batch_rows: could not convert finishing requests' rows together")
    return wrapped(*args, **kwargs)
