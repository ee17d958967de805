"""The TRL pack's pure parts: the rollout's grids on TRL's padded layout and the HF recorder's
rows (no trl needed; torch for the recorder)."""

from __future__ import annotations

import numpy as np
import pytest

from replay_plugin.core.errors import ReplayDataError
from replay_plugin.core.support import SupportRows
from replay_plugin.trl import rollout
from replay_plugin.trl.switch import Ask


def _rows(tokens, width=3):
    t = len(tokens)
    ids = np.full((t, width), -1, dtype=np.int32)
    ids[:, 0] = tokens
    return SupportRows(
        ids=ids, sampled=np.asarray(tokens, np.int32), sampled_logprob=np.zeros(t, np.float32), exact=np.ones(t, bool)
    )


def test_routes_grid_left_pads_prompts_and_right_pads_completions():
    r = rollout.Rollout(Ask(support=True, routes=True))
    # completion 0: prompt 2 + completion 1; completion 1: prompt 1 + completion 2; L=1, K=2
    r0 = np.array([[[10, 11]], [[12, 13]], [[14, 15]]], dtype=np.uint8)
    r1 = np.array([[[20, 21]], [[22, 23]], [[24, 25]]], dtype=np.uint8)
    r.deliver([rollout.Completion(rows=_rows([5]), routes=r0), rollout.Completion(rows=_rows([6, 7]), routes=r1)])
    r.check([[5], [6, 7]], [[1, 2], [3]])
    routes, padding = rollout.routes_grid(r, 2, 3)
    assert routes.dtype == np.uint8 and routes.shape == (2, 5, 1, 2)
    assert padding.tolist() == [[False, False, False, True, True], [True, False, False, False, True]]
    assert routes[0, :, 0, 0].tolist() == [10, 12, 14, 0, 0]
    assert routes[1, :, 0, 0].tolist() == [0, 20, 22, 24, 0]
    np.testing.assert_array_equal(rollout.support_grid(r, 3)[:, :, 0], [[5, -1, -1], [6, 7, -1]])


def test_check_refuses_an_inexact_row_naming_the_completion_and_token():
    """A row flagged inexact (more ties at the k-th logit than the slack holds) would be trained on
    as if it were the sampler's support: refused where every backend's rows are checked."""
    inexact = _rows([5, 6, 7])
    inexact.exact[1] = False
    r = rollout.Rollout(Ask(support=True))
    r.deliver([rollout.Completion(rows=_rows([4])), rollout.Completion(rows=inexact)])
    with pytest.raises(ReplayDataError, match="completion 1: 1 of 3 rows are not the sampler's exact") as info:
        r.check([[4], [5, 6, 7]])
    assert (info.value.trajectory, info.value.token) == (1, 1)
    assert "replay_sample_support_slack" in str(info.value)


def test_check_refuses_routes_of_another_length_naming_the_completion():
    r = rollout.Rollout(Ask(routes=True))
    r.deliver([rollout.Completion(routes=np.zeros((2, 1, 2), np.uint8))])
    with pytest.raises(ReplayDataError, match="completion 0: routes of shape"):
        r.check([[5, 6]], [[1]])


def test_recorder_rows_exact_and_a_wide_support_refused():
    torch = pytest.importorskip("torch")
    from replay_plugin.trl.hf_rows import Recorder, rows_of

    rec = Recorder(width=3)
    inf = float("-inf")
    # step 0: 2 finite scores; step 1: 3 finite
    rec(None, torch.tensor([[0.0, 1.0, inf, inf, inf], [2.0, inf, inf, 1.0, inf]]))
    rec(None, torch.tensor([[0.0, 1.0, 2.0, inf, inf], [inf, inf, 0.0, 0.0, 0.0]]))
    rows = rows_of(rec, [[1, 2], [3]])  # completion 1 ended after one token
    assert rows[0].ids.tolist() == [[1, 0, -1], [2, 1, 0]]
    assert rows[0].exact.all() and len(rows[1]) == 1
    want = torch.log_softmax(torch.tensor([0.0, 1.0]), 0)[1].item()
    assert rows[0].sampled_logprob[0] == pytest.approx(want)

    wide = Recorder(width=2)
    wide(None, torch.tensor([[0.0, 1.0, 2.0, inf]]))
    with pytest.raises(ReplayDataError, match="more than the rows' width 2") as info:
        rows_of(wide, [[2]])
    assert (info.value.trajectory, info.value.token) == (0, 0)


def _trainer(**attrs):
    from types import SimpleNamespace

    args = SimpleNamespace(generation_kwargs={"extra_args": {"replay_sample_support": True}})
    base = dict(args=args, tools=None, environment_factories=None, rollout_func=None, use_vllm=False, top_k=8)
    base.update(attrs)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("attrs", "setting"),
    [
        (dict(tools=[print]), "tools"),
        (dict(environment_factories={None: object}), "tools"),
        (dict(rollout_func=print), "rollout_func"),
        (dict(use_transformers_continuous_batching=True), "use_transformers_continuous_batching"),
        (dict(_is_vlm=True), "processing_class"),
    ],
)
def test_guard_refuses_paths_the_plugin_does_not_serve(attrs, setting):
    """(TRL 1.16 itself refuses tools whose chat template cannot render tool calls before the
    guard runs, so the integration tests cannot build such a trainer with the tiny tokenizer.)"""
    from replay_plugin.core.errors import NotReplayable
    from replay_plugin.trl import guard

    with pytest.raises(NotReplayable) as info:
        guard.check(_trainer(**attrs))
    assert info.value.setting == setting


def test_guard_passes_a_job_without_the_switch():
    from types import SimpleNamespace

    from replay_plugin.trl import guard

    plain = _trainer(tools=[print], args=SimpleNamespace(generation_kwargs=None))
    assert not guard.check(plain).any


@pytest.mark.parametrize(
    ("override", "setting"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"top_k": 4}, "top_k"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ],
)
def test_guard_refuses_sampler_settings_overridden_in_generation_kwargs(override, setting):
    """TRL's backends give the sampler generation_kwargs' value, its trainer scores at GRPOConfig's
    temperature: support log-probs at another temperature than the draw, without a word."""
    from types import SimpleNamespace

    from replay_plugin.core.errors import NotReplayable
    from replay_plugin.trl import guard

    kwargs = {"extra_args": {"replay_sample_support": True}, **override}
    args = SimpleNamespace(generation_kwargs=kwargs, temperature=1.0, top_k=8, repetition_penalty=1.0)
    with pytest.raises(NotReplayable, match=f"set {setting} in GRPOConfig") as info:
        guard.check(_trainer(args=args))
    assert info.value.setting == setting
