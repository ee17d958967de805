"""Model Runner V2 with vLLM's own sampling mask (``return_sampling_mask``): the plugin's native
path, on real MRV2 code (Triton's interpreter on CPU; envs/envs.toml's MRV2 environments).

The engine is the user's: ``return_sampling_mask=True`` and routed experts on where the CPU build
returns them (MRV2 returns routes through the AuxOutput connector on 0.31+, which MRV1 refuses;
0.29's CPU MoE refuses them at engine start on either runner: ``routes_supported``). The plugin then builds an
opted-in request's rows from the mask vLLM sampled from, not from logprob rows. What stock vLLM
gives, read with the plugin's patches reverted on the same engine (``stock_vllm``): the mask of
every position on the *last* output only (none on the outputs of a stream before it, in
``CUMULATIVE`` and, before 0.32, ``DELTA`` kinds), no rows for a request that asks for replay,
and MRV2's Triton top-k (Qrita) keeps ``k`` ids of a group tied at the ``k``-th logit, as on a
GPU, where MRV1 keeps the whole group. The rows must be exactly the ids sampled from.

Sorts after test_offline.py: its engine replaces the session's offline ``LLM`` (one engine at a
time on 2 shared cores).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from scenarios import OPT_IN, PROMPTS, engine_kwargs
from support.upstream import need
from support.vllm_engines import NO_ROUTES_ON_CPU, OfflineEngine, routes_supported
from test_offline import stock_vllm

pytestmark = pytest.mark.timeout(900)

SLACK = 16
#: the tie model's groups of exactly tied ids (tie_group_size=3)
GROUP = 3


def _mrv2() -> bool:
    return os.environ.get("REPLAY_TEST_MRV2") == "1"


@pytest.fixture(scope="module")
def native_llm(tie_model):
    need("vllm")
    if not _mrv2():
        pytest.skip("Model Runner V2 runs only in the MRV2 test environments (REPLAY_TEST_MRV2=1)")
    import replay_plugin

    OfflineEngine.shutdown()
    os.environ["REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS"] = "opt-in"
    replay_plugin.activate()
    from vllm import LLM

    kwargs = engine_kwargs(routes=routes_supported(), fitted_by_hand=False)
    kwargs.update(return_sampling_mask=True, max_num_seqs=8)
    llm = LLM(model=tie_model, **kwargs)
    # 0.34 has no other runner (and no such attribute)
    assert getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", True), "the engine must run Model Runner V2"
    yield llm
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        os.environ.pop("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", None)


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**kw)


def _batch():
    """Opted-in requests (a tie cut at k=5, top-p with a user's logprobs, k=6 with no cut, routes)
    beside plain ones, each with its own seed."""
    routes = {**OPT_IN, "replay_routed_experts": True} if routes_supported() else OPT_IN
    return [
        _params(top_k=5, max_tokens=8, seed=11, ignore_eos=True, extra_args=routes),
        _params(top_k=4, top_p=0.9, max_tokens=8, seed=12, logprobs=2, extra_args=OPT_IN),
        _params(top_k=6, max_tokens=8, seed=13, ignore_eos=True, extra_args=OPT_IN),
        _params(top_k=5, max_tokens=6, seed=14, logprobs=3),
        _params(top_k=7, top_p=0.8, max_tokens=6, seed=15),
    ]


def _mask_sets(completion) -> list[set]:
    return [set(position) for position in completion.sampling_mask.token_ids]


def _row_sets(rows) -> list[set]:
    return [set(int(i) for i in row if i >= 0) for row in rows.ids]


def _logprob_rows(completion):
    """Per position: the sampled token's logprob and the set of listed logprob values. Which of
    several exactly tied ids fill the last ranks (and so how many distinct ids a position lists)
    is not stable between two runs of the same request in stock vLLM on MRV2 (seen on 0.31: ids
    (96, 97) once, (96, 97, 98) the next time, all of one tied value), so ids are not compared."""
    if completion.logprobs is None:
        return None
    return [
        (position[token].logprob, sorted({lp.logprob for lp in position.values()}))
        for token, position in zip(completion.token_ids, completion.logprobs)
    ]


@pytest.fixture(scope="module")
def batch_runs(native_llm):
    params = _batch()
    prompts = PROMPTS[: len(params)]
    with stock_vllm():
        stock = [r.outputs[0] for r in native_llm.generate(prompts, _batch(), use_tqdm=False)]
    ours = [r.outputs[0] for r in native_llm.generate(prompts, params, use_tqdm=False)]
    return stock, ours, params


def test_rows_are_the_mask_vllm_sampled_from(batch_runs):
    """Every opted-in row holds exactly the ids of vLLM's own mask at its position (the sampled
    token first), flagged exact; stock vLLM returns the same tokens and masks and no rows."""
    from replay_plugin.vllm import ReplayDataMissing, support_of

    stock, ours, params = batch_runs
    partial_ties = 0
    for s, o, p in zip(stock, ours, params):
        assert list(o.token_ids) == list(s.token_ids)
        assert _mask_sets(o) == _mask_sets(s)  # the user's own sampling_mask, unchanged
        if not (p.extra_args or {}).get("replay_sample_support"):
            continue
        with pytest.raises(ReplayDataMissing):  # the gap: stock serves no rows for the request
            support_of(s)
        rows = support_of(o)
        tokens = np.asarray(o.token_ids)
        assert rows.width == p.top_k + SLACK
        assert rows.exact.all() and (rows.sampled == tokens).all()
        assert (rows.ids[:, 0] == tokens).all()  # sampled token first
        assert _row_sets(rows) == _mask_sets(o)
        assert np.isfinite(rows.sampled_logprob).all() and (rows.sampled_logprob <= 0).all()
        for members in _mask_sets(o):
            groups = {}
            for i in members:
                groups.setdefault(i // GROUP, set()).add(i)
            partial_ties += any(len(g) < GROUP for g in groups.values())
            if p.top_p is None or p.top_p >= 1.0:
                assert len(members) == p.top_k  # Qrita keeps k ids, ties or not
    # k=5 on groups of three always cuts a group at the k-th logit: MRV2 keeps a subset of it
    assert partial_ties > 0


def test_user_logprobs_and_plain_requests_as_stock(batch_runs):
    """The user's own logprobs (logprobs=2 beside the capture) and the plain requests' outputs
    are vLLM's, value for value."""
    stock, ours, params = batch_runs
    for s, o, p in zip(stock, ours, params):
        assert _logprob_rows(o) == _logprob_rows(s)
        assert o.cumulative_logprob == s.cumulative_logprob
        if not (p.extra_args or {}).get("replay_sample_support"):
            assert "sample_support" not in o.__dict__
            assert o.text == s.text and list(o.token_ids) == list(s.token_ids)
    assert ours[1].logprobs is not None and all(len(position) in (2, 3) for position in ours[1].logprobs)


