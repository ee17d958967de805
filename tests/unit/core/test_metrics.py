"""``replay_plugin.metrics.mismatch_metrics``: every value against an independent float64 numpy
computation, the edge cases (no scored token, equal logprobs, garbage outside the mask), no host
synchronisation, no autograd, the refusals, and the README block."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import readme_blocks  # tests/readme_blocks.py (tests/ is on sys.path: support/__init__.py)
import torch

from replay_plugin.core import metrics as core_metrics
from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.metrics import LOGPROB_KEYS, ROUTE_KEY, mismatch_metrics

# --------------------------------------------------------------------------- reference


def reference(t, q, mask, lo=0.5, hi=2.0, trainer_routes=None, rollout_routes=None, route_mask=None) -> dict:
    """The definitions of the core.metrics docstring, one sequence at a time, in float64 numpy.
    Sequence means run over every row, as verl's do: an empty row has sum 0 and mean 0."""
    t, q, mask = np.asarray(t, np.float64), np.asarray(q, np.float64), np.asarray(mask, bool)
    seqs = [(t[b][mask[b]], q[b][mask[b]]) for b in range(t.shape[0]) if mask[b].any()]
    rows = [(t[b][mask[b]], q[b][mask[b]]) for b in range(t.shape[0])]
    if not seqs:
        return {k: math.nan for k in LOGPROB_KEYS}

    def mean_or_0(x):
        return np.mean(x) if len(x) else 0.0

    tt = np.concatenate([a for a, _ in seqs])
    qq = np.concatenate([b for _, b in seqs])
    r = tt - qq
    w = np.exp(np.clip(r, -20.0, 20.0))
    c = np.minimum(w, hi)
    pt, pq = np.exp(tt), np.exp(qq)
    d = np.abs(pt - pq)
    out = {
        "rollout_corr/kl": np.mean(qq - tt),
        # float64 keeps ~4 digits of k3 at |r| ~ 1e-6 this way: enough for the tolerances here
        "rollout_corr/k3_kl": np.mean(np.exp(r) - 1.0 - r),
        "rollout_corr/chi2_token": np.mean(w**2) - 1.0,
        "rollout_corr/chi2_seq": np.mean([np.exp(2.0 * np.clip(np.sum(a - b), -20.0, 20.0)) for a, b in rows]) - 1.0,
        "rollout_corr/rollout_is_mean": np.mean(c),
        "rollout_corr/rollout_is_eff_sample_size": np.mean(c) ** 2 / np.mean(c**2),
        "rollout_corr/rollout_is_ratio_fraction_high": np.mean(w > hi),
        "rollout_corr/rollout_is_ratio_fraction_low": np.mean(w < lo),
        "rollout_corr/log_ppl_diff": np.mean([mean_or_0(b) - mean_or_0(a) for a, b in rows]),
        "rollout_corr/log_ppl_abs_diff": np.mean([abs(mean_or_0(b) - mean_or_0(a)) for a, b in rows]),
        "rollout_corr/ratio_mean": np.mean(w),
        "rollout_corr/log_ratio_abs_mean": np.mean(np.abs(r)),
        "rollout_corr/log_ratio_abs_max": np.max(np.abs(r)),
        "training/rollout_probs_diff_mean": np.mean(d),
        "training/rollout_probs_diff_max": np.max(d),
        "training/rollout_probs_diff_std": np.std(d, ddof=1) if d.size > 1 else math.nan,
        "training/rollout_actor_probs_pearson_corr": np.corrcoef(pt, pq)[0, 1],
    }
    if trainer_routes is not None:
        valid = mask if route_mask is None else mask & np.asarray(route_mask, bool)
        tr, rr = np.asarray(trainer_routes), np.asarray(rollout_routes)
        num_layers = tr.shape[2]
        same = np.zeros(tr.shape[:3], dtype=bool)
        for b, s, layer in itertools.product(*(range(n) for n in tr.shape[:3])):
            same[b, s, layer] = sorted(tr[b, s, layer].tolist()) == sorted(rr[b, s, layer].tolist())
        n = valid.sum()
        out[ROUTE_KEY] = same.all(-1)[valid].sum() / n if n else math.nan
        for layer in range(num_layers):
            out[f"rollout_corr/route_agreement_layer_{layer}"] = same[..., layer][valid].sum() / n if n else math.nan
    return {k: float(v) for k, v in out.items()}


