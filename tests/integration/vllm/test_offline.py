"""Sampler support and routed experts from a real offline ``vllm.LLM`` on CPU (one engine).

Each test first shows what stock vLLM returns (the plugin deactivated in this process: every
patch lives in the API-server process, which is this one for ``LLM``), then the plugin's output.
The oracle for exactness is vLLM's own processed logprobs at full width (``logprobs=-1`` on the
~500-token vocabulary): the support is every id with a finite processed logprob.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
import pickle

import numpy as np
import pytest
from conftest import MAX_LOGPROBS, OfflineEngine, need, routes_supported

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "the router sends each token",
    "a sampler draws from the top",
    "mixture of experts models route",
    "numbers 0 1 2 3",
    "questions: what is two plus",
    "reinforcement learning rolls out",
    "which token comes next?",
    "symbols + - * /",
]
OPT_IN = {"replay_sample_support": True}


def _params(seed0: int = 0, n: int = len(PROMPTS), **kw):
    from vllm import SamplingParams

    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 1.0)
    return [SamplingParams(seed=seed0 + i, **kw) for i in range(n)]


@contextlib.contextmanager
def stock_vllm():
    """The plugin's patches reverted in this process (the engine keeps its configuration)."""
    import replay_plugin
    from replay_plugin import states

    replay_plugin.deactivate()
    try:
        yield
    finally:
        replay_plugin.activate()
        assert states.get("vllm.sample_support").state == "applied"


def _generate(llm, params, prompts=PROMPTS):
    return [r.outputs[0] for r in llm.generate(prompts[: len(params)], params, use_tqdm=False)]


def _flat_rows(flat):
    """FlatLogprobs -> per position (ids, logprobs) arrays; entry 0 is the sampled token."""
    ids, lps = np.asarray(flat.token_ids), np.asarray(flat.logprobs, dtype=np.float64)
    return [(ids[s:e], lps[s:e]) for s, e in zip(flat.start_indices, flat.end_indices)]


def _oracle(llm, **kw):
    """Full-width processed logprobs of the same requests: per output, per position
    ``{id: logprob}`` of every vocabulary id (no detokenisation: it would take seconds)."""
    outs = _generate(llm, _params(logprobs=-1, flat_logprobs=True, detokenize=False, **kw))
    return outs, [[dict(zip(i[1:].tolist(), lp[1:].tolist())) for i, lp in _flat_rows(o.logprobs)] for o in outs]


def _support(position: dict) -> set:
    return {t for t, lp in position.items() if np.isfinite(lp)}


# --------------------------------------------------------------------------- engine configuration


def test_engine_fitted_only_for_jobs_that_opt_in(tie_model, monkeypatch, caplog):
    """No engine is started: EngineArgs.create_engine_config is what the patch changes."""
    need("vllm")
    from vllm.engine.arg_utils import EngineArgs

    import replay_plugin
    from replay_plugin import states

    replay_plugin.activate()

    def config():
        args = EngineArgs(model=tie_model, dtype="float32", enforce_eager=True, max_model_len=256)
        cfg = args.create_engine_config()
        assert (args.logprobs_mode, args.max_logprobs) == ("raw_logprobs", 20)  # caller's object untouched
        return cfg.model_config

    monkeypatch.delenv("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", raising=False)
    plain = config()
    assert (plain.logprobs_mode, plain.max_logprobs) == ("raw_logprobs", 20)  # job did not opt in

    monkeypatch.setenv("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", "opt-in")
    with stock_vllm():
        stock = config()
    assert (stock.logprobs_mode, stock.max_logprobs) == ("raw_logprobs", 20)  # stock ignores the knob
    with caplog.at_level(logging.WARNING, logger="replay_plugin"):
        fitted = config()
    assert (fitted.logprobs_mode, fitted.max_logprobs) == ("processed_logprobs", 128)
    assert "logprobs_mode raw_logprobs -> processed_logprobs, max_logprobs 20 -> 128" in caplog.text
    assert any("engine configuration changed" in e for e in states.events())


# --------------------------------------------------------------------------- exact support


