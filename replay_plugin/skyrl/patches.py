"""Patch pack for SkyRL (entry point ``replay_plugin.patches: skyrl``): one row per patch.
Switched on by SkyRL's own config keys, nothing else (docs/integrations/skyrl.md).

What each patch fixes, and how: its module's docstring (the row names it); targets, versions,
why, upstream fix and remove-when: compat_matrix.yaml, rendered into docs/reference/patches.md.
Loading this pack imports nothing but the plugin's machinery.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Knob, Patch

#: SkyRL's config keys that ask for a replay (read by the guards, the FSDP routes patch and the doctor)
SUPPORT_CONFIG_KEY = "generator.inference_engine.enable_return_sample_support_set"
ROUTES_CONFIG_KEY = "generator.inference_engine.enable_return_routed_experts"

ON_INEXACT_ENV = "REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS_ON_INEXACT"
ON_INEXACT_POLICIES = ("error", "repair")
ON_INEXACT_KNOB = Knob(
    ON_INEXACT_ENV,
    "error",
    "what `/skyrl/v1/generate` does with a support row that is not the sampler's exact support (more ties "
    "than the slack covers): `error` (HTTP 500 naming the token and the fix) or `repair` (trains on the "
    "row; a sampled id missing from it goes into its first padding slot, or overwrites the row's last "
    "member when the row is full; logged with counts); any other value refuses sample-support jobs and "
    "requests, naming the variable",
)

PATCHES = {
    "skyrl.sample_support_rows": Patch("replay_plugin.skyrl.generate_endpoint", knobs=(ON_INEXACT_KNOB,)),
    "skyrl.engine_support_width": Patch("replay_plugin.skyrl.engine_args"),
    "skyrl.generator_support_width": Patch("replay_plugin.skyrl.generator_rows"),
    "skyrl.fsdp_routes": Patch("replay_plugin.skyrl.fsdp_routes:install_model_wrapper"),
    "skyrl.fsdp_worker_routes": Patch("replay_plugin.skyrl.fsdp_routes:install_workers"),
    "skyrl.fsdp_routes_config": Patch("replay_plugin.skyrl.fsdp_routes:install_config"),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
