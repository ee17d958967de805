"""SkyRL: the plugin's replays inside stock SkyRL jobs, switched on by SkyRL's own config keys.

- sampler-support replay: ``/skyrl/v1/generate`` returns the plugin's exact rows
  (``generate_endpoint``), the engine allows their width (``engine_args``) and SkyRL's agent loop
  takes it (``generator_rows``); SkyRL's batch, trainers and multi-turn accumulation do the rest.
  Where the capture is not in place, the width patches refuse the job (``capture_guard``).
- routed-expert replay on SkyRL's FSDP path (``fsdp_routes``); SkyRL's Megatron path keeps its own.

``patches.py`` is the pack (entry point ``replay_plugin.patches: skyrl``); targets, versions and
fingerprints are in compat_matrix.yaml. Importing this package imports nothing.
"""
