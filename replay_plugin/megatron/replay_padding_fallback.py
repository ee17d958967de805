"""Patch ``megatron.replay_padding_fallback``: rows without a recorded route are routed by the
trainer's own router during replay.

The upstream gap (megatron-core 0.16.0 - 0.19.2, ``RouterReplay.get_replay_topk``): under
``REPLAY_FORWARD`` / ``REPLAY_BACKWARD`` every token takes the replayed indices; there is no
per-token way to say "no route was recorded here". Replay data therefore carries a dummy
route ``[0, 1, ..., K-1]`` in such rows (distinct experts keep the dropless dispatcher's
``tokens * topk`` invariant). That is harmless for alignment padding and for tokens no
loss-bearing target depends on, but wrong for a synthetic EOS appended after generation: its
source token was never routed by the engine (:class:`replay_plugin.core.trace.RoutedExpertTrace`
marks it True in the router padding mask), and a dummy route computes the EOS logprob from
experts nobody chose. The plugin's contract for ``router_padding_mask`` is that the trainer's
own router routes such a token, like an unreplayed trainer would.

No probe: upstream has no per-row replay at any version (the patch is a feature the replay
driver relies on; with it off, rows marked in the padding mask replay the dummy route).

The wrapper, around ``RouterReplay.get_replay_topk``: when the replay tensor about to be used
(``target_topk_idx`` for ``REPLAY_FORWARD``, the head of ``replay_backward_list`` for
``REPLAY_BACKWARD``) carries an own-rows mask (attached by :func:`mark_own_rows`, which the
replay driver calls), the original runs as usual (so the backward FIFO is consumed exactly as
upstream does), the router's default top-k is computed on the same scores, and rows marked
True take the router's own experts; probabilities are gathered from the scores at the final
indices, as upstream does for replayed rows (gate weights keep their gradient). Replay tensors
without the mark, and every other action, pass through untouched. No host sync: the merge is
one ``torch.where``.
"""

from __future__ import annotations

from typing import Any, Optional

from ..patcher import Patcher

#: Attribute on a replay index tensor ``[N, K]``: bool ``[N]``, True = the router's own top-k.
OWN_ROWS_ATTR = "_replay_plugin_own_rows"


def mark_own_rows(indices: Any, own_rows: Any) -> None:
    """Attach the own-rows mask ``[N]`` bool to the replay tensor ``indices`` ``[N, K]``."""
    setattr(indices, OWN_ROWS_ATTR, own_rows)


def own_rows_of(indices: Any) -> Optional[Any]:
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
