"""TRL (``trl >=1.16,<1.17``, ``GRPOTrainer``): both replays in a stock TRL job, switched on by
TRL's own ``GRPOConfig.generation_kwargs`` (``switch.py``).

- ``switch.py``: what the job asked for (pure).
- ``rollout.py``: the rows and routes of one generation, from the generation backend (HF generate,
  vLLM colocate, vLLM server) to TRL's batch dict (pure but for numpy).
- ``patches.py``: the pack table; one module per patch: ``batch.py`` (``trl.rollout_batch``),
  ``logprobs.py`` (``trl.support_logprobs``), ``routes.py`` (``trl.routes``), ``hf_rows.py``
  (``trl.hf_sampler_rows`` and the transformers-side ``trl.hf_warped_scores``), ``guard.py``
  (``trl.replay_guard``).

Importing this package imports neither trl nor torch.
"""
