"""Patch pack for megatron-core (entry point ``replay_plugin.patches: megatron``).

Only specs live here; the wrapper code is imported when ``megatron.core`` is imported.
All three patches trigger on ``megatron.core`` itself so that ``import megatron.core`` leaves
them in place (its ``__init__`` already imports the schedules and the MoE router).
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..registry import PatchSpec

_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_ROUTER = "megatron.core.transformer.moe.router"


@hookimpl
def replay_plugin_patches() -> list[PatchSpec]:
    return [
        PatchSpec.from_matrix(
            "megatron.router_replay_scope",
            targets=(
                f"{_SCHEDULES}:forward_backward_no_pipelining",
                f"{_SCHEDULES}:forward_backward_pipelining_without_interleaving",
                f"{_SCHEDULES}:forward_backward_pipelining_with_interleaving",
                "megatron.core.transformer.moe.router_replay:RouterReplay.set_target_indices",
            ),
            install="replay_plugin.megatron.router_replay_scope:install",
            trigger="megatron.core",
        ),
        PatchSpec.from_matrix(
            "megatron.expert_bias_padding_mask",
            targets=(f"{_ROUTER}:TopKRouter._apply_expert_bias",),
            install=None,
            trigger="megatron.core",
        ),
        PatchSpec.from_matrix(
            "megatron.router_layer_number",
            targets=(f"{_ROUTER}:TopKRouter.set_layer_number",),
            install=None,
            trigger="megatron.core",
        ),
    ]