def as_floats(metrics: dict) -> dict:
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())
    return {k: float(v) for k, v in metrics.items()}


def assert_matches(got: dict, want: dict, rtol: float, atol: float = 0.0) -> None:
    assert list(got) == list(want)
    for k in want:
        if math.isnan(want[k]):
            assert math.isnan(got[k]), (k, got[k])
        else:
            assert got[k] == pytest.approx(want[k], rel=rtol, abs=atol), (k, got[k], want[k])


def batch(seed: int, scale: float, B: int = 6, T: int = 40, dtype=torch.float32):
    """Ragged right-padded rows (one of them empty), padding holding -inf / NaN garbage."""
    g = torch.Generator().manual_seed(seed)
    q = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4.0  # rollout logprobs in (-4, 0]
    t = q + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    t = t.clamp(max=0.0)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]
    t, q = t.to(dtype), q.to(dtype)
    t = t.masked_fill(~mask, float("-inf"))
    q = q.masked_fill(~mask, float("nan"))
    return t, q, mask


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("scale", [0.3, 1e-3])
def test_every_value_matches_the_float64_reference(scale):
    """float32 inputs computed in float32: every key within float32 rounding of the float64
    reference; at ``|r| ~ 1e-3`` too (k3 and chi2 would lose most digits to cancellation if
    computed as ``exp(r) - 1``)."""
    t, q, mask = batch(0, scale)
    got = as_floats(mismatch_metrics(t, q, mask))
    assert list(got) == list(LOGPROB_KEYS)
    assert_matches(got, reference(t.double(), q.double(), mask), rtol=2e-4, atol=1e-7)
    assert all(v.dtype == torch.float32 for v in mismatch_metrics(t, q, mask).values())


def test_replay_sized_mismatch_keeps_its_digits_in_float32():
    """At ``|r| ~ 1e-6`` (a float32 trainer with both replays) k3 is ~5e-13: computed in float32 it
    keeps its digits, where the formula verl writes (``exp(r) - r - 1``) gives rounding error."""
    t, q, mask = batch(1, 1e-6)
    got = as_floats(mismatch_metrics(t, q, mask))
    want = reference(t.double(), q.double(), mask)
    assert 1e-14 < want["rollout_corr/k3_kl"] < 1e-11
    assert got["rollout_corr/k3_kl"] == pytest.approx(want["rollout_corr/k3_kl"], rel=1e-4)
    assert got["rollout_corr/chi2_token"] == pytest.approx(want["rollout_corr/chi2_token"], rel=1e-3)
    r = torch.where(mask, t - q, 0.0)
    naive = float((torch.exp(r) - r - 1.0).sum() / mask.sum())
    assert abs(naive - want["rollout_corr/k3_kl"]) > 0.1 * want["rollout_corr/k3_kl"]  # what it avoids


def test_float64_inputs_are_computed_in_float64():
    t, q, mask = batch(2, 0.5, dtype=torch.float64)
    out = mismatch_metrics(t, q, mask)
    assert all(v.dtype == torch.float64 for v in out.values())
    assert_matches(as_floats(out), reference(t, q, mask), rtol=1e-10, atol=1e-14)


def test_bfloat16_inputs_are_computed_in_float32():
    t, q, mask = batch(3, 0.2, dtype=torch.bfloat16)
    out = mismatch_metrics(t, q, mask)
    assert all(v.dtype == torch.float32 for v in out.values())
    assert_matches(as_floats(out), reference(t.double(), q.double(), mask), rtol=2e-4, atol=1e-7)


def test_threshold_band_and_ratio_above_the_safety_bound():
    t, q, mask = batch(4, 0.4)
    t[0, 0], q[0, 0] = 0.0, -30.0  # w = exp(30) clamped to exp(20)
    lo, hi = 0.8, 1.25
    got = as_floats(mismatch_metrics(t, q, mask, is_threshold=(lo, hi)))
    want = reference(t.double(), q.double(), mask, lo=lo, hi=hi)
    assert (
        want["rollout_corr/rollout_is_ratio_fraction_low"] > 0
        and want["rollout_corr/rollout_is_ratio_fraction_high"] > 0
    )
    assert_matches(got, want, rtol=2e-4, atol=1e-7)


