"""Patch pack for vLLM (entry point ``replay_plugin.patches: vllm``). Specs only: the patch code
(one module per patch, each documenting the upstream gap) is imported when its trigger is.

* ``vllm.sample_support`` arms on ``vllm.engine.arg_utils`` (imported before any engine
  configuration is created, also by ``vllm serve``);
* ``vllm.routed_experts`` on the output processor of the API-server process;
* ``vllm.openai_fields`` on the OpenAI server's completion module, so that offline jobs never
  import the server.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..registry import PatchSpec
from . import options

_SAMPLE_SUPPORT = (
    "vllm.engine.arg_utils:EngineArgs.create_engine_config",
    "vllm.v1.engine.input_processor:InputProcessor.process_inputs",
    "vllm.v1.engine.logprobs:LogprobsProcessor.from_new_request",
    "vllm.v1.engine.logprobs:LogprobsProcessor._update_sample_logprobs",
    "vllm.v1.engine.output_processor:RequestState._new_completion_output",
    "vllm.outputs:RequestOutput.add",
)
_ROUTED_EXPERTS = (
    "vllm.v1.engine.output_processor:RequestState.from_new_request",
    "vllm.v1.engine.output_processor:RequestState.make_request_output",
    "vllm.v1.engine.output_processor:RequestOutputCollector.put",
)
_OPENAI_FIELDS = (
    "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.request_output_to_completion_response",
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_full_generator",
)


@hookimpl
def replay_plugin_patches() -> list[PatchSpec]:
    return [
        PatchSpec.from_matrix(
            "vllm.sample_support",
            targets=_SAMPLE_SUPPORT,
            install="replay_plugin.vllm.sample_support:install",
            trigger="vllm.engine.arg_utils",
            knobs=options.SUPPORT_KNOBS,
        ),
        PatchSpec.from_matrix(
            "vllm.routed_experts",
            targets=_ROUTED_EXPERTS,
            install="replay_plugin.vllm.routed_experts:install",
            knobs=options.ROUTES_KNOBS,
        ),
        PatchSpec.from_matrix(
            "vllm.openai_fields",
            targets=_OPENAI_FIELDS,
            install="replay_plugin.vllm.openai_fields:install",
        ),
    ]
