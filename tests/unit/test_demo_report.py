"""The demo's figures come from ``replay_plugin.metrics`` (one code path) and equal what the demo
computed before it did (the recorded runs in docs/demo/ were made that way): its table's columns
from ``report.measure``, and the Megatron trainer's expert ids read from routing maps."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from replay_plugin.core.layout import TokenMetadataLayout
from replay_plugin.demo import report
from replay_plugin.demo.score import _trainer_routes
from replay_plugin.metrics import LOGPROB_KEYS, ROUTE_KEY


def old_figures(trainer, rollout, route_match):
    """The demo's figures before replay_plugin.metrics (flattened scored tokens, float64)."""
    r = trainer.astype(np.float64) - rollout.astype(np.float64)
    ratio = np.exp(r)
    return {
        "mean_abs_delta": float(np.mean(np.abs(r))),
        "max_abs_delta": float(np.max(np.abs(r))),
        "k3_kl": float(np.mean(ratio - 1.0 - r)),
        "mean_ratio": float(np.mean(ratio)),
        "frac_ratio_outside": float(np.mean((ratio < 0.9) | (ratio > 1.1))),
        "route_agreement": None if route_match is None else float(np.mean(route_match)),
    }


def scored_batch(seed=0, B=5, T=30, L=3, K=4, E=16):
    rng = np.random.default_rng(seed)
    rollout = -rng.random((B, T)).astype(np.float32) * 3
    trainer = (rollout + 0.15 * rng.standard_normal((B, T))).astype(np.float32)
    lengths = rng.integers(1, T + 1, B)
    mask = np.arange(T)[None, :] >= T - lengths[:, None]  # left-padded, as the demo's grid
    engine = np.argsort(rng.random((B, T, L, E)), axis=-1)[..., :K].astype(np.uint8)
    own = engine[..., ::-1].astype(np.int64).copy()
    moved = rng.random((B, T, L)) < 0.1
    own[..., 0] = np.where(moved, -1, own[..., 0])
    route_mask = rng.random((B, T)) > 0.05
    return report.Scored(trainer, rollout, mask, own, engine, route_mask, list(range(L)))


def test_the_table_columns_come_from_the_metrics_and_equal_the_old_figures():
    s = scored_batch()
    metrics = report.measure(s)
    assert list(metrics) == [*LOGPROB_KEYS, ROUTE_KEY] + [f"rollout_corr/route_agreement_layer_{i}" for i in range(3)]
    sets_equal = (np.sort(s.trainer_routes, -1) == np.sort(s.rollout_routes, -1)).all(-1).all(-1)
    valid = s.mask & s.route_mask
    want = old_figures(s.logprobs[s.mask], s.rollout[s.mask], None)
    want["route_agreement"] = float(np.mean(sets_equal[valid]))
    got = report.figures(metrics)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert 0 < got["route_agreement"] < 1 and 0 < got["frac_ratio_outside"] < 1
    np.testing.assert_array_equal(s.log_ratios(), s.logprobs[s.mask].astype(np.float64) - s.rollout[s.mask])


def test_without_routes_the_route_column_is_empty():
    s = scored_batch()
    s.trainer_routes = s.rollout_routes = s.route_mask = s.route_layers = None
    assert report.figures(report.measure(s))["route_agreement"] is None


def test_metrics_table_and_json(tmp_path):
    s = scored_batch()
    metrics = report.measure(s)
    metrics["training/rollout_probs_diff_std"] = math.nan
    metric_rows = [{"precision": "float32", "replay": r, **metrics} for r in ("none", "both")]
    text = report.metrics_table(metric_rows)
    assert "float32/none" in text.splitlines()[0] and "is_threshold=(0.9, 1.1)" in text
    assert all(any(line.startswith(k + " ") for line in text.splitlines()) for k in metrics)
    rows = [{"precision": "float32", "replay": r, **report.figures(metrics)} for r in ("none", "both")]
    path = tmp_path / "demo.json"
    report.write_json(str(path), rows, {"seed": 0}, metric_rows)
    doc = json.loads(path.read_text())  # strict JSON: NaN written as null
    assert [set(r) for r in doc["rows"]] == [set(report.COLUMNS)] * 2
    assert doc["metrics"][0]["training/rollout_probs_diff_std"] is None
    assert doc["metrics"][1]["rollout_corr/kl"] == metrics["rollout_corr/kl"]


def test_megatron_routing_maps_give_the_old_route_agreement():
    """``score._trainer_routes`` (expert ids from each router's ``[tokens, experts]`` routing map,
    sequence-major) compared as sets equals the old in-place comparison of the maps
    (``(used == want).all(-1) & (used.sum(-1) == k)``)."""
    rng = np.random.default_rng(1)
    B, S, L, K, E = 3, 9, 2, 2, 6
    attention = np.zeros((B, S), dtype=bool)
    for b, n in enumerate((9, 6, 4)):
        attention[b, S - n :] = True
    layout = TokenMetadataLayout.build(torch.from_numpy(attention), packed=False, align=1)
    A = layout.output_shape[1]
    routes = np.argsort(rng.random((B, S, L, E)), axis=-1)[..., :K].astype(np.uint8)
    maps, want = {}, torch.ones(B, A, dtype=torch.bool)
    for layer in range(L):
        recorded = layout.align(torch.from_numpy(routes[:, :, layer].astype(np.int64)), 0)  # [B, A, K]
        wanted = torch.zeros(B, A, E, dtype=torch.bool).scatter_(-1, recorded, True)
        used = wanted.clone()
        flip = torch.from_numpy(rng.random((B, A)) < 0.3)
        used[flip] = torch.from_numpy(np.argsort(rng.random((int(flip.sum()), E)), axis=-1) < K)
        maps[layer + 1] = used.transpose(0, 1).reshape(A * B, E)  # sequence-major, as the router's
        want &= (used == wanted).all(-1) & (used.sum(-1) == K)
    old = layout.restore(want.float(), 0.0).numpy() > 0.5  # [B, S - 1]
    trainer = _trainer_routes(maps, [1, 2], K, layout, (B, A))
    assert trainer.shape == (B, S - 1, L, K)
    new = (np.sort(trainer, -1) == np.sort(routes[:, :-1].astype(np.int64), -1)).all(-1).all(-1)
    scored = attention[:, :-1] & attention[:, 1:]  # positions whose token and next token exist
    np.testing.assert_array_equal(new[scored], old[scored])
    assert 0 < old[scored].mean() < 1


def test_a_router_map_without_k_experts_never_matches():
    """A token the router sent to one expert where top-2 was recorded: the old comparison said
    no match; a top-2 of its map would fill in the other expert (2 experts in all) and match."""
    attention = torch.ones(1, 3, dtype=torch.bool)
    layout = TokenMetadataLayout.build(attention, packed=False, align=1)
    used = torch.tensor([[[True, False], [True, True], [True, True]]])  # [B, A, E]: token 0 has 1 expert
    maps = {1: used.transpose(0, 1).reshape(3, 2)}
    trainer = _trainer_routes(maps, [1], 2, layout, (1, 3))  # [1, 2, 1, 2]
    rollout = np.array([[[[0, 1]], [[1, 0]]]])
    same = (np.sort(trainer, -1) == np.sort(rollout, -1)).all(-1).all(-1)
    assert same.tolist() == [[False, True]]
