"""``vllm.batch_rows`` on vLLM's real output classes and msgpack transport, without an engine.

The gap: stock vLLM gives every request's ``EngineCoreOutput`` of a step its own
``LogprobsLists`` (three numpy arrays), each encoded and decoded on its own. With the patch the
captured requests' rows travel in one carrier and the front end gives every output exactly its
rows back, across ``AsyncLLM``'s chunks; outputs of other requests are not touched. The engine
path (a real engine core packing, the front end unpacking) runs in test_offline.py and, with
chunks of two outputs, in test_served.py.
"""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(120)

W = 6


@pytest.fixture(autouse=True)
def _vllm():
    need("vllm")


def _request(planned: bool, batch: bool = True):
    from vllm import SamplingParams

    from replay_plugin.vllm import options

    extra = {options.PLAN_KEY: {"width": W, "user_logprobs": None, "native": False, "batch": batch}}
    # the engine core reads only Request.sampling_params; vLLM's Request needs a whole engine
    # planned: the admission asks for W logprobs (vllm.sample_support)
    params = SamplingParams(top_k=4, logprobs=W if planned else None, extra_args=extra if planned else None)
    return types.SimpleNamespace(sampling_params=params)


def _step():
    """One step's outputs as vLLM's scheduler builds them: per-request slices of the step's
    arrays. r0, r2, r3, r5 are planned; r1 is a plain request that asked for logprobs; r4
    asked for none; r5 finished (its request already freed)."""
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.outputs import LogprobsLists

    rng = np.random.default_rng(7)
    n = 6
    batch = LogprobsLists(
        rng.integers(0, 500, (n, W + 1)).astype(np.int32),
        rng.standard_normal((n, W + 1)).astype(np.float32),
        rng.integers(0, 9, n).astype(np.int64),
    )
    outputs = []
    for i in range(n):
        lists = None if i == 4 else batch.slice_request(i, 1)
        outputs.append(
            EngineCoreOutput(request_id=f"r{i}", new_token_ids=[int(batch.logprob_token_ids[i, 0])], new_logprobs=lists)
        )
    requests = {f"r{i}": _request(planned=i in (0, 2, 3, 5)) for i in range(5)}  # r5 freed
    return outputs, requests


def _rows(outputs):
    return [None if o.new_logprobs is None else tuple(np.array(a) for a in tuple(o.new_logprobs)[:3]) for o in outputs]


def _wire(outputs):
    """Encode and decode one client's outputs with vLLM's own engine-core transport."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    frames = MsgpackEncoder().encode(EngineCoreOutputs(engine_index=0, outputs=outputs, timestamp=1.5))
    return MsgpackDecoder(EngineCoreOutputs).decode(frames).outputs


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            for u, v in zip(x, y):
                assert u.dtype == v.dtype and np.array_equal(u, v)


@pytest.mark.parametrize("chunk", [1, 2, 4, 6])
def test_rows_travel_in_one_batch_and_come_back_per_output(chunk):
    from replay_plugin.vllm.batch_rows import MAGIC, pack_outputs, unpack_outputs

    outputs, requests = _step()
    before = _rows(outputs)
    plain = outputs[1].new_logprobs
    # stock: every output that asked for logprobs carries its own arrays on the wire
    assert sum(o.new_logprobs is not None for o in outputs) == 5

    assert pack_outputs(outputs, requests)
    carriers = [o.new_logprobs for o in outputs if o.new_logprobs is not None]
    assert len(carriers) == 3  # the batch on r0, the plain r1's and the freed r5's own rows
    assert outputs[0].new_logprobs.cu_num_generated_tokens == [MAGIC, 0, 1, 2, 2, 3, 3]
    assert outputs[1].new_logprobs is plain  # never touched
    assert outputs[2].new_logprobs is None and outputs[3].new_logprobs is None
    assert outputs[5].new_logprobs is not None  # freed request: its own rows, as in stock vLLM

    received = _wire(outputs)
    pending = None
    for start in range(0, len(received), chunk):  # AsyncLLM's chunks (VLLM_V1_OUTPUT_PROC_CHUNK_SIZE)
        pending = unpack_outputs(received[start : start + chunk], pending)
    assert pending is None
    _same(_rows(received), before)


@pytest.mark.parametrize("chunk", [2, 6])
def test_captured_rows_are_taken_from_the_carrier_once_per_step(chunk):
    """The front end's ``take``: an output whose request the capture keeps itself (its user
    asked no logprobs) gets no rows (vLLM then has nothing to process for it) and the capture
    gets row ``i`` of one copy of the carrier's arrays, made once for the whole carrier (not a
    view of the transport's buffer); the others get their views as before."""
    from replay_plugin.vllm.batch_rows import pack_outputs, unpack_outputs

    outputs, requests = _step()
    before = _rows(outputs)
    assert pack_outputs(outputs, requests)
    received = _wire(outputs)
    carrier = received[0].new_logprobs
    taken = {}

    def take(out, ids, logprobs, row):
        if out.request_id == "r2":
            return False  # e.g. a request whose user asked logprobs too: it keeps its view
        taken[out.request_id] = (ids, logprobs, row)
        return True

    pending = None
    for start in range(0, len(received), chunk):
        pending = unpack_outputs(received[start : start + chunk], pending, take)
    assert pending is None and set(taken) == {"r0", "r3"}
    arrays = {id(ids) for ids, _, _ in taken.values()}
    assert len(arrays) == 1  # one copy per carrier
    for name, (ids, logprobs, row) in taken.items():
        i = int(name[1:])
        assert not np.shares_memory(ids, carrier.logprob_token_ids)
        assert np.array_equal(ids[row], before[i][0][0]) and np.array_equal(logprobs[row], before[i][1][0])
        assert received[i].new_logprobs is None
    _same(_rows(received)[2:3], before[2:3])  # not taken: its own view
    assert received[1].new_logprobs is not None  # the plain request: untouched


