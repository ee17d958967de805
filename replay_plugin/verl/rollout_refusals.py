"""Patch ``verl.rollout_refusals``: a trajectory the plugin refuses in verl's V1 rollout stops the step.

Gap (verl 0.9.1, ``trainer/ppo/v1/agent_loop_tq.py``, ``replay_buffer.py``): in V1
(``trainer.use_v1=true``, verl's default) ``AgentLoopWorkerTQ._run_prompt`` settles the sessions of a
prompt with ``asyncio.gather(..., return_exceptions=True)`` (``_settle_session_tasks``), logs each
error in the agent-loop worker's log and tags the prompt group ``failure`` in the TransferQueue. The
trainer's ``ReplayBuffer`` keeps a failed group sampleable (``sync_refill_failed_groups`` false, the
default): the step trains on the trajectories that survived, a partial group, with no error. With
every trajectory refused it raises its own ``RuntimeError`` ("no materializable trajectories"),
without the reason; with ``sync_refill_failed_groups`` or an async trainer it evicts and refills the
group, and a deterministic refusal fails again, round after round. The plugin's refusals (an inexact
row, rows for other tokens, a request the vLLM pack cannot replay, an answer without rows, an
alignment it cannot make) are raised exactly there, per trajectory, to keep such a trajectory out
of training; verl V1 turned each into a dropped trajectory: a selection bias.

Two halves, joined by the prompt's TransferQueue tag (verl merges tags key by key):

- agent-loop worker (``verl.rollout_support_batch``'s ``AgentLoopWorker._run_agent_loop``, in a V1
  worker only): a session that raises one of the plugin's errors (:func:`refusal`: its own type, or
  the cause of a Ray task error from the server) writes :data:`TAG` (type, field or setting, token,
  message, trajectory) into its prompt's tag before the session ends, so before ``_run_prompt``
  writes the group's terminal status; the error then goes on to verl as before;
- trainer (this patch, ``ReplayBuffer._sync_metadata_from_transfer_queue``, the snapshot every poll
  of ``sample``, ``wait_for_sampleable`` and ``get_sampleable_count`` starts with): a failed group
  whose tag carries a refusal raises it in the trainer, typed as in the rollout and naming the
  trajectory and the plugin, before verl selects, evicts or refills anything. Failed groups
  without the tag (verl's own failures) are verl's business, as before; each is looked up once.

Jobs without the plugin's refusals run verl's code unchanged (one extra ``kv_list`` per poll that
finds new failed groups). V0 needs nothing: its ``asyncio.gather`` propagates the first error.

With ``REPLAY_PLUGIN_VERL_ROLLOUT_REFUSALS=0`` (or wherever the patch would not apply, as
``registry.would_apply`` reads it in the worker's process) verl's own behaviour returns: the worker
writes no tag and the refused trajectory is dropped. That choice is made visible where it happens:
each such trajectory is logged by the worker at WARNING on the ``replay_plugin`` logger, naming the
trajectory (prompt uid, session, sample index), the plugin's reason, that it is dropped because
the patch is off, and how many this worker has dropped so far.

Remove when verl's V1 rollout lets a trajectory's error stop the step (or names a policy for it).
"""

from __future__ import annotations

import logging
from typing import Any

from ..patcher import Patcher

log = logging.getLogger("replay_plugin")

#: this patch's name (its toggle: ``REPLAY_PLUGIN_VERL_ROLLOUT_REFUSALS``)
PATCH = "verl.rollout_refusals"
#: the key of the prompt's TransferQueue tag that carries a refusal from the worker to the trainer
TAG = "replay_plugin_refusal"
#: a V1 worker's count of the refused trajectories it let verl drop (the patch off)
_DROPPED = "_replay_plugin_dropped_refusals"
#: the module of verl's V1 agent-loop worker (``AgentLoopWorkerTQ``, a Ray actor class)
WORKER_MODULE = "verl.trainer.ppo.v1.agent_loop_tq"
_SEEN = "_replay_plugin_failed_seen"


def refusal(error: BaseException) -> BaseException | None:
    """The plugin's own error in ``error``: itself, or the error a Ray actor raised (verl's vLLM
    server: ``RayTaskError.cause``); None for any other error."""
    from ..core.errors import NotReplayable, ReplayDataError, ReplayTypeError
    from ..vllm.refusal import SampleSupportRefused

    ours = (ReplayDataError, ReplayTypeError, NotReplayable, SampleSupportRefused)
    for candidate in (getattr(error, "cause", None), error):
        if isinstance(candidate, ours):
            return candidate
    return None


def _v1_worker(worker: Any) -> bool:
    return any(getattr(cls, "__module__", "") == WORKER_MODULE for cls in type(worker).__mro__)


