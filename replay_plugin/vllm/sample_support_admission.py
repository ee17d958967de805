"""``vllm.sample_support``, admission: fit the engine to capture, plan or refuse each request.

Part of the ``vllm.sample_support`` patch (``sample_support.py`` installs it). Capture needs
processed logprobs, ``max_logprobs >= W`` and replayable sampler settings; stock vLLM checks
none of that. Remove with the patch (see compat_matrix.yaml).
"""

from __future__ import annotations

import logging
from typing import Any

from .. import states
from ..core.sampler import check_replayable
from . import options
from .sample_support_capture import count_request

log = logging.getLogger("replay_plugin")


PROCESSED = "processed_logprobs"


class SampleSupportRefused(ValueError):
    """A request opted into support capture with settings that cannot be replayed.

    ``setting`` names the sampler or engine setting (``temperature``, ``top_k``,
    ``logprobs_mode``...). The class actually raised also derives from vLLM's
    ``VLLMValidationError`` so that the OpenAI server answers HTTP 400.
    """

    setting: str | None = None


_refusal_class: type | None = None


def _refusal(message: str, setting: str | None, value: Any = None) -> SampleSupportRefused:
    global _refusal_class
    if _refusal_class is None:  # vLLM is imported by now: this code runs inside its front end
        from vllm.exceptions import VLLMValidationError

        class Refused(SampleSupportRefused, VLLMValidationError):
            def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
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
        states.note(message)


# --------------------------------------------------------------------------- engine configuration


def _fit_engine(wrapped, instance, args, kwargs):
    """``EngineArgs.create_engine_config``: for a job that opted in, processed logprobs and
    ``max_logprobs >= MAX_WIDTH`` (logged, noted in the status file); the caller's
    ``EngineArgs`` is left as it was. Other jobs get the configuration they asked for."""
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
        message = f"vllm.sample_support: {options.REQUESTS_ENV}={mode}: engine configuration changed: " + ", ".join(
            changes
        )
        log.warning("replay_plugin: %s (logprobs of every request are now processed logprobs)", message)
        states.note(message)
    return config


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


def _opts_in(extra: dict | None) -> bool:
    """Whether a request (its ``extra_args``) asks for capture; a bad value of its own key is
    refused, a bad job-wide knob is reported once and treated as off."""
    try:
        return options.wants_support(extra)
    except options.OptionError as exc:
        if exc.key != options.REQUESTS_ENV:  # the request's own key: refuse it
            raise _refusal(f"replay_plugin: {exc}", exc.key) from None
        _warn_once(
            f"vllm.sample_support: {exc}; requests that do not set {options.SUPPORT_KEY!r} are not captured"
        )  # a typo in the job's knob must not fail every request
        return False


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
