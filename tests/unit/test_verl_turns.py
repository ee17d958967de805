"""replay_plugin.verl.turns: a trajectory's generate calls aligned with verl's response token by
token (pure numpy; the layouts are those verl 0.9.1's continuous-token merges produce)."""

from __future__ import annotations

import numpy as np
import pytest

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
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


# --------------------------------------------------------------------------- hostile inputs (issue 41, F8)


@pytest.mark.parametrize(
    "response, field, error, token",
    [
        ([5, None, 7], "response_ids", ReplayTypeError, 1),  # numpy: TypeError
        ([5, 6, 2**70], "response_ids", ReplayDataError, 2),  # numpy: OverflowError
        (["a", 6, 7], "response_ids", ReplayTypeError, 0),  # numpy: ValueError
        ([5, 6.0, 7], "response_ids", ReplayTypeError, 1),  # numpy: 6 (a float is not an id)
        ([5, -3, 7], "response_ids", ReplayDataError, 1),
    ],
)
def test_response_ids_that_are_not_token_ids_are_refused_typed(response, field, error, token):
    """Before: numpy's TypeError / OverflowError / ValueError escaped untyped, or a float was read
    as an id; now each is the plugin's error naming the field and the position."""
    with pytest.raises(error) as info:
        T.align(response, [1, 1, 1], [T.turn([5, 6, 7], _rows([5, 6, 7]))], width=3, trajectory=2)
    assert info.value.field == field and info.value.token == token and info.value.trajectory == 2


@pytest.mark.parametrize(
    "ids, rows, error, match",
    [
        ([5, None], _rows([5, 6]), ReplayTypeError, "token id None at position 1"),
        ([5, 2**70], None, ReplayDataError, "position 1"),
        ([5, 6], [[5, 105], [6]], ReplayDataError, "not one array"),  # ragged rows
        ([5, 6], np.array([[5, 2**32 + 5], [6, -1]], np.int64), ReplayDataError, "would wrap"),  # int32 -> 5
        ([5, 6], np.array([[5, 4294967295], [6, 1]], np.uint32), ReplayDataError, "would wrap"),  # int32 -> -1
        ([5, 6], np.array([[5, -2], [6, 1]], np.int32), ReplayDataError, "generated token 0"),
    ],
)
def test_a_turn_with_bad_ids_or_rows_is_refused_typed(ids, rows, error, match):
    with pytest.raises(error, match=match):
        T.turn(ids, rows)


def test_a_mask_entry_that_is_not_0_or_1_is_refused():
    turn = T.turn([5, 6], _rows([5, 6]))
    with pytest.raises(ReplayDataError, match="entry 0.5 at position 1") as info:
        T.align([5, 6], [1, 0.5], [turn], width=3)  # numpy's int64 cast read 0.5 as 0: a context token
    assert info.value.field == "response_mask" and info.value.token == 1
    assert (T.align([5, 6], [True, 1.0], [turn], width=3) == _rows([5, 6])).all()  # bool and 1.0 are 1


# --------------------------------------------------------------------------- the server's rows_of (same ids)


def _served(ids, sampled, exact=None):
    from types import SimpleNamespace

    from replay_plugin.core.support import SupportRows

    n = len(sampled)
    rows = SupportRows(
        ids=np.asarray(ids, np.int32),
        sampled=np.asarray(sampled, np.int32),
        sampled_logprob=np.full(n, -0.5, np.float32),
        exact=np.asarray([True] * n if exact is None else exact),
    )
    return SimpleNamespace(outputs=[SimpleNamespace(sample_support=rows)])


def test_rows_of_checks_the_token_ids_verl_returns_before_reading_them():
    """``rollout_server.rows_of`` (verl's server, ``verl.rollout_support_server``): float ids were
    read as ints (7.9 as 7, and the row of 7 handed on for it), an id beyond int64 raised numpy's
    OverflowError; a missing capture named the vLLM attribute ``sample_support``, not verl's field."""
    from replay_plugin.verl.rollout_server import rows_of
    from replay_plugin.vllm.client import ReplayDataMissing

    served = _served([[5, 6], [7, 8]], [5, 7])
    assert rows_of(served, [5, 7]).tolist() == [[5, 6], [7, 8]]
    with pytest.raises(ReplayTypeError, match="7.9 at position 1") as info:
        rows_of(served, [5, 7.9])
    assert info.value.field == "rollout_sample_support" and info.value.token == 1
    with pytest.raises(ReplayTypeError, match="5.0 at position 0"):  # an integral float is no id either
        rows_of(served, [5.0, 7.9])
    with pytest.raises(ReplayDataError, match="position 1"):
        rows_of(served, [5, 2**70])
    bare = _served([[5, 6]], [5])
    del bare.outputs[0].sample_support
    with pytest.raises(ReplayDataMissing, match="no support rows") as missing:
        rows_of(bare, [5])
    assert missing.value.field == "rollout_sample_support"
    assert "'sample_support'" not in str(missing.value)
    with pytest.raises(ReplayDataError, match="not the sampler's exact support") as inexact:
        rows_of(_served([[5, 6], [7, 8]], [5, 7], exact=[True, False]), [5, 7])
    assert inexact.value.token == 1 and "replay_sample_support_slack" in str(inexact.value)
