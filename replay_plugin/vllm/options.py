"""Who opted into replay data, and with which width: the knobs and the per-request keys.

Never imports vLLM: imported by the patch pack (every process that imports a watched upstream)
and by the patch code.

Per request, in ``SamplingParams.extra_args`` (served: the ``vllm_xargs`` object of an
OpenAI-compatible completion or chat request, which vLLM copies into ``extra_args``):

====================================  ==========================================================
``replay_sample_support``             true: capture the sampler support of every generated
                                      token (``false`` opts a request out of ``REQUESTS=all``)
``replay_sample_support_slack``       int >= 0: row width ``W = top_k + slack`` for this request
``replay_routed_experts``             true: routed experts in the compact dtype (and as a
                                      wire document when served); implied by
                                      ``replay_sample_support``
====================================  ==========================================================

``vllm_xargs`` only carries strings and numbers, so ``1``, ``"1"``, ``"true"``, ``"yes"`` and
``"on"`` count as true, ``0``, ``"0"``, ``"false"``, ``"no"`` and ``"off"`` as false; anything else
is refused with an error naming the key. Numbers given as strings (the slack, the width knobs)
are ASCII digits only: ``"²"`` or ``"٣"`` are refused like any other bad value (``str.isdigit``
accepts both; ``int`` raised on the first, a 500, and read the second as 3). Keys starting with
``_replay_plugin`` are the plugin's own (:data:`PLAN_KEY`): a request that sets one is refused.

Per job, environment variables (declared as knobs on the patch specs):

``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS``
    unset (default): the job has not opted in. The engine configuration is left exactly as the
    user built it; a request that opts in is served only when that configuration already fits
    (``logprobs_mode="processed_logprobs"``, ``max_logprobs >= W``) and refused otherwise, with
    the setting named. ``opt-in``: the job opts in; the engine is fitted when its configuration
    is created (logged) and requests opt in one by one. ``all``: as ``opt-in``, and every
    request is captured unless it opts out.
``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK``
    default slack (default 16): extra logprob entries requested beyond ``top_k``.
``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_MAX_WIDTH``
    the ``max_logprobs`` a fitted engine gets at least (default 128): the widest row a request
    may ask for.
``REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS``
    ``opt-in`` (default) or ``all``: which requests get compact (and, served, wire-encoded)
    routed experts. ``all`` also starts the engine with ``enable_return_routed_experts`` (for
    frameworks that build their own engine without it: OpenRLHF).

:func:`check_job_knobs` validates all of them; the engine configuration calls it, so a server
with an invalid value does not start (the error names the variable).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ..settings import SettingError, parse_bool
from ..spec import Knob

#: ``extra_args`` keys a request opts in with.
REQUEST_SUPPORT_KEY = "replay_sample_support"
SLACK_KEY = "replay_sample_support_slack"
ROUTES_KEY = "replay_routed_experts"
#: ``extra_args`` key under which the plugin passes a request's capture plan from the input
#: processor to the output processor (both in the API-server process). Never set it yourself.
PLAN_KEY = "_replay_plugin_sample_support"
#: Prefix of the plugin's internal ``extra_args`` keys (clients may not set them).
INTERNAL_PREFIX = "_replay_plugin"
#: Largest accepted ``replay_sample_support_slack`` (rows are capped at the vocabulary anyway;
#: the bound keeps the value an int64 for vLLM's msgpack transport).
MAX_SLACK = 1 << 20

REQUESTS_ENV = "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS"
SLACK_ENV = "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK"
MAX_WIDTH_ENV = "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_MAX_WIDTH"
ROUTES_REQUESTS_ENV = "REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS"

DEFAULT_SLACK = 16
DEFAULT_MAX_WIDTH = 128
_MODES = ("", "opt-in", "all")

SUPPORT_KNOBS = (
    Knob(
        REQUESTS_ENV,
        "",
        "`opt-in`: this job captures sampler support for requests with `extra_args`/`vllm_xargs` "
        '`{"replay_sample_support": true}` and the plugin fits the engine (processed logprobs, '
        "`max_logprobs`), logged; `all`: every request is captured (non-replayable ones are "
        "refused); unset: the engine is left alone and opted-in requests are refused unless it "
        "already fits",
    ),
    Knob(
        SLACK_ENV,
        str(DEFAULT_SLACK),
        "extra logprob entries captured beyond `top_k`: row width `W = top_k + slack` (ties at the "
        "k-th logit widen the support); per request `replay_sample_support_slack`",
    ),
    Knob(
        MAX_WIDTH_ENV,
        str(DEFAULT_MAX_WIDTH),
        "the `max_logprobs` a fitted engine gets at least: the widest support row a request can ask for",
    ),
)
ROUTES_KNOBS = (
    Knob(
        ROUTES_REQUESTS_ENV,
        "opt-in",
        "`all`: every request's routed experts come back compact (served: as a wire document), and "
        "the engine is started with `enable_return_routed_experts` (on CPU also `enforce_eager`), logged; "
        "`opt-in`: only requests with `replay_routed_experts` or `replay_sample_support`",
    ),
)


class OptionError(ValueError):
    """A replay key or knob holds a value the plugin cannot interpret (names the key)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.detail = message
        super().__init__(f"{key}: {message}")


