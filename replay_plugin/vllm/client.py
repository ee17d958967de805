"""Client side of the vLLM replay data: read it from offline outputs and served responses.

Pure (numpy and ``core``): a rollout client that talks to ``vllm serve`` needs no vLLM install.

Offline (``LLM.generate`` / ``AsyncLLM``)::

    out = llm.generate(prompts, SamplingParams(top_k=20, temperature=1.0,
                                              extra_args={"replay_sample_support": True}))
    rows = support_of(out[0].outputs[0])          # core.support.SupportRows
    routes = out[0].outputs[0].routed_experts      # compact ndarray (enable_return_routed_experts)

Served (``POST /v1/completions``, ``/v1/chat/completions`` with
``"vllm_xargs": {"replay_sample_support": 1}``, or ``/inference/v1/generate`` with
``"sampling_params": {"extra_args": {"replay_sample_support": true}}``)::

    choice = response.json()["choices"][0]
    replay = decode_choice(choice)                 # ChoiceReplay(support=SupportRows, routed_experts=ndarray)
    replay = decode_stream(chunks)[0]              # streamed: the parsed ``data:`` objects, in order

A request that asked for replay data and got none raises ``ReplayDataMissing`` (the plugin did
not run where it was served); pass ``required=False`` / ``require_support=False`` for requests
that did not ask.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import ReplayDataError, ReplayTypeError
from ..core.routes import ROUTE_DTYPES
from ..core.support import SupportRows
from ..core.wire import decode_array

#: The ``CompletionOutput`` attribute and the served choice key of the support rows (and of the routes):
#: defined here only; the capture and the served fields import them.
SUPPORT_FIELD = "sample_support"
ROUTES_FIELD = "routed_experts"
#: The ``CompletionOutput`` attribute with the reason the engine core refused the request.
REFUSED_FIELD = "_replay_plugin_refused"

_CHECK = (
    "the replay plugin did not run where the request was served (not installed there, "
    "REPLAY_PLUGIN_DISABLE=1, VLLM_PLUGINS excluding replay_plugin where .pth files are not "
    "processed, or a vLLM it does not patch): run `replay-plugin status --import vllm` and "
    "`replay-plugin doctor` in the serving environment"
)


class ReplayDataMissing(ReplayDataError):
    """A request asked for replay data and its output or response carries none."""


def support_of(output: Any, *, required: bool = True) -> SupportRows | None:
    """The support rows on a vLLM ``CompletionOutput``.

    Raises ``ReplayDataMissing`` when there are none (the plugin did not run, or the engine
    core refused the request: the message says which and how to check); with
    ``required=False`` returns None instead (for requests that did not ask).
    """
    state = getattr(output, "__dict__", {})
    refused = state.get(REFUSED_FIELD)
    if refused:
        raise ReplayDataMissing(SUPPORT_FIELD, f"the engine refused the request: {refused}")
    rows = state.get(SUPPORT_FIELD)
    if isinstance(rows, SupportRows):
        return rows
    if not required:
        return None
    raise ReplayDataMissing(
        SUPPORT_FIELD, f"the output carries no support rows although the request asked for them: {_CHECK}"
    )


def support_for(output: Any, sampled: Any, field: str = SUPPORT_FIELD) -> SupportRows:
    """The support rows on a vLLM ``CompletionOutput`` checked against the token ids the caller
    hands on (a framework's response tokens): one row per token, captured for that token, with a
    finite sampled logprob. Whether each row is exact is the caller's policy (``rows.exact``).

    Raises:
        ReplayDataMissing: no rows on the output (``support_of``).
        ReplayDataError: rows for another number of tokens or for other tokens, a sampled
            logprob that is not finite; naming ``field`` (and the token).
    """
    rows = support_of(output)
    assert rows is not None
    ids = np.asarray(sampled, dtype=np.int64).reshape(-1)
    if len(rows) != len(ids) or not np.array_equal(rows.sampled.astype(np.int64), ids):
        raise ReplayDataError(
            field,
            f"{len(rows)} captured rows for {len(ids)} generated tokens, or rows captured for other tokens",
            expected="one row per generated token, for the token vLLM returned",
        )
    finite = np.isfinite(rows.sampled_logprob)
    if not finite.all():
        bad = int(np.argmax(~finite))
        raise ReplayDataError(field, "the sampled token's logprob is not finite", token=bad, expected="finite")
    return rows


class ChoiceReplay(NamedTuple):
    """Replay data of one served choice; a field is None when the response does not carry it."""

    support: SupportRows | None
    routed_experts: np.ndarray | None


def decode_support(doc: Mapping[str, Any]) -> SupportRows:
    """The ``sample_support`` document of a served choice -> ``SupportRows`` (validated)."""
    if not isinstance(doc, Mapping):
        raise ReplayTypeError(SUPPORT_FIELD, f"got {type(doc).__name__}", expected="an object of wire envelopes")
    missing = {"ids", "sampled", "sampled_logprob", "exact"} - set(doc)
    if missing:
        raise ReplayDataError(
            SUPPORT_FIELD, f"lacks {sorted(missing)}", expected="keys ids, sampled, sampled_logprob, exact"
        )
    return SupportRows(
        ids=decode_array(doc["ids"], dtypes=("int32",), ndim=2),
        sampled=decode_array(doc["sampled"], dtypes=("int32",), ndim=1),
        sampled_logprob=decode_array(doc["sampled_logprob"], dtypes=("float32",), ndim=1),
        exact=decode_array(doc["exact"], dtypes=("bool",), ndim=1),
    )


def decode_routes(doc: Mapping[str, Any]) -> np.ndarray:
    """A served ``routed_experts`` wire document -> ``[tokens, layers, topk]`` compact array."""
    if isinstance(doc, str):
        raise ReplayTypeError(
            ROUTES_FIELD,
            "is vLLM's base64 .npy string: the request did not opt in (send "
            "vllm_xargs replay_routed_experts) or the plugin's vllm.openai_fields patch is off",
            expected="a wire envelope",
        )
    return decode_array(doc, dtypes=tuple(d.name for d in ROUTE_DTYPES), ndim=3)


def decode_choice(choice: Mapping[str, Any], *, require_support: bool = True) -> ChoiceReplay:
    """Replay data of one served choice (a parsed JSON object).

    Raises ``ReplayDataMissing`` when the choice has no ``sample_support`` (the server's plugin
    did not capture it; the message says how to check) unless ``require_support=False``.
    """
    support = choice.get(SUPPORT_FIELD)
    if support is None and require_support:
        raise ReplayDataMissing(
            SUPPORT_FIELD, f"the served choice carries no support rows although the request asked for them: {_CHECK}"
        )
    routes = choice.get(ROUTES_FIELD)
    return ChoiceReplay(
        support=decode_support(support) if support is not None else None,
        routed_experts=decode_routes(routes) if routes is not None else None,
    )


def decode_stream(chunks: Iterable[Mapping[str, Any]], *, require_support: bool = True) -> dict[int, ChoiceReplay]:
    """Replay data of a streamed response, per choice index: the support rows of all its chunks
    concatenated in order (equal to the rows of the same request unstreamed) and its routes.

    ``chunks`` are the parsed JSON objects of the ``data:`` events, in order (the ``[DONE]``
    marker and error events excluded). In a stream whose chunks carry ``token_ids`` (completions
    and chats with ``return_token_ids``, ``/inference/v1/generate``), every chunk that carries
    rows must carry as many token ids as rows, and the rows' sampled ids must be those
    tokens (``ReplayDataError`` naming the choice and the chunk otherwise: rows without their
    tokens are rows of tokens the client never got). A choice without rows raises
    ``ReplayDataMissing`` unless ``require_support=False``.
    """
    parts: dict[int, list[SupportRows]] = {}
    routes: dict[int, np.ndarray] = {}
    tokens: dict[int, int] = {}
    seen: list[int] = []
    unchecked: list[tuple[int, int, int]] = []  # (choice, chunk, rows) of chunks without token_ids
    for number, chunk in enumerate(chunks):
        for choice in chunk.get("choices") or ():
            index = int(choice.get("index", 0))
            if index not in seen:
                seen.append(index)
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                tokens[index] = tokens.get(index, 0) + len(ids)
            if choice.get(SUPPORT_FIELD) is not None:
                chunk_rows = decode_support(choice[SUPPORT_FIELD])
                if isinstance(ids, list):
                    _check_chunk_rows(chunk_rows, ids, index, number)
                else:
                    unchecked.append((index, number, len(chunk_rows)))
                parts.setdefault(index, []).append(chunk_rows)
            if choice.get(ROUTES_FIELD) is not None:
                routes[index] = decode_routes(choice[ROUTES_FIELD])
    for index, number, count in unchecked:
        if tokens:  # the stream carries token ids, this chunk does not
            raise ReplayDataError(
                SUPPORT_FIELD,
                f"streamed choice {index}, chunk {number} carries {count} support rows and no "
                "token_ids (rows of tokens the stream did not deliver: did the stream end with an error?)",
                trajectory=index,
                expected="token_ids beside the rows, one row per token",
            )
    out = {}
    for index in seen:
        if index not in parts and require_support:
            raise ReplayDataMissing(
                SUPPORT_FIELD,
                f"streamed choice {index} carries no support rows although the request asked for them: {_CHECK}",
            )
        rows = SupportRows.concat(parts[index]) if index in parts else None
        if rows is not None and index in tokens and tokens[index] != len(rows):
            raise ReplayDataError(
                SUPPORT_FIELD,
                f"streamed choice {index} has {len(rows)} support rows for {tokens[index]} tokens",
                expected="one row per generated token",
            )
        out[index] = ChoiceReplay(support=rows, routed_experts=routes.get(index))
    return out


def _check_chunk_rows(rows: SupportRows, ids: list, index: int, number: int) -> None:
    """One chunk's rows against its own ``token_ids``."""
    if len(rows) != len(ids):
        raise ReplayDataError(
            SUPPORT_FIELD,
            f"streamed choice {index}, chunk {number} carries {len(rows)} support rows for {len(ids)} token_ids",
            trajectory=index,
            expected="one row per token of the chunk",
        )
    try:
        same = bool(np.array_equal(rows.sampled, np.asarray(ids, dtype=np.int64)))
    except (TypeError, ValueError, OverflowError):
        same = False
    if not same:
        raise ReplayDataError(
            SUPPORT_FIELD,
            f"streamed choice {index}, chunk {number}: the rows' sampled ids {rows.sampled.tolist()[:8]} "
            f"are not the chunk's token_ids {list(ids)[:8]}",
            trajectory=index,
            expected="the rows of the chunk's own tokens, in order",
        )
