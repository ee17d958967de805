"""Patch pack for megatron-core (entry point ``replay_plugin.patches: megatron``).

Only specs live here; each patch's code (its upstream bug, probe and wrapper) is in the module
named by ``install``, imported when ``megatron.core`` is imported. All patches trigger on
``megatron.core`` itself so that ``import megatron.core`` leaves them in place (its
``__init__`` already imports the schedules, the MoE router and RouterReplay).
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..registry import PatchSpec

_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_ROUTER = "megatron.core.transformer.moe.router"
_REPLAY = "megatron.core.transformer.moe.router_replay"
_HERE = "replay_plugin.megatron"


@hookimpl
def replay_plugin_patches() -> list[PatchSpec]:
    return [
        PatchSpec.from_matrix(
            "megatron.router_replay_scope",
            targets=(
                f"{_SCHEDULES}:forward_backward_no_pipelining",
                f"{_SCHEDULES}:forward_backward_pipelining_without_interleaving",
                f"{_SCHEDULES}:forward_backward_pipelining_with_interleaving",
                f"{_REPLAY}:RouterReplay.set_target_indices",
            ),
            install=f"{_HERE}.router_replay_scope:install",
            trigger="megatron.core",
        ),
        PatchSpec.from_matrix(
            "megatron.expert_bias_padding_mask",
            targets=(f"{_ROUTER}:TopKRouter._apply_expert_bias",),
            install=f"{_HERE}.expert_bias_padding_mask:install",
            probe=f"{_HERE}.expert_bias_padding_mask:probe",
            trigger="megatron.core",
        ),
        PatchSpec.from_matrix(
            "megatron.router_layer_number",
            targets=(f"{_ROUTER}:TopKRouter.set_layer_number",),
            install=f"{_HERE}.router_layer_number:install",
            probe=f"{_HERE}.router_layer_number:probe",
            trigger="megatron.core",
        ),
        PatchSpec.from_matrix(
            "megatron.replay_padding_fallback",
            targets=(f"{_REPLAY}:RouterReplay.get_replay_topk",),
            install=f"{_HERE}.replay_padding_fallback:install",
            trigger="megatron.core",
        ),
    ]
