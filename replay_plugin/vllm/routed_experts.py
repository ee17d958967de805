"""Patch ``vllm.routed_experts``: routed experts (R3) in the compact dtype, kept through delta merges.

Gap: vLLM (``enable_return_routed_experts``) returns routes as uint8/uint16 on the final output
only, and vLLM 0.30 drops them when ``AsyncLLM`` merges ``DELTA`` outputs a slow consumer has not
collected (fixed in 0.32, where that wrapper is not installed). For opted-in requests the patch
converts them with ``core.routes.compact`` (validated; the dtype the trainer side uses) and
carries them through the merge; other requests (also one that opts out of
``REQUESTS=all`` with ``"replay_sample_support": false``) stay stock, merges included. Remove when the oldest supported
vLLM keeps routes through delta merges and trainers accept vLLM's uint16.

vLLM 0.31+ returns routes only through the AuxOutput connector, which needs Model Runner V2 (the
only runner of 0.34); 0.33 and 0.34 are run here on it. Every target and relied-on name of 0.33
and 0.34 is 0.32's except ``make_request_output`` (pooling outputs handled first),
``process_outputs`` (engine-core errors, streaming-input boundaries) and ``AsyncLLM.generate``
(a ``GenerationError`` also aborts an ``n > 1`` request's siblings); the routes still reach
``RequestState.make_request_output`` as a uint8 array up to 256 experts, uint16 above.
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
        queue = getattr(state, "queue", None)
        if queue is not None and hasattr(queue, "__dict__"):
            queue.__dict__[_FLAG] = True  # the collector merges this request's deltas
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
    if not instance.__dict__.get(_FLAG):
        return wrapped(*args, **kwargs)
    output = args[0] if args else kwargs["output"]
    previous = instance.output
    routes = {}
    if previous is not None and instance.aggregate and not isinstance(output, Exception):
        routes = {
            c.index: c.routed_experts
            for c in getattr(output, "outputs", None) or ()
            if getattr(c, "routed_experts", None) is not None
        }
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
