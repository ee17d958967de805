"""Issue 32: hostile inputs at the trainer-side core entries. Each case gave a silent number, an
untyped crash or a spurious warning on 452e6a8 (noted per test); here a typed error naming the
field (and where it applies the trajectory and token), or the right value."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from replay_plugin.core import inputs, routes
from replay_plugin.core.errors import ReplayDataError, ReplayTypeError, RouteSanityWarning
from replay_plugin.core.logprobs import (
    full_vocab_logprobs,
    full_vocab_logprobs_fixed_capacity,
    replay_logprobs,
    support_logprobs,
    support_logprobs_from_hidden,
)
from replay_plugin.core.support import SupportRows, dense_support_batch

V = 300


def _logits(n: int = 2, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- item 1: unsigned support ids


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_support_ids_are_refused_everywhere(dtype):
    """A -1 pad written into uint8 is 255, a member when V > 255: [3, 255] scored -1.2034 on
    452e6a8 where [3, -1] scores 0 (and [3, 255, 255] was 'id 255 appears more than once')."""
    logits = _logits(1)
    sampled = torch.tensor([3])
    want, _ = support_logprobs(logits, sampled, torch.tensor([[3, -1]], dtype=torch.int32))
    assert float(want[0]) == 0.0
    sup = torch.tensor([[3, -1]], dtype=torch.int32).to(dtype)  # what a user's cast does to -1
    calls = {
        "support_logprobs": lambda: support_logprobs(logits, sampled, sup),
        "from_hidden": lambda: support_logprobs_from_hidden(torch.randn(1, 4), torch.randn(V, 4), sampled, sup),
        "replay_logprobs": lambda: replay_logprobs(logits, sampled, sup, torch.tensor([True]), torch.tensor([0]), 1),
    }
    for name, call in calls.items():
        with pytest.raises(ReplayTypeError, match="cannot hold the padding id -1") as err:
            call()
        assert err.value.field == "support_ids", name


def test_unsigned_support_rows_are_refused_by_the_batch_builders():
    with pytest.raises(ReplayTypeError) as err:
        dense_support_batch([np.array([[3, 255]], dtype=np.uint8)], [np.array([3])], [np.array([True])], 2, None)
    assert (err.value.field, err.value.trajectory) == ("support", 0)
    for field in ("ids", "sampled"):
        kwargs = {
            "ids": np.array([[3, -1]], dtype=np.int32),
            "sampled": np.array([3], dtype=np.int32),
            "sampled_logprob": np.zeros(1, np.float32),
            "exact": np.ones(1, bool),
        }
        kwargs[field] = kwargs[field].astype(np.uint8)
        with pytest.raises(ReplayTypeError) as err:
            SupportRows(**kwargs)
        assert err.value.field == field


# --------------------------------------------------------------------------- item 2: NaN logprobs


def test_non_finite_logprobs_are_refused_by_every_entry():
    """On 452e6a8: support_logprobs returned NaN with valid=True for NaN logits and for a row
    whose members' logits are all -inf; replay_logprobs returned NaN for the synthetic-EOS row on
    NaN logits (logits and hidden paths). FSDP already refused: one rule now."""
    nan = torch.full((2, 5), float("nan"))
    sampled = torch.tensor([1, 2])
    sup = torch.tensor([[1, 2], [2, -1]], dtype=torch.int32)
    neg = torch.zeros(1, 5)
    neg[0, 1:3] = float("-inf")
    no_support = torch.full((2, 2), -1, dtype=torch.int32)
    loss = torch.tensor([True, False])
    traj = torch.tensor([0, 0])
    cases = {
        "support nan": lambda: support_logprobs(nan, sampled, sup),
        "support -inf members": lambda: support_logprobs(neg, torch.tensor([1]), sup[:1]),
        "hidden nan": lambda: support_logprobs_from_hidden(
            torch.full((2, 4), float("nan")), torch.randn(5, 4), sampled, sup
        ),
        "eos nan logits": lambda: replay_logprobs(nan, sampled, no_support, loss, traj, 1),
        "eos nan hidden": lambda: replay_logprobs(
            torch.full((2, 4), float("nan")), sampled, no_support, loss, traj, 1, lm_head_weight=torch.randn(5, 4)
        ),
    }
    for name, call in cases.items():
        with pytest.raises(ReplayDataError, match="not finite") as err:
            call()
        assert (err.value.field, err.value.token) == ("logits", 0), name


def test_nan_outside_the_scored_rows_is_not_read():
    logits = _logits(3, 5)
    logits[2] = float("nan")  # a row without support and without loss: never scored
    sup = torch.tensor([[1, 2], [2, -1], [-1, -1]], dtype=torch.int32)
    out = replay_logprobs(
        logits, torch.tensor([1, 2, 3]), sup, torch.tensor([True, True, False]), torch.zeros(3, dtype=torch.long), 1
    )
    assert torch.isfinite(out.logprobs).all() and out.valid.tolist() == [True, True, False]


# --------------------------------------------------------------------------- items 8, 10: argument types


def test_support_width_0_numpy_inputs_and_device_mixes_are_typed():
    """On 452e6a8: RuntimeError (cannot reshape), AttributeError, RuntimeError (device)."""
    logits, sampled = _logits(2, 5), torch.tensor([1, 2])
    sup = torch.tensor([[1, -1], [2, -1]], dtype=torch.int32)
    cases = [
        (
            lambda: support_logprobs(logits, sampled, torch.zeros(2, 0, dtype=torch.int32)),
            ReplayDataError,
            "support_ids",
        ),
        (lambda: support_logprobs(logits.numpy(), sampled, sup), ReplayTypeError, "logits"),
        (lambda: support_logprobs(logits, sampled.numpy(), sup), ReplayTypeError, "sampled_ids"),
        (lambda: support_logprobs(logits, sampled, sup.numpy()), ReplayTypeError, "support_ids"),
        (lambda: support_logprobs(logits.to("meta"), sampled, sup), ReplayDataError, "sampled_ids"),
        (lambda: support_logprobs(logits, sampled, sup.to("meta")), ReplayDataError, "support_ids"),
        (
            lambda: support_logprobs(logits, sampled, sup, loss_mask=torch.ones(2, dtype=torch.bool, device="meta")),
            ReplayDataError,
            "loss_mask",
        ),
        (
            lambda: support_logprobs_from_hidden(torch.randn(2, 4), torch.randn(5, 4).numpy(), sampled, sup),
            ReplayTypeError,
            "lm_head_weight",
        ),
        (
            lambda: support_logprobs_from_hidden(torch.randn(2, 4), torch.randn(5, 4, device="meta"), sampled, sup),
            ReplayDataError,
            "lm_head_weight",
        ),
        (
            lambda: replay_logprobs(
                logits,
                sampled,
                torch.zeros(2, 0, dtype=torch.int32),
                torch.ones(2, dtype=torch.bool),
                torch.zeros(2, dtype=torch.long),
                1,
            ),
            ReplayDataError,
            "support_ids",
        ),
        (lambda: full_vocab_logprobs(logits.numpy(), sampled), ReplayTypeError, "logits"),
    ]
    for i, (call, error, field) in enumerate(cases):
        with pytest.raises(error) as err:
            call()
        assert err.value.field == field, (i, err.value)


@pytest.mark.parametrize(
    ("temperature", "error"),
    [
        (0, ReplayDataError),
        (-1.0, ReplayDataError),
        (float("inf"), ReplayDataError),
        (np.float32(0.0), ReplayDataError),
        (True, ReplayTypeError),
        ("1.0", ReplayTypeError),
        (None, ReplayTypeError),
    ],
)
def test_temperature_errors_are_typed_and_numpy_scalars_are_numbers(temperature, error):
    """On 452e6a8 plain ValueError with a numpy repr ('got np.float32(0.0)'), and a valid
    np.float32(1.0) was refused."""
    logits, sampled = _logits(2, 5), torch.tensor([1, 2])
    sup = torch.tensor([[1, 3], [2, -1]], dtype=torch.int32)
    with pytest.raises(error) as err:
        support_logprobs(logits, sampled, sup, temperature=temperature)
    assert err.value.field == "temperature" and "np.float" not in str(err.value)
    ok, _ = support_logprobs(logits, sampled, sup, temperature=np.float32(0.7))
    torch.testing.assert_close(ok, support_logprobs(logits, sampled, sup, temperature=0.7)[0])


def test_replay_logprobs_checks_its_arguments_as_support_logprobs_does():
    """On 452e6a8 a float loss mask of 0.5, an int mask of 2, float trajectory ids and
    num_trajectories=1.7 (silently 1) were accepted; vocab_start=-3 was read as a shard start."""
    logits, sampled = _logits(2, 5), torch.tensor([1, 2])
    sup = torch.tensor([[1, -1], [2, -1]], dtype=torch.int32)
    traj, loss = torch.tensor([0, 0]), torch.tensor([True, True])
    cases = [
        ({"loss_mask": torch.tensor([0.5, 1.0])}, ReplayDataError, "loss_mask", "fractional"),
        ({"loss_mask": torch.tensor([1, 2])}, ReplayDataError, "loss_mask", "holds 2"),
        ({"trajectory_ids": torch.tensor([0.0, 0.0])}, ReplayTypeError, "trajectory_ids", "integer"),
        ({"num_trajectories": 1.7}, ReplayTypeError, "num_trajectories", "1.7"),
        ({"num_trajectories": True}, ReplayTypeError, "num_trajectories", "int"),
        ({"num_trajectories": -1}, ReplayDataError, "num_trajectories", ">= 0"),
        ({"vocab_start": -3}, ReplayDataError, "vocab_start", ">= 0"),
        ({"vocab_start": 2.0}, ReplayTypeError, "vocab_start", "int"),
    ]
    for kwargs, error, field, text in cases:
        args = {"loss_mask": loss, "trajectory_ids": traj, "num_trajectories": 1, **kwargs}
        with pytest.raises(error, match=text) as err:
            replay_logprobs(
                logits,
                sampled,
                sup,
                args.pop("loss_mask"),
                args.pop("trajectory_ids"),
                args.pop("num_trajectories"),
                **args,
            )
        assert err.value.field == field, kwargs
    # the mask error names the position, and 0/1 numbers are a mask
    with pytest.raises(ReplayDataError) as err:
        replay_logprobs(logits, sampled, sup, torch.tensor([1, 3]), traj, 1)
    assert (err.value.trajectory, err.value.token) == (0, 1)
    for ok in (torch.tensor([1, 1]), torch.tensor([1.0, 1.0])):
        torch.testing.assert_close(
            replay_logprobs(logits, sampled, sup, ok, traj, 1).logprobs,
            replay_logprobs(logits, sampled, sup, loss, traj, 1).logprobs,
        )
    with pytest.raises(ReplayTypeError) as err:
        full_vocab_logprobs_fixed_capacity(logits, sampled, torch.tensor([True, False]), torch.tensor([0.0, 0.0]), 1)
    assert err.value.field == "trajectory_ids"
    with pytest.raises(ReplayTypeError) as err:
        full_vocab_logprobs_fixed_capacity(logits, sampled, torch.tensor([True, False]), traj, 1.5)
    assert err.value.field == "capacity"


def test_the_one_mask_rule():
    for mask in (torch.tensor([True, False]), torch.tensor([1, 0]), torch.tensor([1.0, 0.0]), np.array([1, 0])):
        assert inputs.as_mask(mask, "m").tolist() == [True, False]
    for mask, text in (
        (torch.tensor([2, 0]), "holds 2"),
        (torch.tensor([0.5, 1.0]), "holds 0.5"),
        (torch.tensor([1.0, float("nan")]), "holds nan"),
    ):
        with pytest.raises(ReplayDataError, match=text) as err:
            inputs.as_mask(mask, "m")
        assert err.value.field == "m"
    with pytest.raises(ReplayTypeError):
        inputs.as_mask([1, 0], "m")


# --------------------------------------------------------------------------- item 3: placeholder trajectories


def _real_routes(b: int, s: int, layers: int, k: int, experts: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, s, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.uint8)


def test_a_trajectory_of_placeholder_routes_is_refused_among_real_ones():
    """On 452e6a8 only all-zero trajectories were caught: one whose every route is the
    placeholder [0..K-1] passed when the other trajectories are real."""
    r = _real_routes(3, 10, 4, 2, 8)
    r[1] = torch.tensor([0, 1], dtype=torch.uint8)
    with pytest.raises(ReplayDataError, match=r"placeholder \[0, 1\]") as err:
        routes.check_route_sanity(r)
    assert err.value.trajectory == 1
    # the same rows marked as padding are not looked at
    valid = torch.ones(3, 10, dtype=torch.bool)
    valid[1] = False
    routes.check_route_sanity(r, valid)
    # a short one (fewer than PLACEHOLDER_MIN_ROWS token-layer rows) is reported, not refused
    short = _real_routes(2, 3, 1, 2, 8)
    short[0] = torch.tensor([0, 1], dtype=torch.uint8)
    with pytest.warns(RouteSanityWarning, match="placeholder"):
        routes.check_route_sanity(short)


# --------------------------------------------------------------------------- item 4: pad_batch row counts


def test_pad_batch_refuses_fewer_rows_than_the_engine_returns():
    """On 452e6a8 0 rows for 10 valid tokens were accepted: the 10 tokens were then routed by
    the trainer's own router, silently."""
    attention = np.ones((2, 10), dtype=bool)
    full = _real_routes(1, 9, 3, 2, 8)[0].numpy()
    for rows in (0, 5, 8):
        with pytest.raises(ReplayDataError, match=f"{rows} route rows for 10 valid tokens") as err:
            routes.pad_batch([full, full[:rows]], attention)
        assert (err.value.field, err.value.trajectory) == ("routed_experts", 1)
    # P + T - 1 rows (vLLM) and P + T rows are the batch; a marked TrajectoryRoutes covers gaps
    for rows in (9,):
        out, mask = routes.pad_batch([full, full[:rows]], attention)
        assert mask[:, -1].all() and not mask[:, :-1].any()
    marked = routes.TrajectoryRoutes(
        np.concatenate([full[:8], routes.padding_rows(1, 3, 2)]), np.array([False] * 8 + [True])
    )
    _, mask = routes.pad_batch([full, marked], attention)
    assert mask[1, 8:].all() and not mask[1, :8].any()


