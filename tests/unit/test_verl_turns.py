"""replay_plugin.verl.turns: a trajectory's generate calls aligned with verl's response token by
token (pure numpy; the layouts are those verl 0.9.1's continuous-token merges produce)."""

from __future__ import annotations

import numpy as np
import pytest

from replay_plugin.core.errors import ReplayDataError
from replay_plugin.verl import turns as T


def _rows(ids, width=3):
    """A distinct row per token: the token first, then two ids derived from it."""
    return np.array([[t, 100 + t, 200 + t][:width] for t in ids], dtype=np.int32)


def test_single_turn_and_padding():
    gen = [5, 6, 7]
    out = T.align([5, 6, 7, 0, 0], [1, 1, 1, 0, 0], [T.turn(gen, _rows(gen))], width=3)
    assert out.dtype == np.int32 and out.shape == (5, 3)
    assert (out[:3] == _rows(gen)).all() and (out[3:] == -1).all()


def test_two_turns_with_context_between_and_a_trimmed_tail():
    # turn 1 = [5, 6, 9] whose last token the context merge removed, context [40, 41] (mask 0),
    # turn 2 = [7, 8]; the response is cut at 6 tokens (response_length)
    t1, t2 = [5, 6, 9], [7, 8]
    out = T.align([5, 6, 40, 41, 7, 8], [1, 1, 0, 0, 1, 1], [T.turn(t1, _rows(t1)), T.turn(t2, _rows(t2))], width=3)
    assert (out[0] == _rows([5])[0]).all() and (out[1] == _rows([6])[0]).all()
    assert (out[2:4] == -1).all()
    assert (out[4:] == _rows(t2)).all()


def test_resumed_attempts_fill_one_run_and_a_final_cut():
    # a partial rollout resumed twice: three generate calls, one run of mask 1; the last call's
    # tokens are cut at response_length
    a, b, c = [5, 6], [7], [8, 9, 10]
    out = T.align([5, 6, 7, 8, 9], [1] * 5, [T.turn(a, _rows(a)), T.turn(b, _rows(b)), T.turn(c, _rows(c))], width=3)
    assert (out == _rows([5, 6, 7, 8, 9])).all()


def test_uncaptured_turn_gets_padding_and_wider_rows_widen_the_result():
    greedy, sampled = [5, 6], [7]
    out = T.align(
        [5, 6, 1, 7], [1, 1, 0, 1], [T.turn(greedy, None), T.turn(sampled, np.array([[7, 3, 4, 2]], np.int32))], width=2
    )
    assert out.shape == (4, 4)
    assert (out[:3] == -1).all() and (out[3] == [7, 3, 4, 2]).all()


@pytest.mark.parametrize(
    "response, mask, calls, token",
    [
        ([5, 6, 7], [1, 1, 1], [[5, 6]], 2),  # more generated tokens than the calls returned
        ([5, 8, 7], [1, 1, 1], [[5, 6, 7]], 1),  # a different id where the call returned another
        ([5, 6, 0, 9], [1, 1, 0, 1], [[5, 6, 7]], 3),  # a run after the only call was consumed
    ],
)
def test_tokens_that_cannot_be_placed_are_refused_naming_the_position(response, mask, calls, token):
    with pytest.raises(ReplayDataError) as info:
        T.align(response, mask, [T.turn(c, _rows(c)) for c in calls], width=3, trajectory=4)
    assert info.value.field == "rollout_sample_support"
    assert info.value.token == token and info.value.trajectory == 4


def test_rows_not_matching_their_tokens_are_refused():
    with pytest.raises(ReplayDataError, match="rows of shape"):
        T.turn([5, 6], np.zeros((3, 2), np.int32))
    with pytest.raises(ReplayDataError, match="rows of shape"):
        T.turn([5, 6], np.zeros((2, 2), np.float32))
    with pytest.raises(ReplayDataError, match="response_mask"):
        T.align([5, 6], [1], [], width=2)
