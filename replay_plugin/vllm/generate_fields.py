"""Patch ``vllm.generate_fields``: ``/inference/v1/generate`` (token in, token out) returns the
sampler support of opted-in requests, in vLLM's own ``sampling_mask`` field.

Gap (vLLM 0.30-0.34): the endpoint RL frameworks use has a ``sampling_mask`` field (per
generated token, the list of token ids the sampler could draw) but fills it only on Model Runner
V2 (GPU) with ``--return-sampling-mask``; on the V1 runner and on CPU it is null, and a
``sampling_params.extra_args.replay_sample_support`` request got nothing (streamed or not; 0.30
does not even stream the field). For an opted-in request each choice (each chunk, streamed) gets
``sampling_mask`` in vLLM's format (ids ascending) where vLLM did not fill it, so clients written
for Model Runner V2 work unchanged, plus the plugin's ``sample_support`` envelopes beside it
(``exact`` says which mask rows are the whole support, ``sampled_logprob`` the rollout logprob)
and ``routed_experts`` as a compact wire envelope (instead of vLLM's base64 ``.npy``), as on the
OpenAI endpoints. Remove when the native mask works on every runner the supported versions use.

vLLM 0.24 serves the endpoint from ``vllm.entrypoints.serve.disagg.serving`` (0.25 moved it to
``vllm.entrypoints.scale_out.token_in_token_out``; both generators otherwise 0.25's): there this
module runs as ``vllm.generate_fields_disagg`` over those targets, and this patch is retired.

vLLM 0.33 added ``output_mode: "derender"`` (the choices as chat messages, parsed by the server's
reasoning and tool parsers) and 0.34 streams it. When a parser hides the reasoning
(``parse_context.include_reasoning: false``), vLLM withholds ``token_ids``, ``logprobs`` and
``sampling_mask`` of every choice (each chunk, streamed: ``ChatStreamProcessor.hide_metadata``),
because they would reveal the hidden tokens; replay data would reveal them just the same (its
rows name every sampled token), and without it the trainer cannot replay the sample. So such an
opted-in request is refused before compute (HTTP 400 naming ``include_reasoning``) instead of
filling the mask vLLM withheld (what the patch would have done: it fills ``sampling_mask`` where
vLLM left it empty). A derender request whose reasoning is shown gets its fields as the other
modes do, streamed or not. The rest of both generators changed around what the patch reads
(0.33: response fields built by a helper, the derender choices; 0.34: the logprob settings
helper, one chunk class per output mode, an error closes the result generator): each choice and
chunk is still built from the engine outputs the patch taps, with the choice ``index``.

Streamed with ``n > 1``: vLLM 0.30 (and 0.31) sizes its per-choice token counts by the first
engine output's choices and fails mid-stream (an error event, then ``[DONE]``) once a later
choice arrives; 0.32 sizes them by ``n``. Where the installed generator has that bug, an
opted-in streamed request with ``n > 1`` is refused (HTTP 400 naming ``n``) before compute
instead of streaming an error and, before this check, replay rows of choices that never got a
chunk. Whatever the version, rows still pending when a stream reports an error are dropped
(``served_stream``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from ..core.routes import compact
from ..core.wire import encode_array
from ..patcher import Patcher
from . import options
from .client import ROUTES_FIELD, SUPPORT_FIELD
from .openai_fields import _rebuild, _replay_model
from .refusal import refusal
from .sample_support_capture import sample_support
from .served_stream import (
    MASK_FIELD,
    StreamReplay,
    encode_support,
    get_arg,
    native_mask,
    replace_arg,
)

log = logging.getLogger("replay_plugin")


def _wants(request: Any) -> tuple[bool, bool]:
    """(replay data at all, routes) for a ``GenerateRequest``."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    try:
        routes = options.wants_routes(extra)
        return options.wants_support(extra) or routes, routes
    except options.OptionError:
        return False, False  # refused by the admission before any output exists