def test_routes_come_back_through_model_runner_v2(batch_runs, native_llm):
    """Routes of the request that asked for them: [prompt + generated - 1, layers, top-k], uint8,
    equal to vLLM's own (AuxOutput connector from 0.31, which Model Runner V1 refuses)."""
    if not routes_supported():
        pytest.skip(NO_ROUTES_ON_CPU)
    from replay_plugin.vllm import decode_choice  # noqa: F401 - the client helpers load

    stock, ours, _ = batch_runs
    prompt = native_llm.get_tokenizer().encode(PROMPTS[0])
    r0, r1 = stock[0].routed_experts, ours[0].routed_experts
    assert r1 is not None and r1.dtype == np.uint8
    assert r1.shape == (len(prompt) + len(ours[0].token_ids) - 1, 2, 2)
    assert np.array_equal(r0, r1)


class _Seen:
    """What one output held when the engine returned it (a ``CUMULATIVE`` output's ``token_ids``
    is the request's live token list, which later steps extend: vLLM 0.30-0.34 hand out the
    detokenizer's own list)."""

    def __init__(self, output) -> None:
        self.token_ids = list(output.token_ids)
        self.sampling_mask = output.sampling_mask
        self.finish_reason = output.finish_reason
        self.rows = output.__dict__.get("sample_support")


