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
slice agreed). Server mode (``VLLMClient.generate`` drops every field but ids and logprobs) is
not covered by this patch: TRL's own guard refuses the switch there. Jobs without the switch, and
every call outside a collected generation, run TRL's code unchanged. Remove when TRL hands the
sampler's support (vLLM's sampling mask, trl#6789) and routes to its batch.
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
    if target is None or not target.ask.any or getattr(instance, "mode", None) != "colocate":
        return None
    return target


def _generate(wrapped, instance, args, kwargs):
    target = _collecting(instance)
    if target is None:
        return wrapped(*args, **kwargs)
    prompts = args[0] if args else kwargs["prompts"]
    slot: list[Any] = []
    token = _OUTPUTS.set(slot)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _OUTPUTS.reset(token)
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


def _extract_logprobs(wrapped, instance, args, kwargs):
    slot = _OUTPUTS.get()
    if slot is not None:
        slot.append(args[0] if args else kwargs["all_outputs"])
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    patcher.wrap("VLLMGeneration.generate", _generate)
    patcher.wrap("extract_logprobs", _extract_logprobs)
