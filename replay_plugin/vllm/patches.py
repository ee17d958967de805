"""Patch pack for vLLM (entry point ``replay_plugin.patches: vllm``): one row per patch.
``vllm.sample_support`` keeps its request admission and its capture in two helper modules and arms
on ``vllm.engine.arg_utils`` (imported before any engine configuration is created, also by
``vllm serve``); the served patches share ``served_stream``; refusals share ``refusal``. The two
``*_disagg`` rows are ``vllm.served_endpoints`` and ``vllm.generate_fields`` on vLLM 0.24's module
paths.

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
    "vllm.monolithic_routes": Patch("replay_plugin.vllm.monolithic_routes"),
    "vllm.openai_fields": Patch("replay_plugin.vllm.openai_fields"),
    "vllm.served_endpoints": Patch("replay_plugin.vllm.served_endpoints"),
    "vllm.generate_fields": Patch("replay_plugin.vllm.generate_fields"),
    # vLLM 0.24 serves /inference/v1/generate from vllm.entrypoints.serve.disagg.serving (0.25 moved
    # it to scale_out.token_in_token_out): the same wrappers over 0.24's targets (the matrix holds
    # one target list per patch; request_guard.LINES treats each pair as one patch)
    "vllm.served_endpoints_disagg": Patch("replay_plugin.vllm.served_endpoints"),
    "vllm.generate_fields_disagg": Patch("replay_plugin.vllm.generate_fields"),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