def _stream(llm, kind, seed: int, max_tokens: int = 6):
    """Outputs of one request stepped through the engine in output kind ``kind``."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    rid = f"mrv2-{kind.name}-{seed}"
    params = _params(top_k=5, max_tokens=max_tokens, seed=seed, ignore_eos=True, extra_args=OPT_IN, output_kind=kind)
    engine.add_request(rid, PROMPTS[2], params)
    outs = []
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.request_id == rid:
                outs.append(_Seen(r.outputs[0]))
    assert outs and outs[-1].finish_reason is not None
    assert kind != RequestOutputKind.FINAL_ONLY or len(outs) == 1
    return outs


@pytest.mark.parametrize("kind_name", ["CUMULATIVE", "DELTA"])
def test_every_streamed_output_carries_exact_rows(native_llm, kind_name):
    """Each output of a ``CUMULATIVE`` (AsyncLLM's default) or ``DELTA`` stream carries exact rows
    for its tokens, the same as the final output's. vLLM puts the mask on the last output only
    (CUMULATIVE; DELTA before 0.32): the plugin reads the masks the request received each step
    (before, these outputs' rows were empty and inexact)."""
    from vllm.sampling_params import RequestOutputKind

    from replay_plugin.core.support import SupportRows

    kind = RequestOutputKind[kind_name]
    with stock_vllm():
        stock = _stream(native_llm, kind, seed=31)
    ours = _stream(native_llm, kind, seed=31)
    assert len(ours) > 1
    if kind == RequestOutputKind.CUMULATIVE:
        assert all(o.sampling_mask is None for o in stock[:-1])  # what vLLM gives a stream
        final = stock[-1]
        assert [list(o.token_ids) for o in ours] == [list(o.token_ids) for o in stock]
    else:
        final_tokens = [t for o in stock for t in o.token_ids]
        masks = [m for o in stock if o.sampling_mask is not None for m in o.sampling_mask.token_ids]
        assert len(masks) == len(final_tokens)
    parts = []
    for o in ours:
        rows = o.rows
        assert rows is not None and len(rows) == len(o.token_ids) and rows.exact.all(), (kind_name, rows)
        assert (rows.sampled == np.asarray(o.token_ids)).all()
        parts.append(rows)
    if kind == RequestOutputKind.CUMULATIVE:
        assert _row_sets(parts[-1]) == _mask_sets(final)
        for rows in parts:  # each a prefix of the final rows
            assert np.array_equal(rows.ids, parts[-1].ids[: len(rows)])
        assert [len(rows) for rows in parts] == list(range(1, len(parts) + 1))
    else:
        merged = SupportRows.concat(parts)
        assert merged.sampled.tolist() == final_tokens
        assert _row_sets(merged) == [set(m) for m in masks]


def test_forced_tokens_are_their_own_support(native_llm):
    """Thinking budget: MRV2's mask at a forced position lists the top-k survivors (vLLM forces by
    logit, not by masking all others), so budgeted requests are captured from processed logprobs
    instead: the row of a forced token is that token alone, exact."""
    from replay_plugin.vllm import support_of

    reasoning = native_llm.llm_engine.vllm_config.reasoning_config
    start, end = list(reasoning.reasoning_start_token_ids), list(reasoning.reasoning_end_token_ids)
    prompt = native_llm.get_tokenizer().encode(PROMPTS[4]) + start
    kw = dict(top_k=5, temperature=0.8, max_tokens=12, ignore_eos=True, thinking_token_budget=3, seed=3)
    with stock_vllm():
        stock = native_llm.generate({"prompt_token_ids": prompt}, _params(**kw), use_tqdm=False)[0].outputs[0]
    ours = native_llm.generate({"prompt_token_ids": prompt}, _params(extra_args=OPT_IN, **kw), use_tqdm=False)[
        0
    ].outputs[0]
    tokens = list(ours.token_ids)
    assert tokens == list(stock.token_ids)
    at = next(j for j in range(len(tokens)) if tokens[j : j + len(end)] == end)
    forced = range(at, at + len(end))
    masks = _mask_sets(stock)
    assert any(len(masks[j]) > 1 for j in forced)  # vLLM's mask: more than the forced token
    rows = support_of(ours)
    assert rows.exact.all()
    for j in forced:
        assert _row_sets(rows)[j] == {tokens[j]} and rows.sampled_logprob[j] == 0.0


def test_unreplayable_requests_refused_naming_the_setting(native_llm):
    from replay_plugin.vllm.refusal import SampleSupportRefused

    for kw, setting in (
        (dict(top_k=5, logprob_token_ids=[3, 4]), "logprob_token_ids"),
        (dict(top_k=1), "top_k"),
    ):
        with pytest.raises(SampleSupportRefused) as info:
            native_llm.generate(PROMPTS[:1], _params(max_tokens=4, extra_args=OPT_IN, **kw), use_tqdm=False)
        assert info.value.setting == setting, str(info.value)
        assert setting in str(info.value)
    assert not native_llm.llm_engine.has_unfinished_requests()