def _record(error: BaseException, kwargs: dict, trajectory: Any) -> dict:
    from ..core.errors import NotReplayable, ReplayTypeError
    from ..vllm.refusal import SampleSupportRefused

    if isinstance(error, (NotReplayable, SampleSupportRefused)):
        kind, name, token = "setting", getattr(error, "setting", None) or "sampler", None
    else:
        kind = "type" if isinstance(error, ReplayTypeError) else "data"
        name, token = getattr(error, "field", "rollout_sample_support"), getattr(error, "token", None)
    sample = trajectory.get("sample_index", None) if hasattr(trajectory, "get") else None
    try:
        sample = int(sample) if sample is not None else None
    except (TypeError, ValueError):
        sample = None
    return {
        "kind": kind,
        "name": str(name),
        "token": token if isinstance(token, int) else None,
        "type": type(error).__name__,
        "message": str(error),
        "uid": str(kwargs.get("uid")),
        "session": kwargs.get("session_id"),
        "sample_index": sample,
    }


def _where(record: dict) -> str:
    where = f"prompt uid {record.get('uid')!r}, session {record.get('session')}"
    if record.get("sample_index") is not None:
        where += f", sample_index {record['sample_index']}"
    return where


def warn_dropped(worker: Any, record: dict, why: str) -> int:
    """Log (WARNING, ``replay_plugin``) that the refused trajectory ``record`` is dropped by verl
    because this patch is off (``why``: ``registry.would_apply``'s reason); returns the worker's
    count of such trajectories so far, which the message names."""
    from ..spec import toggle_name

    count = worker.__dict__.get(_DROPPED, 0) + 1
    worker.__dict__[_DROPPED] = count
    if why.startswith("disabled"):
        fix = f"unset {toggle_name(PATCH)} (or set it to 1)"
    else:
        fix = "run a verl the patch supports (`replay-plugin status`)"
    log.warning(
        "%s: replay-plugin refused a trajectory of verl's rollout (%s; %s): %s. verl's V1 agent loop drops it and "
        "trains on the group's other trajectories, because %s is off here (%s); refused trajectories dropped by "
        "this agent-loop worker so far: %d. To stop the step with the refusal instead, %s",
        PATCH,
        _where(record),
        record.get("type"),
        record.get("message"),
        PATCH,
        why,
        count,
        fix,
    )
    return count


async def tag_group(worker: Any, kwargs: dict, trajectory: Any, error: BaseException) -> None:
    """In a V1 agent-loop worker, put the plugin's ``error`` of one session into its prompt's
    TransferQueue tag (before verl writes the group's terminal status); with this patch off in the
    worker's process, no tag (verl drops the trajectory) and a warning (:func:`warn_dropped`).
    Anything else: nothing."""
    ours = refusal(error)
    if ours is None or "uid" not in kwargs or not _v1_worker(worker):
        return
    from ..registry import would_apply

    record = _record(ours, kwargs, trajectory)
    applies, why = would_apply(PATCH)
    if not applies:
        warn_dropped(worker, record, why)
        return
    import transfer_queue as tq

    validate = trajectory.get("validate", False) if hasattr(trajectory, "get") else False
    try:
        await tq.async_kv_put(key=kwargs["uid"], partition_id="val" if validate else "train", tag={TAG: record})
    except Exception:  # the refusal itself still reaches verl: say why the trainer cannot name it
        log.exception("replay_plugin: verl.rollout_refusals: could not tag prompt %s with its refusal", kwargs["uid"])


# --------------------------------------------------------------------------- trainer


def _error(refused: list[tuple[str, str, dict]]) -> Exception:
    from ..core.errors import NotReplayable, ReplayDataError, ReplayTypeError

    partition, uid, first = refused[0]
    where = _where({**first, "uid": uid})
    message = str(first.get("message", ""))
    if first.get("kind") != "setting" and message.startswith("field "):
        message = message.partition(": ")[2] or message  # the field and token are named again below
    more = ""
    if len(refused) > 1:
        uids = ", ".join(repr(u) for _, u, _ in refused[1:6])
        more = f" ({len(refused)} prompt groups refused; also {uids}{', ...' if len(refused) > 6 else ''})"
    text = (
        f"replay-plugin refused a trajectory of verl's rollout ({where}, partition {partition!r}; "
        f"{first.get('type')}): {message}. verl's V1 agent loop tags its group failed and would train on the "
        "group's other trajectories (or refill it, to fail again); the plugin stops the step instead: fix the "
        f"cause above{more}"
    )
    kind, name = first.get("kind"), str(first.get("name"))
    if kind == "setting":
        return NotReplayable(name, text)
    cls = ReplayTypeError if kind == "type" else ReplayDataError
    return cls(name, text, trajectory=first.get("sample_index"), token=first.get("token"))


def _sync_metadata(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    failed = {(partition, uid) for partition, uids in instance.failure_keys.items() for uid in uids}
    seen = instance.__dict__.setdefault(_SEEN, set())
    seen.intersection_update(failed)  # groups verl has cleared since
    new = failed - seen
    if not new:
        return result
    import transfer_queue as tq

    listing = tq.kv_list() or {}
    refused = []
    for partition, uid in sorted(new):
        tag = (listing.get(partition) or {}).get(uid) or {}
        if TAG in tag:
            refused.append((partition, uid, dict(tag[TAG])))
        else:
            seen.add((partition, uid))  # verl's own failure: its business; a refusal is tagged before it
    if refused:
        raise _error(refused)
    return result


def install(patcher: Patcher) -> None:
    patcher.wrap("ReplayBuffer._sync_metadata_from_transfer_queue", _sync_metadata)
