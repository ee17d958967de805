"""The verl switch of sampler-support replay: keys under ``actor_rollout_ref.rollout.custom``.

verl 0.9.1 has no sampler-support setting; ``RolloutConfig.custom`` ("extension point for custom
configurations", a free dict that verl hands, like the rest of the rollout config, to its vLLM
server actors and agent-loop workers) carries the plugin's keys, so one line of the job's Hydra
overrides switches the whole job on, in every process:

    +actor_rollout_ref.rollout.custom.replay_sample_support=true
    +actor_rollout_ref.rollout.custom.replay_sample_support_slack=16   # optional

The row width is ``W = min(top_k + slack, vocabulary)`` (slack default: the vLLM pack's
``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK``, 16: room for ties at the k-th logit; at most the vLLM
pack's ``MAX_SLACK``, which every request's slack is held to). The agent loop sends the job's slack
with every request, so that every server builds rows of the same ``W`` whatever its environment.

Pure: reads mappings and attributes, imports neither verl nor vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..core.errors import NotReplayable

SWITCH = "replay_sample_support"
SLACK = "replay_sample_support_slack"
PREFIX = "actor_rollout_ref.rollout.custom."
#: the row field of a rollout sample / batch (the agent loop writes it, the FSDP engine reads it)
BATCH_SUPPORT_KEY = "rollout_sample_support"
PROCESSED = "processed_logprobs"


def _custom(rollout_config: Any) -> Mapping[str, Any]:
    custom = rollout_config.get("custom", None) if isinstance(rollout_config, Mapping) else None
    if custom is None and not isinstance(rollout_config, Mapping):
        custom = getattr(rollout_config, "custom", None)
    if custom is None:
        return {}
    if not hasattr(custom, "get"):
        raise NotReplayable(
            "actor_rollout_ref.rollout.custom", f"expected a mapping, got {type(custom).__name__}", value=custom
        )
    return custom


def _flag(value: Any, key: str) -> bool:
    from ..settings import SettingError, parse_bool

    if value is None or isinstance(value, bool):
        return bool(value)
    try:
        return parse_bool(PREFIX + key, str(value))
    except SettingError as exc:
        raise NotReplayable(PREFIX + key, str(exc), value=value) from None


#: every key of the plugin's under ``custom`` (verl accepts any key there: a misspelt switch would
#: otherwise be ignored by verl and by the plugin alike, and the job would train over the full vocabulary)
KEYS = (SWITCH, SLACK)
_OURS = "replay_"


def unknown_keys(rollout_config: Any) -> list[str]:
    """``custom`` keys that look like the plugin's (``replay_*``, any case) but are none of ``KEYS``:
    one message each, with the closest known key."""
    import difflib

    out = []
    for key in _custom(rollout_config):
        name = str(key)
        if name.lower().startswith(_OURS) and name not in KEYS:
            close = difflib.get_close_matches(name.lower(), KEYS, n=1, cutoff=0.6)
            hint = f"; did you mean {PREFIX}{close[0]}?" if close else f" (known: {', '.join(KEYS)})"
            out.append(f"{PREFIX}{name} is not a key of replay-plugin's{hint}")
    return out


def requested(rollout_config: Any) -> bool:
    """Whether the job asked for sampler-support replay (``custom.replay_sample_support``).

    Raises ``NotReplayable`` for a ``replay_*`` key under ``custom`` the plugin does not know: a
    misspelt switch is refused, not read as "off"."""
    unknown = unknown_keys(rollout_config)
    if unknown:
        raise NotReplayable(PREFIX.rstrip("."), "; ".join(unknown), value=sorted(_custom(rollout_config)))
    return _flag(_custom(rollout_config).get(SWITCH, False), SWITCH)


def slack(rollout_config: Any) -> int | None:
    """The job's slack (``custom.replay_sample_support_slack``), or None: the vLLM pack's default.

    Refused (``NotReplayable`` naming the key) unless an int in ``[0, MAX_SLACK]``: the vLLM pack
    refuses a request's slack above its cap, so a larger one would pass the server's start and fail
    every request."""
    from ..vllm.options import MAX_SLACK

    value = _custom(rollout_config).get(SLACK, None)
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdecimal() or not text.isascii() or int(text) > MAX_SLACK:
        raise NotReplayable(
            PREFIX + SLACK, f"{PREFIX}{SLACK}={value!r}: expected an int in [0, {MAX_SLACK}]", value=value
        )
    return int(text)


def job_slack(rollout_config: Any) -> int:
    from ..vllm import options

    own = slack(rollout_config)
    return options.job_slack() if own is None else own


def width(rollout_config: Any, vocabulary: int | None) -> int:
    """``W = min(top_k + slack, vocabulary)`` of the job's training sampler (``rollout.top_k``)."""
    top_k = _get(rollout_config, "top_k")
    w = int(top_k) + job_slack(rollout_config)
    return min(w, int(vocabulary)) if vocabulary else w


