"""Patch pack for verl (entry point ``replay_plugin.patches: verl``): one row per patch. Driven
by verl's batch and config, nothing else (docs/integrations/verl.md).

What each patch fixes, and how: its module's docstring (the row names it); targets, versions,
why, upstream fix and remove-when: compat_matrix.yaml, rendered into docs/reference/patches.md.
The Ulysses N-D partition patch verl needs for routes (``ulysses.nd_partition``) lives in the
FSDP pack. Loading this pack imports nothing but the plugin's machinery.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Patch

_ENGINE = "replay_plugin.verl.fsdp_engine"

PATCHES = {
    "verl.rollout_support_server": Patch("replay_plugin.verl.rollout_server"),
    "verl.rollout_support_batch": Patch("replay_plugin.verl.agent_loop"),
    "verl.rollout_support_padding": Patch("replay_plugin.verl.tq_padding"),
    "verl.rollout_refusals": Patch("replay_plugin.verl.rollout_refusals"),
    "verl.fsdp_support_logprobs": Patch(f"{_ENGINE}:install_support_logprobs"),
    "verl.fsdp_routes": Patch(f"{_ENGINE}:install_routes"),
    "verl.megatron_support_logprobs": Patch("replay_plugin.verl.megatron_engine"),
    "verl.megatron_r3_layout": Patch("replay_plugin.verl.megatron_r3_layout"),
    "verl.engine_replay_guard": Patch("replay_plugin.verl.engine_guard"),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
