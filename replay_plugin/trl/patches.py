"""Patch pack for TRL (entry point ``replay_plugin.patches: trl``): one row per patch. Switched on
by TRL's own ``GRPOConfig.generation_kwargs["extra_args"]`` (``switch.py``), nothing else.

What each patch fixes, and how: its module's docstring (the row names it); targets, versions,
why, upstream fix and remove-when: compat_matrix.yaml, rendered into docs/reference/patches.md.
``trl.hf_warped_scores`` is a transformers patch (``GenerationMixin._get_logits_processor``) that
does nothing unless ``trl.hf_sampler_rows`` opened a recording around TRL's HF generate. Loading
this pack imports nothing but the plugin's machinery.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Knob, Patch

ROUTER_AGREEMENT_ENV = "REPLAY_PLUGIN_TRL_ROUTER_AGREEMENT"
ROUTER_AGREEMENT_KNOB = Knob(
    ROUTER_AGREEMENT_ENV,
    "1",
    "`1`: with routes asked, the first no-grad pass over each generation runs one more no-grad forward per "
    "chunk by the trainer's own routers and logs `replay/router_agreement` (the share of routed tokens whose "
    "own experts are the rollout's); `0` skips that forward and the metric (`replay/route_agreement` is "
    "logged either way); any other value refuses route replay, naming the variable",
)

PATCHES = {
    # trainer side, HF generate, guard
    "trl.rollout_batch": Patch("replay_plugin.trl.batch"),
    "trl.support_logprobs": Patch("replay_plugin.trl.logprobs"),
    "trl.routes": Patch("replay_plugin.trl.routes", knobs=(ROUTER_AGREEMENT_KNOB,)),
    "trl.hf_sampler_rows": Patch("replay_plugin.trl.hf_rows"),
    "trl.hf_warped_scores": Patch("replay_plugin.trl.hf_rows:install_recorder"),
    "trl.replay_guard": Patch("replay_plugin.trl.guard"),
    "trl.unwired_trainers": Patch("replay_plugin.trl.guard:install_unwired"),
    # vLLM colocate and server
    "trl.vllm_engine_args": Patch("replay_plugin.trl.vllm_engine"),
    "trl.vllm_rows": Patch("replay_plugin.trl.vllm_rows"),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
