"""Patch ``verl.rollout_support_batch``: the rollout's support rows ride verl's batch.

Gap (verl 0.9.1, ``experimental/agent_loop/agent_loop.py``, ``workers/rollout/llm_server.py``):
nothing in verl asks the rollout server for sampler support, and a per-token field a server puts
into ``TokenOutput.extra_fields`` does not survive the agent loop: ``ToolAgentLoop`` keeps only
the first turn's ``extra_fields``, ``FullyAsyncLLMServerClient`` rebuilds the ``TokenOutput``
without them, and ``_postprocess`` turns ``extra_fields`` into per-sample objects, not a
response-aligned tensor.

With ``+actor_rollout_ref.rollout.custom.replay_sample_support=true`` (``switch``), for every
training trajectory (not validation):

- ``AgentLoopWorker._run_agent_loop`` opens a record of the trajectory's ``generate`` calls (a
  context variable: each trajectory is its own asyncio task);
- ``LLMServerClient.generate`` (every call: each turn, each resumed attempt of a partial rollout)
  opts the request into the plugin's capture (``extra_args.replay_sample_support``; greedy
  requests, ``temperature`` 0 or ``top_k`` 1, are not opted in: their tokens get padding rows,
  which the trainer refuses to score), takes the rows the server put into ``extra_fields``
  (``verl.rollout_support_server``) out of them, and appends the turn to the record; an opted-in
  request answered without rows is refused (the server side is not patched);
- the rows are aligned with the finished response token by token (``turns.align``: every mask-1
  token must be a turn's token, in order) and become the sample's ``rollout_sample_support``:
  V0 (``trainer.use_v1=false``): ``_postprocess`` adds ``batch["rollout_sample_support"]``, int32
  ``[B, response_length, W]``, right-padded like ``rollout_log_probs``; V1 (the TransferQueue):
  ``AgentLoopOutput.as_dict`` adds ``rollout_sample_support`` int32 ``[R, W]`` per sample (jagged in
  the batch, as ``rollout_log_probs``). Both forms are what ``verl.fsdp_support_logprobs`` reads,
  and the field is carried by verl through balancing, micro-batching and padding removal like
  ``rollout_log_probs``.

An agent loop that returns several outputs for one trajectory (V1 list outputs) is refused: the
record cannot tell which turns each output holds. Every request carries the job's slack, so that
every server builds rows of the width the record pads to. In a V1 worker, a trajectory that raises
one of the plugin's errors (here, in the server, or in the vLLM pack) tags its prompt in the
TransferQueue on its way out, so that the trainer stops the step with it (``rollout_refusals``:
verl V1 would drop the trajectory). Once per process, a warning when one training batch's rows
would be large (``switch.row_memory_warning``). Validation batches and jobs without the switch
run verl's code unchanged.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import numpy as np

from ..patcher import Patcher
from . import rollout_refusals, switch, turns
from .switch import BATCH_SUPPORT_KEY

log = logging.getLogger("replay_plugin")

#: the private key a V0 sample carries the support field (``BATCH_SUPPORT_KEY``) under from
#: ``_run_agent_loop`` to ``_postprocess`` (popped there before verl reads ``extra_fields``)
_STASH = "_replay_plugin_rollout_sample_support"
_ACTIVE = False
_MEMORY_CHECKED = False


class _Record:
    """The ``generate`` calls of one trajectory."""

    __slots__ = ("turns", "width", "outputs", "client")

    def __init__(self, width: int, client: Any = None) -> None:
        self.turns: list[turns.Turn] = []
        self.width = width
        self.outputs = 0
        #: the worker's own rollout client; other clients (a distillation teacher's, called in the
        #: same task by ``_compute_teacher_logprobs``) are not the trajectory's turns
        self.client = client


_TRAJECTORY: contextvars.ContextVar[_Record | None] = contextvars.ContextVar(
    "replay_plugin_verl_trajectory", default=None
)


def _greedy(sampling_params: Any) -> bool:
    temperature = sampling_params.get("temperature", 1.0)
    top_k = sampling_params.get("top_k", -1)
    # verl's greedy samples (validation, ``__do_sample__`` false) set temperature 0; vLLM's top_k 0 / -1
    # is no top-k (unbounded: opted in, and refused by the vLLM pack naming the setting)
    return (temperature is not None and float(temperature) <= 0.0) or (top_k is not None and int(top_k) == 1)


# --------------------------------------------------------------------------- LLMServerClient.generate


async def _client_generate(wrapped, instance, args, kwargs):
    record = _TRAJECTORY.get() if _ACTIVE else None
    if record is None or (record.client is not None and instance is not record.client):
        return await wrapped(*args, **kwargs)
    from ..core.errors import ReplayDataError
    from ..vllm import options

    params = dict(kwargs.get("sampling_params") or {})
    opt_in = not _greedy(params)
    if opt_in:
        extra = dict(params.get("extra_args") or {})
        extra[options.REQUEST_SUPPORT_KEY] = True
        # always the job's slack (its key, else this worker's REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK): a
        # server left to its own environment could build rows of another width W than the record's, and
        # verl's jagged V1 field cannot hold samples of different widths
        extra[options.SLACK_KEY] = switch.job_slack(getattr(instance.config.actor_rollout_ref, "rollout", {}))
        params["extra_args"] = extra
        kwargs = {**kwargs, "sampling_params": params}
    output = await wrapped(*args, **kwargs)
    rows = output.extra_fields.pop(BATCH_SUPPORT_KEY, None)
    if opt_in and rows is None and output.token_ids:
        raise ReplayDataError(
            BATCH_SUPPORT_KEY,
            f"the rollout server answered a request that asked for support rows without them "
            f"({len(output.token_ids)} tokens): the plugin's verl.rollout_support_server patch did not run in the "
            "server process (run `replay-plugin status --import verl.workers.rollout.vllm_rollout.vllm_async_server` "
            "in the rollout environment)",
            expected="rows from verl's vLLM server",
        )
    record.turns.append(turns.turn(output.token_ids, rows if opt_in else None))
    return output


# --------------------------------------------------------------------------- AgentLoopWorker


def _width(worker: Any) -> int:
    vocabulary = getattr(getattr(worker.model_config, "hf_config", None), "vocab_size", None)
    try:
        return switch.width(worker.rollout_config, vocabulary)
    except (TypeError, ValueError):
        return 1


async def _run_agent_loop(wrapped, instance, args, kwargs):
    if not _ACTIVE:
        return await wrapped(*args, **kwargs)
    trajectory = kwargs["trajectory"] if "trajectory" in kwargs else args[1] if len(args) > 1 else None
    try:
        return await _run_recorded(wrapped, instance, args, kwargs, trajectory)
    except Exception as exc:
        # verl V1 settles a prompt's sessions with return_exceptions=True and trains on the survivors:
        # a refusal of the plugin's is tagged on the prompt, for the trainer to raise it
        # (verl.rollout_refusals); elsewhere a no-op
        await rollout_refusals.tag_group(instance, kwargs, trajectory, exc)
        raise


async def _run_recorded(wrapped, instance, args, kwargs, trajectory):
    if not switch.requested(instance.rollout_config) or not hasattr(trajectory, "get") or trajectory.get("validate"):
        return await wrapped(*args, **kwargs)
    record = _Record(_width(instance), getattr(instance, "llm_client", None))
    _warn_row_memory(instance, record.width)
    token = _TRAJECTORY.set(record)
    try:
        result = await wrapped(*args, **kwargs)
    finally:
        _TRAJECTORY.reset(token)
    if result is not None and hasattr(result, "response_ids") and hasattr(result, "extra_fields"):  # V0
        ids = result.response_ids.reshape(-1).tolist()
        mask = result.response_mask.reshape(-1).tolist()
        result.extra_fields[_STASH] = turns.align(ids, mask, record.turns, record.width, trajectory=_index(trajectory))
    return result


def _warn_row_memory(worker: Any, width: int) -> None:
    """Once per process: the warning when one training batch's rows are large (``switch``)."""
    global _MEMORY_CHECKED
    if _MEMORY_CHECKED:
        return
    _MEMORY_CHECKED = True
    message = switch.row_memory_warning(getattr(worker, "config", None), width)
    if message:
        log.warning("replay_plugin: verl.rollout_support_batch: %s", message)