class KnobError(OptionError):
    """A job-wide ``REPLAY_PLUGIN_VLLM_*`` variable is invalid: a server misconfiguration, not
    the request's fault (raised when the engine configuration is created)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.detail = message
        ValueError.__init__(
            self,
            f"replay_plugin: invalid {key}: {message} (server configuration: fix or unset the "
            "variable in the environment of every vLLM process)",
        )


#: Whitespace stripped around a string value: ASCII only (``str.strip()`` would also strip
#: Unicode spaces, which ``int()`` then accepts too).
_ASCII_SPACE = " \t\r\n"
#: A non-negative decimal integer in ASCII digits (``str.isdigit()`` is true for ``"²"``, which
#: ``int()`` rejects, and for ``"٣"``, which ``int()`` reads as 3).
_ASCII_INT = re.compile(r"\+?[0-9]{1,39}")


def _ascii_text(value: str) -> str | None:
    """``value`` without surrounding ASCII whitespace, or None when it holds a non-ASCII
    character (every spelling the plugin accepts is ASCII)."""
    return value.strip(_ASCII_SPACE) if value.isascii() else None


def flag(value: Any, key: str) -> bool:
    """``extra_args`` value -> bool (see the module docstring for accepted spellings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and len(value) < 40 and (text := _ascii_text(value)):
        try:
            return parse_bool(key, text)
        except SettingError:
            pass
    shown = value if not isinstance(value, str) or len(value) <= 40 else value[:40] + "..."
    raise OptionError(key, f'got {shown!r}; expected true/false (1/0, "true"/"false")')


def non_negative_int(value: Any, key: str, maximum: int | None = None) -> int:
    """An int >= 0 (at most ``maximum``) from an int, an integral float or a string of ASCII
    digits (an optional ``+``, surrounding ASCII whitespace); anything else raises
    ``OptionError`` naming ``key``, never another exception."""
    expected = "an int >= 0" if maximum is None else f"an int in [0, {maximum}]"
    number: int | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, str):
        text = _ascii_text(value) if len(value) < 80 else None
        if text is not None and _ASCII_INT.fullmatch(text):
            number = int(text)
    elif isinstance(value, int) and value >= 0:
        number = value
    elif isinstance(value, float) and value.is_integer() and value >= 0:
        number = int(value)
    if number is None or (maximum is not None and number > maximum):
        shown = value if not isinstance(value, str) or len(value) <= 40 else value[:40] + "..."
        raise OptionError(key, f"got {shown!r}; expected {expected}")
    return number


def _env(name: str, default: str, environ: Mapping[str, str] | None) -> str:
    env = os.environ if environ is None else environ
    return env.get(name, default)


def _knob(read: Any) -> Any:
    try:
        return read()
    except KnobError:
        raise
    except OptionError as exc:
        raise KnobError(exc.key, exc.detail) from None


def _choice(value: str) -> str:
    """A knob's keyword, lower-cased; a non-ASCII value is kept as given (no keyword matches it)."""
    text = _ascii_text(value)
    return value if text is None else text.lower()


