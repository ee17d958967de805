"""verl: the plugin's replays inside stock verl jobs.

- verl's FSDP engine (``fsdp_engine``): log-probs renormalised over the rollout's sampler support
  when the batch carries ``rollout_sample_support``, and routed-expert replay (R3) of verl's
  ``routed_experts`` when the engine's ``router_replay.mode`` is ``R3``.
- verl's Megatron engine (``megatron_engine``): the same support renormalisation, in whatever
  layout verl's forward function lays the label out; R3 stays verl's own (``RouterReplay``).
- verl's rollout (``rollout_server``, ``agent_loop``, ``turns``, ``switch``): the switch, the
  rows from its vLLM server, and their way through the agent loop into the batch.
- ``engine_batch``: how verl's engines hand a micro-batch over, shared by both engine patches.

``patches.py`` is the pack (entry point ``replay_plugin.patches: verl``); targets, versions and
fingerprints are in compat_matrix.yaml. Importing this package imports nothing.
"""
