"""Patch ``vllm.served_endpoints``: endpoints that cannot return replay data refuse a request
that asks for it, before compute.

Gap (vLLM 0.30-0.32): every OpenAI-compatible request model carries ``vllm_xargs``, so a client
can ask for replay data on any endpoint, but only completions, chat completions (both without
beam search) and ``/inference/v1/generate`` return it (``vllm.openai_fields``,
``vllm.generate_fields``). Beam search rebuilds its own sampling parameters per step without the
request's ``vllm_xargs``; the Responses API, the Anthropic Messages API and speech-to-text build
their own response shapes. Those requests were served without replay data, silently; here they
are refused (HTTP 400 naming the endpoint and what to use instead), also when
``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=all`` opts them in (send
``"replay_sample_support": false`` to opt one out). Remove when these endpoints return replay
data (or vLLM refuses unknown ``vllm_xargs``).

``/inference/v1/generate`` returns replay data through ``vllm.generate_fields``. Where that patch
is not serving (a vLLM outside its range, toggled off, failed, reverted, replaced), an opted-in
request to the endpoint is refused naming the patch, its state and the fix; completions and chats
keep their replay data (before, ``vllm.request_guard`` refused every served replay request of a
server whose generate endpoint was loaded). Until this port ``vllm.generate_fields`` stopped before
0.33 and this refusal was what 0.33/0.34 served; it covers them now (its derender case refuses
by itself).

vLLM 0.24 serves ``/inference/v1/generate`` from ``vllm.entrypoints.serve.disagg.serving`` (0.25
moved it to ``vllm.entrypoints.scale_out.token_in_token_out``, same ``serve_tokens``): there this
module runs as ``vllm.served_endpoints_disagg`` over that target, and this patch is retired (without
it the scale_out target would not resolve, the patch would fail, and ``vllm.request_guard`` would
refuse every served replay request). ``request_guard.LINES`` makes either of the pair stand for
both.

vLLM 0.33/0.34 (compared with 0.32, run on both): ``serve_tokens`` builds the derender chat request
(0.34: and its stream processors) before the engine sees the request and still takes the request
model first; ``ResponsesRequest.to_sampling_params`` takes the skip_special_tokens defaults (0.33)
and passes ``thinking_token_budget`` (0.34), after this wrapper's refusal; the Anthropic and Cohere
endpoints still enter through ``create_chat_completion``; the speech-to-text methods are unchanged.

The same wrappers see the client's ``temperature`` on completions and chats before vLLM builds
its ``SamplingParams``, which raises any value in ``(0, 0.01)`` to 0.01 silently (0.30-0.32): a
captured request with such a temperature is refused naming the value it sent (the capture's
admission, which sees only the raised value, refuses 0.01 itself; ``sample_support_admission``).
"""

from __future__ import annotations

from typing import Any

from ..patcher import Patcher
from . import options
from .refusal import VLLM_TEMPERATURE_FLOOR, refusal, temperature_fix

_USE = "use /v1/completions, /v1/chat/completions (without beam search) or /inference/v1/generate"


def _wants_replay(xargs: Any) -> bool:
    try:
        return options.wants_support(xargs) or options.explicit_routes(xargs)
    except options.KnobError:
        raise
    except options.OptionError as exc:
        raise refusal(f"replay_plugin: {exc}", exc.key) from None


def _refuse(endpoint: str) -> None:
    raise refusal(
        f"replay_plugin: the request asks for replay data ({options.REQUEST_SUPPORT_KEY!r}, "
        f"{options.ROUTES_KEY!r} or the job's {options.REQUESTS_ENV}=all) but {endpoint} cannot "
        f"return it; {_USE}, or send {options.REQUEST_SUPPORT_KEY!r}: false",
        options.REQUEST_SUPPORT_KEY,
    )


def _check_temperature(request: Any) -> None:
    """Refuse a captured request whose temperature vLLM would raise to its floor, by the value
    the client sent (``0 < temperature < 0.01``; 0 is greedy, refused by the admission)."""
    temperature = getattr(request, "temperature", None)
    if not (isinstance(temperature, (int, float)) and 0 < temperature < VLLM_TEMPERATURE_FLOOR):
        return
    try:
        wants = options.wants_support(getattr(request, "vllm_xargs", None))
    except options.KnobError:
        raise
    except options.OptionError as exc:
        raise refusal(f"replay_plugin: {exc}", exc.key) from None
    if wants:
        raise refusal(
            f"replay_plugin: request opted into sample-support capture but {temperature_fix(temperature)}",
            "temperature",
            temperature,
        )


def _request_method(endpoint: str):
    """A wrapper for a request model's method: refuse when the request itself opts in."""

    def wrapper(wrapped, instance, args, kwargs):
        if _wants_replay(getattr(instance, "vllm_xargs", None)):
            _refuse(endpoint)
        return wrapped(*args, **kwargs)

    return wrapper


def _chat(wrapped, instance, args, kwargs):
    """``OpenAIServingChat.create_chat_completion``: beam search, and subclasses that reshape the
    chat response (the Anthropic Messages API calls it on its own serving object)."""
    request = args[0] if args else kwargs.get("request")
    _check_temperature(request)
    if _wants_replay(getattr(request, "vllm_xargs", None)):
        if getattr(request, "use_beam_search", False):
            _refuse("beam search (use_beam_search)")
        if type(instance).__name__ != "OpenAIServingChat":
            _refuse(f"{type(instance).__name__} (it reshapes the chat response, e.g. /v1/messages)")
    return wrapped(*args, **kwargs)


def _completion(wrapped, instance, args, kwargs):
    """``OpenAIServingCompletion.create_completion``: beam search."""
    request = args[0] if args else kwargs.get("request")
    _check_temperature(request)
    if getattr(request, "use_beam_search", False) and _wants_replay(getattr(request, "vllm_xargs", None)):
        _refuse("beam search (use_beam_search)")
    return wrapped(*args, **kwargs)


def _generate(wrapped, instance, args, kwargs):
    """``ServingTokens.serve_tokens``: an opted-in request needs ``vllm.generate_fields``."""
    request = kwargs["request"] if "request" in kwargs else (args[0] if args else None)
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    if _wants_replay(extra):
        from .request_guard import patch_problems

        problems = patch_problems(["vllm.generate_fields"])
        if problems:
            raise refusal(
                f"replay_plugin: the request asks for replay data ({options.REQUEST_SUPPORT_KEY!r}, "
                f"{options.ROUTES_KEY!r} or the job's {options.REQUESTS_ENV}=all) but /inference/v1/generate "
                f"cannot return it in this server: {'; '.join(problems)}; or use /v1/completions or "
                "/v1/chat/completions, which return it",
                options.REQUEST_SUPPORT_KEY,
            )
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    # Armed when the chat serving module has loaded (its bases and the protocol modules are
    # loaded by then; arming on a protocol module imported serving modules half-initialised).
    patcher.wrap("OpenAIServingChat.create_chat_completion", _chat)
    patcher.wrap("OpenAIServingCompletion.create_completion", _completion)
    patcher.wrap("ServingTokens.serve_tokens", _generate)
    patcher.wrap("ResponsesRequest.to_sampling_params", _request_method("the Responses API (/v1/responses)"))
    for name in ("TranscriptionRequest", "TranslationRequest"):
        for method in ("to_sampling_params", "to_beam_search_params"):
            patcher.wrap(f"{name}.{method}", _request_method("speech-to-text (/v1/audio/...)"))