def test_an_output_without_rows_travels_on_its_own():
    from replay_plugin.vllm.batch_rows import pack_outputs, unpack_outputs

    outputs, requests = _step()
    empty = outputs[2].new_logprobs._replace(
        **{f: a[:0] for f, a in zip(("logprob_token_ids", "logprobs", "sampled_token_ranks"), outputs[2].new_logprobs)}
    )
    outputs[2].new_logprobs = empty  # vLLM slices zero rows for an output without new tokens
    before = _rows(outputs)
    assert pack_outputs(outputs, requests)
    assert outputs[2].new_logprobs is empty and outputs[3].new_logprobs is None
    received = _wire(outputs)
    assert unpack_outputs(received, None) is None
    _same(_rows(received), before)


def test_unplanned_steps_are_left_alone():
    from replay_plugin.vllm.batch_rows import pack_outputs

    outputs, requests = _step()
    for key in ("r2", "r3"):
        requests[key] = _request(planned=True, batch=False)  # e.g. a plan from an older front end
    before = [o.new_logprobs for o in outputs]
    assert not pack_outputs(outputs, requests)  # one batchable output: nothing to gain
    assert [o.new_logprobs for o in outputs] == before


def test_malformed_or_stale_batches_are_dropped_loudly(caplog, monkeypatch):
    from replay_plugin.vllm import batch_rows
    from replay_plugin.vllm.batch_rows import MAGIC, _unpack, pack_outputs, unpack_outputs

    outputs, requests = _step()
    pack_outputs(outputs, requests)
    carrier = outputs[0].new_logprobs
    bad = carrier._replace(cu_num_generated_tokens=[MAGIC, 0, 1, 2, 99])  # more rows than sent
    outputs[0].new_logprobs = bad
    with caplog.at_level(logging.ERROR, logger="replay_plugin"):
        assert unpack_outputs(outputs, None) is None
    assert "dropped a batch" in caplog.text
    assert outputs[0].new_logprobs is None and outputs[2].new_logprobs is None  # no rows, never wrong rows

    # a carrier whose later entries are still pending when the next step arrives is dropped
    outputs, requests = _step()
    pack_outputs(outputs, requests)
    processor = types.SimpleNamespace()
    seen = []

    def wrapped(outs, stamp=None):
        seen.append([o.new_logprobs is not None for o in outs])

    # a front end that planned no batched request in its process leaves its outputs as stock
    monkeypatch.setattr(batch_rows, "_expecting", False)
    carrier = outputs[0].new_logprobs
    _unpack(wrapped, processor, (outputs[:2], 1.0), {})
    assert outputs[0].new_logprobs is carrier and outputs[1].new_logprobs is not None and seen.pop()
    monkeypatch.setattr(batch_rows, "_expecting", True)  # the admission planned one here

    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="replay_plugin"):
        _unpack(wrapped, processor, (outputs[:2], 1.0), {})  # first chunk of step 1
        next_step, next_requests = _step()
        _unpack(wrapped, processor, (next_step, 2.0), {})  # step 2: unbatched rows, untouched
    assert "never handed out" in caplog.text
    assert seen[1] == [o.new_logprobs is not None for o in next_step] and all(seen[1][:4])