def test_equal_logprobs_give_no_mismatch():
    t, _, mask = batch(5, 0.0)
    got = as_floats(mismatch_metrics(t, t.clone(), mask))
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff"):
        assert got[f"rollout_corr/{key}"] == 0.0, key
    for key in ("rollout_is_mean", "rollout_is_eff_sample_size", "ratio_mean"):
        assert got[f"rollout_corr/{key}"] == 1.0, key
    assert got["rollout_corr/rollout_is_ratio_fraction_high"] == got["rollout_corr/rollout_is_ratio_fraction_low"] == 0
    assert got["training/rollout_probs_diff_max"] == 0.0 and got["training/rollout_probs_diff_std"] == 0.0
    assert got["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0, abs=1e-6)


def test_no_scored_token_gives_nan_everywhere():
    t, q, mask = batch(6, 0.1)
    out = as_floats(
        mismatch_metrics(
            t,
            q,
            torch.zeros_like(mask),
            trainer_routes=torch.zeros(*t.shape, 2, 2, dtype=torch.int64),
            rollout_routes=torch.zeros(*t.shape, 2, 2, dtype=torch.int64),
        )
    )
    assert out and all(math.isnan(v) for v in out.values()), out
    empty = as_floats(mismatch_metrics(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool)))
    assert all(math.isnan(v) for v in empty.values())


def test_one_scored_token_std_is_nan_and_the_rest_defined():
    t, q = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    got = as_floats(mismatch_metrics(t, q, torch.tensor([[True, False]])))
    assert math.isnan(got["training/rollout_probs_diff_std"])
    assert math.isnan(got["training/rollout_actor_probs_pearson_corr"])  # one point: 0/0
    assert got["rollout_corr/kl"] == pytest.approx(-0.5)
    assert got["rollout_corr/ratio_mean"] == pytest.approx(math.exp(0.5))


def test_prefix_is_prepended_to_every_key():
    t, q, mask = batch(7, 0.1)
    out = mismatch_metrics(t, q, mask, prefix="actor/")
    assert list(out) == [f"actor/{k}" for k in LOGPROB_KEYS]


# --------------------------------------------------------------------------- routes


def routes_batch(seed: int, shape, num_layers=3, top_k=4, experts=16):
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    rollout = torch.argsort(torch.rand(B, T, num_layers, experts, generator=g), dim=-1)[..., :top_k]
    # the trainer: the same experts in another order, and a different expert set for ~20% of
    # (token, layer) pairs
    perm = torch.argsort(torch.rand(B, T, num_layers, top_k, generator=g), dim=-1)
    trainer = rollout.gather(-1, perm).clone()
    other = torch.rand(B, T, num_layers, generator=g) < 0.2
    swapped = (trainer[..., 0] + 1 + torch.randint(0, experts - 1, (B, T, num_layers), generator=g)) % experts
    trainer[..., 0] = torch.where(other & ~(rollout == swapped.unsqueeze(-1)).any(-1), swapped, trainer[..., 0])
    return trainer, rollout


@pytest.mark.parametrize(("trainer_dtype", "rollout_dtype"), [(torch.int64, torch.uint8), (torch.int16, torch.uint8)])
def test_route_agreement_per_layer_and_in_every_layer(trainer_dtype, rollout_dtype):
    t, q, mask = batch(8, 0.1)
    trainer, rollout = routes_batch(8, t.shape)
    route_mask = torch.rand(t.shape, generator=torch.Generator().manual_seed(9)) > 0.1
    got = as_floats(
        mismatch_metrics(
            t,
            q,
            mask,
            trainer_routes=trainer.to(trainer_dtype),
            rollout_routes=rollout.to(rollout_dtype),
            route_mask=route_mask,
        )
    )
    want = reference(
        t.double(), q.double(), mask, trainer_routes=trainer, rollout_routes=rollout, route_mask=route_mask
    )
    assert list(got)[len(LOGPROB_KEYS) :] == [ROUTE_KEY] + [f"rollout_corr/route_agreement_layer_{i}" for i in range(3)]
    assert 0.3 < want[ROUTE_KEY] < 0.8  # the batch has both outcomes
    assert_matches(got, want, rtol=1e-6, atol=1e-7)


