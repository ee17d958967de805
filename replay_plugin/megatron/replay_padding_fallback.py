"""Patch ``megatron.replay_padding_fallback``: rows without a recorded route are routed by the
trainer's own router during replay.

Gap (megatron-core 0.16.0 - 0.19.2, ``RouterReplay.get_replay_topk``): under replay every token
takes the replayed indices; there is no per-token "no route recorded here". Such rows carry the
dummy route ``[0..K-1]``, which is wrong for a synthetic EOS appended after generation (its
logprob would come from experts nobody chose). The wrapper gives rows marked by
:func:`mark_own_rows` (the replay driver marks the router padding mask) the router's own top-k,
with one ``torch.where`` and no host sync. No probe: no release has per-row replay. Remove when
``RouterReplay`` supports a per-token mask of rows to route normally.
"""

from __future__ import annotations

from typing import Any

from ..patcher import Patcher

#: Attribute on a replay index tensor ``[N, K]``: bool ``[N]``, True = the router's own top-k.
OWN_ROWS_ATTR = "_replay_plugin_own_rows"


def mark_own_rows(indices: Any, own_rows: Any) -> None:
    """Attach the own-rows mask ``[N]`` bool to the replay tensor ``indices`` ``[N, K]``."""
    setattr(indices, OWN_ROWS_ATTR, own_rows)


def own_rows_of(indices: Any) -> Any | None:
    return getattr(indices, OWN_ROWS_ATTR, None) if indices is not None else None


def _bind(args: tuple, kwargs: dict) -> tuple:
    names = ("scores", "topk", "num_groups", "group_topk", "default_compute_topk")
    values = dict(zip(names, args))
    values.update(kwargs)
    return tuple(values.get(n) for n in names)


def _get_replay_topk(wrapped, instance, args, kwargs):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    action = instance.router_replay_action
    if action == RouterReplayAction.REPLAY_FORWARD:
        pending = instance.target_topk_idx
    elif action == RouterReplayAction.REPLAY_BACKWARD:
        fifo = instance.replay_backward_list
        pending = fifo[0] if fifo else None
    else:
        return wrapped(*args, **kwargs)
    own = own_rows_of(pending)
    if own is None:
        return wrapped(*args, **kwargs)
    import torch

    _, replayed = wrapped(*args, **kwargs)
    scores, topk, num_groups, group_topk, default_compute_topk = _bind(args, kwargs)
    _, own_indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    own = own.to(scores.device)
    indices = torch.where(own.unsqueeze(-1), own_indices, replayed.to(own_indices.dtype))
    return scores.gather(1, indices), indices


def install(patcher: Patcher) -> None:
    patcher.wrap("RouterReplay.get_replay_topk", _get_replay_topk)