def test_a_step_whose_rows_are_all_planned_is_gathered_without_vllms_slices():
    """Every request asking for rows is planned: vLLM is handed the step without its rows
    (slices none) and each output gets exactly the rows vLLM would have sliced for it, from the
    step's arrays, in the output order (not the batch order); a step with a plain request that
    asked for logprobs is left to vLLM's slicing."""
    from vllm.v1.engine import EngineCoreOutput

    from replay_plugin.vllm.batch_rows import MAGIC, _wanted_rows, gather_outputs, unpack_outputs

    _, requests = _step()
    steps, _ = _step()
    batch = type(steps[0].new_logprobs)(
        *(np.concatenate([o.new_logprobs[f] for o in steps if o.new_logprobs is not None]) for f in range(3))
    )
    from vllm import SamplingParams

    scheduled = types.SimpleNamespace(num_scheduled_tokens={f"r{i}": 1 for i in range(5)})
    assert _wanted_rows(scheduled, requests) == {"r0", "r2", "r3"}  # r1 and r4 ask for no rows
    requests["r1"].sampling_params = SamplingParams(top_k=4, logprobs=1)  # a plain request with logprobs
    assert _wanted_rows(scheduled, requests) is None  # vLLM slices the step as stock
    requests["r1"].sampling_params = SamplingParams(top_k=4)
    wanted = _wanted_rows(scheduled, requests)
    assert wanted == {"r0", "r2", "r3"}

    index = {"r0": 4, "r1": 0, "r2": 1, "r3": 3, "r4": 2}  # the runner's batch order
    outputs = [
        EngineCoreOutput(request_id=r, new_token_ids=[int(batch.logprob_token_ids[index[r], 0])], new_logprobs=None)
        for r in ("r0", "r1", "r2", "r4", "r3")
    ]
    outputs[2].new_token_ids = []  # r2 stopped without a token this step: an empty slice, as vLLM
    expected = [batch.slice_request(index[o.request_id], len(o.new_token_ids)) if o.request_id in wanted else None
                for o in outputs]  # fmt: skip
    gather_outputs(outputs, batch, index, wanted)
    assert outputs[0].new_logprobs.cu_num_generated_tokens == [MAGIC, 0, 1, 4, 2]
    assert outputs[1].new_logprobs is None and outputs[3].new_logprobs is None  # asked for none
    assert outputs[2].new_logprobs.logprob_token_ids.shape == (0, W + 1)
    assert outputs[4].new_logprobs is None  # travels in the carrier
    received = _wire(outputs)
    assert unpack_outputs(received, None) is None
    _same(_rows(received), [None if e is None else tuple(np.array(a) for a in tuple(e)[:3]) for e in expected])

    one = [EngineCoreOutput(request_id="r3", new_token_ids=[5], new_logprobs=None)]
    gather_outputs(one, batch, index, wanted)  # a lone output: its own slice, no carrier
    assert one[0].new_logprobs.cu_num_generated_tokens is None
    assert np.array_equal(one[0].new_logprobs.logprobs, batch.logprobs[3:4])


