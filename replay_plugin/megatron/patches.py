"""Patch pack for megatron-core (entry point ``replay_plugin.patches: megatron``): one row per
patch; targets, versions and the rest are in compat_matrix.yaml.

Every patch triggers on ``megatron.core`` itself: its ``__init__`` imports the schedules, the
MoE router and RouterReplay, so ``import megatron.core`` leaves them patched, and a patch with
targets in several modules never imports one of them half-initialised.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Patch

_CORE = "megatron.core"

PATCHES = {
    "megatron.router_replay_scope": Patch("replay_plugin.megatron.router_replay_scope", trigger=_CORE),
    "megatron.expert_bias_padding_mask": Patch("replay_plugin.megatron.expert_bias_padding_mask", trigger=_CORE),
    "megatron.router_layer_number": Patch("replay_plugin.megatron.router_layer_number", trigger=_CORE),
    "megatron.replay_padding_fallback": Patch("replay_plugin.megatron.replay_padding_fallback", trigger=_CORE),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