def test_route_order_does_not_matter_and_labels_name_the_layers():
    t, q, mask = batch(10, 0.1)
    _, rollout = routes_batch(10, t.shape, num_layers=2, top_k=6, experts=300)  # int16 ids > 255
    shuffled = rollout.flip(-1)
    got = as_floats(
        mismatch_metrics(t, q, mask, trainer_routes=shuffled, rollout_routes=rollout, route_layers=[12, 13])
    )
    assert got[ROUTE_KEY] == 1.0
    assert got["rollout_corr/route_agreement_layer_12"] == got["rollout_corr/route_agreement_layer_13"] == 1.0
    one_off = shuffled.clone()
    one_off[0, 0, 1, 0] = 999  # first row is scored (lengths >= 1 except row 2)
    assert mask[0, 0]
    got = as_floats(mismatch_metrics(t, q, mask, trainer_routes=one_off, rollout_routes=rollout))
    n = int(mask.sum())
    assert got["rollout_corr/route_agreement_layer_0"] == 1.0
    assert got["rollout_corr/route_agreement_layer_1"] == pytest.approx((n - 1) / n)
    assert got[ROUTE_KEY] == pytest.approx((n - 1) / n)


def test_route_agreement_with_no_routed_token_is_nan():
    t, q, mask = batch(11, 0.1)
    trainer, rollout = routes_batch(11, t.shape)
    got = as_floats(
        mismatch_metrics(t, q, mask, trainer_routes=trainer, rollout_routes=rollout, route_mask=torch.zeros_like(mask))
    )
    assert math.isnan(got[ROUTE_KEY]) and not math.isnan(got["rollout_corr/kl"])


@pytest.mark.parametrize("n", range(1, 13))
def test_the_sorting_network_sorts_every_zero_one_input(n):
    """0-1 principle: a comparator network that sorts every 0/1 sequence sorts every sequence."""
    pairs = core_metrics._sorting_network(n)
    for bits in itertools.product((0, 1), repeat=n):
        v = list(bits)
        for i, j in pairs:
            v[i], v[j] = min(v[i], v[j]), max(v[i], v[j])
        assert v == sorted(bits), (n, bits)


# --------------------------------------------------------------------------- no sync, no grad


SYNCING = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@pytest.fixture
def no_host_sync(monkeypatch):
    """Every Tensor method that reads a value on the host (or needs a data-dependent shape)
    raises while the fixture is active."""

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"host synchronisation: Tensor.{name}")

        return call

    def patch():
        for name in SYNCING:
            monkeypatch.setattr(torch.Tensor, name, refuse(name))
        monkeypatch.setattr(torch, "nonzero", refuse("torch.nonzero"))
        monkeypatch.setattr(torch, "masked_select", refuse("torch.masked_select"))
        monkeypatch.setattr(torch.Tensor, "masked_select", refuse("masked_select"))

    return patch


def test_no_host_synchronisation(no_host_sync):
    t, q, mask = batch(12, 0.2)
    trainer, rollout = routes_batch(12, t.shape)
    t.requires_grad_()
    no_host_sync()
    with pytest.raises(AssertionError, match="host synchronisation"):  # the patch is in force
        bool(mask.any())
    out = mismatch_metrics(t, q, mask, trainer_routes=trainer, rollout_routes=rollout)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.values())
    assert not any(v.requires_grad for v in out.values())


def test_autograd_is_left_alone():
    t, q, mask = batch(13, 0.2)
    t.requires_grad_()
    out = mismatch_metrics(t, q, mask)
    assert not any(v.requires_grad or v.grad_fn is not None for v in out.values())
    assert t.grad is None


# --------------------------------------------------------------------------- refusals