def _support_rows(rng, n: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """``[n, columns]`` rows as vLLM's processed top-N gives them: the sampled token, then
    descending logprobs: a normalised head and ``-inf`` after it (exact rows), or, one row in
    four, a support wider than the row (no ``-inf``, mass below 1: inexact rows)."""
    ids = np.empty((n, columns), dtype=np.int32)
    lps = np.full((n, columns), -np.inf, dtype=np.float32)
    for r in range(n):
        wide = rng.random() < 0.25
        k = columns - 1 if wide else int(rng.integers(1, columns))
        z = np.sort(rng.normal(size=k + 4 if wide else k))[::-1]
        lp = (z - z.max() - np.log(np.exp(z - z.max()).sum())).astype(np.float32)[:k]
        ids[r, 1:] = rng.choice(500, size=columns - 1, replace=False)
        lps[r, 1 : k + 1] = lp
        pick = int(rng.integers(k))
        ids[r, 0], lps[r, 0] = ids[r, 1 + pick], lp[pick]
    return ids, lps


def test_runs_of_one_row_each_travel_as_two_ints_and_come_back_per_output():
    """An RL step (every output wanted, one token each) is a *run*: the layout is
    ``[MAGIC_RUN, n]`` instead of ``2n + 1`` ints, from ``gather_outputs`` and ``pack_outputs``
    alike, and the front end gives each output its rows back, across any chunking."""
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.outputs import LogprobsLists

    from replay_plugin.vllm.batch_rows import MAGIC_RUN, gather_outputs, pack_outputs, unpack_outputs

    rng = np.random.default_rng(11)
    ids, lps = _support_rows(rng, 5, W + 1)
    lists = LogprobsLists(ids, lps, rng.integers(0, 9, 5).astype(np.int64))
    index = {f"r{i}": (i * 3) % 5 for i in range(5)}  # the runner's batch order differs
    for chunk in (1, 2, 4, 5):
        outputs = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=[1]) for i in range(5)]
        gather_outputs(outputs, lists, index, set(index))
        assert outputs[0].new_logprobs.cu_num_generated_tokens == [MAGIC_RUN, 5]
        received, pending = _wire(outputs), None
        for start in range(0, 5, chunk):
            pending = unpack_outputs(received[start : start + chunk], pending)
        assert pending is None
        _same(
            _rows(received),
            [tuple(np.array(a) for a in tuple(lists.slice_request(index[f"r{i}"], 1))[:3]) for i in range(5)],
        )

    outputs, requests = _step()
    outputs = [outputs[i] for i in (0, 2, 3)]  # consecutive planned outputs with rows
    before = _rows(outputs)
    assert pack_outputs(outputs, requests)
    assert outputs[0].new_logprobs.cu_num_generated_tokens == [MAGIC_RUN, 3]
    received = _wire(outputs)
    assert unpack_outputs(received, None) is None
    _same(_rows(received), before)

    bad = _wire(outputs)
    bad[0].new_logprobs = bad[0].new_logprobs._replace(cu_num_generated_tokens=[MAGIC_RUN, 4])  # 3 rows sent
    assert unpack_outputs(bad, None) is None and all(o.new_logprobs is None for o in bad)  # dropped, never wrong


