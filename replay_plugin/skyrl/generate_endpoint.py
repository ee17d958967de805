"""Patch ``skyrl.sample_support_rows``: SkyRL's ``/skyrl/v1/generate`` returns the plugin's exact rows.

Gap (skyrl 0.4.0, ``inference_servers/vllm_server_actor.py``; SkyRL PRs #1913/#2084, no fix
upstream): with ``return_sample_support`` the endpoint asks vLLM for ``logprobs=top_k`` and
``_sample_support_from_flat_logprobs`` builds rows of width ``top_k`` from them. A row cannot
hold the support when logits tie at the k-th position (vLLM's CPU/PyTorch top-k keeps every
tie), and when the sampled id is missing from the top-k entries the function *repairs* the row by
overwriting its weakest member with the sampled id (one warning per batch): the trainer then
renormalises over a set the sampler never had, and nothing downstream can tell.

With the patch, for a request that asked ``return_sample_support``:

- the request is opted into the plugin's capture (``extra_args.replay_sample_support``; the
  ``vllm.sample_support`` patch computes each row inside vLLM's sampler, width
  ``W = top_k + slack``, exact under ties, with an exactness flag per token);
- ``_sample_support_from_flat_logprobs`` returns those rows (int32 ``[T, W]``, ``-1`` padding) and
  the sampled logprobs, never a repaired row; SkyRL's own rows are not built;
- a row that is not exact follows the knob ``REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS_ON_INEXACT``:
  ``error`` (default) answers HTTP 500 naming the token and the fix, ``repair`` keeps the plugin's
  row and, where the sampled id is missing from it, writes the id into its first padding slot, or
  over its last (least likely) member when the row is full (logged with counts). A value of the
  knob that is neither refuses every request asking for support (HTTP 500 naming the variable):
  the patch still applies (were it left off, SkyRL would answer with its own rows), and SkyRL's
  width patches refuse such a job at start (``capture_guard``);
- a request the plugin cannot capture (sampler settings that are not replayable, an engine without
  the capture) is answered HTTP 400 / 500 with the reason instead of SkyRL's top-k rows.

Other requests, and every other SkyRL endpoint, run SkyRL's code unchanged. The engine must allow
``W`` logprobs: ``skyrl.engine_support_width`` raises SkyRL's ``max_logprobs = top_k``.

How: ``VLLMServerActor._add_custom_endpoints`` is wrapped. It registers the endpoints as before,
with a thin stand-in for the engine that sets the opt-in and keeps the request's last output in a
context variable of the request's task; the ``/skyrl/v1/generate`` route is then re-registered
around SkyRL's own endpoint function to mark the requests that asked for support. The module
function ``_sample_support_from_flat_logprobs`` (looked up by SkyRL at call time) is wrapped to read
the marked request's rows. Remove when SkyRL takes the support rows from vLLM's sampler.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import numpy as np

from ..patcher import Patcher
from ..vllm.engine_proxy import OutputKeepingEngine, OutputSlot
from .capture_guard import on_inexact
from .patches import ON_INEXACT_ENV

log = logging.getLogger("replay_plugin")

PATH = "/skyrl/v1/generate"


#: Whether the patch is applied. The route and the engine stand-in outlive a revert (a running
#: server keeps its routes); cleared, they pass every request to SkyRL unchanged.
_ACTIVE = False

#: The request being served in this task (set by the route, read by the engine stand-in and by
#: the row builder, which SkyRL calls in the same task).
_CURRENT: contextvars.ContextVar[OutputSlot | None] = contextvars.ContextVar(
    "replay_plugin_skyrl_request", default=None
)


# --------------------------------------------------------------------------- the engine stand-in


def _active() -> bool:
    return _ACTIVE


def _opt_in(sampling_params: Any) -> bool:
    """A request the route marked: opted into the plugin's capture (its output kept)."""
    from ..vllm import options

    extra = dict(getattr(sampling_params, "extra_args", None) or {})
    extra[options.REQUEST_SUPPORT_KEY] = True
    sampling_params.extra_args = extra
    return True


# --------------------------------------------------------------------------- the route


def _mark_support_requests(endpoint: Any) -> Any:
    """SkyRL's endpoint function, wrapped: a request whose body asks ``return_sample_support``
    runs with a fresh ``OutputSlot`` in :data:`_CURRENT`; the plugin's refusals become HTTP
    errors with their message (SkyRL's endpoint has no handler for them: a bare 500). A bad
    ``ON_INEXACT`` value refuses such a request before the engine runs."""
    from fastapi import HTTPException, Request

    from ..core.errors import NotReplayable, ReplayDataError
    from ..vllm.refusal import SampleSupportRefused

    async def skyrl_generate(request: Request):
        if not _ACTIVE:  # reverted: SkyRL's endpoint, unchanged
            return await endpoint(request)
        body = await request.json()  # starlette keeps the parsed body: SkyRL's own call reads it again
        if not isinstance(body, dict) or not body.get("return_sample_support", False):
            return await endpoint(request)
        try:
            on_inexact()
        except NotReplayable as exc:  # the server's configuration, not the request's fault
            raise HTTPException(status_code=500, detail=f"replay_plugin: {exc}") from exc
        token = _CURRENT.set(OutputSlot())
        try:
            return await endpoint(request)
        except SampleSupportRefused as exc:
            raise HTTPException(status_code=400, detail=f"replay_plugin: {exc}") from exc
        except ReplayDataError as exc:
            raise HTTPException(status_code=500, detail=f"replay_plugin: {exc}") from exc
        finally:
            _CURRENT.reset(token)

    skyrl_generate.__wrapped__ = endpoint  # type: ignore[attr-defined]
    return skyrl_generate


