"""Patch ``trl.vllm_rows``: the support rows and routes of TRL's colocated vLLM completions reach
TRL's batch.

Gap (trl 1.16.0, ``generation/vllm_generation.py``): in colocate mode ``VLLMGeneration.generate``
calls ``LLM.generate`` and keeps each ``CompletionOutput``'s token ids and, through
``extract_logprobs``, the ranked logprobs TRL asked for (the sampled token's, ``logprobs=0``).
Everything else on the outputs is dropped there: the sampler support the vLLM pack captured
(``CompletionOutput.sample_support``) and the routed experts (``CompletionOutput.routed_experts``),
so the trainer can neither renormalise its logprobs on the sampler's support nor replay the
routes.

While ``trl.rollout_batch`` collects a generation (``rollout.current()``, opened by TRL's
``_generate_and_score_completions`` with the switch on) and the job asks for rows or routes,
``generate`` keeps the ``RequestOutput`` list TRL hands to ``extract_logprobs`` and, once TRL
returns, delivers one ``rollout.Completion`` per completion in TRL's order, after TRL's own
tensor-parallel slice (each rank of a TP group generates the group's prompts and keeps its
share: the same slice here):

- ``rows``: ``vllm.client.support_for(c, c.token_ids)``, the rows checked against the tokens vLLM
  returned (one per token, for that token, a finite sampled logprob); missing rows (the plugin's
  capture did not run, the engine refused the request) raise ``ReplayDataMissing`` naming the fix;
- ``routes``: ``c.routed_experts`` (compact, ``[P + T - 1, L, K]``: vLLM routes every token it ran,
  the prompt and every generated token but the last) extended by one padding row for the last
  token, ``router_padding`` True there; an output without routes, or routes of another length,
  is refused naming the completion.

The delivered completions' tokens are checked against the ``completion_ids`` TRL returns (the TP
slice agreed).

Server mode (``vllm serve`` with the plugin; ``VLLMClient.generate`` posts one ``/v1/completions``
request and keeps each choice's ids and logprobs only): TRL puts ``generation_kwargs`` into the
request body as is, where vLLM's OpenAI server does not read ``extra_args`` (an unknown field,
dropped). ``VLLMClient.generate`` moves the plugin's keys to ``vllm_xargs`` (booleans as 1 / 0),
keeps the response body ``VLLMClient._post`` returns and decodes every choice
(``vllm.client.decode_choice``: the ``sample_support`` and ``routed_experts`` envelopes of the
plugin's ``vllm.openai_fields``), checked as above. ``VLLMGeneration.generate`` runs the client on
the main process only and broadcasts TRL's 4-tuple; the decoded completions follow with one more
broadcast and each rank keeps TRL's ``process_slice``. Image prompts (``/inference/v1/generate``)
are refused by name.

Jobs without the switch, and every call outside a collected generation, run TRL's code
unchanged. Remove when TRL hands the sampler's support (vLLM's sampling mask, trl#6789) and
routes to its batch.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.errors import ReplayDataError
from ..patcher import Patcher
from . import rollout
from .switch import Ask

#: the ``RequestOutput`` list of the ``generate`` call running in this context (None outside one)
_OUTPUTS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "replay_plugin_trl_vllm_outputs", default=None
)


def completion_of(output: Any, prompt_ids: Sequence[int], ask: Ask, index: int) -> rollout.Completion:
    """The :class:`rollout.Completion` of one vLLM ``CompletionOutput`` (completion ``index`` of
    the call, for messages) whose prompt is ``prompt_ids``.

    Raises:
        ReplayDataMissing / ReplayDataError: rows missing or not for the output's tokens; routes
            missing or of another length than the prompt and completion; naming the completion.
    """
    from ..core import routes as core_routes
    from ..vllm.client import ROUTES_FIELD, ReplayDataMissing, support_for

    token_ids = list(output.token_ids)
    rows = None
    if ask.support:
        try:
            rows = support_for(output, token_ids, field="replay_support")
        except ReplayDataError as exc:  # ReplayDataMissing included: the same error, located
            problem = str(exc).split(": ", 1)[-1]  # the message without its location (re-located here)
            raise type(exc)("replay_support", problem, trajectory=index, token=exc.token) from None
    routes = padding = None
    if ask.routes:
        captured = getattr(output, ROUTES_FIELD, None)
        if captured is None:
            raise ReplayDataMissing(
                "replay_routes",
                f"completion {index}: vLLM returned no routed experts although {ask!r} asked for them: the colocated "
                "engine was started without enable_return_routed_experts (trl.vllm_engine_args not applied?) or "
                "this vLLM returns none on this device (on CPU only vLLM 0.30 does): run `replay-plugin status "
                "--import trl`",
            )
        captured = core_routes.compact(np.asarray(captured), trajectory=index)
        total = len(prompt_ids) + len(token_ids)
        if captured.ndim != 3 or captured.shape[0] not in (total - 1, total):
            raise ReplayDataError(
                "replay_routes",
                f"completion {index}: routes of shape {captured.shape} for {len(prompt_ids)} prompt and "
                f"{len(token_ids)} completion tokens",
                trajectory=index,
                expected=f"[{total - 1} or {total}, layers, topk]",
            )
        missing = total - captured.shape[0]
        pad = core_routes.padding_rows(missing, captured.shape[1], captured.shape[2], captured.dtype)
        routes = np.concatenate([captured, pad]) if missing else captured
        padding = np.zeros(total, dtype=bool)
        padding[captured.shape[0] :] = True
    return rollout.Completion(rows=rows, routes=routes, router_padding=padding)


def completions_of(request_outputs: Sequence[Any], ask: Ask) -> list[rollout.Completion]:
    """Every completion of ``LLM.generate``'s outputs, in TRL's order (request by request, then
    each request's completions)."""
    out: list[rollout.Completion] = []
    for request in request_outputs:
        prompt = list(request.prompt_token_ids or [])
        for output in request.outputs:
            out.append(completion_of(output, prompt, ask, len(out)))
    return out


def check_tokens(completions: Sequence[rollout.Completion], completion_ids: Sequence[Sequence[int]]) -> None:
    """The delivered rows are for TRL's completions (count, and each row's token).

    Raises:
        ReplayDataError: naming the completion and token.
    """
    if len(completions) != len(completion_ids):
        raise ReplayDataError(
            "replay_support",
            f"{len(completions)} completions captured from vLLM for the {len(completion_ids)} TRL keeps on this rank",
        )
    for i, (completion, ids) in enumerate(zip(completions, completion_ids)):
        if completion.rows is None:
            continue
        sampled = completion.rows.sampled.astype(np.int64)
        tokens = np.asarray(list(ids), dtype=np.int64)
        if sampled.shape != tokens.shape or not np.array_equal(sampled, tokens):
            raise ReplayDataError(
                "replay_support",
                f"completion {i}: the rows were captured for other tokens than TRL's completion_ids "
                "(TRL's tensor-parallel slice and the plugin's disagree)",
                trajectory=i,
            )


def _tp_share(instance: Any, completions: list[rollout.Completion], local: int) -> list[rollout.Completion]:
    """This rank's share of its TP group's completions, sliced as TRL slices (1.16.0,
    ``VLLMGeneration.generate``: ``local_rank_in_group * orig_size``)."""
    if getattr(instance, "tensor_parallel_size", 1) <= 1:
        return completions
    import torch.distributed

    rank = torch.distributed.get_rank(group=instance.tp_group)
    return completions[rank * local : (rank + 1) * local]


def _collecting(instance: Any) -> rollout.Rollout | None:
    target = rollout.current()
    if target is None or not target.ask.any or getattr(instance, "mode", None) not in ("colocate", "server"):
        return None
    return target


def _collect(var: contextvars.ContextVar[list[Any] | None], wrapped, *args, **kwargs) -> tuple[Any, list[Any]]:
    """``wrapped(*args, **kwargs)`` with ``var`` holding a fresh list for the inner wrappers of this
    call (and only this call: reset after, on error too) to append to; the result and that list."""
    slot: list[Any] = []
    token = var.set(slot)
    try:
        return wrapped(*args, **kwargs), slot
    finally:
        var.reset(token)


def _generate(wrapped, instance, args, kwargs):
    target = _collecting(instance)
    if target is None:
        return wrapped(*args, **kwargs)
    prompts = args[0] if args else kwargs["prompts"]
    if instance.mode == "server":
        return _generate_served(wrapped, instance, args, kwargs, target, prompts)
    result, slot = _collect(_OUTPUTS, wrapped, *args, **kwargs)
    if len(slot) != 1:
        raise ReplayDataError(
            "replay_support",
            f"TRL's colocated generate handed {len(slot)} output lists to extract_logprobs (expected 1): "
            "a TRL release outside trl.vllm_rows' range?",
        )
    completions = _tp_share(instance, completions_of(slot[0], target.ask), len(prompts))
    check_tokens(completions, result[1])
    target.deliver(completions)
    return result


# --------------------------------------------------------------------------- server mode

#: the completions ``VLLMClient.generate`` decoded during the served ``generate`` running here
_SERVED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("replay_plugin_trl_served", default=None)
#: the response bodies ``VLLMClient._post`` returned during the ``VLLMClient.generate`` running here
_RESPONSES: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "replay_plugin_trl_responses", default=None
)