def test_the_front_end_log_keeps_each_final_only_request_exactly_its_rows(monkeypatch):
    """Captured ``FINAL_ONLY`` requests whose users asked no logprobs keep their rows in the
    front end's ``RowLog`` (one block per step, folded every ``FOLD_AT`` steps) instead of per
    request; each converts to exactly the rows of the per-request path, across folds, a change
    of row width, rows reaching a request outside a run, an aborted request (dropped at the next
    fold) replaced by a new one in the same step, a request aborted in ``AsyncLLM`` (its state
    dropped before its final output reads its rows), runs split by ``AsyncLLM``'s chunks, and
    requests finishing at different steps. A
    streamed (``DELTA``) request and one whose user asked logprobs are left to the per-request
    path / vLLM. The log holds at most
    ``FOLD_AT`` steps beyond the live requests' rows (and dead rows up to as many as live ones,
    in chunks not yet rebuilt) and is empty when they are done."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    from replay_plugin.vllm import sample_support_capture as capture
    from replay_plugin.vllm import sample_support_log
    from replay_plugin.vllm.batch_rows import _taker, gather_outputs, unpack_outputs
    from replay_plugin.vllm.sample_support_log import FOLD_AT, RowLog

    monkeypatch.setattr(sample_support_log, "MERGE_AT", 3)  # merge chunks in this short run too
    folds = []
    real_fold = RowLog.fold
    monkeypatch.setattr(RowLog, "fold", lambda self, prune=True: folds.append(1) or real_fold(self, prune))

    width = W + 2
    kinds = {f"r{i}": RequestOutputKind.FINAL_ONLY for i in range(6)}
    kinds["r4"] = RequestOutputKind.DELTA
    states, reference, caps = {}, {}, {}

    def admit(rid, kind):
        processor = LogprobsProcessor(
            tokenizer=None, logprobs=None, prompt_logprobs=None, cumulative_logprob=None,
            num_logprobs=2 if rid == "r5" else None, num_prompt_logprobs=None,
        )  # fmt: skip
        caps[rid] = processor.__dict__[capture._CAPTURE_ATTR] = capture._Capture(width, native=False)
        states[rid] = types.SimpleNamespace(logprobs_processor=processor, output_kind=kind)
        reference[rid] = capture._Capture(width, native=False)

    for rid, kind in kinds.items():
        admit(rid, kind)
    log = RowLog(capture.loggable)
    take = _taker(states)
    rng = np.random.default_rng(12)
    running = list(kinds)
    steps = 2 * FOLD_AT + 30
    for step in range(steps):
        columns = W + 1 if step < 100 else W + 3  # the step's largest ``logprobs`` grew
        ids, lps = _support_rows(rng, len(running), columns)
        for j, rid in enumerate(running):
            reference[rid].add(ids[j : j + 1], lps[j : j + 1])
        if step == 40:  # rows reaching each request on its own (no batch): vLLM's own path
            for j, rid in enumerate(running):
                caps[rid].add(ids[j : j + 1], lps[j : j + 1])
        else:
            lists = LogprobsLists(ids, lps, np.zeros(len(running), dtype=np.int64))
            outputs = [EngineCoreOutput(request_id=rid, new_token_ids=[1]) for rid in running]
            gather_outputs(outputs, lists, {rid: j for j, rid in enumerate(running)}, set(running))
            received, pending = _wire(outputs), None
            chunk = (1, 2, 3, len(received))[step % 4]  # AsyncLLM's chunks split some runs
            for start in range(0, len(received), chunk):
                pending = unpack_outputs(received[start : start + chunk], pending, take, log, states)
            assert pending is None
            for out in received:
                # taken by the log or the per-request capture; r5's user asked logprobs: its view
                assert (out.new_logprobs is not None) == (out.request_id == "r5")
        assert len(log.blocks) < FOLD_AT
        if step == 70:  # aborted (vLLM drops its state, nothing converts it); r6 takes its place
            running[running.index("r3")] = "r6"
            del states["r3"]
            admit("r6", RequestOutputKind.FINAL_ONLY)
        if step == 100:  # finished alone: converts its own rows from the log
            caps["r2"]._convert()
            running.remove("r2")
            del states["r2"]
        if step == 120:  # aborted in AsyncLLM: vLLM drops its state, then builds its final output
            assert log.blocks  # (so reading its rows folds)
            running.remove("r1")
            del states["r1"]
            caps["r1"]._convert()
    assert set(log.captures) == {caps[r].slot for r in ("r0", "r6")}  # r3 pruned, r1 and r2 released
    # r3's rows folded before it left are counted dead (a chunk is rebuilt once half dead);
    # later folds do not keep them
    assert sum(c.dead for c in log.chunks) > 0 and caps["r3"].slot not in log.chunks[-1].slots
    assert len(folds) > sample_support_log.MERGE_AT >= len(log.chunks)  # chunks were merged
    assert caps["r4"].log is None and caps["r5"].log is None and caps["r0"]._pending == []
    finishing = [EngineCoreOutput(request_id=r, new_token_ids=[1], finish_reason=1) for r in ("r0", "r4", "r6")]
    capture.convert_finishing(finishing, states)
    assert len(log) == 0 and not log.captures  # nothing live: nothing held
    for rid, n in (("r0", steps), ("r1", 121), ("r2", 101), ("r4", steps), ("r6", steps - 71)):
        caps[rid]._convert()
        reference[rid]._convert()
        a, b = caps[rid].buffer, reference[rid].buffer
        assert a.size == b.size == n
        x, y = a.view(0, a.size), b.view(0, b.size)
        for name in ("ids", "sampled", "sampled_logprob", "exact"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=f"{rid} {name}")
        assert x.exact.any() and not x.exact.all()  # real rows of both kinds were compared


def test_a_request_id_used_again_before_the_next_fold_gets_its_own_rows():
    """A request aborted in an ``LLMEngine`` builds no final output, so its slot in the front
    end's log lives until the next fold prunes it. A new request of the same id, made before
    that fold (through ``LogprobsProcessor.from_new_request``, the patch's own entry), gets a slot
    of its own, also when the next step schedules the very same ids (the log's per-step cache):
    it converts exactly its rows. Another request of the step keeps all of its rows."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    from replay_plugin.vllm import options
    from replay_plugin.vllm import sample_support_capture as capture
    from replay_plugin.vllm.batch_rows import _taker, gather_outputs, unpack_outputs
    from replay_plugin.vllm.sample_support_log import FOLD_AT, RowLog

    width = W + 2
    states, reference = {}, {}

    def admit(rid):
        def stock(*args, **kwargs):
            return LogprobsProcessor(
                tokenizer=None, logprobs=None, prompt_logprobs=None, cumulative_logprob=None,
                num_logprobs=None, num_prompt_logprobs=None,
            )  # fmt: skip

        plan = {"width": width, "user_logprobs": None, "native": False}
        request = types.SimpleNamespace(
            request_id=rid, sampling_params=types.SimpleNamespace(extra_args={options.PLAN_KEY: plan})
        )
        processor = capture._new_processor(stock, None, (), {"request": request})
        states[rid] = types.SimpleNamespace(logprobs_processor=processor, output_kind=RequestOutputKind.FINAL_ONLY)
        reference[rid] = capture._Capture(width, native=False)
        return processor.__dict__[capture._CAPTURE_ATTR]

    caps = {rid: admit(rid) for rid in ("a", "b")}
    log = RowLog(capture.loggable)
    take = _taker(states)
    rng = np.random.default_rng(5)
    running = ["a", "b"]
    first_a = caps["a"]
    for step in range(FOLD_AT // 2):
        ids, lps = _support_rows(rng, len(running), W + 1)
        for j, rid in enumerate(running):
            reference[rid].add(ids[j : j + 1], lps[j : j + 1])
        outputs = [EngineCoreOutput(request_id=rid, new_token_ids=[1]) for rid in running]
        gather_outputs(outputs, LogprobsLists(ids, lps, np.zeros(2, dtype=np.int64)), {"a": 0, "b": 1}, set(running))
        assert unpack_outputs(_wire(outputs), None, take, log, states) is None
        if step == 9:  # "a" aborted in an LLMEngine (state dropped, nothing converts it) ...
            del states["a"]
            caps["a"] = admit("a")  # ... and a new request takes its id before any fold
            assert first_a.log is None  # the old slot was released
    assert len(log.blocks) == FOLD_AT // 2 and not log.chunks  # no fold ran: nothing pruned
    for rid, n in (("a", FOLD_AT // 2 - 10), ("b", FOLD_AT // 2)):
        assert caps[rid].log is log
        caps[rid]._convert()
        reference[rid]._convert()
        a, b = caps[rid].buffer, reference[rid].buffer
        assert a.size == b.size == n, rid
        x, y = a.view(0, a.size), b.view(0, b.size)
        for name in ("ids", "sampled", "sampled_logprob", "exact"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=f"{rid} {name}")
    assert len(log) == 0 and not log.captures


def test_the_scheduler_step_is_gathered_from_vllms_own_runner_output():
    """``Scheduler.update_from_output`` (the patch's target) on vLLM's own ``ModelRunnerOutput`` of
    this version: when every request asking for rows is planned, vLLM gets the step without its
    rows and each output's rows are gathered by request id. vLLM 0.30-0.33 map ids to rows with
    ``req_id_to_index``; 0.34 dropped it (its scheduler enumerates ``req_ids``, the batch order),
    and so does the patch there: before, it fell back to vLLM's per-request slices on 0.34."""
    import dataclasses

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput

    from replay_plugin.vllm.batch_rows import MAGIC_RUN, _pack, _row_index

    steps, requests = _step()
    batch = type(steps[0].new_logprobs)(
        *(np.concatenate([o.new_logprobs[f] for o in steps if o.new_logprobs is not None]) for f in range(3))
    )
    order = ["r3", "r0", "r2"]  # the runner's batch order (not the scheduler's)
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    kwargs = {"req_ids": order, "sampled_token_ids": [[1]] * 3, "logprobs": batch}
    if "req_id_to_index" in fields:  # vLLM 0.30-0.33
        kwargs["req_id_to_index"] = {r: i for i, r in enumerate(order)}
    runner_output = ModelRunnerOutput(**kwargs)
    assert _row_index(runner_output) == {"r3": 0, "r0": 1, "r2": 2}
    planned = {r: requests[r] for r in order}
    scheduled = types.SimpleNamespace(num_scheduled_tokens=dict.fromkeys(order, 1))
    seen = []

    def update_from_output(scheduler_output, model_runner_output):
        seen.append(model_runner_output.logprobs)  # what vLLM would slice per request
        outs = [EngineCoreOutput(request_id=r, new_token_ids=[7], new_logprobs=None) for r in order]
        return {0: EngineCoreOutputs(engine_index=0, outputs=outs)}

    scheduler = types.SimpleNamespace(requests=planned)
    result = _pack(update_from_output, scheduler, (scheduled, runner_output), {})
    assert seen == [None] and runner_output.logprobs is batch  # vLLM sliced nothing; restored after
    carrier = result[0].outputs[0].new_logprobs
    assert carrier.cu_num_generated_tokens == [MAGIC_RUN, 3]
    assert np.array_equal(carrier.logprob_token_ids, batch.logprob_token_ids[:3])
