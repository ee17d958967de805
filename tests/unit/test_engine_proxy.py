"""The engine stand-in verl's and SkyRL's rollout servers get, and their shared max_logprobs fitting
(``replay_plugin.vllm.engine_proxy``): pure Python, a stand-in engine of the test's own."""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace

import pytest

from replay_plugin.vllm.engine_proxy import OutputKeepingEngine, OutputSlot, fitted_max_logprobs


@pytest.mark.parametrize(
    ("current", "width", "fitted"),
    [
        (None, 36, 36),  # unset: set explicitly
        (None, 20, 20),  # even where vLLM's default (20) would do
        (-1, 36, None),  # no limit: never lowered (SkyRL's fitting lowered it to W before)
        ("-1", 36, None),
        (0, 36, 36),
        (35, 36, 36),
        (36, 36, None),
        (100, 36, None),  # never lowered
    ],
)
def test_fitted_max_logprobs(current, width, fitted):
    assert fitted_max_logprobs(current, width) == fitted


class _Engine:
    model_config = "the engine's"

    def __init__(self):
        self.calls = []

    async def generate(self, prompt, sampling_params, request_id=None):
        self.calls.append((prompt, sampling_params, request_id))
        for i in range(3):
            yield f"{prompt}-{i}"


def _run(engine, slot, *args, **kwargs):
    current: contextvars.ContextVar = contextvars.ContextVar("t", default=None)

    async def go():
        token = current.set(slot)
        try:
            return [o async for o in engine(current).generate(*args, **kwargs)]
        finally:
            current.reset(token)

    return asyncio.run(go())


def test_keeps_the_last_output_of_a_selected_request_only():
    real = _Engine()
    params = SimpleNamespace(extra_args=None)

    def make(select, active=True):
        return lambda current: OutputKeepingEngine(real, current, lambda: active, select)

    slot = OutputSlot()
    assert _run(make(lambda p: True), slot, "a", params) == ["a-0", "a-1", "a-2"]  # outputs unchanged
    assert slot.output == "a-2"
    slot = OutputSlot()
    _run(make(lambda p: False), slot, "b", sampling_params=params, request_id="r")
    assert slot.output is None and real.calls[-1] == ("b", params, "r")
    slot = OutputSlot()
    _run(make(lambda p: True, active=False), slot, "c", params)  # reverted patch: nothing kept
    assert slot.output is None
    _run(make(lambda p: pytest.fail("select is not asked without a slot")), None, "d", params)


def test_select_may_opt_the_request_in_and_attributes_are_the_engines():
    real = _Engine()
    params = SimpleNamespace(extra_args={"user": 1})

    def opt_in(p):
        p.extra_args = {**(p.extra_args or {}), "replay_sample_support": True}
        return True

    slot = OutputSlot()
    _run(lambda current: OutputKeepingEngine(real, current, lambda: True, opt_in), slot, "e", params)
    assert real.calls[-1][1].extra_args == {"user": 1, "replay_sample_support": True}
    assert slot.output == "e-2"
    proxy = OutputKeepingEngine(real, contextvars.ContextVar("u", default=None), lambda: True, opt_in)
    assert proxy.model_config == "the engine's"
