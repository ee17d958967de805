"""Patch pack for vLLM (entry point ``replay_plugin.patches: vllm``). Specs only."""

from __future__ import annotations

from ..hooks import hookimpl
from ..registry import PatchSpec


@hookimpl
def replay_plugin_patches() -> list[PatchSpec]:
    return [
        PatchSpec.from_matrix(
            "vllm.sample_support",
            targets=(
                "vllm.v1.engine.input_processor:InputProcessor.process_inputs",
                "vllm.v1.engine.output_processor:RequestState._new_completion_output",
            ),
            install=None,
        ),
        PatchSpec.from_matrix(
            "vllm.routed_experts",
            targets=("vllm.v1.engine.output_processor:RequestState._new_completion_output",),
            install=None,
        ),
    ]