def _index(trajectory: Any) -> int | None:
    value: Any = trajectory.get("sample_index", None) if hasattr(trajectory, "get") else None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _postprocess(wrapped, instance, args, kwargs):
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[0]
    stashed = [item.extra_fields.pop(_STASH, None) for item in inputs]
    output = wrapped(*args, **kwargs)
    present = [rows is not None for rows in stashed]
    if not any(present):
        return output
    if not all(present):
        from ..core.errors import ReplayDataError

        missing = present.index(False)
        raise ReplayDataError(
            BATCH_SUPPORT_KEY,
            "a batch mixes samples with and without support rows",
            trajectory=missing,
            expected="rows for every training sample of the batch",
        )
    import torch

    width = max(rows.shape[1] for rows in stashed)
    length = max(rows.shape[0] for rows in stashed)
    batch = np.full((len(stashed), length, width), turns.PAD, dtype=np.int32)
    for i, rows in enumerate(stashed):
        batch[i, : rows.shape[0], : rows.shape[1]] = rows
    output.batch[BATCH_SUPPORT_KEY] = torch.from_numpy(batch)
    return output


# --------------------------------------------------------------------------- AgentLoopOutput (V1)


def _as_dict(wrapped, instance, args, kwargs):
    output = wrapped(*args, **kwargs)
    record = _TRAJECTORY.get() if _ACTIVE else None
    if record is None:
        return output
    record.outputs += 1
    if record.outputs > 1:
        from ..core.errors import NotReplayable

        raise NotReplayable(
            "agent_loop",
            "an agent loop returned several outputs for one trajectory: the plugin cannot tell which generate calls "
            f"each holds, so {switch.PREFIX}{switch.SWITCH}=true supports one output per trajectory",
            value=record.outputs,
        )
    import torch

    rows = turns.align(instance.response_ids, instance.response_mask, record.turns, record.width)
    output[BATCH_SUPPORT_KEY] = torch.from_numpy(rows)
    return output


def _deactivate() -> None:
    global _ACTIVE
    _ACTIVE = False


def install(patcher: Patcher) -> None:
    global _ACTIVE
    patcher.wrap("AgentLoopWorker._run_agent_loop", _run_agent_loop)
    patcher.wrap("AgentLoopWorker._postprocess", _postprocess)
    patcher.wrap("AgentLoopOutput.as_dict", _as_dict)
    patcher.wrap("verl.workers.rollout.llm_server:LLMServerClient.generate", _client_generate)
    _ACTIVE = True
    patcher.on_revert(_deactivate)
