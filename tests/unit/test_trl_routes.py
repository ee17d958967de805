"""The TRL routes patch's knob (no trl needed): ``REPLAY_PLUGIN_TRL_ROUTER_AGREEMENT``."""

from __future__ import annotations

import pytest

from replay_plugin.core.errors import NotReplayable
from replay_plugin.trl import routes
from replay_plugin.trl.patches import PATCHES, ROUTER_AGREEMENT_ENV


def test_router_agreement_knob_defaults_on_and_reads_0_and_1():
    assert routes.router_agreement_on({}) is True
    assert routes.router_agreement_on({ROUTER_AGREEMENT_ENV: ""}) is True
    assert routes.router_agreement_on({ROUTER_AGREEMENT_ENV: " 1 "}) is True
    assert routes.router_agreement_on({ROUTER_AGREEMENT_ENV: "0"}) is False
    assert PATCHES["trl.routes"].knobs[0].env == ROUTER_AGREEMENT_ENV


@pytest.mark.parametrize("value", ["no", "off", "2", "true"])
def test_router_agreement_knob_refuses_other_values_by_name(value):
    with pytest.raises(NotReplayable) as err:
        routes.router_agreement_on({ROUTER_AGREEMENT_ENV: value})
    assert ROUTER_AGREEMENT_ENV in str(err.value) and repr(value) in str(err.value)
