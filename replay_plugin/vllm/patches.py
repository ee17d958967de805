"""Patch pack for vLLM (entry point ``replay_plugin.patches: vllm``): one row per patch.
``vllm.sample_support`` keeps its request admission and its capture in two helper modules and arms
on ``vllm.engine.arg_utils`` (imported before any engine configuration is created, also by
``vllm serve``); the served patches share ``served_stream``; refusals share ``refusal``.

What each patch fixes, and how: its module's docstring (the row names it); targets, versions,
why, upstream fix and remove-when: compat_matrix.yaml, rendered into docs/reference/patches.md;
which process each patch changes: docs/integrations/vllm.md.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Patch
from . import options

PATCHES = {
    "vllm.sample_support": Patch(
        "replay_plugin.vllm.sample_support", trigger="vllm.engine.arg_utils", knobs=options.SUPPORT_KNOBS
    ),
    "vllm.request_guard": Patch("replay_plugin.vllm.request_guard"),
    "vllm.engine_admission": Patch("replay_plugin.vllm.engine_admission"),
    "vllm.batch_rows": Patch("replay_plugin.vllm.batch_rows"),
    "vllm.sampler_rows": Patch("replay_plugin.vllm.sampler_rows"),
    "vllm.cpu_logprob_ranks": Patch("replay_plugin.vllm.cpu_logprob_ranks"),
    "vllm.routed_experts": Patch("replay_plugin.vllm.routed_experts", knobs=options.ROUTES_KNOBS),
    "vllm.openai_fields": Patch("replay_plugin.vllm.openai_fields"),
    "vllm.served_endpoints": Patch("replay_plugin.vllm.served_endpoints"),
    "vllm.generate_fields": Patch("replay_plugin.vllm.generate_fields"),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