def served_generation_kwargs(generation_kwargs: Any) -> dict[str, Any]:
    """TRL's ``generation_kwargs`` for a ``/v1/completions`` body: the plugin's keys moved from
    ``extra_args`` (which vLLM's OpenAI server does not read: an unknown field, dropped) to
    ``vllm_xargs`` (copied into ``SamplingParams.extra_args``), booleans as 1 / 0 (``vllm_xargs``
    carries strings and numbers only). Other keys stay where the user put them."""
    from .switch import KEYS

    out = dict(generation_kwargs or {})
    extra = dict(out.get("extra_args") or {})
    moved = {key: extra.pop(key) for key in KEYS if key in extra}
    if not moved:
        return out
    if extra:
        out["extra_args"] = extra
    else:
        out.pop("extra_args", None)
    xargs = dict(out.get("vllm_xargs") or {})
    xargs.update({key: int(value) if isinstance(value, bool) else value for key, value in moved.items()})
    out["vllm_xargs"] = xargs
    return out


def completions_of_choices(choices: Sequence[Any], ask: Ask) -> list[rollout.Completion]:
    """Every served choice of TRL's ``/v1/completions`` request, in the response's order (TRL's:
    prompt-major), decoded (``vllm.client.decode_choice``) and checked as :func:`completion_of`."""
    import types

    from ..vllm.client import decode_choice

    out: list[rollout.Completion] = []
    for i, choice in enumerate(choices):
        replay = decode_choice(choice, require_support=ask.support)
        output = types.SimpleNamespace(
            token_ids=list(choice.get("token_ids") or []), routed_experts=replay.routed_experts
        )
        if replay.support is not None:
            output.sample_support = replay.support
        out.append(completion_of(output, list(choice.get("prompt_token_ids") or []), ask, i))
    return out


