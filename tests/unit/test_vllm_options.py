"""Parsing of the replay keys and the ``REPLAY_PLUGIN_VLLM_*`` knobs (``replay_plugin.vllm.options``
imports no vLLM): every bad value is an ``OptionError`` naming its key, never another exception,
and numbers are ASCII digits only."""

from __future__ import annotations

import pytest

from replay_plugin.vllm import options

# str.isdigit() is true for all of these; int() raises on some ("²", "①": HTTP 500 when served)
# and reads others as numbers ("٣" is 3, "３" is 3): neither may reach int().
UNICODE_DIGITS = ["²", "①", "٣", "３", "1٣", "𝟙", "७"]
# Unicode spaces around ASCII digits or keywords: str.strip() and int() accept them.
UNICODE_SPACES = ["\u00a03", "3\u2003", "\u30003"]


@pytest.mark.parametrize("value", UNICODE_DIGITS + UNICODE_SPACES + ["++3", "+-3", "3.0", "0x3", "1_000", " ", ""])
def test_slack_strings_other_than_ascii_digits_are_refused_naming_the_key(value):
    with pytest.raises(options.OptionError, match=options.SLACK_KEY) as info:
        options.check_request_keys({options.REQUEST_SUPPORT_KEY: 1, options.SLACK_KEY: value})
    assert info.value.key == options.SLACK_KEY
    with pytest.raises(options.OptionError, match=options.SLACK_KEY):
        options.request_slack({options.SLACK_KEY: value}, {})


@pytest.mark.parametrize("value, number", [("3", 3), ("+3", 3), (" 12\t", 12), ("0", 0), (3, 3), (3.0, 3)])
def test_slack_accepts_ascii_digits_ints_and_integral_floats(value, number):
    assert options.request_slack({options.SLACK_KEY: value}, {}) == number


@pytest.mark.parametrize("name", [options.SLACK_ENV, options.MAX_WIDTH_ENV])
@pytest.mark.parametrize("value", UNICODE_DIGITS + UNICODE_SPACES + ["++3"])
def test_width_knobs_refuse_non_ascii_digits_naming_the_variable(name, value):
    with pytest.raises(options.KnobError, match=name):
        options.check_job_knobs({name: value})


@pytest.mark.parametrize(
    "name", [options.REQUESTS_ENV, options.ROUTES_REQUESTS_ENV], ids=["requests", "routes-requests"]
)
@pytest.mark.parametrize("value", ["ａｌｌ", "all\u00a0", "\u2003all"])
def test_mode_knobs_refuse_non_ascii_spellings(name, value):
    with pytest.raises(options.KnobError, match=name):
        options.check_job_knobs({name: value})


def test_mode_knobs_keep_their_ascii_spellings():
    options.check_job_knobs({options.REQUESTS_ENV: " ALL\n", options.ROUTES_REQUESTS_ENV: "Opt-In"})
    assert options.job_mode({options.REQUESTS_ENV: " ALL\n"}) == "all"


@pytest.mark.parametrize("key", [options.REQUEST_SUPPORT_KEY, options.ROUTES_KEY])
@pytest.mark.parametrize("value", ["１", "ｔｒｕｅ", "true\u00a0", "on\u2003", "x" * 5000])
def test_flags_refuse_non_ascii_spellings_naming_the_key(key, value):
    with pytest.raises(options.OptionError, match=key) as info:
        options.check_request_keys({key: value})
    assert len(str(info.value)) < 200  # a long value is shown cut


@pytest.mark.parametrize("value, expected", [("1", True), (" yes ", True), ("OFF", False), (0, False), (1.0, True)])
def test_flags_keep_their_ascii_spellings(value, expected):
    assert options.flag(value, options.REQUEST_SUPPORT_KEY) is expected