def test_stock_top_k_rows_miss_the_sampled_token_exact_rows_do_not(llm):
    from replay_plugin.vllm import support_of

    top_k = 5  # the tie model ties ids in runs of three: the 5th logit always has 6th tied with it
    seeds_capture = dict(top_k=top_k, logprobs=top_k, flat_logprobs=True, extra_args=OPT_IN)
    with stock_vllm():
        stock = _generate(llm, _params(**seeds_capture))
    assert all(support_of(o) is None for o in stock)  # stock: no support field at all
    rows = [r for o in stock for r in _flat_rows(o.logprobs)]
    missing = sum(int(ids[0]) not in ids[1:].tolist() for ids, _ in rows)
    # Capturing with logprobs=top_k rows (an earlier design) misses the drawn token whenever a tied 6th was drawn.
    assert missing > 0, "expected the tie model to make top-k rows miss sampled tokens"

    patched = _generate(llm, _params(top_k=top_k, extra_args=OPT_IN))
    for out in patched:
        support = support_of(out)
        assert support is not None and len(support) == len(out.token_ids)
        assert support.exact.all()
        assert (support.ids == support.sampled[:, None]).any(axis=1).all()
        assert (support.sampled == np.asarray(out.token_ids)).all()
    sizes = np.concatenate([(support_of(o).ids >= 0).sum(axis=1) for o in patched])
    assert (sizes > top_k).any(), "ties make the support wider than top_k"


