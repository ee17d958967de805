"""Patch ``megatron.router_replay_scope``: what a pipeline schedule installs on RouterReplay ends
with the schedule.

Gap (megatron-core 0.16.0 - 0.19.2; no upstream issue, every RL framework clears it itself):
``RouterReplay`` keeps process-global state that nothing in Megatron clears, so a forward-only
schedule (logprob pass) that installs routes per microbatch leaves backward-FIFO entries that the
next training step's recompute replays (or fails on), and a forward-only pass with grad enabled
adds its tokens to the routers' expert-bias counts.

The wrapper, around each top-level ``forward_backward_*`` schedule, undoes only the schedule's
own installs: FIFO entries appended during the schedule (``set_target_indices``) and left
unconsumed are removed, so is a target it installed, and after a forward-only schedule the
expert-bias counts are restored. Actions: on a router the schedule installed routes on, a replay
action (``REPLAY_FORWARD`` / ``REPLAY_BACKWARD``) left at the end would replay routes that were
just dropped, so the router gets back the action it had when the schedule started (none for a
router built during it): a ``REPLAY_FORWARD`` the caller set once before two schedules whose
``forward_step`` installs routes stays set for the second. Every other action change is left as
stock Megatron leaves it (``RECORD`` set inside ``forward_step`` keeps recording afterwards; an
action set on a router the schedule installed nothing on is the caller's). State that existed
before the schedule is left as stock Megatron leaves it too: routes installed once and replayed by
two schedules, ``RECORD`` set once for several schedules, a second model's routes installed before
this schedule runs. One exception: FIFO entries installed before the schedule on a router the
schedule installs on again would be popped by this schedule's recompute in place of its own
routes; they are dropped with a :class:`StaleRoutesWarning` (an error under ``-W error``).
Remove when Megatron scopes that state to a schedule and skips counting in forward-only schedules.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
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


class StaleRoutesWarning(UserWarning):
    """Backward-replay entries installed before a schedule were dropped because the schedule
    installed routes on the same router (they would have been replayed in place of its own)."""


class Schedule:
    """One top-level schedule running in this thread (see :func:`current_schedule`).

    Attributes:
        forward_only: the schedule's ``forward_only`` argument (no backward pass, so no
            recompute pops a FIFO entry).
    """

    __slots__ = ("forward_only", "instances", "actions", "installed", "stale")

    def __init__(self, forward_only: bool, instances: list) -> None:
        self.forward_only = forward_only
        # every RouterReplay (held, so that ids stay unique) and, by id, its action when the
        # schedule started
        self.instances = list(instances)
        self.actions = {id(inst): inst.router_replay_action for inst in instances}
        # instance -> ids of the FIFO entries set_target_indices appended during the schedule
        self.installed: dict[Any, set[int]] = {}
        self.stale = 0


class _State(threading.local):
    schedule: Schedule | None = None


_state = _State()


def current_schedule() -> Schedule | None:
    """The top-level schedule this thread is running, or None (outside schedules, or the patch is
    not applied)."""
    return _state.schedule


_registry: list = []  # RouterReplay (for global_router_replay_instances) and RouterReplayAction, looked up once


def _classes() -> tuple[Any, Any]:
    if not _registry:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        _registry.extend((RouterReplay, RouterReplayAction))
    return _registry[0], _registry[1]


def _observe_set_target(wrapped, instance, args, kwargs):
    schedule = _state.schedule
    if schedule is None:
        return wrapped(*args, **kwargs)
    own = schedule.installed.get(instance)
    if own is None:
        own = schedule.installed[instance] = set()
        fifo = instance.replay_backward_list
        if fifo:
            _drop_stale(schedule, instance, fifo)
    result = wrapped(*args, **kwargs)
    fifo = instance.replay_backward_list
    if fifo:
        own.add(id(fifo[-1]))
    return result


def _drop_stale(schedule: Schedule, instance: Any, fifo: list) -> None:
    """The schedule installs on ``instance`` while its FIFO still holds entries from before the
    schedule: stock Megatron would pop those first in this schedule's recompute."""
    count = len(fifo)
    del fifo[:]
    schedule.stale += count
    if schedule.stale == count:  # the first router of this schedule: one warning per schedule
        layer = getattr(instance, "layer_number", None)
        where = f"router layer {layer}" if layer is not None else "a router"
        warnings.warn(
            f"replay_plugin: {where} held {count} backward-replay entr{'y' if count == 1 else 'ies'} installed before "
            "this schedule and never consumed; dropped (with those of any other router this schedule installs on), "
            "since its recompute would have replayed them in place of the routes installed now. Clear routes "
            "replayed outside a schedule (replay_plugin.megatron.clear_routes(model) or "
            "RouterReplay.clear_global_indices()).",
            StaleRoutesWarning,
            stacklevel=3,
        )