def test_masks_follow_the_one_mask_rule():
    """The rule of every trainer-side entry (core.inputs): bool, or numbers that are all 0/1
    (read as bool: the same figures); 2, 0.5 and NaN refused naming the position (on 452e6a8
    integer masks were refused outright while the trainer entries read 0.5 and 2 as True)."""
    t, q, mask = batch(14, 0.1)
    want = as_floats(mismatch_metrics(t, q, mask))
    for ok in (mask.long(), mask.int(), mask.to(torch.uint8), mask.float(), mask.to(torch.bfloat16)):
        assert as_floats(mismatch_metrics(t, q, ok)) == pytest.approx(want, nan_ok=True)
    for value, text in ((2, "holds 2"), (0.5, "holds 0.5"), (float("nan"), "holds nan")):
        bad = mask.double()
        bad[3, 1] = value
        with pytest.raises(ReplayDataError, match=text) as err:
            mismatch_metrics(t, q, bad)
        assert (err.value.field, err.value.trajectory, err.value.token) == ("response_mask", 3, 1)
    trainer, rollout = routes_batch(14, t.shape)
    with pytest.raises(ReplayDataError) as err:
        mismatch_metrics(t, q, mask, trainer_routes=trainer, rollout_routes=rollout, route_mask=mask.long() * 2)
    assert err.value.field == "route_mask"
    with pytest.raises(ReplayTypeError) as err:
        mismatch_metrics(t, q, mask.to(torch.complex64))
    assert err.value.field == "response_mask"


def test_is_threshold_reads_verl_spellings_and_refuses_strings_and_bools():
    """verl's rollout_is_threshold forms (a number hi, "hi", "lo_hi") give the band they mean;
    on 452e6a8 the string "12" was iterated to (1.0, 2.0) and (True, 2) read as lo = 1.0."""
    t, q, mask = batch(15, 0.8)

    def band(th):
        got = mismatch_metrics(t, q, mask, is_threshold=th)
        return [float(got[f"rollout_corr/rollout_is_ratio_fraction_{s}"]) for s in ("low", "high")]

    assert band("0.5_2.0") == band((0.5, 2.0)) == band(2.0) == band("2.0") == band(2)
    assert band("12") == band((1 / 12, 12.0)) != band((1.0, 2.0))
    assert band(" 0.25_3 ") == band((0.25, 3.0))
    for bad, error in (
        ((True, 2), ReplayTypeError),
        ((0.5, False), ReplayTypeError),
        (True, ReplayTypeError),
        (("0.5", "2"), ReplayTypeError),
        ("abc", ReplayDataError),
        ("0.5_x", ReplayDataError),
        ("", ReplayDataError),
        ("3_2", ReplayDataError),
        ((0.5, 1.0, 2.0), ReplayDataError),
        (None, ReplayTypeError),
    ):
        with pytest.raises(error) as err:
            mismatch_metrics(t, q, mask, is_threshold=bad)
        assert err.value.field == "is_threshold", bad


