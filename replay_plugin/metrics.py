"""Train-inference mismatch metrics for every training step: the public name of
:mod:`replay_plugin.core.metrics` (framework-free torch; see its docstring for every key's
formula, shape and unit, and where they follow or leave verl's ``rollout_corr/*`` and
``training/rollout_probs_diff_*`` definitions).

    from replay_plugin.metrics import mismatch_metrics

    metrics = mismatch_metrics(trainer_logprobs, rollout_logprobs, response_mask.bool())
    logger.log({k: v.item() for k, v in metrics.items()})  # the only host synchronisation
"""

from __future__ import annotations

from replay_plugin.core.metrics import (
    DEFAULT_IS_THRESHOLD,
    LOGPROB_KEYS,
    ROUTE_KEY,
    ROUTE_LAYER_KEY,
    SAFETY_BOUND,
    mismatch_metrics,
)

__all__ = ["DEFAULT_IS_THRESHOLD", "LOGPROB_KEYS", "ROUTE_KEY", "ROUTE_LAYER_KEY", "SAFETY_BOUND", "mismatch_metrics"]
