"""Patch ``vllm.openai_fields``: replay data in ``vllm serve`` responses as ``core.wire`` documents.

Gap (vLLM 0.30-0.32, no upstream fix): ``vllm serve`` has no field for a sampler support and
returns routed experts as a base64 ``.npy`` string (none at all in streamed completions and
chats); nested JSON lists cost 3-4x the bytes and parse slowly. For an opted-in request each
choice of a completion or chat response gets ``sample_support`` (``ids``, ``sampled``,
``sampled_logprob``, ``exact``: one envelope each) and ``routed_experts`` (one envelope,
compact dtype); streamed, each chunk carries the rows of the tokens that arrived since the
choice's previous chunk (``served_stream``) and the routes come with the choice's last rows.
Other responses are left alone. Read them with :func:`replay_plugin.vllm.client.decode_choice`
(one choice) or :func:`~replay_plugin.vllm.client.decode_stream` (chunks). Remove when vLLM
serves both in a binary array format.

vLLM 0.33/0.34 (compared with 0.32, run on both): chat's stream generator is a shell that
serializes the chunks of the new ``chat_completion_stream_generator_raw`` (relied on: the same
chunks per choice, the role chunk first, ``[DONE]`` last, errors as ``{"error": ...}`` events); a
finishing output without text gets a chunk in both stream generators, which also carry
``weight_versions`` and ``kv_transfer_params``; the full responses build the same choices (a
``weight_versions`` field; chat assembles tool calls in helpers). 0.34's completion stream renders
plain delta chunks (no logprobs, echo or token ids) from a template of the JSON bytes the model
would serialize: still one ``data: {...}`` event per chunk, read and rewritten as before.

Hidden reasoning (vLLM 0.30-0.34, ``chat_completion/serving.py``): a server with a reasoning or
tool parser (``OpenAIServingChat.parser_cls``) withholds a chat choice's ``logprobs`` and
``token_ids`` when the request sets ``include_reasoning: false`` (``suppress_metadata`` in the full
response, ``hide_stream_metadata`` / the stream processor's ``hide_metadata`` in streams): they
would reveal the hidden reasoning tokens. A support row names its token's sampled id, so it would
reveal them just the same: such a request asking for the support is refused before compute (HTTP
400 naming ``include_reasoning``), as ``vllm.generate_fields`` refuses 0.33's derender mode. Routes
alone are not refused: vLLM serves a chat choice's ``routed_experts`` with the reasoning hidden too.
"""

from __future__ import annotations

import logging
from typing import Any

from ..core.routes import compact
from ..core.wire import encode_array
from ..patcher import Patcher
from . import options
from .client import ROUTES_FIELD, SUPPORT_FIELD
from .refusal import refusal
from .sample_support_capture import sample_support
from .served_stream import StreamReplay, encode_support, get_arg, replace_arg

log = logging.getLogger("replay_plugin")


def _request_wants_routes(request: Any) -> bool:
    try:
        return options.wants_routes(getattr(request, "vllm_xargs", None))
    except options.OptionError as exc:
        log.warning("replay_plugin: vllm.openai_fields: %s; routed experts left as vLLM serves them", exc)
        return False


def _request_wants_replay(request: Any) -> bool:
    """Whether a served request asked for replay data (else its stream is left untouched)."""
    xargs = getattr(request, "vllm_xargs", None)
    try:
        return options.wants_support(xargs) or options.wants_routes(xargs)
    except options.OptionError:
        return False  # refused by the admission before any output exists


def _refuse_hidden_reasoning(serving: Any, request: Any) -> None:
    """Refuse a chat request asking for the support whose reasoning vLLM hides (module docstring).
    Runs before the result generator is iterated: the engine has not seen the request."""
    if getattr(request, "include_reasoning", True) or getattr(serving, "parser_cls", None) is None:
        return
    try:
        wanted = options.wants_support(getattr(request, "vllm_xargs", None))
    except options.OptionError:
        return  # refused by the admission, naming the key
    if wanted:
        raise refusal(
            "replay_plugin: the chat request asks for the sampler support (replay_sample_support) with "
            "include_reasoning false on a server with a reasoning or tool parser: vLLM then withholds the "
            "choices' token ids and logprobs, and support rows would reveal the hidden tokens just the same; "
            "send include_reasoning true (and drop the reasoning client-side), or do not ask for the support",
            "include_reasoning",
            False,
        )


def _fields(output: Any, routes_wanted: bool) -> dict:
    fields: dict[str, Any] = {}
    rows = sample_support(output)
    if rows is not None:
        fields[SUPPORT_FIELD] = encode_support(rows)
    routes = getattr(output, "routed_experts", None)
    if routes is not None and (routes_wanted or rows is not None):
        fields[ROUTES_FIELD] = encode_array(compact(routes))
    return fields


_subclasses: dict[Any, Any] = {}