def _choice_fields(output: Any, choice: Any, routes_wanted: bool) -> dict:
    fields: dict[str, Any] = {}
    rows = sample_support(output)
    if rows is not None:
        fields[SUPPORT_FIELD] = encode_support(rows)
        if getattr(choice, MASK_FIELD, None) is None:
            fields[MASK_FIELD] = native_mask(rows)
    routes = getattr(output, "routed_experts", None)
    if routes is not None and (routes_wanted or rows is not None):
        fields[ROUTES_FIELD] = encode_array(compact(routes))
    return fields


def _refuse_hidden_reasoning(request: Any, hidden: bool) -> None:
    """Refuse a derender request whose reasoning vLLM hides (module docstring)."""
    if hidden:
        raise refusal(
            "replay_plugin: the request asks for replay data on /inference/v1/generate with "
            "output_mode 'derender' while the server's reasoning parser hides the reasoning "
            "(parse_context include_reasoning false): vLLM then withholds the choices' token ids, "
            "logprobs and sampling masks, and replay rows would reveal the hidden tokens just the "
            "same; send include_reasoning true, or output_mode 'tokens' or 'text'",
            "include_reasoning",
            False,
        )


def _optional_arg(args: tuple, kwargs: dict, name: str, position: int) -> Any:
    """An argument with a default (None) that the caller may not pass."""
    return kwargs.get(name) if name in kwargs or len(args) <= position else args[position]


async def _full(wrapped, instance, args, kwargs):
    """``serve_tokens_full_generator``: the last engine output of each choice decorates it.
    Runs before the result generator starts (no compute yet): a derender request whose
    reasoning is hidden is refused here (0.33+: ``derender_request`` is the parsed chat request,
    ``include_reasoning`` as vLLM reads it)."""
    request = get_arg(args, kwargs, "request", 0)
    wanted, routes_wanted = _wants(request)
    if not wanted:
        return await wrapped(*args, **kwargs)
    if getattr(request, "output_mode", None) == "derender":
        chat = _optional_arg(args, kwargs, "derender_request", 5)
        _refuse_hidden_reasoning(request, chat is not None and not getattr(chat, "include_reasoning", True))
    _refuse_lost_choices(request, wrapped)
    last: list[Any] = []

    async def tap(results):
        async for res in results:
            last[:] = [res]
            yield res

    args, kwargs = replace_arg(args, kwargs, "result_generator", 1, tap(get_arg(args, kwargs, "result_generator", 1)))
    response = await wrapped(*args, **kwargs)
    if not last or not getattr(response, "choices", None):
        return response
    try:
        by_index = {o.index: o for o in last[0].outputs}
        fields = [
            _choice_fields(by_index[c.index], c, routes_wanted) if c.index in by_index else {} for c in response.choices
        ]
        if not any(fields):
            return response
        # sampling_mask declared too: GenerateResponseChoice has no such field before vLLM 0.28, and
        # model_construct drops an undeclared one (the mask _choice_fields fills); harmless where it exists
        choice_cls = _replay_model(type(response.choices[0]), routed_experts=Any, sample_support=Any, sampling_mask=Any)
        choices = [_rebuild(c, choice_cls, f) for c, f in zip(response.choices, fields)]
        response_cls = _replay_model(type(response), choices=list[choice_cls])
        return _rebuild(response, response_cls, {"choices": choices})
    except Exception:
        log.exception("replay_plugin: vllm.generate_fields: could not add replay fields to a generate response")
        return response


_source_checks: dict[tuple[Any, str], bool] = {}


def _source_has(method: Any, needle: str, unreadable: bool) -> bool:
    """Whether ``method``'s own source (unwrapped, newlines as spaces) holds ``needle``; cached per
    function; ``unreadable`` when its source cannot be read."""
    function = inspect.unwrap(getattr(method, "__func__", method))
    key = (function, needle)
    if key not in _source_checks:
        try:
            _source_checks[key] = needle in inspect.getsource(function).replace("\n", " ")
        except (OSError, TypeError):
            _source_checks[key] = unreadable
    return _source_checks[key]


def _streams_one_choice(generator: Any) -> bool:
    """Whether vLLM's stream generator counts tokens per choice in a list sized by the first
    engine output's choices (0.30: ``[0] * len(res.outputs)``; 0.32: ``[0] * sampling_params.n``):
    then a later choice raises ``IndexError`` inside the stream. Unreadable source counts as
    having the bug (a refusal with a fix, never a broken stream)."""
    return _source_has(generator, "[0] * len(res.outputs)", unreadable=True)


