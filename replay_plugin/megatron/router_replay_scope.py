"""Patch ``megatron.router_replay_scope``: scope RouterReplay state to one pipeline schedule.

The upstream gap (megatron-core 0.16.0 - 0.19.2, ``transformer/moe/router_replay.py``):
``RouterReplay`` keeps process-global state. ``set_target_indices`` sets the forward target
*and appends it to* ``replay_backward_list``; ``REPLAY_BACKWARD`` drains that list with
``pop(0)`` during activation recompute. Nothing in Megatron clears it, so a forward-only
schedule (logprob or reference pass) leaves its entries behind and the next training step's
recompute replays the stale routes of the logprob pass, or fails with a split-size error when
token counts differ. Reproduced on CPU with 0.16.1 and 0.19.2 (tests/integration/megatron).

A second leak: the schedules never enter ``no_grad`` for ``forward_only=True``, so a
forward-only pass run with grad enabled adds its tokens to every router's expert-bias counts
(``local_tokens_per_expert``, also the global-aux-loss and quantile accumulators of newer
releases); ``finalize_model_grads`` resets them only after a training step, so the logprob
pass's tokens pollute the next expert-bias update.

The wrapper, around each of the three ``forward_backward_*`` functions (every binding
``get_forward_backward_func`` returns resolves them from the module at call time):

* before the schedule, drops backward-FIFO entries that were not installed since the previous
  schedule ended (entries installed by the caller for this schedule, through
  ``set_target_indices`` / ``set_replay_data``, are kept: callers may set replay data before
  the schedule starts);
* in ``finally`` (also on exceptions): clears every instance's target and FIFO and the global
  replay action (recorded indices are kept for callers that read them after the schedule);
* with ``forward_only=True``: restores every router's token-count accumulators of the model(s)
  being run to the values they had before the schedule.

Nested schedule calls are scoped by the outermost one only.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable

from ..registry import Patcher

_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
_SET_TARGET = "megatron.core.transformer.moe.router_replay:RouterReplay.set_target_indices"

#: Router buffers a forward pass with grad enabled accumulates into (absent ones are skipped):
#: expert-bias counts (0.16+), global aux-loss counts and step counter, quantile-balancing
#: accumulators (0.19).
COUNT_BUFFERS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps", "qb_beta_accum", "qb_beta_count")


class _State(threading.local):
    depth = 0


_state = _State()
# RouterReplay instance -> ids of FIFO entries installed since the previous schedule ended.
_installed: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()
_routers_of: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def _observe_set_target(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    fifo = getattr(instance, "replay_backward_list", None)
    if fifo:
        _installed.setdefault(instance, set()).add(id(fifo[-1]))
    return result


def _instances() -> list:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return list(RouterReplay.global_router_replay_instances)


def drop_stale_entries() -> int:
    """Remove FIFO entries not installed since the previous schedule; returns how many."""
    dropped = 0
    for inst in _instances():
        fifo = inst.replay_backward_list
        if not fifo:
            continue
        keep = _installed.get(inst, set())
        fresh = [t for t in fifo if id(t) in keep]
        dropped += len(fifo) - len(fresh)
        if len(fresh) != len(fifo):
            inst.replay_backward_list = fresh
    _installed.clear()
    return dropped


def clear_replay_state() -> None:
    """Targets, FIFOs and actions of every instance; recorded indices stay."""
    for inst in _instances():
        inst.target_topk_idx = None
        inst.replay_backward_list = []
        inst.router_replay_action = None
    _installed.clear()


def _model_chunks(model: Any) -> Iterable[Any]:
    if isinstance(model, (list, tuple)):
        return model
    return [model] if model is not None else []


def _count_buffers(model: Any) -> list:
    """(router, buffer name) pairs of the routers inside ``model`` (cached per model chunk)."""
    pairs: list = []
    for chunk in _model_chunks(model):
        try:
            cached = _routers_of.get(chunk)
        except TypeError:  # not weak-referenceable
            cached = None
        if cached is None:
            cached = []
            modules = chunk.modules() if hasattr(chunk, "modules") else []
            for module in modules:
                for name in COUNT_BUFFERS:
                    if getattr(module, name, None) is not None and hasattr(module, "router_replay"):
                        cached.append((weakref.ref(module), name))
            try:
                _routers_of[chunk] = cached
            except TypeError:
                pass
        pairs.extend(cached)
    return pairs


def _snapshot_counts(model: Any) -> list:
    snap = []
    for ref, name in _count_buffers(model):
        module = ref()
        if module is None:
            continue
        value = getattr(module, name, None)
        if value is not None:
            snap.append((module, name, value.detach().clone()))
    return snap


def _restore_counts(snapshot: list) -> None:
    import torch

    with torch.no_grad():
        for module, name, saved in snapshot:
            current = getattr(module, name, None)
            if current is not None and current.shape == saved.shape:
                current.copy_(saved)


def _scope(wrapped, instance, args, kwargs):
    if _state.depth:
        return wrapped(*args, **kwargs)
    forward_only = bool(kwargs.get("forward_only", False))
    snapshot = _snapshot_counts(kwargs.get("model")) if forward_only else None
    drop_stale_entries()
    _state.depth += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _state.depth -= 1
        clear_replay_state()
        if snapshot:
            _restore_counts(snapshot)


def install(patcher: Patcher) -> None:
    for name in SCHEDULE_FUNCTIONS:
        patcher.wrap(f"{_SCHEDULES}:{name}", _scope)
    patcher.wrap(_SET_TARGET, _observe_set_target)
    patcher.on_revert(_installed.clear)