def _client_generate(wrapped, instance, args, kwargs):
    import inspect
    import types

    from .switch import asked

    call = inspect.signature(wrapped).bind(*args, **kwargs)
    generation_kwargs = call.arguments.get("generation_kwargs")
    ask = asked(types.SimpleNamespace(generation_kwargs=generation_kwargs))
    if not ask.any:
        return wrapped(*args, **kwargs)
    if call.arguments.get("features") is not None:
        from ..core.errors import NotReplayable

        raise NotReplayable(
            "features",
            "TRL's server mode generates image prompts through /inference/v1/generate, which trl.vllm_rows does not "
            "read: replay is not available for vision-language prompts; drop the switch for this job",
        )
    call.arguments["generation_kwargs"] = served_generation_kwargs(generation_kwargs)
    result, responses = _collect(_RESPONSES, wrapped, *call.args, **call.kwargs)
    if len(responses) != 1:
        raise ReplayDataError(
            "replay_support",
            f"TRL's VLLMClient.generate posted {len(responses)} requests (expected 1): a TRL release outside "
            "trl.vllm_rows' range?",
        )
    completions = completions_of_choices(responses[0]["choices"], ask)
    check_tokens(completions, result["completion_ids"])
    served = _SERVED.get()
    if served is not None:
        served.append(completions)
    elif (target := rollout.current()) is not None:
        target.deliver(completions)
    return result


def _post(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    responses = _RESPONSES.get()
    url = args[0] if args else kwargs.get("url", "")
    if responses is not None and str(url).endswith("/v1/completions"):
        responses.append(result)
    return result


def _generate_served(wrapped, instance, args, kwargs, target: rollout.Rollout, prompts: Sequence[Any]):
    """Server mode: the main process posts every rank's prompts and broadcasts TRL's 4-tuple; the
    rows it decoded go the same way (one more broadcast), then each rank keeps its share as TRL
    does (``process_slice``)."""
    result, slot = _collect(_SERVED, wrapped, *args, **kwargs)
    accelerator = instance.accelerator
    completions = slot[0] if slot else None
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [completions]
        broadcast_object_list(box, from_process=0)
        completions = box[0]
    if completions is None:
        raise ReplayDataError(
            "replay_support",
            "TRL's served generate returned completions the plugin did not decode (VLLMClient.generate ran "
            "without trl.vllm_rows' wrapper: replaced by another library?)",
        )
    share = slice(accelerator.process_index * len(prompts), (accelerator.process_index + 1) * len(prompts))
    completions = completions[share]
    check_tokens(completions, result[1])
    target.deliver(completions)
    return result


def _extract_logprobs(wrapped, instance, args, kwargs):
    slot = _OUTPUTS.get()
    if slot is not None:
        slot.append(args[0] if args else kwargs["all_outputs"])
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    patcher.wrap("VLLMGeneration.generate", _generate)
    patcher.wrap("extract_logprobs", _extract_logprobs)
    patcher.wrap("VLLMClient.generate", _client_generate)
    patcher.wrap("VLLMClient._post", _post)
