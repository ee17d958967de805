"""Compact routes, batch padding and pipeline-stage replay data."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from replay_plugin.core import routes
from replay_plugin.core.errors import ReplayDataError, ReplayTypeError, RouteSanityWarning
from replay_plugin.core.layout import TokenMetadataLayout


def _routes(tokens: int, layers: int = 3, topk: int = 2, high: int = 128, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, (tokens, layers, topk))


# ---------------------------------------------------------------------------------------
# compact


@pytest.mark.parametrize(
    "high, dtype",
    [(1, np.uint8), (256, np.uint8), (257, np.int16), (2**15, np.int16), (2**15 + 1, np.int32), (2**31, np.int32)],
)
def test_compact_picks_the_smallest_safe_dtype(high: int, dtype) -> None:
    a = _routes(5, high=high, seed=high)
    a[0, 0, 0] = high - 1  # the maximum decides
    out = routes.compact(a)
    assert out.dtype == dtype and out.flags.c_contiguous
    assert np.array_equal(out, a)


def test_compact_keeps_an_already_compact_array_and_accepts_tensors() -> None:
    a = _routes(4).astype(np.uint8)
    assert routes.compact(a) is a
    view = _routes(4).astype(np.uint8)[::2]
    assert routes.compact(view).flags.c_contiguous
    assert routes.compact(torch.from_numpy(_routes(4))).dtype == np.uint8
    assert routes.compact(np.zeros((0, 3, 2), np.int64)).dtype == np.uint8


@pytest.mark.parametrize(
    "bad, exc, token",
    [
        (_routes(3).tolist(), ReplayTypeError, None),
        (_routes(3).astype(float), ReplayTypeError, None),
        (_routes(3).astype(bool), ReplayTypeError, None),
        (_routes(3)[0], ReplayDataError, None),
        (np.where(np.arange(3)[:, None, None] == 2, -1, _routes(3)), ReplayDataError, 2),
        (np.where(np.arange(3)[:, None, None] == 1, 2**31, _routes(3)), ReplayDataError, 1),
    ],
)
def test_compact_rejects_with_a_named_token(bad, exc, token) -> None:
    with pytest.raises(exc) as info:
        routes.compact(bad, trajectory=4)
    assert info.value.field == "routed_experts"
    assert info.value.token == token
    assert info.value.trajectory == 4


# ---------------------------------------------------------------------------------------
# routes no router chose (the engine's capture was not written: vLLM #54730)


def _router_routes(tokens: int, layers: int, topk: int, experts: int = 8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.permutation(experts)[:topk] for _ in range(layers)]) for _ in range(tokens)]).astype(
        np.uint8
    )


def test_uncaptured_route_accepts_router_routes_and_dense_layers() -> None:
    r = _router_routes(6, 3, 2)
    assert routes.uncaptured_route(r) is None
    r[:, 0] = 0  # a dense layer: vLLM leaves its rows zero, beside the MoE layers' captured routes
    assert routes.uncaptured_route(r) is None
    assert routes.uncaptured_route(np.zeros((5, 2, 1), np.uint8)) is None  # top-1: nothing to see
    assert routes.uncaptured_route(np.zeros((0, 2, 2), np.uint8)) is None


def test_uncaptured_route_names_the_first_impossible_row() -> None:
    zero = routes.uncaptured_route(np.zeros((4, 2, 2), np.uint8))  # what vLLM returns uncaptured
    assert zero == routes.RouteGap(token=0, layer=0, row=(0, 0), all_zero=True)
    r = _router_routes(6, 3, 4)
    r[4, 2] = [5, 1, 5, 2]
    assert routes.uncaptured_route(r) == routes.RouteGap(token=4, layer=2, row=(5, 1, 5, 2), all_zero=False)
    r = _router_routes(6, 3, 2)
    r[3:, 1] = 0  # a MoE layer whose last tokens were not captured
    gap = routes.uncaptured_route(r)
    assert (gap.token, gap.layer, gap.row, gap.all_zero) == (3, 1, (0, 0), False)


# ---------------------------------------------------------------------------------------
# padding rows and batches


def test_padding_rows_are_distinct_dummy_experts() -> None:
    rows = routes.padding_rows(3, 2, 4, np.int16)
    assert rows.shape == (3, 2, 4) and rows.dtype == np.int16 and rows.flags.writeable
    assert (rows == np.arange(4)).all()
    with pytest.raises(ReplayDataError, match="fit"):
        routes.padding_rows(1, 1, 300, np.uint8)
    with pytest.raises(ReplayTypeError):
        routes.padding_rows(1, 1, 2, np.int64)
    with pytest.raises(ReplayDataError):
        routes.padding_rows(-1, 1, 2)


def test_pad_batch_left_padded() -> None:
    a = _routes(3).astype(np.uint8)
    b = _routes(1, high=300, seed=1).astype(np.int16)
    b[0, 0, 0] = 299
    attn = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    out, mask = routes.pad_batch([a, b], attn)
    assert out.dtype == np.int16 and out.shape == (2, 4, 3, 2)  # widest in the batch
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    assert mask.tolist() == [[True, False, False, False], [True, True, False, True]]
    assert np.array_equal(out[0, 1:], a) and np.array_equal(out[1, 2], b[0])
    pad = np.arange(2)
    assert (out[0, 0] == pad).all() and (out[1, [0, 1, 3]] == pad).all()


def test_pad_batch_non_contiguous_mask_and_trajectory_routes() -> None:
    attn = np.array([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=bool)
    a = _routes(3)
    full = routes.TrajectoryRoutes(
        routes=np.concatenate([_routes(2).astype(np.uint8), routes.padding_rows(1, 3, 2)]),
        router_padding_mask=np.array([False, False, True]),
    )
    out, mask = routes.pad_batch([a, full], attn)
    assert mask.tolist() == [[False, True, False, False, True], [False, False, True, True, True]]
    assert np.array_equal(out[0, [0, 2, 3]], a)
    assert np.array_equal(out[1, :3], full.routes)
    assert full.captured_rows == 2


@pytest.mark.parametrize(
    "arrays, attn, match, trajectory",
    [
        ([_routes(4), _routes(1)], [[0, 1, 1, 1], [0, 0, 1, 1]], "4 route rows for 3 valid tokens", 0),
        ([_routes(1), _routes(1, layers=2)], [[1, 1], [1, 1]], r"\[L, K\]", 1),
        ([_routes(1)], [[1, 1], [1, 1]], "1 trajectories", None),
        ([_routes(1), -_routes(1) - 1], [[1, 1], [1, 1]], "negative", 1),
        ([_routes(1), _routes(1)[0]], [[1, 1], [1, 1]], "shape", 1),
        ([], np.zeros((0, 3), dtype=bool), "empty batch", None),
        ([_routes(1)], [[1, 2]], "value 2", 0),
    ],
)
def test_pad_batch_errors_name_the_trajectory(arrays, attn, match, trajectory) -> None:
    with pytest.raises((ReplayDataError, ReplayTypeError), match=match) as info:
        routes.pad_batch(arrays, torch.tensor(attn))
    assert info.value.trajectory == trajectory


def test_pad_batch_rejects_lists_of_lists() -> None:
    with pytest.raises(ReplayTypeError):
        routes.pad_batch([_routes(1).tolist()], torch.ones(1, 2))
    with pytest.raises(ReplayTypeError):
        routes.pad_batch(_routes(1), torch.ones(1, 2))


# ---------------------------------------------------------------------------------------
# pipeline-stage replay data


def test_select_layers_keeps_the_compact_dtype() -> None:
    r = _routes(5, layers=4).astype(np.uint8)[None]
    assert routes.select_layers(r, [3, 1]).dtype == np.uint8
    assert np.array_equal(routes.select_layers(r, [3, 1]), r[:, :, [3, 1]])
    t = torch.from_numpy(r)
    assert torch.equal(routes.select_layers(t, torch.tensor([2])), t[:, :, [2]])


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32])
def test_replay_data_is_identical_for_every_compact_dtype(dtype) -> None:
    base = _routes(6, layers=4, topk=3)
    r = base.astype(dtype).reshape(2, 3, 4, 3)
    data = routes.local_replay_data(r, [2, 0])
    assert len(data) == 2
    for tensor, layer in zip(data, [2, 0]):
        assert tensor.dtype == torch.int32 and tensor.is_contiguous() and tensor.shape == (6, 3)
        assert tensor.tolist() == base[:, layer].tolist()
    split = routes.split_for_replay(routes.select_layers(r, [2, 0]))
    assert all(torch.equal(x, y) for x, y in zip(data, split))


def test_replay_data_from_a_read_only_array_without_warnings(recwarn) -> None:
    r = _routes(4).astype(np.uint8)
    r.flags.writeable = False
    data = routes.local_replay_data(r, [1])
    assert data[0].tolist() == r[:, 1].tolist()
    assert not [w for w in recwarn.list if "writable" in str(w.message)]


def test_layer_index_errors() -> None:
    r = _routes(2, layers=3)
    for bad, match in [
        ([3], "out of range"),
        ([-1], "out of range"),
        ([1, 1], "duplicates"),
        ([0.5], "ints"),
        ("01", "sequence"),
    ]:
        with pytest.raises((ReplayDataError, ReplayTypeError), match=match) as info:
            routes.local_replay_data(r, bad)
        assert info.value.field == "layer_indices"
    with pytest.raises(ReplayTypeError):
        routes.split_for_replay(r.astype(float))
    with pytest.raises(ReplayDataError):
        routes.select_layers(r[0], [0])


def test_batch_to_stage_replay_end_to_end() -> None:
    """pad_batch -> layout.align (routes with the padding row, mask with True) -> replay data.

    Mirrors SkyRL's PP example: routes over 3 layers, this stage owns layer 1, one trajectory
    of 2 captured rows in a row of 3 valid tokens.
    """
    trajectory = np.array([[[9, 9], [1, 2], [9, 9]], [[9, 9], [3, 4], [9, 9]]], dtype=np.uint8)
    batch, mask = routes.pad_batch([trajectory], torch.tensor([[0, 1, 1, 1]]))
    layout = TokenMetadataLayout.build(torch.tensor([[0, 1, 1, 1]]), packed=False, align=1)
    local = routes.select_layers(torch.from_numpy(batch), [1])
    aligned = layout.align(local, torch.arange(2, dtype=torch.uint8))
    assert aligned.dtype == torch.uint8 and aligned.shape == (1, 3, 1, 2)
    assert routes.split_for_replay(aligned)[0].tolist() == [[1, 2], [3, 4], [0, 1]]
    assert layout.align(mask, True).tolist() == [[False, False, True]]


def test_routes_imports_no_torch_and_core_no_framework() -> None:
    code = (
        "import sys, replay_plugin.core.routes, replay_plugin.core.trace, replay_plugin.core.wire\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "import replay_plugin.core.layout\n"
        "bad = [m for m in ('megatron', 'vllm', 'verl', 'skyrl') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _distinct_routes(b: int, s: int, layers: int, experts: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, experts, (b, s, layers), generator=g)
    return torch.stack([first, (first + 1) % experts], -1).to(torch.uint8)  # [B, S, L, 2], distinct


def test_route_sanity_passes_real_looking_routes_without_warning(recwarn) -> None:
    routes.check_route_sanity(_distinct_routes(2, 20, 3))
    routes.check_route_sanity(_distinct_routes(1, 40, 2)[0])  # [T, L, K]
    assert not [w for w in recwarn if issubclass(w.category, RouteSanityWarning)]


def test_an_all_zero_trajectory_is_refused_naming_it() -> None:
    r = _distinct_routes(3, 20, 3)
    r[2] = 0
    with pytest.raises(ReplayDataError, match="every recorded route of the trajectory is expert 0") as info:
        routes.check_route_sanity(r)
    assert (info.value.field, info.value.trajectory) == ("routes", 2)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[2] = False  # the trajectory's rows are placeholders: not checked
    routes.check_route_sanity(r, valid)
    valid[2, :4] = True  # some recorded rows, zero: refused
    with pytest.raises(ReplayDataError, match=r"\(4 tokens x 3 layers x top-2\)"):
        routes.check_route_sanity(r, valid)


def test_an_all_zero_top1_trajectory_is_reported() -> None:
    r = _distinct_routes(2, 20, 3)[..., :1]
    r[0] = 0
    with pytest.warns(RouteSanityWarning, match="trajectory 0: every recorded route"):
        routes.check_route_sanity(r)


def test_a_layer_constant_across_the_batch_is_reported_naming_the_layer() -> None:
    r = _distinct_routes(2, 9, 3)
    r[:, :, 1] = torch.tensor([5, 3], dtype=torch.uint8)  # the same experts, in either order
    r[1, 4, 1] = torch.tensor([3, 5], dtype=torch.uint8)
    with pytest.warns(RouteSanityWarning, match=r"layer 7 routes all 18 valid tokens of the batch to experts \[3, 5\]"):
        routes.check_route_sanity(r, layer_names=[6, 7, 8])
    r[0, 0, 1] = torch.tensor([0, 1], dtype=torch.uint8)  # one token differs: not constant
    routes.check_route_sanity(r)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, 0] = False  # ... unless it is a placeholder row
    with pytest.warns(RouteSanityWarning, match="layer 1 routes all 17 valid"):
        routes.check_route_sanity(r, valid)


def test_a_constant_layer_in_a_small_batch_is_not_reported(recwarn) -> None:
    r = _distinct_routes(1, routes.CONSTANT_LAYER_MIN_TOKENS - 1, 2)
    r[..., 0, :] = torch.tensor([1, 2], dtype=torch.uint8)
    routes.check_route_sanity(r)
    assert not [w for w in recwarn if issubclass(w.category, RouteSanityWarning)]


def test_route_sanity_synchronises_once_when_nothing_is_found(monkeypatch) -> None:
    calls = []
    real = torch.Tensor.__bool__

    def counting(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item() called"))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("tolist() called"))
    routes.check_route_sanity(_distinct_routes(4, 32, 4))
    assert len(calls) == 1
