"""verl: the plugin's replays inside stock verl jobs.

- verl's FSDP engine (``fsdp_engine``): log-probs renormalised over the rollout's sampler support
  when the batch carries ``rollout_sample_support``, and routed-expert replay (R3) of verl's
  ``routed_experts`` when the engine's ``router_replay.mode`` is ``R3``. verl's Megatron engine
  keeps its own R3 (``RouterReplay``), with the plugin's Megatron patches.

``patches.py`` is the pack (entry point ``replay_plugin.patches: verl``); targets, versions and
fingerprints are in compat_matrix.yaml. Importing this package imports nothing.
"""