def _end(schedule: Schedule) -> None:
    """Undo what ``schedule`` installed and left unconsumed; leave older state alone."""
    installed = schedule.installed
    if not installed:  # the common case of a schedule that replays nothing
        return
    _, action_enum = _classes()
    replay_actions = (action_enum.REPLAY_FORWARD, action_enum.REPLAY_BACKWARD)
    for inst, own in installed.items():
        _drop_own(inst, own)
        # A replay action left on a router whose own routes were just dropped would replay
        # nothing (REPLAY_FORWARD gathers at a None target) or another schedule's FIFO entries:
        # the router gets back the action it had when the schedule started (routers built during
        # the schedule had none). Not RECORD, nor routers the schedule installed nothing on:
        # those stay as stock Megatron leaves them.
        if inst.router_replay_action in replay_actions:
            inst.router_replay_action = schedule.actions.get(id(inst))


def _drop_own(inst: Any, own: set[int]) -> None:
    fifo = inst.replay_backward_list
    if fifo:
        kept = [t for t in fifo if id(t) not in own]
        if len(kept) != len(fifo):
            fifo[:] = kept
    target = inst.target_topk_idx
    if target is not None and id(target) in own:
        inst.target_topk_idx = None


def release_entry(instance: Any, entry: Any) -> bool:
    """Remove ``entry`` (by identity) from ``instance``'s backward FIFO; True if it was there.

    For drivers that know an entry can no longer be consumed (its forward will not be
    recomputed), so that it does not hold memory until the schedule ends.
    """
    fifo = instance.replay_backward_list
    for i, t in enumerate(fifo):
        if t is entry:
            del fifo[i]
            return True
    return False


# ---------------------------------------------------------------------------------------
# expert-bias counts of forward-only schedules


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


# ---------------------------------------------------------------------------------------
# the wrapper


#: Callables ``check(model, forward_only)`` run before each top-level schedule; they raise to
#: refuse it (the replay driver refuses combined 1F1B for models it replays on).
_schedule_checks: list[Callable[[Any, bool], None]] = []


def add_schedule_check(check: Callable[[Any, bool], None]) -> None:
    if check not in _schedule_checks:
        _schedule_checks.append(check)


def _scope(wrapped, instance, args, kwargs):
    if _state.schedule is not None:  # a schedule inside a schedule: the outer one scopes
        return wrapped(*args, **kwargs)
    forward_only = bool(kwargs.get("forward_only", False))
    for check in _schedule_checks:
        check(kwargs.get("model"), forward_only)
    snapshot = _CountSnapshot(kwargs.get("model")) if forward_only else None
    replay_cls, _ = _classes()
    schedule = Schedule(forward_only, replay_cls.global_router_replay_instances)
    _state.schedule = schedule
    try:
        return wrapped(*args, **kwargs)
    finally:
        _state.schedule = None
        _end(schedule)
        if snapshot is not None:
            snapshot.restore()


def _reset() -> None:
    _state.schedule = None


def install(patcher: Patcher) -> None:
    for name in SCHEDULE_FUNCTIONS:
        patcher.wrap(name, _scope)
    patcher.wrap("RouterReplay.set_target_indices", _observe_set_target)
    patcher.on_revert(_reset)
