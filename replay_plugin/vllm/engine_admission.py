"""Patch ``vllm.engine_admission``: the engine core checks that it can capture each request the
front end planned, and refuses it with the reason otherwise.

Gap (vLLM 0.30-0.32): the front end admits a request for support capture by its *own*
configuration, but a ``vllm serve --headless`` engine (a data-parallel engine on another node)
builds its configuration from its own arguments and environment. Started without
``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS`` it runs ``raw_logprobs``: rows then rank the raw
logits, contain no ``-inf``, and the mass test could flag rows exact that hold tokens outside
the support. Here ``EngineCore.add_request`` checks, for every planned request, the engine's
``logprobs_mode`` and ``max_logprobs``; a request that does not fit is not scheduled and
finishes at once with ``error`` and the reason, which the front end raises as
``SampleSupportRefused`` (HTTP 400 when served). An in-process engine core raises it directly.
Remove with ``vllm.sample_support``.

vLLM 0.33/0.34: ``EngineCore.add_request`` is 0.32's; the new ``EngineCoreOutput.error`` field
follows the fields the refusal sets, and an ``error`` output without it still reaches
``RequestState.make_request_output``, where ``vllm.sample_support`` raises the reason.
"""

from __future__ import annotations

import logging
from typing import Any

from ..patcher import Patcher
from . import options
from .refusal import engine_refusal_reason, refusal

log = logging.getLogger("replay_plugin")

PROCESSED = "processed_logprobs"
_FIX = (
    "this engine built its own configuration (e.g. `vllm serve --headless`, a data-parallel "
    f"engine on another node): start it with {options.REQUESTS_ENV}=opt-in in its environment "
    "(the plugin then fits it), or with --logprobs-mode processed_logprobs and a large enough "
    "--max-logprobs"
)


def misfit(plan: Any, params: Any, model_config: Any) -> tuple[str, str] | None:
    """``(setting, message)`` when an engine with ``model_config`` cannot capture a request of
    this plan and ``SamplingParams``; None when it can."""
    if not isinstance(plan, dict):
        return "extra_args", "the request carries a malformed capture plan"
    mode = getattr(model_config, "logprobs_mode", None)
    mode = str(getattr(mode, "value", mode))
    if plan.get("native"):
        if not getattr(model_config, "return_sampling_mask", False):
            return (
                "return_sampling_mask",
                "the front end planned vLLM's native sampling mask, this engine does not return it",
            )
        return None
    if mode != PROCESSED:
        return "logprobs_mode", f"this engine runs logprobs_mode={mode!r}, capture needs {PROCESSED!r}"
    asked = getattr(params, "logprobs", None)
    limit = getattr(model_config, "max_logprobs", None)
    if asked is None or (asked != -1 and asked < int(plan.get("width", 0))):
        return (
            "logprobs",
            f"the request asks the engine for logprobs={asked!r}, its support rows need {plan.get('width')}",
        )
    # -1 means the whole vocabulary, for the request and for the engine, as vLLM reads it
    # (0.30-0.32 ``SamplingParams._validate_logprobs``: both become ``get_vocab_size()``): a
    # ``logprobs=-1`` request fits any engine whose ``max_logprobs`` reaches the vocabulary.
    needed = _vocabulary(model_config) if asked == -1 else asked
    if isinstance(limit, int) and limit != -1 and (needed is None or needed > limit):
        shown = f"{asked} (the vocabulary, {needed})" if asked == -1 and needed is not None else f"{asked}"
        return "max_logprobs", f"this engine allows max_logprobs={limit}, the request needs logprobs={shown}"
    return None


def _vocabulary(model_config: Any) -> int | None:
    try:
        return int(model_config.get_vocab_size())
    except Exception:  # noqa: BLE001 - unknown: a limited engine cannot be shown to fit -1
        return None


def _check(wrapped, instance, args, kwargs):
    """``EngineCore.add_request``: schedule a planned request only if this engine fits it."""
    request = args[0] if args else kwargs["request"]
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    plan = extra.get(options.PLAN_KEY) if extra else None
    if plan is None:
        return wrapped(*args, **kwargs)
    problem = misfit(plan, params, instance.vllm_config.model_config)
    if problem is None:
        return wrapped(*args, **kwargs)
    setting, detail = problem
    message = (
        f"replay_plugin: engine core {getattr(instance, 'engine_index', 0)} cannot capture the "
        f"sampler support of request {request.request_id}: {detail}; {_FIX}"
    )
    log.error("%s", message)
    queue = getattr(instance, "output_queue", None)
    if queue is None:  # engine core in the caller's process: the caller gets the error
        raise refusal(message, setting)
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    output = EngineCoreOutput(
        request.request_id,
        [],
        finish_reason=FinishReason.ERROR,
        stop_reason=engine_refusal_reason(setting, message),
    )
    queue.put_nowait(
        (request.client_index, EngineCoreOutputs(finished_requests={request.request_id}, outputs=[output]))
    )
    return None


def install(patcher: Patcher) -> None:
    patcher.wrap("EngineCore.add_request", _check)
