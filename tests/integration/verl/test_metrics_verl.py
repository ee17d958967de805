"""``replay_plugin.metrics.mismatch_metrics`` against verl 0.9.1's own functions on the same
tensors: ``rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` (token-level TIS,
``rollout_is="token"``) and ``verl.utils.debug.metrics.calculate_debug_metrics``, for every key
the two share (14), in float32 and float64, on batches with empty rows (issue 32 item 7: on
452e6a8 ``chi2_seq`` and ``log_ppl_*`` averaged over non-empty rows only, 1.5x verl's value with
2 of 6 rows empty), with verl's threshold spellings, and on bfloat16 inputs by the documented rule
(the plugin computes in float32: it equals verl on the inputs upcast)."""

from __future__ import annotations

import pytest
from support.upstream import need

#: The plugin's keys that are verl's (the other three, ratio_mean and log_ratio_abs_*, are the
#: plugin's own: test_the_shared_keys_are_the_14_verl_returns checks the split against verl).
PLUGIN_ONLY = ("rollout_corr/ratio_mean", "rollout_corr/log_ratio_abs_mean", "rollout_corr/log_ratio_abs_max")


def _shared() -> tuple[str, ...]:
    from replay_plugin.metrics import LOGPROB_KEYS

    return tuple(k for k in LOGPROB_KEYS if k not in PLUGIN_ONLY)


def _batch(seed: int, dtype, scale: float, empty_rows=(1, 4)):
    import torch

    g = torch.Generator().manual_seed(seed)
    B, T = 6, 24
    q = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    t = (q + scale * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    for b in empty_rows:
        lengths[b] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return t.to(dtype), q.to(dtype), mask


def _verl(t, q, mask, threshold=2.0) -> dict:
    import torch
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    from verl.utils.debug.metrics import calculate_debug_metrics

    *_, corr = compute_rollout_correction_and_rejection_mask(
        t, q, mask.long(), rollout_is="token", rollout_is_threshold=threshold
    )
    batch = {
        "rollout_log_probs": q,
        "old_log_probs": t,
        "response_mask": mask.long(),
        "responses": torch.zeros_like(mask, dtype=torch.long),
    }
    debug = calculate_debug_metrics(DataProto.from_dict(batch))
    return {k: float(v) for k, v in {**corr, **debug}.items()}


def test_the_shared_keys_are_the_14_verl_returns():
    need("verl")
    import torch

    t, q, mask = _batch(9, torch.float64, 0.3)
    verl_keys = set(_verl(t, q, mask))
    assert len(_shared()) == 14 and set(_shared()) <= verl_keys
    assert not set(PLUGIN_ONLY) & verl_keys


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize(("seed", "scale"), [(0, 0.3), (1, 1.0), (2, 0.02)])
def test_every_shared_key_carries_verls_value(dtype_name, seed, scale):
    need("verl")
    import torch

    from replay_plugin.metrics import mismatch_metrics

    dtype = getattr(torch, dtype_name)
    t, q, mask = _batch(seed, dtype, scale)
    ours = {k: float(v) for k, v in mismatch_metrics(t, q, mask).items()}
    want = _verl(t, q, mask)
    # float32: verl's exp(r) - 1 - r and exp(2 s) - 1 lose digits to cancellation that the
    # plugin's forms keep (core.metrics docstring); float64 agrees to verl's masked_mean epsilon
    # (1e-8 added to every denominator: ~1e-8 relative on these batches)
    rel = 2e-4 if dtype == torch.float32 else 1e-7
    for key in _shared():
        assert ours[key] == pytest.approx(want[key], rel=rel, abs=1e-6 if dtype == torch.float32 else 1e-12), key


def test_empty_rows_count_as_verl_counts_them():
    """With 2 of 6 rows empty, the sequence keys carry verl's mean over all rows (452e6a8: over
    the 4 non-empty ones, 1.5x)."""
    need("verl")
    import torch

    from replay_plugin.metrics import mismatch_metrics

    t, q, mask = _batch(3, torch.float64, 0.5)
    full_t, full_q, full_mask = t[[0, 2, 3, 5]], q[[0, 2, 3, 5]], mask[[0, 2, 3, 5]]
    ours = mismatch_metrics(t, q, mask)
    without_empty = mismatch_metrics(full_t, full_q, full_mask)
    want = _verl(t, q, mask)
    for key in ("rollout_corr/chi2_seq", "rollout_corr/log_ppl_diff", "rollout_corr/log_ppl_abs_diff"):
        assert float(ours[key]) == pytest.approx(want[key], rel=1e-7), key
        assert float(without_empty[key]) == pytest.approx(1.5 * want[key], rel=1e-7), key


@pytest.mark.parametrize(("ours_threshold", "verl_threshold"), [(3.0, 3.0), ("3.0", 3.0), ((1 / 3, 3.0), 3.0)])
def test_threshold_spellings_mean_what_they_mean_in_verl(ours_threshold, verl_threshold):
    need("verl")
    import torch

    from replay_plugin.metrics import mismatch_metrics

    t, q, mask = _batch(4, torch.float64, 1.2)
    ours = mismatch_metrics(t, q, mask, is_threshold=ours_threshold)
    want = _verl(t, q, mask, threshold=verl_threshold)
    for key in (
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_eff_sample_size",
        "rollout_corr/rollout_is_ratio_fraction_high",
        "rollout_corr/rollout_is_ratio_fraction_low",
    ):
        assert float(ours[key]) == pytest.approx(want[key], rel=1e-7), key
    assert 0 < want["rollout_corr/rollout_is_ratio_fraction_high"] < 1  # the band is exercised


def test_bfloat16_inputs_are_verls_figures_of_the_upcast_inputs():
    """The documented rule: the plugin computes in float32, verl in the input dtype. On bf16
    inputs the plugin's figures are verl's on ``.float()`` of the same tensors; verl's own bf16
    figures differ from them in most keys (counted, not asserted exactly: bf16 rounding)."""
    need("verl")
    import torch

    from replay_plugin.metrics import mismatch_metrics

    t, q, mask = _batch(5, torch.bfloat16, 0.3)
    ours = {k: float(v) for k, v in mismatch_metrics(t, q, mask).items()}
    upcast = _verl(t.float(), q.float(), mask)
    for key in _shared():
        assert ours[key] == pytest.approx(upcast[key], rel=2e-4, abs=1e-6), key
    in_bf16 = _verl(t, q, mask)
    differ = [k for k in _shared() if ours[k] != pytest.approx(in_bf16[k], rel=1e-3, abs=1e-6)]
    assert len(differ) >= 5, differ