SETTINGS = [
    dict(top_k=5),  # tie at the k-th logit on every token
    dict(top_k=6),  # never a tie at the boundary
    dict(top_k=5, top_p=0.8),
    dict(top_k=7, min_p=0.05),
    dict(top_k=4, temperature=0.7, top_p=0.9),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_rows_equal_the_full_width_oracle(llm, setting):
    from replay_plugin.vllm import support_of

    with stock_vllm():  # stock: the support is only recoverable at full width, per request
        stock = _generate(llm, _params(extra_args=OPT_IN, **setting))
    assert all(support_of(o) is None for o in stock)
    captured = _generate(llm, _params(extra_args=OPT_IN, **setting))
    oracle_outs, oracle = _oracle(llm, **setting)
    checked = 0
    for out, ref_out, positions in zip(captured, oracle_outs, oracle):
        assert list(out.token_ids) == list(ref_out.token_ids)  # same seeds, same draws
        rows = support_of(out)
        assert out.logprobs is None and out.cumulative_logprob is None  # the user asked none
        for i, position in enumerate(positions):
            members = rows.ids[i][rows.ids[i] >= 0].tolist()
            assert set(members) == _support(position), (setting, i)
            assert len(members) == len(set(members))
            values = [position[t] for t in members]
            assert values == sorted(values, reverse=True)  # most probable first
            assert rows.exact[i] and int(rows.sampled[i]) in members
            assert rows.sampled_logprob[i] == pytest.approx(position[int(rows.sampled[i])], abs=1e-6)
            checked += 1
    assert checked >= len(PROMPTS) * 8


def test_renormalised_logprob_reproduces_vllms_sampled_logprob(llm):
    """The trainer's replay math (core.logprobs) over the captured row, on the model's raw
    logits, gives the processed logprob vLLM reported for the sampled token; the plain
    full-vocabulary logprob (what a trainer computes without the support) does not."""
    import torch
    from vllm import SamplingParams

    from replay_plugin.core.logprobs import support_logprobs
    from replay_plugin.vllm import support_of

    temperature, top_k = 0.8, 5
    results = llm.generate(
        PROMPTS[:4], _params(n=4, temperature=temperature, top_k=top_k, extra_args=OPT_IN), use_tqdm=False
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    worst, full_vocab_gap = 0.0, 0.0
    for res in results:
        out = res.outputs[0]
        rows = support_of(out)
        prompt, gen = list(res.prompt_token_ids), list(out.token_ids)
        # Raw log-softmax at every position of prompt + generated tokens (prompt logprobs are
        # never processed by the sampler).
        scored = llm.generate(
            {"prompt_token_ids": prompt + gen},
            SamplingParams(max_tokens=1, prompt_logprobs=-1, flat_logprobs=True, detokenize=False),
            use_tqdm=False,
        )[0]
        positions = _flat_rows(scored.prompt_logprobs)
        raw = np.full((len(gen), vocab), -np.inf)
        for j in range(len(gen)):
            ids, lps = positions[len(prompt) + j]
            raw[j, ids] = lps
        logits = torch.tensor(raw, dtype=torch.float64)
        lp, valid = support_logprobs(logits, torch.tensor(gen), torch.tensor(rows.ids), temperature=temperature)
        assert valid.all()
        worst = max(worst, float(np.abs(lp.numpy() - rows.sampled_logprob).max()))
        full = torch.log_softmax(logits / temperature, dim=-1)[torch.arange(len(gen)), torch.tensor(gen)]
        full_vocab_gap = max(full_vocab_gap, float(np.abs(full.numpy() - rows.sampled_logprob).max()))
    assert worst < 2e-4, worst
    assert full_vocab_gap > 1e-2  # without the support the trainer's logprob is off


def test_tie_model_slack(llm):
    """Default slack: every row exact on the tie model. Slack 0 (W = top_k): the tied 6th member
    does not fit, those rows are flagged inexact and counted, never repaired silently."""
    from replay_plugin.vllm import support_of
    from replay_plugin.vllm.sample_support import capture_stats

    top_k = 5
    before = capture_stats()
    default = _generate(llm, _params(top_k=top_k, extra_args=OPT_IN))
    after_default = capture_stats()
    assert after_default["inexact"] == before["inexact"]
    assert all(support_of(o).exact.all() for o in default)

    tight = _generate(llm, _params(top_k=top_k, extra_args={**OPT_IN, "replay_sample_support_slack": 0}))
    oracle_outs, oracle = _oracle(llm, top_k=top_k)
    flagged = 0
    for out, positions in zip(tight, oracle):
        rows = support_of(out)
        assert rows.width == top_k
        for i, position in enumerate(positions):
            truth = _support(position)
            members = set(rows.ids[i][rows.ids[i] >= 0].tolist())
            assert members <= truth
            if rows.exact[i]:
                # exact means the whole support, up to core.support.DEFAULT_MASS_TOLERANCE of mass
                missing = sum(np.exp(position[t]) for t in truth - members)
                assert int(rows.sampled[i]) in members and missing < 1e-4
            else:
                flagged += 1
    assert flagged > 0
    assert capture_stats()["inexact"] - after_default["inexact"] == flagged


# --------------------------------------------------------------------------- the user's own output


def _same_up_to_ties(a, b, oracle):
    """Two FlatLogprobs positions ``[sampled, top1..topk]`` are equal, except which of several
    exactly tied ids fill the last ranks (vLLM's ``torch.topk`` orders tied ids differently for
    different ``k``, and ``k`` is the widest ``logprobs`` of the engine step, which in stock vLLM
    depends on which requests happen to share the step)."""
    assert a.start_indices == b.start_indices and a.end_indices == b.end_indices
    for pos, (s, e) in enumerate(zip(a.start_indices, a.end_indices)):
        assert (a.token_ids[s], a.logprobs[s], a.ranks[s]) == (b.token_ids[s], b.logprobs[s], b.ranks[s])
        assert a.logprobs[s:e] == b.logprobs[s:e] and a.ranks[s:e] == b.ranks[s:e]
        last = a.logprobs[e - 1]

        def above(x, s=s, e=e, last=last):
            return {t for t, lp in zip(x.token_ids[s + 1 : e], x.logprobs[s + 1 : e]) if lp > last}

        assert above(a) == above(b)
        for x in (a, b):
            assert all(
                lp == pytest.approx(oracle[pos][t], abs=1e-6) for t, lp in zip(x.token_ids[s:e], x.logprobs[s:e])
            )


def test_user_logprobs_come_back_as_requested(llm):
    """Opted-in requests that ask logprobs=2 get vLLM's logprobs=2 rows (the first 3 columns of
    the plugin's wider internal rows), flat or not, with the same cumulative logprob."""
    from replay_plugin.vllm import support_of

    asked = dict(top_k=5, logprobs=2)
    with stock_vllm():
        stock = _generate(llm, _params(flat_logprobs=True, extra_args=OPT_IN, **asked))
    patched = _generate(llm, _params(flat_logprobs=True, extra_args=OPT_IN, **asked))
    as_dicts = _generate(llm, _params(extra_args=OPT_IN, **asked))
    _, oracle = _oracle(llm, top_k=5)
    for s, p, d, ref in zip(stock, patched, as_dicts, oracle):
        assert support_of(p) is not None and support_of(s) is None
        assert list(p.token_ids) == list(s.token_ids) == list(d.token_ids)
        assert len(p.logprobs) == len(p.token_ids) and p.logprobs.end_indices[-1] == 3 * len(p.token_ids)
        assert p.cumulative_logprob == s.cumulative_logprob == d.cumulative_logprob
        _same_up_to_ties(p.logprobs, s.logprobs, ref)
        assert isinstance(d.logprobs, list) and d.logprobs == list(p.logprobs)  # same rows, dict form


def test_non_opted_request_is_byte_for_byte_stock(llm):
    from replay_plugin.vllm import support_of

    kinds = [dict(top_k=5), dict(top_k=5, logprobs=3), dict(temperature=0.0, logprobs=1), dict(top_p=0.9)]
    for kind in kinds:
        with stock_vllm():
            stock = _generate(llm, _params(n=3, **kind))
        patched = _generate(llm, _params(n=3, **kind))
        for s, p in zip(stock, patched):
            assert support_of(p) is None
            assert pickle.dumps(p) == pickle.dumps(s), kind


def test_refused_before_compute_naming_the_setting(llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from replay_plugin.vllm.sample_support import SampleSupportRefused, capture_stats

    engine = llm.llm_engine
    cases = [
        (dict(temperature=0.0, top_k=5), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=5, repetition_penalty=1.2), "repetition_penalty"),
        (dict(top_k=5, presence_penalty=0.5), "presence_penalty"),
        (dict(top_k=5, logprob_token_ids=[3, 4]), "logprob_token_ids"),
    ]
    with stock_vllm():  # stock accepts them (and returns no support)
        assert len(_generate(llm, [SamplingParams(max_tokens=2, extra_args=OPT_IN, **cases[0][0])])) == 1
    requests = capture_stats()["requests"]
    for kwargs, setting in cases:
        good = SamplingParams(top_k=5, max_tokens=4, extra_args=OPT_IN)
        bad = SamplingParams(max_tokens=4, extra_args=OPT_IN, **kwargs)
        with pytest.raises(SampleSupportRefused) as info:
            llm.generate(PROMPTS[:2], [good, bad], use_tqdm=False)
        assert info.value.setting == setting and setting in str(info.value)
        assert isinstance(info.value, ValueError) and isinstance(info.value, VLLMValidationError)
        assert engine.get_num_unfinished_requests() == 0  # the good one was aborted, nothing ran
    assert capture_stats()["requests"] == requests + len(cases)  # only the good ones were admitted

    # An engine that was not fitted: refused with the engine setting and the knob that fits it.
    model_config = engine.input_processor.model_config  # the API server's copy; the engine is untouched
    for attr, value, setting in (
        ("logprobs_mode", "raw_logprobs", "logprobs_mode"),
        ("max_logprobs", 8, "max_logprobs"),
    ):
        saved = getattr(model_config, attr)
        setattr(model_config, attr, value)
        try:
            with pytest.raises(SampleSupportRefused, match="REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=opt-in") as info:
                llm.generate(PROMPTS[:1], SamplingParams(top_k=5, extra_args=OPT_IN), use_tqdm=False)
            assert info.value.setting == setting
        finally:
            setattr(model_config, attr, saved)
    assert engine.model_config.max_logprobs == MAX_LOGPROBS


def test_job_wide_opt_in(llm, monkeypatch):
    """REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=all: every request is captured without
    extra_args, non-replayable ones are refused, a request can still opt out."""
    from vllm import SamplingParams

    from replay_plugin.vllm import support_of
    from replay_plugin.vllm.sample_support import SampleSupportRefused

    monkeypatch.setenv("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", "all")
    with stock_vllm():
        assert all(support_of(o) is None for o in _generate(llm, _params(n=2, top_k=5)))
    outs = _generate(llm, _params(n=2, top_k=5))
    assert all(support_of(o) is not None and support_of(o).exact.all() for o in outs)
    with pytest.raises(SampleSupportRefused, match="top_k"):
        _generate(llm, [SamplingParams(max_tokens=4)])  # vLLM's defaults: top_k disabled
    out = _generate(llm, [SamplingParams(max_tokens=4, extra_args={"replay_sample_support": False})])[0]
    assert support_of(out) is None


# --------------------------------------------------------------------------- delta outputs


def _run_deltas(llm, request_id, params):
    engine = llm.llm_engine
    engine.add_request(request_id, PROMPTS[0], params)
    deltas = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        deltas += [o for o in engine.step() if o.request_id == request_id]
    assert not engine.has_unfinished_requests()
    return deltas


def test_delta_outputs_carry_their_own_rows_and_merge(llm):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from replay_plugin.core.support import SupportRows
    from replay_plugin.vllm import support_of

    kw = dict(top_k=5, max_tokens=12, seed=11, extra_args=OPT_IN)
    final = _generate(llm, [SamplingParams(**kw)])[0]
    deltas = _run_deltas(llm, "delta-a", SamplingParams(output_kind=RequestOutputKind.DELTA, **kw))
    assert len(deltas) > 2
    parts = [support_of(d.outputs[0]) for d in deltas]
    assert all(len(p) == len(d.outputs[0].token_ids) for p, d in zip(parts, deltas))
    whole = SupportRows.concat(parts)
    assert whole.ids.tolist() == support_of(final).ids.tolist()

    def merged():  # what AsyncLLM's collector does when the consumer lags behind
        out = copy.deepcopy(deltas[0])
        for d in deltas[1:]:
            out.add(copy.deepcopy(d), aggregate=True)
        return out.outputs[0]

    with stock_vllm():
        stock = merged()
    assert len(stock.token_ids) == len(final.token_ids)
    assert len(support_of(stock)) == len(parts[0]) != len(stock.token_ids)  # stock keeps the first delta's rows only
    patched = merged()
    assert support_of(patched).ids.tolist() == support_of(final).ids.tolist()


# --------------------------------------------------------------------------- routed experts


@pytest.fixture()
def routes(llm):
    if not routes_supported():
        pytest.skip("vLLM >= 0.31 returns routed experts only on Model Runner V2 (GPU); tested on 0.30")
    return llm


def _tokens(llm, text):
    return llm.get_tokenizer().encode(text)


def test_routes_compact_shape_and_prefix_cache_hit(routes):
    from vllm import SamplingParams

    llm = routes
    prompt = _tokens(llm, " ".join(PROMPTS) * 6)[:200]  # > one 128-token KV block: the rerun hits the cache
    params = SamplingParams(top_k=5, max_tokens=10, seed=5, extra_args={"replay_routed_experts": True})
    with stock_vllm():
        stock = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    r0, r1, r2 = (x.outputs[0].routed_experts for x in (stock, first, second))
    assert r1.shape == (len(prompt) + 10 - 1, 2, 2) and r1.dtype == np.uint8
    assert r0.dtype == r1.dtype and np.array_equal(r0, r1)  # compact already: nothing lost
    assert np.array_equal(r1, r2)
    assert (r1 < 8).all() and (r1[:, :, 0] != r1[:, :, 1]).all()  # 8 experts, 2 distinct per token


def test_multi_turn_trace_with_prompt_starts_equals_full_recompute(routes):
    from vllm import SamplingParams

    from replay_plugin.core.trace import RoutedExpertTrace

    llm = routes
    opt = {"replay_routed_experts": True}
    p1 = _tokens(llm, PROMPTS[0])
    trace = RoutedExpertTrace()
    turn1 = llm.generate(
        {"prompt_token_ids": p1}, SamplingParams(top_k=5, max_tokens=8, seed=1, extra_args=opt), use_tqdm=False
    )[0].outputs[0]
    trace.record_generation(
        prompt_token_count=len(p1), generated_token_count=len(turn1.token_ids), routed_experts=turn1.routed_experts
    )
    observation = _tokens(llm, " numbers 4 5")
    p2 = p1 + list(turn1.token_ids) + observation
    start = trace.prompt_start
    turn2 = llm.generate(
        {"prompt_token_ids": p2},
        SamplingParams(top_k=5, max_tokens=8, seed=2, extra_args=opt, routed_experts_prompt_start=start),
        use_tqdm=False,
    )[0].outputs[0]
    assert turn2.routed_experts.shape[0] == len(p2) - start + len(turn2.token_ids) - 1  # prompt start honoured
    trace.record_generation(
        prompt_token_count=len(p2), generated_token_count=len(turn2.token_ids), routed_experts=turn2.routed_experts
    )
    full = p2 + list(turn2.token_ids)
    loss = [0] * len(p1) + [1] * len(turn1.token_ids) + [0] * len(observation) + [1] * len(turn2.token_ids)
    traced = trace.finalize(len(full), loss)
    recompute = (
        llm.generate({"prompt_token_ids": full}, SamplingParams(max_tokens=1, extra_args=opt), use_tqdm=False)[0]
        .outputs[0]
        .routed_experts
    )
    captured = len(full) - 1
    assert traced.routes.shape == (len(full), 2, 2) and traced.router_padding_mask.sum() == 1
    assert np.array_equal(traced.routes[:captured], recompute[:captured])


# --------------------------------------------------------------------------- activation


def test_every_process_is_activated(llm):
    _generate(llm, _params(n=1, top_k=5, extra_args=OPT_IN))
    docs = []
    for path in glob.glob(os.path.join(OfflineEngine.status_dir, "*.json")):
        with open(path) as fh:
            docs.append(json.load(fh))
    names = {d["process"]["process_name"]: {p["name"]: p["state"] for p in d["patches"]} for d in docs}
    main = names.get("MainProcess")
    assert main and main["vllm.sample_support"] == "applied" and main["vllm.routed_experts"] == "applied"
    assert any("EngineCore" in (n or "") for n in names), names
    assert any("Worker" in (n or "") for n in names), names
    for patches in names.values():  # every process loaded the pack (targets live in the API server only)
        assert {"vllm.sample_support", "vllm.routed_experts", "vllm.openai_fields"} <= set(patches)
