"""Patch ``megatron.router_replay_scope``: scope RouterReplay state to one pipeline schedule.

Gap (megatron-core 0.16.0 - 0.19.2; no upstream issue, every RL framework clears it itself):
``RouterReplay`` keeps process-global state that nothing in Megatron clears, so a forward-only
schedule (logprob pass) leaves backward-FIFO entries that the next training step's recompute
replays (or fails on), and a forward-only pass with grad enabled adds its tokens to the routers'
expert-bias counts. The wrapper, around each ``forward_backward_*`` schedule, drops stale FIFO
entries before the schedule (keeping what the caller installed for it), clears targets, FIFOs
and actions afterwards, and restores the token counts after a forward-only schedule. Remove when
Megatron scopes that state to a schedule and skips counting in forward-only schedules.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

from ..patcher import Patcher

SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)

#: Router buffers a forward pass with grad enabled accumulates into (absent ones are skipped):
#: expert-bias counts (0.16+), global aux-loss counts and step counter, quantile-balancing
#: accumulators (0.19).
COUNT_BUFFERS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps", "qb_beta_accum", "qb_beta_count")


class _State(threading.local):
    depth = 0


_state = _State()
# RouterReplay instance -> FIFO entries appended since the previous schedule ended.
_appended: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _observe_set_target(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    _appended[instance] = _appended.get(instance, 0) + 1
    return result


_registry: list = []  # RouterReplay.global_router_replay_instances, looked up once


def _instances() -> list:
    if not _registry:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        _registry.append(RouterReplay)
    return _registry[0].global_router_replay_instances


# Both loops below run twice per schedule over every RouterReplay in the process (48+ for a
# large model): they read before they write and touch the weak dictionary only for instances
# holding data, which keeps a schedule's overhead to a few microseconds.


def drop_stale_entries() -> int:
    """Remove FIFO entries (and targets) not installed since the previous schedule ended;
    returns how many FIFO entries were dropped."""
    dropped = 0
    appended = _appended
    for inst in _instances():
        fifo = inst.replay_backward_list
        if not fifo and inst.target_topk_idx is None:
            continue
        fresh = appended.get(inst, 0) if appended else 0
        if not fresh:
            inst.target_topk_idx = None
        stale = len(fifo) - min(fresh, len(fifo))
        if stale:
            del fifo[:stale]
            dropped += stale
    if appended:
        appended.clear()
    return dropped


def clear_replay_state() -> None:
    """Targets, FIFOs and actions of every instance; recorded indices stay."""
    for inst in _instances():
        if inst.target_topk_idx is not None:
            inst.target_topk_idx = None
        if inst.replay_backward_list:
            inst.replay_backward_list = []
        if inst.router_replay_action is not None:
            inst.router_replay_action = None
    if _appended:
        _appended.clear()


class _CountPlan:
    """The count buffers of one model chunk's routers, and a staging buffer to save them.

    Built once per chunk and rebuilt when upstream reassigns a buffer. The 1-D buffers of the
    first buffer's dtype and device (the per-expert counts) are saved with one
    ``torch.cat(..., out=staging)`` and restored from precomputed views of ``staging``; any
    other buffer (0-d step counters, other dtypes) is cloned. Per-tensor Python work is what
    costs here (~0.5 us per tensor attribute access on the CPU), so it is done once.
    """

    __slots__ = ("holders", "names", "tensors", "flat", "flat_tensors", "views", "staging", "other")

    def __init__(self, chunk: Any) -> None:
        import torch

        # The dict each buffer lives in (``module._buffers``; ``Module.__getattr__`` costs ~1 us
        # per lookup, a dict lookup ~0.05 us), to see cheaply whether upstream reassigned it.
        self.holders, self.names, self.tensors = [], [], []
        for module in chunk.modules() if hasattr(chunk, "modules") else ():
            if not hasattr(module, "router_replay"):  # TopKRouter and subclasses
                continue
            buffers = getattr(module, "_buffers", {})
            for name in COUNT_BUFFERS:
                t = getattr(module, name, None)
                if t is not None:
                    self.holders.append(buffers if buffers.get(name) is t else module.__dict__)
                    self.names.append(name)
                    self.tensors.append(t)
        dtype, device = (self.tensors[0].dtype, self.tensors[0].device) if self.tensors else (None, None)
        self.flat = [i for i, t in enumerate(self.tensors) if t.dim() == 1 and t.dtype == dtype and t.device == device]
        self.flat_tensors = [self.tensors[i] for i in self.flat]
        self.other = [i for i in range(len(self.tensors)) if i not in set(self.flat)]
        self.staging: Any = None
        self.views: Any = None
        if self.flat:
            self.staging = torch.empty(sum(self.tensors[i].numel() for i in self.flat), dtype=dtype, device=device)
            self.views = list(self.staging.split([self.tensors[i].numel() for i in self.flat]))

    def current(self) -> bool:
        return all(h.get(n) is t for h, n, t in zip(self.holders, self.names, self.tensors))


_plans: weakref.WeakKeyDictionary[Any, _CountPlan] = weakref.WeakKeyDictionary()


def _model_chunks(model: Any) -> Iterable[Any]:
    if isinstance(model, (list, tuple)):
        return model
    return [model] if model is not None else []


def _plan_of(chunk: Any) -> _CountPlan:
    try:
        plan = _plans.get(chunk)
    except TypeError:  # not weak-referenceable: no caching
        return _CountPlan(chunk)
    if plan is None or not plan.current():
        plan = _plans[chunk] = _CountPlan(chunk)
    return plan


class _CountSnapshot:
    """Counts of a forward-only schedule's routers, restored only where written: a buffer
    whose autograd version counter did not move was not written (a pass under ``no_grad``
    writes none) and is not copied back."""

    __slots__ = ("saved",)

    def __init__(self, model: Any) -> None:
        import torch

        self.saved = []
        for chunk in _model_chunks(model):
            plan = _plan_of(chunk)
            if not plan.tensors:
                continue
            versions = [t._version for t in plan.tensors]
            if plan.flat:
                torch.cat(plan.flat_tensors, out=plan.staging)
            others = {i: plan.tensors[i].detach().clone() for i in plan.other}
            self.saved.append((plan, versions, others))

    def restore(self) -> None:
        import torch

        for plan, versions, others in self.saved:
            tensors = plan.tensors
            changed = [t._version != v for t, v in zip(tensors, versions)]
            if not any(changed):
                continue
            if all(changed) and not others:  # the common grad-enabled case: one call, no lists
                with torch.no_grad():
                    torch._foreach_copy_(plan.flat_tensors, plan.views)
                continue
            dst, src = [], []
            for j, i in enumerate(plan.flat):
                if changed[i]:
                    dst.append(tensors[i])
                    src.append(plan.views[j])
            for i, saved in others.items():
                if changed[i]:
                    dst.append(tensors[i])
                    src.append(saved)
            with torch.no_grad():
                torch._foreach_copy_(dst, src)


def _scope(wrapped, instance, args, kwargs):
    if _state.depth:
        return wrapped(*args, **kwargs)
    snapshot = _CountSnapshot(kwargs.get("model")) if kwargs.get("forward_only", False) else None
    drop_stale_entries()
    _state.depth += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _state.depth -= 1
        clear_replay_state()
        if snapshot is not None:
            snapshot.restore()


def install(patcher: Patcher) -> None:
    for name in SCHEDULE_FUNCTIONS:
        patcher.wrap(name, _scope)
    patcher.wrap("RouterReplay.set_target_indices", _observe_set_target)
    patcher.on_revert(_appended.clear)
