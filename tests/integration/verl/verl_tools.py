"""A multi-turn workload for verl's own ``ToolAgentLoop`` with the tiny model (test data, loaded by
verl from ``actor_rollout_ref.rollout.multi_turn.function_tool_path``, its extension point).

The tiny model writes no tool calls, so the tool parser registered here (``multi_turn.format:
replay_test``, verl's ``ToolParser.register``) reads one from every assistant turn, and stops
generation at the ids :data:`STOP_EVERY` divides (``stop_token_ids``, which ``ToolAgentLoop``
injects into the sampling params), so each turn is a few tokens long. ``ToolAgentLoop`` then runs
the tool, merges its response into the context (``response_mask`` 0) with verl's continuous-token
builder for Qwen3, and generates again, up to ``max_assistant_turns``.
"""

from __future__ import annotations

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.function_tool import function_tool

STOP_EVERY = 4
FORMAT = "replay_test"


@function_tool
def lookup(query: str) -> str:
    """Look a word up.

    Args:
        query: the word.
    """
    return "experts route tokens"


@ToolParser.register(FORMAT)
class AlwaysCallsLookup(ToolParser):
    @property
    def stop_token_ids(self) -> list[int]:
        return [i for i in range(8, len(self.tokenizer)) if i % STOP_EVERY == 0]

    async def extract_tool_calls(self, responses_ids, tools=None):
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        return text, [FunctionCall(name="lookup", arguments='{"query": "moe"}')]
