"""Patch ``verl.rollout_support_server``: verl's vLLM server returns each request's support rows.

Gap (verl 0.9.1, ``workers/rollout/vllm_rollout/vllm_async_server.py``): ``vLLMHttpServer``
runs vLLM's ``AsyncLLM`` in-process and answers ``generate`` with a ``TokenOutput`` built from the
final ``RequestOutput`` (token ids, the sampled token's logprob, routed experts). verl has no
sampler-support replay: nothing asks the sampler for its support, and the final output (where
the plugin's vLLM capture puts the rows) is a local of ``generate`` that no caller sees.

With ``+actor_rollout_ref.rollout.custom.replay_sample_support=true`` (``switch``):

- ``_preprocess_engine_kwargs`` (before the engine is built): the rollout config is checked
  (``switch.check_rollout_config``: bounded top_k, temperature, processed logprobs, no PD
  disaggregation; refused naming the verl key, so the server does not start; so is the switch with
  ``REPLAY_PLUGIN_VERL_ROLLOUT_SUPPORT_BATCH=0``, which would leave the batch without rows, and the
  switch where the vLLM capture patches would not apply: a vLLM outside their range such as the
  0.24 of verl's ``[vllm]`` extra, or one of them switched off), and the engine's
  ``max_logprobs`` is raised to the rows' width ``W`` (never lowered; vLLM's default is 20);
- ``run_server``: once verl has built the engine, ``self.engine`` is a thin stand-in that keeps
  the last output of each request that opted in (``extra_args.replay_sample_support``, set by the
  agent-loop side ``verl.rollout_support_batch`` for training requests only);
- ``generate``: for such a request, the rows (int32 ``[T, W]``, ``-1`` padding) are checked against
  the returned token ids and put into ``TokenOutput.extra_fields["rollout_sample_support"]``. A
  row that is not the sampler's exact support (more ties at the k-th logit than the slack holds)
  is refused with an error naming the token and the fix (raise the slack); so is an opted-in
  request whose output carries no rows (the vLLM pack did not run in this process).

Requests that did not opt in (validation, greedy samples), and every request without the
switch, run verl's code unchanged. Remove when verl carries the sampler's support itself.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import numpy as np

from ..patcher import Patcher
from ..vllm.engine_proxy import OutputKeepingEngine, OutputSlot, fitted_max_logprobs
from ..vllm.request_guard import SUPPORT_CAPTURE
from . import switch

log = logging.getLogger("replay_plugin")

#: the request being answered in this task (set by ``generate``, filled by the engine stand-in)
_CURRENT: contextvars.ContextVar[OutputSlot | None] = contextvars.ContextVar("replay_plugin_verl_request", default=None)
_ACTIVE = False


def _active() -> bool:
    return _ACTIVE


def _opted_in(params: Any) -> bool:
    from ..vllm import options

    return options.wants_support(getattr(params, "extra_args", None))


def _on(instance: Any) -> bool:
    return _ACTIVE and switch.requested(instance.config)


def _preprocess_engine_kwargs(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if not _on(instance):
        return result
    engine_kwargs = args[0] if args else kwargs["engine_kwargs"]
    switch.check_rollout_config(instance.config)
    _check_batch_patch()
    _check_capture()
    vocabulary = getattr(getattr(instance.model_config, "hf_config", None), "vocab_size", None)
    width = switch.width(instance.config, vocabulary)
    current = engine_kwargs.get("max_logprobs")
    if fitted_max_logprobs(current, width) is not None:
        log.info(
            "replay_plugin: verl.rollout_support_server: max_logprobs %s -> %d (top_k %s + slack, the rows' width)",
            "default (20)" if current is None else current,
            width,
            instance.config.top_k,
        )
        engine_kwargs["max_logprobs"] = width
    return result


def _check_batch_patch() -> None:
    """The switch without the agent-loop half would train on batches without rows, silently
    (nothing opts in): refuse it where the job starts, naming the variable."""
    from ..core.errors import NotReplayable
    from ..settings import load
    from ..spec import toggle_name

    name = toggle_name("verl.rollout_support_batch")
    if load().toggle(name) is False:
        raise NotReplayable(
            name,
            f"{switch.PREFIX}{switch.SWITCH}=true but {name}=0 switches off the patch that puts the rows into verl's "
            f"batch: the trainer would score without them. Unset {name}, or drop the switch",
            value=False,
        )


#: the vLLM patches that capture the rows for verl's in-process engine (front end, engine core,
#: scheduler, sampler); any of them off and every opted-in request would fail on its first answer
CAPTURE = SUPPORT_CAPTURE


def _check_capture() -> None:
    """The switch with a vLLM the capture patches do not cover or with one of them switched off:
    refused where the server starts, before the model loads, naming the patch, its state and the
    fix (``vllm.request_guard.refuse_capture_off``)."""
    from ..vllm.request_guard import refuse_capture_off

    refuse_capture_off(
        CAPTURE,
        f"{switch.PREFIX}{switch.SWITCH}=true",
        "here",
        "verl 0.9.1's [vllm] extra pins vLLM 0.24; routes on CPU need vLLM 0.30, "
        "docs/integrations/verl.md#vllm-versions-and-limits",
    )


async def _run_server(wrapped, instance, args, kwargs):
    result = await wrapped(*args, **kwargs)
    engine = getattr(instance, "engine", None)
    if _on(instance) and engine is not None and not isinstance(engine, OutputKeepingEngine):
        instance.engine = OutputKeepingEngine(engine, _CURRENT, _active, _opted_in)
    return result


async def _generate(wrapped, instance, args, kwargs):
    if not _on(instance):
        return await wrapped(*args, **kwargs)
    request = OutputSlot()
    token = _CURRENT.set(request)
    try:
        result = await wrapped(*args, **kwargs)
    finally:
        _CURRENT.reset(token)
    if request.output is None:  # did not opt in (or parked and rejected before the engine)
        return result
    rows = rows_of(request.output, list(result.token_ids))
    if rows is not None:
        result.extra_fields[switch.BATCH_SUPPORT_KEY] = rows
    return result


def rows_of(output: Any, token_ids: Any) -> np.ndarray | None:
    """The support rows (int32 ``[T, W]``) of one opted-in request's final output, checked
    against the token ids verl returns; None for an aborted request without tokens.

    Raises:
        ReplayTypeError: a token id that is not an int (a float would be truncated), naming the token.
        ReplayDataError: a token id outside int64, no rows (the capture did not run, or the engine
            refused the request), rows for other tokens, a row that is not the sampler's exact
            support; each naming verl's field ``rollout_sample_support``.
    """
    from ..core.errors import ReplayDataError
    from ..vllm.client import ReplayDataMissing, support_for
    from .turns import token_ids as checked_ids

    ids = checked_ids(token_ids, switch.BATCH_SUPPORT_KEY)
    completion = output.outputs[0] if getattr(output, "outputs", None) else None
    if completion is None:
        if ids.size:
            raise ReplayDataError(switch.BATCH_SUPPORT_KEY, "the engine returned no completion", expected="one")
        return None
    try:
        rows = support_for(completion, ids, switch.BATCH_SUPPORT_KEY)
    except ReplayDataMissing as exc:
        if exc.field == switch.BATCH_SUPPORT_KEY:
            raise
        # the vLLM client names its own attribute (``sample_support``); verl's users know the field
        problem = str(exc).partition(": ")[2] or str(exc)
        raise ReplayDataMissing(
            switch.BATCH_SUPPORT_KEY, problem, expected="rows from the plugin's vLLM capture"
        ) from None
    inexact = np.flatnonzero(~rows.exact)
    if inexact.size:
        tok = int(inexact[0])
        raise ReplayDataError(
            switch.BATCH_SUPPORT_KEY,
            f"{inexact.size} of {len(rows)} rows are not the sampler's exact support (token {tok}: more tokens tie "
            f"at the top_k-th logit than the {rows.width} ids of a row hold, or the row lacks the sampled token)",
            token=tok,
            expected=f"exact rows: raise {switch.PREFIX}{switch.SLACK} (row width top_k + slack = {rows.width})",
        )
    return np.ascontiguousarray(rows.ids, dtype=np.int32)


def _deactivate() -> None:
    global _ACTIVE
    _ACTIVE = False


def install(patcher: Patcher) -> None:
    global _ACTIVE
    patcher.wrap("vLLMHttpServer._preprocess_engine_kwargs", _preprocess_engine_kwargs)
    patcher.wrap("vLLMHttpServer.run_server", _run_server)
    patcher.wrap("vLLMHttpServer.generate", _generate)
    _ACTIVE = True
    patcher.on_revert(_deactivate)
