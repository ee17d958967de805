"""Patch pack for verl (entry point ``replay_plugin.patches: verl``): one row per patch; targets,
versions and the rest are in compat_matrix.yaml. Driven by verl's batch and config, nothing else
(README "verl"):

* ``verl.rollout_support_server`` on verl's vLLM server: with
  ``+actor_rollout_ref.rollout.custom.replay_sample_support=true`` the engine allows the rows' width
  and each opted-in request's support rows come back in ``TokenOutput.extra_fields``;
* ``verl.rollout_support_batch`` on the agent loop: training requests opt in, every turn's rows
  are kept and aligned with the response, and the sample carries ``rollout_sample_support``
  (V0 ``DataProto`` and V1 TransferQueue);
* ``verl.rollout_support_padding`` on the V1 trainer's padding template: the no-op samples verl pads
  a TransferQueue batch with get one row of ``-1``, not the first sample's rows;
* ``verl.rollout_refusals`` on the V1 trainer's ``ReplayBuffer``: a trajectory the plugin refused in
  the rollout (tagged on its prompt by the agent-loop half) stops the step with the plugin's error,
  where verl V1 would drop it and train on the rest of the batch;

* ``verl.fsdp_support_logprobs`` on the FSDP engine's ``prepare_model_outputs``: log-probs over
  the rollout's support when the batch carries ``rollout_sample_support``;
* ``verl.fsdp_routes`` on the FSDP engine's ``forward_backward_batch`` / ``forward_step``: R3
  with verl's ``router_replay.mode: R3`` and the batch's ``routed_experts``;
* ``verl.megatron_support_logprobs`` on the Megatron engine's ``forward_step`` and verl's Megatron
  forward function: log-probs over the rollout's support when the batch carries
  ``rollout_sample_support`` (R3 on Megatron stays verl's own ``RouterReplay``);
* ``verl.megatron_r3_layout`` on the Megatron engine's ``forward_backward_batch``: verl's own R3
  with the padded layout and several sequences per micro-batch is refused (it replays other
  tokens' routes);

* ``verl.engine_replay_guard`` on ``BaseEngine.infer_batch`` / ``train_batch``: a batch with rows
  is refused by an engine no applied patch makes score over them, and an FSDP engine configured
  for router replay while ``verl.fsdp_routes`` is not applied.

The Ulysses N-D partition patch verl needs for routes (``ulysses.nd_partition``) lives in the
FSDP pack. Loading this pack imports nothing but the plugin's machinery.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Patch

_ENGINE = "replay_plugin.verl.fsdp_engine"

PATCHES = {
    "verl.rollout_support_server": Patch("replay_plugin.verl.rollout_server"),
    "verl.rollout_support_batch": Patch("replay_plugin.verl.agent_loop"),
    "verl.rollout_support_padding": Patch("replay_plugin.verl.tq_padding"),
    "verl.rollout_refusals": Patch("replay_plugin.verl.rollout_refusals"),
    "verl.fsdp_support_logprobs": Patch(f"{_ENGINE}:install_support_logprobs"),
    "verl.fsdp_routes": Patch(f"{_ENGINE}:install_routes"),
    "verl.megatron_support_logprobs": Patch("replay_plugin.verl.megatron_engine"),
    "verl.megatron_r3_layout": Patch("replay_plugin.verl.megatron_r3_layout"),
    "verl.engine_replay_guard": Patch("replay_plugin.verl.engine_guard"),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