def _unstreamed_keeps_every_choice(generator: Any) -> bool:
    """Whether a non-streamed request with ``n > 1`` gets every choice back: vLLM 0.29+'s
    ``serve_tokens`` asks the engine for ``FINAL_ONLY`` outputs (all choices in one); 0.24-0.28
    leave the default ``CUMULATIVE``, where each engine output holds one choice, and
    ``serve_tokens_full_generator`` builds the response from the last output only: one choice of
    ``n`` (stock vLLM, with or without the plugin). Unreadable source counts as losing them."""
    owner = getattr(getattr(generator, "__self__", None), "serve_tokens", None)
    return owner is not None and _source_has(owner, "FINAL_ONLY", unreadable=False)


def _refuse_lost_choices(request: Any, generator: Any) -> None:
    """An unstreamed ``n > 1`` request where vLLM answers with one choice of ``n`` (0.24-0.28,
    :func:`_unstreamed_keeps_every_choice`): stock vLLM drops the other samples silently; asked
    for replay data, refused before compute naming ``n`` (the caller would train on a batch
    missing samples it asked for)."""
    n = getattr(getattr(request, "sampling_params", None), "n", 1)
    if isinstance(n, int) and n > 1 and not _unstreamed_keeps_every_choice(generator):
        import vllm

        raise refusal(
            f"replay_plugin: the request asks for replay data with sampling_params.n={n} on an "
            f"unstreamed /inference/v1/generate, where vLLM {vllm.__version__} returns only one of the "
            f"{n} choices (its serve_tokens leaves the engine's outputs CUMULATIVE, one choice each; "
            "vLLM 0.29+ asks for FINAL_ONLY); send n=1 (one request per sample), or run vLLM 0.29+",
            "n",
            n,
        )


def _refuse_many_choices(request: Any, generator: Any) -> None:
    n = getattr(getattr(request, "sampling_params", None), "n", 1)
    if isinstance(n, int) and n > 1 and _streams_one_choice(generator):
        import vllm

        # vLLM 0.24-0.28 return one choice of n unstreamed (see _unstreamed_keeps_every_choice):
        # there "stream": false is no fix
        unstreamed = ' or "stream": false' if _unstreamed_keeps_every_choice(generator) else ""
        raise refusal(
            f"replay_plugin: the request asks for replay data with sampling_params.n={n} on a "
            f"streamed /inference/v1/generate, which vLLM {vllm.__version__} cannot stream for more "
            "than one choice (it fails mid-stream once the second choice arrives); send n=1 (one "
            f"request per sample){unstreamed}",
            "n",
            n,
        )


def _stream(wrapped, instance, args, kwargs):
    """``serve_tokens_stream_generator``: fields per chunk (``served_stream``); ``n > 1`` refused
    where vLLM cannot stream it (module docstring). Called by ``serve_tokens`` before the engine
    sees the request (the result generator has not started), so a refusal costs no compute."""
    request = get_arg(args, kwargs, "request", 0)
    wanted, routes_wanted = _wants(request)
    if not wanted:
        return wrapped(*args, **kwargs)
    _refuse_many_choices(request, wrapped)
    processors = _optional_arg(args, kwargs, "processors", 5)  # 0.34: streamed derender
    _refuse_hidden_reasoning(request, any(getattr(p, "hide_metadata", False) for p in processors or ()))
    replay = StreamReplay(lambda res: [(o.index, o) for o in res.outputs], routes_wanted, mask=True)
    results = get_arg(args, kwargs, "result_generator", 1)
    args, kwargs = replace_arg(args, kwargs, "result_generator", 1, replay.tap(results))
    return replay.decorate(wrapped(*args, **kwargs))


def install(patcher: Patcher) -> None:
    patcher.wrap("ServingTokens.serve_tokens_full_generator", _full)
    patcher.wrap("ServingTokens.serve_tokens_stream_generator", _stream)
