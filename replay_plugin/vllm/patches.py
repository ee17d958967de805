"""Patch pack for vLLM (entry point ``replay_plugin.patches: vllm``): one row per patch;
targets, versions and the rest are in compat_matrix.yaml. ``vllm.sample_support`` keeps its
request admission and its capture in two helper modules.

* ``vllm.sample_support`` arms on ``vllm.engine.arg_utils`` (imported before any engine
  configuration is created, also by ``vllm serve``);
* ``vllm.routed_experts`` on the output processor of the API-server process;
* ``vllm.openai_fields`` on the OpenAI server's completion module, so that offline jobs never
  import the server.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Patch
from . import options

PATCHES = {
    "vllm.sample_support": Patch(
        "replay_plugin.vllm.sample_support", trigger="vllm.engine.arg_utils", knobs=options.SUPPORT_KNOBS
    ),
    "vllm.routed_experts": Patch("replay_plugin.vllm.routed_experts", knobs=options.ROUTES_KNOBS),
    "vllm.openai_fields": Patch("replay_plugin.vllm.openai_fields"),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