def test_a_nan_on_a_scored_token_shows_in_every_key():
    """On 452e6a8 the fraction keys stayed finite (NaN > hi is False) while the others were NaN."""
    t, q, mask = batch(16, 0.3)
    for side in ("trainer", "rollout"):
        tt, qq = t.clone(), q.clone()
        (tt if side == "trainer" else qq)[0, 0] = float("nan")
        got = as_floats(mismatch_metrics(tt, qq, mask))
        assert all(math.isnan(v) for v in got.values()), (side, {k: v for k, v in got.items() if not math.isnan(v)})
    # outside the mask a NaN is never read
    tt = t.clone()
    tt[2, 5] = float("nan")  # row 2 is empty
    assert not any(math.isnan(v) for k, v in as_floats(mismatch_metrics(tt, q, mask)).items() if "std" not in k)


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"trainer_logprobs": "t"}, ReplayTypeError, "trainer_logprobs"),
        ({"trainer_logprobs": torch.zeros(6, 40, dtype=torch.int64)}, ReplayTypeError, "trainer_logprobs"),
        ({"trainer_logprobs": torch.zeros(240)}, ReplayDataError, "trainer_logprobs"),
        ({"rollout_logprobs": torch.zeros(6, 39)}, ReplayDataError, "rollout_logprobs"),
        ({"rollout_logprobs": torch.zeros(6, 40, device="meta")}, ReplayDataError, "rollout_logprobs"),
        ({"response_mask": torch.ones(6, 41, dtype=torch.bool)}, ReplayDataError, "response_mask"),
        ({"trainer_routes": torch.zeros(6, 40, 2, 2, dtype=torch.int64)}, ReplayDataError, "rollout_routes"),
        ({"rollout_routes": torch.zeros(6, 40, 2, 2, dtype=torch.int64)}, ReplayDataError, "trainer_routes"),
        (
            {"trainer_routes": torch.zeros(6, 40, 2, 2), "rollout_routes": torch.zeros(6, 40, 2, 2)},
            ReplayTypeError,
            "trainer_routes",
        ),
        (
            {
                "trainer_routes": torch.zeros(6, 40, 2, 2, dtype=torch.int64),
                "rollout_routes": torch.zeros(6, 40, 3, 2, dtype=torch.uint8),
            },
            ReplayDataError,
            "trainer_routes",
        ),
        (
            {
                "trainer_routes": torch.zeros(6, 40, 2, dtype=torch.int64),
                "rollout_routes": torch.zeros(6, 40, 2, dtype=torch.int64),
            },
            ReplayDataError,
            "trainer_routes",
        ),
        (
            {
                "trainer_routes": torch.zeros(6, 41, 2, 2, dtype=torch.int64),
                "rollout_routes": torch.zeros(6, 41, 2, 2, dtype=torch.int64),
            },
            ReplayDataError,
            "trainer_routes",
        ),
        (
            {
                "trainer_routes": torch.zeros(6, 40, 2, 2, dtype=torch.int64),
                "rollout_routes": torch.zeros(6, 40, 2, 2, dtype=torch.int64),
                "route_layers": [0, 0],
            },
            ReplayDataError,
            "route_layers",
        ),
        ({"route_mask": torch.ones(6, 40, dtype=torch.bool)}, ReplayDataError, "route_mask"),
        ({"is_threshold": (2.0, 0.5)}, ReplayDataError, "is_threshold"),
        ({"is_threshold": (0.0, 2.0)}, ReplayDataError, "is_threshold"),
        ({"is_threshold": -2.0}, ReplayDataError, "is_threshold"),
        ({"prefix": 3}, ReplayTypeError, "prefix"),
    ],
)
def test_bad_input_raises_a_typed_error_naming_the_field(kwargs, error, field):
    t, q, mask = batch(15, 0.1)
    args = {"trainer_logprobs": t, "rollout_logprobs": q, "response_mask": mask} | kwargs
    with pytest.raises(error) as err:
        mismatch_metrics(**args)
    assert err.value.field == field, str(err.value)


# --------------------------------------------------------------------------- README


def test_readme_block_mismatch_metrics():
    """The README's block as written, on a batch bound the way its comments describe."""
    t, q, mask = batch(16, 0.2)
    trainer, rollout = routes_batch(16, t.shape)
    ns = readme_blocks.run(
        "mismatch-metrics",
        {
            "log_probs": t.clone().requires_grad_(),
            "rollout_log_probs": q,
            "response_mask": mask.long(),  # the trainer's 0/1 mask; the block converts it
            "trainer_routes": trainer,
            "rollout_routes": rollout,
        },
    )
    want = reference(t.double(), q.double(), mask, trainer_routes=trainer, rollout_routes=rollout)
    assert_matches(ns["logged"], {f"actor/{k}": v for k, v in want.items()}, rtol=2e-4, atol=1e-7)


def test_same_expert_sets_is_order_free_per_layer_on_any_leading_shape():
    from replay_plugin.core.metrics import same_expert_sets

    rollout = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[1, 3], [2, 4]]], dtype=torch.uint8)  # [3, L=2, K=2]
    trainer = torch.tensor([[[2, 1], [3, 4]], [[5, 7], [0, 7]], [[1, 3], [2, 5]]], dtype=torch.int64)
    want = torch.tensor([[True, True], [False, True], [True, False]])
    assert torch.equal(same_expert_sets(trainer, rollout), want)
    assert torch.equal(same_expert_sets(trainer[None], rollout[None]), want[None])  # [1, 3, L]
