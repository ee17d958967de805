import dataclasses

import pytest

from replay_plugin import settings


def test_toggle_name():
    from replay_plugin.spec import toggle_name

    assert toggle_name("megatron.router_replay_scope") == "REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE"
    assert toggle_name("ulysses.nd_partition") == "REPLAY_PLUGIN_ULYSSES_ND_PARTITION"


@pytest.mark.parametrize(
    "value,expected",
    [
        ("1", True),
        ("true", True),
        ("ON", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("", False),
    ],
)
def test_parse_bool(value, expected):
    assert settings.parse_bool("X", value) is expected


def test_parse_bool_rejects_garbage():
    with pytest.raises(settings.SettingError, match="REPLAY_PLUGIN_STRICT='maybe'"):
        settings.parse_bool("REPLAY_PLUGIN_STRICT", "maybe")


def test_load_and_toggle():
    cfg = settings.load(
        {
            "REPLAY_PLUGIN_STRICT": "1",
            "REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE": "0",
            "REPLAY_PLUGIN_STATUS_DIR": "/tmp/x",
        }
    )
    assert cfg.strict and not cfg.disable and not cfg.allow_unsupported
    assert cfg.status_dir == "/tmp/x"
    assert cfg.toggle("REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE") is False
    assert cfg.toggle("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT") is None


def test_bad_global_value_is_not_fatal_but_reported():
    env = {"REPLAY_PLUGIN_STRICT": "sure"}
    assert settings.load(env).strict is False
    assert any("REPLAY_PLUGIN_STRICT='sure'" in p for p in settings.problems([], env))


def test_disable_matches_pth_rule():
    for value in ("1", "true", "TRUE", "on", "yes", " 1 "):
        assert settings.disabled({"REPLAY_PLUGIN_DISABLE": value})
    for value in ("0", "", "no", "2"):
        assert not settings.disabled({"REPLAY_PLUGIN_DISABLE": value})


def test_unknown_names_reported_with_suggestion():
    known = {"REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE"}
    env = {"REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCPOE": "0", "REPLAY_PLUGIN_STRICT": "1", "OTHER": "x"}
    problems = settings.problems(known, env)
    assert problems == [
        "unknown variable REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCPOE; did you mean "
        "REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE?"
    ]


def test_pth_guard_is_generated_from_the_one_table():
    from replay_plugin import _pth

    assert repr(settings.TRUE) in _pth.GUARD
    for value in ("1", " On ", "YES", "0", "", "2", "off"):
        guard = eval(_pth.GUARD.split(" or ")[0], {"os": type("O", (), {"environ": {"REPLAY_PLUGIN_DISABLE": value}})})
        assert guard == settings.disabled({"REPLAY_PLUGIN_DISABLE": value}), value


@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_empty_toggle_is_unset(value):
    """``export REPLAY_PLUGIN_X=$UNSET`` gives an empty value: the patch keeps its default (issue 41:
    read as ``0`` it switched SkyRL's capture off, and SkyRL trained on its own rows)."""
    cfg = settings.load({"REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS": value})
    assert cfg.toggle("REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS") is None
    assert cfg.toggle("REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS") == cfg.toggle("REPLAY_PLUGIN_NEVER_SET")
    # the global switches read an empty value as they read an unset one (off)
    env = {"REPLAY_PLUGIN_STRICT": value, "REPLAY_PLUGIN_ALLOW_UNSUPPORTED": value, "REPLAY_PLUGIN_DISABLE": value}
    assert settings.load(env) == dataclasses.replace(settings.load({}), environ=env)
    assert settings.problems([], env) == []
