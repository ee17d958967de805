"""Multi-turn traces: accumulation equals the single-shot array; misuse raises clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.routes import TrajectoryRoutes
from replay_plugin.core.trace import RoutedExpertTrace, TokenMetadataTrace

L, K = 3, 2


def _truth(tokens: int, seed: int = 0, high: int = 64) -> np.ndarray:
    """Engine routes of every token position (what a single full prefill would return)."""
    return np.random.default_rng(seed).integers(0, high, (tokens, L, K)).astype(np.uint8)


# ---------------------------------------------------------------------------------------
# TokenMetadataTrace


def test_token_metadata_trace_concatenates_turns() -> None:
    rows = np.arange(30, dtype=np.int32).reshape(10, 3)
    trace = TokenMetadataTrace("support", trajectory=2)
    trace.append(rows[:4], expected_rows=4)
    trace.append(rows[4:4], expected_rows=0)
    trace.append(rows[4:][::1].copy(order="F"), expected_rows=6)
    assert trace.num_rows == 10
    assert np.array_equal(trace.finalize(expected_rows=10), rows)
    assert trace.finalized


def test_token_metadata_trace_copies_on_append() -> None:
    rows = np.zeros((2, 2), np.int32)
    trace = TokenMetadataTrace()
    trace.append(rows, expected_rows=2)
    rows[:] = 5
    assert (trace.finalize(expected_rows=2) == 0).all()


def test_token_metadata_trace_misuse() -> None:
    trace = TokenMetadataTrace("support", trajectory=3)
    with pytest.raises(ReplayDataError, match="nothing was appended"):
        trace.finalize(expected_rows=0)
    with pytest.raises(ReplayTypeError, match="numpy array"):
        trace.append([[1, 2]], expected_rows=1)
    with pytest.raises(ReplayDataError, match="0-d"):
        trace.append(np.array(1), expected_rows=1)
    trace.append(np.zeros((2, 4), np.int32), expected_rows=2)
    with pytest.raises(ReplayDataError) as info:
        trace.append(np.zeros((3, 4), np.int32), expected_rows=2)
    assert (info.value.field, info.value.trajectory, info.value.token) == ("support", 3, 2)
    with pytest.raises(ReplayDataError, match="row shape"):
        trace.append(np.zeros((1, 5), np.int32), expected_rows=1)
    with pytest.raises(ReplayTypeError, match="dtype int64"):
        trace.append(np.zeros((1, 4), np.int64), expected_rows=1)
    with pytest.raises(ReplayTypeError):
        trace.append(np.zeros((1, 4), np.int32), expected_rows=True)
    with pytest.raises(ReplayDataError, match="expected_rows"):
        trace.append(np.zeros((0, 4), np.int32), expected_rows=-1)
    with pytest.raises(ReplayDataError, match="2 rows in total"):
        trace.finalize(expected_rows=3)
    trace.finalize(expected_rows=2)
    with pytest.raises(RuntimeError, match="after finalize"):
        trace.finalize(expected_rows=2)
    with pytest.raises(RuntimeError, match="after finalize"):
        trace.append(np.zeros((1, 4), np.int32), expected_rows=1)


def test_token_metadata_trace_promotes_when_asked() -> None:
    trace = TokenMetadataTrace(promote_dtypes=True)
    trace.append(np.ones((1, 2), np.uint8), expected_rows=1)
    trace.append(np.full((1, 2), 300, np.int16), expected_rows=1)
    out = trace.finalize(expected_rows=2)
    assert out.dtype == np.int16 and out.tolist() == [[1, 1], [300, 300]]


# ---------------------------------------------------------------------------------------
# RoutedExpertTrace


@st.composite
def conversations(draw):
    """Turns of (prompt growth, generated count): prompt_i = history + observation tokens."""
    turns = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 5)), min_size=1, max_size=5))
    first_prompt = draw(st.integers(1, 6))
    return first_prompt, turns


@settings(max_examples=200, deadline=None, database=None)
@given(conversations(), st.integers(0, 2**31))
def test_multi_turn_accumulation_equals_single_shot(conversation, seed) -> None:
    first_prompt, turns = conversation
    history = first_prompt
    total = first_prompt + sum(obs + gen for obs, gen in turns)
    truth = _truth(total, seed)
    trace = RoutedExpertTrace(trajectory=0)
    for i, (observation, generated) in enumerate(turns):
        prompt = history + (observation if i else 0)
        start = trace.prompt_start
        # The engine routes prompt[start:] + generated[:-1].
        trace.record_generation(
            prompt_token_count=prompt,
            generated_token_count=generated,
            routed_experts=truth[start : prompt + generated - 1],
        )
        history = prompt + generated
        assert trace.prompt_start == history - 1
    token_count = history
    single = RoutedExpertTrace()
    single.record_generation(
        prompt_token_count=token_count - 1, generated_token_count=1, routed_experts=truth[: token_count - 1]
    )
    loss = np.zeros(token_count, dtype=bool)
    loss[first_prompt:] = True  # every response token is loss-bearing: all sources captured
    multi = trace.finalize(token_count, loss)
    one = single.finalize(token_count, loss)
    assert np.array_equal(multi.routes, one.routes) and np.array_equal(
        multi.router_padding_mask, one.router_padding_mask
    )
    assert np.array_equal(multi.routes[: token_count - 1], truth[: token_count - 1])
    assert multi.router_padding_mask.tolist() == [False] * (token_count - 1) + [True]


def test_dtype_widens_across_turns() -> None:
    trace = RoutedExpertTrace()
    trace.record_generation(prompt_token_count=2, generated_token_count=1, routed_experts=_truth(2))
    wide = np.full((2, L, K), 1000)
    trace.record_generation(prompt_token_count=4, generated_token_count=1, routed_experts=wide)
    out = trace.finalize(5, [0, 0, 1, 1, 1])
    assert out.routes.dtype == np.int16
    assert out.routes[2:4].tolist() == wide.tolist()


def test_uncaptured_suffix_without_loss_is_padded() -> None:
    trace = RoutedExpertTrace()
    trace.record_generation(prompt_token_count=3, generated_token_count=2, routed_experts=_truth(4))
    # Observation tokens appended after the last turn carry no loss.
    out = trace.finalize(7, torch.tensor([0, 0, 0, 1, 1, 0, 0]))
    assert isinstance(out, TrajectoryRoutes)
    assert out.router_padding_mask.tolist() == [False] * 4 + [True] * 3
    assert (out.routes[4:] == np.arange(K)).all()
    assert out.captured_rows == 4


def test_loss_bearing_target_without_route_raises_naming_it() -> None:
    trace = RoutedExpertTrace(trajectory=5)
    trace.record_generation(prompt_token_count=3, generated_token_count=2, routed_experts=_truth(4))
    with pytest.raises(ReplayDataError, match="target token 6") as info:
        trace.finalize(7, [0, 0, 0, 1, 1, 0, 1])
    assert (info.value.trajectory, info.value.token) == (5, 6)
    # The trace is still usable after the error.
    assert trace.finalize(7, [0, 0, 0, 1, 1, 0, 0]).captured_rows == 4


def test_synthetic_eos_is_routed_by_the_trainer_not_a_dummy_replay() -> None:
    trace = RoutedExpertTrace()
    trace.record_generation(prompt_token_count=3, generated_token_count=2, routed_experts=_truth(4))
    loss = [0, 0, 0, 1, 1, 1]  # token 5 is an EOS appended after the engine returned
    with pytest.raises(ReplayDataError, match="synthetic_eos=True"):
        trace.finalize(6, loss)
    out = trace.finalize(6, loss, synthetic_eos=True)
    # Source of the EOS (token 4) has no route: padding row, and True = the trainer routes it.
    assert out.router_padding_mask.tolist() == [False] * 4 + [True, True]
    assert (out.routes[4] == np.arange(K)).all()


def test_synthetic_eos_declaration_is_checked() -> None:
    trace = RoutedExpertTrace(trajectory=1)
    trace.record_generation(prompt_token_count=3, generated_token_count=2, routed_experts=_truth(4))
    # 5 tokens: the last token is the engine's own last generated token, its source is routed.
    with pytest.raises(ReplayDataError, match="synthetic_eos") as info:
        trace.finalize(5, [0, 0, 0, 1, 1], synthetic_eos=True)
    assert info.value.token == 4
    # Other uncaptured loss-bearing targets still raise with a declared EOS.
    with pytest.raises(ReplayDataError, match="target token 5"):
        trace.finalize(7, [0, 0, 0, 1, 1, 1, 1], synthetic_eos=True)
    with pytest.raises(ReplayTypeError):
        trace.finalize(6, [0, 0, 0, 1, 1, 1], synthetic_eos=1)


def test_routed_expert_trace_misuse() -> None:
    trace = RoutedExpertTrace(trajectory=9)
    with pytest.raises(ReplayDataError, match="generated_token_count"):
        trace.record_generation(prompt_token_count=3, generated_token_count=0, routed_experts=_truth(2))
    with pytest.raises(ReplayDataError, match="3 rows") as info:
        trace.record_generation(prompt_token_count=3, generated_token_count=2, routed_experts=_truth(3))
    assert info.value.trajectory == 9
    with pytest.raises(ReplayTypeError):
        trace.record_generation(prompt_token_count=3, generated_token_count=2, routed_experts=_truth(4).tolist())
    trace.record_generation(prompt_token_count=3, generated_token_count=2, routed_experts=_truth(4))
    with pytest.raises(ReplayDataError, match="already routed"):
        trace.record_generation(prompt_token_count=3, generated_token_count=1, routed_experts=_truth(0))
    with pytest.raises(ReplayDataError, match="row shape"):
        trace.record_generation(
            prompt_token_count=6, generated_token_count=1, routed_experts=np.zeros((2, L + 1, K), np.uint8)
        )
    with pytest.raises(ReplayDataError, match="negative"):
        trace.record_generation(
            prompt_token_count=6, generated_token_count=1, routed_experts=-np.ones((2, L, K), np.int64)
        )
    with pytest.raises(ReplayDataError, match="loss_mask"):
        trace.finalize(6, [0, 0, 0, 1, 1])
    with pytest.raises(ReplayDataError, match="value 2") as info:
        trace.finalize(5, [0, 0, 2, 1, 1])
    assert info.value.token == 2
    with pytest.raises(ReplayTypeError, match="loss_mask"):
        trace.finalize(5, ["a", "b", "c", "d", "e"])
    with pytest.raises(ReplayDataError, match="token_count"):
        trace.finalize(3, [0, 0, 0])
    trace.finalize(5, [0, 0, 0, 1, 1])
    with pytest.raises(RuntimeError, match="after finalize"):
        trace.record_generation(prompt_token_count=6, generated_token_count=1, routed_experts=_truth(2))
    with pytest.raises(RuntimeError, match="after finalize"):
        trace.finalize(5, [0, 0, 0, 1, 1])


def test_finalize_without_any_turn() -> None:
    trace = RoutedExpertTrace()
    with pytest.raises(ReplayDataError, match="target token 1"):
        trace.finalize(2, [0, 1])
    with pytest.raises(ReplayDataError, match="nothing was appended"):
        trace.finalize(2, [0, 0])
