"""The error a request that asked for replay data is refused with, before any compute.

Shared by the patches that refuse (``vllm.sample_support``, ``vllm.request_guard``,
``vllm.engine_admission``, ``vllm.served_endpoints``); imports nothing heavy, so a refusal still
works when a capture module cannot be imported.
"""

from __future__ import annotations

from typing import Any


class SampleSupportRefused(ValueError):
    """A request asked for replay data (sampler support or routed experts) that cannot be served.

    ``setting`` names the sampler, engine or plugin setting at fault (``temperature``,
    ``logprobs_mode``, ``replay_sample_support``, a patch name...). The class actually raised
    inside vLLM also derives from vLLM's ``VLLMValidationError`` so that ``vllm serve`` answers
    HTTP 400 with the message.
    """

    setting: str | None = None


#: vLLM's temperature floor (0.30-0.32 ``vllm/sampling_params.py`` ``_MAX_TEMP``, the same value
#: as ``core.sampler.MIN_TEMPERATURE``). Surprise: ``SamplingParams.__post_init__`` raises every
#: temperature in ``(0, 0.01)`` to 0.01 with a log line only, when the params are built (the
#: user's object offline; ``to_sampling_params`` served; the request model's parsing on
#: ``/inference/v1/generate``), so no entry point after that sees the value the client sent. A
#: captured request reads as 0.01 whether the client asked 0.01 or 0.005, and the trainer would
#: score its tokens at another temperature than the client believes. Capture therefore refuses
#: 0.01 itself (``sample_support_admission``); served completions and chats, whose request
#: models still hold the client's value, are refused with it (``vllm.served_endpoints``).
VLLM_TEMPERATURE_FLOOR = 1e-2


def temperature_fix(value: Any) -> str:
    """The refusal text of a temperature vLLM raises (or may have raised) to its floor."""
    return (
        f"sampler setting 'temperature'={value!r} is not replayable: vLLM raises every temperature "
        f"in (0, {VLLM_TEMPERATURE_FLOOR:g}) to {VLLM_TEMPERATURE_FLOOR:g} when it builds the "
        "sampling parameters, so the rows would be computed at another temperature than the one "
        f"asked for (and {VLLM_TEMPERATURE_FLOOR:g} itself cannot be told apart from a raised "
        f"value); use a temperature > {VLLM_TEMPERATURE_FLOOR:g}, and the same in the trainer"
    )


_refusal_class: type | None = None


def refusal(message: str, setting: str | None, value: Any = None) -> SampleSupportRefused:
    """A ``SampleSupportRefused`` that vLLM's server turns into HTTP 400 (vLLM must be imported)."""
    global _refusal_class
    if _refusal_class is None:  # vLLM is imported by now: this code runs inside its front end
        from vllm.exceptions import VLLMValidationError

        class Refused(SampleSupportRefused, VLLMValidationError):
            def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
                VLLMValidationError.__init__(self, message, parameter=parameter, value=value)
                self.setting = parameter

            def __reduce__(self) -> tuple:  # picklable across vLLM's processes
                return (refusal, (self.args[0] if self.args else "", self.setting))

        Refused.__name__ = Refused.__qualname__ = "SampleSupportRefused"
        _refusal_class = Refused
    return _refusal_class(message, parameter=setting, value=value)


#: ``stop_reason`` prefix of a request the engine core refused (``vllm.engine_admission``); the
#: front end turns it back into ``SampleSupportRefused``.
ENGINE_REFUSAL_PREFIX = "replay_plugin refused "


def engine_refusal_reason(setting: str, message: str) -> str:
    """The ``stop_reason`` the engine core finishes a refused request with."""
    return f"{ENGINE_REFUSAL_PREFIX}[{setting}]: {message}"


def engine_refusal(finish_reason: Any, stop_reason: Any) -> tuple[str, str] | None:
    """``(setting, message)`` when an engine output says the engine core refused the request."""
    if not isinstance(stop_reason, str) or not stop_reason.startswith(ENGINE_REFUSAL_PREFIX):
        return None
    if str(finish_reason) != "error":
        return None
    head, _, message = stop_reason[len(ENGINE_REFUSAL_PREFIX) :].partition("]: ")
    return head.lstrip("["), message
