"""Train-inference mismatch metrics for every training step: the public name of
:mod:`replay_plugin.core.metrics` (framework-free torch; see its docstring for every key's
formula, shape and unit, and where they follow or leave verl's ``rollout_corr/*`` and
``training/rollout_probs_diff_*`` definitions).

    from replay_plugin.metrics import mismatch_metrics

    # Megatron: replay_response_logprobs(...) is [B, S - 1]; position s scores token s + 1
    metrics = mismatch_metrics(logprobs, rollout_logprobs[:, 1:], response_mask[:, 1:].bool())
    values = torch.stack(list(metrics.values())).tolist()  # the one copy to the host
    logger.log(dict(zip(metrics, values)))
"""

from __future__ import annotations

from replay_plugin.core.metrics import (
    DEFAULT_IS_THRESHOLD,
    LOGPROB_KEYS,
    ROUTE_KEY,
    ROUTE_LAYER_KEY,
    SAFETY_BOUND,
    LogprobsWithMetrics,
    mismatch_metrics,
)

__all__ = [
    "DEFAULT_IS_THRESHOLD",
    "LOGPROB_KEYS",
    "LogprobsWithMetrics",
    "ROUTE_KEY",
    "ROUTE_LAYER_KEY",
    "SAFETY_BOUND",
    "mismatch_metrics",
]