def _rewrap_route(app: Any) -> None:
    from fastapi.routing import APIRoute

    routes = app.router.routes
    for i, route in enumerate(routes):
        if isinstance(route, APIRoute) and route.path == PATH and "POST" in route.methods:
            routes[i] = APIRoute(PATH, _mark_support_requests(route.endpoint), methods=["POST"], name=route.name)
            return
    raise RuntimeError(f"VLLMServerActor._add_custom_endpoints registered no POST {PATH} route")


def _add_custom_endpoints(wrapped, instance, args, kwargs):
    # (app, engine, cli_args), positional or by name, as SkyRL's staticmethod takes them
    params = dict(zip(("app", "engine", "cli_args"), args), **kwargs)
    params["engine"] = OutputKeepingEngine(params["engine"], _CURRENT, _active, _opt_in)
    result = wrapped(**params)
    _rewrap_route(params["app"])
    return result


# --------------------------------------------------------------------------- the rows


def _rows(wrapped, instance, args, kwargs):
    current = _CURRENT.get()
    if current is None:  # not a request the route marked (the patch was applied late, or a test)
        return wrapped(*args, **kwargs)
    flat = args[0] if args else kwargs["logprobs"]
    top_k = args[1] if len(args) > 1 else kwargs["top_k"]
    return support_rows(current.output, flat, int(top_k))


def support_rows(output: Any, flat: Any, top_k: int) -> tuple[list[dict[str, float]], np.ndarray]:
    """``(sampled logprobs as SkyRL's content, rows int32 [T, W])`` of one request's last output,
    from the plugin's capture, checked against the flat logprobs SkyRL would have read.

    Raises:
        ReplayDataError: no rows on the output (the capture did not run), rows not aligned with
            the sampled tokens, an inexact row under ``on_inexact() == "error"``.
    """
    from ..core.errors import ReplayDataError
    from ..vllm.client import support_for

    completion = output.outputs[0] if output is not None and getattr(output, "outputs", None) else None
    if completion is None:
        raise ReplayDataError("rollout_sample_support", "the engine returned no output", expected="one output")
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    sampled = np.asarray(flat.token_ids, dtype=np.int64)[starts] if len(starts) else np.zeros(0, np.int64)
    rows = support_for(completion, sampled, "rollout_sample_support")
    ids = rows.ids
    inexact = np.flatnonzero(~rows.exact)
    if inexact.size:
        policy = on_inexact()
        tok = int(inexact[0])
        if policy == "error":
            raise ReplayDataError(
                "rollout_sample_support",
                f"{inexact.size} of {len(rows)} rows are not the sampler's exact support (token {tok}: its support "
                f"is wider than the {rows.width} ids recorded, or lacks the sampled token)",
                token=tok,
                expected=f"exact rows: raise REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK (row width top_k + slack = "
                f"{rows.width}), or set {ON_INEXACT_ENV}=repair to train on them",
            )
        ids = ids.copy()
        missing = [int(t) for t in inexact if not (ids[t] == rows.sampled[t]).any()]
        overwritten = 0
        for t in missing:
            filled = int((ids[t] >= 0).sum())
            overwritten += filled >= ids.shape[1]
            # the first padding slot, or over the last (least likely) member of a full row
            ids[t, min(filled, ids.shape[1] - 1)] = rows.sampled[t]
        log.warning(
            "replay_plugin: skyrl.sample_support_rows: %d of %d support rows inexact; %d lacked the sampled id: "
            "%d got it in a padding slot, %d had their last member overwritten by it (%s=repair); first at token %d",
            inexact.size,
            len(rows),
            len(missing),
            len(missing) - overwritten,
            overwritten,
            ON_INEXACT_ENV,
            tok,
        )
    content = [{"logprob": float(value)} for value in rows.sampled_logprob]
    return content, np.ascontiguousarray(ids, dtype=np.int32)


def _deactivate() -> None:
    global _ACTIVE
    _ACTIVE = False


def install(patcher: Patcher) -> None:
    global _ACTIVE
    from ..core.errors import NotReplayable

    try:
        on_inexact()
    except NotReplayable as exc:  # applied all the same: each support request is refused instead
        log.warning("replay_plugin: skyrl.sample_support_rows: %s", exc)
    patcher.wrap("VLLMServerActor._add_custom_endpoints", _add_custom_endpoints)
    patcher.wrap("_sample_support_from_flat_logprobs", _rows)
    _ACTIVE = True
    patcher.on_revert(_deactivate)