#: the size of one training batch's rows above which the agent loop warns (once per process)
ROW_BYTES_WARNING = 1 << 30


def row_memory_warning(config: Any, width: int) -> str | None:
    """The warning when the rows of one training batch, int32 ``[samples, response_length, W]``
    with ``data.train_batch_size * rollout.n`` samples (the V0 tensor; V1's jagged field holds up to
    that), exceed :data:`ROW_BYTES_WARNING`; None below it, or where ``config`` (verl's job config)
    does not give the sizes."""
    rollout = _get(_get(config, "actor_rollout_ref"), "rollout")
    sizes = (_get(_get(config, "data"), "train_batch_size"), _get(rollout, "n"), _get(rollout, "response_length"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        return None
    prompts, n, length = sizes
    size = prompts * n * length * int(width) * 4
    if size <= ROW_BYTES_WARNING:
        return None
    return (
        f"the support rows of one training batch take up to {size / 2**30:.1f} GiB (int32 ids: data.train_batch_size "
        f"{prompts} x actor_rollout_ref.rollout.n {n} x response_length {length} x row width W {width}), carried "
        f"beside the batch through Ray and the TransferQueue to the engines; to lower it, lower {PREFIX}{SLACK} "
        "(W = top_k + slack) or actor_rollout_ref.rollout.top_k, or the batch"
    )


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def check_rollout_config(rollout_config: Any) -> None:
    """Refuse (``NotReplayable`` naming the verl key) a rollout config whose training sampler the
    plugin cannot replay: verl's own settings, checked before any engine starts. The vLLM pack
    checks each resolved request again (penalties, logit bias, speculative decoding, ...)."""
    top_k = _get(rollout_config, "top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 1:
        raise NotReplayable(
            "actor_rollout_ref.rollout.top_k",
            f"{PREFIX}{SWITCH}=true needs a bounded sampler: actor_rollout_ref.rollout.top_k > 1 (got {top_k!r}); "
            "the support rows hold top_k + slack ids",
            value=top_k,
        )
    temperature = _get(rollout_config, "temperature", 1.0)
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not number or not math.isfinite(temperature) or temperature <= 0.01:
        raise NotReplayable(
            "actor_rollout_ref.rollout.temperature",
            f"{PREFIX}{SWITCH}=true needs a finite actor_rollout_ref.rollout.temperature > 0.01 (got "
            f"{temperature!r}): greedy decoding or vLLM's floor temperature has no support to replay, NaN or inf no "
            "distribution to sample from",
            value=temperature,
        )
    mode = _get(rollout_config, "logprobs_mode", PROCESSED)
    if mode is not None and str(mode) != PROCESSED:
        raise NotReplayable(
            "actor_rollout_ref.rollout.logprobs_mode",
            f"{PREFIX}{SWITCH}=true needs actor_rollout_ref.rollout.logprobs_mode={PROCESSED} (got {mode!r}): the "
            "rows are read from the sampler's processed logprobs",
            value=mode,
        )
    disaggregation = _get(rollout_config, "disaggregation", None)
    if disaggregation is not None and _get(disaggregation, "enabled", False):
        raise NotReplayable(
            "actor_rollout_ref.rollout.disaggregation.enabled",
            f"{PREFIX}{SWITCH}=true is not implemented for prefill/decode disaggregation (the decode server's rows "
            "do not reach the prefill server's answer): disable it",
            value=True,
        )
    job_slack(rollout_config)
