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
from conftest import need

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