def _replay_model(cls: Any, **overrides: Any) -> Any:
    """A cached pydantic subclass of ``cls`` with field types ``overrides`` (name -> type)."""
    key = (cls, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
    sub = _subclasses.get(key)
    if sub is None:
        import pydantic

        sub = pydantic.create_model(
            f"Replay{cls.__name__}",
            __base__=cls,
            __module__=__name__,
            **{name: (tp, None) for name, tp in overrides.items()},
        )
        _subclasses[key] = sub
    return sub


def _rebuild(model: Any, cls: Any, replace: dict) -> Any:
    data = {**model.__dict__, **(model.__pydantic_extra__ or {}), **replace}
    return cls.model_construct(_fields_set=set(model.model_fields_set) | set(replace), **data)


def decorate(response: Any, outputs: list[Any | None], routes_wanted: bool) -> Any:
    """Return ``response`` with replay fields on the choices whose output (same position in
    ``outputs``; None for none) carries replay data; unchanged when there is none."""
    per_choice = [(_fields(o, routes_wanted) if o is not None else {}) for o in outputs]
    if not any(per_choice):
        return response
    choices = list(response.choices)
    choice_cls = _replay_model(type(choices[0]), routed_experts=Any)
    new_choices = [_rebuild(c, choice_cls, f) for c, f in zip(choices, per_choice)]
    new_choices += [_rebuild(c, choice_cls, {}) for c in choices[len(per_choice) :]]
    response_cls = _replay_model(type(response), choices=list[choice_cls])  # type: ignore[valid-type]
    return _rebuild(response, response_cls, {"choices": new_choices})


def _completion_response(wrapped, instance, args, kwargs):
    response = wrapped(*args, **kwargs)
    try:
        batch = args[0] if args else kwargs["final_res_batch"]
        request = args[1] if len(args) > 1 else kwargs["request"]
        outputs = [o for res in batch for o in res.outputs]
        return decorate(response, outputs, _request_wants_routes(request))
    except Exception:
        log.exception("replay_plugin: vllm.openai_fields: could not add replay fields to a completion response")
        return response


async def _chat_full(wrapped, instance, args, kwargs):
    args = list(args)
    request = args[0] if args else kwargs["request"]
    _refuse_hidden_reasoning(instance, request)
    last: list[Any] = []

    async def tap(results):
        async for res in results:
            last[:] = [res]
            yield res

    if len(args) > 1:
        args[1] = tap(args[1])
    else:
        kwargs["result_generator"] = tap(kwargs["result_generator"])
    response = await wrapped(*args, **kwargs)
    if not last or not hasattr(response, "choices"):
        return response
    try:
        by_index = {o.index: o for o in last[0].outputs}
        outputs = [by_index.get(getattr(c, "index", None)) for c in response.choices]
        return decorate(response, outputs, _request_wants_routes(request))
    except Exception:
        log.exception("replay_plugin: vllm.openai_fields: could not add replay fields to a chat response")
        return response


def _completion_stream(wrapped, instance, args, kwargs):
    """``completion_stream_generator``: choice ``i`` of prompt ``p`` is ``p * n + i``."""
    request = get_arg(args, kwargs, "request", 0)
    if not _request_wants_replay(request):
        return wrapped(*args, **kwargs)
    n = request.n or 1
    replay = StreamReplay(
        lambda item: [(item[0] * n + o.index, o) for o in item[1].outputs], _request_wants_routes(request), mask=False
    )
    results = get_arg(args, kwargs, "result_generator", 2)
    args, kwargs = replace_arg(args, kwargs, "result_generator", 2, replay.tap(results))
    return replay.decorate(wrapped(*args, **kwargs))


def _chat_takes_rows(choice: dict) -> bool:
    """Chat's first chunk per choice announces the role and carries no token."""
    delta = choice.get("delta")
    return not (isinstance(delta, dict) and "role" in delta)


def _chat_stream(wrapped, instance, args, kwargs):
    """``chat_completion_stream_generator``: the choice index is the output's index."""
    request = get_arg(args, kwargs, "request", 0)
    if not _request_wants_replay(request):
        return wrapped(*args, **kwargs)
    _refuse_hidden_reasoning(instance, request)
    replay = StreamReplay(lambda res: [(o.index, o) for o in res.outputs], _request_wants_routes(request), mask=False)
    results = get_arg(args, kwargs, "result_generator", 1)
    args, kwargs = replace_arg(args, kwargs, "result_generator", 1, replay.tap(results))
    return replay.decorate(wrapped(*args, **kwargs), _chat_takes_rows)


def install(patcher: Patcher) -> None:
    patcher.wrap("OpenAIServingCompletion.request_output_to_completion_response", _completion_response)
    patcher.wrap("OpenAIServingChat.chat_completion_full_generator", _chat_full)
    patcher.wrap("OpenAIServingCompletion.completion_stream_generator", _completion_stream)
    patcher.wrap("OpenAIServingChat.chat_completion_stream_generator", _chat_stream)
