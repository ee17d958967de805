"""Which sampler settings sampler-support replay can reproduce: :func:`check_replayable`.

The trainer reproduces ``softmax(z / T)`` restricted to the recorded support, so the engine may
*mask* tokens in any way (top-k, top-p, min-p, allowed ids, bad words, grammars) but must not
change the values of the surviving logits (penalties, logit bias, logits processors), and the
captured rows must be the sampler's real support (processed logprobs, no speculative decoding).
Duck-typed: imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replay_plugin.core.errors import NotReplayable

#: vLLM replaces temperatures in (0, 0.01) by 0.01 and treats < 1e-5 as greedy.
MIN_TEMPERATURE = 1e-2

_DEFAULTS = {
    "temperature": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "logits_processors": None,
}
_MISSING = object()


def check_replayable(params: Any, engine: Any = None, *, width: int | None = None) -> None:
    """Return None when support replay can reproduce these settings, else raise ``NotReplayable``.

    Args:
        params: vLLM ``SamplingParams`` or a mapping of its fields (a missing key takes
            vLLM's default).
        engine: optional engine configuration: an object or mapping with ``logprobs_mode``,
            ``max_logprobs``, ``speculative_config`` and ``logits_processors`` on itself or on
            its ``model_config`` / ``vllm_config`` / ``llm_engine`` (vLLM's ``EngineArgs``,
            ``ModelConfig``, ``VllmConfig`` or an ``LLM``). Not visible here: defaults merged
            later from the model's ``generation_config`` (check the resolved parameters) and
            logits processors installed through the ``vllm.logits_processors`` entry points.
        width: the support row width ``W`` that will be recorded (default: ``top_k``).

    Refused (``NotReplayable``, a ``ValueError``, with the setting in its message and in
    ``.setting``):
        ``temperature`` below 0.01 (greedy, or raised by vLLM to a value the trainer would not
        use); ``top_k`` disabled (0, -1, None: the support is unbounded) or 1 (a one-token
        support has logprob 0 and no gradient), or larger than ``width``;
        ``repetition_penalty`` != 1, ``presence_penalty`` / ``frequency_penalty`` != 0, a
        non-zero ``logit_bias``, per-request ``logits_processors`` (they change logit values).
        Engine (each checked when the engine carries it): ``logprobs_mode`` other than
        ``processed_logprobs`` (raw modes rank the unprocessed logits, not the sampler's
        support); ``max_logprobs`` below ``width`` (unless -1, unlimited); any
        ``speculative_config`` (not shown to leave the captured support exact); engine-level
        ``logits_processors``.
    Accepted: ``top_p``, ``min_p``, ``bad_words``, ``allowed_token_ids``, ``min_tokens``,
    structured outputs, ``seed``, ``n`` (masks or sampling choices the support records).
    """
    w = _check_sampler(params, width)
    if engine is not None:
        _check_engine(engine, w)


def _check_sampler(params: Any, width: int | None) -> int:
    """Refuse the request's own settings; return the support width ``W`` (``width`` or ``top_k``)."""
    temperature = _number(params, "temperature")
    if temperature is None or temperature < MIN_TEMPERATURE:
        raise NotReplayable(
            "temperature",
            f"sampler setting 'temperature'={temperature!r} is not replayable: it must be >= "
            f"{MIN_TEMPERATURE} (vLLM samples greedily below 1e-5 and raises smaller values to 0.01)",
            value=temperature,
        )
    top_k = _value(params, "top_k")
    if top_k is None or isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 1:
        raise NotReplayable(
            "top_k",
            f"sampler setting 'top_k'={top_k!r} is not replayable: set top_k > 1 (0 or -1 disables "
            "it and leaves the support unbounded; top_k=1 is greedy and carries no gradient)",
            value=top_k,
        )
    w = top_k if width is None else int(width)
    if top_k > w:
        raise NotReplayable(
            "top_k",
            f"sampler setting 'top_k'={top_k} exceeds the support width {w}: rows would be truncated",
            value=top_k,
        )
    _check_logit_changes(params)
    return w


def _check_logit_changes(params: Any) -> None:
    """Refuse settings that change the values of surviving logits (penalties, bias, processors)."""
    rep = _number(params, "repetition_penalty")
    if rep is not None and rep != 1.0:
        raise NotReplayable(
            "repetition_penalty",
            f"sampler setting 'repetition_penalty'={rep} is not replayable (must be 1.0)",
            value=rep,
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(params, name)
        if value is not None and value != 0.0:
            raise NotReplayable(name, f"sampler setting {name!r}={value} is not replayable (must be 0.0)", value=value)
    bias = _value(params, "logit_bias")
    if bias:
        values = bias.values() if isinstance(bias, Mapping) else [1.0]
        if any(float(b) != 0.0 for b in values):
            raise NotReplayable(
                "logit_bias",
                "sampler setting 'logit_bias' is not replayable: it changes logit values",
                value=bias,
            )
    procs = _value(params, "logits_processors")
    if procs:
        raise NotReplayable(
            "logits_processors",
            "sampler setting 'logits_processors' is not replayable: custom processors change logit values",
            value=procs,
        )


def _check_engine(engine: Any, w: int) -> None:
    """Refuse engine settings under which the captured rows are not the sampler's support."""
    mode = _engine_value(engine, "logprobs_mode")
    mode = getattr(mode, "value", mode)
    if mode is not _MISSING and str(mode) != "processed_logprobs":
        raise NotReplayable(
            "logprobs_mode",
            f"engine setting 'logprobs_mode'={mode!r} is not replayable: it must be "
            "'processed_logprobs' (logprobs after temperature, penalties and top-k/top-p/min-p)",
            value=mode,
        )
    max_logprobs = _engine_value(engine, "max_logprobs")
    if max_logprobs is not _MISSING and max_logprobs is not None and max_logprobs != -1 and max_logprobs < w:
        raise NotReplayable(
            "max_logprobs",
            f"engine setting 'max_logprobs'={max_logprobs} is smaller than the support width {w}: "
            f"start the engine with max_logprobs >= {w} (or -1)",
            value=max_logprobs,
        )
    spec = _engine_value(engine, "speculative_config")
    if spec is not _MISSING and spec:
        raise NotReplayable(
            "speculative_config",
            "engine setting 'speculative_config' is not replayable: speculative decoding is not "
            "shown to leave the captured support exact",
            value=spec,
        )
    procs = _engine_value(engine, "logits_processors")
    if procs is not _MISSING and procs:
        raise NotReplayable(
            "logits_processors",
            "engine setting 'logits_processors' is not replayable: custom processors change logit values",
            value=procs,
        )


def _value(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, _DEFAULTS.get(name))
    return getattr(obj, name, _DEFAULTS.get(name))


def _number(obj: Any, name: str) -> float | None:
    value = _value(obj, name)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise NotReplayable(name, f"sampler setting {name!r}={value!r} is not a number", value=value) from None


def _lookup(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, _MISSING)
    return getattr(obj, name, _MISSING)


def _engine_value(engine: Any, name: str) -> Any:
    """``name`` on the engine or on the config objects it carries, first found wins."""
    seen: list[Any] = []
    queue = [engine]
    while queue:
        obj = queue.pop(0)
        if obj is None or any(obj is s for s in seen) or len(seen) > 8:
            continue
        seen.append(obj)
        value = _lookup(obj, name)
        if value is not _MISSING:
            return value
        for child in ("model_config", "vllm_config", "llm_engine"):
            sub = _lookup(obj, child)
            if sub is not _MISSING:
                queue.append(sub)
    return _MISSING
