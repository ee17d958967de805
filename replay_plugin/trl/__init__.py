"""TRL (``trl >=1.16,<1.17``, ``GRPOTrainer``): both replays in a stock TRL job, switched on by
TRL's own ``GRPOConfig.generation_kwargs`` (``switch.py``).

- ``switch.py``: what the job asked for (pure).
- ``rollout.py``: the rows and routes of one generation, from the generation backend (HF generate,
  vLLM colocate, vLLM server) to TRL's batch dict (pure but for numpy).

Importing this package imports neither trl nor torch.
"""
