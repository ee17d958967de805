"""Replay fields on streamed (server-sent events) responses: shared by ``vllm.openai_fields``
(completions, chat) and ``vllm.generate_fields`` (``/inference/v1/generate``).

vLLM builds each chunk inside its stream generator and yields it as ``data: <json>\\n\\n``; no
hook sits between an engine output and its chunk. So the stream's engine outputs are tapped
(their ``sample_support`` rows and routed experts are kept per choice index) and each chunk the
generator yields for a choice gets the rows that arrived since that choice's previous chunk.
Concatenated over a choice's chunks, the rows are those of the whole request, in order (a chunk
that carries no token, like chat's first role chunk, gets none; rows left when the stream ends
go out in one extra chunk before ``[DONE]``). After an error event nothing more is added: rows
still pending then belong to tokens the client never received (vLLM 0.30's generate stream
failing at a second choice sent that choice's rows in the extra chunk, with no token), so they
are dropped and logged. Only streams of requests that asked for replay data are touched; all
others pass through byte for byte.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import orjson

from ..core.routes import compact
from ..core.support import SupportRows
from ..core.wire import encode_array
from .client import ROUTES_FIELD, SUPPORT_FIELD
from .sample_support_capture import sample_support

log = logging.getLogger("replay_plugin")

MASK_FIELD = "sampling_mask"
_DATA = "data: "
_END = "\n\n"


def encode_support(rows: SupportRows) -> dict:
    """``SupportRows`` -> the ``sample_support`` document of a served choice (four envelopes)."""
    return {
        "ids": encode_array(rows.ids),
        "sampled": encode_array(rows.sampled),
        "sampled_logprob": encode_array(rows.sampled_logprob),
        "exact": encode_array(rows.exact),
    }


def native_mask(rows: SupportRows) -> list[list[int]]:
    """vLLM's ``sampling_mask`` format: per generated token the support's ids, ascending (the
    order Model Runner V2 produces from its bitmask)."""
    ids = np.sort(np.where(rows.ids >= 0, rows.ids, np.iinfo(np.int32).max), axis=1)
    counts = (rows.ids >= 0).sum(axis=1)
    return [row[:c].tolist() for row, c in zip(ids, counts)]


class StreamReplay:
    """The replay data of one streamed request, per choice index, not sent yet.

    ``index_of(item)`` maps one item of vLLM's result generator to ``(request output, choice
    index of output i)`` pairs; ``mask`` adds vLLM's ``sampling_mask`` field (generate endpoint).
    """

    def __init__(self, index_of: Callable[[Any], list[tuple[int, Any]]], routes_wanted: bool, mask: bool) -> None:
        self.index_of = index_of
        self.routes_wanted = routes_wanted
        self.mask = mask
        self.rows: dict[int, list[SupportRows]] = {}
        self.routes: dict[int, Any] = {}
        self.envelope: dict[str, Any] = {}

    async def tap(self, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for item in results:
            try:
                for index, output in self.index_of(item):
                    self._record(index, output)
            except Exception:
                log.exception("replay_plugin: could not read replay data from a streamed output")
            yield item

    def _record(self, index: int, output: Any) -> None:
        rows = sample_support(output)
        if rows is not None and len(rows):
            self.rows.setdefault(index, []).append(rows)
        routes = getattr(output, "routed_experts", None)
        if routes is not None and (self.routes_wanted or rows is not None):
            self.routes[index] = routes

    def fields(self, index: int) -> dict:
        fields: dict[str, Any] = {}
        parts = self.rows.pop(index, None)
        if parts:
            rows = parts[0] if len(parts) == 1 else SupportRows.concat(parts)
            fields[SUPPORT_FIELD] = encode_support(rows)
            if self.mask:
                fields[MASK_FIELD] = native_mask(rows)
        routes = self.routes.pop(index, None)
        if routes is not None:
            fields[ROUTES_FIELD] = encode_array(compact(routes))
        return fields

    def _inject(self, chunk: str, takes_rows: Callable[[dict], bool]) -> str:
        if not (chunk.startswith(_DATA) and chunk.endswith(_END)) or not (self.rows or self.routes):
            return chunk
        payload = chunk[len(_DATA) : -len(_END)]
        if not payload.startswith("{"):
            return chunk
        doc = orjson.loads(payload)
        choices = doc.get("choices") if isinstance(doc, dict) else None
        if not choices:
            return chunk
        for key in ("id", "object", "created", "model", "request_id"):
            if key in doc:
                self.envelope[key] = doc[key]
        changed = False
        for choice in choices:
            index = choice.get("index")
            if index in self.rows or index in self.routes:
                if takes_rows(choice):
                    fields = self.fields(index)
                    if self.mask and MASK_FIELD in fields and choice.get(MASK_FIELD) is not None:
                        del fields[MASK_FIELD]  # vLLM's own mask (Model Runner V2) is kept
                    choice.update(fields)
                    changed = True
        return _DATA + orjson.dumps(doc).decode() + _END if changed else chunk

    async def decorate(
        self, chunks: AsyncIterator[str], takes_rows: Callable[[dict], bool] = lambda choice: True
    ) -> AsyncIterator[str]:
        """``chunks`` with each choice's replay fields on its next chunk that carries tokens."""
        failed = False
        async for chunk in chunks:
            if failed or chunk.startswith(_DATA + '{"error"'):
                if self.rows or self.routes:
                    log.warning(
                        "replay_plugin: the stream reported an error; replay data of choices %s not sent",
                        sorted(set(self.rows) | set(self.routes)),
                    )
                    self.rows.clear()
                    self.routes.clear()
                failed = True
                yield chunk
                continue
            if chunk.startswith(_DATA + "[DONE]") and (self.rows or self.routes):
                for index in sorted(set(self.rows) | set(self.routes)):
                    log.warning("replay_plugin: replay data of choice %d sent in an extra chunk", index)
                    doc = {**self.envelope, "choices": [{"index": index, **self.fields(index)}]}
                    yield _DATA + orjson.dumps(doc).decode() + _END
            try:
                chunk = self._inject(chunk, takes_rows)
            except Exception:
                log.exception("replay_plugin: could not add replay fields to a streamed chunk")
            yield chunk


def replace_arg(args: tuple, kwargs: dict, name: str, position: int, value: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the argument ``name`` (positional index ``position``, self
    excluded) replaced by ``value``."""
    if name in kwargs or len(args) <= position:
        return args, {**kwargs, name: value}
    return (*args[:position], value, *args[position + 1 :]), kwargs


def get_arg(args: tuple, kwargs: dict, name: str, position: int) -> Any:
    return kwargs[name] if name in kwargs else args[position]
