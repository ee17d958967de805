"""Patch pack for vLLM (entry point ``replay_plugin.patches: vllm``): one row per patch;
targets, versions and the rest are in compat_matrix.yaml. ``vllm.sample_support`` keeps its
request admission and its capture in two helper modules; the served patches share
``served_stream``; refusals share ``refusal``.

* ``vllm.sample_support`` arms on ``vllm.engine.arg_utils`` (imported before any engine
  configuration is created, also by ``vllm serve``);
* ``vllm.request_guard`` on the input processor (front end; no upper version bound: it must
  stay when the capture patches are skipped);
* ``vllm.engine_admission`` on the engine core module (engine-core processes, headless ones too);
* ``vllm.batch_rows`` on the scheduler module (engine-core processes; its front-end half is
  part of ``vllm.sample_support``);
* ``vllm.sampler_rows`` and ``vllm.cpu_logprob_ranks`` on the V1 sampler (worker processes);
* ``vllm.routed_experts`` on the output processor of the API-server process;
* ``vllm.openai_fields``, ``vllm.served_endpoints`` and ``vllm.generate_fields`` on the server's
  modules, so that offline jobs never import the server.
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
