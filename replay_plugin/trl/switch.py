"""The TRL switch: the plugin's keys in ``GRPOConfig.generation_kwargs["extra_args"]``.

TRL hands ``generation_kwargs`` to every generation backend: vLLM colocate merges it into
``SamplingParams`` (where ``extra_args`` is vLLM's own per-request field, the one the vLLM pack
reads), vLLM server mode puts it into the request body, HF generate into its ``GenerationConfig``.
So one dict switches a job on::

    GRPOConfig(..., top_k=20,
               generation_kwargs={"extra_args": {"replay_sample_support": True,
                                                 "replay_routed_experts": True}})

The keys are the vLLM pack's request keys (``replay_plugin.vllm.options``): the same values count
as true and false, ``replay_sample_support_slack`` sets the row width ``W = top_k + slack``. Stock
TRL ignores the keys without a word, so the trainer's guard refuses a job whose switch is set
where a needed patch is not in place.

Pure: reads mappings and attributes, imports neither trl nor vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import NotReplayable
from ..vllm import options

#: where the switch lives, as a user writes it
WHERE = 'GRPOConfig.generation_kwargs["extra_args"]'
KEYS = (options.REQUEST_SUPPORT_KEY, options.SLACK_KEY, options.ROUTES_KEY)


@dataclass(frozen=True)
class Ask:
    """What a TRL job asked the plugin for."""

    support: bool = False
    routes: bool = False
    slack: int | None = None  # None: the vLLM pack's job default (REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK)

    @property
    def any(self) -> bool:
        return self.support or self.routes


def extra_args(generation_kwargs: Any) -> Mapping[str, Any]:
    """The ``extra_args`` mapping of TRL's ``generation_kwargs`` (empty when there is none).

    Raises:
        NotReplayable: ``extra_args`` is there but not a mapping.
    """
    if not generation_kwargs:
        return {}
    if not isinstance(generation_kwargs, Mapping):
        return {}
    extra = generation_kwargs.get("extra_args")
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise NotReplayable(WHERE, f"{WHERE} is {type(extra).__name__}, expected a dict", value=extra)
    return extra


def asked(args: Any) -> Ask:
    """What ``args`` (a ``GRPOConfig``, or anything with ``generation_kwargs``) asks for.

    Raises:
        NotReplayable: a ``replay_*`` key the plugin does not know (a misspelt switch would
            otherwise train without replay), or a bad value (naming the key and the value).
    """
    extra = extra_args(getattr(args, "generation_kwargs", None))
    unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("replay_") and k not in KEYS)
    if unknown:
        raise NotReplayable(
            WHERE,
            f"{WHERE} has {', '.join(map(repr, unknown))}, which the plugin does not know; "
            f"its keys are {', '.join(KEYS)}",
        )
    try:
        support = _flag(extra, options.REQUEST_SUPPORT_KEY)
        routes = _flag(extra, options.ROUTES_KEY)
        slack = (
            options.non_negative_int(extra[options.SLACK_KEY], options.SLACK_KEY, options.MAX_SLACK)
            if options.SLACK_KEY in extra
            else None
        )
    except options.OptionError as exc:
        raise NotReplayable(WHERE, f"{WHERE}: {exc}") from exc
    return Ask(support=support, routes=routes, slack=slack)


def _flag(extra: Mapping[str, Any], key: str) -> bool:
    return options.flag(extra[key], key) if key in extra else False
