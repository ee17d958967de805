"""The engine stand-in a framework's rollout server gets in place of its vLLM ``AsyncLLM`` (verl's
``vLLMHttpServer``, SkyRL's server actor): the real engine for everything, except that
``generate`` keeps the last output of the request the framework's handler is answering, so the
handler can read that output's support rows after the framework has turned it into its own
response (which keeps no such field). And the one ``max_logprobs`` fitting both servers' engine
arguments share.

Imports neither vllm nor numpy: the framework packs load in every process that imports them.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any


class OutputSlot:
    """One request a handler answers: its engine output, once the engine has yielded it."""

    __slots__ = ("output",)

    def __init__(self) -> None:
        self.output: Any = None


class OutputKeepingEngine:
    """``engine`` with ``generate`` keeping, for a request answered with an :class:`OutputSlot` in
    ``current`` while ``active()`` holds, its last output in that slot. ``select(sampling_params)``
    decides per call: True keeps the output (it may first opt the request in by changing its
    ``extra_args``: SkyRL's marked requests), False leaves the request alone (verl: requests that
    did not opt in)."""

    def __init__(
        self,
        engine: Any,
        current: contextvars.ContextVar[OutputSlot | None],
        active: Callable[[], bool],
        select: Callable[[Any], bool],
    ) -> None:
        self._replay_plugin_engine = engine
        self._replay_plugin_hooks = (current, active, select)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._replay_plugin_engine, name)

    async def generate(self, *args: Any, **kwargs: Any):
        current, active, select = self._replay_plugin_hooks
        slot = current.get() if active() else None
        params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        if slot is not None and not select(params):
            slot = None
        async for output in self._replay_plugin_engine.generate(*args, **kwargs):
            if slot is not None:
                slot.output = output
            yield output


def fitted_max_logprobs(current: Any, width: int) -> int | None:
    """The ``max_logprobs`` an engine needs to return rows ``width`` wide, or None when ``current``
    already allows them: ``-1`` (no limit) or at least ``width``. Unset (None) is set explicitly
    (vLLM's default, 20 in 0.28-0.34, is not relied on); 0 allows none. Never lowers a value."""
    if current is None:
        return width
    value = int(current)
    if value == -1 or value >= width:
        return None
    return width