# --------------------------------------------------------------------------- item 11: route sanity edges


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_route_sanity_takes_every_integer_dtype(dtype):
    r = _real_routes(2, 20, 3, 2, 8).to(dtype)
    routes.check_route_sanity(r)
    zeros = torch.zeros(1, 20, 3, 2, dtype=dtype)
    with pytest.raises(ReplayDataError, match="expert 0"):
        routes.check_route_sanity(zeros)
    assert routes.as_signed_routes(r).dtype == (torch.int32 if dtype == torch.uint16 else torch.int64)


def test_top_k_equal_to_the_number_of_experts_is_no_warning():
    """On 452e6a8 a top-k equal to the number of experts warned on every layer (fatal under the
    README's simplefilter("error") advice): every token necessarily has every expert."""
    g = torch.Generator().manual_seed(1)
    r = torch.rand(2, 20, 3, 4, generator=g).argsort(-1).to(torch.uint8)  # K = E = 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", RouteSanityWarning)
        routes.check_route_sanity(r, num_experts=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RouteSanityWarning)
        routes.check_route_sanity(r)  # without the expert count, the same routes look constant
    assert [str(w.message).split(" routes all")[0][-7:] for w in seen] == ["layer 0", "layer 1", "layer 2"]


@pytest.mark.parametrize("valid", [torch.ones(1, 20, dtype=torch.long), torch.ones(1, 20), np.ones((1, 20), bool)])
def test_route_sanity_refuses_a_non_bool_valid_mask(valid):
    """On 452e6a8 an int mask was inverted by ~ and legitimate routes were refused with 'every
    recorded route is expert 0'."""
    with pytest.raises(ReplayTypeError) as err:
        routes.check_route_sanity(_real_routes(1, 20, 2, 2, 8), valid)
    assert err.value.field == "valid"