def job_mode(environ: Mapping[str, str] | None = None) -> str:
    """``""`` (not opted in), ``"opt-in"`` or ``"all"``."""
    value = _choice(_env(REQUESTS_ENV, "", environ))
    if value not in _MODES:
        raise KnobError(REQUESTS_ENV, f"got {value!r}; expected 'opt-in' or 'all' (or unset)")
    return value


def job_slack(environ: Mapping[str, str] | None = None) -> int:
    return _knob(lambda: non_negative_int(_env(SLACK_ENV, str(DEFAULT_SLACK), environ), SLACK_ENV, MAX_SLACK))


def job_max_width(environ: Mapping[str, str] | None = None) -> int:
    width = _knob(lambda: non_negative_int(_env(MAX_WIDTH_ENV, str(DEFAULT_MAX_WIDTH), environ), MAX_WIDTH_ENV))
    if width < 2:
        raise KnobError(MAX_WIDTH_ENV, f"got {width}; expected an int >= 2")
    return width


def routes_mode(environ: Mapping[str, str] | None = None) -> str:
    value = _choice(_env(ROUTES_REQUESTS_ENV, "opt-in", environ))
    if value not in ("opt-in", "all"):
        raise KnobError(ROUTES_REQUESTS_ENV, f"got {value!r}; expected 'opt-in' or 'all'")
    return value


def check_job_knobs(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``KnobError`` (naming the variable) when any job-wide knob is invalid."""
    job_mode(environ)
    job_slack(environ)
    job_max_width(environ)
    routes_mode(environ)


def check_request_keys(extra_args: Mapping[str, Any] | None) -> None:
    """Refuse (``OptionError`` naming the key) an internal key set by the client and any replay
    key whose value cannot be read. Reads no environment variable."""
    if not extra_args:
        return
    for key in extra_args:
        if isinstance(key, str) and key.startswith(INTERNAL_PREFIX):
            raise OptionError(key, "is an internal key of replay_plugin; requests cannot set it")
    for key in (REQUEST_SUPPORT_KEY, ROUTES_KEY):
        if key in extra_args:
            flag(extra_args[key], key)
    if SLACK_KEY in extra_args:
        non_negative_int(extra_args[SLACK_KEY], SLACK_KEY, MAX_SLACK)


def wants_support(extra_args: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> bool:
    """Does this request capture its sampler support? Its own key wins over the job mode."""
    if extra_args and REQUEST_SUPPORT_KEY in extra_args:
        return flag(extra_args[REQUEST_SUPPORT_KEY], REQUEST_SUPPORT_KEY)
    return job_mode(environ) == "all"


def request_slack(extra_args: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> int:
    if extra_args and SLACK_KEY in extra_args:
        return non_negative_int(extra_args[SLACK_KEY], SLACK_KEY, MAX_SLACK)
    return job_slack(environ)


def wants_routes(extra_args: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> bool:
    """Does this request get compact, wire-encodable routed experts?

    ``replay_routed_experts`` decides when present; else a captured request (plan) does; else
    ``replay_sample_support`` true implies routes and false opts the request out of
    ``REQUESTS=all`` (only ``ROUTES_REQUESTS=all`` still gives it compact routes).
    """
    if extra_args:
        if ROUTES_KEY in extra_args:
            return flag(extra_args[ROUTES_KEY], ROUTES_KEY)
        if PLAN_KEY in extra_args:
            return True
        if REQUEST_SUPPORT_KEY in extra_args:
            return flag(extra_args[REQUEST_SUPPORT_KEY], REQUEST_SUPPORT_KEY) or routes_mode(environ) == "all"
    return routes_mode(environ) == "all" or job_mode(environ) == "all"


def explicit_routes(extra_args: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> bool:
    """Does this request ask for compact routes by itself (its key, or ``ROUTES_REQUESTS=all``)?"""
    if extra_args and ROUTES_KEY in extra_args:
        return flag(extra_args[ROUTES_KEY], ROUTES_KEY)
    return routes_mode(environ) == "all"
